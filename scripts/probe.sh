#!/usr/bin/env bash
# A development probe on the GPU machine: GPU tests, verify, the seed tile
# sweep (forward and backward), and Nsight Compute on the default and the
# streaming bwd_gemm where the machine allows it. Results: $OUT/results.tar.gz.
set -uo pipefail
OUT=${OUT:-/tmp/mixstack-out}; mkdir -p "$OUT"
if [ -f .device/bundle.tar.xz ] && [ ! -x .device/mixstack ]; then tar -C .device -xJf .device/bundle.tar.xz && mv .device/bin/* .device/; fi
export MIXSTACK_VECTORS="$PWD/vectors"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > "$OUT/gpu.txt"; date -u >> "$OUT/gpu.txt"
timeout 60 .device/gpu_stack --test-threads=1 --nocapture > "$OUT/gpu_stack.log" 2>&1; echo "gpu_stack rc=$? $(grep 'test result' "$OUT/gpu_stack.log")"
grep -E "panicked|FAILED|failed" "$OUT/gpu_stack.log" | head -5
timeout 20 .device/mixstack verify > "$OUT/verify.log" 2>&1; echo "verify rc=$? $(tail -1 "$OUT/verify.log")"
REPS=${REPS:-5} timeout ${SWEEP_S:-150} bash scripts/sweep.sh ${PRESET:-seed} ${CF:-32}; echo "sweep rc=$?"
if [ -n "${NCU_K:-}" ] && command -v ncu >/dev/null; then
  timeout ${NCU_S:-90} ncu --clock-control none -k "regex:${NCU_K}" -c ${NCU_C:-2} --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
    .device/mixstack bench --preset seed --reps 1 ${NCU_ARGS:-} > "$OUT/ncu.log" 2>&1; echo "ncu rc=$?"; grep -E "^  [a-z_]|Throughput|Warp Cycles|Stall|Occupancy|Registers|Duration|Block Limit|Issued" "$OUT/ncu.log" | head -80
fi
cd "$OUT" && tar -czf /tmp/results.tar.gz ./* && rm -rf "$OUT"/* && mv /tmp/results.tar.gz "$OUT"/results.tar.gz
