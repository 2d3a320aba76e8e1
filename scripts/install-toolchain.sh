#!/usr/bin/env bash
# Installs the pinned CUDA 13.0 compiler toolchain from PyPI wheels into
# .toolchain/ (no system CUDA needed). --no-deps: the wheels' unpinned
# dependencies would pull 13.5 parts that emit PTX 9.5, which the 13.0
# driver rejects (see docs/TOOLCHAIN.md).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="${MIXSTACK_TOOLCHAIN_DIR:-$root/.toolchain}"
if [ -x "$dest/nvidia/cu13/bin/nvcc" ]; then
  echo "toolchain already at $dest"; exit 0
fi
python3 -m pip install -q --no-deps --target "$dest" \
  nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-nvcc==13.0.88 \
  nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
  nvidia-cuda-runtime==13.0.96
echo "toolchain installed at $dest/nvidia/cu13"
