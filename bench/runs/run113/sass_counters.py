#!/usr/bin/env python3
"""Run 113's reading of Nsight Compute's per-SASS-instruction CSV (.csv or
.csv.gz from `ncu --page source --csv --print-source sass`).

  sass_counters.py FILE ops            executed warp instructions per opcode
  sass_counters.py FILE blocks         the heaviest straight-line blocks
                                       (runs of equal execution count)
  sass_counters.py FILE split ROW      instructions, FFMAs and stall samples
                                       before / from instruction ROW (the
                                       consumers' code ends at their EXIT)

"Instructions Executed" counts predicated-off instructions too: a
predicated FFMA takes its issue slot whether or not it computes.
"""
import collections
import csv
import gzip
import sys


def rows(fn):
    f = gzip.open(fn, "rt") if fn.endswith(".gz") else open(fn)
    r = list(csv.reader(f))
    hdr = r[1]
    return hdr, r[2:]


def opcode(src):
    w = src.split()
    if not w:
        return "?"
    return (w[1] if w[0].startswith("@") else w[0]).split(".")[0]


def main():
    fn, what = sys.argv[1], sys.argv[2]
    hdr, data = rows(fn)
    ie, src = hdr.index("Instructions Executed"), hdr.index("Source")
    smp = hdr.index("Warp Stall Sampling (All Samples)")
    n = [int(r[ie]) if r[ie].isdigit() else 0 for r in data]
    s = [int(r[smp]) if r[smp].isdigit() else 0 for r in data]
    ops = [opcode(r[src]) for r in data]
    if what == "ops":
        c, cs = collections.Counter(), collections.Counter()
        for o, k, t in zip(ops, n, s):
            c[o] += k
            cs[o] += t
        print("total %.0fM instructions, %d samples" % (sum(n) / 1e6, sum(s)))
        for o, k in c.most_common(22):
            print("  %-8s %8.1fM  samples %5.1f%%" % (o, k / 1e6, 100 * cs[o] / sum(s)))
    elif what == "blocks":
        blocks = []
        for i, (o, k, t) in enumerate(zip(ops, n, s)):
            if blocks and blocks[-1]["n"] == k:
                b = blocks[-1]
            else:
                b = {"at": i, "n": k, "len": 0, "s": 0, "ops": collections.Counter()}
                blocks.append(b)
            b["len"] += 1
            b["s"] += t
            b["ops"][o] += 1
        for b in sorted(blocks, key=lambda b: -b["n"] * b["len"])[:25]:
            print("%5d len %4d  exec %9d  inst %7.1fM  samples %6d  %s"
                  % (b["at"], b["len"], b["n"], b["n"] * b["len"] / 1e6, b["s"], dict(b["ops"].most_common(6))))
    elif what == "split":
        cut = int(sys.argv[3])
        for name, sl in (("before", slice(0, cut)), ("from", slice(cut, None))):
            k = sum(n[sl])
            f = sum(x for x, o in zip(n[sl], ops[sl]) if o == "FFMA")
            print("%s %d: %.0fM instructions, %.0fM FFMA, %d samples" % (name, cut, k / 1e6, f / 1e6, sum(s[sl])))


main()
