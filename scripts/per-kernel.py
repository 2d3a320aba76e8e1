#!/usr/bin/env python3
"""Per-stage sums of the per-kernel times in `mixstack bench --json` files
(one extra call per variant): one line per forward variant and backward
variant, its median, its ratio to the file's first, the tiles it ran and each
stage's milliseconds over all its launches.
Usage: scripts/per-kernel.py RUN.json [RUN.json ...]"""
import collections
import json
import re
import sys

for f in sys.argv[1:]:
    d = json.load(open(f))
    print(f"## {f} ({d['device']})")
    for sec in ("forward_variants", "backward"):
        base = None
        for v in d.get(sec, []):
            agg = collections.OrderedDict()
            for stage, _, ms in v["per_kernel"]:
                agg[stage] = agg.get(stage, 0.0) + ms
            # the GEMM tiles (m.._n.._k..), not the row stages'
            tiles = sorted({m.group(0) for _, n, _ in v["per_kernel"] if (m := re.search(r"m\d+_n\d+_k\d+_\w+", n))})
            base = base or v["median_ms"]
            stages = " ".join(f"{k} {x:.3f}" for k, x in agg.items())
            print(f"  {sec[:3]} {v['median_ms']:.3f} ({v['median_ms'] / base:.3f}) {' '.join(tiles)}: {stages}")
