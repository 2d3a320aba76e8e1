//! The committed snapshot in generated-tests/: rendered CUDA C, PTX and the
//! ptxas report (as the manifest), plus the fingerprint of the generator's
//! inputs. Review reads its diff; a machine without the CUDA toolkit builds
//! from it when the fingerprint matches the tree.

use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

pub const DIR: &str = "generated-tests";
pub const FINGERPRINT_FILE: &str = "FINGERPRINT";
pub const MANIFEST_FILE: &str = "report.json";
pub const CUDA_DIR: &str = "cuda";
pub const PTX_DIR: &str = "ptx";

/// Everything whose change can change the generated output.
pub fn inputs(crate_dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut files = vec![crate_dir.join("build.rs"), crate_dir.join("src/kinds.rs")];
    for dir in ["specs", "templates", "src/codegen"] {
        let mut v: Vec<PathBuf> = std::fs::read_dir(crate_dir.join(dir))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file())
            .collect();
        v.sort();
        files.extend(v);
    }
    Ok(files)
}

/// sha256 over (relative path, content) of every input, in order.
pub fn fingerprint(crate_dir: &Path) -> std::io::Result<String> {
    let mut h = Sha256::new();
    for f in inputs(crate_dir)? {
        let rel = f.strip_prefix(crate_dir).unwrap_or(&f);
        h.update(rel.to_string_lossy().as_bytes());
        h.update([0u8]);
        // Normalise line endings so a checkout with CRLF fingerprints the same.
        let text = std::fs::read(&f)?;
        let text: Vec<u8> = text.into_iter().filter(|&b| b != b'\r').collect();
        h.update(&text);
        h.update([0u8]);
    }
    Ok(format!("{:x}", h.finalize()))
}

pub fn committed_fingerprint(crate_dir: &Path) -> Option<String> {
    std::fs::read_to_string(crate_dir.join(DIR).join(FINGERPRINT_FILE)).ok().map(|s| s.trim().to_string())
}
