#!/usr/bin/env python3
"""Tests of the PyTorch op (mixstack_torch) against the eager reference.

Run on a CUDA machine, from the repository root, either way:

    MIXSTACK_LIB=$PWD/.device/libmixstack.so python3 python/tests/test_torch_op.py [--bench]
    MIXSTACK_LIB=$PWD/.device/libmixstack.so python3 -m pytest -q python/tests

As a script it prints one PASS/FAIL line per test and exits non-zero on any
failure; without torch or without a CUDA device it prints SKIP and exits 0.
``--bench`` then times eager vs mixstack relay vs mixstack fused forward and
backward at the seed workload (F=2, E=646000, Cf=32, lmax=3, n_layers=3,
apply_alpha, float32) with CUDA events; ``--bench-only`` skips the tests;
``--repeats N`` (default 10) and ``--warmup N`` (default 3).
"""

import contextlib
import faulthandler
import os
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # python/, for mixstack_torch

try:
    import torch
except ImportError:  # pragma: no cover - depends on the machine
    torch = None


def _skip_reason():
    if torch is None:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch.cuda is not available (no CUDA device)"
    return None


if __name__ != "__main__" and _skip_reason():
    import pytest

    pytest.skip(_skip_reason(), allow_module_level=True)

if torch is not None:
    import mixstack_torch as mt
    from mixstack_torch import reference as ref

FUSED_ENV = "MIXSTACK_STACK_BWD_FUSED"
PRECISION_ENV = "MIXSTACK_PRECISION"
TOL_F64 = 1e-10
TOL_F32 = 1e-5


# ----------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------


@contextlib.contextmanager
def _env_restored(name):
    """Restores the environment variable `name` as it was, however the block ends."""
    saved = os.environ.get(name)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def _tf32_off():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def rel(a, b):
    """||a - b|| / ||b|| in float64 (0 when both are zero; inf on non-finite)."""
    a, b = a.detach().double(), b.detach().double()
    assert a.shape == b.shape, f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("inf")
    nb = b.norm().item()
    d = (a - b).norm().item()
    if nb == 0.0:
        return 0.0 if d == 0.0 else float("inf")
    return d / nb


def make_case(F, E, cf, L, n_layers, dtype, seed=0, device="cuda"):
    """Random inputs: u0, alpha in (0.5, 1.5), weights scaled 1/sqrt(fan_in), grad_out."""
    g = torch.Generator().manual_seed(seed)
    row, m0, m1, lg = ref.dims(L, cf)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype=dtype, device=device)

    c = {
        "u0": rnd(F, E, row),
        "alpha": (0.5 + torch.rand(E, F, generator=g, dtype=torch.float64)).to(dtype=dtype, device=device),
        "w0_all": rnd(n_layers, F, m0, m0, scale=m0 ** -0.5),
        "w1_all": rnd(n_layers, F, m1, m1, scale=m1 ** -0.5),
        "gw_all": rnd(n_layers - 1, F, cf, lg, scale=cf ** -0.5),
        "grad_out": rnd(E, F, row),
        "lmax": L,
        "focus_dim": cf,
    }
    return c


def op_fwd_bwd(c, apply_alpha, path, dtype=None):
    """Through the op: (out, z_all, grad_u0, grad_alpha)."""
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    u0 = cast(c["u0"]).detach().clone().requires_grad_(True)
    alpha = cast(c["alpha"]).detach().clone().requires_grad_(True)
    out, z_all = mt.mixstack_stack(
        u0, alpha, cast(c["w0_all"]), cast(c["w1_all"]), cast(c["gw_all"]), c["lmax"], c["focus_dim"],
        apply_alpha, path=path,
    )
    gu, ga = torch.autograd.grad(out, (u0, alpha), cast(c["grad_out"]))
    return out.detach(), z_all.detach(), gu, ga


def ref_all(c, apply_alpha, dtype):
    """Reference in `dtype`: (out, z_all, grad_u0 closed form, grad_alpha closed form,
    grad_u0 autograd, grad_alpha autograd)."""
    t = {k: (v.to(dtype) if isinstance(v, torch.Tensor) else v) for k, v in c.items()}
    args = (t["w0_all"], t["w1_all"], t["gw_all"], t["lmax"], t["focus_dim"], apply_alpha)
    with torch.no_grad():
        out, z_all = ref.forward(t["u0"], t["alpha"], *args)
        gu, ga = ref.backward(t["grad_out"], out, z_all, t["alpha"], *args)
    gu_ad, ga_ad = ref.autograd_backward(t["u0"], t["alpha"], *args, t["grad_out"])
    return out, z_all, gu, ga, gu_ad, ga_ad


