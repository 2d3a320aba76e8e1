#!/usr/bin/env python3
"""The LAMMPS runs of scripts/lammps-on-device.sh, side by side: time per
step (LAMMPS's loop time over the steps), total-energy drift over the run
(per atom), and the first step's energy and forces (relative L2 over every
atom, from the dumps) against upstream's run on the fewest ranks that left a
log (energy) and a dump (forces).

    python3 examples/lammps/summarize.py OUTDIR
"""

import glob
import os
import re
import sys

import numpy as np


def thermo(log):
    """(steps, atoms, loop seconds, [(step, pe, etotal)]) of a LAMMPS log."""
    text = open(log).read()
    loop = re.search(r"Loop time of ([0-9.eE+-]+) on (\d+) procs for (\d+) steps with (\d+) atoms", text)
    rows, cols = [], None
    for ln in text.splitlines():
        parts = ln.split()
        if parts[:2] == ["Step", "PotEng"]:
            cols = parts
            continue
        if cols and len(parts) == len(cols):
            try:
                vals = [float(x) for x in parts]
            except ValueError:
                cols = None
                continue
            rows.append((int(vals[0]), vals[cols.index("PotEng")], vals[cols.index("TotEng")]))
    if not loop:
        return None
    return int(loop.group(3)), int(loop.group(4)), float(loop.group(1)), rows


def first_forces(dump):
    lines = open(dump).read().splitlines()
    n = int(lines[3])
    rows = sorted((int(r.split()[0]), [float(x) for x in r.split()[2:5]]) for r in lines[9 : 9 + n])
    return np.array([f for _, f in rows])


def main(out):
    # The reference: upstream's run on the fewest ranks that left a log (for
    # the energy) and a dump (for the forces).
    def upstream(kind):
        found = sorted(glob.glob(os.path.join(out, f"*upstream_np*.{kind}")),
                       key=lambda p: int(re.search(r"_np(\d+)", p).group(1)))
        return (found[0], re.search(r"_np(\d+)", found[0]).group(1)) if found else (None, "-")
    f_path, f_np = upstream("dump")
    e_path, e_np = upstream("log")
    f_ref = first_forces(f_path) if f_path else None
    e_ref = None
    if e_path and thermo(e_path):
        e_ref = thermo(e_path)[3][0][1]
    print(f"| variant | ranks | ms / step | first-step energy (eV) | energy vs upstream np{e_np} (rel) "
          f"| forces vs upstream np{f_np} (rel L2) | drift of etotal (eV / atom, whole run) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    def run_of(path):  # (variant, ranks) of lmp_VARIANT_npN.log
        variant, ranks = re.match(r"lmp_(\w+)_np(\d+)\.log", os.path.basename(path)).groups()
        return variant, ranks

    # ranks, then upstream first (the reference)
    logs = sorted(glob.glob(os.path.join(out, "lmp_*_np*.log")),
                  key=lambda p: (int(run_of(p)[1]), run_of(p)[0] != "upstream", run_of(p)[0]))
    for log in logs:
        variant, ranks = run_of(log)
        t = thermo(log)
        if t is None:
            print(f"| {variant} | {ranks} | failed: see {os.path.basename(log)}.out | | | | |")
            continue
        steps, atoms, loop_s, rows = t
        e0 = rows[0][1]
        drift = (rows[-1][2] - rows[0][2]) / atoms
        dump = os.path.join(out, f"forces_{variant}_np{ranks}.dump")
        frel = ""
        if f_ref is not None and os.path.exists(dump):
            f = first_forces(dump)
            frel = f"{np.linalg.norm(f - f_ref) / max(np.linalg.norm(f_ref), 1e-300):.2e}"
        erel = f"{abs(e0 - e_ref) / max(abs(e_ref), 1e-300):.2e}" if e_ref is not None else ""
        print(f"| {variant} | {ranks} | {1000 * loop_s / steps:.2f} | {e0:.8f} | {erel} | {frel} | {drift:.3e} |")


if __name__ == "__main__":
    main(sys.argv[1])
