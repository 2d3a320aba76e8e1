//! CPU tests of the generator's front half: specs (errors with file, line
//! and field), expansion and canonical names, layout, rendering.

use mixstack::kinds::{canonical_name, Arch, Dtype, Geometry, Pipe, Stage};
use mixstack_gen::{expand::expand, pipeline, render::Renderer, spec};
use std::path::{Path, PathBuf};

mod temp;
use temp::TempDir;

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A copy of specs/ in a temp dir (removed on drop) with `file` rewritten by `edit`.
fn specs_with(file: &str, edit: impl Fn(&str) -> String) -> TempDir {
    let dir = TempDir::new("mixstack-specs");
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
    let exp = expand(&s, None).unwrap();
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
    assert!(e.contains("Cf 96") && e.contains("regime.fused_cf_below = 96"), "{e}");
    // ... by the regime the spec states, not a number in Rust
    let dir = specs_with("stages.yaml", |t| t.replacen("fused_cf_below: 96", "fused_cf_below: 64", 1));
    let e = load_err(&dir);
    assert!(e.contains("Cf 64") && e.contains("fused_cf_below = 64"), "{e}");
    // a stage that finishes cuBLAS's gate GEMMs serves from cublas_gate_from_cf on
    let dir = specs_with("stages.yaml", |t| t.replacen("cublas_gate_from_cf: 96", "cublas_gate_from_cf: 128", 1));
    let e = load_err(&dir);
    assert!(e.contains("Cf 96") && e.contains("cublas_gate_from_cf = 128"), "{e}");
    // roles are spelled from a closed set
    let dir = specs_with("stages.yaml", |t| t.replacen("    pass: forward\n", "    pass: sideways\n", 1));
    let e = load_err(&dir);
    assert!(e.contains("stages.yaml") && e.contains("sideways"), "{e}");
}

/// `file:line:column: ` of an error, as numbers.
fn line_of(e: &str, file: &str) -> usize {
    let loc = e.split(&format!("{file}:")).nth(1).unwrap_or_else(|| panic!("no {file}: in {e}"));
    loc.split(':').next().unwrap().parse().unwrap_or_else(|_| panic!("no line number in {e}"))
}

/// The 1-based line of the first line of `text` containing `needle`.
fn line_with(text: &str, needle: &str) -> usize {
    text.lines().position(|l| l.contains(needle)).unwrap() + 1
}

#[test]
fn a_duplicated_tile_names_both_lines() {
    let shipped = std::fs::read_to_string(crate_dir().join("specs/tiles.yaml")).unwrap();
    let entry = "    - {dtypes: [f32], cf: [32, 64], block_m: 32, bn: 64, block_k: 16, tm: 8, tn: 4, stages: 2, min_blocks: 6, pipe: stream, archs: [sm_90]}\n";
    assert!(shipped.contains(entry));
    let dir = specs_with("tiles.yaml", |t| t.replacen(entry, &format!("{entry}{entry}"), 1));
    let e = load_err(&dir);
    let first = line_with(&shipped, entry.trim());
    assert_eq!(line_of(&e, "tiles.yaml"), first + 1, "{e}");
    assert!(e.contains(&format!("(line {first})")) && e.contains("share one name"), "{e}");

    // `block_k: cf` is the number Cf: the same instance at Cf 32 only
    let dir = specs_with("tiles.yaml", |t| {
        let second = entry.replace("cf: [32, 64]", "cf: [32]").replace("block_k: 16", "block_k: 32");
        let first = entry.replace("block_k: 16", "block_k: cf");
        t.replacen(entry, &format!("{first}{second}"), 1)
    });
    assert!(load_err(&dir).contains("share one name"));
    // different Cf: no clash
    let dir = specs_with("tiles.yaml", |t| {
        let second = entry.replace("cf: [32, 64]", "cf: [32]").replace("block_k: 16", "block_k: 32");
        let first = entry.replace("cf: [32, 64]", "cf: [64]").replace("block_k: 16", "block_k: cf");
        t.replacen(entry, &format!("{first}{second}"), 1)
    });
    spec::load(&dir).unwrap();

    let row = "    - {dtypes: [f32, f64], cf: [32, 64, 96, 128], rows: 8, threads: 256, min_blocks: 1}\n";
    let dir = specs_with("tiles.yaml", |t| t.replacen(row, &format!("{row}{row}"), 1));
    assert!(load_err(&dir).contains("share one name"));
}

#[test]
fn a_second_default_for_one_key_is_refused() {
    let shipped = std::fs::read_to_string(crate_dir().join("specs/tiles.yaml")).unwrap();
    let d = "  - {stage: bwd_pointwise, dtype: f32, cf: 32, tile: r16_t128_b8}\n";
    assert!(shipped.contains(d));
    let other = d.replace("r16_t128_b8", "r32_t128_b8");
    let dir = specs_with("tiles.yaml", |t| format!("{t}{other}"));
    let e = load_err(&dir);
    assert!(e.contains("a second default") && e.contains(&format!("(line {})", line_with(&shipped, d.trim()))), "{e}");
    assert_eq!(line_of(&e, "tiles.yaml"), shipped.lines().count() + 1, "{e}");
}

/// Defaults keyed by GPU: one per (stage, dtype, Cf, GPU), beside the
/// generic one; the instance knows the GPUs that name it.
#[test]
fn gpu_keyed_defaults() {
    let gpu_default = "  - {stage: bwd_fused, dtype: f32, cf: 32, tile: m32_n64_k16_t8x4_s2_b6_ps, gpu: H200}\n";
    let dir = specs_with("tiles.yaml", |t| format!("{t}{gpu_default}"));
    let specs = spec::load(&dir).unwrap();
    let exp = expand(&specs, None).unwrap();
    let named: Vec<_> = exp.instances.iter().filter(|i| i.gpu_defaults.iter().any(|g| g == "H200")).collect();
    assert_eq!(named.len(), 1);
    assert_eq!(named[0].name, "ms_bwd_fused_f32_cf32_m32_n64_k16_t8x4_s2_b6_ps");
    assert_eq!(named[0].gpu_defaults, ["H200"]);
    assert!(!named[0].is_default, "a GPU's default is not the generic one");
    // a second default for the same GPU (any case) is refused; another GPU is fine
    let again = gpu_default.replace("m32_n64_k16_t8x4_s2_b6_ps", "m64_n64_k16_t8x4_s2_b4_ps").replace("H200", "h200");
    let dir = specs_with("tiles.yaml", |t| format!("{t}{gpu_default}{again}"));
    let e = load_err(&dir);
    assert!(e.contains("a second default") && e.contains("on GPU h200"), "{e}");
    let other = again.replace("h200", "A100");
    let dir = specs_with("tiles.yaml", |t| format!("{t}{gpu_default}{other}"));
    spec::load(&dir).unwrap();
    let empty = gpu_default.replace("gpu: H200", "gpu: ' '");
    let dir = specs_with("tiles.yaml", |t| format!("{t}{empty}"));
    assert!(load_err(&dir).contains("empty GPU name"));
}

