#!/usr/bin/env bash
# Builds the release binary and the GPU test binaries here and copies them
# into .device/ (git-ignored) for the device tool's `carry`; the GPU machine
# has no Rust. Then, there: scripts/on-device.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .device && mkdir -p .device
cargo build --release
cp target/release/mixstack .device/
cargo test --release --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, sys, shutil
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        name = m["target"]["name"]
        if name.startswith("gpu_"):
            shutil.copy(m["executable"], ".device/" + name)
            print("staged", name)
'
ls -la .device
