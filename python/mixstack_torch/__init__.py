"""PyTorch op over mixstack's C ABI (include/mixstack.h, libmixstack.so).

    from mixstack_torch import mixstack_stack
    out, z_all = mixstack_stack(u0, alpha, w0_all, w1_all, gw_all, lmax, focus_dim, apply_alpha)

The library is found, in order, at: ``$MIXSTACK_LIB`` (a file, or a directory
holding libmixstack.so); inside this package (``pip install ./python`` builds
it there); the repository's ``.device/``, ``target/release/``. See
python/README.md. The library part (``library_path``, ``abi_version``)
imports without torch; the op needs torch.
"""

from ._lib import ABI_VERSION, PATHS, MixstackError, abi_version, library_path, supports

__all__ = ["ABI_VERSION", "PATHS", "MixstackError", "abi_version", "library_path", "supports"]

try:
    import torch  # noqa: F401
except ImportError:  # the library loads without torch; the op needs it
    torch = None

if torch is not None:
    try:
        from .ops import clear_cache, last_backward_path, mixstack_stack, release_cached_memory
    except Exception as _e:  # noqa: BLE001  (DeePMD-kit imports this through its plugins: never stop it)
        # The ops' C++ library could not be built or loaded (no compiler,
        # another torch): the library part above still works; the ops say why.
        import warnings

        warnings.warn(f"mixstack_torch: the ops are unavailable: {_e}", stacklevel=2)
        _ops_error = _e

        def _unavailable(*_args, **_kwargs):
            raise ImportError(f"mixstack_torch: the ops are unavailable: {_ops_error}") from _ops_error

        clear_cache = last_backward_path = mixstack_stack = release_cached_memory = _unavailable

    __all__ += ["mixstack_stack", "last_backward_path", "clear_cache", "release_cached_memory"]
