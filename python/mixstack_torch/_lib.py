"""The C library under mixstack_torch: finding and loading libmixstack.so,
its ABI version and status codes (include/mixstack.h). Needs no torch.
"""

import ctypes
import glob
import operator
import os
import threading

ABI_VERSION = 4
LIB_NAME = "libmixstack.so"

# include/mixstack.h
_STATUS = {
    0: "MIXSTACK_OK",
    1: "MIXSTACK_ERR_NULL_POINTER",
    2: "MIXSTACK_ERR_BAD_SHAPE",
    3: "MIXSTACK_ERR_BAD_DTYPE",
    4: "MIXSTACK_ERR_MISALIGNED",
    5: "MIXSTACK_ERR_UNSUPPORTED",
    6: "MIXSTACK_ERR_CUDA",
    7: "MIXSTACK_ERR_INTERNAL",
    8: "MIXSTACK_ERR_BAD_ARGUMENT",
    9: "MIXSTACK_ERR_INVALID_HANDLE",
}
# Statuses that mean "the caller asked for something invalid" -> ValueError.
_VALUE_ERRORS = {1, 2, 3, 4, 8, 9}
PATHS = {"auto": 0, "relay": 1, "fused": 2, "fused_always": 3}
_PATH_NAMES = {0: None, 1: "relay", 2: "fused"}


class MixstackError(RuntimeError):
    """A mixstack call failed for a reason other than an invalid argument."""


# ----------------------------------------------------------------------
# the library
# ----------------------------------------------------------------------

_lib = None
_lib_path = None
_lib_lock = threading.Lock()


def _candidates():
    env = os.environ.get("MIXSTACK_LIB")
    if env:
        yield os.path.join(env, LIB_NAME) if os.path.isdir(env) else env
        return
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(os.path.dirname(here))  # python/mixstack_torch -> repo
    # `pip install` puts the library in the package under an extension name
    # (libmixstack.cpython-311-x86_64-linux-gnu.so).
    # (Not libmixstack_torch.so, the ops' library beside it.)
    yield os.path.join(here, LIB_NAME)
    yield from sorted(glob.glob(os.path.join(here, "libmixstack.cpython*.so")))
    yield os.path.join(repo, ".device", LIB_NAME)
    yield os.path.join(repo, "target", "release", LIB_NAME)


def library_path():
    """Path of the libmixstack.so that is (or would be) loaded."""
    if _lib_path is not None:
        return _lib_path
    tried = list(_candidates())
    for p in tried:
        if os.path.isfile(p):
            return p
    raise OSError(
        "libmixstack.so not found; tried: " + ", ".join(tried)
        + " (set MIXSTACK_LIB to the file or its directory; `pip install ./python` builds it into the package,"
        + " `cargo build --release` into target/release)"
    )


def _load():
    with _lib_lock:
        if _lib is not None:
            return _lib
        path = library_path()
        try:
            return _bind(path)
        except AttributeError as e:
            # A library without mixstack's symbols (MIXSTACK_LIB pointing
            # elsewhere): the same OSError as one that does not load.
            raise OSError(f"{path} is not libmixstack.so: {e}") from None


