#!/usr/bin/env bash
# One GPU session's worth of evidence, in priority order, each step with its
# own time limit so the results archive is always written: GPU tests, verify,
# the seed tile sweep, the side-by-side benchmarks of BENCH.md (cf32 with the
# fastest measured tiles, cf64 with its defaults), the PyTorch op's tests and
# timing. Everything lands in $OUT/results.tar.gz.
set -uo pipefail
OUT=${OUT:-/tmp/mixstack-out}; mkdir -p "$OUT"
if [ -f .device/bundle.tar.xz ] && [ ! -x .device/mixstack ]; then tar -C .device -xJf .device/bundle.tar.xz && mv .device/bin/* .device/; fi
export MIXSTACK_VECTORS="$PWD/vectors"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > "$OUT/gpu.txt"; date -u >> "$OUT/gpu.txt"
timeout 45 .device/gpu_stack --test-threads=1 --nocapture > "$OUT/gpu_stack.log" 2>&1; echo "gpu_stack rc=$? $(grep 'test result' "$OUT/gpu_stack.log")"
timeout 15 .device/mixstack verify > "$OUT/verify.log" 2>&1; echo "verify rc=$? $(tail -1 "$OUT/verify.log")"
REPS=5 timeout 85 bash scripts/sweep.sh seed 32 > /dev/null; echo "sweep rc=$?"
for p in seed f1 cf64; do
  # cf32 workloads run the fastest tiles of the seed sweep; cf64 its defaults
  if [ $p = cf64 ] || [ ! -s "$OUT/sweep_seed.json" ]; then v=(relay fused); else mapfile -t v < <(python3 scripts/pick_tiles.py "$OUT/sweep_seed.json"); fi
  echo "== bench $p: ${v[*]}"
  timeout 35 .device/mixstack bench --preset $p --reps 12 --variant "${v[0]}" --variant "${v[1]}" --json "$OUT/bench_$p.json" > "$OUT/bench_$p.log" 2>&1
  grep -vE "^    " "$OUT/bench_$p.log"
done
MIXSTACK_LIB=$PWD/.device/libmixstack.so timeout 75 python3 python/tests/test_torch_op.py --bench --repeats 5 > "$OUT/torch_op.log" 2>&1; echo "torch rc=$?"; tail -25 "$OUT/torch_op.log"
cd "$OUT" && tar -czf /tmp/results.tar.gz ./* && rm -rf "$OUT"/* && mv /tmp/results.tar.gz "$OUT"/results.tar.gz
