"""The PyTorch op over the C library (_lib.py): autograd, weight stacks,
argument checks."""

import atexit
import collections
import ctypes
import operator
import threading

import torch
from torch.autograd.function import once_differentiable

from . import _lib as _libmod
from ._lib import _STATUS, PATHS, _PATH_NAMES, MixstackError, _check, _load

_DTYPES = {torch.float32: 0, torch.float64: 1}


# ----------------------------------------------------------------------
# stacks, cached per weights
# ----------------------------------------------------------------------


class _Stack:
    """One C handle. Holds the weight tensors so their memory (the cache key)
    cannot be reused by other tensors while the handle is cached."""

    def __init__(self, handle, dtype, device, weights):
        self.handle = handle
        self.dtype = dtype
        self.device = device
        self.weights = weights

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


_CACHE_SIZE = 8
_cache = collections.OrderedDict()
_cache_lock = threading.Lock()


def clear_cache():
    """Destroy every cached stack (they are re-created on the next call)."""
    with _cache_lock:
        entries = list(_cache.values())
        _cache.clear()
    for e in entries:
        e.close()


atexit.register(clear_cache)


def release_cached_memory():
    """Hand the scratch memory the cached stacks keep mapped between calls
    (their own pools, outside PyTorch's allocator) back to the device."""
    with _cache_lock:
        entries = list(_cache.values())
    for e in entries:
        if e.handle:
            _check(_load().mixstack_release_cached_memory(e.handle), "mixstack_release_cached_memory")


def _current_stream(device):
    return ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)


def _get_stack(w0_all, w1_all, gw_all, dims_key):
    dtype, device = w0_all.dtype, w0_all.device
    ws = (w0_all, w1_all, gw_all)
    # The version counters catch in-place updates of the weights.
    key = (device.index, dtype, dims_key) + tuple(w.data_ptr() for w in ws) + tuple(w._version for w in ws)
    with _cache_lock:
        st = _cache.get(key)
        if st is not None:
            _cache.move_to_end(key)
            return st
    lib = _load()
    F, cf, lmax, n_layers = dims_key
    handle = ctypes.c_void_p()
    with torch.cuda.device(device):
        status = lib.mixstack_stack_create(
            _DTYPES[dtype], device.index, F, cf, lmax, n_layers,
            w0_all.data_ptr() or None, w1_all.data_ptr() or None, gw_all.data_ptr() or None,
            _current_stream(device), ctypes.byref(handle),
        )
    _check(status, "mixstack_stack_create")
    st = _Stack(handle.value, dtype, device, tuple(w.detach() for w in ws))
    evicted = []
    with _cache_lock:
        _cache[key] = st
        while len(_cache) > _CACHE_SIZE:
            evicted.append(_cache.popitem(last=False)[1])
    for e in evicted:
        e.close()
    return st


# ----------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------


def _need(cond, msg):
    if not cond:
        raise ValueError("mixstack_stack: " + msg)


