#!/usr/bin/env bash
# Builds the release binary, the C library and the GPU test binaries here and
# packs them into .device/bundle.tar.xz (git-ignored) for the device tool's
# `carry`; the GPU machine has no Rust. There: scripts/on-device.sh unpacks.
# BINS="mixstack gpu_stack": pack only those (the tracked tree is near the
# tool's 64 MiB with the carry; the whole bundle may not fit beside it).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .device && mkdir -p .device/bin
cargo build --release
rel="${CARGO_TARGET_DIR:-target}/release"
cp "$rel/mixstack" .device/bin/
[ -f "$rel/libmixstack.so" ] && cp "$rel/libmixstack.so" .device/bin/
cargo test --release --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, sys, shutil
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        name = m["target"]["name"]
        # gpu_* suites, and capi_cpu whose handle tests also run on a GPU.
        if name.startswith("gpu_") or name == "capi_cpu":
            shutil.copy(m["executable"], ".device/bin/" + name)
'
strip .device/bin/*
if [ -n "${BINS:-}" ]; then
  tar -C .device -cJf .device/bundle.tar.xz $(for b in $BINS; do echo "bin/$b"; done) && rm -rf .device/bin
else
  tar -C .device -cJf .device/bundle.tar.xz bin && rm -rf .device/bin
fi
ls -la .device
