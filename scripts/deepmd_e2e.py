#!/usr/bin/env python3
"""A DeePMD-kit DPA4 / SeZM model end to end: upstream's Triton stack
(DP_TRITON_INFER=2, fp32) against mixstack relay and mixstack fused
("fused_always": the fused kernels wherever they serve) through the drop-in
(mixstack_torch.deepmd), in one process.

    python3 scripts/deepmd_e2e.py [--atoms 4096] [--reps 10] [--warmup 3] [--json FILE]

The model is built with DeePMD-kit's own API from the water example's DPA4
shape (n_focus 2, channels 32, lmax 3, mixing_layers 3, n_blocks 2, rcut
7.2), random but fixed weights (seed 42), one instance per variant with the
same state_dict (the stack op is taken when a value path is built). The
system: water at 0.1 atoms / A^3 in a periodic cube (random molecules, fixed
seed); neighbour lists as DeePMD-kit builds them (vesin). Per variant:
energy and forces against upstream's (relative, forces in L2), the median
of `reps` warm energy + force evaluations (interleaved across variants), the
stack's own GPU time per evaluation from a profile (kernels `ms_*` for
mixstack, upstream's `_stack_*`), torch's peak allocation and the device's
used memory. On a machine without CUDA it runs on the CPU, where every
variant is upstream's reference (a check of the script, not a measurement).
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

os.environ.setdefault("DP_TRITON_INFER", "2")  # read when the model is built

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

MODEL = {
    "type": "DPA4",
    "type_map": ["O", "H"],
    "descriptor": {
        "rcut": 7.2,
        "channels": 32,
        "lmax": 3,
        "mmax": 1,
        "n_blocks": 2,
        "mixing_layers": 3,
        "n_focus": 2,
        "precision": "float32",
        "seed": 42,
    },
    "fitting_net": {"neuron": [0], "precision": "float32", "seed": 42},
}


def build_model(state=None):
    from deepmd.pt.model.model import get_model
    from deepmd.utils.argcheck import model_args

    base = model_args()
    cfg = base.normalize_value(json.loads(json.dumps(MODEL)), trim_pattern="_*")
    base.check_value(cfg, strict=False)
    torch.manual_seed(42)
    m = get_model(cfg)
    if state is not None:
        m.load_state_dict(state)
    return m.eval()


def nonzero_state(state, scale=0.05, seed=42):
    """DeePMD-kit initialises some layers to zero (residual branches): a
    mixing stack of zero weights is an identity whatever kernel runs it, and
    run 71 saw energies and forces bitwise equal across implementations.
    Fill every all-zero floating tensor with fixed normal noise, so the
    comparison exercises the stack's arithmetic. Returns (state, names)."""
    g = torch.Generator().manual_seed(seed)
    out, filled = {}, []
    for k, v in state.items():
        if v.is_floating_point() and v.numel() > 1 and not v.any():
            v = (torch.randn(v.shape, generator=g, dtype=torch.float64) * scale).to(v.dtype)
            filled.append(k)
        out[k] = v
    return out, filled


def water_box(n_atoms, density=0.1, seed=0):
    g = torch.Generator().manual_seed(seed)
    n_mol = n_atoms // 3
    side = (3 * n_mol / density) ** (1 / 3)
    o = torch.rand(n_mol, 3, generator=g, dtype=torch.float64) * side
    d = torch.randn(n_mol, 2, 3, generator=g, dtype=torch.float64)
    h = o[:, None, :] + 0.9572 * d / d.norm(dim=-1, keepdim=True)
    coord = (torch.cat([o[:, None, :], h], dim=1).reshape(-1, 3) % side).float()
    atype = torch.tensor([0, 1, 1] * n_mol)
    box = (torch.eye(3) * side).reshape(1, 9)
    return coord[None], atype[None], box


