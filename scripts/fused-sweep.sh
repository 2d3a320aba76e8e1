#!/usr/bin/env bash
# Relay against fused backward (default tiles) over Cf {32, 64} x lmax 1..6
# (F 2, E 646,000, 3 layers, alpha on), one `mixstack bench` per point,
# relay and fused interleaved and checked bitwise. Prints one table row per
# point. Usage: [REPS=N] scripts/fused-sweep.sh (binaries staged in .device/).
set -uo pipefail
OUT=${OUT:-/tmp/mixstack-out}; mkdir -p "$OUT"
if [ -f .device/bundle.tar.xz ] && [ ! -x .device/mixstack ]; then tar -C .device -xJf .device/bundle.tar.xz && mv .device/bin/* .device/; fi
echo "| Cf | lmax | relay bwd ms | fused bwd ms | fused / relay | bitwise |"
echo "| --- | --- | --- | --- | --- | --- |"
for cf in 32 64; do
  for l in 1 2 3 4 5 6; do
    j="$OUT/sweep_cf${cf}_l${l}.json"
    .device/mixstack bench --focus 2 --edges 646000 --cf "$cf" --lmax "$l" --layers 3 --reps "${REPS:-6}" \
      --variant relay --variant fused --json "$j" > "$OUT/sweep_cf${cf}_l${l}.log" 2>&1
    python3 - "$j" "$cf" "$l" <<'PY'
import json, sys
j, cf, l = sys.argv[1:]
try:
    d = json.load(open(j))
except Exception as e:
    print(f"| {cf} | {l} | failed: {e} | | | |"); sys.exit()
b = {v["label"]: v["median_ms"] for v in d["backward"]}
r, f = b.get("relay"), b.get("fused")
eq = d.get("fused_bitwise_equal_to_relay")
print(f"| {cf} | {l} | {r:.3f} | {f:.3f} | {f / r:.3f} | {'EQUAL' if eq else eq} |")
PY
  done
done
