#!/usr/bin/env bash
# Run 54 (device): row kernels without per-element integer division and
# with a warp-uniform gate residual (B) against main 697846e (A): GPU
# tests, verify, then A/B of seed and cf64 (medians of 20, alternating).
set -uo pipefail
AB=" " AB_PRESETS="seed cf64" ROUNDS=2 TESTS_S=150 bash scripts/probe.sh