/// stages.yaml with its `regime.fused_faster` list replaced by `entries`
/// (one flow mapping per line).
fn with_fused_faster(text: &str, entries: &[&str]) -> String {
    let start = text.find("  fused_faster:").expect("a fused_faster list in stages.yaml");
    let end = text[start..].find("\n\n").map_or(text.len(), |n| start + n);
    let list: String = entries.iter().map(|e| format!("\n    - {e}")).collect();
    format!("{}  fused_faster:{list}{}", &text[..start], &text[end..])
}

/// `regime.fused_faster`: each entry a Cf the fused stage is built for, an
/// lmax range inside the build's, a GPU name that is not empty; entries for
/// one GPU key and mode do not overlap. Each refusal names the entry's line
/// and field.
#[test]
fn fused_faster_entries_are_checked() {
    let shipped = std::fs::read_to_string(crate_dir().join("specs/stages.yaml")).unwrap();
    let good = "{cf: 32, lmax: [1, 3], gpu: H100}";
    for (bad, needles) in [
        ("{cf: 48, lmax: [1, 3], gpu: H100}", &["fused_faster[1].cf", "Cf 48", "no fused stage"][..]),
        ("{cf: 32, lmax: [0, 3], gpu: H200}", &["fused_faster[1].lmax", "[0, 3]"][..]),
        ("{cf: 32, lmax: [3, 2], gpu: H200}", &["fused_faster[1].lmax", "[3, 2]"][..]),
        ("{cf: 32, lmax: [1, 7], gpu: H200}", &["fused_faster[1].lmax", "<= 6"][..]),
        ("{cf: 32, lmax: [1, 3], gpu: ' '}", &["fused_faster[1].gpu", "empty GPU name"][..]),
        ("{cf: 32, lmax: [3, 4], gpu: h100}", &["fused_faster[1].lmax", "overlaps regime.fused_faster[0]"][..]),
        ("{cf: 32, lmax: [1, 3], precision: fp17}", &["fp17"][..]),
        ("{cf: 32, lmax: [1, 3], tile: x}", &["tile"][..]),
    ] {
        let text = with_fused_faster(&shipped, &[good, bad]);
        let dir = specs_with("stages.yaml", |_| text.clone());
        let e = load_err(&dir);
        assert_eq!(line_of(&e, "stages.yaml"), line_with(&text, bad), "{bad}: {e}");
        for n in needles {
            assert!(e.contains(n), "{bad}: no {n:?} in {e}");
        }
    }
    // no overlap across GPU keys, modes, the generic list, or beside each other
    for ok in [
        "{cf: 32, lmax: [3, 4], gpu: H200}",
        "{cf: 32, lmax: [1, 6]}",
        "{cf: 32, lmax: [4, 6], gpu: H100}",
        "{cf: 32, lmax: [1, 3], precision: fp16x3, gpu: H100}",
    ] {
        let dir = specs_with("stages.yaml", |t| with_fused_faster(t, &[good, ok]));
        assert_eq!(spec::load(&dir).unwrap().stages.regime.fused_faster.len(), 2, "{ok}");
    }
    // none listed: "on" runs the relay everywhere
    let dir = specs_with("stages.yaml", |t| {
        with_fused_faster(t, &[]).replacen("  fused_faster:\n", "  fused_faster: []\n", 1)
    });
    assert!(spec::load(&dir).unwrap().stages.regime.fused_faster.is_empty());
}

/// `mixstack tune --regime --write` on the shipped stages.yaml: a sweep's
/// entries for one GPU replace that GPU's (for the swept Cf) and keep every
/// other line; the result loads, and its regime is the one written.
#[test]
fn a_measured_regime_writes_into_the_shipped_specs() {
    use mixstack::kinds::Precision;
    use mixstack_gen::regime::{entries, write, Point};
    let shipped = std::fs::read_to_string(crate_dir().join("specs/stages.yaml")).unwrap();
    let before = spec::load(&crate_dir().join("specs")).unwrap().stages.regime.fused_faster;
    let pt = |cf, lmax, ratio| Point { cf, lmax, ratio: Some(ratio), bitwise_equal: true };
    let points = [pt(32, 1, 0.9), pt(32, 2, 0.9), pt(32, 3, 1.01), pt(32, 4, 0.97), pt(64, 1, 1.2)];
    let found = entries(&points, 0.98, "H200", Precision::Exact);
    let text = write(&shipped, "NVIDIA H200", Precision::Exact, &[32, 64], &found).unwrap();
    let dir = specs_with("stages.yaml", |_| text.clone());
    let after = spec::load(&dir).unwrap().stages.regime.fused_faster;
    let h200: Vec<[u32; 2]> = after.iter().filter(|x| x.gpu.as_deref() == Some("H200")).map(|x| x.lmax).collect();
    assert_eq!(h200, [[1, 2], [4, 4]]);
    let others = before.iter().filter(|x| x.gpu.as_deref() != Some("H200")).count();
    assert_eq!(after.len(), others + 2, "the other GPUs' entries are kept, this GPU's replaced");
    // Written again, the same sweep changes nothing; the diff is the entries only.
    assert_eq!(write(&text, "NVIDIA H200", Precision::Exact, &[32, 64], &found).unwrap(), text);
    let added: Vec<&str> = text.lines().filter(|l| !shipped.lines().any(|o| o == *l)).collect();
    assert_eq!(
        added,
        [
            "    - {cf: 32, lmax: [1, 2], gpu: H200}  # fused / relay 0.900-0.900 (mixstack tune --regime)",
            "    - {cf: 32, lmax: [4, 4], gpu: H200}  # fused / relay 0.970-0.970 (mixstack tune --regime)"
        ]
    );
    // ... and this GPU's shipped entries are the lines it replaced
    let removed: Vec<&str> = shipped.lines().filter(|l| !text.lines().any(|o| o == *l)).collect();
    let shipped_h200: Vec<&str> = shipped.lines().filter(|l| l.contains("gpu: H200}")).collect();
    assert!(!shipped_h200.is_empty(), "the shipped stages.yaml has the H200's entries");
    assert_eq!(removed, shipped_h200);
}

