//! CPU tests of `mixstack verify`'s refusal to pass on nothing: a vectors
//! directory whose manifest lists no case is an error of the loader
//! (`vectors::load_dir`, which verify uses) and makes `mixstack verify` exit
//! with a failure instead of printing "all checks passed". No GPU needed:
//! the manifest is refused before any device is opened.

use std::path::{Path, PathBuf};
use std::process::Command;

use mixstack_reference::vectors::{self, VectorError};

/// A temporary vectors directory holding only `manifest.json` with `text`;
/// removed on drop.
struct TempVectors(PathBuf);

impl TempVectors {
    fn new(tag: &str, manifest: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("mixstack-verify-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("manifest.json"), manifest).unwrap();
        TempVectors(dir)
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempVectors {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn loader_refuses_a_manifest_that_lists_no_case() {
    for (tag, text) in [("empty", "[]"), ("spaced", " [\n ]\n")] {
        let dir = TempVectors::new(tag, text);
        match vectors::load_dir(dir.path()) {
            Err(e @ VectorError::NoCases { .. }) => {
                let VectorError::NoCases { path } = &e else { unreachable!() };
                assert_eq!(path, &dir.path().join("manifest.json"), "the error names the manifest");
                let msg = e.to_string();
                assert!(msg.starts_with(&dir.path().join("manifest.json").display().to_string()), "{msg}");
                assert!(msg.contains("the manifest lists no case"), "{msg}");
                assert!(msg.contains("nothing would be verified"), "{msg}");
            }
            Ok(cases) => {
                panic!("{text:?}: an empty manifest loaded as {} cases: verify would pass on nothing", cases.len())
            }
            Err(other) => panic!("{text:?}: expected NoCases, got {other:?}"),
        }
    }
}

#[test]
fn loader_still_reports_other_manifest_errors_first() {
    // Not a list at all: a JSON error, not "no case".
    let dir = TempVectors::new("object", "{}");
    assert!(matches!(vectors::load_dir(dir.path()), Err(VectorError::ManifestJson { .. })));
}

#[test]
fn verify_command_fails_on_a_manifest_that_lists_no_case() {
    let dir = TempVectors::new("cli", "[]");
    let out = Command::new(env!("CARGO_BIN_EXE_mixstack"))
        .args(["verify", "--vectors"])
        .arg(dir.path())
        .env_remove("MIXSTACK_VECTORS")
        .output()
        .expect("run mixstack verify");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "verify on an empty manifest must fail\nstdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(!stdout.contains("all checks passed"), "stdout:\n{stdout}");
    assert!(stderr.contains("the manifest lists no case: nothing would be verified"), "stderr:\n{stderr}");
    assert!(stderr.contains("manifest.json"), "the error names the manifest: {stderr}");
}
