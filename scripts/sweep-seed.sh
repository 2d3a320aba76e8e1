#!/usr/bin/env bash
# Tile sweep at the seed workload: every accepted relay GEMM tile (bwd_gemm
# and bwd_final together) and fused tile, side by side in one run.
set -uo pipefail
OUT=${OUT:-/tmp/mixstack-out}
v=(--variant relay)
for t in m128_n64_k16_t8x8 m128_n64_k16_t8x4 m128_n64_k32_t8x4; do
  v+=(--variant "relay:bwd_gemm=ms_bwd_gemm_f32_cf32_$t,bwd_final=ms_bwd_final_f32_cf32_$t")
done
v+=(--variant fused)
for t in m64_n128_k32_t4x8 m32_n64_k32_t4x4; do v+=(--variant "fused:bwd_fused_m0=ms_bwd_fused_m0_f32_cf32_$t"); done
v+=(--variant "fused:bwd_fused_m1=ms_bwd_fused_m1_f32_cf32_m32_n64_k32_t4x4")
.device/mixstack bench --preset seed --reps ${REPS:-15} "${v[@]}" --json "$OUT/sweep_seed.json" 2>&1 | tee "$OUT/sweep_seed.log"