def _bind(path):
    """Open `path` and declare the C ABI's functions (AttributeError for a
    missing symbol)."""
    global _lib, _lib_path
    lib = ctypes.CDLL(path)
    c_int, c_i64, c_vp = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    lib.mixstack_abi_version.argtypes = []
    lib.mixstack_abi_version.restype = c_int
    lib.mixstack_last_error.argtypes = []
    lib.mixstack_last_error.restype = ctypes.c_char_p
    lib.mixstack_stack_create.argtypes = [
        c_int, c_int, c_i64, c_i64, c_i64, c_i64, c_vp, c_vp, c_vp, c_vp, ctypes.POINTER(c_vp),
    ]
    lib.mixstack_stack_create.restype = c_int
    lib.mixstack_stack_create_borrowing.argtypes = [c_int, c_int, c_i64, c_i64, c_i64, c_i64, ctypes.POINTER(c_vp)]
    lib.mixstack_stack_create_borrowing.restype = c_int
    lib.mixstack_supports.argtypes = [c_int, c_i64, c_i64, c_i64, c_i64]
    lib.mixstack_supports.restype = c_int
    lib.mixstack_forward_w.argtypes = [c_vp, c_i64, c_vp, c_vp, c_int, c_vp, c_vp, c_vp, c_vp, c_vp, c_vp]
    lib.mixstack_forward_w.restype = c_int
    lib.mixstack_backward_w.argtypes = [
        c_vp, c_i64, c_vp, c_vp, c_vp, c_vp, c_int, c_vp, c_vp, c_vp, c_vp, c_vp, c_vp, c_int, c_vp,
    ]
    lib.mixstack_backward_w.restype = c_int
    lib.mixstack_forward.argtypes = [c_vp, c_i64, c_vp, c_vp, c_int, c_vp, c_vp, c_vp]
    lib.mixstack_forward.restype = c_int
    lib.mixstack_backward.argtypes = [c_vp, c_i64, c_vp, c_vp, c_vp, c_vp, c_int, c_vp, c_vp, c_int, c_vp]
    lib.mixstack_backward.restype = c_int
    lib.mixstack_last_path.argtypes = [c_vp, ctypes.POINTER(c_int), ctypes.c_char_p, ctypes.c_size_t]
    lib.mixstack_last_path.restype = c_int
    lib.mixstack_stack_destroy.argtypes = [c_vp]
    lib.mixstack_stack_destroy.restype = None
    lib.mixstack_release_cached_memory.argtypes = [c_vp]
    lib.mixstack_release_cached_memory.restype = c_int
    version = lib.mixstack_abi_version()
    if version != ABI_VERSION:
        raise OSError(f"{path}: ABI version {version}, this package expects {ABI_VERSION}")
    _lib, _lib_path = lib, path
    return lib


def _check(status, func):
    """Raise on a non-zero status, with the library's message (read on this thread)."""
    if status == 0:
        return
    msg = _load().mixstack_last_error()
    msg = msg.decode("utf-8", "replace") if msg else ""
    name = _STATUS.get(status, f"status {status}")
    # The library's message names the function and the status already.
    text = f"mixstack: {msg}" if msg else f"mixstack: {func} failed ({name})"
    if status in _VALUE_ERRORS:
        raise ValueError(text)
    raise MixstackError(text)



def abi_version():
    """The ABI version of the loaded library (checked against ABI_VERSION at load)."""
    return _load().mixstack_abi_version()


_DTYPE_CODES = {"float32": 0, "float64": 1}


def supports(dtype, f, cf, lmax, n_layers):
    """``(True, "")`` if the build serves a stack of this dtype ("float32" /
    "float64", or a torch dtype) and shape, else ``(False, reason)``. Reads the
    kernel table only: no GPU needed."""
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPE_CODES:
        return False, f"dtype {dtype}: mixstack serves float32 and float64"
    dims = {"F": f, "Cf": cf, "lmax": lmax, "n_layers": n_layers}
    for k, v in dims.items():
        # Integers only (2.9 is not 2), and within int64: ctypes would wrap.
        try:
            dims[k] = operator.index(v)
        except TypeError:
            return False, f"{k} = {v!r}: not an integer"
        if not -(2**63) <= dims[k] < 2**63:
            return False, f"{k} = {v}: out of the int64 range"
    lib = _load()
    status = lib.mixstack_supports(_DTYPE_CODES[name], dims["F"], dims["Cf"], dims["lmax"], dims["n_layers"])
    if status == 0:
        return True, ""
    msg = lib.mixstack_last_error()
    return False, (msg.decode("utf-8", "replace") if msg else _STATUS.get(status, f"status {status}"))
