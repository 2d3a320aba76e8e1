#!/usr/bin/env bash
# Run 51 (device): the final build's GPU tests and verify (scripts/probe.sh),
# then the row tiles of the cuBLAS-path stages at Cf 128, L 3, side by side.
set -uo pipefail
OUT=${OUT:-/tmp/mixstack-out}
tar -C .device -xJf .device/bundle.tar.xz && mv .device/bin/* .device/
TESTS_S=150 bash scripts/probe.sh
mkdir -p "$OUT"
lib=$(find /usr/local -name 'libcublas.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH="$(dirname "$lib")"
V=""; F=""
for t in r32_t256_b1 r16_t128_b8 r32_t128_b8 r64_t256_b4; do
  V="$V --variant relay:bwd_glogit=ms_bwd_glogit_f32_cf128_$t"; F="$F --forward-variant fwd_gate_act=ms_fwd_gate_act_f32_cf128_$t"; done
timeout 150 .device/mixstack bench --focus 2 --edges 323000 --cf 128 --lmax 3 --layers 3 --reps 6 $V $F --json "$OUT/tiles_cf128.json" > "$OUT/tiles_cf128.log" 2>&1; echo "rc=$?"
grep -vE "^    " "$OUT/tiles_cf128.log"; grep -E "^    (fwd_gate_act|bwd_glogit)" "$OUT/tiles_cf128.log"
