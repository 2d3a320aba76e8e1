#!/usr/bin/env bash
# The relay backward against every accepted bwd_fused tile, side by side in
# one `mixstack bench` run (each fused variant checked bitwise against the
# relay). Usage: [MATCH=REGEX] [REPS=N] scripts/fused-tiles.sh NAME BENCH-ARGS...
# e.g. scripts/fused-tiles.sh seed --preset seed; scripts/fused-tiles.sh
# cf64l5 --cf 64 --lmax 5 --edges 646000. Binaries staged in .device/.
set -uo pipefail
OUT=${OUT:-/tmp/mixstack-out}; mkdir -p "$OUT"
name=$1; shift
if [ -f .device/bundle.tar.xz ] && [ ! -x .device/mixstack ]; then tar -C .device -xJf .device/bundle.tar.xz && mv .device/bin/* .device/; fi
# Cf of the workload: --cf N, or the preset's (cf64: 64, seed and f1: 32).
cf=$(echo "$@" | grep -oE -- "--cf [0-9]+" | awk '{print $2}')
case " $* " in *"--preset cf64"*) cf=64;; esac
v=(--variant relay --variant fused)
for n in $(bash scripts/instances.sh bwd_fused "${cf:-32}"); do v+=(--variant "fused:bwd_fused=$n"); done
.device/mixstack bench "$@" --reps "${REPS:-10}" "${v[@]}" --json "$OUT/fused_$name.json" > "$OUT/fused_$name.log" 2>&1
echo "rc=$? $name"
grep -vE "^    " "$OUT/fused_$name.log" | tail -40