#[test]
fn numbers_that_overflow_or_make_no_sense_are_refused() {
    let entry = "block_m: 64, bn: 64, block_k: 16, tm: 8, tn: 4, stages: 2, min_blocks: 4";
    for (from, to, says) in [
        ("block_m: 64,", "block_m: 2147483776,", "block_m 2147483776"),
        ("block_m: 64,", "block_m: 4294967295,", "block_m 4294967295"),
        ("bn: 64,", "bn: 0,", "bn 0"),
        ("block_k: 16,", "block_k: 100000,", "block_k 100000"),
        ("tm: 8,", "tm: 128,", "tm 128"),
        ("min_blocks: 4", "min_blocks: 4000000000", "min_blocks 4000000000"),
    ] {
        let dir = specs_with("tiles.yaml", |t| t.replacen(entry, &entry.replacen(from, to, 1), 1));
        let e = load_err(&dir);
        assert!(e.contains(says) && e.contains("at most"), "{from} -> {to}: {e}");
        assert!(line_of(&e, "tiles.yaml") > 0, "{e}");
    }
    // a number that does not fit u32 is a parse error with its line
    let dir = specs_with("tiles.yaml", |t| t.replacen(entry, &entry.replacen("bn: 64", "bn: 99999999999", 1), 1));
    assert!(line_of(&load_err(&dir), "tiles.yaml") > 0);
    // threads that overflow the multiplication
    let dir = specs_with("tiles.yaml", |t| {
        t.replacen(entry, &entry.replacen("block_m: 64", "block_m: 4096", 1).replacen("bn: 64", "bn: 4096", 1), 1)
    });
    assert!(load_err(&dir).contains("threads"));
    let dir = specs_with("stages.yaml", |t| t.replacen("max: 6}", "max: 4000000000}", 1));
    assert!(load_err(&dir).contains("lmax"));
    let dir = specs_with("stages.yaml", |t| t.replacen("cf: [32, 64, 96, 128]", "cf: [32, 32]", 1));
    assert!(load_err(&dir).contains("Cf 32 listed twice"));
}

#[test]
fn a_default_must_name_an_instance() {
    let dir = specs_with("tiles.yaml", |t| {
        t.replacen("tile: m64_n64_k16_t8x4_s2_b4_ps}", "tile: m64_n64_k16_t8x4_s9_b4_ps}", 1)
    });
    let s = spec::load(&dir).unwrap();
    let e = pipeline::check_defaults(&s, &expand(&s, None).unwrap()).unwrap_err().to_string();
    assert!(e.contains("defaults[") && e.contains("s9"), "{e}");
}

#[test]
fn narrowing_keeps_matching_names_only() {
    let s = spec::load(&crate_dir().join("specs")).unwrap();
    let exp = expand(&s, Some("bwd_fused,cf32")).unwrap();
    assert!(!exp.instances.is_empty());
    assert!(exp.instances.iter().all(|i| i.name.contains("bwd_fused") && i.name.contains("cf32")));
}

#[test]
fn fused_instances_walk_row_blocks_with_block_k_dividing_cf() {
    let s = spec::load(&crate_dir().join("specs")).unwrap();
    let exp = expand(&s, None).unwrap();
    let fused: Vec<_> = exp.instances.iter().filter(|i| i.stage == Stage::BwdFused).collect();
    assert!(!fused.is_empty());
    for i in fused {
        match i.geometry {
            Geometry::Gemm { block_k, pipe, .. } => {
                assert!(i.cf % block_k == 0, "{}", i.name);
                // the row-block walks (listed here, not by the predicate expand prunes with)
                let walks = [Pipe::Stream, Pipe::Ws, Pipe::Split, Pipe::Wgmma, Pipe::SplitWgmma];
                assert!(walks.contains(&pipe), "{}", i.name);
            }
            _ => panic!("{} is not a GEMM", i.name),
        }
        assert_eq!(i.dtype, Dtype::F32);
    }
}

#[test]
fn rendering_spells_every_rounding_and_one_entry() {
    let s = spec::load(&crate_dir().join("specs")).unwrap();
    let exp = expand(&s, None).unwrap();
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
    for i in expand(&s, None).unwrap().instances {
        let l = &i.layout;
        for off in [l.a_tile, l.b_tile, l.s_rows, l.gzs_rows].into_iter().flatten() {
            assert_eq!(off % 16, 0, "{}", i.name);
            // pipe wgmma's B panel follows the fixed part (it grows with lmax)
            let panel = i.geometry.pipe() == Some(Pipe::Wgmma) && Some(off) == l.b_tile;
            assert!(off < l.fixed || (panel && off == l.fixed), "{}", i.name);
        }
        assert!(l.bytes(i.cf, 2) >= l.bytes(i.cf, 1));
        assert_eq!(l.bytes(i.cf, 3) - l.bytes(i.cf, 2), l.per_lg * i.cf);
    }
}

/// The specs' GEMM instances with this pipe (at least one).
fn instances_with(pipe: Pipe) -> Vec<mixstack_gen::expand::Instance> {
    let s = spec::load(&crate_dir().join("specs")).unwrap();
    let found: Vec<_> = expand(&s, None)
        .unwrap()
        .instances
        .into_iter()
        .filter(|i| matches!(i.geometry, Geometry::Gemm { pipe: p, .. } if p == pipe))
        .collect();
    assert!(!found.is_empty(), "no pipe: {pipe:?} instance in the specs");
    found
}

/// `pipe: ws`: the kernel places the panel (BLOCK_M rows of ROW + one
/// 16-byte pad), sig and the g_logit rows after it from L at run time
/// (templates/stages.cuh: GzPanel); what it places must end exactly where the
/// launch size does, for every lmax, and the fixed buffers must lie before
/// the panel without overlapping. Producers come on top of the consumers.
#[test]
fn ws_layout_matches_what_the_kernel_places() {
    // The ws tiles are not built (tiles.yaml says why): the layout of the
    // ones it lists, added back, is what the kernel would place.
    let dir = specs_with("tiles.yaml", |t| {
        let ws: String = t
            .lines()
            .filter_map(|l| l.trim_start().strip_prefix("#   {").filter(|r| r.contains("pipe: ws")))
            .map(|r| format!("    - {{{r}\n"))
            .collect();
        assert!(!ws.is_empty(), "tiles.yaml lists the ws tiles it does not build");
        t.replacen("  fused:\n", &format!("  fused:\n{ws}"), 1)
    });
    let s = spec::load(&dir).unwrap();
    let ws: Vec<_> = expand(&s, None)
        .unwrap()
        .instances
        .into_iter()
        .filter(|i| matches!(i.geometry, Geometry::Gemm { pipe: Pipe::Ws, .. }))
        .collect();
    assert!(ws.len() >= 4, "{}", ws.len());
    for i in ws {
        let Geometry::Gemm { block_m, bn, block_k, tm, tn, stages, .. } = i.geometry else { unreachable!() };
        let (l, sz, cf) = (&i.layout, i.dtype.size() as u32, i.cf);
        let (ring, s_rows, panel) = (l.b_tile.unwrap(), l.s_rows.unwrap(), l.panel.unwrap());
        assert!(ring + stages * block_k * bn * sz <= s_rows, "{}: ring overlaps s", i.name);
        assert!(s_rows + block_m * cf * sz <= panel, "{}: s overlaps the panel", i.name);
        assert_eq!(panel % 16, 0, "{}", i.name);
        let glog_rows = l.glog_rows.unwrap();
        assert_eq!(block_m % glog_rows, 0, "{}", i.name);
        for lmax in 1..=6u32 {
            let (lg, row) = (lmax * cf, (3 * lmax + 1) * cf);
            let end = panel + (block_m * (row + 16 / sz) + block_m * lg + glog_rows * lg) * sz;
            assert_eq!(end, l.bytes(cf, lmax), "{} at lmax {lmax}", i.name);
        }
        assert_eq!(i.threads(), (block_m / tm) * (bn / tn) + mixstack::kinds::WS_PRODUCER_THREADS, "{}", i.name);
    }
}

