#!/usr/bin/env bash
# A development probe on the GPU machine: GPU tests, verify, then optionally
#   AB="BENCH-ARGS"  scripts/ab.sh: the staged build (B) against .device/old (A),
#                    for each preset of AB_PRESETS (default seed),
#   SWEEP=1          the seed tile sweep (scripts/sweep.sh),
#   NCU_K=REGEX      Nsight Compute on the matching kernels, with the warp
#                    stall breakdown per issued instruction,
#   TORCH=1          the PyTorch op's tests and timing (python/tests).
# Results: $OUT/results.tar.gz.
set -uo pipefail
OUT=${OUT:-/tmp/mixstack-out}; mkdir -p "$OUT"
if [ -f .device/bundle.tar.xz ] && [ ! -x .device/mixstack ]; then tar -C .device -xJf .device/bundle.tar.xz && mv .device/bin/* .device/; fi
export MIXSTACK_VECTORS="$PWD/vectors"
# cuBLAS (the gate GEMMs at Cf >= 96) is loaded at run time: put a CUDA
# install's libcublas on the path where the loader would not find it.
lib=$(find /usr/local -name 'libcublas.so*' 2>/dev/null | head -1)
[ -n "$lib" ] && export LD_LIBRARY_PATH="$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > "$OUT/gpu.txt"; date -u >> "$OUT/gpu.txt"
timeout ${TESTS_S:-90} .device/gpu_stack --test-threads=1 --nocapture > "$OUT/gpu_stack.log" 2>&1; echo "gpu_stack rc=$? $(grep 'test result' "$OUT/gpu_stack.log")"
grep -E "panicked|FAILED|failed" "$OUT/gpu_stack.log" | head -5
timeout 20 .device/mixstack verify > "$OUT/verify.log" 2>&1; echo "verify rc=$? $(tail -1 "$OUT/verify.log")"
if [ -n "${AB:-}" ]; then
  for p in ${AB_PRESETS:-seed}; do
    # shellcheck disable=SC2086
    ROUNDS=${ROUNDS:-2} timeout ${AB_S:-240} bash scripts/ab.sh --preset $p $AB; echo "ab $p rc=$?"
    mkdir -p "$OUT/ab_$p" && mv "$OUT"/ab_[AB]_* "$OUT/ab_$p/" 2>/dev/null
  done
fi
if [ "${SWEEP:-0}" = 1 ]; then
  REPS=${REPS:-5} timeout ${SWEEP_S:-150} bash scripts/sweep.sh ${PRESET:-seed} ${CF:-32}; echo "sweep rc=$?"
fi
if [ -n "${NCU_K:-}" ] && command -v ncu >/dev/null; then
  stalls=$(for s in barrier long_scoreboard short_scoreboard wait math_pipe_throttle mio_throttle lg_throttle not_selected selected dispatch_stall no_instruction branch_resolving; do
    printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' $s; done)
  timeout ${NCU_S:-120} ncu --clock-control none -k "regex:${NCU_K}" -c ${NCU_C:-4} --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
    --metrics "${stalls%,},smsp__inst_executed.sum,smsp__sass_thread_inst_executed_op_ffma_pred_on.sum,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active" \
    .device/mixstack bench --preset seed --reps 1 ${NCU_ARGS:-} > "$OUT/ncu.log" 2>&1; echo "ncu rc=$?"
  grep -E "^  [a-z_]|Throughput|Warp Cycles|stalled|Occupancy|Registers|Duration|Block Limit|inst_executed|ffma|pipe_fma" "$OUT/ncu.log" | grep -v "^ *-" | head -120
fi
if [ "${TORCH:-0}" = 1 ]; then
  MIXSTACK_TORCH_CACHE=$PWD/.device/torch-ext PYTHONPATH=$PWD/python python3 -m mixstack_torch._ext > /dev/null 2>&1; MIXSTACK_TORCH_CACHE=$PWD/.device/torch-ext MIXSTACK_LIB=$PWD/.device/libmixstack.so timeout 90 python3 python/tests/test_torch_op.py --bench --repeats 5 > "$OUT/torch_op.log" 2>&1; echo "torch rc=$?"; tail -12 "$OUT/torch_op.log"
fi
cd "$OUT" && tar -czf /tmp/results.tar.gz ./* && rm -rf "$OUT"/* && mv /tmp/results.tar.gz "$OUT"/results.tar.gz
