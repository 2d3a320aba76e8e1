//! What a successful build prints (build.rs prints these lines; a failure
//! prints its error): one summary line, then a line for each rejection or
//! pruning the committed snapshot (generated-tests/report.json) does not
//! already have, so a tile just added that spills is named while the known
//! rejections are only counted, and a line when that snapshot is stale.

use super::embed::{Manifest, ManifestInstance};
use super::snapshot;
use crate::kinds::Arch;
use std::collections::BTreeSet;
use std::path::Path;

/// Where this build's kernels came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// Compiled with the toolchain (`version`: nvcc's release line);
    /// `cached` instances came from the compile cache.
    Toolchain { version: String, compiled: usize, cached: usize },
    /// The committed snapshot, whose fingerprint matches the tree; `missing`
    /// says where the toolchain was looked for.
    Snapshot { fingerprint: String, missing: String },
}

impl Origin {
    /// "toolchain" or "snapshot" (`BUILD_SOURCE`).
    pub fn source(&self) -> &'static str {
        match self {
            Origin::Toolchain { .. } => "toolchain",
            Origin::Snapshot { .. } => "snapshot",
        }
    }
}

/// The committed snapshot's manifest, read before a bless overwrites it;
/// `None` when it is missing or unreadable (every rejection is then named).
pub fn committed(crate_dir: &Path) -> Option<Manifest> {
    let p = crate_dir.join(snapshot::DIR).join(snapshot::MANIFEST_FILE);
    serde_json::from_str(&std::fs::read_to_string(p).ok()?).ok()
}

/// Why an instance was rejected, from ptxas's numbers, as the build and
/// `mixstack report` print it (check::accepts: spills, or a register move
/// sized from another starting count).
pub fn rejection(i: &ManifestInstance) -> String {
    if i.spill_stores == 0 && i.spill_loads == 0 {
        return format!("starts at {} registers, not the count its `regs` move was sized from", i.registers);
    }
    format!(
        "spills {} B stores, {} B loads ({} registers, {} B stack)",
        i.spill_stores, i.spill_loads, i.registers, i.stack_bytes
    )
}

/// check::accepts' two reasons, named as the rejected rows have them: "for
/// spills", "for register moves" or "for spills or register moves".
pub fn rejected_for(rejected: &[&ManifestInstance]) -> &'static str {
    let spilled = rejected.iter().filter(|i| i.spill_stores > 0 || i.spill_loads > 0).count();
    match (spilled, rejected.len() - spilled) {
        (_, 0) => "for spills",
        (0, _) => "for register moves",
        _ => "for spills or register moves",
    }
}

/// The build's lines: the summary first, then each rejected instance the
/// snapshot does not reject (absent there, or accepted there) with its
/// spills, each pruned instance the snapshot did not prune, and, unless this
/// build blesses it, whether the snapshot is stale (`cargo test` says so too).
pub fn lines(now: &Manifest, committed: Option<&Manifest>, origin: &Origin, blessing: bool) -> Vec<String> {
    // Rows are (instance, arch) builds.
    let key = |i: &ManifestInstance| (i.name.clone(), i.arch);
    let rejected_before: BTreeSet<(String, Arch)> =
        committed.map(|m| m.instances.iter().filter(|i| !i.accepted).map(key).collect()).unwrap_or_default();
    let accepted_before: BTreeSet<(String, Arch)> =
        committed.map(|m| m.instances.iter().filter(|i| i.accepted).map(key).collect()).unwrap_or_default();
    let pruned_before: BTreeSet<&str> =
        committed.map(|m| m.pruned.iter().map(|p| p.name.as_str()).collect()).unwrap_or_default();

    let rejected: Vec<&ManifestInstance> = now.instances.iter().filter(|i| !i.accepted).collect();
    let new: Vec<&ManifestInstance> = rejected.iter().copied().filter(|i| !rejected_before.contains(&key(i))).collect();
    let known = rejected.len() - new.len();
    let new_pruned: Vec<_> = now.pruned.iter().filter(|p| !pruned_before.contains(p.name.as_str())).collect();
    let known_pruned = now.pruned.len() - new_pruned.len();

    let report = "`mixstack report` lists them";
    let why = rejected_for(&rejected);
    let rejections = match (known, new.len()) {
        (0, 0) => "0 rejected".to_string(),
        (k, 0) => format!("{k} rejected {why}, as in the snapshot ({report})"),
        (0, n) if committed.is_none() => format!(
            "{n} rejected {why}, named below (no readable {}/{} to compare with)",
            snapshot::DIR,
            snapshot::MANIFEST_FILE
        ),
        (0, n) => format!("{n} rejected {why}, new since the snapshot, named below"),
        (k, n) => format!(
            "{} rejected {why}: {k} as in the snapshot ({report}), {n} new since the snapshot, named below",
            k + n
        ),
    };
    let pruned = match (known_pruned, new_pruned.len()) {
        (0, 0) => String::new(),
        (k, 0) => format!(", {k} pruned as in the snapshot"),
        (k, n) => format!(", {} pruned ({n} new, named below)", k + n),
    };
    let from = match origin {
        Origin::Toolchain { version, compiled, cached } => format!(
            "from the toolchain ({}): {compiled} compiled, {cached} from cache",
            version.trim_start_matches("Cuda compilation tools, ")
        ),
        Origin::Snapshot { fingerprint, missing } => format!(
            "from the snapshot: no CUDA toolchain ({missing}), so built from the committed {}/ (fingerprint {} matches); kernels embed PTX only, JIT-compiled by the driver",
            snapshot::DIR,
            fingerprint.get(..12).unwrap_or(fingerprint)
        ),
    };
    let per_arch: Vec<String> =
        now.archs.iter().map(|a| format!("{a} {}", now.instances.iter().filter(|i| i.arch == *a).count())).collect();
    let mut out = vec![format!(
        "mixstack: {} instance builds ({}), {} accepted, {rejections}{pruned}; {from}",
        now.instances.len(),
        per_arch.join(", "),
        now.instances.len() - rejected.len()
    )];
    for i in new {
        let was = if accepted_before.contains(&key(i)) { "accepted in the snapshot" } else { "not in the snapshot" };
        out.push(format!("rejected {} on {} ({was}): {}", i.name, i.arch, rejection(i)));
    }
    for p in new_pruned {
        out.push(format!("pruned {}: {}", p.name, p.reason));
    }
    if let Some(c) = committed.filter(|c| !blessing && c.fingerprint != now.fingerprint) {
        out.push(format!(
            "the snapshot {}/ is stale (fingerprint {}, this tree {}): `cargo test` fails until `MIXSTACK_BLESS=1 cargo build --release` and a commit of {}/",
            snapshot::DIR,
            c.fingerprint.get(..12).unwrap_or(&c.fingerprint),
            now.fingerprint.get(..12).unwrap_or(&now.fingerprint),
            snapshot::DIR
        ));
    }
    out
}
