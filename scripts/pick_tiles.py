#!/usr/bin/env python3
"""Reads a sweep JSON (scripts/sweep.sh) and prints two bench variants made
of the fastest measured kernel per stage (by that stage's summed per-kernel
time across the sweep): the relay (bwd_gemm, bwd_final) and the fused path
(bwd_fused_m0, bwd_fused_m1, and the relay's bwd_final)."""
import json
import sys


def main(path):
    runs = json.load(open(path))["backward"]
    best = {}  # stage -> (ms, kernel)
    for r in runs:
        per_stage = {}
        for stage, kernel, ms in r["per_kernel"]:
            ms0, _ = per_stage.get(stage, (0.0, kernel))
            per_stage[stage] = (ms0 + ms, kernel)
        for stage, (ms, kernel) in per_stage.items():
            if stage not in best or ms < best[stage][0]:
                best[stage] = (ms, kernel)
    pick = lambda stages: ",".join(f"{s}={best[s][1]}" for s in stages if s in best)
    print("relay:" + pick(["bwd_gemm", "bwd_final"]))
    print("fused:" + pick(["bwd_fused_m0", "bwd_fused_m1", "bwd_final"]))


if __name__ == "__main__":
    main(sys.argv[1])