def _validate(u0, alpha, w0_all, w1_all, gw_all, lmax, focus_dim, path):
    tensors = {"u0": u0, "alpha": alpha, "w0_all": w0_all, "w1_all": w1_all, "gw_all": gw_all}
    for name, t in tensors.items():
        _need(isinstance(t, torch.Tensor), f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
    for name, t in tensors.items():
        _need(t.is_cuda, f"`{name}` is on {t.device}: mixstack runs on CUDA tensors only (no CPU fallback)")
        _need(
            t.dtype in _DTYPES,
            f"`{name}` has dtype {t.dtype}: mixstack supports torch.float32 and torch.float64 only",
        )
    dev, dt = u0.device, u0.dtype
    for name, t in tensors.items():
        _need(t.device == dev, f"`{name}` is on {t.device}, `u0` on {dev}: all tensors must be on one device")
        _need(t.dtype == dt, f"`{name}` has dtype {t.dtype}, `u0` {dt}: all tensors must have one dtype")
        _need(
            t.is_contiguous(),
            f"`{name}` is not contiguous (strides {tuple(t.stride())}): mixstack reads dense row-major "
            f"tensors and does not copy; pass `{name}.contiguous()`",
        )
    _need(path in PATHS, f"path must be one of {sorted(PATHS)}, got {path!r}")
    _need(isinstance(lmax, int) and lmax >= 1, f"lmax must be an int >= 1, got {lmax!r}")
    _need(isinstance(focus_dim, int) and focus_dim >= 1, f"focus_dim must be an int >= 1, got {focus_dim!r}")
    L, cf = lmax, focus_dim
    row, m0, m1, lg = (3 * L + 1) * cf, (L + 1) * cf, 2 * L * cf, L * cf
    _need(u0.dim() == 3, f"u0 must be (F, E, ROW), got shape {tuple(u0.shape)}")
    F, E, r = u0.shape
    _need(r == row, f"u0 has {r} columns, expected ROW = (3*lmax+1)*focus_dim = {row}")
    _need(F >= 1, "u0 has F = 0 focus streams")
    _need(tuple(alpha.shape) == (E, F), f"alpha must be (E, F) = {(E, F)}, got {tuple(alpha.shape)}")
    _need(w0_all.dim() == 4, f"w0_all must be (n_layers, F, M0, M0), got shape {tuple(w0_all.shape)}")
    n = w0_all.shape[0]
    _need(n >= 1, "w0_all has n_layers = 0")
    for name, t, want in (
        ("w0_all", w0_all, (n, F, m0, m0)),
        ("w1_all", w1_all, (n, F, m1, m1)),
        ("gw_all", gw_all, (n - 1, F, cf, lg)),
    ):
        _need(tuple(t.shape) == want, f"{name} must be {want} (n_layers={n}, F={F}), got {tuple(t.shape)}")
    return F, E, n


# ----------------------------------------------------------------------
# the op
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


class _MixstackStackFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u0, alpha, w0_all, w1_all, gw_all, lmax, focus_dim, apply_alpha, path):
        F, E, n_layers = _validate(u0, alpha, w0_all, w1_all, gw_all, lmax, focus_dim, path)
        row = (3 * lmax + 1) * focus_dim
        dev = u0.device
        st = _get_stack(w0_all, w1_all, gw_all, (F, focus_dim, lmax, n_layers))
        out = torch.empty((E, F, row), dtype=u0.dtype, device=dev)
        z_all = torch.empty((n_layers - 1, F, E, row), dtype=u0.dtype, device=dev)
        with torch.cuda.device(dev):
            status = _load().mixstack_forward(
                st.handle, E, u0.data_ptr() or None, alpha.data_ptr() or None, int(bool(apply_alpha)),
                out.data_ptr() or None, z_all.data_ptr() or None, _current_stream(dev),
            )
        _check(status, "mixstack_forward")
        ctx.stack = st  # keeps the handle alive for backward, even if evicted
        ctx.apply_alpha = bool(apply_alpha)
        ctx.path = PATHS[path]
        ctx.save_for_backward(out, z_all, alpha)
        ctx.mark_non_differentiable(z_all)
        return out, z_all

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, _grad_z_all):
        out, z_all, alpha = ctx.saved_tensors
        st = ctx.stack
        E, F, _row = out.shape
        dev = out.device
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        # Autograd may hand in any layout (e.g. expanded ones): make it dense.
        grad_out = grad_out.to(dtype=out.dtype).contiguous()
        grad_u0 = torch.empty((F, E, out.shape[2]), dtype=out.dtype, device=dev)
        grad_alpha = torch.empty((E, F), dtype=out.dtype, device=dev)
        with torch.cuda.device(dev):
            status = _load().mixstack_backward(
                st.handle, E, grad_out.data_ptr() or None, out.data_ptr() or None, z_all.data_ptr() or None,
                alpha.data_ptr() or None, int(ctx.apply_alpha), grad_u0.data_ptr() or None,
                grad_alpha.data_ptr() or None, ctx.path, _current_stream(dev),
            )
        _check(status, "mixstack_backward")
        if E > 0:
            _query_path(st)
        return (
            grad_u0 if ctx.needs_input_grad[0] else None,
            grad_alpha if ctx.needs_input_grad[1] else None,
            None, None, None, None, None, None, None,
        )


def mixstack_stack(u0, alpha, w0_all, w1_all, gw_all, lmax, focus_dim, apply_alpha, path="auto"):
    """The SO(2) mixing stack (docs/MIXING_STACK.md) on CUDA through mixstack.

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
    alpha > 0, and zeros when ``apply_alpha`` is false. The op is not
    twice differentiable.

    Refused with ValueError (mixstack does not fall back or copy): CPU
    tensors, tensors on different devices or of different dtypes, dtypes
    other than float32/float64, non-contiguous tensors, shapes that do not
    match, and shapes outside the build (Cf, lmax, F the kernels were not
    generated for).

    The weights are copied to mixstack once per (device, dtype, shapes,
    weight data_ptr, weight version): in-place updates of the weights (which
    bump their version counter) make a new stack; a cache of the last 8
    stacks holds references to their weight tensors.
    """
    try:
        lmax, focus_dim = operator.index(lmax), operator.index(focus_dim)
    except TypeError:
        raise ValueError(f"mixstack_stack: lmax and focus_dim must be integers, got {lmax!r}, {focus_dim!r}") from None
    if alpha is None and not apply_alpha and isinstance(u0, torch.Tensor) and u0.dim() == 3:
        # mixstack always takes an alpha buffer; it is not read without apply_alpha.
        alpha = torch.ones((u0.shape[1], u0.shape[0]), dtype=u0.dtype, device=u0.device)
    return _MixstackStackFn.apply(u0, alpha, w0_all, w1_all, gw_all, lmax, focus_dim, apply_alpha, path)