def upstream_tables():
    """DeePMD-kit 3.2.0 ships tuned tile tables for the GPUs its maintainers
    swept (the H20, sm_90); a GPU without its own table (the H100 and H200)
    would run upstream's kernels at their untuned fallbacks. Register the
    H20's tables there, as the issue asks, and say which were used."""
    if not torch.cuda.is_available():
        return "none (no CUDA)"
    from deepmd.kernels.triton.sezm import tile_configs as tc
    from deepmd.kernels.triton.sezm.tile_config_data import BUILTIN_TILE_CONFIGS

    name = torch.cuda.get_device_name()
    if name in BUILTIN_TILE_CONFIGS:
        return f"{name} (built in)"
    for family, table in BUILTIN_TILE_CONFIGS["NVIDIA H20"].items():
        if family in tc.TILE_CONFIG_FAMILIES:
            tc.register_tile_configs(family, table)
    return "NVIDIA H20 (built in, registered for this GPU)"


def evaluate(model, coord, atype, box):
    out = model(coord, atype, box=box)
    return out["energy"].detach(), out["force"].detach()


def rel(a, b):
    return (a.double() - b.double()).norm().item() / max(b.double().norm().item(), 1e-300)


def stack_ms(model, args, dev, prefixes):
    """GPU time per evaluation of the kernels whose names start with `prefixes`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        evaluate(model, *args)
        torch.cuda.synchronize(dev)
    total = 0.0
    for e in prof.key_averages():
        if e.key.startswith(prefixes):
            total += getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0.0))
    return total / 1000.0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--atoms", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--variants", default="upstream,relay,fused_always")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()

    import mixstack_torch.deepmd as dropin

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    names = a.variants.split(",")
    tables = upstream_tables()
    models = {}
    reference = build_model()
    state, filled = nonzero_state(reference.state_dict())
    for name in names:
        if name == "upstream":
            dropin.uninstall()
        else:
            dropin.install(name)
        models[name] = build_model(state).to(dev)
    dropin.uninstall()

    coord, atype, box = (t.to(dev) for t in water_box(a.atoms))
    args = (coord, atype, box)
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    results = {n: {"times_ms": []} for n in names}
    for n in names:
        for _ in range(a.warmup):
            evaluate(models[n], *args)
    sync()
    for _ in range(a.reps):  # interleaved, so drift hits every variant alike
        for n in names:
            sync()
            t0 = time.perf_counter()
            evaluate(models[n], *args)
            sync()
            results[n]["times_ms"].append((time.perf_counter() - t0) * 1e3)
    base_e, base_f = evaluate(models[names[0]], *args)
    for n in names:
        e, f = evaluate(models[n], *args)
        r = results[n]
        r["energy"] = e.double().sum().item()
        r["energy_rel"] = abs(r["energy"] - base_e.double().sum().item()) / abs(base_e.double().sum().item())
        r["force_rel_l2"] = rel(f, base_f)
        r["median_ms"] = statistics.median(r["times_ms"])
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
            evaluate(models[n], *args)
            sync()
            r["torch_peak_bytes"] = torch.cuda.max_memory_allocated(dev)
            free, total = torch.cuda.mem_get_info(dev)
            r["device_used_bytes"] = total - free
            r["stack_ms"] = stack_ms(models[n], args, dev, ("_stack_",) if n == "upstream" else ("ms_",))
    header = {
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu (no CUDA: upstream reference everywhere)",
        "torch": torch.__version__,
        "atoms": a.atoms,
        "reps": a.reps,
        "warmup": a.warmup,
        "fallbacks": dropin.fallbacks(),
        "upstream_tile_tables": tables,
        "zero_tensors_filled": len(filled),
    }
    print(json.dumps(header))
    print(f"{'variant':<13} {'median ms':>10} {'stack ms':>9} {'E rel':>9} {'F rel L2':>9} {'torch peak GB':>13} {'used GB':>8}")
    for n in names:
        r = results[n]
        print(
            f"{n:<13} {r['median_ms']:>10.2f} {r.get('stack_ms', math.nan):>9.2f} {r['energy_rel']:>9.1e} "
            f"{r['force_rel_l2']:>9.1e} {r.get('torch_peak_bytes', 0) / 1e9:>13.2f} {r.get('device_used_bytes', 0) / 1e9:>8.2f}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"header": header, "results": results}, f, indent=1)
    bad = [n for n in names if results[n]["energy_rel"] > 1e-6 or results[n]["force_rel_l2"] > 1e-5]
    if bad:
        print(f"FAIL: {bad} outside 1e-6 (energy) / 1e-5 (forces, L2) of {names[0]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
