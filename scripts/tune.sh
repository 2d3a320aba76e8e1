#!/usr/bin/env bash
# Per-stage tile choice on the GPU, then the choice measured as a whole.
# 1. One `mixstack bench` over the candidate overrides given as arguments
#    (--variant / --forward-variant, as scripts/sweep.sh builds them): every
#    variant is checked bitwise against the first and timed per kernel.
# 2. For each stage, the instance with the least time summed over its
#    launches, across the variants that ran it.
# 3. A second bench: the defaults against that combination, side by side.
# Usage: PRESET=seed scripts/tune.sh BENCH-VARIANT-ARGS...   (binaries staged
# in .device/; logs, JSON and the chosen names in $OUT/tune_PRESET.tar.gz)
set -uo pipefail
OUT=${OUT:-/tmp/mixstack-out}; mkdir -p "$OUT"
preset=${PRESET:-seed}
if [ -f .device/bundle.tar.xz ] && [ ! -x .device/mixstack ]; then tar -C .device -xJf .device/bundle.tar.xz && mv .device/bin/* .device/; fi
timeout ${TUNE_S:-150} .device/mixstack bench --preset "$preset" --reps "${REPS:-8}" "$@" \
  --json "$OUT/tune_$preset.json" > "$OUT/tune_$preset.log" 2>&1
echo "tune bench rc=$?"; grep -vE "^    " "$OUT/tune_$preset.log" | grep -v " / "
read -r bwd fwd < <(python3 - "$OUT/tune_$preset.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
best = {}
for group in ("backward", "forward_variants"):
    for v in d.get(group) or []:
        if v.get("path") == "fused":
            continue
        per = {}
        for stage, name, ms in v["per_kernel"]:
            per.setdefault((stage, name), 0.0)
            per[(stage, name)] += ms
        for (stage, name), ms in per.items():
            if stage not in best or ms < best[stage][1]:
                best[stage] = (name, ms)
for stage, (name, ms) in sorted(best.items()):
    print(f"best {stage}: {name} {ms:.3f} ms", file=sys.stderr)
bwd = ",".join(f"{s}={n}" for s, (n, _) in sorted(best.items()) if s.startswith("bwd_"))
fwd = ",".join(f"{s}={n}" for s, (n, _) in sorted(best.items()) if s.startswith("fwd_"))
print(bwd or "-", fwd or "-")
EOF
)
echo "chosen backward: $bwd"; echo "chosen forward: $fwd"
echo "$bwd" > "$OUT/chosen_backward.txt"; echo "$fwd" > "$OUT/chosen_forward.txt"
timeout ${TUNE_S:-150} .device/mixstack bench --preset "$preset" --reps 12 --variant relay --variant "relay:$bwd" \
  --forward-variant default --forward-variant "$fwd" --json "$OUT/chosen_$preset.json" > "$OUT/chosen_$preset.log" 2>&1
echo "chosen bench rc=$?"; grep -vE "^    " "$OUT/chosen_$preset.log"
# One archive: the device returns at most 8 files.
(cd "$OUT" && tar -czf "tune_$preset.tar.gz" "tune_$preset".{json,log} "chosen_$preset".{json,log} chosen_*.txt && \
  rm -f "tune_$preset".{json,log} "chosen_$preset".{json,log} chosen_*.txt)
