#!/usr/bin/env bash
# Runs on the GPU machine over binaries staged by scripts/stage-device.sh:
# GPU tests, verify, the Python op's tests, and the benchmarks of BENCH.md.
#   scripts/on-device.sh [all|tests|python|bench [bench args]]     results under $OUT
set -uo pipefail
OUT=${OUT:-/tmp/mixstack-out}; mkdir -p "$OUT"
export MIXSTACK_VECTORS="$PWD/vectors"
# unpack what scripts/stage-device.sh packed
if [ -f .device/bundle.tar.xz ] && [ ! -x .device/mixstack ]; then tar -C .device -xJf .device/bundle.tar.xz && mv .device/bin/* .device/; fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
date -u | tee -a "$OUT/gpu.txt"
what=${1:-all}
if [ "$what" = all ] || [ "$what" = tests ]; then
  for t in .device/gpu_* .device/capi_cpu; do
    echo "== $t"; "$t" --test-threads=1 --nocapture 2>&1 | tee "$OUT/$(basename "$t").log" | grep -E "test |SKIPPED|panicked|result|rel|bitwise" | tail -60
  done
  echo "== verify"; .device/mixstack verify 2>&1 | tee "$OUT/verify.log" | tail -30
fi
if [ "$what" = all ] || [ "$what" = python ]; then
  # the torch ops over the staged library: numerics, opcheck, compile/export, CUDA graphs; tracing; drop-in.
  # The ops' C++ library is built first, here, against this machine's torch (kept in .device/ while warm).
  export MIXSTACK_TORCH_CACHE=$PWD/.device/torch-ext MIXSTACK_LIB=$PWD/.device/libmixstack.so PYTHONPATH=$PWD/python
  echo "== libmixstack_torch.so"; python3 -m mixstack_torch._ext 2>&1 | tail -3
  # which C++ runtimes a Python process with torch and the op maps (BENCH.md
  # run 94: integer formatting in the op crashed here, text did not)
  python3 -c "import mixstack_torch, torch; torch.ops.mixstack.stack; print(open('/proc/self/maps').read())" \
    > "$OUT/maps.txt" 2>&1 || echo "maps: the import failed (maps.txt)"
  grep -oE "/[^ ]*(libstdc\+\+|libgcc_s)[^ ]*" "$OUT/maps.txt" | sort -u | tee "$OUT/cxx_runtimes.txt"
  # test_torch_op.py again past a test that crashed the process (at most
  # twice), so one crash does not hide the tests after it
  skip=""
  for attempt in 1 2 3; do
    echo "== python/tests/test_torch_op.py ${skip:+--skip $skip}"
    python3 python/tests/test_torch_op.py ${skip:+--skip "$skip"} > "$OUT/test_torch_op.$attempt.log" 2>&1
    rc=$?; tail -40 "$OUT/test_torch_op.$attempt.log"
    [ $rc -lt 128 ] && break
    crashed=$(grep -E "^RUN " "$OUT/test_torch_op.$attempt.log" | tail -1 | cut -d' ' -f2)
    echo "== test_torch_op.py: $crashed crashed the process (status $rc)"
    skip=${skip:+$skip,}$crashed
  done
  for t in python/tests/test_trace_cpu.py python/tests/test_deepmd_dropin_cpu.py; do
    echo "== $t"; python3 "$t" 2>&1 | tee "$OUT/$(basename "$t" .py).log" | tail -40
  done
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  shift || true
  for p in seed cf64 f1; do
    echo "== bench $p"; .device/mixstack bench --preset "$p" --json "$OUT/bench_$p.json" "$@" 2>&1 | tee "$OUT/bench_$p.log"
  done
fi
