#!/usr/bin/env python3
"""Energies and forces of frozen packages through DeePMD-kit's Python
DeepPot, on the box of water.data, against the first package given:

    python3 examples/lammps/compare.py model_upstream.pt2 model_mixstack.pt2 [--json FILE]

A mixstack package is evaluated twice, with MIXSTACK_STACK_BWD_FUSED=0 and
=always (its backward reads the switch at each call): relay and fused, whose
forces must be bitwise equal. Reports the energy's relative difference and
the forces' relative L2 difference against the reference package.

Each evaluation runs in a process of its own (`--one`), and only a package
that calls mixstack's op loads mixstack: a crash loading a package (run 89
saw one inside torch's aoti_load_package) is then reported for that package
alone, with its exit status and stack, and the others still compare.
"""

import argparse
import faulthandler
import json
import os
import subprocess
import sys
import tempfile
import zipfile

import numpy as np


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


def calls_mixstack(path):
    """Whether a package's graph names mixstack's op."""
    with zipfile.ZipFile(path) as z:
        return any(b"mixstack::stack" in z.read(n) for n in z.namelist() if n.endswith((".json", ".pt2", ".py")))


def evaluate_here(path, data, out):
    """--one: evaluate one package in this process, save (energy, forces)."""
    if calls_mixstack(path):
        import mixstack_torch.ops  # noqa: F401  registers mixstack::stack before the package loads
    from deepmd.infer import DeepPot

    coord, box, atype = read_data(data)
    e, f, _v = DeepPot(path).eval(coord, box, atype)
    np.savez(out, e=np.asarray(e, dtype=np.float64).reshape(-1), f=np.asarray(f, dtype=np.float64).reshape(-1))


def evaluate(path, data, fused=None):
    """(energy, forces) of one package from a fresh process, or None where it failed."""
    env = dict(os.environ)
    if fused is not None:
        env["MIXSTACK_STACK_BWD_FUSED"] = fused
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "ef.npz")
        r = subprocess.run([sys.executable, "-X", "faulthandler", __file__, "--one", path, "--data", data, "--out", out],
                           env=env, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"{path}: evaluation failed, exit status {r.returncode}:\n{r.stderr[-3000:]}", flush=True)
            return None
        ef = np.load(out)
        return ef["e"], ef["f"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*")
    ap.add_argument("--data", default="water.data")
    ap.add_argument("--json")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        return evaluate_here(a.one, a.data, a.out)
    runs = []  # (model, backward variant or None, energy, forces)
    failed = []
    for path in a.models:
        variants = (("relay", "0"), ("fused", "always")) if calls_mixstack(path) else ((None, None),)
        for variant, fused in variants:
            ef = evaluate(path, a.data, fused)
            if ef is None:
                failed.append(f"{path} ({variant})" if variant else path)
            else:
                runs.append((path, variant, *ef))
    if not runs:
        sys.exit(f"no package could be evaluated: {', '.join(failed)}")
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
        if (path, "relay") not in by_variant or (path, "fused") not in by_variant:
            continue
        (e1, f1), (e2, f2) = by_variant[path, "relay"], by_variant[path, "fused"]
        same = bool(np.array_equal(f1, f2) and np.array_equal(e1, e2))
        print(f"{path}: relay vs fused energy and forces bitwise {'EQUAL' if same else 'DIFFERENT'}")
        out.append({"model": path, "relay_fused_bitwise": same})
    out.extend({"model": name, "failed": True} for name in failed)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    faulthandler.enable()  # a crash loading a package prints where (BENCH.md, run 89)
    main()
