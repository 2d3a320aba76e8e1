#!/usr/bin/env bash
# A/B of two staged builds on the GPU machine: the same `mixstack bench`
# arguments run alternately with .device/old/mixstack (A) and .device/mixstack
# (B), ROUNDS times each, so a change in a kernel body (which renames no
# kernel) is measured side by side. Usage: scripts/ab.sh BENCH-ARGS...
# Stage B with scripts/stage-device.sh, then put A's bundle in .device/old/.
# NAME (default ab) prefixes the logs: two A/Bs in one call keep both.
set -uo pipefail
OUT=${OUT:-/tmp/mixstack-out}; mkdir -p "$OUT"
for d in .device/old .device; do
  if [ -f $d/bundle.tar.xz ] && [ ! -x $d/mixstack ]; then tar -C $d -xJf $d/bundle.tar.xz && mv $d/bin/* $d/; fi
done
for r in $(seq 1 "${ROUNDS:-2}"); do
  for side in A B; do
    bin=.device/mixstack; [ $side = A ] && bin=.device/old/mixstack
    echo "== round $r $side: $*"
    timeout 90 $bin bench "$@" --json "$OUT/${NAME:-ab}_${side}_$r.json" > "$OUT/${NAME:-ab}_${side}_$r.log" 2>&1
    grep -E "^(default|relay|fused)[@ ]|^    " "$OUT/${NAME:-ab}_${side}_$r.log" | awk '/^    /{printf "  %s %s", $1, $2; next} {printf "\n%s %s median %s", $1, $2, $4} END {print ""}'
  done
done