/// `pipe: split`: two sets of the per-row buffers (templates/stages.cuh:
/// GzRows::s_sh / sig_sh / chunk with a slot), placed by the kernel from L
/// at run time: s slot j at s_rows + j * BLOCK_M * Cf values, before `fixed`
/// and after both rings; sig slot j at fixed + (sig_slot + j) * BLOCK_M * LG,
/// then the g_logit rows; the end is the launch size, for every lmax.
/// Producers come on top of the consumers.
#[test]
fn split_layout_matches_what_the_kernel_places() {
    for i in instances_with(Pipe::Split) {
        let Geometry::Gemm { block_m, bn, block_k, tm, tn, stages, .. } = i.geometry else { unreachable!() };
        let (l, sz, cf) = (&i.layout, i.dtype.size() as u32, i.cf);
        let (a, b, s_rows) = (l.a_tile.unwrap(), l.b_tile.unwrap(), l.s_rows.unwrap());
        assert!(a + stages * block_m * (block_k + l.apad) * sz <= b, "{}: A ring overlaps B", i.name);
        assert!(b + stages * block_k * bn * sz <= s_rows, "{}: B ring overlaps s", i.name);
        assert!(s_rows + 2 * block_m * cf * sz <= l.fixed, "{}: two s slots do not fit before fixed", i.name);
        assert_eq!(l.sig_slot, Some(0), "{}", i.name);
        assert_eq!(l.glog_slot, Some(2), "{}: g_logit after both sig slots", i.name);
        let glog_rows = l.glog_rows.unwrap();
        assert_eq!(block_m % glog_rows, 0, "{}", i.name);
        for lmax in 1..=6u32 {
            let lg = lmax * cf;
            let end = l.fixed + (2 * block_m * lg + glog_rows * lg) * sz;
            assert_eq!(end, l.bytes(cf, lmax), "{} at lmax {lmax}", i.name);
        }
        assert_eq!(i.threads(), (block_m / tm) * (bn / tn) + mixstack::kinds::WS_PRODUCER_THREADS, "{}", i.name);
    }
}

#[test]
fn archs_are_checked_where_they_are_written() {
    // stages.yaml: a known arch only (the YAML error has the line), oldest
    // first, none twice.
    let stages = std::fs::read_to_string(crate_dir().join("specs/stages.yaml")).unwrap();
    let line = line_with(&stages, "archs: [sm_80, sm_90]");
    let e = load_err(&specs_with("stages.yaml", |t| t.replace("archs: [sm_80, sm_90]", "archs: [sm_70, sm_90]")));
    assert!(e.contains(&format!("stages.yaml:{line}:")) && e.contains("sm_70"), "{e}");
    for bad in ["archs: [sm_90, sm_80]", "archs: [sm_90, sm_90]", "archs: []"] {
        let e = load_err(&specs_with("stages.yaml", |t| t.replace("archs: [sm_80, sm_90]", bad)));
        assert_eq!(line_of(&e, "stages.yaml"), line, "{bad}: {e}");
        assert!(e.contains("archs: need at least one arch, oldest first"), "{bad}: {e}");
    }
    // tiles.yaml: a tile's archs are targets of stages.yaml.
    let tiles = std::fs::read_to_string(crate_dir().join("specs/tiles.yaml")).unwrap();
    let entry =
        "block_m: 64, bn: 64, block_k: 16, tm: 8, tn: 4, stages: 2, min_blocks: 4, pipe: stream, archs: [sm_90]}";
    let line = line_with(&tiles, entry);
    let dir = specs_with("stages.yaml", |t| t.replace("archs: [sm_80, sm_90]", "archs: [sm_80]"));
    let e = load_err(&dir);
    assert_eq!(line_of(&e, "tiles.yaml"), line, "{e}");
    assert!(e.contains("archs: sm_90 is not a target of stages.yaml `archs` (sm_80)"), "{e}");
    let e = load_err(&specs_with("tiles.yaml", |t| t.replacen("archs: [sm_90]", "archs: []", 1)));
    assert!(e.contains("archs: need at least one arch"), "{e}");
}

#[test]
fn instances_build_for_their_tiles_archs() {
    // The fused tiles say sm_90 (Hopper's bulk L2 prefetch); a tile without
    // `archs` builds for every target; an arch whose shared memory the tile
    // exceeds even at the smallest lmax is dropped, the instance kept for
    // the others.
    let specs = mixstack_gen::spec::load(&crate_dir().join("specs")).unwrap();
    let exp = mixstack_gen::expand::expand(&specs, None).unwrap();
    assert_eq!(specs.stages.archs, [Arch::Sm80, Arch::Sm90]);
    for i in &exp.instances {
        if i.stage == Stage::BwdFused {
            assert_eq!(i.archs, [Arch::Sm90], "{}", i.name);
        }
    }
    let default_gemm = "ms_bwd_gemm_f32_cf32_m128_n64_k32_t8x4_s3_b2_ps";
    let i = exp.instances.iter().find(|i| i.name == default_gemm).unwrap();
    assert_eq!(i.archs, [Arch::Sm80, Arch::Sm90]);
    // A tile built everywhere that needs more than sm_80's 163 KiB.
    let dir = specs_with("tiles.yaml", |t| {
        t.replacen(
            "  relay_gemm:\n",
            "  relay_gemm:\n    - {dtypes: [f32], cf: [128], block_m: 256, bn: 128, block_k: 32, tm: 8, tn: 8, stages: 4, min_blocks: 1, pipe: stream}\n",
            1,
        )
    });
    let specs = mixstack_gen::spec::load(&dir).unwrap();
    let exp = mixstack_gen::expand::expand(&specs, None).unwrap();
    let big = exp.instances.iter().find(|i| i.name == "ms_bwd_gemm_f32_cf128_m256_n128_k32_t8x8_s4_b1_ps").unwrap();
    assert_eq!(big.archs, [Arch::Sm90], "{} B at lmax 1", big.layout.bytes(128, 1));
    let why = exp.pruned.iter().find(|p| p.name == big.name).map(|p| p.reason.as_str()).unwrap_or("no pruned line");
    assert!(why.starts_with("not built for sm_80: "), "{why}");
}

