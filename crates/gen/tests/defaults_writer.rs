//! The tiles.yaml defaults writer (`mixstack tune --write`'s last step):
//! comments and order kept, one line per changed key, the result parses and
//! expands with the new defaults, a second write changes nothing.

use std::path::PathBuf;

use mixstack_gen::defaults::{write, Default, WriteError};
use mixstack_gen::expand::expand;
use mixstack_gen::kinds::{Dtype, Precision, Stage};
use mixstack_gen::spec;

fn specs_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../specs"))
}

fn texts(tiles: String) -> [String; 3] {
    let read = |f: &str| std::fs::read_to_string(specs_dir().join(f)).unwrap();
    [read("ops.yaml"), read("stages.yaml"), tiles]
}

fn shipped() -> String {
    std::fs::read_to_string(specs_dir().join("tiles.yaml")).unwrap()
}

fn d(stage: Stage, cf: u32, tile: &str, gpu: Option<&str>) -> Default {
    Default { stage, dtype: Dtype::F32, cf, tile: tile.into(), gpu: gpu.map(Into::into), precision: Precision::Exact }
}

#[test]
fn writes_replace_or_append_and_keep_everything_else() {
    let before = shipped();
    let changes = [
        // replaces the shipped generic default of this key
        d(Stage::BwdFused, 32, "m32_n64_k16_t8x4_s2_b6_ps", None),
        // a new key for one GPU
        d(Stage::BwdFused, 64, "m32_n64_k16_t8x4_s2_b6_ps", Some("H200")),
    ];
    let after = write(&before, &changes).unwrap();
    let (old, new): (Vec<&str>, Vec<&str>) = (before.lines().collect(), after.lines().collect());
    assert_eq!(new.len(), old.len() + 1, "one line added");
    let removed: Vec<&&str> = old.iter().filter(|l| !new.contains(l)).collect();
    let added: Vec<&&str> = new.iter().filter(|l| !old.contains(l)).collect();
    assert_eq!(removed, [&"  - {stage: bwd_fused, dtype: f32, cf: 32, tile: m64_n64_k32_t8x4_s2_b2_px}"]);
    assert_eq!(
        added,
        [
            &"  - {stage: bwd_fused, dtype: f32, cf: 32, tile: m32_n64_k16_t8x4_s2_b6_ps}",
            &"  - {stage: bwd_fused, dtype: f32, cf: 64, tile: m32_n64_k16_t8x4_s2_b6_ps, gpu: H200}"
        ]
    );
    // comments and order: the kept lines appear in the same order
    let kept: Vec<&&str> = old.iter().filter(|l| new.contains(l)).collect();
    let in_new: Vec<&&str> = new.iter().filter(|l| old.contains(l)).collect();
    assert_eq!(kept, in_new);
    assert!(old.iter().filter(|l| l.trim_start().starts_with('#')).all(|c| new.contains(c)));
    // it parses and expands with the new defaults
    let specs = spec::from_texts(&specs_dir(), texts(after.clone())).unwrap();
    let exp = expand(&specs, None).unwrap();
    let by = |n: &str| exp.instances.iter().find(|i| i.name == n).unwrap();
    assert!(by("ms_bwd_fused_f32_cf32_m32_n64_k16_t8x4_s2_b6_ps").is_default);
    assert!(!by("ms_bwd_fused_f32_cf32_m64_n64_k32_t8x4_s2_b2_px").is_default);
    assert_eq!(by("ms_bwd_fused_f32_cf64_m32_n64_k16_t8x4_s2_b6_ps").gpu_defaults, ["H200"]);
    // a second write of the same defaults changes nothing
    assert_eq!(write(&after, &changes).unwrap(), after);
    // the GPU key matches without case: replaced, not added
    let again = write(&after, &[d(Stage::BwdFused, 64, "m64_n64_k16_t8x4_s2_b4_ps", Some("h200"))]).unwrap();
    assert_eq!(again.lines().count(), after.lines().count());
}

#[test]
fn texts_it_cannot_edit_are_refused() {
    assert_eq!(write("gemm: {}\n", &[]), Err(WriteError::NoDefaultsList));
    let odd = shipped().replacen("defaults:\n", "defaults:\n  - stage: fwd_m0\n", 1);
    assert!(matches!(write(&odd, &[]), Err(WriteError::Unreadable { .. })));
}
