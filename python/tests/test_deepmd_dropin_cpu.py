"""The DeePMD-kit drop-in (mixstack_torch.deepmd) against a stand-in of
DeePMD-kit's value-path module, without a GPU or DeePMD-kit: install /
uninstall swap the module-level stack op, calls mixstack does not serve go to
upstream's op and say so, and ``MIXSTACK_DEEPMD`` installs the drop-in when
the module is imported after the plugin (DeePMD-kit's load order).

    python3 python/tests/test_deepmd_dropin_cpu.py    # or under pytest

Without torch it prints SKIP and exits 0. The real model end to end needs a
GPU and DeePMD-kit.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
PKG = os.path.join(HERE, "..")
sys.path.insert(0, PKG)

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

STUB = '''
calls = []


def upstream(u0, alpha, w0_all, w1_all, gw_all, lmax, focus_dim, apply_alpha):
    calls.append((tuple(u0.shape), lmax, focus_dim, apply_alpha))
    return "upstream-out", "upstream-z"


_mixing_stack_op = upstream
'''


def _stub_tree():
    root = tempfile.mkdtemp(prefix="mixstack-deepmd-stub-")
    d = root
    for part in ("deepmd", "kernels", "triton", "sezm"):
        d = os.path.join(d, part)
        os.makedirs(d, exist_ok=True)
        open(os.path.join(d, "__init__.py"), "w").close()
    with open(os.path.join(d, "so2_value_path.py"), "w") as f:
        f.write(STUB)
    return root


def test_install_swaps_and_falls_back_with_a_reason():
    root = _stub_tree()
    sys.path.insert(0, root)
    try:
        import importlib

        import mixstack_torch.deepmd as dropin

        mod = importlib.import_module(dropin.UPSTREAM_MODULE)
        assert dropin.installed() is None
        replaced = dropin.install("relay")
        relay_op = mod._mixing_stack_op  # what a model built now takes
        assert replaced is mod.upstream and isinstance(relay_op, dropin.StackOp) and relay_op.path == "relay"
        assert dropin.installed() == "relay"
        dropin.install("fused")  # again: keeps upstream's op as the one to restore
        assert dropin.installed() == "fused" and mod._mixing_stack_op.upstream is mod.upstream
        assert relay_op.path == "relay", "a model built before keeps its path"
        # A shape the build serves, on the CPU (as DeePMD-kit traces to
        # freeze): mixstack's op, whose CPU kernel is the reference math, so
        # that a frozen model records mixstack::stack.
        from mixstack_torch import reference

        g = torch.Generator().manual_seed(3)
        u0, alpha = torch.randn(2, 5, 320, generator=g), torch.rand(5, 2, generator=g) + 0.5
        ws = (torch.randn(3, 2, 128, 128, generator=g) / 128**0.5, torch.randn(3, 2, 192, 192, generator=g) / 192**0.5,
              torch.randn(2, 2, 32, 96, generator=g) / 32**0.5)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out, z_all = mod._mixing_stack_op(u0, alpha, *ws, 3, 32, True)
            want, want_z = reference.forward(u0, alpha, *ws, 3, 32, True)
            assert torch.allclose(out, want, atol=1e-5) and torch.allclose(z_all, want_z, atol=1e-5)
            assert mod.calls == []
            # A shape outside the build (Cf 48): upstream's op, with the reason once.
            u48, w48 = torch.zeros(1, 5, 192), torch.zeros(2, 1, 96, 96)
            out = mod._mixing_stack_op(u48, torch.ones(5, 1), w48, None, None, 1, 48, True)
            relay_op(u48, torch.ones(5, 1), w48, None, None, 1, 48, True)
        assert out == ("upstream-out", "upstream-z")
        assert mod.calls == [((1, 5, 192), 1, 48, True)] * 2
        said = [str(x.message) for x in w]
        assert len(said) == 1 and "48" in said[0], said  # once per reason
        assert list(dropin.fallbacks().values()) == [2]
        # Forward mode (torch.func.jvp) is refused, not answered with a zero tangent.
        op = mod._mixing_stack_op
        try:
            torch.func.jvp(lambda u: op(u, alpha, *ws, 3, 32, True)[0], (u0,), (torch.ones_like(u0),))
        except NotImplementedError as e:
            assert "forward-mode" in str(e), e
        else:
            raise AssertionError("torch.func.jvp through the drop-in was accepted")
        dropin.uninstall()
        assert mod._mixing_stack_op is mod.upstream and dropin.installed() is None
        assert relay_op.path == "relay", "uninstall leaves models built with the drop-in alone"
        try:
            dropin.install("sideways")
        except ValueError as e:
            assert "path" in str(e)
        else:
            raise AssertionError("a bad path was accepted")
    finally:
        sys.path.remove(root)
        shutil.rmtree(root, ignore_errors=True)
        for name in [m for m in sys.modules if m == "deepmd" or m.startswith("deepmd.")]:
            del sys.modules[name]


def _run(env_value, code):
    root = _stub_tree()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, PKG]), MIXSTACK_DEEPMD=env_value)
    try:
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_environment_switch_installs_after_the_module_is_imported():
    # DeePMD-kit's order: the plugin first, the value-path module later.
    code = (
        "import mixstack_torch.deepmd_plugin, mixstack_torch.deepmd as d\n"
        "import deepmd.kernels.triton.sezm.so2_value_path as m\n"
        "assert isinstance(m._mixing_stack_op, d.StackOp), m._mixing_stack_op\n"
        "print(d.installed())\n"
    )
    r = _run("fused", code)
    assert r.returncode == 0 and r.stdout.strip() == "fused", (r.stdout, r.stderr)
    # the switch's own spelling of "always" names the same path
    for value in ("always", "fused_always"):
        r = _run(value, code)
        assert r.returncode == 0 and r.stdout.strip() == "fused_always", (value, r.stdout, r.stderr)
    r = _run("0", code.replace("isinstance(m._mixing_stack_op, d.StackOp)", "m._mixing_stack_op is m.upstream").replace("print(d.installed())", "print('off')"))
    assert r.returncode == 0 and r.stdout.strip() == "off", (r.stdout, r.stderr)
    r = _run("sideways", "import mixstack_torch.deepmd_plugin")
    assert r.returncode != 0 and "MIXSTACK_DEEPMD" in r.stderr, r.stderr


def main():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _runner import run

    return run(globals(), torch)


if __name__ == "__main__":
    sys.exit(main())
