#!/usr/bin/env python3
"""A DPA4 checkpoint for DeePMD-kit's pt_expt backend (what
`dp --pt-expt freeze` and freeze.py read), and a water box for LAMMPS: the water example's descriptor shape (the model of
scripts/deepmd_e2e.py: n_focus 2, channels 32, lmax 3, mixing_layers 3,
n_blocks 2, rcut 7.2), fixed random weights (seed 42; DeePMD-kit's zero-
initialised residual branches filled with fixed noise, so that the mixing
stack's arithmetic shows in energies and forces). Untrained: a potential to
exercise the route, not physics.

    python3 examples/lammps/make_model.py [--atoms 648] [--ckpt model.ckpt.pt] [--data water.data]

The box: water at 0.1 atoms / A^3 (scripts/deepmd_e2e.py's water_box), 648
atoms by default, an 18.6 A cube: wide enough that each of two MPI ranks
owns atoms (LAMMPS splits the box in two).
"""

import argparse

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "scripts"))
from deepmd_e2e import MODEL, nonzero_state, water_box  # noqa: E402


def write_data(path, n_atoms):
    """A LAMMPS data file (atom_style atomic, metal units: A) of the box."""
    coord, atype, box = water_box(n_atoms)
    side = float(box[0, 0])
    with open(path, "w") as f:
        f.write(f"water box for a DPA4 model ({n_atoms} atoms, examples/lammps/make_model.py)\n\n")
        f.write(f"{coord.shape[1]} atoms\n2 atom types\n\n")
        for ax in "xyz":
            f.write(f"0.0 {side:.6f} {ax}lo {ax}hi\n")
        f.write("\nMasses\n\n1 15.9994\n2 1.00794\n\nAtoms # atomic\n\n")
        for i, (t, (x, y, z)) in enumerate(zip(atype[0].tolist(), coord[0].tolist()), 1):
            f.write(f"{i} {t + 1} {x:.6f} {y:.6f} {z:.6f}\n")
    print(f"wrote {path} ({coord.shape[1]} atoms, box {side:.3f} A)")


def write_checkpoint(out):
    from deepmd.pt_expt.model.get_model import get_model
    from deepmd.pt_expt.train.wrapper import ModelWrapper
    from deepmd.utils.argcheck import model_args

    base = model_args()
    cfg = base.normalize_value(json.loads(json.dumps(MODEL)), trim_pattern="_*")
    base.check_value(cfg, strict=False)
    torch.manual_seed(42)
    model = get_model(json.loads(json.dumps(cfg)))
    state, filled = nonzero_state(model.state_dict())
    model.load_state_dict(state)
    wrapper = ModelWrapper(model, model_params=cfg)
    torch.save({"model": wrapper.state_dict()}, out)
    print(f"wrote {out} ({len(filled)} zero-initialised tensors filled)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--atoms", type=int, default=648)
    ap.add_argument("--ckpt", default="model.ckpt.pt")
    ap.add_argument("--data", default="water.data")
    a = ap.parse_args()
    write_checkpoint(a.ckpt)
    write_data(a.data, a.atoms)