def case_name(F, E, cf, L, n, apply_alpha, dtype, path):
    return f"{str(dtype).replace('torch.', '')} F={F} E={E} Cf={cf} L={L} n_layers={n} alpha={int(apply_alpha)} {path}"


def check_close(name, errs, tol):
    line = "  " + name + ": " + " ".join(f"{k} {v:.2e}" for k, v in errs.items())
    print(line)
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"{name}: rel. error above {tol:.0e}: {bad}"


# ----------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------


def test_library_loads():
    print(f"  {mt.library_path()}: ABI {mt.abi_version()}")
    assert mt.abi_version() == mt.ABI_VERSION


def test_reference_closed_form_matches_autograd():
    _tf32_off()
    for F, E, cf, L, n, aa in [(2, 300, 32, 3, 3, True), (1, 200, 64, 2, 2, False), (2, 100, 32, 1, 1, True)]:
        c = make_case(F, E, cf, L, n, torch.float64, seed=11)
        _, _, gu, ga, gu_ad, ga_ad = ref_all(c, aa, torch.float64)
        check_close(
            "reference " + case_name(F, E, cf, L, n, aa, torch.float64, "closed form vs autograd"),
            {"grad_u0": rel(gu, gu_ad), "grad_alpha": rel(ga, ga_ad)},
            1e-12,
        )


F64_CASES = [
    # F, E, Cf, L, n_layers, apply_alpha, path
    (2, 1000, 32, 3, 3, True, "relay"),
    (1, 777, 64, 2, 2, False, "auto"),
    (2, 513, 32, 1, 1, True, "relay"),
    (3, 300, 96, 2, 3, True, "relay"),
    (1, 257, 128, 1, 2, True, "relay"),
    (2, 129, 32, 6, 2, True, "relay"),
    (1, 1, 32, 2, 4, True, "relay"),
]


def test_op_vs_eager_fp64():
    _tf32_off()
    saved = os.environ.pop(FUSED_ENV, None)
    try:
        for i, (F, E, cf, L, n, aa, path) in enumerate(F64_CASES):
            c = make_case(F, E, cf, L, n, torch.float64, seed=100 + i)
            out, z, gu, ga = op_fwd_bwd(c, aa, path)
            r_out, r_z, r_gu, r_ga, ad_gu, ad_ga = ref_all(c, aa, torch.float64)
            errs = {
                "out": rel(out, r_out),
                "z_all": rel(z, r_z),
                "grad_u0": rel(gu, r_gu),
                "grad_alpha": rel(ga, r_ga),
                "grad_u0(autograd)": rel(gu, ad_gu),
                "grad_alpha(autograd)": rel(ga, ad_ga),
            }
            check_close(case_name(F, E, cf, L, n, aa, torch.float64, path), errs, TOL_F64)
            assert mt.last_backward_path()[0] == "relay", mt.last_backward_path()
    finally:
        if saved is not None:
            os.environ[FUSED_ENV] = saved


F32_CASES = [
    (2, 4099, 32, 3, 3, True, "relay"),
    (2, 4099, 32, 3, 3, True, "fused_always"),
    (2, 4099, 32, 3, 3, True, "fused"),  # fused where measured faster on this GPU, else the relay
    (1, 1000, 64, 2, 3, False, "fused_always"),
    (2, 500, 96, 1, 2, True, "relay"),
    (1, 300, 128, 2, 2, True, "fused_always"),  # falls back to the relay (Cf >= 96)
]

NOT_FASTER = "not measured faster"


def _check_on_path(got):
    """The switch's plain "on": the fused backward, or the relay because
    this GPU's measured regime does not list the shape (and says so)."""
    assert got[0] == "fused" or (got[0] == "relay" and NOT_FASTER in got[1]), got


