"""The PyTorch ops: ``mixstack::stack`` and ``mixstack::stack_bwd``.

Their schemas and kernels are registered in C++ (libmixstack_torch.so,
csrc/mixstack_op.cpp, built and loaded by _ext.py): a CUDA kernel over the
C library (include/mixstack.h, libmixstack.so) on the current stream and a
CPU kernel of the reference math, so that a frozen model (an AOTInductor
``.pt2``) finds the same ops in C++ (DeePMD-kit's DP_PLUGIN_PATH, LAMMPS).
This module adds what stays in Python: the fake kernels (shapes only) and
autograd, so ``make_fx(tracing_mode="symbolic")``,
``torch.compile(fullgraph=True)`` and ``torch.export`` trace through them.

The weights are arguments of every call, as upstream: the C library is
given their device pointers per call (``mixstack_forward_w`` /
``mixstack_backward_w`` on a stack that borrows its weights), and the
backward's transposes are made on the device, on the current stream. No
host round trip, nothing cached on data pointers: one C handle per (device,
dtype, F, Cf, lmax, n_layers) holds the kernels and the scratch pool.
"""

import ctypes
import operator

import torch
import torch.autograd.forward_ad as fwAD

from . import _ext
from . import _lib as _libmod
from ._lib import _PATH_NAMES, PATHS, MixstackError, _check, _load

# ----------------------------------------------------------------------
# the C++ registration (libmixstack_torch.so, csrc/mixstack_op.cpp)
# ----------------------------------------------------------------------

def _load_ext():
    """Loads libmixstack_torch.so (which defines the ops and their CPU and
    CUDA kernels) and points it at the libmixstack.so this package loads,
    where there is one (the CPU kernels need none)."""
    path = _ext.library_path()
    seen = _ext.identity(path)
    try:
        torch.ops.load_library(path)
    except OSError:
        # A cached build that does not load (cut short, or damaged): built
        # again, once, unless another process has already (the package's
        # own build is not: reinstall it).
        path = _ext.rebuild(path, seen)
        torch.ops.load_library(path)
    lib = ctypes.CDLL(path)
    lib.mixstack_torch_set_library.argtypes = [ctypes.c_char_p]
    lib.mixstack_torch_last_path.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.mixstack_torch_clear_cache.argtypes = [ctypes.c_int]
    try:
        _load()
    except OSError:
        return lib  # no libmixstack.so: the CUDA kernels say so when called
    here = _libmod.library_path()
    if lib.mixstack_torch_set_library(here.encode()) != 0:
        raise MixstackError(f"mixstack: libmixstack_torch.so has another libmixstack.so open than {here}")
    return lib


# Once, at import (a module runs once).
_ext_lib = _load_ext()
stack = torch.ops.mixstack.stack
stack_bwd = torch.ops.mixstack.stack_bwd


def clear_cache():
    """Destroy the C handles (one per device, dtype and shape; made again on
    the next call)."""
    _ext_lib.mixstack_torch_clear_cache(0)


def release_cached_memory():
    """Hand the scratch memory the handles keep mapped between calls (their
    own pools, outside PyTorch's allocator) back to the device."""
    _check(_ext_lib.mixstack_torch_clear_cache(1), "mixstack_release_cached_memory")


def last_backward_path():
    """(path, reason) of the most recent CUDA backward through the op in this
    process ("relay" or "fused", and why), or None before the first."""
    buf = ctypes.create_string_buffer(256)
    code = _ext_lib.mixstack_torch_last_path(buf, len(buf))
    name = _PATH_NAMES.get(code)
    return None if name is None else (name, buf.value.decode("utf-8", "replace"))


# ----------------------------------------------------------------------
# fake kernels (shapes only) and autograd
# ----------------------------------------------------------------------


def _fake_args(named, lmax, focus_dim, path):
    """The real kernels' argument checks (csrc/mixstack_op.cpp), as ValueError
    on fake and meta tensors, so that tracing refuses what running would:
    `named` holds (name, tensor, rank); one floating dtype (float32 or
    float64), one device, each tensor of its rank."""
    if lmax < 1 or focus_dim < 1:
        raise ValueError(f"mixstack_stack: lmax and focus_dim must be >= 1, got {lmax}, {focus_dim}")
    if path not in PATHS:
        raise ValueError(f"mixstack_stack: path must be one of {sorted(PATHS)}, got {path!r}")
    first, t0, _ = named[0]
    for name, t, rank in named:
        if t is None:
            raise ValueError(f"mixstack_stack: `{name}` is None (an undefined tensor)")
        if t.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"mixstack_stack: `{name}` has dtype {t.dtype}: mixstack supports float32 and float64 only")
        if t.dtype != t0.dtype:
            raise ValueError(f"mixstack_stack: `{name}` has dtype {t.dtype}, `{first}` {t0.dtype}: all tensors must have one dtype")
        if t.device != t0.device:
            raise ValueError(f"mixstack_stack: `{name}` is on {t.device}, `{first}` on {t0.device}: one device")
        if t.dim() != rank:
            raise ValueError(f"mixstack_stack: {name} must have {rank} dimensions, got {list(t.shape)}")