#[test]
fn producers_count_toward_the_block_size() {
    // 1024 GEMM threads alone are a legal block; with pipe: split's 128
    // producers beside them they are not, and the error says so at the line.
    let tiles = std::fs::read_to_string(crate_dir().join("specs/tiles.yaml")).unwrap();
    let entry = "block_m: 128, bn: 64, block_k: 32, tm: 8, tn: 4, stages: 3, min_blocks: 1, pipe: split";
    let line = line_with(&tiles, entry);
    let big = "block_m: 256, bn: 128, block_k: 32, tm: 8, tn: 4, stages: 3, min_blocks: 1, pipe: split";
    let e = load_err(&specs_with("tiles.yaml", |t| t.replace(entry, big)));
    assert_eq!(line_of(&e, "tiles.yaml"), line, "{e}");
    assert!(e.contains("1024 threads (+ 128 producers)") && e.contains("at most 1024 in all"), "{e}");
    let stream = big.replace("pipe: split", "pipe: stream");
    assert!(spec::load(&specs_with("tiles.yaml", |t| t.replace(entry, &stream))).is_ok());
}

/// The Cf 32 fused default was measured at the occupancy its tile was built
/// for (`min_blocks` blocks per SM) at the seed's lmax 3 (BENCH.md runs 90
/// and 93); a spec edit that grows its shared memory past that changes what
/// was measured, so it fails here, not on a GPU. An sm_90 SM holds 228 KiB
/// of shared memory, of which each resident block reserves 1 KiB.
#[test]
fn the_fused_default_keeps_its_measured_occupancy_at_the_seed() {
    const SM_SMEM: u32 = 228 * 1024;
    const RESERVED_PER_BLOCK: u32 = 1024;
    let s = spec::load(&crate_dir().join("specs")).unwrap();
    let exp = expand(&s, None).unwrap();
    let i = exp
        .instances
        .iter()
        .find(|i| i.stage == Stage::BwdFused && i.dtype == Dtype::F32 && i.cf == 32 && i.is_default)
        .expect("a generic Cf 32 bwd_fused default");
    let Geometry::Gemm { min_blocks, .. } = i.geometry else { unreachable!() };
    let per_block = i.layout.bytes(32, 3) + RESERVED_PER_BLOCK;
    assert!(
        min_blocks * per_block <= SM_SMEM,
        "{}: {min_blocks} blocks of {per_block} bytes do not fit an sm_90 SM's {SM_SMEM} at lmax 3",
        i.name
    );
}

/// The fp16x3 tile line of tiles.yaml (the first one).
fn x3_line(t: &str) -> String {
    let tile = |l: &&str| l.trim_start().starts_with("- {") && l.contains("precision: fp16x3");
    t.lines().find(tile).expect("tiles.yaml has fp16x3 tiles").to_string()
}

#[test]
fn fp16x3_tiles_outside_what_the_core_is_written_for_are_refused_where_written() {
    for (from, to, field, why) in [
        ("dtypes: [f32]", "dtypes: [f32, f64]", "dtypes", "dtypes [f32]"),
        ("tm: 8, tn: 4", "tm: 4, tn: 4", "tm", "tm 8, tn 4"),
        ("tm: 8, tn: 4", "tm: 8, tn: 8", "tn", "tm 8, tn 4"),
        ("block_k: 32", "block_k: 8", "block_k", "multiple of 16"),
        ("block_m: 128", "block_m: 80", "block_m", "multiples of 32"),
        ("bn: 64", "bn: 48", "bn", "multiples of 32"),
    ] {
        let dir = specs_with("tiles.yaml", |t| {
            let line = x3_line(t);
            t.replacen(&line, &line.replacen(from, to, 1), 1)
        });
        let e = load_err(&dir);
        let text = std::fs::read_to_string(crate_dir().join("specs/tiles.yaml")).unwrap();
        assert!(e.contains("precision fp16x3") && e.contains(why), "{from} -> {to}: {e}");
        assert!(e.contains(&format!(".{field}")), "{from} -> {to}: {e}");
        assert_eq!(line_of(&e, "tiles.yaml"), line_with(&text, &x3_line(&text)), "{e}");
    }
    let dir = specs_with("tiles.yaml", |t| {
        let line = x3_line(t);
        t.replacen(&line, &line.replacen("pipe: stream", "pipe: async", 1), 1)
    });
    assert!(load_err(&dir).contains("pipe stream"));
    // The chunk width is part of the arithmetic: one block_k for every fp16x3 tile.
    let dir = specs_with("tiles.yaml", |t| {
        let line = x3_line(t);
        let other = line.replacen("block_k: 32", "block_k: 64", 1).replacen("stages: 3", "stages: 2", 1);
        t.replacen(&line, &format!("{line}\n{other}"), 1)
    });
    let e = load_err(&dir);
    assert!(e.contains("one block_k") && e.contains(".block_k"), "{e}");
}

#[test]
fn fp16x3_instances_are_their_own_keys_never_an_exact_default() {
    use mixstack::kinds::Precision;
    let s = spec::load(&crate_dir().join("specs")).unwrap();
    let exp = expand(&s, None).unwrap();
    let x3: Vec<_> = exp.instances.iter().filter(|i| i.geometry.precision() == Precision::Fp16x3).collect();
    // every relay GEMM stage has them, f32 only, named with the mode
    for stage in [Stage::FwdM0, Stage::FwdM1, Stage::FwdFinal, Stage::BwdFinal, Stage::BwdGemm] {
        assert!(x3.iter().any(|i| i.stage == stage), "{stage}");
    }
    for i in &x3 {
        assert_eq!(i.dtype, Dtype::F32, "{}", i.name);
        assert!(i.name.ends_with("_x3"), "{}", i.name);
    }
    // named by defaults of the mode only (the spec refuses an exact one naming it)
    for d in &s.tiles.defaults {
        let x3_tile = d.tile.ends_with("_x3");
        assert_eq!(x3_tile, d.precision == Precision::Fp16x3, "{d:?}");
    }
    assert!(x3.iter().any(|i| i.is_default), "the mode's generic defaults name its tiles");
    // an exact tile of the same geometry is another instance, not a duplicate
    let dir = specs_with("tiles.yaml", |t| {
        let line = x3_line(t);
        t.replacen(&line, &format!("{line}\n{}", line.replacen("precision: fp16x3, ", "", 1)), 1)
    });
    let s2 = spec::load(&dir).unwrap();
    let exp2 = expand(&s2, None).unwrap();
    let name = &x3[0].name;
    assert!(exp2.instances.iter().any(|i| &i.name == name));
    assert!(exp2.instances.iter().any(|i| i.name == name.trim_end_matches("_x3")), "{name}'s exact twin");
    // a default naming an fp16x3 tile must say so
    let dir = specs_with("tiles.yaml", |t| {
        format!("{t}  - {{stage: bwd_gemm, dtype: f32, cf: 96, tile: m128_n64_k32_t8x4_s3_b1_ps_x3}}\n")
    });
    let s = spec::load(&dir).unwrap();
    let e = pipeline::check_defaults(&s, &expand(&s, None).unwrap()).unwrap_err().to_string();
    assert!(e.contains("precision: fp16x3") && e.contains(".precision"), "{e}");
    // ... and with it, it is that mode's default
    let dir = specs_with("tiles.yaml", |t| {
        format!(
            "{t}  - {{stage: bwd_gemm, dtype: f32, cf: 96, tile: m128_n64_k32_t8x4_s3_b1_ps_x3, precision: fp16x3}}\n"
        )
    });
    let s = spec::load(&dir).unwrap();
    let exp = expand(&s, None).unwrap();
    pipeline::check_defaults(&s, &exp).unwrap();
    assert!(exp
        .instances
        .iter()
        .any(|i| i.is_default && i.name == "ms_bwd_gemm_f32_cf96_m128_n64_k32_t8x4_s3_b1_ps_x3"));
}

