//! The committed snapshot (generated-tests/) must match what the generator
//! produces now: rendered CUDA C (always checked, no toolkit needed), PTX and
//! the ptxas report (checked against this build when it used the toolchain).
//! Bless with: MIXSTACK_BLESS=1 cargo build --release

use mixstack::codegen::{embed::Manifest, expand::expand, pipeline::render_all, snapshot, spec};
use mixstack::runtime::table::{BUILD_MANIFEST_JSON, BUILD_SOURCE, KERNELS};
use std::path::{Path, PathBuf};

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
    let n = expand(&specs, None).instances.len();
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
    let exp = expand(&specs, None);
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
        let p = snap(&format!("{}/{}.ptx", snapshot::PTX_DIR, k.name));
        let committed = std::fs::read_to_string(&p).unwrap_or_default();
        let built =
            if k.ptx.is_empty() { std::fs::read_to_string(k.ptx_file).unwrap_or_default() } else { k.ptx.to_string() };
        diffs.extend(diff(&format!("{}.ptx", k.name), &committed, &built));
    }
    let committed = std::fs::read_to_string(snap(snapshot::MANIFEST_FILE)).unwrap_or_default();
    let now = serde_json::to_string_pretty(&built_manifest()).unwrap() + "\n";
    diffs.extend(diff(snapshot::MANIFEST_FILE, &committed, &now));
    fail_with(diffs, "PTX files or the register report");
}

#[test]
fn snapshot_holds_no_stale_ptx() {
    let names: Vec<String> = KERNELS.iter().filter(|k| k.accepted).map(|k| format!("{}.ptx", k.name)).collect();
    if narrowed() {
        return;
    }
    for e in std::fs::read_dir(Path::new(&snap(snapshot::PTX_DIR))).unwrap() {
        let n = e.unwrap().file_name().to_string_lossy().to_string();
        assert!(
            names.contains(&n),
            "{n} is in the snapshot but no accepted instance has that name; bless with `{BLESS}`"
        );
    }
}
