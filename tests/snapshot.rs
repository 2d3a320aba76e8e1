//! The committed snapshot (generated-tests/) must match what the generator
//! produces now: rendered CUDA C (always checked, no toolkit needed), PTX and
//! the ptxas report (checked against this build when it used the toolchain).
//! Bless with: MIXSTACK_BLESS=1 cargo build --release

use mixstack::runtime::table::{BUILD_MANIFEST_JSON, BUILD_SOURCE, KERNELS};
use mixstack_gen::{embed::Manifest, expand::expand, pipeline::render_all, snapshot, spec};
use std::path::{Path, PathBuf};

mod temp;
use temp::TempDir;

const BLESS: &str = "MIXSTACK_BLESS=1 cargo build --release";

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn snap(p: &str) -> PathBuf {
    crate_dir().join(snapshot::DIR).join(p)
}

/// A unified diff, or None when equal.
fn diff(name: &str, committed: &str, now: &str) -> Option<String> {
    (committed != now).then(|| {
        similar::TextDiff::from_lines(committed, now)
            .unified_diff()
            .context_radius(3)
            .header(&format!("{name} (committed)"), &format!("{name} (generated now)"))
            .to_string()
    })
}

fn fail_with(diffs: Vec<String>, what: &str) {
    if !diffs.is_empty() {
        let shown: String = diffs.iter().take(5).cloned().collect::<Vec<_>>().join("\n");
        panic!("{} {what} differ from the snapshot; review, then bless with `{BLESS}`:\n{shown}", diffs.len());
    }
}

fn built_manifest() -> Manifest {
    serde_json::from_str(BUILD_MANIFEST_JSON).expect("embedded manifest parses")
}

fn narrowed() -> bool {
    let specs = spec::load(&crate_dir().join("specs")).unwrap();
    let n = expand(&specs, None).unwrap().instances.len();
    let built = built_manifest().instances.len();
    if built != n {
        eprintln!("SKIPPED: this build was narrowed by MIXSTACK_ONLY ({built} of {n} instances)");
    }
    built != n
}

#[test]
fn fingerprint_matches_tree() {
    let now = snapshot::fingerprint(&crate_dir()).unwrap();
    let committed = snapshot::committed_fingerprint(&crate_dir()).unwrap_or_default();
    assert_eq!(
        committed, now,
        "specs, templates or the generator changed since the snapshot was blessed; run `{BLESS}` and commit generated-tests/"
    );
}

#[test]
fn rendered_cuda_matches_snapshot() {
    let specs = spec::load(&crate_dir().join("specs")).unwrap();
    let exp = expand(&specs, None).unwrap();
    let files = render_all(&specs, &exp, &crate_dir().join("templates")).unwrap();
    let mut diffs = Vec::new();
    for (name, text) in &files {
        let committed = std::fs::read_to_string(snap(&format!("{}/{name}", snapshot::CUDA_DIR))).unwrap_or_default();
        diffs.extend(diff(name, &committed, text));
    }
    let expected: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
    for e in std::fs::read_dir(snap(snapshot::CUDA_DIR)).unwrap() {
        let n = e.unwrap().file_name().to_string_lossy().to_string();
        if !expected.contains(&n.as_str()) {
            diffs.push(format!("{n}: in the snapshot, no longer generated"));
        }
    }
    fail_with(diffs, "rendered CUDA files");
}

#[test]
fn ptx_and_report_match_snapshot() {
    if narrowed() {
        return;
    }
    if BUILD_SOURCE != "toolchain" {
        eprintln!("NOTE: built from the snapshot (no toolchain): PTX and report are the snapshot's own; the rendering test still checks the CUDA C");
    }
    let mut diffs = Vec::new();
    for k in KERNELS.iter().filter(|k| k.accepted) {
        let rel = format!("{}/{}.ptx", k.arch, k.name);
        let committed = std::fs::read_to_string(snap(&format!("{}/{rel}", snapshot::PTX_DIR))).unwrap_or_default();
        let built =
            if k.ptx.is_empty() { std::fs::read_to_string(k.ptx_file).unwrap_or_default() } else { k.ptx.to_string() };
        diffs.extend(diff(&rel, &committed, &built));
    }
    let committed = std::fs::read_to_string(snap(snapshot::MANIFEST_FILE)).unwrap_or_default();
    let now = serde_json::to_string_pretty(&built_manifest()).unwrap() + "\n";
    diffs.extend(diff(snapshot::MANIFEST_FILE, &committed, &now));
    fail_with(diffs, "PTX files or the register report");
}

