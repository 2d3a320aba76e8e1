#!/usr/bin/env bash
# The GPU test suite under compute-sanitizer's memcheck, racecheck, initcheck
# and synccheck, at small shapes (MIXSTACK_TEST_SMALL=1 skips the large-E
# tests and thins the fault sweep). racecheck runs with =race: every problem
# shrinks to F 1, E <= 70, lmax <= 2 (tests/gpu_stack.rs race_sized), every
# kernel instance still runs, and only the project's kernels (ms_...) are
# checked. Runs on the GPU machine over binaries staged by
# scripts/stage-device.sh (or GPU_TEST_BIN=path here). Logs and a summary
# line per tool under $OUT; exit status 1 if any tool reports an error.
#   scripts/sanitize.sh [TOOL...]      TESTS="filter" narrows the tests
# SAN_KERNELS=SUBSTR checks only the kernels whose name contains SUBSTR
# (compute-sanitizer --kernel-name kns=SUBSTR; the others run unchecked at
# full speed), e.g. SAN_KERNELS=ms_bwd_fused TESTS=fused for racecheck.
# PER_TEST_S=N runs each test alone under the tool, N seconds at most, and
# prints one line per test (ok or errors, with its seconds, or timed out):
# racecheck is slow (a GEMM launch at F 1, E 70 takes 0.15-0.45 s under it)
# and one slow test must not leave the others unchecked. JOBS=N runs N
# tests at once (the tools are bound by the host's cores, not the GPU); a
# test that timed out or reported anything makes the exit status 1.
set -uo pipefail
OUT=${OUT:-/tmp/mixstack-out}; mkdir -p "$OUT"
bin=${GPU_TEST_BIN:-.device/gpu_stack}
if [ -f .device/bundle.tar.xz ] && [ ! -x "$bin" ]; then tar -C .device -xJf .device/bundle.tar.xz && mv .device/bin/* .device/; fi
cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
export MIXSTACK_VECTORS="${MIXSTACK_VECTORS:-$PWD/vectors}"
status=0
filter=()
[ -n "${SAN_KERNELS:-}" ] && filter=(--kernel-name "kns=$SAN_KERNELS")
# racecheck checks the project's kernels (all named ms_...), not cuBLAS's on
# the Cf >= 96 gate path: instrumenting those took gate_gemms_on_cublas past
# 170 s alone (BENCH.md run 86).
race_filter=(--kernel-name "kns=${SAN_KERNELS:-ms_}")
tool_filter() {  # the kernel filter of a tool, as words
  if [ "$1" = racecheck ]; then echo "${race_filter[@]}"; else echo "${filter[@]+"${filter[@]}"}"; fi
}
one_test() {  # tool test: one test alone under the tool, one line
  local tool=$1 t=$2 rc t0
  t0=$(date +%s)
  # shellcheck disable=SC2046
  timeout "$PER_TEST_S" "$cs" --tool "$tool" $(tool_filter "$tool") --error-exitcode 99 --print-limit 20 "$bin" --test-threads=1 --exact "$t" \
    >"$OUT/sanitize_${tool}_$t.log" 2>&1
  rc=$?
  t0=$(( $(date +%s) - t0 ))
  # a test that makes no CUDA call at the sanitizer's size (the large-E and
  # many-tile tests skip there) passes, and the tool exits 255 finding nothing
  # to instrument
  if [ $rc = 255 ] && grep -q "terminated before first instrumented API call" "$OUT/sanitize_${tool}_$t.log" \
    && grep -q "^test result: ok" "$OUT/sanitize_${tool}_$t.log"; then
    echo "  $tool $t: no CUDA call at this size (skipped there), ok in $t0 s"
    return
  fi
  case $rc in
    0) echo "  $tool $t: ok in $t0 s, $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/sanitize_${tool}_$t.log" | tail -1)" ;;
    124) echo "  $tool $t: timed out after $PER_TEST_S s (not checked)" ;;
    *) echo "  $tool $t: exit $rc in $t0 s, $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|FAILED" "$OUT/sanitize_${tool}_$t.log" | tail -1)" ;;
  esac
}
per_test() {  # tool: each test alone, PER_TEST_S seconds at most, JOBS at once
  local tool=$1 t
  # shellcheck disable=SC2086
  for t in $("$bin" --list ${TESTS:-} 2>/dev/null | sed -n 's/: test$//p'); do
    while [ "$(jobs -rp | wc -l)" -ge "${JOBS:-1}" ]; do wait -n; done
    one_test "$tool" "$t" &
  done
  wait
}
for tool in ${*:-memcheck racecheck initcheck synccheck}; do
  # racecheck: one small problem per kernel instance (tests/gpu_stack.rs race_mode)
  if [ "$tool" = racecheck ]; then export MIXSTACK_TEST_SMALL=race; else export MIXSTACK_TEST_SMALL=1; fi
  if [ -n "${PER_TEST_S:-}" ]; then
    per_test "$tool" | tee "$OUT/sanitize_${tool}_summary.txt"
    grep -qvE ": ok in .*(ERROR SUMMARY: 0 errors|RACECHECK SUMMARY: 0 hazards)|: no CUDA call at this size" \
      "$OUT/sanitize_${tool}_summary.txt" && status=1
    continue
  fi
  log="$OUT/sanitize_$tool.log"
  start=$(date +%s)
  # shellcheck disable=SC2086
  "$cs" --tool "$tool" $(tool_filter "$tool") --error-exitcode 99 --print-limit 20 "$bin" --test-threads=1 ${TESTS:-} >"$log" 2>&1
  rc=$?
  echo "$tool: exit $rc in $(( $(date +%s) - start )) s; $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -1); $(grep -E "^test result" "$log" | tail -1)"
  [ "$rc" -ne 0 ] && status=1
done
exit $status
