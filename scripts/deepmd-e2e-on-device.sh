#!/usr/bin/env bash
# On the GPU machine: install the wheels scripts/stage-deepmd-wheels.sh
# staged (scripts/device-wheels.sh; DeePMD-kit loads libmpi.so.12 at
# import), then run scripts/deepmd_e2e.py over the library
# of the staged bundle (.device/, scripts/stage-device.sh). Results under $OUT.
#   carry: [".device/bundle.tar.xz", ".whl/mpi"], then at once [".whl/deepmd"]
#   (one call cannot carry both with the tree: scripts/stage-deepmd-wheels.sh)
#   args: passed to deepmd_e2e.py
set -uo pipefail
OUT=${OUT:-/tmp/mixstack-out}; mkdir -p "$OUT"
if [ -f .device/bundle.tar.xz ] && [ ! -f .device/libmixstack.so ]; then tar -C .device -xJf .device/bundle.tar.xz && mv .device/bin/* .device/; fi
. scripts/device-wheels.sh && need mpi deepmd || exit 1
export MIXSTACK_LIB=$PWD/.device/libmixstack.so PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 scripts/deepmd_e2e.py --json "$OUT/deepmd_e2e.json" "$@" 2>&1 | tee "$OUT/deepmd_e2e.log"
