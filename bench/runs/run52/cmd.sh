#!/usr/bin/env bash
# Run 52 (device): after the review's refactor (GateBlas shared by the
# runtime and bench --cublas-gate; the stack keeps Result<GateBlas, why>):
# the cuBLAS-path GPU test, and --cublas-gate at the seed and Cf 128 L 3.
set -uo pipefail
OUT=${OUT:-/tmp/mixstack-out}; mkdir -p "$OUT"
tar -C .device -xJf .device/bundle.tar.xz && mv .device/bin/* .device/
lib=$(find /usr/local -name 'libcublas.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH="$(dirname "$lib")"
export MIXSTACK_VECTORS="$PWD/vectors"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt"; date -u >> "$OUT/gpu.txt"
timeout 60 .device/gpu_stack gate_gemms_on_cublas_from_cf96 --nocapture > "$OUT/gpu_stack.log" 2>&1; echo "gate test rc=$?"; grep -E "ok gate|SKIPPED|test result|panicked" "$OUT/gpu_stack.log"
for w in "--preset seed" "--focus 2 --edges 323000 --cf 128 --lmax 3 --layers 3"; do
  timeout 45 .device/mixstack bench $w --reps 3 --variant relay --cublas-gate > "$OUT/b.log" 2>&1; echo "bench rc=$?"; grep -A2 "gate contractions" "$OUT/b.log"; cat "$OUT/b.log" >> "$OUT/bench.log"
done