#[test]
fn fused_fp16x3_tiles_share_the_relays_chunk_width() {
    use mixstack::kinds::Precision;
    // The built set: fused fp16x3 instances exist, at the relay's block_k.
    let s = spec::load(&crate_dir().join("specs")).unwrap();
    let exp = expand(&s, None).unwrap();
    let x3: Vec<_> = exp.instances.iter().filter(|i| i.geometry.precision() == Precision::Fp16x3).collect();
    assert!(x3.iter().any(|i| i.stage == Stage::BwdFused), "fused fp16x3 instances are built");
    assert!(x3.iter().all(|i| i.geometry.block_k() == x3[0].geometry.block_k()), "one chunk width");
    // A fused fp16x3 tile of another block_k is refused, naming the first.
    let dir = specs_with("tiles.yaml", |t| {
        let line = x3_line(t);
        let fused = line.replace("cf: [32, 64, 96, 128]", "cf: [32, 64]").replacen("block_k: 32", "block_k: 16", 1);
        t.replacen("  fused:\n", &format!("  fused:\n{fused}\n"), 1)
    });
    let e = load_err(&dir);
    assert!(e.contains("one block_k") && e.contains("as gemm.fused[0]"), "{e}");
    // ... and one on the ws panel, which the core does not walk.
    let dir = specs_with("tiles.yaml", |t| {
        let line = x3_line(t);
        let fused = line.replace("cf: [32, 64, 96, 128]", "cf: [32, 64]").replacen("pipe: stream", "pipe: ws", 1);
        t.replacen("  fused:\n", &format!("  fused:\n{fused}\n"), 1)
    });
    assert!(load_err(&dir).contains("pipe stream (or split, fused; or wgmma, split_wgmma)"));
}

fn regs_line(t: &str) -> String {
    let tile = |l: &&str| l.trim_start().starts_with("- {") && l.contains("regs: 192");
    t.lines().find(tile).expect("tiles.yaml has a tile with regs").to_string()
}

#[test]
fn register_moves_outside_what_setmaxnreg_allows_are_refused_where_written() {
    for (from, to, why) in [
        ("pipe: split", "pipe: stream", "pipe split only"),
        ("archs: [sm_90]", "archs: [sm_80, sm_90]", "archs: [sm_90]"),
        ("regs: 192", "regs: 196", "multiple of 8"),
        ("regs: 192", "regs: 264", "24 to 256"),
        // 2 blocks of 256 threads start at 128 registers each
        ("regs: 192", "regs: 128", "not above the launch cap of 128"),
        // 128 consumers at 232 leave the producers 24: at 240, 16
        ("regs: 192", "regs: 240", "fewer than 24"),
        // 64 consumers: half a warpgroup
        ("tm: 8, tn: 8", "tm: 8, tn: 16", "not a multiple of 128"),
    ] {
        let dir = specs_with("tiles.yaml", |t| {
            let line = regs_line(t);
            t.replacen(&line, &line.replacen(from, to, 1), 1)
        });
        let e = load_err(&dir);
        let text = std::fs::read_to_string(crate_dir().join("specs/tiles.yaml")).unwrap();
        assert!(e.contains(why) && e.contains(".regs"), "{from} -> {to}: {e}");
        assert_eq!(line_of(&e, "tiles.yaml"), line_with(&text, &regs_line(&text)), "{e}");
    }
    let dir = specs_with("tiles.yaml", |t| {
        let line = regs_line(t);
        t.replacen(&line, &line.replacen("regs: 192", "regs: 232", 1), 1)
    });
    assert!(spec::load(&dir).is_ok(), "232 leaves the producers 24, setmaxnreg's least");
}

#[test]
fn register_moves_are_named_split_and_built_for_sm_90a() {
    let specs = spec::load(&crate_dir().join("specs")).unwrap();
    let exp = expand(&specs, None).unwrap();
    let r = Renderer::new(&crate_dir().join("templates")).unwrap();
    let moved: Vec<_> = exp.instances.iter().filter(|i| i.geometry.setmaxnreg().is_some()).collect();
    assert!(!moved.is_empty(), "tiles.yaml ships tiles with regs");
    for i in &moved {
        let (producers, consumers) = i.geometry.setmaxnreg().unwrap();
        assert!(i.geometry.tag().contains(&format!("_px_r{consumers}")), "{}", i.name);
        // the block's registers, as ptxas starts it, split between the sides
        assert_eq!(i.geometry.launch_regs(), 128, "{}", i.name);
        assert_eq!(128 * producers + 128 * consumers, 256 * 128, "{}", i.name);
        assert_eq!(i.archs, [Arch::Sm90], "{}", i.name);
        assert_eq!(Arch::Sm90.target(i.geometry.arch_specific()), "sm_90a");
        let src = r.instance(i).unwrap();
        assert!(src.contains(&format!("producer_regs = {producers};")), "{src}");
        assert!(src.contains(&format!("consumer_regs = {consumers};")), "{src}");
        // what the pipeline compiled (the committed snapshot's PTX)
        let ptx = crate_dir().join(format!("generated-tests/ptx/sm_90/{}.ptx", i.name));
        let ptx = std::fs::read_to_string(&ptx).unwrap_or_else(|e| panic!("{}: {e}", ptx.display()));
        assert!(ptx.contains(".target sm_90a") && ptx.contains("setmaxnreg.inc"), "{}", i.name);
    }
    // every other instance keeps its name, its target and its file (pipe
    // wgmma's are sm_90a too: wgmma_tiles_are_built_for_sm_90a)
    for i in exp.instances.iter().filter(|i| i.geometry.setmaxnreg().is_none()) {
        let wgmma = i.geometry.pipe().is_some_and(Pipe::wgmma);
        assert!(i.geometry.arch_specific() == wgmma && !i.geometry.tag().contains("_r"), "{}", i.name);
        let src = r.instance(i).unwrap();
        assert!(!src.contains("_regs ="), "{}", i.name);
    }
    assert_eq!(Arch::Sm90.target(false), "sm_90");
}

