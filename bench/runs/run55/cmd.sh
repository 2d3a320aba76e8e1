#!/usr/bin/env bash
# Run 55 (device): run 54's build with the gate residual in one warp-uniform
# loop (scalar items first, then gated) and the shared row helpers of the
# fused kernels left as they were (B), against main 697846e (A): GPU tests,
# verify, then A/B of seed and cf64 (medians of 20, alternating).
set -uo pipefail
AB=" " AB_PRESETS="seed cf64" ROUNDS=2 TESTS_S=150 bash scripts/probe.sh
