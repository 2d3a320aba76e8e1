//! Stage 4: CUDA C -> PTX (nvcc 13.0) -> a cubin per target arch (ptxas -v, whose report
//! stage 5 reads). Results are cached by content hash, so an unchanged
//! instance never recompiles. Failures carry the compiler's text and the
//! command that reproduces them.

use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    #[error("{instance}: `{command}` failed:\n{stderr}")]
    Tool { instance: String, command: String, stderr: String },
    #[error("{instance}: cannot run `{command}`: {source}")]
    Spawn { instance: String, command: String, source: std::io::Error },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
}

/// The pinned CUDA 13.0 compilers.
#[derive(Debug, Clone)]
pub struct Toolchain {
    pub root: PathBuf,
    /// nvcc's `release` line.
    pub version: String,
    /// Everything `nvcc --version` and `ptxas --version` print: part of
    /// every cache key, so another build of the tools never reuses a cubin.
    pub identity: String,
}

pub const REQUIRED_RELEASE: &str = "release 13.0";

pub const INSTALL_HINT: &str = "install the pinned CUDA 13.0 toolchain with `scripts/install-toolchain.sh` \
(PyPI wheels into .toolchain/, no system CUDA needed) or point MIXSTACK_CUDA_ROOT at a CUDA 13.0 \
root holding bin/nvcc and bin/ptxas";

impl Toolchain {
    /// MIXSTACK_CUDA_ROOT, else `<crate>/.toolchain/nvidia/cu13`. Only 13.0 is
    /// accepted: newer tools emit PTX the 13.0 driver rejects. `Ok(Err(why))`:
    /// none there, `why` saying where it looked (a snapshot build says it);
    /// `Err`: one there that cannot be used.
    pub fn find(crate_dir: &Path) -> Result<Result<Toolchain, String>, String> {
        let (root, from) = match std::env::var_os("MIXSTACK_CUDA_ROOT") {
            Some(r) => (PathBuf::from(r), "MIXSTACK_CUDA_ROOT"),
            None => (crate_dir.join(".toolchain/nvidia/cu13"), "the default"),
        };
        let nvcc = root.join("bin/nvcc");
        if !nvcc.exists() {
            return Ok(Err(format!("no {} ({from})", nvcc.display())));
        }
        let out =
            Command::new(&nvcc).arg("--version").output().map_err(|e| format!("cannot run {}: {e}", nvcc.display()))?;
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let version = text.lines().find(|l| l.contains("release")).unwrap_or("").trim().to_string();
        if !version.contains(REQUIRED_RELEASE) {
            return Err(format!("{} is '{version}', need {REQUIRED_RELEASE}; {INSTALL_HINT}", nvcc.display()));
        }
        let ptxas = root.join("bin/ptxas");
        let out = Command::new(&ptxas)
            .arg("--version")
            .output()
            .map_err(|e| format!("cannot run {}: {e}", ptxas.display()))?;
        let identity = format!("{text}\n{}", String::from_utf8_lossy(&out.stdout));
        Ok(Ok(Toolchain { root, version, identity }))
    }

    fn nvcc_args(&self, arch: &str, include: &Path, src: &Path, ptx: &Path) -> Vec<String> {
        vec![
            "-ptx".into(),
            format!("-arch={}", arch.replace("sm_", "compute_")),
            "-std=c++17".into(),
            "-O3".into(),
            // No contraction beyond the explicit __fmaf_rn of the op sequences.
            "--fmad=false".into(),
            "-I".into(),
            include.display().to_string(),
            "-o".into(),
            ptx.display().to_string(),
            src.display().to_string(),
        ]
    }

    fn ptxas_args(&self, arch: &str, ptx: &Path, cubin: &Path) -> Vec<String> {
        vec![
            "-v".into(),
            "-O3".into(),
            "--fmad=false".into(),
            "--gpu-name".into(),
            arch.into(),
            ptx.display().to_string(),
            "-o".into(),
            cubin.display().to_string(),
        ]
    }
}

/// What stage 4 produced for one instance.
#[derive(Debug, Clone)]
pub struct Compiled {
    pub ptx: PathBuf,
    pub cubin: PathBuf,
    /// ptxas -v output (stderr).
    pub report: String,
    pub cached: bool,
}

fn run(instance: &str, exe: &Path, args: &[String]) -> Result<String, CompileError> {
    let command = format!("{} {}", exe.display(), args.join(" "));
    let out = Command::new(exe).args(args).output().map_err(|source| CompileError::Spawn {
        instance: instance.into(),
        command: command.clone(),
        source,
    })?;
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    if !out.status.success() {
        return Err(CompileError::Tool { instance: instance.into(), command, stderr });
    }
    Ok(stderr)
}

/// The cache key of an instance: `{instance}-{16 hex digits}` of the hash
/// of its source and headers (`material`), the tools' identity, the arch
/// and every flag of every tool (paths as placeholders).
pub fn cache_key(instance: &str, material: &[u8], identity: &str, arch: &str, flags: &[&[String]]) -> String {
    let mut h = Sha256::new();
    for part in [material, identity.as_bytes(), arch.as_bytes()] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part);
    }
    h.update(format!("{flags:?}").as_bytes());
    let hex = format!("{:x}", h.finalize());
    format!("{instance}-{}", &hex[..16])
}

/// Compile `src` (in `include`, next to its headers) into `cache`, keyed by
/// the hash of everything that can change the output.
pub fn compile(
    tc: &Toolchain,
    arch: &str,
    instance: &str,
    src: &Path,
    include: &Path,
    key_material: &[u8],
    cache: &Path,
) -> Result<Compiled, CompileError> {
    let nvcc = tc.nvcc_args(arch, Path::new("I"), Path::new("S"), Path::new("P"));
    let ptxas = tc.ptxas_args(arch, Path::new("P"), Path::new("C"));
    let key = cache_key(instance, key_material, &tc.identity, arch, &[&nvcc, &ptxas]);
    let key = key.as_str();
    let ptx = cache.join(format!("{key}.ptx"));
    let cubin = cache.join(format!("{key}.cubin"));
    let log = cache.join(format!("{key}.ptxas.txt"));
    if ptx.exists() && cubin.exists() && log.exists() {
        let report = std::fs::read_to_string(&log).map_err(|source| CompileError::Io { path: log.clone(), source })?;
        return Ok(Compiled { ptx, cubin, report, cached: true });
    }
    let tmp_ptx = cache.join(format!("{key}.ptx.tmp"));
    let tmp_cubin = cache.join(format!("{key}.cubin.tmp"));
    run(instance, &tc.root.join("bin/nvcc"), &tc.nvcc_args(arch, include, src, &tmp_ptx))?;
    let report = run(instance, &tc.root.join("bin/ptxas"), &tc.ptxas_args(arch, &tmp_ptx, &tmp_cubin))?;
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| CompileError::Io { path, source }
    };
    std::fs::write(&log, &report).map_err(io(&log))?;
    std::fs::rename(&tmp_ptx, &ptx).map_err(io(&ptx))?;
    std::fs::rename(&tmp_cubin, &cubin).map_err(io(&cubin))?;
    Ok(Compiled { ptx, cubin, report, cached: false })
}
