//! The build's lines (mixstack_gen::buildlog::lines), on the CPU: rejections
//! the committed snapshot already has are counted, not named; a rejection it
//! does not have (a new instance, or one it accepted) is named with its spills.

use mixstack_gen::buildlog::{self, lines, Origin};
use mixstack_gen::embed::{Manifest, ManifestInstance, PrunedRow};
use mixstack_gen::kinds::Arch;
use std::path::Path;

/// An instance with ptxas's numbers; rejected when it spills.
fn inst(name: &str, spill_stores: u32, spill_loads: u32, registers: u32, stack_bytes: u32) -> ManifestInstance {
    serde_json::from_value(serde_json::json!({
        "name": name, "arch": "sm_90", "stage": "fwd_m0", "variant": "relay", "dtype": "f32", "cf": 32, "lmax": null,
        "block_m": 128, "bn": 64, "block_k": 32, "tm": 8, "tn": 8, "rows": null, "threads": 256,
        "registers": registers, "spill_stores": spill_stores, "spill_loads": spill_loads,
        "stack_bytes": stack_bytes, "smem_static": 0, "smem_fixed": 79872, "smem_per_lg": 0,
        "accepted": spill_stores == 0 && spill_loads == 0, "is_default": false
    }))
    .expect("a manifest row")
}

fn manifest(instances: Vec<ManifestInstance>) -> Manifest {
    Manifest {
        archs: vec![Arch::Sm90],
        lmax: (1, 6),
        fingerprint: "0".repeat(64),
        instances,
        dispatch: vec![],
        pruned: vec![],
    }
}

/// The snapshot: ms_a and ms_c spill, ms_b does not.
fn snapshot() -> Manifest {
    manifest(vec![inst("ms_a", 112, 80, 255, 112), inst("ms_b", 0, 0, 128, 0), inst("ms_c", 8, 8, 255, 8)])
}

fn toolchain() -> Origin {
    Origin::Toolchain { version: "Cuda compilation tools, release 13.0, V13.0.88".into(), compiled: 1, cached: 2 }
}

#[test]
fn known_rejections_are_counted_not_named() {
    let s = snapshot();
    let out = lines(&s, Some(&s), &toolchain(), false);
    assert_eq!(
        out,
        vec![
            "mixstack: 3 instance builds (sm_90 3), 1 accepted, 2 rejected for spills, as in the snapshot (`mixstack report` lists them); \
             from the toolchain (release 13.0, V13.0.88): 1 compiled, 2 from cache"
        ]
    );
    assert!(!out.iter().any(|l| l.contains("ms_a") || l.contains("ms_c")), "{out:#?}");
}

#[test]
fn new_rejected_instance_is_named_with_its_spill_bytes() {
    let mut now = snapshot();
    now.instances.push(inst("ms_new", 20, 16, 255, 24));
    let out = lines(&now, Some(&snapshot()), &toolchain(), false);
    assert_eq!(out.len(), 2, "{out:#?}");
    assert!(
        out[0].starts_with(
            "mixstack: 4 instance builds (sm_90 4), 1 accepted, 3 rejected for spills: 2 as in the snapshot (`mixstack report` lists them), \
             1 new since the snapshot, named below;"
        ),
        "{}",
        out[0]
    );
    assert_eq!(
        out[1],
        "rejected ms_new on sm_90 (not in the snapshot): spills 20 B stores, 16 B loads (255 registers, 24 B stack)"
    );
}

#[test]
fn instance_accepted_in_snapshot_but_rejected_now_is_named() {
    let mut now = snapshot();
    now.instances[1] = inst("ms_b", 4, 0, 255, 4);
    let out = lines(&now, Some(&snapshot()), &toolchain(), false);
    assert_eq!(out.len(), 2, "{out:#?}");
    assert!(out[0].contains("3 rejected for spills: 2 as in the snapshot"), "{}", out[0]);
    assert_eq!(
        out[1],
        "rejected ms_b on sm_90 (accepted in the snapshot): spills 4 B stores, 0 B loads (255 registers, 4 B stack)"
    );
}

#[test]
fn a_register_move_rejection_is_counted_and_named_as_one() {
    // ms_r spills nothing but was rejected (check::accepts: started at
    // another count than its `regs` move was sized from).
    let mut now = snapshot();
    now.instances.push(ManifestInstance { accepted: false, ..inst("ms_r", 0, 0, 168, 0) });
    let out = lines(&now, Some(&snapshot()), &toolchain(), false);
    assert_eq!(out.len(), 2, "{out:#?}");
    assert!(out[0].contains("3 rejected for spills or register moves: 2 as in the snapshot"), "{}", out[0]);
    assert_eq!(
        out[1],
        "rejected ms_r on sm_90 (not in the snapshot): starts at 168 registers, not the count its `regs` move was sized from"
    );
    let only = manifest(vec![ManifestInstance { accepted: false, ..inst("ms_r", 0, 0, 168, 0) }]);
    let out = lines(&only, Some(&only), &toolchain(), false);
    assert!(out[0].contains("1 rejected for register moves, as in the snapshot"), "{}", out[0]);
}

