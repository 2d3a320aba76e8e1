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
