//! Loader for the reference vectors (`vectors/` in this crate, copied from the
//! project's shared folder): a `manifest.json` listing the cases plus raw,
//! header-less, row-major little-endian files.
//!
//! Inputs (`u0`, `alpha`, `w0`, `w1`, `gw`, `grad_out`) are stored as `<f4`;
//! they are kept as loaded (`*_f32`) and widened to f64. Outputs (`out`,
//! `z_all`, `grad_u0`, `grad_alpha`) are stored as `<f8`. Every tensor's
//! manifest shape and dtype, and its file's byte length, are checked against
//! the case's [`Shape`].

use std::path::{Component, Path, PathBuf};

use serde::Deserialize;

use crate::reference::{Shape, Weights};

/// One reference case.
#[derive(Clone, Debug)]
pub struct Case {
    /// The manifest's `case` number.
    pub index: usize,
    pub shape: Shape,
    pub apply_alpha: bool,

    // Inputs widened to f64 (exactly representable).
    pub u0: Vec<f64>,
    pub alpha: Vec<f64>,
    pub w0: Vec<f64>,
    pub w1: Vec<f64>,
    pub gw: Vec<f64>,
    pub grad_out: Vec<f64>,

    // The same inputs as stored, for fp32 (GPU) tests.
    pub u0_f32: Vec<f32>,
    pub alpha_f32: Vec<f32>,
    pub w0_f32: Vec<f32>,
    pub w1_f32: Vec<f32>,
    pub gw_f32: Vec<f32>,
    pub grad_out_f32: Vec<f32>,

    // Expected outputs (f64).
    pub out: Vec<f64>,
    pub z_all: Vec<f64>,
    pub grad_u0: Vec<f64>,
    pub grad_alpha: Vec<f64>,
}

impl Case {
    /// The f64 weights as a [`Weights`] view for [`crate::reference`].
    pub fn weights(&self) -> Weights<'_> {
        Weights { w0: &self.w0, w1: &self.w1, gw: &self.gw }
    }
}

/// Why a vectors directory could not be loaded. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum VectorError {
    #[error("{}: file not found", .path.display())]
    MissingFile { path: PathBuf },

    #[error("{}: cannot read: {source}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{}: bad manifest JSON: {source}", .path.display())]
    ManifestJson {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },

    /// The manifest parses but lists no case: whatever reads the directory
    /// (verify, the tests) would check nothing and pass.
    #[error("{}: the manifest lists no case: nothing would be verified", .path.display())]
    NoCases { path: PathBuf },

    #[error("{}: case {case}: {problem}", .path.display())]
    BadCase { path: PathBuf, case: usize, problem: String },

    #[error("{}: case {case}: tensor `{tensor}` is not listed", .path.display())]
    MissingTensor { path: PathBuf, case: usize, tensor: &'static str },

    #[error("{}: case {case}, tensor `{tensor}`: {problem}", .path.display())]
    BadTensor { path: PathBuf, case: usize, tensor: &'static str, problem: String },

    #[error(
        "{}: case {case}, tensor `{tensor}`: {found} bytes, expected {expected} ({elems} elements of {itemsize} bytes)",
        .path.display()
    )]
    ByteLength {
        path: PathBuf,
        case: usize,
        tensor: &'static str,
        found: u64,
        expected: u64,
        elems: usize,
        itemsize: usize,
    },
}

/// `MIXSTACK_VECTORS` if set; else the project's copy (`vectors/` of the
/// source tree this was built from, or of the working directory when the
/// binary runs elsewhere, e.g. on a GPU machine without the source tree).
pub fn default_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("MIXSTACK_VECTORS") {
        return PathBuf::from(d);
    }
    // crates/reference -> the workspace root's vectors/
    let built = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../vectors"));
    if built.join("manifest.json").exists() {
        built
    } else {
        PathBuf::from("vectors")
    }
}

