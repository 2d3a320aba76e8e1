#!/usr/bin/env bash
# Run 56 (device): run 55's build (B). fwd_gate's row tiles, interleaved in
# one bench each at seed and cf64 (the instruction mix changed); A/B of the
# f1 workload against main 697846e (A); the PyTorch op and C ABI tests.
set -uo pipefail
OUT=${OUT:-/tmp/mixstack-out}; mkdir -p "$OUT"
for d in .device/old .device; do tar -C $d -xJf $d/bundle.tar.xz && mv $d/bin/* $d/; done
export MIXSTACK_VECTORS="$PWD/vectors"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > "$OUT/gpu.txt"; date -u >> "$OUT/gpu.txt"
for p in "seed 32" "cf64 64"; do set -- $p
  F=""; for t in r32_t128_b8 r16_t128_b8 r64_t256_b4 r8_t256_b1 r32_t256_b1 r64_t256_b1 r128_t256_b1; do F="$F --forward-variant fwd_gate=ms_fwd_gate_f32_cf$2_$t"; done
  timeout 100 .device/mixstack bench --preset $1 --reps 10 --variant relay --forward-variant default $F --json "$OUT/tiles_$1.json" > "$OUT/tiles_$1.log" 2>&1; echo "tiles $1 rc=$?"
  grep -E "^(default|fwd_gate=).* median |^    fwd_gate |forward median:" "$OUT/tiles_$1.log" | cut -c1-110
done
ROUNDS=2 timeout 120 bash scripts/ab.sh --preset f1; echo "ab f1 rc=$?"; mkdir -p "$OUT/ab_f1" && mv "$OUT"/ab_[AB]_* "$OUT/ab_f1/"
MIXSTACK_LIB=$PWD/.device/libmixstack.so timeout 120 python3 python/tests/test_torch_op.py --bench --repeats 5 > "$OUT/torch_op.log" 2>&1; echo "torch rc=$?"; tail -9 "$OUT/torch_op.log"
cd "$OUT" && tar -czf /tmp/results.tar.gz ./* && rm -rf "$OUT"/* && mv /tmp/results.tar.gz "$OUT"/results.tar.gz
