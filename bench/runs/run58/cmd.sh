#!/usr/bin/env bash
# Run 58 (device): after the review (595bdf3: one fwd_gate launch per gate
# path; bench compares forward variants within a gate path): GPU tests,
# verify, and a small Cf 128 bench whose forward variants cross gate paths.
set -uo pipefail
OUT=${OUT:-/tmp/mixstack-out}
TESTS_S=200 bash scripts/probe.sh
mkdir -p "$OUT"
lib=$(find /usr/local -name 'libcublas.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH="$(dirname "$lib")"
timeout 60 .device/mixstack bench --focus 2 --edges 20000 --cf 128 --lmax 3 --layers 3 --reps 3 --variant relay \
  --forward-variant default --forward-variant fwd_gate_act=ms_fwd_gate_act_f32_cf128_r16_t128_b8 \
  --forward-variant fwd_gate=ms_fwd_gate_f32_cf128_r32_t256_b1 > "$OUT/b.log" 2>&1; echo "bench rc=$?"
grep -E "gate path|bitwise|median" "$OUT/b.log"
