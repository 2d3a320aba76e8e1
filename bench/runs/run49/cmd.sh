#!/usr/bin/env bash
# Run 49 (device): the relay's gate contractions against cuBLAS at every Cf
# (bench --cublas-gate), and the row tiles at Cf 96 and 128 side by side.
set -uo pipefail
OUT=${OUT:-/tmp/mixstack-out}; mkdir -p "$OUT"
tar -C .device -xJf .device/bundle.tar.xz && mv .device/bin/* .device/
lib=$(find / -name 'libcublas.so*' -not -path '*/proc/*' 2>/dev/null | head -1)
echo "cublas: $lib"; export LD_LIBRARY_PATH="$(dirname "$lib"):${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt"; date -u >> "$OUT/gpu.txt"
B=".device/mixstack bench --reps 10"
run() { local tag=$1; shift; echo "== $tag: $*"; timeout 120 $B "$@" --json "$OUT/$tag.json" > "$OUT/$tag.log" 2>&1; echo "rc=$?"; grep -vE "^    " "$OUT/$tag.log" | grep -vE "^(default|relay:)" ; }
run seed --preset seed --variant relay --cublas-gate
run cf64 --preset cf64 --variant relay --cublas-gate
for cf in 96 128; do
  W="--focus 2 --edges 646000 --cf $cf --lmax 3 --layers 3"
  V=""; for t in r32_t256_b1 r16_t128_b8 r32_t128_b8 r64_t256_b4; do
    V="$V --variant relay:bwd_pointwise=ms_bwd_pointwise_f32_cf${cf}_$t,bwd_recompute=ms_bwd_recompute_f32_cf${cf}_$t --forward-variant fwd_gate=ms_fwd_gate_f32_cf${cf}_$t"; done
  run cf$cf $W $V --cublas-gate
  grep -E "median|/ " "$OUT/cf$cf.log"
done
run cf128l6 --focus 2 --edges 323000 --cf 128 --lmax 6 --layers 3 --variant relay --cublas-gate
cd "$OUT" && tar -czf /tmp/r.tar.gz ./* && rm -rf "$OUT"/* && mv /tmp/r.tar.gz "$OUT/results.tar.gz"
