#!/usr/bin/env bash
# Run 53 (device): where the forward's time goes. Nsight Compute (full set,
# PC-sampled stall sources) on one launch each of fwd_gate, fwd_m1 and
# bwd_gemm at the seed workload; then the PyTorch op and C ABI tests
# (TORCH=1), not run last session.
set -uo pipefail
OUT=${OUT:-/tmp/mixstack-out}; mkdir -p "$OUT"
tar -C .device -xJf .device/bundle.tar.xz && mv .device/bin/* .device/
lib=$(find /usr/local -name 'libcublas.so*' 2>/dev/null | head -1); export LD_LIBRARY_PATH="$(dirname "$lib")"
export MIXSTACK_VECTORS="$PWD/vectors"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > "$OUT/gpu.txt"; date -u >> "$OUT/gpu.txt"
for k in fwd_gate fwd_m1 bwd_gemm; do
  timeout 150 ncu --clock-control none -k "regex:${k}_" -s 2 -c 1 --set full --import-source no \
    .device/mixstack bench --preset seed --reps 1 --variant relay > "$OUT/ncu_$k.log" 2>&1; echo "ncu $k rc=$?"
  grep -E "Duration|DRAM Throughput|Memory Throughput|L1/TEX Hit|L2 Hit|Compute \(SM\)|Issued Ipc|Achieved Occupancy|Warp Cycles Per Issued|Registers Per|Theoretical Occ|Block Limit" "$OUT/ncu_$k.log" | head -24
done
MIXSTACK_LIB=$PWD/.device/libmixstack.so timeout 120 python3 python/tests/test_torch_op.py --bench --repeats 5 > "$OUT/torch_op.log" 2>&1; echo "torch rc=$?"; tail -14 "$OUT/torch_op.log"
