"""Run DeePMD-kit's SeZM / DPA4 mixing stacks on mixstack.

    import mixstack_torch.deepmd
    mixstack_torch.deepmd.install(path="relay")   # or "fused", "fused_always", "auto"; before the model is built
    # ... build or load the DeePMD-kit model (DP_TRITON_INFER=2) and evaluate it

or, with no code change, set ``MIXSTACK_DEEPMD=relay`` (``fused``, ``fused_always``, ``auto``)
in the environment: DeePMD-kit loads this package's ``deepmd.pt`` /
``deepmd.pt_expt`` entry point when it imports its backend, and the switch
installs the drop-in then.

DeePMD-kit's value path (``deepmd.kernels.triton.sezm.so2_value_path``) takes
its stack op from the module-level name ``_mixing_stack_op`` when each SO(2)
convolution's value path is constructed. :func:`install` points that name at
:class:`StackOp`, which has the upstream op's signature and runs
``mixstack::stack`` (eager, ``torch.compile``, ``make_fx``, ``torch.export``:
it is a ``torch.library`` op with fake kernels and autograd). The rotation
kernels around the stack stay DeePMD-kit's. Nothing of DeePMD-kit is copied.

Where mixstack does not serve a call, :class:`StackOp` runs upstream's op
instead and says so once per reason (a ``UserWarning``, and
:func:`fallbacks`): a dtype or shape outside mixstack's build, tensors on a
device other than CUDA or the CPU. On the CPU (DeePMD-kit traces there when
it freezes a model) the op's CPU kernel runs, so the frozen ``.pt2`` calls
``mixstack::stack``, which DeePMD-kit's C++ finds in libmixstack_torch.so
(``DP_PLUGIN_PATH``).
"""

import functools
import importlib
import importlib.abc
import importlib.util
import os
import sys
import threading
import warnings

import torch

from . import ops  # noqa: F401  (registers mixstack::stack)
from .ops import _refuse_forward_mode
from ._lib import PATHS, _load, supports

UPSTREAM_MODULE = "deepmd.kernels.triton.sezm.so2_value_path"
UPSTREAM_NAME = "_mixing_stack_op"
ENV = "MIXSTACK_DEEPMD"

_lock = threading.Lock()
_upstream = None  # the op install() replaced
_fallbacks = {}  # reason -> count


def _say(reason):
    with _lock:
        first = reason not in _fallbacks
        _fallbacks[reason] = _fallbacks.get(reason, 0) + 1
    if first:
        warnings.warn(f"mixstack drop-in: upstream's stack op runs: {reason}", stacklevel=3)


def fallbacks():
    """``{reason: calls}`` of the calls the drop-in gave to upstream's op."""
    with _lock:
        return dict(_fallbacks)


@functools.lru_cache(maxsize=None)
def _served(dtype, F, cf, lmax, n_layers):
    try:
        ok, why = supports(dtype, F, cf, lmax, n_layers)
    except OSError as e:  # no library, or another ABI: upstream runs, and says why
        return str(e)
    return None if ok else why


def _refusal(u0, w0_all, lmax, focus_dim):
    """Why mixstack does not serve this call (None: it does). Decided from
    static properties only, so the same branch is taken under tracing. On the
    CPU (DeePMD-kit traces there to freeze) the op's CPU kernel runs, so that
    the frozen model records mixstack::stack for the GPU it will run on."""
    if u0.device.type not in ("cuda", "cpu"):
        return f"tensors on {u0.device.type} (mixstack runs on CUDA, and on the CPU for tracing)"
    return _served(str(u0.dtype), int(u0.shape[0]), int(focus_dim), int(lmax), int(w0_all.shape[0]))


class StackOp:
    """Upstream's ``sezm_triton::so2_mixing_stack`` signature on mixstack:
    ``(x_local (E, F, ROW), z_all (n_layers-1, F, E, ROW))``, with the backward
    path fixed when it was made (a model built after ``install(path)`` keeps
    that path; upstream reads the op when the model is built)."""

    def __init__(self, path, upstream):
        self.path, self.upstream = path, upstream

    def __call__(self, u0, alpha, w0_all, w1_all, gw_all, lmax, focus_dim, apply_alpha):
        _refuse_forward_mode(u0=u0, alpha=alpha, w0_all=w0_all, w1_all=w1_all, gw_all=gw_all)
        why = _refusal(u0, w0_all, lmax, focus_dim)
        if why is not None:
            _say(why)
            return self.upstream(u0, alpha, w0_all, w1_all, gw_all, lmax, focus_dim, apply_alpha)
        return torch.ops.mixstack.stack(
            u0, alpha, w0_all, w1_all, gw_all, int(lmax), int(focus_dim), bool(apply_alpha), self.path
        )

    def __repr__(self):
        return f"mixstack_torch.deepmd.StackOp(path={self.path!r})"


def install(path="auto"):
    """Point DeePMD-kit's value path at mixstack's stack (``path``: the
    backward, "relay", "fused" (where measured faster), "fused_always" or
    "auto" = the ``MIXSTACK_STACK_BWD_FUSED`` switch). Takes effect for models built afterwards. Returns the op it
    replaced (upstream's). Fails at once when the library cannot be loaded."""
    global _upstream
    if path not in PATHS:
        raise ValueError(f"mixstack drop-in: path must be one of {sorted(PATHS)}, got {path!r}")
    _load()
    mod = importlib.import_module(UPSTREAM_MODULE)
    with _lock:
        current = getattr(mod, UPSTREAM_NAME)
        if not isinstance(current, StackOp):
            _upstream = current
        setattr(mod, UPSTREAM_NAME, StackOp(path, _upstream))
    return _upstream


def uninstall():
    """Restore upstream's op for models built afterwards (models built with
    the drop-in keep it)."""
    mod = sys.modules.get(UPSTREAM_MODULE)
    with _lock:
        if mod is not None and isinstance(getattr(mod, UPSTREAM_NAME, None), StackOp) and _upstream is not None:
            setattr(mod, UPSTREAM_NAME, _upstream)


def installed():
    """The backward path of the drop-in models built now get, or None."""
    mod = sys.modules.get(UPSTREAM_MODULE)
    op = getattr(mod, UPSTREAM_NAME, None) if mod is not None else None
    return op.path if isinstance(op, StackOp) else None


# ----------------------------------------------------------------------
# the environment switch (read when DeePMD-kit loads its plugins)
# ----------------------------------------------------------------------


class _AfterImport:
    """Install the drop-in right after DeePMD-kit's value-path module is
    imported (DeePMD-kit loads plugins while it is still importing itself, so
    the module may not exist yet)."""

    def __init__(self, path):
        self.path = path

    def find_spec(self, name, import_path=None, target=None):
        if name != UPSTREAM_MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader, hook = spec.loader, self

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                if hook in sys.meta_path:
                    sys.meta_path.remove(hook)
                install(hook.path)

        spec.loader = _Loader()
        return spec


def from_environment():
    """Install the drop-in if ``MIXSTACK_DEEPMD`` asks for it: at once when
    DeePMD-kit's value path is imported already, else right after it is."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "0", "off", "no", "false"):
        return None
    path = {"1": "auto", "on": "auto", "yes": "auto", "true": "auto", "always": "fused_always"}.get(value, value)
    if path not in PATHS:
        raise ValueError(f"{ENV}={value!r}: expected relay, fused, fused_always, auto (or 1/on), or unset/0/off")
    if UPSTREAM_MODULE in sys.modules:
        install(path)
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(path))
    return path
