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
timeout 90 .device/gpu_stack --test-threads=1 --nocapture > "$OUT/gpu_stack.log" 2>&1; echo "gpu_stack rc=$? $(grep 'test result' "$OUT/gpu_stack.log")"
timeout 20 .device/mixstack verify > "$OUT/verify.log" 2>&1; echo "verify rc=$? $(tail -1 "$OUT/verify.log")"
k() { echo "ms_$1_f32_cf$2_$3"; }
bench() {  # PRESET ARGS...
  p=$1; shift
  echo "== bench $p"
  timeout 60 .device/mixstack bench --preset "$p" --reps 12 "$@" --json "$OUT/bench_$p.json" > "$OUT/bench_$p.log" 2>&1
  grep -vE "^    " "$OUT/bench_$p.log"
}
old32="fwd_m0=$(k fwd_m0 32 m128_n64_k32_t8x4_s2_b1_pa),fwd_m1=$(k fwd_m1 32 m128_n64_k32_t8x4_s2_b1_pa),fwd_final=$(k fwd_final 32 m128_n64_k32_t8x4_s2_b1_pa)"
m1alt="fused:bwd_fused_m1=$(k bwd_fused_m1 32 m64_n64_k32_t4x4_s3_b2_ps)"
bench seed --variant relay --variant fused --variant "$m1alt" --forward-variant default --forward-variant "$old32"
bench f1 --variant relay --variant fused
old64="fwd_m0=$(k fwd_m0 64 m128_n64_k32_t8x4_s2_b1_pa),fwd_m1=$(k fwd_m1 64 m128_n64_k32_t8x4_s2_b1_pa),fwd_final=$(k fwd_final 64 m128_n64_k32_t8x4_s2_b1_pa)"
bench cf64 --variant relay --variant "relay:bwd_gemm=$(k bwd_gemm 64 m64_n64_k16_t4x4_s2_b1_pr),bwd_final=$(k bwd_final 64 m64_n64_k16_t4x4_s2_b1_pr)" \
  --variant fused \
  --forward-variant default --forward-variant "$old64"
MIXSTACK_LIB=$PWD/.device/libmixstack.so timeout 90 python3 python/tests/test_torch_op.py --bench --repeats 5 > "$OUT/torch_op.log" 2>&1; echo "torch rc=$?"; tail -12 "$OUT/torch_op.log"
cd "$OUT" && tar -czf /tmp/results.tar.gz ./* && rm -rf "$OUT"/* && mv /tmp/results.tar.gz "$OUT"/results.tar.gz