#[test]
fn a_rejection_on_a_new_arch_is_named_with_the_arch() {
    // ms_b builds for sm_80 too now, and spills there only.
    let mut now = snapshot();
    now.archs = vec![Arch::Sm80, Arch::Sm90];
    now.instances.push(ManifestInstance { arch: Arch::Sm80, ..inst("ms_b", 8, 4, 255, 8) });
    let out = lines(&now, Some(&snapshot()), &toolchain(), false);
    assert_eq!(out.len(), 2, "{out:#?}");
    assert!(out[0].starts_with("mixstack: 4 instance builds (sm_80 1, sm_90 3), 1 accepted"), "{}", out[0]);
    assert_eq!(
        out[1],
        "rejected ms_b on sm_80 (not in the snapshot): spills 8 B stores, 4 B loads (255 registers, 8 B stack)"
    );
}

#[test]
fn without_a_readable_snapshot_every_rejection_is_named() {
    let out = lines(&snapshot(), None, &toolchain(), false);
    assert_eq!(out.len(), 3, "{out:#?}");
    assert!(
        out[0].contains("2 rejected for spills, named below (no readable generated-tests/report.json"),
        "{}",
        out[0]
    );
    assert!(out[1].starts_with("rejected ms_a on sm_90 (not in the snapshot): spills 112 B stores, 80 B loads"));
    assert!(out[2].starts_with("rejected ms_c on sm_90 (not in the snapshot): spills 8 B stores, 8 B loads"));
}

#[test]
fn a_snapshot_build_prints_one_line_that_says_so() {
    let s = snapshot();
    let fingerprint = "41cbf475d7a92b989034e38dc6bd097381e65dfb34b1ddec7be553d91342c99b".to_string();
    let missing = "no /nowhere/bin/nvcc (MIXSTACK_CUDA_ROOT)".to_string();
    let origin = Origin::Snapshot { fingerprint, missing };
    assert_eq!(origin.source(), "snapshot");
    assert_eq!(toolchain().source(), "toolchain");
    let out = lines(&s, Some(&s), &origin, false);
    assert_eq!(
        out,
        vec![
            "mixstack: 3 instance builds (sm_90 3), 1 accepted, 2 rejected for spills, as in the snapshot (`mixstack report` lists them); \
             from the snapshot: no CUDA toolchain (no /nowhere/bin/nvcc (MIXSTACK_CUDA_ROOT)), so built from the committed generated-tests/ (fingerprint 41cbf475d7a9 \
             matches); kernels embed PTX only, JIT-compiled by the driver"
        ]
    );
}

#[test]
fn pruned_instances_new_since_the_snapshot_are_named() {
    let row = |n: &str| PrunedRow { name: n.into(), reason: "needs 300000 B of shared memory".into() };
    let mut before = snapshot();
    before.pruned = vec![row("ms_p")];
    let mut now = snapshot();
    now.pruned = vec![row("ms_p"), row("ms_q")];
    let out = lines(&now, Some(&before), &toolchain(), false);
    assert_eq!(out.len(), 2, "{out:#?}");
    assert!(
        out[0].contains("as in the snapshot (`mixstack report` lists them), 2 pruned (1 new, named below);"),
        "{}",
        out[0]
    );
    assert_eq!(out[1], "pruned ms_q: needs 300000 B of shared memory");
    let out = lines(&before, Some(&before), &toolchain(), false);
    assert_eq!(out.len(), 1, "{out:#?}");
    assert!(out[0].contains("lists them), 1 pruned as in the snapshot;"), "{}", out[0]);
}

#[test]
fn the_committed_snapshot_against_itself_is_one_line() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let m = buildlog::committed(&root).expect("generated-tests/report.json parses as a manifest");
    let rejected = m.instances.iter().filter(|i| !i.accepted).count();
    assert!(rejected > 0, "the snapshot rejects some instances; this test needs one");
    let out = lines(&m, Some(&m), &toolchain(), false);
    assert_eq!(out.len(), 1, "{out:#?}");
    assert!(out[0].contains(&format!("{rejected} rejected for spills, as in the snapshot")), "{}", out[0]);
}

#[test]
fn a_stale_snapshot_is_said_unless_this_build_blesses_it() {
    let before = snapshot();
    let mut now = snapshot();
    now.fingerprint = "a".repeat(64);
    let out = lines(&now, Some(&before), &toolchain(), false);
    assert_eq!(out.len(), 2, "{out:#?}");
    assert_eq!(
        out[1],
        "the snapshot generated-tests/ is stale (fingerprint 000000000000, this tree aaaaaaaaaaaa): `cargo test` fails \
         until `MIXSTACK_BLESS=1 cargo build --release` and a commit of generated-tests/"
    );
    assert_eq!(lines(&now, Some(&before), &toolchain(), true).len(), 1);
    assert_eq!(lines(&before, Some(&before), &toolchain(), false).len(), 1);
}