def test_op_vs_eager_fp32():
    _tf32_off()
    for i, (F, E, cf, L, n, aa, path) in enumerate(F32_CASES):
        c = make_case(F, E, cf, L, n, torch.float32, seed=200 + i)
        out, z, gu, ga = op_fwd_bwd(c, aa, path)
        # The truth: the reference in float64 on the same (float32) inputs.
        r_out, r_z, r_gu, r_ga, _, _ = ref_all(c, aa, torch.float64)
        # The eager float32 reference, for comparison.
        e_out, e_z, e_gu, e_ga, _, _ = ref_all(c, aa, torch.float32)
        errs = {
            "out": rel(out, r_out),
            "z_all": rel(z, r_z),
            "grad_u0": rel(gu, r_gu),
            "grad_alpha": rel(ga, r_ga),
            "out(vs eager f32)": rel(out, e_out),
            "grad_u0(vs eager f32)": rel(gu, e_gu),
            "grad_alpha(vs eager f32)": rel(ga, e_ga),
        }
        check_close(case_name(F, E, cf, L, n, aa, torch.float32, path), errs, TOL_F32)
        got = mt.last_backward_path()
        print(f"    backward path: {got[0]} ({got[1]})")
        if path == "fused":
            _check_on_path(got)
            continue
        want = "fused" if (path == "fused_always" and cf < 96) else "relay"
        assert got[0] == want, f"expected the {want} path, got {got}"


def test_gradcheck_fp64():
    for F, E, cf, L, n, aa in [(2, 3, 32, 1, 2, True), (1, 2, 32, 2, 3, True), (1, 3, 32, 1, 2, False)]:
        c = make_case(F, E, cf, L, n, torch.float64, seed=300)
        u0 = c["u0"].detach().clone().requires_grad_(True)
        alpha = c["alpha"].detach().clone().requires_grad_(True)

        def fn(u, a):
            return mt.mixstack_stack(u, a, c["w0_all"], c["w1_all"], c["gw_all"], L, cf, aa, path="relay")[0]

        ok = torch.autograd.gradcheck(fn, (u0, alpha), eps=1e-6, atol=1e-6, rtol=1e-4, raise_exception=True)
        assert ok
        print(f"  gradcheck {case_name(F, E, cf, L, n, aa, torch.float64, 'relay')}: ok")


def test_relay_fused_bitwise():
    for F, E, cf, L, n in [(2, 5003, 32, 3, 3), (1, 2000, 64, 2, 3), (2, 1000, 32, 6, 2)]:
        c = make_case(F, E, cf, L, n, torch.float32, seed=400)
        o_r, z_r, gu_r, ga_r = op_fwd_bwd(c, True, "relay")
        p_r = mt.last_backward_path()
        o_f, z_f, gu_f, ga_f = op_fwd_bwd(c, True, "fused_always")
        p_f = mt.last_backward_path()
        print(f"  {case_name(F, E, cf, L, n, True, torch.float32, 'relay vs fused')}: paths {p_r[0]} / {p_f[0]} ({p_f[1]})")
        assert p_r[0] == "relay", p_r
        assert p_f[0] == "fused", f"the fused path did not run: {p_f}"
        assert torch.equal(o_r, o_f) and torch.equal(z_r, z_f), "forward differs between two identical calls"
        for name, a, b in (("grad_u0", gu_r, gu_f), ("grad_alpha", ga_r, ga_f)):
            if not torch.equal(a, b):
                diff = (a != b).sum().item()
                raise AssertionError(f"{name}: relay and fused differ in {diff} elements (max |d| {(a - b).abs().max().item():.3e})")


def _refused_by_env(c, name, value, path):
    """With the environment variable `name` set to `value`, a call through the
    op is refused by a ValueError naming the variable."""
    os.environ[name] = value
    try:
        op_fwd_bwd(c, True, path)
    except ValueError as e:
        assert name in str(e), str(e)
        print(f"  {name}={value!r} refused: {e}")
    else:
        raise AssertionError(f"{name}={value!r} was accepted")


def test_auto_path_reads_env():
    c = make_case(1, 700, 32, 2, 2, torch.float32, seed=500)
    with _env_restored(FUSED_ENV):
        os.environ[FUSED_ENV] = "1"
        op_fwd_bwd(c, True, "auto")
        _check_on_path(mt.last_backward_path())
        os.environ[FUSED_ENV] = "always"
        op_fwd_bwd(c, True, "auto")
        assert mt.last_backward_path()[0] == "fused", mt.last_backward_path()
        os.environ[FUSED_ENV] = "off"
        op_fwd_bwd(c, True, "auto")
        assert mt.last_backward_path()[0] == "relay", mt.last_backward_path()
        _refused_by_env(c, FUSED_ENV, "maybe", "auto")
        # An explicit path overrides the variable.
        op_fwd_bwd(c, True, "relay")
        assert mt.last_backward_path()[0] == "relay"


