#!/usr/bin/env bash
# On the GPU machine: install the wheels scripts/stage-deepmd-wheels.sh
# carried in .whl/ (mpich into its own prefix: DeePMD-kit loads its
# libmpi.so.12 at import), then run scripts/deepmd_e2e.py over the library
# of the staged bundle (.device/, scripts/stage-device.sh). Results under $OUT.
#   carry: [".device/bundle.tar.xz", ".whl"]   args: passed to deepmd_e2e.py
set -uo pipefail
OUT=${OUT:-/tmp/mixstack-out}; mkdir -p "$OUT"
if [ -f .device/bundle.tar.xz ] && [ ! -f .device/libmixstack.so ]; then tar -C .device -xJf .device/bundle.tar.xz && mv .device/bin/* .device/; fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --prefix /tmp/mpich .whl/mpich-*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  $(ls .whl/*.whl | grep -v '/mpich-') || exit 1
mpich_site=$(ls -d /tmp/mpich/lib/python3*/site-packages)
export PYTHONPATH=/tmp/site:$mpich_site:$PWD/python LD_LIBRARY_PATH=/tmp/mpich/lib:${LD_LIBRARY_PATH:-}
export MIXSTACK_LIB=$PWD/.device/libmixstack.so PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 scripts/deepmd_e2e.py --json "$OUT/deepmd_e2e.json" "$@" 2>&1 | tee "$OUT/deepmd_e2e.log"