/// The committed snapshot's PTX of a wgmma instance the pipeline accepted
/// (generated-tests/report.json): sm_90a, with wgmma in it. One it rejected
/// for spills has no PTX there.
fn assert_wgmma_ptx(name: &str) {
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(crate_dir().join("generated-tests/report.json")).unwrap())
            .unwrap();
    let row = report["instances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == name && r["arch"] == "sm_90")
        .unwrap_or_else(|| panic!("{name} is not in the snapshot's report"));
    let ptx = crate_dir().join(format!("generated-tests/ptx/sm_90/{name}.ptx"));
    if row["accepted"] == true {
        let ptx = std::fs::read_to_string(&ptx).unwrap_or_else(|e| panic!("{}: {e}", ptx.display()));
        assert!(ptx.contains(".target sm_90a") && ptx.contains("wgmma.mma_async"), "{name}");
    } else {
        assert!(row["spill_stores"].as_u64().unwrap() > 0 && !ptx.exists(), "{name}: rejected, but not for spills");
    }
}

/// Two split B chunks, head and tail fp16 halves of BK x BN each: what the
/// fused wgmma walks need at `b_split` (core.cuh's static_assert).
fn b_split_bytes(g: &Geometry) -> u32 {
    match *g {
        Geometry::Gemm { block_k, bn, .. } => 2 * 2 * 2 * block_k * bn,
        _ => panic!("a GEMM tile"),
    }
}

/// tiles.yaml with its split_wgmma tiles, which it keeps as comments (not
/// built: their kernel has not run since its last change), written back in.
fn with_split_wgmma(t: &str) -> String {
    let line = |l: &str| match l.trim_start().starts_with("#   {") && l.contains("pipe: split_wgmma") {
        true => l.replacen("#   {", "- {", 1),
        false => l.to_string(),
    };
    t.lines().map(line).collect::<Vec<_>>().join("\n") + "\n"
}

#[test]
fn split_wgmma_tiles_are_fused_sm_90a_with_their_b_split() {
    use mixstack::kinds::Precision;
    let r = Renderer::new(&crate_dir().join("templates")).unwrap();
    // the shipped specs build none; a b_split buffer only in the fused wgmma walk
    let shipped = expand(&spec::load(&crate_dir().join("specs")).unwrap(), None).unwrap();
    for i in &shipped.instances {
        assert!(i.geometry.pipe() != Some(Pipe::SplitWgmma), "{}", i.name);
        let fused_wg = i.stage == Stage::BwdFused && i.geometry.pipe() == Some(Pipe::Wgmma);
        assert_eq!(i.layout.b_split.is_some(), fused_wg, "{}", i.name);
        assert_eq!(r.instance(i).unwrap().contains("b_split"), fused_wg, "{}", i.name);
    }
    let exp = expand(&spec::load(&specs_with("tiles.yaml", with_split_wgmma)).unwrap(), None).unwrap();
    let wg: Vec<_> = exp.instances.iter().filter(|i| i.geometry.pipe() == Some(Pipe::SplitWgmma)).collect();
    assert!(wg.len() >= 2, "tiles.yaml keeps the split_wgmma tiles as comments");
    for i in &wg {
        assert!(i.name.contains("_pxg_x3") && i.stage == Stage::BwdFused, "{}", i.name);
        assert_eq!(i.geometry.precision(), Precision::Fp16x3, "{}", i.name);
        // 128 producers and a consumer warpgroup per 64 rows
        let threads = 128 + 2 * i.geometry.rows();
        assert_eq!((i.geometry.threads(), i.archs.as_slice()), (threads, &[Arch::Sm90][..]), "{}", i.name);
        assert_eq!(Arch::Sm90.target(i.geometry.arch_specific()), "sm_90a");
        // two split B chunks (4 * BK * BN bytes each: head and tail halves) after the B ring
        let b = i.layout.b_split.expect("a b_split buffer");
        assert!(b >= i.layout.b_tile.unwrap() && b + b_split_bytes(&i.geometry) <= i.layout.fixed, "{}", i.name);
        assert!(r.instance(i).unwrap().contains(&format!("b_split = {b};")), "{}", i.name);
    }
    // Refused outside what gemm_rowblock's wgmma consumers are written for.
    let line = "block_m: 64, bn: 64, block_k: 32, tm: 8, tn: 4, stages: 3, min_blocks: 1, pipe: split_wgmma";
    // In the relay's GEMM set it loads, and expand prunes it there, saying why.
    let dir = specs_with("tiles.yaml", |t| {
        let tile = format!("    - {{dtypes: [f32], cf: [32], {line}, precision: fp16x3, archs: [sm_90]}}\n");
        t.replacen("  relay_gemm:\n", &format!("  relay_gemm:\n{tile}"), 1)
    });
    let pruned = expand(&spec::load(&dir).unwrap(), None).unwrap().pruned;
    let why = pruned.iter().find(|p| p.name.starts_with("ms_bwd_gemm_") && p.name.contains("_pxg_x3"));
    assert!(
        why.is_some_and(|p| p.reason.contains("split and split_wgmma serve the fused backward only")),
        "{pruned:?}"
    );
    for (to, want) in [
        (line.replace("block_m: 64", "block_m: 96"), "block_m 64, 128 or 192"),
        (line.replace("bn: 64", "bn: 128").replace("tn: 4", "tn: 8"), "bn 64"),
    ] {
        let e = load_err(&specs_with("tiles.yaml", |t| with_split_wgmma(t).replacen(line, &to, 1)));
        assert!(e.contains(want) && e.contains("tiles.yaml:"), "{to}: {e}");
    }
    let full = "pipe: split_wgmma, precision: fp16x3, archs: [sm_90]";
    for (to, want) in [
        ("pipe: split_wgmma, precision: fp16x3", "archs [sm_90]"),
        ("pipe: split_wgmma, archs: [sm_90]", "run the fp16x3 products"),
    ] {
        let e = load_err(&specs_with("tiles.yaml", |t| with_split_wgmma(t).replacen(full, to, 1)));
        assert!(e.contains(want) && e.contains("tiles.yaml:"), "{to}: {e}");
    }
}