def test_precision_env_selects_the_mode():
    """MIXSTACK_PRECISION=fp16x3 runs the op's GEMMs in the compensated mode
    (read at each call): its bits differ from the exact mode's, it stays
    within 1e-6 of the fp64 reference, the fused backward gives the relay's
    bits in the mode, and a bad value is refused naming the variable."""
    c = make_case(2, 3001, 32, 3, 3, torch.float32, seed=600)
    want = ref_all(c, True, torch.float64)[:4]
    with _env_restored(PRECISION_ENV):
        os.environ.pop(PRECISION_ENV, None)
        exact = op_fwd_bwd(c, True, "relay")
        os.environ[PRECISION_ENV] = "fp16x3"
        x3 = op_fwd_bwd(c, True, "relay")
        names = ("out", "z_all", "grad_u0", "grad_alpha")
        check_close("fp16x3 " + case_name(2, 3001, 32, 3, 3, True, torch.float32, "relay"),
                    {k: rel(a, b) for k, a, b in zip(names, x3, want)}, 1e-6)
        assert not torch.equal(exact[0], x3[0]), "MIXSTACK_PRECISION=fp16x3 gave the exact mode's bits"
        fused = op_fwd_bwd(c, True, "fused_always")
        path, why = mt.last_backward_path()
        print(f"  fused requested in fp16x3: {path} ({why})")
        assert path == "fused", (path, why)
        for k, a, b in zip(names, fused, x3):
            assert torch.equal(a, b), f"{k}: fused and relay differ in fp16x3"
        _refused_by_env(c, PRECISION_ENV, "fp17", "relay")


def _expect_value_error(what, fn, *needles):
    try:
        fn()
    except ValueError as e:
        msg = str(e)
        for n in needles:
            assert n in msg, f"{what}: message should mention {n!r}: {msg}"
        print(f"  refused {what}: {msg}")
        return
    raise AssertionError(f"{what} was not refused with ValueError")


def test_refusals():
    c = make_case(2, 64, 32, 2, 3, torch.float32, seed=600)
    w = (c["w0_all"], c["w1_all"], c["gw_all"])

    def call(u0=c["u0"], alpha=c["alpha"], ws=w, L=2, cf=32, path="auto"):
        return mt.mixstack_stack(u0, alpha, *ws, L, cf, True, path=path)

    _expect_value_error("u0 on the CPU", lambda: call(u0=c["u0"].cpu()), "u0", "one device")
    _expect_value_error("w0_all on the CPU", lambda: call(ws=(w[0].cpu(), w[1], w[2])), "w0_all", "one device")
    nc = c["u0"].transpose(0, 1).contiguous().transpose(0, 1)  # right shape, not contiguous
    _expect_value_error("non-contiguous u0", lambda: call(u0=nc), "u0", "contiguous")
    _expect_value_error("float16", lambda: call(u0=c["u0"].half()), "Half")
    _expect_value_error("mixed dtypes", lambda: call(alpha=c["alpha"].double()), "alpha", "dtype")
    _expect_value_error("bad alpha shape", lambda: call(alpha=c["alpha"][:10].contiguous()), "alpha")
    _expect_value_error("bad ROW", lambda: call(cf=16), "ROW")
    _expect_value_error("bad path", lambda: call(path="bogus"), "path")
    # A shape the build has no kernels for (Cf = 48): refused by mixstack itself.
    d = make_case(1, 16, 48, 1, 2, torch.float32, seed=601)
    _expect_value_error(
        "Cf 48 (outside the build)",
        lambda: mt.mixstack_stack(d["u0"], d["alpha"], d["w0_all"], d["w1_all"], d["gw_all"], 1, 48, True),
        "MIXSTACK_ERR_BAD_SHAPE",
    )


def test_cpu_kernel_agrees_with_the_cuda_kernel():
    # All tensors on the CPU run the C++ CPU kernel (the reference math; what
    # export and freezing trace through), fp64: the GPU's result to rounding.
    c = make_case(2, 77, 32, 3, 3, torch.float64, seed=610)
    args = (c["u0"], c["alpha"], c["w0_all"], c["w1_all"], c["gw_all"], 3, 32, True)
    out, z_all = mt.mixstack_stack(*args)
    out_cpu, z_cpu = mt.mixstack_stack(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args))
    assert out_cpu.device.type == "cpu"
    assert torch.allclose(out.cpu(), out_cpu, rtol=1e-12, atol=1e-12), (out.cpu() - out_cpu).abs().max()
    assert torch.allclose(z_all.cpu(), z_cpu, rtol=1e-12, atol=1e-12)
    go = torch.randn_like(out)
    bwd = (go, out, z_all, c["alpha"], c["w0_all"], c["w1_all"], c["gw_all"], 3, 32, True, "relay")
    gu, ga = torch.ops.mixstack.stack_bwd(*bwd)
    gu_cpu, ga_cpu = torch.ops.mixstack.stack_bwd(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in bwd))
    assert torch.allclose(gu.cpu(), gu_cpu, rtol=1e-11, atol=1e-11), (gu.cpu() - gu_cpu).abs().max()
    assert torch.allclose(ga.cpu(), ga_cpu, rtol=1e-11, atol=1e-11), (ga.cpu() - ga_cpu).abs().max()


