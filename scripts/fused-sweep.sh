#!/usr/bin/env bash
# Relay against fused backward (default tiles) over Cf {32, 64} x lmax 1..6
# (F 2, E 646,000, 3 layers, alpha on), one `mixstack bench` per point,
# relay and fused interleaved and checked bitwise. Prints one table row per
# point. EXTRA="tile ..." adds those bwd_fused tiles as variants at every
# point (e.g. EXTRA="m64_n64_k16_t8x4_s2_b4_ps m64_n64_k32_t8x4_s2_b2_px":
# the stream and split tiles beside the default; a tile that does not fit a
# point's shared memory is left out there, and its column says so).
# The switch's regime from the same sweep (default tiles): `mixstack tune
# --regime` (device-check.sh SWEEP=1), which prints stages.yaml's entries.
# Usage: [REPS=N] [EXTRA=...] scripts/fused-sweep.sh (binaries staged in .device/).
set -uo pipefail
OUT=${OUT:-/tmp/mixstack-out}; mkdir -p "$OUT"
if [ -f .device/bundle.tar.xz ] && [ ! -x .device/mixstack ]; then tar -C .device -xJf .device/bundle.tar.xz && mv .device/bin/* .device/; fi
read -ra extra <<< "${EXTRA:-}"
head="| Cf | lmax | relay bwd ms | fused bwd ms | fused / relay |"
rule="| --- | --- | --- | --- | --- |"
for t in "${extra[@]}"; do head+=" $t / relay |"; rule+=" --- |"; done
echo "$head bitwise |"; echo "$rule --- |"
for cf in 32 64; do
  for l in 1 2 3 4 5 6; do
    j="$OUT/sweep_cf${cf}_l${l}.json"
    v=(--variant relay --variant fused)
    for t in "${extra[@]}"; do v+=(--variant "fused:bwd_fused=ms_bwd_fused_f32_cf${cf}_$t"); done
    .device/mixstack bench --focus 2 --edges 646000 --cf "$cf" --lmax "$l" --layers 3 --reps "${REPS:-6}" \
      "${v[@]}" --json "$j" > "$OUT/sweep_cf${cf}_l${l}.log" 2>&1
    python3 - "$j" "$cf" "$l" "${extra[@]}" <<'PY'
import json, sys
j, cf, l, *extra = sys.argv[1:]
try:
    d = json.load(open(j))
except Exception as e:
    print(f"| {cf} | {l} | failed: {e} | | |" + " |" * len(extra) + " |"); sys.exit()
b = {v["label"]: v["median_ms"] for v in d["backward"]}
r, f = b.get("relay"), b.get("fused")
if r is None or f is None:
    print(f"| {cf} | {l} | relay {r} | fused {f} | left out |" + " |" * len(extra) + " |"); sys.exit()
eq = d.get("fused_bitwise_equal_to_relay")
cols = []
for t in extra:
    m = b.get(f"fused:bwd_fused=ms_bwd_fused_f32_cf{cf}_{t}")
    cols.append(f"{m / r:.3f}" if m else "left out")
print(f"| {cf} | {l} | {r:.3f} | {f:.3f} | {f / r:.3f} | " + "".join(c + " | " for c in cols) + f"{'EQUAL' if eq else eq} |")
PY
  done
done
