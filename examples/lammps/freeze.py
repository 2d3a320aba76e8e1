#!/usr/bin/env python3
"""Freezes the checkpoint of make_model.py into an AOTInductor package, as
`dp --pt-expt freeze` does (deepmd.pt_expt's freeze: the graph lower,
with the per-rank communication artifact LAMMPS needs for several ranks),
in one process so that the stack op is chosen here:

    python3 examples/lammps/freeze.py --stack mixstack -o model_mixstack.pt2
    python3 examples/lammps/freeze.py --stack upstream -o model_upstream.pt2

`--stack mixstack` installs mixstack's DeePMD-kit drop-in with path "auto"
before the model is rebuilt, so the package calls `mixstack::stack` by name
and its backward reads MIXSTACK_STACK_BWD_FUSED at each call (relay or fused
is chosen when the model runs, not here). `--stack upstream` keeps
DeePMD-kit's Triton stack (compiled into the package). Both at
DP_TRITON_INFER=2 (fp32), read when the model is built. Freeze on the GPU
machine: the trace runs on the CPU, the compile is for the device.

Afterwards the package's files are searched for the op's name: a mixstack
package must name `mixstack::stack`, an upstream one must not.
"""

import argparse
import json
import os
import time
import zipfile

os.environ["DP_TRITON_INFER"] = "2"  # before DeePMD-kit builds a model

import torch  # noqa: E402


def names_op(pt2, name=b"mixstack::stack"):
    """Members of the package whose bytes contain the op's name."""
    with zipfile.ZipFile(pt2) as z:
        return [i.filename for i in z.infolist() if name in z.read(i.filename)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stack", choices=["mixstack", "upstream"], required=True)
    ap.add_argument("--ckpt", default="model.ckpt.pt")
    ap.add_argument("-o", "--output", required=True)
    a = ap.parse_args()
    if a.stack == "mixstack":
        import mixstack_torch.deepmd as dropin

        dropin.install("auto")
    from deepmd.pt_expt.model.get_model import get_model
    from deepmd.pt_expt.train.wrapper import ModelWrapper
    from deepmd.pt_expt.utils.serialization import deserialize_to_file

    state = torch.load(a.ckpt, map_location="cpu", weights_only=True)["model"]
    cfg = state["_extra_state"]["model_params"]
    model = get_model(json.loads(json.dumps(cfg)))
    ModelWrapper(model).load_state_dict(state)
    model.eval()
    t0 = time.time()
    deserialize_to_file(
        a.output, {"model": model.serialize(), "model_def_script": cfg}, do_atomic_virial=True, lower_kind="graph"
    )
    named = names_op(a.output)
    print(f"froze {a.output} ({a.stack}) in {time.time() - t0:.0f} s; members naming mixstack::stack: {named}")
    if a.stack == "mixstack":
        fell = dropin.fallbacks()
        assert not fell, f"the drop-in fell back to upstream's op while tracing: {fell}"
        assert named, "the mixstack package does not name mixstack::stack"
    else:
        assert not named, f"the upstream package names mixstack::stack: {named}"


if __name__ == "__main__":
    main()