def test_weights_get_no_gradient():
    c = make_case(1, 100, 32, 1, 2, torch.float64, seed=700)
    w = [c[k].detach().clone().requires_grad_(True) for k in ("w0_all", "w1_all", "gw_all")]
    u0 = c["u0"].detach().clone().requires_grad_(True)
    alpha = c["alpha"].detach().clone().requires_grad_(True)
    out, _ = mt.mixstack_stack(u0, alpha, *w, 1, 32, True)
    (out * c["grad_out"]).sum().backward()
    assert u0.grad is not None and alpha.grad is not None
    assert all(x.grad is None for x in w), "weights must get no gradient"


def test_in_place_weight_updates_are_seen():
    _tf32_off()
    c = make_case(1, 200, 32, 2, 2, torch.float64, seed=800)
    args = lambda: (c["w0_all"], c["w1_all"], c["gw_all"], 2, 32, True)  # noqa: E731
    out1, _ = mt.mixstack_stack(c["u0"], c["alpha"], *args())
    with torch.no_grad():
        c["w0_all"].mul_(0.5)  # bumps the version counter
    out2, _ = mt.mixstack_stack(c["u0"], c["alpha"], *args())
    r2, _ = ref.forward(c["u0"], c["alpha"], *args())
    e = rel(out2, r2)
    print(f"  after an in-place update: rel {e:.2e} (before/after differ by {rel(out1, out2):.2e})")
    assert e <= TOL_F64
    assert rel(out1, out2) > 1e-3


def test_empty_edges():
    c = make_case(2, 0, 32, 2, 3, torch.float32, seed=900)
    u0 = c["u0"].detach().clone().requires_grad_(True)
    alpha = c["alpha"].detach().clone().requires_grad_(True)
    out, z = mt.mixstack_stack(u0, alpha, c["w0_all"], c["w1_all"], c["gw_all"], 2, 32, True)
    assert tuple(out.shape) == (0, 2, 224) and tuple(z.shape) == (2, 2, 0, 224)
    gu, ga = torch.autograd.grad(out, (u0, alpha), c["grad_out"])
    assert tuple(gu.shape) == (2, 0, 224) and tuple(ga.shape) == (0, 2)


def test_side_stream():
    _tf32_off()
    c = make_case(2, 3001, 32, 3, 3, torch.float32, seed=1000)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out, z, gu, ga = op_fwd_bwd(c, True, "fused_always")
    torch.cuda.current_stream().wait_stream(s)
    r_out, _, r_gu, r_ga, _, _ = ref_all(c, True, torch.float64)
    check_close("side stream", {"out": rel(out, r_out), "grad_u0": rel(gu, r_gu), "grad_alpha": rel(ga, r_ga)}, TOL_F32)


def test_release_cached_memory():
    # The stacks' pools give their cached scratch back; the next calls map it
    # again and give the same bits.
    c = make_case(2, 3001, 32, 3, 3, torch.float32, seed=1100)
    before = op_fwd_bwd(c, True, "relay")
    torch.cuda.synchronize()
    free_cached, _ = torch.cuda.mem_get_info()
    mt.release_cached_memory()
    free_released, _ = torch.cuda.mem_get_info()
    # The pool held the calls' scratch (MBs here): releasing frees device memory.
    assert free_released > free_cached, f"free memory {free_cached} -> {free_released}: nothing was released"
    after = op_fwd_bwd(c, True, "relay")
    for name, a, b in zip(("out", "z_all", "grad_u0", "grad_alpha"), before, after):
        assert torch.equal(a, b), f"{name} differs after release_cached_memory"


