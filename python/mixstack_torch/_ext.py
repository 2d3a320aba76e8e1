"""libmixstack_torch.so: the C++ registration of the ops (csrc/mixstack_op.cpp).

It defines ``mixstack::stack`` and ``mixstack::stack_bwd`` with their CUDA
(C ABI) and CPU (reference) kernels, links against the torch it is built
with (libc10, libtorch, libtorch_cpu; no Python), and is what DeePMD-kit's
C++ loads through ``DP_PLUGIN_PATH`` for a frozen ``.pt2`` (LAMMPS).

Built by ``pip install --no-build-isolation ./python`` (setup.py) into the
package, against the torch of that environment. Where the package has none
(a source checkout on ``PYTHONPATH``, or an install without torch), the
first use builds it into ``$MIXSTACK_TORCH_CACHE`` (default
``~/.cache/mixstack_torch``), keyed by the torch version and the source.
``python -m mixstack_torch._ext [DIR]`` builds it and prints its path.
"""

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import uuid

LIB_NAME = "libmixstack_torch.so"
_HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(_HERE, "csrc", "mixstack_op.cpp")


def header_dir():
    """The directory of mixstack.h: the package's copy (installed), else the
    repository's include/."""
    for d in (os.path.join(_HERE, "include"), os.path.join(os.path.dirname(os.path.dirname(_HERE)), "include")):
        if os.path.isfile(os.path.join(d, "mixstack.h")):
            return d
    raise FileNotFoundError("mixstack.h: neither in the package (include/) nor in the repository's include/")


def _stamp(torch):
    """The torch a build is for (its version and C++ ABI), written beside it."""
    return f"{torch.__version__} cxx11abi={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"


def _digest(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read())
    return "sha256 " + h.hexdigest()


def _stamp_lines(path):
    """The lines of the stamp beside a build: the torch it is for, and the
    build's own digest (written when it was published)."""
    try:
        with open(path + ".torch") as f:
            return f.read().splitlines()
    except OSError:
        return []


def _intact(path):
    """A cached build is loaded only as it was published: a file cut short
    (a full disk, a copy) would crash the loader (SIGBUS), not fail it."""
    lines = _stamp_lines(path)
    return len(lines) >= 2 and os.path.isfile(path) and _digest(path) == lines[1]


def _key(torch):
    h = hashlib.sha256()
    for p in (SOURCE, os.path.join(header_dir(), "mixstack.h")):
        with open(p, "rb") as f:
            h.update(f.read())
    h.update(_stamp(torch).encode())
    return h.hexdigest()[:16]


def build(out_dir):
    """Compiles the library into out_dir against the importable torch;
    returns its path. Needs a C++17 compiler ($CXX, else c++)."""
    import torch
    from torch.utils import cpp_extension

    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, LIB_NAME)
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("mixstack_torch: building libmixstack_torch.so needs a C++ compiler (set CXX)")
    libs = cpp_extension.library_paths()
    cmd = [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", "-I", header_dir()]
    for d in cpp_extension.include_paths():
        cmd += ["-isystem", d]
    # A name no other build uses, whatever its host or PID namespace (ranks
    # sharing a cache over NFS); the linker creates it under the umask, as
    # any library.
    tmp = os.path.join(out_dir, f"{LIB_NAME}.{uuid.uuid4().hex}.tmp")
    cmd += [SOURCE, "-o", tmp]
    for d in libs:
        cmd += ["-L", d, f"-Wl,-rpath,{d}"]
    cmd += ["-lc10", "-ltorch", "-ltorch_cpu", "-ldl"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"mixstack_torch: building {LIB_NAME} failed:\n{' '.join(cmd)}\n{r.stderr[-4000:]}")
        # Published only once it loads (in a child, which sees this sys.path:
        # loading registers ops).
        probe = "import ctypes, sys, torch; ctypes.CDLL(sys.argv[1])"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        r = subprocess.run([sys.executable, "-c", probe, tmp], capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise RuntimeError(f"mixstack_torch: the built {LIB_NAME} does not load:\n{r.stderr[-4000:]}")
        with open(tmp + ".torch", "w") as f:
            f.write(_stamp(torch) + "\n" + _digest(tmp) + "\n")
        os.replace(tmp + ".torch", out + ".torch")
        os.replace(tmp, out)
    finally:
        for t in (tmp, tmp + ".torch"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(t)
    return out


@contextlib.contextmanager
def _locked(d):
    """An exclusive lock on folder `d` (created): one build at a time among
    the processes sharing it (MPI ranks, test workers), the others wait and
    then find it built. POSIX locks, which NFS's lock manager honours."""
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, ".lock"), "a") as f:
        fcntl.lockf(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(f, fcntl.LOCK_UN)


def library_path(build_missing=True, packaged=True):
    """The libmixstack_torch.so to load: the package's (built at install) if
    built for this torch (and `packaged`), else the cached build for this
    torch and source (built now if missing or not as published)."""
    import torch

    own = os.path.join(_HERE, LIB_NAME)
    if packaged and _stamp_lines(own)[:1] == [_stamp(torch)]:
        return own

    d = _cache_dir(torch)
    path = os.path.join(d, LIB_NAME)
    if not _intact(path):
        if not build_missing:
            raise FileNotFoundError(path)
        with _locked(d):
            if not _intact(path):
                build(d)
    return path


def _cache_dir(torch):
    cache = os.environ.get("MIXSTACK_TORCH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "mixstack_torch")
    return os.path.join(cache, _key(torch))


def identity(path):
    """What a rebuild compares: the file that failed to load, or another."""
    with contextlib.suppress(OSError):
        st = os.stat(path)
        return st.st_ino, st.st_mtime_ns, st.st_size
    return None


def rebuild(path, failed):
    """Build the cached library at `path` again (one that exists but does not
    load: a build cut short, or damaged), unless another process already
    has: `failed` is the identity() of the file that did not load. The
    package's own build is not rebuilt."""
    import torch

    d = _cache_dir(torch)
    if os.path.dirname(os.path.abspath(path)) != os.path.abspath(d):
        raise FileNotFoundError(f"{path} is not a cached build; reinstall the package")
    with _locked(d):
        if identity(path) == failed or not _intact(path):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            build(d)
    return path


if __name__ == "__main__":
    print(build(sys.argv[1]) if len(sys.argv) > 1 else library_path())
