"""The PyTorch ops over the C library (_lib.py): ``mixstack::stack`` and
``mixstack::stack_bwd`` as ``torch.library`` custom ops, with fake kernels
(shapes only) and autograd, so ``make_fx(tracing_mode="symbolic")``,
``torch.compile(fullgraph=True)`` and ``torch.export`` trace through them.

The weights are arguments of every call, as upstream: the C library is
given their device pointers per call (``mixstack_forward_w`` /
``mixstack_backward_w`` on a stack that borrows its weights), and the
backward's transposes are made on the device, on the current stream. No
host round trip, nothing cached on data pointers: one C handle per (device,
dtype, F, Cf, lmax, n_layers) holds the kernels and the scratch pool.
"""

import atexit
import ctypes
import operator
import threading

import torch

from . import _lib as _libmod
from ._lib import PATHS, _PATH_NAMES, MixstackError, _check, _load

_DTYPES = {torch.float32: 0, torch.float64: 1}


# ----------------------------------------------------------------------
# C handles, one per shape
# ----------------------------------------------------------------------


class _Stack:
    """One C handle of a stack that borrows its weights."""

    def __init__(self, handle):
        self.handle = handle

    def close(self):
        h, self.handle = self.handle, None
        lib = _libmod._lib  # None once the library is gone (interpreter exit)
        if h and lib is not None:
            lib.mixstack_stack_destroy(h)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


_stacks = {}
_stacks_lock = threading.Lock()


def clear_cache():
    """Destroy the C handles (one per shape; made again on the next call)."""
    with _stacks_lock:
        entries = list(_stacks.values())
        _stacks.clear()
    for e in entries:
        e.close()


atexit.register(clear_cache)


def release_cached_memory():
    """Hand the scratch memory the handles keep mapped between calls (their
    own pools, outside PyTorch's allocator) back to the device."""
    with _stacks_lock:
        entries = list(_stacks.values())
    for e in entries:
        if e.handle:
            _check(_load().mixstack_release_cached_memory(e.handle), "mixstack_release_cached_memory")


def _current_stream(device):
    return ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)


def _get_stack(device, dtype, dims):
    key = (device.index, dtype, dims)
    with _stacks_lock:
        st = _stacks.get(key)
    if st is not None:
        return st
    if torch.cuda.is_current_stream_capturing():
        raise MixstackError(
            "mixstack: the first call for this shape is inside a CUDA graph capture; run it once before "
            "capturing (creating the handle allocates and may synchronise)"
        )
    F, cf, lmax, n_layers = dims
    handle = ctypes.c_void_p()
    with torch.cuda.device(device):
        status = _load().mixstack_stack_create_borrowing(
            _DTYPES[dtype], device.index, F, cf, lmax, n_layers, ctypes.byref(handle)
        )
    _check(status, "mixstack_stack_create_borrowing")
    st = _Stack(handle.value)
    with _stacks_lock:
        other = _stacks.setdefault(key, st)
    if other is not st:
        st.close()
    return other


def _ptr(t):
    return t.data_ptr() or None


# ----------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------


def _need(cond, msg):
    if not cond:
        raise ValueError("mixstack_stack: " + msg)


