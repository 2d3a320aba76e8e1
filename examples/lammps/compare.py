#!/usr/bin/env python3
"""Energies and forces of frozen packages through DeePMD-kit's Python
DeepPot, on the box of water.data, against the first package given:

    python3 examples/lammps/compare.py model_upstream.pt2 model_mixstack.pt2 [--json FILE]

A mixstack package is evaluated twice, with MIXSTACK_STACK_BWD_FUSED=0 and
=1 (its backward reads the switch at each call): relay and fused, whose
forces must be bitwise equal. Reports the energy's relative difference and
the forces' relative L2 difference against the reference package.
"""

import argparse
import faulthandler
import json
import os

import numpy as np

import mixstack_torch.ops  # noqa: F401  registers mixstack::stack before a package calling it loads


def read_data(path):
    lines = open(path).read().splitlines()
    n = int(next(ln.split()[0] for ln in lines if ln.endswith(" atoms")))
    side = float(next(ln.split()[1] for ln in lines if ln.endswith("xlo xhi")))
    start = next(i for i, ln in enumerate(lines) if ln.startswith("Atoms")) + 2
    rows = [ln.split() for ln in lines[start : start + n]]
    atype = np.array([int(r[1]) - 1 for r in rows])
    coord = np.array([[float(x) for x in r[2:5]] for r in rows]).reshape(1, -1)
    box = (np.eye(3) * side).reshape(1, 9)
    return coord, box, atype


def evaluate(path, coord, box, atype):
    from deepmd.infer import DeepPot

    e, f, _v = DeepPot(path).eval(coord, box, atype)
    return np.asarray(e, dtype=np.float64).reshape(-1), np.asarray(f, dtype=np.float64).reshape(-1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--data", default="water.data")
    ap.add_argument("--json")
    a = ap.parse_args()
    coord, box, atype = read_data(a.data)
    runs = []  # (model, backward variant or None, energy, forces)
    for path in a.models:
        if "mixstack" in os.path.basename(path):
            for variant, fused in (("relay", "0"), ("fused", "1")):
                os.environ["MIXSTACK_STACK_BWD_FUSED"] = fused
                runs.append((path, variant, *evaluate(path, coord, box, atype)))
        else:
            runs.append((path, None, *evaluate(path, coord, box, atype)))
    name0, _, e0, f0 = runs[0]
    out = []
    for path, variant, e, f in runs:
        name = f"{path} ({variant})" if variant else path
        row = {
            "model": name,
            "energy": float(e[0]),
            "energy_rel": float(abs(e[0] - e0[0]) / max(abs(e0[0]), 1e-300)),
            "force_rel_l2": float(np.linalg.norm(f - f0) / max(np.linalg.norm(f0), 1e-300)),
            "force_norm": float(np.linalg.norm(f)),
        }
        out.append(row)
        print(f"{name}: energy {row['energy']:.10f} (rel {row['energy_rel']:.2e} vs {name0}), "
              f"forces rel L2 {row['force_rel_l2']:.2e}, |F| {row['force_norm']:.6f}")
    by_variant = {(path, variant): (e, f) for path, variant, e, f in runs}
    for path in dict.fromkeys(p for p, v, _, _ in runs if v):
        (e1, f1), (e2, f2) = by_variant[path, "relay"], by_variant[path, "fused"]
        same = bool(np.array_equal(f1, f2) and np.array_equal(e1, e2))
        print(f"{path}: relay vs fused energy and forces bitwise {'EQUAL' if same else 'DIFFERENT'}")
        out.append({"model": path, "relay_fused_bitwise": same})
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    faulthandler.enable()  # a crash loading a package prints where (BENCH.md, run 89)
    main()