def test_alpha_none_without_apply_alpha():
    c = make_case(1, 50, 32, 1, 2, torch.float64, seed=1100)
    out, _ = mt.mixstack_stack(c["u0"], None, c["w0_all"], c["w1_all"], c["gw_all"], 1, 32, False)
    r, _ = ref.forward(c["u0"], c["alpha"], c["w0_all"], c["w1_all"], c["gw_all"], 1, 32, False)
    assert rel(out, r) <= TOL_F64


def _vectors_dir():
    return os.environ.get("MIXSTACK_VECTORS") or os.path.join(os.path.dirname(os.path.dirname(HERE)), "vectors")


def _load_vector(d, spec):
    dt = {"<f4": torch.float32, "<f8": torch.float64}[spec["dtype"]]
    with open(os.path.join(d, spec["file"]), "rb") as f:
        raw = bytearray(f.read())
    return torch.frombuffer(raw, dtype=dt).reshape(spec["shape"]).clone()


def test_reference_vectors():
    """The eager reference and the op against DeePMD-kit's own reference vectors (vectors/)."""
    import json

    _tf32_off()
    d = _vectors_dir()
    with open(os.path.join(d, "manifest.json")) as f:
        cases = json.load(f)
    assert cases, f"no cases in {d}/manifest.json"
    for case in cases:
        t = {k: _load_vector(d, spec) for k, spec in case["tensors"].items()}
        F, E, cf, L, n, aa = (case[k] for k in ("F", "E", "cf", "lmax", "n_layers", "apply_alpha"))
        for dtype, tol, paths in ((torch.float64, TOL_F64, ("relay",)), (torch.float32, TOL_F32, ("relay", "fused_always"))):
            c = {
                "u0": t["u0"], "alpha": t["alpha"], "w0_all": t["w0"], "w1_all": t["w1"], "gw_all": t["gw"],
                "grad_out": t["grad_out"], "lmax": L, "focus_dim": cf,
            }
            c = {k: (v.to(device="cuda", dtype=dtype) if isinstance(v, torch.Tensor) else v) for k, v in c.items()}
            want = {k: t[k].cuda() for k in ("out", "z_all", "grad_u0", "grad_alpha")}
            if dtype == torch.float64:
                r_out, r_z, r_gu, r_ga, _, _ = ref_all(c, aa, torch.float64)
                check_close(
                    f"vectors case {case['case']} eager reference",
                    {"out": rel(r_out, want["out"]), "z_all": rel(r_z, want["z_all"]),
                     "grad_u0": rel(r_gu, want["grad_u0"]), "grad_alpha": rel(r_ga, want["grad_alpha"])},
                    TOL_F64,
                )
            for path in paths:
                out, z, gu, ga = op_fwd_bwd(c, aa, path)
                check_close(
                    f"vectors case {case['case']} " + case_name(F, E, cf, L, n, aa, dtype, path),
                    {"out": rel(out, want["out"]), "z_all": rel(z, want["z_all"]),
                     "grad_u0": rel(gu, want["grad_u0"]), "grad_alpha": rel(ga, want["grad_alpha"])},
                    tol,
                )


def _op_args(c, path="relay"):
    return (c["u0"], c["alpha"], c["w0_all"], c["w1_all"], c["gw_all"], c["lmax"], c["focus_dim"], True, path)


def test_opcheck():
    # torch.library.opcheck: schema, fake kernels against the real ones,
    # autograd registration, for both ops.
    c = make_case(2, 50, 32, 3, 3, torch.float32, seed=1100)
    u0 = c["u0"].detach().clone().requires_grad_(True)
    alpha = c["alpha"].detach().clone().requires_grad_(True)
    args = (u0, alpha) + _op_args(c)[2:]
    torch.library.opcheck(torch.ops.mixstack.stack.default, args)
    out, z = torch.ops.mixstack.stack(*_op_args(c))
    bwd_args = (c["grad_out"], out, z, c["alpha"], c["w0_all"], c["w1_all"], c["gw_all"], 3, 32, True, "relay")
    torch.library.opcheck(torch.ops.mixstack.stack_bwd.default, bwd_args)