def _check_tensors(tensors):
    """Tensors, on CUDA, of one supported dtype, on one device, dense."""
    for name, t in tensors.items():
        _need(isinstance(t, torch.Tensor), f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
    for name, t in tensors.items():
        _need(t.device.type == "cuda", f"`{name}` is on {t.device}: mixstack runs on CUDA tensors only (no CPU fallback)")
        _need(
            t.dtype in _DTYPES,
            f"`{name}` has dtype {t.dtype}: mixstack supports torch.float32 and torch.float64 only",
        )
    first, t0 = next(iter(tensors.items()))
    for name, t in tensors.items():
        _need(t.device == t0.device, f"`{name}` is on {t.device}, `{first}` on {t0.device}: all tensors must be on one device")
        _need(t.dtype == t0.dtype, f"`{name}` has dtype {t.dtype}, `{first}` {t0.dtype}: all tensors must have one dtype")
        _need(
            t.is_contiguous(),
            f"`{name}` is not contiguous (strides {tuple(t.stride())}): mixstack reads dense row-major "
            f"tensors and does not copy; pass `{name}.contiguous()`",
        )


def _check_scalars(lmax, focus_dim, path):
    _need(path in PATHS, f"path must be one of {sorted(PATHS)}, got {path!r}")
    _need(isinstance(lmax, int) and lmax >= 1, f"lmax must be an int >= 1, got {lmax!r}")
    _need(isinstance(focus_dim, int) and focus_dim >= 1, f"focus_dim must be an int >= 1, got {focus_dim!r}")


def _check_weights(w0_all, w1_all, gw_all, F, lmax, focus_dim):
    """The weights' shapes for F focus streams; returns n_layers."""
    L, cf = lmax, focus_dim
    m0, m1, lg = (L + 1) * cf, 2 * L * cf, L * cf
    _need(w0_all.dim() == 4, f"w0_all must be (n_layers, F, M0, M0), got shape {tuple(w0_all.shape)}")
    n = w0_all.shape[0]
    _need(n >= 1, "w0_all has n_layers = 0")
    for name, t, want in (
        ("w0_all", w0_all, (n, F, m0, m0)),
        ("w1_all", w1_all, (n, F, m1, m1)),
        ("gw_all", gw_all, (n - 1, F, cf, lg)),
    ):
        _need(tuple(t.shape) == want, f"{name} must be {want} (n_layers={n}, F={F}), got {tuple(t.shape)}")
    return n


def _validate(u0, alpha, w0_all, w1_all, gw_all, lmax, focus_dim, path):
    _check_tensors({"u0": u0, "alpha": alpha, "w0_all": w0_all, "w1_all": w1_all, "gw_all": gw_all})
    _check_scalars(lmax, focus_dim, path)
    row = _row(lmax, focus_dim)
    _need(u0.dim() == 3, f"u0 must be (F, E, ROW), got shape {tuple(u0.shape)}")
    F, E, r = u0.shape
    _need(r == row, f"u0 has {r} columns, expected ROW = (3*lmax+1)*focus_dim = {row}")
    _need(F >= 1, "u0 has F = 0 focus streams")
    _need(tuple(alpha.shape) == (E, F), f"alpha must be (E, F) = {(E, F)}, got {tuple(alpha.shape)}")
    return F, E, _check_weights(w0_all, w1_all, gw_all, F, lmax, focus_dim)


def _validate_bwd(grad_out, out, z_all, alpha, w0_all, w1_all, gw_all, lmax, focus_dim, path):
    """The backward's inputs, as a direct call may pass them (autograd's come
    checked from the forward): the forward's outputs' shapes, one device and
    dtype, dense (grad_out is made dense before)."""
    _check_tensors(
        {"out": out, "grad_out": grad_out, "z_all": z_all, "alpha": alpha, "w0_all": w0_all, "w1_all": w1_all,
         "gw_all": gw_all}
    )
    _check_scalars(lmax, focus_dim, path)
    row = _row(lmax, focus_dim)
    _need(out.dim() == 3, f"out must be (E, F, ROW), got shape {tuple(out.shape)}")
    E, F, _r = out.shape
    n = _check_weights(w0_all, w1_all, gw_all, F, lmax, focus_dim)
    for name, t, want in (
        ("out", out, (E, F, row)),
        ("grad_out", grad_out, (E, F, row)),
        ("z_all", z_all, (n - 1, F, E, row)),
        ("alpha", alpha, (E, F)),
    ):
        _need(tuple(t.shape) == want, f"{name} must be {want}, got {tuple(t.shape)}")
    return F, E, n


# ----------------------------------------------------------------------
# the ops
# ----------------------------------------------------------------------

_last_path = None  # (path name, reason) of the most recent backward


def last_backward_path():
    """(path, reason) of the most recent backward through the op in this
    process ("relay" or "fused", and why), or None before the first."""
    return _last_path


def _query_path(st):
    global _last_path
    code = ctypes.c_int(0)
    buf = ctypes.create_string_buffer(256)
    _check(_load().mixstack_last_path(st.handle, ctypes.byref(code), buf, len(buf)), "mixstack_last_path")
    _last_path = (_PATH_NAMES.get(code.value), buf.value.decode("utf-8", "replace"))


def _row(lmax, focus_dim):
    """ROW = (3L+1)Cf."""
    return (3 * lmax + 1) * focus_dim


@torch.library.custom_op("mixstack::stack", mutates_args=())
def stack(
    u0: torch.Tensor,
    alpha: torch.Tensor,
    w0_all: torch.Tensor,
    w1_all: torch.Tensor,
    gw_all: torch.Tensor,
    lmax: int,
    focus_dim: int,
    apply_alpha: bool,
    path: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward: ``(out (E, F, ROW), z_all (n_layers-1, F, E, ROW))``."""
    F, E, n_layers = _validate(u0, alpha, w0_all, w1_all, gw_all, lmax, focus_dim, path)
    row = _row(lmax, focus_dim)
    dev = u0.device
    out = torch.empty((E, F, row), dtype=u0.dtype, device=dev)
    z_all = torch.empty((n_layers - 1, F, E, row), dtype=u0.dtype, device=dev)
    if E == 0:
        return out, z_all
    st = _get_stack(dev, u0.dtype, (F, focus_dim, lmax, n_layers))
    with torch.cuda.device(dev):
        status = _load().mixstack_forward_w(
            st.handle, E, _ptr(u0), _ptr(alpha), int(bool(apply_alpha)),
            _ptr(w0_all), _ptr(w1_all), _ptr(gw_all), _ptr(out), _ptr(z_all), _current_stream(dev),
        )
    _check(status, "mixstack_forward_w")
    return out, z_all


@stack.register_fake
def _(u0, alpha, w0_all, w1_all, gw_all, lmax, focus_dim, apply_alpha, path):
    F, E, row = u0.shape
    n_layers = w0_all.shape[0]
    return u0.new_empty((E, F, row)), u0.new_empty((n_layers - 1, F, E, row))


@torch.library.custom_op("mixstack::stack_bwd", mutates_args=())
def stack_bwd(
    grad_out: torch.Tensor,
    out: torch.Tensor,
    z_all: torch.Tensor,
    alpha: torch.Tensor,
    w0_all: torch.Tensor,
    w1_all: torch.Tensor,
    gw_all: torch.Tensor,
    lmax: int,
    focus_dim: int,
    apply_alpha: bool,
    path: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Input gradients: ``(grad_u0 (F, E, ROW), grad_alpha (E, F))``."""
    # Autograd may hand in any layout (e.g. expanded ones): make it dense.
    if isinstance(grad_out, torch.Tensor) and isinstance(out, torch.Tensor):
        grad_out = grad_out.to(dtype=out.dtype).contiguous()
    F, E, n_layers = _validate_bwd(grad_out, out, z_all, alpha, w0_all, w1_all, gw_all, lmax, focus_dim, path)
    row = _row(lmax, focus_dim)
    dev = out.device
    grad_u0 = torch.empty((F, E, row), dtype=out.dtype, device=dev)
    grad_alpha = torch.empty((E, F), dtype=out.dtype, device=dev)
    if E == 0:
        return grad_u0, grad_alpha
    # The transposes the backward reads, made on the device on this stream.
    wt0 = w0_all.transpose(-1, -2).contiguous()
    wt1 = w1_all.transpose(-1, -2).contiguous()
    gwt = gw_all.transpose(-1, -2).contiguous()
    st = _get_stack(dev, out.dtype, (F, focus_dim, lmax, n_layers))
    with torch.cuda.device(dev):
        status = _load().mixstack_backward_w(
            st.handle, E, _ptr(grad_out), _ptr(out), _ptr(z_all), _ptr(alpha), int(bool(apply_alpha)),
            _ptr(wt0), _ptr(wt1), _ptr(gw_all), _ptr(gwt), _ptr(grad_u0), _ptr(grad_alpha),
            PATHS[path], _current_stream(dev),
        )
    _check(status, "mixstack_backward_w")
    _query_path(st)
    return grad_u0, grad_alpha


@stack_bwd.register_fake
def _(grad_out, out, z_all, alpha, w0_all, w1_all, gw_all, lmax, focus_dim, apply_alpha, path):
    E, F, row = out.shape
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


stack.register_autograd(_backward, setup_context=_setup_context)


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
    environment switch, read at each backward), "relay" or "fused" (fused runs
    only for float32 with Cf < 96; otherwise the relay runs, see
    :func:`last_backward_path`).

    Gradients: only ``u0`` and ``alpha`` get gradients (the inference/force
    backward). The weights get **None**, even when they require grad: do not
    use this op to train the weights. ``grad_alpha`` is
    ``sum(grad_out * out) / max(alpha, 1e-12)`` as upstream, i.e. exact for
    alpha > 0, and zeros when ``apply_alpha`` is false.

    Refused with ValueError (mixstack does not fall back or copy): CPU
    tensors, tensors on different devices or of different dtypes, dtypes
    other than float32/float64, non-contiguous tensors, shapes that do not
    match, and shapes outside the build (Cf, lmax, F the kernels were not
    generated for).
    """
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
