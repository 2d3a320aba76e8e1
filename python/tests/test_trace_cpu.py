"""The ops' registration, fake kernels and autograd, traced without a GPU:
``make_fx(tracing_mode="symbolic")`` and ``torch.export`` go through
``mixstack::stack`` / ``mixstack::stack_bwd`` on fake tensors (the real
kernels never run), and a CPU tensor given to the op is a ValueError.

    python3 python/tests/test_trace_cpu.py      # or: python3 -m pytest -q python/tests/test_trace_cpu.py

Without torch it prints SKIP and exits 0. (Running the ops, opcheck and CUDA
graphs need a GPU: python/tests/test_torch_op.py.)
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

F, E, CF, L, N = 2, 7, 32, 3, 3
ROW, M0, M1, LG = (3 * L + 1) * CF, (L + 1) * CF, 2 * L * CF, L * CF


def _inputs(device="cpu", e=E):
    g = torch.Generator().manual_seed(0)
    u0 = torch.randn(F, e, ROW, generator=g).to(device).requires_grad_()
    alpha = torch.rand(e, F, generator=g).to(device).requires_grad_()
    w0 = torch.randn(N, F, M0, M0, generator=g).to(device)
    w1 = torch.randn(N, F, M1, M1, generator=g).to(device)
    gw = torch.randn(N - 1, F, CF, LG, generator=g).to(device)
    return u0, alpha, w0, w1, gw


def _forward_and_grads(u0, alpha, w0, w1, gw):
    out, _z = torch.ops.mixstack.stack(u0, alpha, w0, w1, gw, L, CF, True, "auto")
    gu, ga = torch.autograd.grad(out.square().sum(), (u0, alpha))
    return out, gu, ga


def test_ops_are_registered():
    import mixstack_torch  # noqa: F401  (registers the ops)

    for name in ("stack", "stack_bwd"):
        op = getattr(torch.ops.mixstack, name).default
        assert "mixstack::" + name in str(op._schema), op._schema


def test_make_fx_symbolic_traces_forward_and_backward():
    import mixstack_torch  # noqa: F401
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(_forward_and_grads, tracing_mode="symbolic")(*_inputs())
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert "mixstack.stack.default" in targets, targets
    assert "mixstack.stack_bwd.default" in targets, targets
    # E stays symbolic: the fake kernels derive every size from the inputs
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0][0]
    assert any(isinstance(s, torch.SymInt) for s in out.meta["val"].shape), out.meta["val"].shape


def test_export_records_the_op():
    import mixstack_torch  # noqa: F401

    class M(torch.nn.Module):
        def forward(self, u0, alpha, w0, w1, gw):
            return torch.ops.mixstack.stack(u0, alpha, w0, w1, gw, L, CF, True, "relay")

    args = tuple(t.detach() for t in _inputs())
    e = torch.export.Dim("E", min=2)
    shapes = ({1: e}, {0: e}, None, None, None)
    ep = torch.export.export(M(), args, dynamic_shapes=shapes)
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert "mixstack.stack.default" in targets, targets


def test_cpu_tensors_are_a_value_error():
    import mixstack_torch as mt

    try:
        mt.mixstack_stack(*_inputs(), L, CF, True)
    except ValueError as e:
        assert "CUDA" in str(e), e
    else:
        raise AssertionError("CPU tensors were accepted")
    # the backward op checks what a direct call passes, too
    u0, alpha, w0, w1, gw = (t.detach() for t in _inputs())
    out, z = torch.zeros(E, F, ROW), torch.zeros(N - 1, F, E, ROW)
    for what, args in [
        ("CUDA", (out, out, z, alpha, w0, w1, gw)),
        ("CUDA", (out[:3], out, z, alpha, w0, w1, gw)),
    ]:
        try:
            torch.ops.mixstack.stack_bwd(*args, L, CF, True, "relay")
        except ValueError as e:
            assert what in str(e), e
        else:
            raise AssertionError("stack_bwd accepted CPU tensors")
    try:
        mt.mixstack_stack(*_inputs(), L, CF, True, path="sideways")
    except ValueError as e:
        assert "path" in str(e), e
    else:
        raise AssertionError("a bad path was accepted")


def test_refusals_on_fake_cuda_tensors():
    # FakeTensorMode makes CUDA tensors without a GPU: every argument check
    # the op runs before it touches the library, with the message it gives.
    from mixstack_torch import ops
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        u0, alpha, w0, w1, gw = (t.detach().to("cuda") for t in _inputs())
        ws = (w0, w1, gw)

        def call(u0=u0, alpha=alpha, ws=ws, cf=CF, path="auto"):
            return ops._validate(u0, alpha, *ws, L, cf, path)

        assert call() == (F, E, N)
        cases = [
            ("CPU u0", dict(u0=torch.empty(F, E, ROW)), ["u0", "CUDA"]),
            ("non-contiguous", dict(u0=torch.empty(E, F, ROW, device="cuda").transpose(0, 1)), ["u0", "contiguous"]),
            ("float16", dict(u0=u0.half()), ["float16"]),
            ("mixed dtypes", dict(alpha=alpha.double()), ["alpha", "dtype"]),
            ("alpha shape", dict(alpha=alpha[:3]), ["alpha"]),
            ("ROW", dict(cf=16), ["ROW"]),
            ("path", dict(path="bogus"), ["path"]),
            ("gw shape", dict(ws=(w0, w1, gw[:, :, :8])), ["gw_all"]),
        ]
        for what, kw, needles in cases:
            try:
                call(**kw)
            except ValueError as e:
                assert all(n in str(e) for n in needles), f"{what}: {e}"
            else:
                raise AssertionError(f"{what} was accepted")
        out, z = torch.empty(E, F, ROW, device="cuda"), torch.empty(N - 1, F, E, ROW, device="cuda")
        assert ops._validate_bwd(out, out, z, alpha, *ws, L, CF, "relay") == (F, E, N)
        for what, args, needle in [
            ("grad_out shape", (out[:2], out, z, alpha), "grad_out"),
            ("z_all shape", (out, out, z[:, :1], alpha), "z_all"),
        ]:
            try:
                ops._validate_bwd(*args, *ws, L, CF, "relay")
            except ValueError as e:
                assert needle in str(e), f"{what}: {e}"
            else:
                raise AssertionError(f"{what} was accepted")


def main():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _runner import run

    return run(globals(), torch)


if __name__ == "__main__":
    sys.exit(main())
