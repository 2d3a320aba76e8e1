"""Warp-stall samples of run 91's Nsight Compute source page (ncu_sass.csv.gz:
`ncu -i ncu.ncu-rep --page source --csv --print-source sass`), per kernel,
and for the split fused kernel per side: the consumers (the GEMM walk) and
the producers (the per-row work), split at the producers' first instruction
(after the consumers' final DEPBAR and EXIT) and cut into their phases
at the producers' named-barrier waits (BAR.SYNC 0x1).
    python3 bench/runs/run91/stalls.py"""
import csv
import gzip
import os

here = os.path.dirname(os.path.abspath(__file__))
rows = list(csv.reader(gzip.open(os.path.join(here, "ncu_sass.csv.gz"), "rt")))
# Every launch of a kernel, its instructions' counters summed by address
# (the relay's bwd_gemm runs twice per layer: the m0 and the m1 segment).
kernels = {}
for i, r in enumerate(rows):
    if r and r[0] == "Kernel Name":
        hdr, j = rows[i + 1], i + 2
        launch = []
        while j < len(rows) and rows[j] and rows[j][0] != "Kernel Name":
            launch.append(dict(zip(hdr, rows[j])))
            j += 1
        kernels.setdefault(r[1], []).append(launch)
SAMPLES = "Warp Stall Sampling (All Samples)"


def merged(launches):
    """One instruction list, each numeric counter summed over the launches."""
    out = []
    for k, first in enumerate(launches[0]):
        row = dict(first)
        for c in first:
            if c.startswith("stall_") or c in (SAMPLES, "Instructions Executed"):
                row[c] = str(sum(int(l[k][c]) for l in launches))
        out.append(row)
    return out


def summary(name, ins, tot):
    cols = [c for c in ins[0] if c.startswith("stall_") and "Not Issued" not in c]
    s = sum(int(r[SAMPLES]) for r in ins)
    ex = sum(int(r["Instructions Executed"]) for r in ins)
    ffma = sum(int(r["Instructions Executed"]) for r in ins if "FFMA" in r["Source"])
    agg = sorted(((sum(int(r[c]) for r in ins), c[6:]) for c in cols), reverse=True)
    top = ", ".join(f"{c} {100 * v / max(s, 1):.1f}%" for v, c in agg[:6])
    print(f"  {name}: {100 * s / tot:.1f}% of samples, {ex / 1e6:.0f}M warp instructions ({ffma / 1e6:.0f}M FFMA); {top}")


for name, launches in kernels.items():
    ins = merged(launches)
    tot = sum(int(r[SAMPLES]) for r in ins)
    print(f"{name} ({len(launches)} launches, summed)")
    summary("whole kernel", ins, tot)
    if "_px" not in name:
        continue
    split = 1 + next(k for k, r in enumerate(ins) if "DEPBAR" in ins[k - 1]["Source"] and r["Source"].strip() == "EXIT")
    # each phase ends with (and includes) its BAR.SYNC 0x1 wait
    bars = [k + 1 for k, r in enumerate(ins) if k > split and "BAR.SYNC.DEFER_BLOCKING 0x1," in r["Source"]]
    summary("consumers", ins[:split], tot)
    summary("producers", ins[split:], tot)
    cuts = [split] + bars + [len(ins)]
    names = ["producers: EMPTY wait, load s", "producers: sig", "producers: g_logit", "producers: gz_s",
             "producers: tail (FULL arrive, loops, exit)"]
    for n, (a, b) in zip(names, zip(cuts, cuts[1:])):
        summary(n, ins[a:b], tot)
    assert len(cuts) - 1 == len(names), f"{len(cuts) - 1} phases, {len(names)} names"