def test_compile_export_and_make_fx_match_eager():
    _tf32_off()
    from torch.fx.experimental.proxy_tensor import make_fx

    c = make_case(2, 501, 32, 3, 3, torch.float32, seed=1200)

    # grad_out is an input, as in a model (a closed-over real tensor is not
    # a graph input under symbolic make_fx)
    def f(u0, alpha, w0, w1, gw, grad_out):
        out, _ = mt.mixstack_stack(u0, alpha, w0, w1, gw, 3, 32, True, path="relay")
        gu, ga = torch.autograd.grad(out, (u0, alpha), grad_out)
        return out, gu, ga

    def inputs():
        u0 = c["u0"].detach().clone().requires_grad_(True)
        alpha = c["alpha"].detach().clone().requires_grad_(True)
        return u0, alpha, c["w0_all"], c["w1_all"], c["gw_all"]

    want = f(*inputs(), c["grad_out"])
    gm = make_fx(f, tracing_mode="symbolic")(*inputs(), c["grad_out"])
    for a, b in zip(want, gm(*inputs(), c["grad_out"])):
        assert torch.equal(a, b), "make_fx differs from eager"
    # torch.compile over the forward (autograd.grad stays outside the compiled
    # region; the compiled backward runs stack_bwd)
    fwd = torch.compile(lambda *a: mt.mixstack_stack(*a, 3, 32, True, path="relay")[0], fullgraph=True)
    u0, alpha, *w = inputs()
    out = fwd(u0, alpha, *w)
    gu, ga = torch.autograd.grad(out, (u0, alpha), c["grad_out"])
    for name, a, b in zip(("out", "grad_u0", "grad_alpha"), want, (out, gu, ga)):
        assert torch.equal(a, b), f"torch.compile: {name} differs from eager"

    class M(torch.nn.Module):
        def forward(self, u0, alpha, w0, w1, gw):
            return torch.ops.mixstack.stack(u0, alpha, w0, w1, gw, 3, 32, True, "relay")

    args = tuple(t.detach() for t in inputs())
    ep = torch.export.export(M(), args)
    out, _ = ep.module()(*args)
    assert torch.equal(out, want[0]), "torch.export differs from eager"


def test_cuda_graph_capture_replays_exactly():
    _tf32_off()
    c = make_case(2, 777, 32, 3, 3, torch.float32, seed=1300)
    static = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in c.items()}

    def step():
        out, z = torch.ops.mixstack.stack(*_op_args(static))
        gu, ga = torch.ops.mixstack.stack_bwd(
            static["grad_out"], out, z, static["alpha"], static["w0_all"], static["w1_all"], static["gw_all"],
            3, 32, True, "relay",
        )
        return out, gu, ga

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        want = step()  # warm-up: the handle and the kernels are made outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = step()
    # new inputs, same buffers: the replay must compute with them
    c2 = make_case(2, 777, 32, 3, 3, torch.float32, seed=1301)
    for k in ("u0", "alpha", "grad_out", "w0_all"):
        static[k].copy_(c2[k])
    g.replay()
    torch.cuda.synchronize()
    c2 = dict(c2, w1_all=static["w1_all"], gw_all=static["gw_all"])
    out, z = torch.ops.mixstack.stack(*_op_args(c2))
    gu, ga = torch.ops.mixstack.stack_bwd(
        c2["grad_out"], out, z, c2["alpha"], c2["w0_all"], c2["w1_all"], c2["gw_all"], 3, 32, True, "relay"
    )
    for name, a, b in zip(("out", "grad_u0", "grad_alpha"), got, (out, gu, ga)):
        assert torch.equal(a, b), f"graph replay: {name} differs from an eager call on the same inputs"
    assert not torch.equal(got[0], want[0]), "the replay did not see the new inputs"


TESTS = [
    test_library_loads,
    test_reference_closed_form_matches_autograd,
    test_reference_vectors,
    test_op_vs_eager_fp64,
    test_op_vs_eager_fp32,
    test_gradcheck_fp64,
    test_relay_fused_bitwise,
    test_auto_path_reads_env,
    test_precision_env_selects_the_mode,
    test_refusals,
    test_cpu_kernel_agrees_with_the_cuda_kernel,
    test_weights_get_no_gradient,
    test_in_place_weight_updates_are_seen,
    test_empty_edges,
    test_side_stream,
    test_release_cached_memory,
    test_alpha_none_without_apply_alpha,
    test_opcheck,
    test_compile_export_and_make_fx_match_eager,
    test_cuda_graph_capture_replays_exactly,
]


# ----------------------------------------------------------------------
# bench
# ----------------------------------------------------------------------