#[test]
fn wgmma_tiles_are_built_for_sm_90a() {
    use mixstack::kinds::Precision;
    let s = spec::load(&crate_dir().join("specs")).unwrap();
    let exp = expand(&s, None).unwrap();
    let wg: Vec<_> = exp.instances.iter().filter(|i| i.geometry.pipe() == Some(Pipe::Wgmma)).collect();
    let r = Renderer::new(&crate_dir().join("templates")).unwrap();
    let mut relay_rows = std::collections::BTreeSet::new();
    let mut batches = std::collections::BTreeSet::new();
    let mut relay_cols = std::collections::BTreeSet::new();
    assert!(wg.iter().any(|i| i.stage != Stage::BwdFused), "the relay's pipe wgmma instances are built");
    assert!(wg.iter().any(|i| i.stage == Stage::BwdFused), "the fused pipe wgmma instances are built");
    for i in wg {
        assert!(i.name.contains("_pg_x3"), "{}", i.name);
        assert_eq!(i.geometry.precision(), Precision::Fp16x3, "{}", i.name);
        // a warpgroup per 64 rows, no producers
        let threads = 2 * i.geometry.rows();
        assert_eq!((i.geometry.threads(), i.archs.as_slice()), (threads, &[Arch::Sm90][..]), "{}", i.name);
        assert_eq!(Arch::Sm90.target(i.geometry.arch_specific()), "sm_90a");
        if i.stage == Stage::BwdFused {
            // the B ring, then two split B chunks (4 * BK * BN bytes each)
            let b = i.layout.b_split.expect("a b_split buffer");
            assert!(b >= i.layout.b_tile.unwrap() && b + b_split_bytes(&i.geometry) <= i.layout.fixed, "{}", i.name);
        } else {
            // gemm_wg: a warpgroup per 64 rows, each its ring of `stages` chunks of 64 rows at
            // pitch block_k + 8 floats (core.cuh places warpgroup w's at w * stages * 64 rows);
            // then the B panel, 8 * BN bytes per gate column (BN / 64 wgmma tiles)
            let Geometry::Gemm { block_m, bn, block_k, stages, min_blocks, .. } = i.geometry else { unreachable!() };
            assert_eq!(i.layout.a_tile, Some(0), "{}", i.name);
            assert_eq!(i.layout.fixed, (stages * block_m * (block_k + 8) * 4).div_ceil(16) * 16, "{}", i.name);
            assert_eq!((i.layout.b_tile, i.layout.per_lg), (Some(i.layout.fixed), 8 * bn), "{}", i.name);
            relay_rows.insert(block_m);
            relay_cols.insert(bn);
            // the staged epilogue's batch, as ptxas measured what fits
            // (BENCH.md runs 133-140): all eight fragments at one block of
            // 128 rows and one column tile; two at 168 registers (block_m
            // 192, three blocks of 64) and beside a second column tile's
            // accumulators; one at two blocks per SM (128 registers)
            let batch = i.geometry.epi_batch().unwrap();
            let want = match (block_m, bn, min_blocks) {
                (128, 64, 1) => 8,
                (128, 64, 2) => 1,
                (192, 64, 1) | (64, 64, 3) | (128, 128, 1) => 2,
                _ => panic!("{}: a wgmma tile this test does not know", i.name),
            };
            assert_eq!(batch, want, "{}", i.name);
            assert!(r.instance(i).unwrap().contains(&format!("epi_batch = {batch};")), "{}", i.name);
            batches.insert(batch);
        }
        if i.stage == Stage::BwdFused {
            assert!(!r.instance(i).unwrap().contains("epi_batch"), "{}: gemm_wg's alone", i.name);
        }
        assert_wgmma_ptx(&i.name);
    }
    // the relay's tiles of one, two and three warpgroups are built, not pruned
    assert_eq!(relay_rows.into_iter().collect::<Vec<_>>(), [64, 128, 192]);
    assert_eq!(batches.into_iter().collect::<Vec<_>>(), [1, 2, 8], "tiles of each batch are built");
    assert_eq!(relay_cols.into_iter().collect::<Vec<_>>(), [64, 128], "one and two column tiles");
    // In the fused set a block_m 192 tile loads, and expand prunes it, saying why.
    let fused = "block_m: 128, bn: 64, block_k: 32, tm: 8, tn: 4, stages: 2, min_blocks: 1, pipe: wgmma";
    assert_eq!(std::fs::read_to_string(crate_dir().join("specs/tiles.yaml")).unwrap().matches(fused).count(), 1);
    let dir = specs_with("tiles.yaml", |t| t.replacen(fused, &fused.replace("block_m: 128", "block_m: 192"), 1));
    let pruned = expand(&spec::load(&dir).unwrap(), None).unwrap().pruned;
    let why =
        pruned.iter().find(|p| p.name.starts_with("ms_bwd_fused_") && p.name.contains("_m192_n64_k32_t8x4_s2_b1_pg"));
    assert!(why.is_some_and(|p| p.reason.contains("one or two warpgroups")), "{pruned:?}");
    // and one wider than 64 columns: gemm_wg's alone
    let dir = specs_with("tiles.yaml", |t| t.replacen(fused, &fused.replace("bn: 64", "bn: 128"), 1));
    let pruned = expand(&spec::load(&dir).unwrap(), None).unwrap().pruned;
    let why =
        pruned.iter().find(|p| p.name.starts_with("ms_bwd_fused_") && p.name.contains("_m128_n128_k32_t8x4_s2_b1_pg"));
    assert!(why.is_some_and(|p| p.reason.contains("bn 64")), "{pruned:?}");
    // Three warpgroups at bn 192 are 384 threads (not (block_m/tm) * (bn/tn)): loaded.
    let m192 = "block_m: 192, bn: 64, block_k: 32, tm: 8, tn: 4, stages: 3, min_blocks: 1, pipe: wgmma";
    let dir = specs_with("tiles.yaml", |t| t.replacen(m192, &m192.replace("bn: 64", "bn: 192"), 1));
    assert!(spec::load(&dir).is_ok());
    // Refused outside what the wgmma walks are written for, naming the field.
    for (from, to, want) in [
        (
            "block_m: 128, bn: 64, block_k: 32, tm: 8, tn: 4, stages: 4, min_blocks: 1, pipe: wgmma",
            "block_m: 96, bn: 64, block_k: 32, tm: 8, tn: 4, stages: 4, min_blocks: 1, pipe: wgmma",
            "block_m 64, 128 or 192",
        ),
        (
            "block_m: 128, bn: 64, block_k: 32, tm: 8, tn: 4, stages: 4, min_blocks: 1, pipe: wgmma",
            "block_m: 128, bn: 96, block_k: 32, tm: 8, tn: 4, stages: 4, min_blocks: 1, pipe: wgmma",
            "bn 64, 128 or 192",
        ),
        ("pipe: wgmma, precision: fp16x3, archs: [sm_90]", "pipe: wgmma, precision: fp16x3", "archs [sm_90]"),
        ("pipe: wgmma, precision: fp16x3, archs: [sm_90]", "pipe: wgmma, archs: [sm_90]", "run the fp16x3 products"),
    ] {
        let e = load_err(&specs_with("tiles.yaml", |t| t.replacen(from, to, 1)));
        assert!(e.contains(want) && e.contains("tiles.yaml:"), "{to}: {e}");
    }
}