#[derive(Deserialize)]
struct ManifestCase {
    case: usize,
    #[serde(rename = "F")]
    f: usize,
    #[serde(rename = "E")]
    e: usize,
    cf: usize,
    lmax: usize,
    n_layers: usize,
    apply_alpha: bool,
    tensors: std::collections::BTreeMap<String, ManifestTensor>,
}

#[derive(Deserialize)]
struct ManifestTensor {
    file: String,
    shape: Vec<usize>,
    dtype: String,
}

/// Load every case listed in `dir/manifest.json`, in manifest order. A
/// manifest that lists no case is an error ([`VectorError::NoCases`]): a
/// caller would otherwise check nothing and report success.
pub fn load_dir(dir: &Path) -> Result<Vec<Case>, VectorError> {
    let manifest_path = dir.join("manifest.json");
    let text = read_bytes(&manifest_path)?;
    let cases: Vec<ManifestCase> = serde_json::from_slice(&text)
        .map_err(|source| VectorError::ManifestJson { path: manifest_path.clone(), source })?;
    if cases.is_empty() {
        return Err(VectorError::NoCases { path: manifest_path });
    }
    cases.iter().map(|mc| load_case(dir, &manifest_path, mc)).collect()
}

fn io_error(path: &Path, source: std::io::Error) -> VectorError {
    if source.kind() == std::io::ErrorKind::NotFound {
        VectorError::MissingFile { path: path.to_path_buf() }
    } else {
        VectorError::Io { path: path.to_path_buf(), source }
    }
}

fn read_bytes(path: &Path) -> Result<Vec<u8>, VectorError> {
    std::fs::read(path).map_err(|source| io_error(path, source))
}

/// The first `expected` + 1 bytes at most of `path`, and the length to
/// report: the file's own where it holds more (a plain file's metadata),
/// else what was read.
fn read_bounded(path: &Path, expected: u64) -> Result<(Vec<u8>, u64), VectorError> {
    use std::io::Read;
    let file = std::fs::File::open(path).map_err(|source| io_error(path, source))?;
    let mut bytes = Vec::new();
    file.take(expected.saturating_add(1)).read_to_end(&mut bytes).map_err(|source| io_error(path, source))?;
    let read = bytes.len() as u64;
    let found = match std::fs::metadata(path) {
        Ok(m) if m.is_file() && read > expected => m.len(),
        _ => read,
    };
    Ok((bytes, found))
}

/// Element type of a stored tensor.
#[derive(Clone, Copy)]
enum DType {
    F32,
    F64,
}

impl DType {
    fn name(self) -> &'static str {
        match self {
            DType::F32 => "<f4",
            DType::F64 => "<f8",
        }
    }
    fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 => 8,
        }
    }
}

struct CaseLoader<'a> {
    dir: &'a Path,
    manifest_path: &'a Path,
    mc: &'a ManifestCase,
}