def _fake_shapes(shapes):
    """Each (name, tensor, want) of `shapes` of size `want`; symbolic sizes
    are checked with torch._check_value, which records them as guards."""
    for name, t, want in shapes:
        if t.dim() != len(want):
            raise ValueError(f"mixstack_stack: {name} must be {list(want)}, got {list(t.shape)}")
        for got, w in zip(t.shape, want):
            torch._check_value(got == w, lambda name=name, t=t, want=want: f"mixstack_stack: {name} must be {list(want)}, got {list(t.shape)}")


def _dims(lmax, focus_dim):
    """(ROW, M0, M1, LG) of docs/MIXING_STACK.md."""
    return (3 * lmax + 1) * focus_dim, (lmax + 1) * focus_dim, 2 * lmax * focus_dim, lmax * focus_dim


def _weight_shapes(w0_all, w1_all, gw_all, n, F, focus_dim, m0, m1, lg):
    return [("w0_all", w0_all, (n, F, m0, m0)), ("w1_all", w1_all, (n, F, m1, m1)), ("gw_all", gw_all, (n - 1, F, focus_dim, lg))]


@torch.library.register_fake("mixstack::stack")
def _(u0, alpha, w0_all, w1_all, gw_all, lmax, focus_dim, apply_alpha, path):
    named = [("u0", u0, 3), ("alpha", alpha, 2), ("w0_all", w0_all, 4), ("w1_all", w1_all, 4), ("gw_all", gw_all, 4)]
    _fake_args(named, lmax, focus_dim, path)
    (F, E, _), n = u0.shape, w0_all.shape[0]
    row, m0, m1, lg = _dims(lmax, focus_dim)
    torch._check_value(n >= 1, lambda: "mixstack_stack: w0_all has n_layers = 0")
    torch._check_value(F >= 1, lambda: "mixstack_stack: u0 has F = 0 focus streams")
    _fake_shapes([("u0", u0, (F, E, row)), ("alpha", alpha, (E, F))] + _weight_shapes(w0_all, w1_all, gw_all, n, F, focus_dim, m0, m1, lg))
    return u0.new_empty((E, F, row)), u0.new_empty((n - 1, F, E, row))


@torch.library.register_fake("mixstack::stack_bwd")
def _(grad_out, out, z_all, alpha, w0_all, w1_all, gw_all, lmax, focus_dim, apply_alpha, path):
    if grad_out is None or not grad_out.dtype.is_floating_point:
        raise ValueError(f"mixstack_stack: `grad_out` has dtype {getattr(grad_out, 'dtype', None)}: a floating dtype is expected")
    if out is not None and grad_out.device != out.device:
        raise ValueError(f"mixstack_stack: `grad_out` is on {grad_out.device}, `out` on {out.device}: one device")
    named = [("out", out, 3), ("z_all", z_all, 4), ("alpha", alpha, 2), ("w0_all", w0_all, 4), ("w1_all", w1_all, 4),
             ("gw_all", gw_all, 4)]
    _fake_args(named, lmax, focus_dim, path)
    (E, F, _), n = out.shape, w0_all.shape[0]
    row, m0, m1, lg = _dims(lmax, focus_dim)
    torch._check_value(F >= 1, lambda: "mixstack_stack: out has F = 0 focus streams")
    shapes = [("out", out, (E, F, row)), ("grad_out", grad_out, (E, F, row)), ("z_all", z_all, (n - 1, F, E, row)),
              ("alpha", alpha, (E, F))]
    _fake_shapes(shapes + _weight_shapes(w0_all, w1_all, gw_all, n, F, focus_dim, m0, m1, lg))
    return out.new_empty((F, E, row)), out.new_empty((E, F))


def _setup_context(ctx, inputs, output):
    u0, alpha, w0_all, w1_all, gw_all, lmax, focus_dim, apply_alpha, path = inputs
    out, z_all = output
    ctx.save_for_backward(out, z_all, alpha, w0_all, w1_all, gw_all)
    ctx.params = (lmax, focus_dim, apply_alpha, path)
    ctx.mark_non_differentiable(z_all)


def _backward(ctx, grad_out, _grad_z_all):
    out, z_all, alpha, w0_all, w1_all, gw_all = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    grad_u0, grad_alpha = stack_bwd(grad_out, out, z_all, alpha, w0_all, w1_all, gw_all, *ctx.params)
    # Input gradients only (the force backward): the weights get None.
    return grad_u0, grad_alpha, None, None, None, None, None, None, None


