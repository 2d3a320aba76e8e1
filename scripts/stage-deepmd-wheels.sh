#!/usr/bin/env bash
# Downloads, here, the wheels DeePMD-kit 3.2.0 needs on the GPU machine
# (Python 3.12, no network there; its image has torch, triton, e3nn, numpy,
# scipy, h5py, einops, ml-dtypes, msgpack) into .whl/ (git-ignored, ~26 MiB),
# for the device tool's `carry` with scripts/deepmd-e2e-on-device.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  plat+=(--platform "$p")
done
for w in deepmd-kit==3.2.0 mpich==5.0.2 vesin-torch==0.6.2 vesin==0.6.2 lmdb==3.0.0 \
         array-api-compat wcmatch bracex dargs typeguard; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" -d .whl "$w" || python3 -m pip download -q --no-deps --only-binary=:all: -d .whl "$w"
done
du -sh .whl && ls .whl
# mpich: DeePMD-kit needs only libmpi.so.12; drop the ABI library and the
# launchers (6 MB) so the wheels, the bundle and the tree fit one carry.
python3 - <<'PY'
import glob, os, zipfile
src = glob.glob(".whl/mpich-*.whl")[0]
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(src + ".tmp", "w", zipfile.ZIP_DEFLATED) as zout:
    for i in zin.infolist():
        if not (i.filename.endswith("libmpi_abi.so.1") or "/data/bin/" in i.filename):
            zout.writestr(i, zin.read(i.filename))
os.replace(src + ".tmp", src)
PY
du -sh .whl
