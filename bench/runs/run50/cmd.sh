#!/usr/bin/env bash
# Run 50 (device): GPU tests and verify (scripts/probe.sh), then at Cf 96 and
# 128 the gate GEMMs on cuBLAS (default) against the generated gate kernels
# (named as overrides), side by side, and bench --cublas-gate at Cf 96/128 L 3.
set -uo pipefail
OUT=${OUT:-/tmp/mixstack-out}
tar -C .device -xJf .device/bundle.tar.xz && mv .device/bin/* .device/
TESTS_S=150 bash scripts/probe.sh
grep -E "ok gate|SKIPPED cuBLAS" "$OUT"/gpu_stack.log 2>/dev/null | head; mkdir -p "$OUT"
lib=$(find /usr/local -name 'libcublas.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH="$(dirname "$lib")"
run() { local tag=$1; shift; echo "== $tag: $*"; timeout 150 .device/mixstack bench "$@" --json "$OUT/$tag.json" > "$OUT/$tag.log" 2>&1; echo "rc=$?"; grep -vE "^    " "$OUT/$tag.log"; grep -E "^    " "$OUT/$tag.log" | head -24; }
for w in "128 6 323000" "96 3 646000"; do set -- $w
  run cf$1l$2 --focus 2 --edges $3 --cf $1 --lmax $2 --layers 3 --reps 5 --variant relay --variant relay:bwd_recompute=ms_bwd_recompute_f32_cf$1_r32_t256_b1 --forward-variant default --forward-variant fwd_gate=ms_fwd_gate_f32_cf$1_r32_t256_b1
done
run gate_cf128l3 --focus 2 --edges 646000 --cf 128 --lmax 3 --layers 3 --reps 5 --variant relay --cublas-gate