def bench(repeats=10, warmup=3):
    """Eager vs mixstack relay vs mixstack fused at the seed workload (f32)."""
    _tf32_off()
    F, E, cf, L, n = 2, 646000, 32, 3, 3
    print(f"\nbench: seed workload F={F} E={E} Cf={cf} lmax={L} n_layers={n} apply_alpha, float32, "
          f"TF32 off; warm-up {warmup}, median of {repeats}")
    print(f"  device: {torch.cuda.get_device_name()}; torch {torch.__version__}; lib {mt.library_path()}")
    c = make_case(F, E, cf, L, n, torch.float32, seed=1)
    ws = (c["w0_all"], c["w1_all"], c["gw_all"])
    u0 = c["u0"].detach().clone().requires_grad_(True)
    alpha = c["alpha"].detach().clone().requires_grad_(True)
    g = c["grad_out"]

    variants = {
        "eager (torch)": lambda: ref.forward(u0, alpha, *ws, L, cf, True),
        "mixstack relay": lambda: mt.mixstack_stack(u0, alpha, *ws, L, cf, True, path="relay"),
        "mixstack fused": lambda: mt.mixstack_stack(u0, alpha, *ws, L, cf, True, path="fused_always"),
    }
    rows, grads = [], {}
    for name, fwd in variants.items():
        fw, bw = [], []
        for it in range(warmup + repeats):
            e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            e0.record()
            out, _z = fwd()
            e1.record()
            gu, ga = torch.autograd.grad(out, (u0, alpha), g)
            e2.record()
            torch.cuda.synchronize()
            if it >= warmup:
                fw.append(e0.elapsed_time(e1))
                bw.append(e1.elapsed_time(e2))
            del out, _z
        grads[name] = (gu, ga)
        path = mt.last_backward_path() if name.startswith("mixstack") else None
        rows.append((name, statistics.median(fw), statistics.median(bw), path))
        del gu, ga
        torch.cuda.empty_cache()

    base = rows[0][1] + rows[0][2]
    print(f"  {'variant':<16} {'fwd ms':>9} {'bwd ms':>9} {'fwd+bwd ms':>11} {'speedup':>8}  backward path")
    for name, f_ms, b_ms, path in rows:
        tot = f_ms + b_ms
        p = f"{path[0]} ({path[1]})" if path else "autograd"
        print(f"  {name:<16} {f_ms:>9.2f} {b_ms:>9.2f} {tot:>11.2f} {base / tot:>7.2f}x  {p}")
    gr, gf = grads["mixstack relay"], grads["mixstack fused"]
    same = torch.equal(gr[0], gf[0]) and torch.equal(gr[1], gf[1])
    ge = grads["eager (torch)"]
    print(f"  relay == fused bitwise: {same}; mixstack relay vs eager f32: grad_u0 {rel(gr[0], ge[0]):.2e}, "
          f"grad_alpha {rel(gr[1], ge[1]):.2e}")
    return same


# ----------------------------------------------------------------------
# script entry
# ----------------------------------------------------------------------


def _arg(argv, name, default):
    if name in argv:
        i = argv.index(name)
        if i + 1 < len(argv):
            return int(argv[i + 1])
    return default


def main(argv):
    reason = _skip_reason()
    if reason:
        print(f"SKIP: {reason}; the mixstack torch tests need a CUDA device")
        return 0
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name()}")
    # A crash in native code prints the Python stack; `--skip a,b` leaves out
    # tests by name, so a run can go on past one that crashed the process.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    skip = set(argv[argv.index("--skip") + 1].split(",")) if "--skip" in argv[:-1] else set()
    failures = []
    if "--bench-only" not in argv:
        for t in TESTS:
            if t.__name__ in skip:
                print(f"SKIPPED {t.__name__} (--skip)")
                continue
            print(f"RUN {t.__name__}")
            sys.stdout.flush()
            t0 = time.time()
            try:
                t()
            except Exception as e:  # report and go on
                traceback.print_exc()
                print(f"FAIL {t.__name__}: {type(e).__name__}: {e}")
                failures.append(t.__name__)
            else:
                print(f"PASS {t.__name__} ({time.time() - t0:.1f} s)")
            sys.stdout.flush()
    if "--bench" in argv or "--bench-only" in argv:
        try:
            if not bench(repeats=_arg(argv, "--repeats", 10), warmup=_arg(argv, "--warmup", 3)):
                failures.append("bench (relay != fused)")
        except Exception as e:
            traceback.print_exc()
            print(f"FAIL bench: {type(e).__name__}: {e}")
            failures.append("bench")
    n = len(TESTS) if "--bench-only" not in argv else 0
    print(f"\n{n - len([f for f in failures if f.startswith('test_')])}/{n} tests passed"
          + (f"; FAILED: {', '.join(failures)}" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
