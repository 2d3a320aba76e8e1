//! CPU tests of the generator's front half: specs (errors with file, line
//! and field), expansion and canonical names, layout, rendering.

use mixstack::codegen::{expand::expand, pipeline, render::Renderer, spec};
use mixstack::kinds::{canonical_name, Dtype, Geometry, Stage};
use std::path::{Path, PathBuf};

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A copy of specs/ in a temp dir with `file` rewritten by `edit`.
fn specs_with(file: &str, edit: impl Fn(&str) -> String) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mixstack-specs-{}-{}", std::process::id(), rand::random::<u64>()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["ops.yaml", "stages.yaml", "tiles.yaml"] {
        let text = std::fs::read_to_string(crate_dir().join("specs").join(f)).unwrap();
        let text = if f == file { edit(&text) } else { text };
        std::fs::write(dir.join(f), text).unwrap();
    }
    dir
}

fn load_err(dir: &Path) -> String {
    match spec::load(dir) {
        Ok(_) => panic!("specs in {} should not load", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn shipped_specs_load_and_expand() {
    let s = spec::load(&crate_dir().join("specs")).unwrap();
    let exp = expand(&s, None);
    assert!(exp.instances.len() > 100);
    pipeline::check_defaults(&s, &exp).unwrap();
    // every name unique, and the canonical form of its own axes
    let mut names: Vec<&str> = exp.instances.iter().map(|i| i.name.as_str()).collect();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), exp.instances.len());
    for i in &exp.instances {
        assert_eq!(i.name, canonical_name(i.stage, i.dtype, i.cf, &i.geometry));
    }
}

#[test]
fn unknown_field_names_file_line_and_field() {
    let dir = specs_with("tiles.yaml", |t| t.replacen("tm: 8, tn: 4, stages: 2", "tm: 8, tn: 4, stagez: 2", 1));
    let e = load_err(&dir);
    assert!(e.contains("tiles.yaml:"), "{e}");
    assert!(e.contains("stagez"), "{e}");
    // line and column are numbers
    let loc = e.split("tiles.yaml:").nth(1).unwrap();
    let mut parts = loc.split(':');
    assert!(parts.next().unwrap().parse::<usize>().unwrap() > 0, "{e}");
}

#[test]
fn bad_values_are_named() {
    let dir = specs_with("stages.yaml", |t| t.replacen("dtypes: [f32, f64]", "dtypes: [f32, f16]", 1));
    let e = load_err(&dir);
    assert!(e.contains("stages.yaml:") && e.contains("f16"), "{e}");

    let dir = specs_with("ops.yaml", |t| t.replacen("op: exp", "op: expo", 1));
    let e = load_err(&dir);
    assert!(e.contains("ops.yaml") && e.contains("expo") && e.contains("steps"), "{e}");

    let dir = specs_with("stages.yaml", |t| t.replacen("tiles: fused\n", "tiles: fused_zero\n", 1));
    let e = load_err(&dir);
    assert!(e.contains("stages.yaml") && e.contains("fused_zero") && e.contains(".tiles"), "{e}");

    let dir = specs_with("tiles.yaml", |t| {
        t.replacen(
            "tm: 4, tn: 4, stages: 2, min_blocks: 1, pipe: regs",
            "tm: 4, tn: 4, stages: 3, min_blocks: 1, pipe: regs",
            1,
        )
    });
    let e = load_err(&dir);
    assert!(e.contains("stages") && e.contains("1 or 2"), "{e}");

    let dir = specs_with("tiles.yaml", |t| {
        t.replacen("rows: 8, threads: 256, min_blocks: 1}", "rows: 8, threads: 256, min_blocks: 0}", 1)
    });
    let e = load_err(&dir);
    assert!(e.contains("tiles.yaml") && e.contains("relay_rows[1].min_blocks") && e.contains("positive"), "{e}");

    let dir = specs_with("tiles.yaml", |t| {
        t.replacen(
            "bn: 64, block_k: 16, tm: 8, tn: 4, stages: 2, min_blocks: 4",
            "bn: 96, block_k: 16, tm: 8, tn: 6, stages: 2, min_blocks: 4",
            1,
        )
    });
    let e = load_err(&dir);
    assert!(e.contains("tiles.yaml") && e.contains("multiples of 4"), "{e}");

    // the fused regime is enforced by the spec check
    let dir = specs_with("stages.yaml", |t| {
        t.replacen("    cf: [32, 64]\n    tiles: fused\n", "    cf: [32, 96]\n    tiles: fused\n", 1)
    });
    let e = load_err(&dir);
    assert!(e.contains("Cf < 96"), "{e}");
}

#[test]
fn a_default_must_name_an_instance() {
    let dir = specs_with("tiles.yaml", |t| {
        t.replacen("tile: m64_n64_k16_t8x4_s2_b4_ps}", "tile: m64_n64_k16_t8x4_s9_b4_ps}", 1)
    });
    let s = spec::load(&dir).unwrap();
    let e = pipeline::check_defaults(&s, &expand(&s, None)).unwrap_err().to_string();
    assert!(e.contains("defaults[") && e.contains("s9"), "{e}");
}

#[test]
fn narrowing_keeps_matching_names_only() {
    let s = spec::load(&crate_dir().join("specs")).unwrap();
    let exp = expand(&s, Some("bwd_fused,cf32"));
    assert!(!exp.instances.is_empty());
    assert!(exp.instances.iter().all(|i| i.name.contains("bwd_fused") && i.name.contains("cf32")));
}

#[test]
fn fused_instances_stream_with_block_k_dividing_cf() {
    let s = spec::load(&crate_dir().join("specs")).unwrap();
    let exp = expand(&s, None);
    let fused: Vec<_> = exp.instances.iter().filter(|i| i.stage == Stage::BwdFused).collect();
    assert!(!fused.is_empty());
    for i in fused {
        match i.geometry {
            Geometry::Gemm { block_k, pipe, .. } => {
                assert!(i.cf % block_k == 0, "{}", i.name);
                assert_eq!(pipe, mixstack::kinds::Pipe::Stream, "{}", i.name);
            }
            _ => panic!("{} is not a GEMM", i.name),
        }
        assert_eq!(i.dtype, Dtype::F32);
    }
}

#[test]
fn rendering_spells_every_rounding_and_one_entry() {
    let s = spec::load(&crate_dir().join("specs")).unwrap();
    let exp = expand(&s, None);
    let r = Renderer::new(&crate_dir().join("templates")).unwrap();
    let ops = r.ops_header(&s).unwrap();
    for needle in
        ["__fmaf_rn(", "__fma_rn(", "__fadd_rn(", "__dmul_rn(", "::expf(", "::exp(", "op_sigmoid", "op_dsilu_mul"]
    {
        assert!(ops.contains(needle), "ops.cuh lacks {needle}");
    }
    // no unrendered placeholder survives
    assert!(!ops.contains("{{") && !ops.contains("{%"));
    let inst = &exp.instances[0];
    let cu = r.instance(inst).unwrap();
    assert_eq!(cu.matches("extern \"C\" __global__").count(), 1);
    assert!(cu.contains(&format!("{}(", inst.name)));
    assert!(cu.contains(&format!("__launch_bounds__({}", inst.threads())));
    assert!(!cu.contains("{{") && !cu.contains("{%"));
}

#[test]
fn layout_places_buffers_aligned_and_grows_with_lmax() {
    let s = spec::load(&crate_dir().join("specs")).unwrap();
    for i in expand(&s, None).instances {
        let l = &i.layout;
        for off in [l.a_tile, l.b_tile, l.s_rows, l.gzs_rows].into_iter().flatten() {
            assert_eq!(off % 16, 0, "{}", i.name);
            assert!(off < l.fixed, "{}", i.name);
        }
        assert!(l.bytes(i.cf, 2) >= l.bytes(i.cf, 1));
        assert_eq!(l.bytes(i.cf, 3) - l.bytes(i.cf, 2), l.per_lg * i.cf);
    }
}
