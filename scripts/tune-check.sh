#!/usr/bin/env bash
# On the GPU machine, over binaries staged by scripts/stage-device.sh:
# `mixstack tune --write` at one preset, then its winners against the
# previous defaults in one interleaved bench. Defaults are compiled into the
# kernel table, so the winners run as tile overrides of the same binary:
# forward default vs forward winners, relay vs relay with the winners of its
# stages, fused vs fused with the winners of its stages. Under $OUT: the tune
# log, the diff of specs/tiles.yaml, the bench log.
#   scripts/tune-check.sh [PRESET]      (default: seed; REPS, BENCH_REPS)
set -uo pipefail
OUT=${OUT:-/tmp/mixstack-out}; mkdir -p "$OUT"
p=${1:-seed}
bin=.device/mixstack
if [ -f .device/bundle.tar.xz ] && [ ! -x "$bin" ]; then tar -C .device -xJf .device/bundle.tar.xz && mv .device/bin/* .device/; fi
cp specs/tiles.yaml "$OUT/tiles.before.yaml"
"$bin" tune --preset "$p" --reps "${REPS:-10}" --write 2>&1 | tee "$OUT/tune_$p.log"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "tune failed"; exit 1; }
diff -u "$OUT/tiles.before.yaml" specs/tiles.yaml > "$OUT/tiles.diff"; cat "$OUT/tiles.diff"
# "## STAGE (...)" then "winner: NAME (...)": overrides per path. bwd_final
# and bwd_grad_alpha run on both backward paths.
over() {  # $1: regex of the stages to keep
  awk -v keep="$1" '/^## /{s=$2} /^winner: /{if (s ~ keep) printf "%s%s=%s", (n++ ? "," : ""), s, $2}' "$OUT/tune_$p.log"
}
fwd=$(over '^fwd_'); relay=$(over '^bwd_' | tr ',' '\n' | grep -v '^bwd_fused=' | paste -sd,)
fused=$(over '^bwd_(fused|final|grad_alpha)$')
args=(--preset "$p" --reps "${BENCH_REPS:-12}" --forward-variant default)
[ -n "$fwd" ] && args+=(--forward-variant "$fwd")
args+=(--variant relay); [ -n "$relay" ] && args+=(--variant "relay:$relay")
# where the fused path is not served the fused variants run the relay (the
# bench says so); their winners still apply
args+=(--variant fused); [ -n "$fused" ] && args+=(--variant "fused:$fused")
echo "bench ${args[*]}"
"$bin" bench "${args[@]}" 2>&1 | tee "$OUT/tune_bench_$p.log"
