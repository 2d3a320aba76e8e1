#!/usr/bin/env bash
# The fp16x3 relay GEMM tiles side by side in one `mixstack bench` run: the
# dispatch default, the mma.sync stream tile and every accepted wgmma tile,
# forward and relay backward (each variant checked bitwise against the
# first). Usage: [REPS=N] scripts/wgmma-tiles.sh NAME BENCH-ARGS...
# e.g. scripts/wgmma-tiles.sh seed --preset seed. Binaries staged in .device/.
set -uo pipefail
OUT=${OUT:-/tmp/mixstack-out}; mkdir -p "$OUT"
name=$1; shift
if [ -f .device/bundle.tar.xz ] && [ ! -x .device/mixstack ]; then tar -C .device -xJf .device/bundle.tar.xz && mv .device/bin/* .device/; fi
cf=$(echo "$@" | grep -oE -- "--cf [0-9]+" | awk '{print $2}')
case " $* " in *"--preset cf64"*) cf=64;; esac
cf=${cf:-32}
# One tile's instances of the given stages, as overrides (stages it lacks
# keep their default).
over() {
  local tile=$1 o="" s; shift
  for s in "$@"; do
    if PRECISION=fp16x3 bash scripts/instances.sh "$s" "$cf" | grep -qx "ms_${s}_f32_cf${cf}_${tile}"; then
      o+="${o:+,}$s=ms_${s}_f32_cf${cf}_${tile}"
    fi
  done
  echo "$o"
}
fv=(--forward-variant default) bv=(--variant relay)
for t in m128_n64_k32_t8x4_s3_b1_ps_x3 $(PRECISION=fp16x3 bash scripts/instances.sh bwd_gemm "$cf" | grep -oE "m[0-9]+_n[0-9]+_k[0-9]+_.*_pg_x3"); do
  f=$(over "$t" fwd_m0 fwd_m1 fwd_final) b=$(over "$t" bwd_gemm bwd_final)
  [ -n "$f" ] && fv+=(--forward-variant "$f")
  [ -n "$b" ] && bv+=(--variant "relay:$b")
done
.device/mixstack bench "$@" --precision fp16x3 --reps "${REPS:-10}" "${fv[@]}" "${bv[@]}" --json "$OUT/wgmma_$name.json" \
  > "$OUT/wgmma_$name.log" 2>&1
echo "rc=$? $name"
grep -vE "^    " "$OUT/wgmma_$name.log" | tail -40
