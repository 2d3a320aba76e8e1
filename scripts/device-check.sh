#!/usr/bin/env bash
# One device call that checks a staged build (scripts/stage-device.sh):
# the GPU tests and verify (scripts/on-device.sh tests), the Python op's
# tests (on-device.sh python), the sanitizers named in SAN (scripts/
# sanitize.sh), and Nsight Compute on the kernels matching NCU_K (one
# launch each, with per-SASS-instruction source counters as CSV), and with
# GPU_TESTS="filters" only those gpu_stack tests, BENCH="seed cf64 f1" relay
# against fused benches (REPS each), PREC_BENCH="seed" the same in both
# precision modes (exact, fp16x3) side by side, TILES="seed cf64 f1" every fused tile
# matching MATCH against the relay (scripts/fused-tiles.sh), SWEEP=1 the Cf x
# lmax sweep and the switch's regime (mixstack tune --regime; SWEEP_TILES="tile ..." the sweep with those
# tiles beside the default, scripts/fused-sweep.sh; raise SWEEP_S), TUNE="seed" mixstack tune --write and
# its winners against the defaults (scripts/tune-check.sh), PROBE=1 a short fused bench first
# that ends the call if it fails, PROBE_TILES=1 each fused tile (matching MATCH) alone
# at the seed under a 30 s timeout, bitwise against the relay, DEEPMD="args" the DeePMD-kit end to end (scripts/deepmd-e2e-on-device.sh;
# its wheel groups carried by this call or an earlier one on the warm machine:
# scripts/stage-deepmd-wheels.sh), RACE_REPRO=1 the named-barrier
# handover variants of bench/runs/run87/arrive_next.cu under racecheck (the
# ws kernels' report, BENCH.md runs 83-90), EXP_FP16X3=1 the fp16x3 tensor-core
# GEMM experiment of issue 20 (bench/exp/fp16x3_gemm.cu; EXP_NCU=1 adds
# Nsight Compute on its v3 and v4 kernels), DIAG22=1 issue
# 22's Python crashes with native backtraces (bench/runs/run100), SAN_BG="tools"
# sanitizers in the background beside the rest (BG_TESTS, BG_JOBS, BG_PER_TEST_S). Prints a
# summary; packs every log into $OUT/results.tar.gz (the device tool brings
# back at most 8 files).
#   SAN="memcheck synccheck" NCU_K="bwd_fused|bwd_gemm" scripts/device-check.sh
#   NCU_K="pg_x3" NCU_PREC=fp16x3 NCU_C=4 scripts/device-check.sh   (the wgmma tiles in the fp16x3 mode)
#   SAN=racecheck PER_TEST_S=60 SAN_S=500 scripts/device-check.sh   (each test alone)
set -uo pipefail
OUT=${OUT:-/tmp/mixstack-out}; mkdir -p "$OUT/r"
export PYTHONUNBUFFERED=1
if [ -f .device/bundle.tar.xz ] && [ ! -x .device/mixstack ]; then tar -C .device -xJf .device/bundle.tar.xz && mv .device/bin/* .device/; fi
bg=""
if [ -n "${SAN_BG:-}" ]; then
  # sanitizer tools in the background, beside the rest of the call (the tools
  # are bound by the host's cores, the steps after them mostly by the GPU):
  # SAN_BG="racecheck" with BG_TESTS, BG_JOBS, BG_PER_TEST_S, BG_S
  mkdir -p "$OUT/r/bg"
  (OUT=$OUT/r/bg TESTS="${BG_TESTS:-}" JOBS="${BG_JOBS:-4}" PER_TEST_S="${BG_PER_TEST_S:-300}" \
    timeout "${BG_S:-400}" bash scripts/sanitize.sh $SAN_BG > "$OUT/r/bg/out.txt" 2>&1; echo "background sanitize $SAN_BG rc=$?" >> "$OUT/r/bg/out.txt") &
  bg=$!
fi
if [ "${PROBE:-0}" = 1 ]; then
  # one short relay-vs-fused bench first: a fused kernel that hangs or
  # faults stops the call here, not in every step after
  timeout 60 .device/mixstack bench --preset seed --reps 2 --variant relay --variant fused > "$OUT/r/probe.out" 2>&1
  rc=$?; echo "probe rc=$rc"; grep -vE "^    " "$OUT/r/probe.out" | tail -8
  if [ $rc != 0 ]; then tar -C "$OUT/r" -czf "$OUT/results.tar.gz" .; exit 1; fi
fi
if [ "${PROBE_TILES:-0}" = 1 ]; then
  # each accepted fused tile of the seed alone, 30 s each, checked bitwise
  # against the relay: a tile that hangs (a barrier mismatch) or faults is
  # named here, not found by a test that runs into the call's limit
  for n in $(bash scripts/instances.sh bwd_fused 32); do
    timeout 30 .device/mixstack bench --preset seed --reps 1 --variant relay --variant "fused:bwd_fused=$n" \
      > "$OUT/r/probe_$n.out" 2>&1
    rc=$?; echo "probe $n: rc $rc $(grep -oE 'bitwise.*(EQUAL|DIFFER[A-Z]*)' "$OUT/r/probe_$n.out" | tail -1)"
  done | tee "$OUT/r/probe_tiles.txt"
fi
if [ "${RACE_REPRO:-0}" = 1 ]; then
  # 0 must be clean and 2 must report; 3-12 are the ws kernels' differences
  # (each mode's whole report kept: race_mode_M.txt)
  nvcc -arch=sm_90 -o "$OUT/r/arrive" bench/runs/run87/arrive_next.cu && for m in 0 2 3 4 5 6 7 8 9 10 11 12; do
    compute-sanitizer --tool racecheck "$OUT/r/arrive" $m > "$OUT/r/race_mode_$m.txt" 2>&1
    echo "race repro mode $m: $(grep -E 'RACECHECK SUMMARY' "$OUT/r/race_mode_$m.txt")"
  done | tee "$OUT/r/race_repro.txt"
fi
if [ "${EXP_FP16X3:-0}" = 1 ]; then
  # issue 20's first measurement: the compensated fp16x3 GEMM on mma.sync at
  # the relay GEMM's shapes, accuracy over the range contract and time
  # (cuBLAS's ceilings at the same shape need its library: EXP_CUBLAS)
  EXP_CUBLAS=$(find /usr/local -name 'libcublas.so*' 2>/dev/null | head -1); export EXP_CUBLAS
  nvcc -O3 -arch=sm_90a --fmad=false -Xptxas -v -I templates -I generated-tests/cuda -o "$OUT/r/fp16x3" bench/exp/fp16x3_gemm.cu -ldl > "$OUT/r/fp16x3_build.txt" 2>&1 \
    && timeout "${EXP_S:-180}" "$OUT/r/fp16x3" "${EXP_ROWS:-1292000}" "${EXP_REPS:-20}" 2>&1 | tee "$OUT/r/fp16x3.txt"
  grep -E "registers|spill" "$OUT/r/fp16x3_build.txt" | head -4
  if [ "${EXP_NCU:-0}" = 1 ]; then
    # the counters that say what bounds the cores (v3, v4 on mma.sync, v6 on wgmma): one
    # launch of each at one scale (each variant launches reps + 2 = 3 times)
    # demangled names: v4's and v6's functions are both called gemm
    EXP_SCALE=1 timeout "${EXP_NCU_S:-200}" ncu --clock-control none --kernel-name-base demangled \
      -k "regex:${EXP_NCU_K:-core<|v4::gemm|v6::gemm}" -c "${EXP_NCU_C:-9}" \
      --set full -o "$OUT/r/exp_ncu" -f "$OUT/r/fp16x3" "${EXP_ROWS:-1292000}" 1 > "$OUT/r/exp_ncu_run.log" 2>&1; echo "exp ncu rc=$?"
    ncu -i "$OUT/r/exp_ncu.ncu-rep" --page details > "$OUT/r/exp_ncu_details.txt" 2>&1
    grep -E "^  [a-zA-Z_]|Duration|Issue Slots|Issued Ipc|Tensor|Theoretical Occ|Achieved Occ|Warp Cycles Per Issued|Registers Per|Stall|DRAM Throughput" \
      "$OUT/r/exp_ncu_details.txt" | head -80
  fi
fi
if [ "${TESTS:-1}" = 1 ]; then
  OUT=$OUT/r timeout "${TESTS_S:-300}" bash scripts/on-device.sh tests > "$OUT/r/tests.out" 2>&1; echo "tests rc=$?"
  grep -E "^== |^test result|FAILED|panicked|SKIPPED|^verify" "$OUT/r/tests.out" | head -40
fi
if [ -n "${GPU_TESTS:-}" ]; then
  # only the gpu_stack tests matching GPU_TESTS (libtest filters)
  # shellcheck disable=SC2086
  MIXSTACK_VECTORS=$PWD/vectors timeout "${TESTS_S:-300}" .device/gpu_stack --test-threads=1 $GPU_TESTS > "$OUT/r/gpu_stack.out" 2>&1
  echo "gpu_stack ($GPU_TESTS) rc=$?"; grep -E "^test |^test result|panicked" "$OUT/r/gpu_stack.out" | tail -30
fi
for p in ${BENCH:-}; do
  .device/mixstack bench --preset "$p" --reps "${REPS:-10}" --variant relay --variant fused > "$OUT/r/bench_$p.out" 2>&1
  echo "bench $p rc=$?"; grep -vE "^    fwd_|^default|^scratch" "$OUT/r/bench_$p.out"
done
for p in ${PREC_BENCH:-}; do
  # issue 20: both precision modes, relay and fused, interleaved in one bench
  timeout "${PREC_S:-90}" .device/mixstack bench --preset "$p" --reps "${REPS:-10}" --precision exact --precision fp16x3 \
    --variant relay --variant fused > "$OUT/r/prec_bench_$p.out" 2>&1
  echo "precision bench $p rc=$?"; grep -vE "^    fwd_|^scratch" "$OUT/r/prec_bench_$p.out"
done
for p in ${TILES:-}; do
  # every fused tile matching MATCH against the relay, side by side
  OUT=$OUT/r REPS="${REPS:-8}" timeout "${TILES_S:-100}" bash scripts/fused-tiles.sh "$p" --preset "$p"
done
for p in ${TUNE:-}; do
  OUT=$OUT/r timeout "${TUNE_S:-240}" bash scripts/tune-check.sh "$p" > "$OUT/r/tune_check_$p.out" 2>&1; echo "tune $p rc=$?"
  grep -E "^# tune|^winner|^\+ |^bench|^[a-z].*median|EQUAL|DIFFER" "$OUT/r/tune_check_$p.out" | head -60
done
if [ "${SWEEP:-0}" = 1 ]; then
  # the switch's regime on this GPU: relay against fused over Cf x lmax,
  # written into this machine's copy of specs/stages.yaml, which comes back
  # as regime_stages.yaml (copy it over specs/stages.yaml here and rebless)
  timeout "${SWEEP_S:-420}" .device/mixstack tune --regime --write --reps "${SWEEP_REPS:-5}" 2>&1 | tee "$OUT/r/regime.md"
  cp specs/stages.yaml "$OUT/regime_stages.yaml"
fi
if [ -n "${SWEEP_TILES:-}" ]; then
  # the same sweep with more fused tiles beside the default
  OUT=$OUT/r REPS="${SWEEP_REPS:-5}" EXTRA="$SWEEP_TILES" timeout "${SWEEP_S:-240}" bash scripts/fused-sweep.sh | tee "$OUT/r/sweep.md"
fi
if [ "${PY:-1}" = 1 ]; then
  OUT=$OUT/r timeout "${PY_S:-240}" bash scripts/on-device.sh python > "$OUT/r/python.out" 2>&1; echo "python rc=$?"
  grep -E "^== |^FAIL|tests passed|FAILED|Error" "$OUT/r/python.out" | head -20
fi
if [ "${DIAG22:-0}" = 1 ]; then
  # issue 22's two crashes in Python on this machine (BENCH.md runs 89-94),
  # each case in its own process under a native-backtrace handler: the op's
  # refusals thrown from other sites (throws.py f0 n0), and loading
  # AOTInductor packages without and with the op (aoti_probe.py)
  export MIXSTACK_TORCH_CACHE=$PWD/.device/torch-ext MIXSTACK_LIB=$PWD/.device/libmixstack.so PYTHONPATH=$PWD/python
  python3 -m mixstack_torch._ext > "$OUT/r/ext_build.txt" 2>&1; echo "ext build rc=$?"
  gcc -shared -fPIC -O1 -o "$OUT/r/segv_trace.so" bench/runs/run100/segv_trace.c && export SEGV_TRACE=$OUT/r/segv_trace.so
  python3 -c "import mixstack_torch, torch; torch.ops.mixstack.stack; print(open('/proc/self/maps').read())" 2>&1 \
    | grep -oE "/[^ ]*(libstdc\+\+|libgcc_s)[^ ]*" | sort -u | tee "$OUT/r/cxx_runtimes.txt"
  for c in ok f0 n0 row lmax0 alpha_shape; do
    LD_PRELOAD=${SEGV_TRACE:-} timeout 60 python3 bench/runs/run94/throws.py "$c" > "$OUT/r/throws_$c.txt" 2>&1
    echo "throws $c: rc $? $(grep -vE '^\s*$' "$OUT/r/throws_$c.txt" | tail -1 | cut -c1-160)"
  done
  timeout "${DIAG22_S:-240}" python3 bench/runs/run100/aoti_probe.py 2>&1 | tee "$OUT/r/aoti_probe.txt" | head -120
fi
if [ -n "${DEEPMD:-}" ]; then
  # shellcheck disable=SC2086
  OUT=$OUT/r timeout "${DEEPMD_S:-300}" bash scripts/deepmd-e2e-on-device.sh $DEEPMD > "$OUT/r/deepmd.out" 2>&1; echo "deepmd rc=$?"
  tail -40 "$OUT/r/deepmd.out"
fi
for tool in ${SAN:-}; do
  OUT=$OUT/r TESTS="${SAN_TESTS:-}" timeout "${SAN_S:-200}" bash scripts/sanitize.sh "$tool"; echo "sanitize $tool rc=$?"
done
if [ -n "${NCU_K:-}" ]; then
  timeout "${NCU_S:-200}" ncu --clock-control none -k "regex:${NCU_K}" -c "${NCU_C:-2}" --set full --import-source no \
    -o "$OUT/r/ncu" -f .device/mixstack bench --preset "${NCU_PRESET:-seed}" --reps 1 --precision "${NCU_PREC:-exact}" \
    --variant relay --variant fused \
    > "$OUT/r/ncu_run.log" 2>&1; echo "ncu rc=$?"
  ncu -i "$OUT/r/ncu.ncu-rep" --page details > "$OUT/r/ncu_details.txt" 2>&1
  ncu -i "$OUT/r/ncu.ncu-rep" --page source --csv --print-source sass > "$OUT/r/ncu_sass.csv" 2>&1
  grep -E "^  [a-z_]|Duration|Issue Slots|Issued Ipc|FMA|Theoretical Occ|Achieved Occ|Warp Cycles Per Issued|Registers Per|Block Limit|DRAM Throughput|L2 Hit|L1/TEX Hit|No Eligible|Active Warps Per|Eligible Warps" "$OUT/r/ncu_details.txt" | head -90
fi
if [ -n "$bg" ]; then wait "$bg"; cat "$OUT/r/bg/out.txt"; fi
tar -C "$OUT/r" -czf "$OUT/results.tar.gz" . && rm -rf "$OUT/r"
