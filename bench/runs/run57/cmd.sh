#!/usr/bin/env bash
# Run 57 (device): the final build (3f80548): GPU tests (with the new
# cublas_path_tiles_bitwise_equal_every_tile), verify, and the seed A/B
# against main 697846e (A) once more on this machine start.
set -uo pipefail
AB=" " AB_PRESETS="seed" ROUNDS=2 TESTS_S=200 bash scripts/probe.sh