#[test]
fn snapshot_holds_no_stale_ptx() {
    // ptx/<arch>/<name>.ptx, one per accepted instance build.
    let names: Vec<String> =
        KERNELS.iter().filter(|k| k.accepted).map(|k| format!("{}/{}.ptx", k.arch, k.name)).collect();
    if narrowed() {
        return;
    }
    for d in std::fs::read_dir(Path::new(&snap(snapshot::PTX_DIR))).unwrap() {
        let d = d.unwrap();
        let arch = d.file_name().to_string_lossy().to_string();
        assert!(d.path().is_dir(), "{arch}: the snapshot keeps PTX under ptx/<arch>/; bless with `{BLESS}`");
        for e in std::fs::read_dir(d.path()).unwrap() {
            let n = format!("{arch}/{}", e.unwrap().file_name().to_string_lossy());
            assert!(
                names.contains(&n),
                "{n} is in the snapshot but no accepted instance build has that name and arch; bless with `{BLESS}`"
            );
        }
    }
}

/// A copy of the generator's inputs (exactly `snapshot::inputs`) in a temp
/// dir, removed on drop.
fn inputs_copy() -> TempDir {
    let dir = TempDir::new("mixstack-fp");
    for f in snapshot::inputs(&crate_dir()).unwrap() {
        let to = dir.join(f.strip_prefix(crate_dir()).unwrap());
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(&f, &to).unwrap();
    }
    dir
}

#[test]
fn fingerprint_ignores_junk_and_sees_every_input() {
    let dir = inputs_copy();
    let fp = snapshot::fingerprint(&dir).unwrap();
    assert_eq!(fp, snapshot::fingerprint(&crate_dir()).unwrap(), "the copy holds every input");
    // an editor's swap and backup files, a scratch spec, notes: nothing changes
    for junk in [
        "specs/.tiles.yaml.swp",
        "specs/tiles.yaml~",
        "specs/tiles-old.yaml",
        "templates/#core.cuh#",
        "templates/core.cuh.orig",
        "crates/gen/src/notes.txt",
        "crates/gen/src/scratch.rs",
    ] {
        std::fs::write(dir.join(junk), "junk \u{00e9}\u{00ff}").unwrap();
    }
    assert_eq!(snapshot::fingerprint(&dir).unwrap(), fp, "junk files changed the fingerprint");
    // every input counts
    for f in snapshot::inputs(&dir).unwrap() {
        let text = std::fs::read(&f).unwrap();
        std::fs::write(&f, [text.as_slice(), b" "].concat()).unwrap();
        assert_ne!(snapshot::fingerprint(&dir).unwrap(), fp, "{} is not fingerprinted", f.display());
        std::fs::write(&f, text).unwrap();
    }
    // a damaged FINGERPRINT file is no match, never a panic
    std::fs::create_dir_all(dir.join(snapshot::DIR)).unwrap();
    for bad in ["\u{00e9}\u{00e9}\u{00e9}\u{00e9}\u{00e9}\u{00e9}\u{00e9}\u{00e9}", "", "abc", &fp[..40]] {
        std::fs::write(dir.join(snapshot::DIR).join(snapshot::FINGERPRINT_FILE), bad).unwrap();
        assert_eq!(snapshot::committed_fingerprint(&dir), None, "{bad:?}");
    }
    std::fs::write(dir.join(snapshot::DIR).join(snapshot::FINGERPRINT_FILE), [0xffu8, 0xfe, 0x80]).unwrap();
    assert_eq!(snapshot::committed_fingerprint(&dir), None);
}

#[test]
fn cache_key_covers_flags_tools_and_arch() {
    use mixstack_gen::compile::cache_key;
    let nvcc: Vec<String> = ["-ptx", "-O3", "--fmad=false"].map(String::from).to_vec();
    let ptxas: Vec<String> = ["-v", "-O3", "--fmad=false"].map(String::from).to_vec();
    let base = cache_key("k", b"src", "nvcc 13.0.88\nptxas 13.0.88", "sm_90", &[&nvcc, &ptxas]);
    assert!(base.starts_with("k-") && base.len() == 2 + 16);
    let mut ptxas2 = ptxas.clone();
    ptxas2[1] = "-O2".into();
    let mut nvcc2 = nvcc.clone();
    nvcc2.push("-lineinfo".into());
    for other in [
        cache_key("k", b"src", "nvcc 13.0.88\nptxas 13.0.88", "sm_90", &[&nvcc, &ptxas2]),
        cache_key("k", b"src", "nvcc 13.0.88\nptxas 13.0.88", "sm_90", &[&nvcc2, &ptxas]),
        cache_key("k", b"src", "nvcc 13.0.88\nptxas 13.0.99", "sm_90", &[&nvcc, &ptxas]),
        cache_key("k", b"src", "nvcc 13.0.88\nptxas 13.0.88", "sm_80", &[&nvcc, &ptxas]),
        cache_key("k", b"src2", "nvcc 13.0.88\nptxas 13.0.88", "sm_90", &[&nvcc, &ptxas]),
    ] {
        assert_ne!(other, base);
    }
}
