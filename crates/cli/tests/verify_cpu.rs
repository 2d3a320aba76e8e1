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

/// The repository's vector set with case 0 only, its manifest edited by
/// `edit`, and each file of `links` replaced as `link` says.
fn case0_copy(tag: &str, edit: impl Fn(&mut serde_json::Value), link: impl Fn(&Path, &str)) -> TempVectors {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../vectors");
    let text = std::fs::read_to_string(src.join("manifest.json")).unwrap();
    let manifest: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut case = manifest[0].clone();
    edit(&mut case);
    let dir = TempVectors::new(tag, &serde_json::to_string(&[&case]).unwrap());
    for t in case["tensors"].as_object().unwrap().values() {
        let file = t["file"].as_str().unwrap();
        std::fs::copy(src.join(file), dir.path().join(file)).unwrap();
        link(dir.path(), file);
    }
    dir
}

#[test]
fn a_case_of_no_edges_is_refused() {
    // Consistent but empty: every E dimension 0, every E-sized file empty
    // (before the check, four comparisons of empty vectors "passed").
    let e = |c: &serde_json::Value| c["E"].as_u64().unwrap();
    let dir = case0_copy(
        "e0",
        |c| {
            let e0 = e(c);
            for t in c["tensors"].as_object_mut().unwrap().values_mut() {
                for d in t["shape"].as_array_mut().unwrap() {
                    if d.as_u64() == Some(e0) {
                        *d = 0.into();
                    }
                }
            }
            c["E"] = 0.into();
        },
        |d, f| {
            let edge_sized = ["_u0", "_alpha", "_out", "_z_all", "_grad_out", "_grad_u0", "_grad_alpha"];
            if edge_sized.iter().any(|s| f.contains(&format!("{s}."))) {
                std::fs::write(d.join(f), b"").unwrap();
            }
        },
    );
    match vectors::load_dir(dir.path()) {
        Err(e @ VectorError::BadCase { .. }) => assert!(e.to_string().contains("E"), "{e}"),
        Ok(_) => panic!("a case of E = 0 loaded: verify would pass on nothing"),
        Err(other) => panic!("expected BadCase, got {other:?}"),
    }
}

#[test]
fn a_tensor_file_longer_than_its_shape_is_named_not_read_whole() {
    // A plain file one element long too long: its own length is reported.
    let dir = case0_copy(
        "long",
        |_| {},
        |d, f| {
            if f.ends_with("_u0.f32") {
                let mut b = std::fs::read(d.join(f)).unwrap();
                b.extend_from_slice(&[0; 4]);
                std::fs::write(d.join(f), b).unwrap();
            }
        },
    );
    match vectors::load_dir(dir.path()) {
        Err(VectorError::ByteLength { found, expected, .. }) => assert_eq!(found, expected + 4),
        other => panic!("expected ByteLength, got {other:?}"),
    }
    // A file without an end (/dev/zero): refused after one byte too many.
    #[cfg(unix)]
    {
        let dir = case0_copy(
            "endless",
            |_| {},
            |d, f| {
                if f.ends_with("_u0.f32") {
                    std::fs::remove_file(d.join(f)).unwrap();
                    std::os::unix::fs::symlink("/dev/zero", d.join(f)).unwrap();
                }
            },
        );
        match vectors::load_dir(dir.path()) {
            Err(VectorError::ByteLength { found, expected, .. }) => assert_eq!(found, expected + 1),
            other => panic!("expected ByteLength, got {other:?}"),
        }
    }
}