torch.library.register_autograd("mixstack::stack", _backward, setup_context=_setup_context)


def _no_second_derivative(ctx, *grads):
    raise RuntimeError(
        "mixstack::stack is not twice differentiable: its backward (mixstack::stack_bwd) has no derivative. "
        "Forces (one derivative) work; differentiating them again (a force loss in training) does not."
    )


# Without this, torch's fallback would let a second derivative through
# with the paths via out and z_all silently missing (a wrong Hessian).
torch.library.register_autograd("mixstack::stack_bwd", _no_second_derivative, setup_context=lambda ctx, inputs, output: None)


def _refuse_forward_mode(**tensors):
    """NotImplementedError if a tensor carries a forward-mode tangent
    (``torch.func.jvp``, ``jacfwd``, dual tensors): the op has no
    forward-mode derivative, and torch would drop the tangent silently
    (a zero tangent, not an error) where no input requires grad."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and fwAD.unpack_dual(t).tangent is not None:
            raise NotImplementedError(
                f"mixstack_stack: `{name}` carries a forward-mode tangent (torch.func.jvp, jacfwd or a dual "
                "tensor): forward-mode AD is not supported"
            )


def mixstack_stack(u0, alpha, w0_all, w1_all, gw_all, lmax, focus_dim, apply_alpha, path="auto"):
    """The SO(2) mixing stack (docs/MIXING_STACK.md) on CUDA through mixstack
    (``torch.ops.mixstack.stack``).

    Same argument order and layouts as the upstream op:

    - ``u0`` (F, E, ROW), ``alpha`` (E, F),
    - ``w0_all`` (n_layers, F, M0, M0), ``w1_all`` (n_layers, F, M1, M1),
      ``gw_all`` (n_layers-1, F, Cf, LG), all (in, out),
    - ``lmax`` (L), ``focus_dim`` (Cf), ``apply_alpha`` (bool),

    with ROW = (3L+1)Cf, M0 = (L+1)Cf, M1 = 2L*Cf, LG = L*Cf. Returns
    ``(out (E, F, ROW), z_all (n_layers-1, F, E, ROW))``; ``z_all`` (the
    gated layers' pre-activations) is not differentiable.

    ``path`` picks the backward: "auto" (the ``MIXSTACK_STACK_BWD_FUSED``
    environment switch, read at each backward), "relay", "fused" (the fused
    backward where it was measured faster than the relay on this GPU) or
    "fused_always" (wherever its kernels serve: float32 with Cf < 96);
    otherwise the relay runs, see :func:`last_backward_path`.

    Gradients: only ``u0`` and ``alpha`` get gradients (the inference/force
    backward). The weights get **None**, even when they require grad: do not
    use this op to train the weights. One derivative only: differentiating
    the gradients again (``create_graph=True`` then a second grad) raises;
    forward-mode AD (``torch.func.jvp``, ``jacfwd``, dual tensors) raises
    NotImplementedError here (a direct ``torch.ops.mixstack.stack`` call
    under ``torch.func.jvp`` is not caught: torch drops the tangent). ``grad_alpha`` is
    ``sum(grad_out * out) / max(alpha, 1e-12)`` as upstream, i.e. exact for
    alpha > 0, and zeros when ``apply_alpha`` is false.

    Tensors all on the CPU run the CPU kernel (the reference math: what
    export and freezing trace through; not meant to be fast). Refused with
    ValueError (mixstack does not fall back or copy): tensors on different
    devices or of different dtypes, dtypes other than float32/float64,
    non-contiguous tensors, shapes that do not match, and shapes outside the
    build (Cf, lmax, F the kernels were not generated for). Failures of the
    library itself (the driver, a missing libmixstack.so) raise RuntimeError.
    """
    _refuse_forward_mode(u0=u0, alpha=alpha, w0_all=w0_all, w1_all=w1_all, gw_all=gw_all)
    try:
        lmax, focus_dim = operator.index(lmax), operator.index(focus_dim)
    except TypeError:
        raise ValueError(f"mixstack_stack: lmax and focus_dim must be integers, got {lmax!r}, {focus_dim!r}") from None
    if alpha is None and not apply_alpha and isinstance(u0, torch.Tensor) and u0.dim() == 3:
        # mixstack always takes an alpha buffer; it is not read without apply_alpha.
        alpha = torch.ones((u0.shape[1], u0.shape[0]), dtype=u0.dtype, device=u0.device)
    if not isinstance(path, str) or path not in PATHS:
        raise ValueError(f"mixstack_stack: path must be one of {sorted(PATHS)}, got {path!r}")
    return stack(u0, alpha, w0_all, w1_all, gw_all, lmax, focus_dim, bool(apply_alpha), path)
