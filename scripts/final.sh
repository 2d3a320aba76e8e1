#!/usr/bin/env bash
# One GPU session's closing evidence, each step with its own time limit so
# the results archive is always written: GPU tests, verify, the side-by-side
# benchmarks of BENCH.md (defaults against the named alternatives), the
# PyTorch op's tests and timing. Everything lands in $OUT/results.tar.gz.
set -uo pipefail
OUT=${OUT:-/tmp/mixstack-out}; mkdir -p "$OUT"
if [ -f .device/bundle.tar.xz ] && [ ! -x .device/mixstack ]; then tar -C .device -xJf .device/bundle.tar.xz && mv .device/bin/* .device/; fi
export MIXSTACK_VECTORS="$PWD/vectors"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > "$OUT/gpu.txt"; date -u >> "$OUT/gpu.txt"
timeout 150 .device/gpu_stack --test-threads=1 --nocapture > "$OUT/gpu_stack.log" 2>&1; echo "gpu_stack rc=$? $(grep 'test result' "$OUT/gpu_stack.log")"
timeout 20 .device/mixstack verify > "$OUT/verify.log" 2>&1; echo "verify rc=$? $(tail -1 "$OUT/verify.log")"
k() { echo "ms_$1_f32_cf$2_$3"; }
bench() {  # PRESET ARGS...
  p=$1; shift
  echo "== bench $p"
  timeout 90 .device/mixstack bench --preset "$p" --reps 12 "$@" --json "$OUT/bench_$p.json" > "$OUT/bench_$p.log" 2>&1
  grep -vE "^    " "$OUT/bench_$p.log"
}
prev32="relay:bwd_gemm=$(k bwd_gemm 32 m256_n64_k16_t8x8_s3_b2_ps)"
bench seed --variant relay --variant "$prev32" --variant fused
bench f1 --variant relay --variant fused
bench cf64 --variant relay --variant fused
# The previous stop's build (.device/old, commit f741c62) against this one.
if [ -f .device/old/bundle.tar.xz ]; then
  ROUNDS=1 timeout 120 bash scripts/ab.sh --preset seed --variant relay --variant fused --reps 8; echo "ab rc=$?"
fi
MIXSTACK_TORCH_CACHE=$PWD/.device/torch-ext PYTHONPATH=$PWD/python python3 -m mixstack_torch._ext > /dev/null 2>&1; MIXSTACK_TORCH_CACHE=$PWD/.device/torch-ext MIXSTACK_LIB=$PWD/.device/libmixstack.so timeout 90 python3 python/tests/test_torch_op.py --bench --repeats 5 > "$OUT/torch_op.log" 2>&1; echo "torch rc=$?"; tail -12 "$OUT/torch_op.log"
cd "$OUT" && tar -czf /tmp/results.tar.gz ./* && rm -rf "$OUT"/* && mv /tmp/results.tar.gz "$OUT"/results.tar.gz
