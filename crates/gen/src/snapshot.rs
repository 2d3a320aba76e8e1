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

/// Where the snapshot keeps an instance's PTX for `arch`: ptx/<arch>/<name>.ptx.
pub fn ptx_path(dir: &Path, arch: crate::kinds::Arch, name: &str) -> PathBuf {
    dir.join(PTX_DIR).join(arch.as_str()).join(format!("{name}.ptx"))
}

/// Exactly the files the generator reads or is built from, by name (README,
/// "The snapshot"): build.rs, crates/kinds/src/lib.rs, crates/gen/src/lib.rs
/// and the modules it declares, the three spec files and the templates the
/// renderer loads. Anything else beside them (an editor's swap file, a backup, a
/// scratch spec) changes nothing.
pub fn inputs(crate_dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut files = vec![crate_dir.join("build.rs"), crate_dir.join("crates/kinds/src/lib.rs")];
    let codegen = crate_dir.join("crates/gen/src");
    let mod_rs = codegen.join("lib.rs");
    let mut modules: Vec<String> = std::fs::read_to_string(&mod_rs)?
        .lines()
        .filter_map(|l| l.trim().strip_prefix("pub mod ").or_else(|| l.trim().strip_prefix("mod ")))
        .filter_map(|m| m.strip_suffix(';'))
        .map(|m| format!("{}.rs", m.trim()))
        .collect();
    modules.sort();
    files.push(mod_rs);
    files.extend(modules.iter().map(|m| codegen.join(m)));
    files.extend(super::spec::FILES.iter().map(|f| crate_dir.join("specs").join(f)));
    let mut templates: Vec<&str> = super::render::STATIC_HEADERS.into_iter().chain(super::render::TEMPLATES).collect();
    templates.sort();
    files.extend(templates.iter().map(|t| crate_dir.join("templates").join(t)));
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

/// The committed fingerprint; `None` when the file is missing, not UTF-8 or
/// not a hex digest (a damaged file never matches, and never panics).
pub fn committed_fingerprint(crate_dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(crate_dir.join(DIR).join(FINGERPRINT_FILE)).ok()?;
    let t = text.trim();
    (t.len() == 64 && t.bytes().all(|b| b.is_ascii_hexdigit())).then(|| t.to_string())
}