impl CaseLoader<'_> {
    /// Check the manifest entry of `tensor` against `dims`/`dtype`, read its
    /// file and check the byte length; returns the raw bytes.
    fn raw(&self, tensor: &'static str, dims: &[usize], dtype: DType) -> Result<Vec<u8>, VectorError> {
        let case = self.mc.case;
        let entry = self.mc.tensors.get(tensor).ok_or_else(|| VectorError::MissingTensor {
            path: self.manifest_path.to_path_buf(),
            case,
            tensor,
        })?;
        let bad =
            |problem: String| VectorError::BadTensor { path: self.manifest_path.to_path_buf(), case, tensor, problem };
        // The file must be a plain name inside `dir`.
        let rel = Path::new(&entry.file);
        if entry.file.is_empty() || !rel.components().all(|c| matches!(c, Component::Normal(_))) {
            return Err(bad(format!("file name {:?} is not a plain relative path", entry.file)));
        }
        if entry.dtype != dtype.name() {
            return Err(bad(format!("dtype {:?}, expected {:?}", entry.dtype, dtype.name())));
        }
        if entry.shape != dims {
            return Err(bad(format!("shape {:?}, expected {:?} for the case's shape", entry.shape, dims)));
        }
        let path = self.dir.join(rel);
        let elems = dims
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| bad(format!("shape {dims:?} overflows usize")))?;
        let expected = (elems as u64).saturating_mul(dtype.size() as u64);
        // At most one byte past the expected length is read: a file that is
        // not what the manifest says (or no file: /dev/zero) is named, never
        // read whole.
        let (bytes, found) = read_bounded(&path, expected)?;
        if found != expected {
            return Err(VectorError::ByteLength { path, case, tensor, found, expected, elems, itemsize: dtype.size() });
        }
        Ok(bytes)
    }

    fn f32s(&self, tensor: &'static str, dims: &[usize]) -> Result<Vec<f32>, VectorError> {
        let bytes = self.raw(tensor, dims, DType::F32)?;
        Ok(bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect())
    }

    fn f64s(&self, tensor: &'static str, dims: &[usize]) -> Result<Vec<f64>, VectorError> {
        let bytes = self.raw(tensor, dims, DType::F64)?;
        Ok(bytes.chunks_exact(8).map(|b| f64::from_le_bytes(b.try_into().unwrap())).collect())
    }
}

fn widen(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

fn load_case(dir: &Path, manifest_path: &Path, mc: &ManifestCase) -> Result<Case, VectorError> {
    let bad_case = |problem: &str| VectorError::BadCase {
        path: manifest_path.to_path_buf(),
        case: mc.case,
        problem: problem.to_string(),
    };
    if mc.f == 0 || mc.e == 0 || mc.cf == 0 || mc.lmax == 0 || mc.n_layers == 0 {
        return Err(bad_case("F, E, cf, lmax and n_layers must all be >= 1 (a case of no edges checks nothing)"));
    }
    // Keep every derived dimension well inside usize.
    let limit = 1usize << 24;
    if [mc.f, mc.e, mc.cf, mc.lmax, mc.n_layers].iter().any(|&d| d > limit) {
        return Err(bad_case("a dimension is implausibly large"));
    }
    let shape = Shape { f: mc.f, e: mc.e, cf: mc.cf, lmax: mc.lmax, n_layers: mc.n_layers };
    let (f, e, nl, ng) = (shape.f, shape.e, shape.n_layers, shape.n_layers - 1);
    let (row, m0, m1, cf, lg) = (shape.row(), shape.m0(), shape.m1(), shape.cf, shape.lg());

    let ld = CaseLoader { dir, manifest_path, mc };
    let u0_f32 = ld.f32s("u0", &[f, e, row])?;
    let alpha_f32 = ld.f32s("alpha", &[e, f])?;
    let w0_f32 = ld.f32s("w0", &[nl, f, m0, m0])?;
    let w1_f32 = ld.f32s("w1", &[nl, f, m1, m1])?;
    let gw_f32 = ld.f32s("gw", &[ng, f, cf, lg])?;
    let grad_out_f32 = ld.f32s("grad_out", &[e, f, row])?;
    let out = ld.f64s("out", &[e, f, row])?;
    let z_all = ld.f64s("z_all", &[ng, f, e, row])?;
    let grad_u0 = ld.f64s("grad_u0", &[f, e, row])?;
    let grad_alpha = ld.f64s("grad_alpha", &[e, f])?;

    Ok(Case {
        index: mc.case,
        shape,
        apply_alpha: mc.apply_alpha,
        u0: widen(&u0_f32),
        alpha: widen(&alpha_f32),
        w0: widen(&w0_f32),
        w1: widen(&w1_f32),
        gw: widen(&gw_f32),
        grad_out: widen(&grad_out_f32),
        u0_f32,
        alpha_f32,
        w0_f32,
        w1_f32,
        gw_f32,
        grad_out_f32,
        out,
        z_all,
        grad_u0,
        grad_alpha,
    })
}
