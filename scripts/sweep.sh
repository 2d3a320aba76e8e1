#!/usr/bin/env bash
# Tile sweep on the GPU: every accepted relay GEMM tile (bwd_gemm and
# bwd_final together; fwd_m0, fwd_m1 and fwd_final together) and every
# bwd_fused tile, side by side in one `mixstack bench` run per preset.
# Usage: [MATCH=REGEX] scripts/sweep.sh PRESET CF   (binaries staged in
# .device/; MATCH keeps the kernels whose names it matches)
set -uo pipefail
OUT=${OUT:-/tmp/mixstack-out}; mkdir -p "$OUT"
preset=$1; cf=$2
if [ -f .device/bundle.tar.xz ] && [ ! -x .device/mixstack ]; then tar -C .device -xJf .device/bundle.tar.xz && mv .device/bin/* .device/; fi
names() { bash scripts/instances.sh "$1" "$cf"; }
v=(--variant relay)
finals=$(names bwd_final)
for n in $(names bwd_gemm); do
  t=${n#ms_bwd_gemm_f32_cf${cf}_}
  f=ms_bwd_final_f32_cf${cf}_$t
  if echo "$finals" | grep -qx "$f"; then v+=(--variant "relay:bwd_gemm=$n,bwd_final=$f"); else v+=(--variant "relay:bwd_gemm=$n"); fi
done
fw=(--forward-variant default)
f1s=$(names fwd_m1); ffs=$(names fwd_final)
for n in $(names fwd_m0); do
  t=${n#ms_fwd_m0_f32_cf${cf}_}
  o="fwd_m0=$n"
  echo "$f1s" | grep -qx "ms_fwd_m1_f32_cf${cf}_$t" && o+=",fwd_m1=ms_fwd_m1_f32_cf${cf}_$t"
  echo "$ffs" | grep -qx "ms_fwd_final_f32_cf${cf}_$t" && o+=",fwd_final=ms_fwd_final_f32_cf${cf}_$t"
  fw+=(--forward-variant "$o")
done
v+=(--variant fused)
for n in $(names bwd_fused); do v+=(--variant "fused:bwd_fused=$n"); done
.device/mixstack bench --preset "$preset" --reps "${REPS:-10}" "${v[@]}" "${fw[@]}" --json "$OUT/sweep_$preset.json" > "$OUT/sweep_$preset.log" 2>&1
grep -vE "^    " "$OUT/sweep_$preset.log" | grep -v " / relay"
