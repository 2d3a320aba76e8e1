//! Runtime tests that need no GPU: the fused switch, dispatch over
//! hand-built tables, launch geometry, shape arithmetic.

use mixstack::kinds::fused_faster;
use mixstack::runtime::dispatch::{
    decide_backward_path, dispatch_report, forward_stages, needs_cublas, relay_stages, select_kernel, Dispatch, Path,
    Reason, TileOverride, FUSED_CF_LIMIT,
};
use mixstack::runtime::error::{MixError, ShapeParam};
use mixstack::runtime::launch::launch_config;
use mixstack::runtime::precision::{parse_precision, PrecisionMode, PRECISION_ENV};
use mixstack::runtime::shape::{StackShape, MAX_EDGES, MAX_LAYERS};
use mixstack::runtime::stack::validate_shape;
use mixstack::runtime::switch::{parse_switch, FusedMode, Request, FUSED_ENV};
use mixstack::runtime::table::{self, Arch, Dtype, FusedFaster, Geometry, KernelEntry, Precision, Stage, Variant};

// ----------------------------------------------------------------------
// hand-built tables
// ----------------------------------------------------------------------

fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}

fn gemm(block_m: u32, bn: u32, block_k: u32, tm: u32, tn: u32) -> Geometry {
    Geometry::Gemm {
        block_m,
        bn,
        block_k,
        tm,
        tn,
        stages: 2,
        min_blocks: 1,
        pipe: mixstack::kinds::Pipe::Regs,
        precision: Precision::Exact,
        regs: 0,
    }
}

/// A streaming GEMM tile (the only kind the fused stage takes).
fn stream(block_m: u32, bn: u32, block_k: u32, tm: u32, tn: u32) -> Geometry {
    Geometry::Gemm {
        block_m,
        bn,
        block_k,
        tm,
        tn,
        stages: 2,
        min_blocks: 1,
        pipe: mixstack::kinds::Pipe::Stream,
        precision: Precision::Exact,
        regs: 0,
    }
}

fn threads_of(g: Geometry) -> u32 {
    g.threads()
}

/// An entry with the canonical name of docs/KERNELS.md.
fn entry(stage: Stage, dtype: Dtype, cf: u32, geometry: Geometry, accepted: bool, is_default: bool) -> KernelEntry {
    let name = mixstack::kinds::canonical_name(stage, dtype, cf, &geometry);
    let variant = if stage == Stage::BwdFused { Variant::Fused } else { Variant::Relay };
    KernelEntry {
        name: leak(name),
        arch: Arch::Sm90,
        stage,
        variant,
        dtype,
        cf,
        geometry,
        threads: threads_of(geometry),
        smem_fixed: 0,
        smem_per_lg: 0,
        registers: 64,
        spill_stores: if accepted { 0 } else { 8 },
        spill_loads: if accepted { 0 } else { 8 },
        stack_bytes: 0,
        smem_static: 0,
        accepted,
        spec_default: is_default,
        gpu_defaults: &[],
        ptx: "",
        ptx_file: "",
        cubin: None,
    }
}

fn is_gemm_stage(s: Stage) -> bool {
    matches!(s, Stage::FwdM0 | Stage::FwdM1 | Stage::FwdFinal | Stage::BwdFinal | Stage::BwdGemm | Stage::BwdFused)
}

/// Every non-fused stage but the optional ones (the cuBLAS gate path) for
/// (dtype, cf), one accepted default entry each.
fn relay_entries(dtype: Dtype, cf: u32) -> Vec<KernelEntry> {
    Stage::ALL
        .into_iter()
        .filter(|s| *s != Stage::BwdFused && !mixstack::runtime::dispatch::needs_cublas(*s))
        .map(|s| {
            let g = if is_gemm_stage(s) {
                gemm(64, 64, 32, 4, 4)
            } else {
                Geometry::Rows { rows: 4, threads: 128, min_blocks: 1 }
            };
            entry(s, dtype, cf, g, true, true)
        })
        .collect()
}

/// Fused entries for f32 at `cf` (streaming, BLOCK_K 32 divides cf): two
/// accepted tiles and one that spills.
fn fused_entries(cf: u32) -> Vec<KernelEntry> {
    let s = Stage::BwdFused;
    vec![
        entry(s, Dtype::F32, cf, stream(64, 32, 32, 4, 4), true, false),
        entry(s, Dtype::F32, cf, stream(128, 32, 32, 8, 4), true, true),
        entry(s, Dtype::F32, cf, stream(128, 64, 32, 8, 8), false, false), // spills
    ]
}

/// A full table: relay for f32/f64 at Cf 32/64/96/128, fused f32 at 32/64.
fn full_table() -> Vec<KernelEntry> {
    let mut t = Vec::new();
    for cf in [32, 64, 96, 128] {
        t.extend(relay_entries(Dtype::F32, cf));
        t.extend(relay_entries(Dtype::F64, cf));
    }
    t.extend(fused_entries(32));
    t.extend(fused_entries(64));
    t
}

fn leak_table(t: Vec<KernelEntry>) -> &'static [KernelEntry] {
    Box::leak(t.into_boxed_slice())
}

// ----------------------------------------------------------------------
// switch
// ----------------------------------------------------------------------

#[test]
fn switch_on_spellings() {
    for v in ["1", "true", "on", "yes", "TRUE", "On", "YeS", " 1 ", "\ttrue\n", "  ON"] {
        assert_eq!(parse_switch(Some(v)).unwrap(), Request::On, "{v:?} should be on");
    }
    for v in ["always", "ALWAYS", " Always\n"] {
        assert_eq!(parse_switch(Some(v)).unwrap(), Request::Always, "{v:?} should be always");
    }
}

#[test]
fn switch_off_spellings() {
    assert_eq!(parse_switch(None).unwrap(), Request::Off, "unset is off");
    for v in ["0", "false", "off", "no", "", "   ", "FALSE", "Off", "NO", " 0\n"] {
        assert_eq!(parse_switch(Some(v)).unwrap(), Request::Off, "{v:?} should be off");
    }
}

#[test]
fn switch_garbage_is_typed_error() {
    for v in ["2", "yess", "enable", "tru", "1.0", "o n", "-1", "fused", "y", "n", "t", "f", "alway", "force"] {
        match parse_switch(Some(v)) {
            Err(MixError::InvalidSwitch { variable, value, allowed }) => {
                assert_eq!(variable, FUSED_ENV);
                assert_eq!(value, v);
                assert!(allowed.contains("yes") && allowed.contains("off") && allowed.contains("always"), "{allowed}");
            }
            other => panic!("{v:?}: expected InvalidSwitch, got {other:?}"),
        }
    }
}

#[test]
fn explicit_modes_ignore_env() {
    // These modes never read the environment, so this is safe alongside other tests.
    assert_eq!(FusedMode::On.requested().unwrap(), Request::On);
    assert_eq!(FusedMode::Always.requested().unwrap(), Request::Always);
    assert_eq!(FusedMode::Off.requested().unwrap(), Request::Off);
    assert_eq!(FusedMode::default(), FusedMode::FromEnv);
}

#[test]
fn from_env_reads_at_each_call() {
    // The only test of this binary that touches the variable.
    std::env::set_var(FUSED_ENV, "on");
    assert_eq!(FusedMode::FromEnv.requested().unwrap(), Request::On);
    std::env::set_var(FUSED_ENV, "always");
    assert_eq!(FusedMode::FromEnv.requested().unwrap(), Request::Always);
    std::env::set_var(FUSED_ENV, "0");
    assert_eq!(FusedMode::FromEnv.requested().unwrap(), Request::Off);
    std::env::set_var(FUSED_ENV, "bogus");
    assert!(matches!(FusedMode::FromEnv.requested(), Err(MixError::InvalidSwitch { .. })));
    std::env::remove_var(FUSED_ENV);
    assert_eq!(FusedMode::FromEnv.requested().unwrap(), Request::Off);
    // Explicit modes override whatever the environment holds.
    std::env::set_var(FUSED_ENV, "1");
    assert_eq!(FusedMode::Off.requested().unwrap(), Request::Off);
    std::env::remove_var(FUSED_ENV);
}

// ----------------------------------------------------------------------
// fused / relay decision
// ----------------------------------------------------------------------

/// The measured regime's lookup: a GPU with entries of its own is judged by
/// those only (every key that is a part of its name, without case), any
/// other GPU (or none) by the generic entries; the lmax range is inclusive,
/// and `None` asks for any lmax; each mode has its own entries.
#[test]
fn fused_faster_lookup() {
    let h100 = Some("NVIDIA H100 80GB HBM3");
    let h200 = Some("NVIDIA H200");
    let x = |cf, lmax, gpu| FusedFaster { cf, lmax, precision: Precision::Exact, gpu };
    let list =
        [x(32, (1, 3), Some("h100")), x(32, (4, 4), Some("H100 80GB")), x(32, (1, 6), None), x(64, (2, 2), None)];
    let at = |cf, lmax, dev| fused_faster(&list, Precision::Exact, cf, Some(lmax), dev);
    assert!(at(32, 1, h100) && at(32, 3, h100) && at(32, 4, h100), "every matching key counts");
    assert!(!at(32, 5, h100) && !at(64, 2, h100), "the H100's own entries only");
    assert!(at(32, 6, h200) && at(64, 2, h200), "generic for the H200");
    assert!(!at(64, 1, h200) && !at(64, 3, h200));
    assert!(at(32, 5, None), "no GPU: the generic entries");
    assert!(fused_faster(&list, Precision::Exact, 64, None, h200), "Cf 64 at some lmax");
    assert!(!fused_faster(&list, Precision::Exact, 64, None, h100));
    assert!(!fused_faster(&list, Precision::Fp16x3, 32, Some(2), h200), "another mode's entries");
    assert!(!fused_faster(&[], Precision::Exact, 32, Some(3), h100), "an empty regime serves nothing");
    assert!(!fused_faster(&list[..1], Precision::Exact, 32, Some(3), h200), "no generic entries: nothing elsewhere");
}

/// "On" takes the fused backward inside the dispatch's regime for its GPU
/// (here a list of the test's own, so both outcomes occur whatever
/// stages.yaml lists), the relay elsewhere (reason NotFaster, checked
/// after every kernel condition); "always" wherever the kernels serve;
/// "off" never. A dispatch without a list of its own judges by the build's.
#[test]
fn decision_on_follows_the_measured_regime() {
    let t = full_table();
    let x = |cf, lmax, gpu| FusedFaster { cf, lmax, precision: Precision::Exact, gpu };
    let list = [x(32, (1, 3), Some("H100")), x(64, (2, 2), Some("H100")), x(32, (2, 4), None)];
    for gpu in [Some("NVIDIA H100 80GB HBM3"), Some("NVIDIA H200"), None] {
        let d = Dispatch::new(&t).with_gpu(gpu).with_fused_faster(&list);
        let (mut fused, mut relay) = (0, 0);
        for cf in [32u32, 64] {
            for lmax in 1..=6u32 {
                let listed = fused_faster(&list, Precision::Exact, cf, Some(lmax), gpu);
                assert_eq!(d.fused_faster(cf, lmax), listed);
                let on = d.decide_backward_path_at(Dtype::F32, cf, lmax, Request::On);
                let always = d.decide_backward_path_at(Dtype::F32, cf, lmax, Request::Always);
                let off = d.decide_backward_path_at(Dtype::F32, cf, lmax, Request::Off);
                let what = format!("{gpu:?} cf {cf} lmax {lmax}");
                assert_eq!((always.path, always.reason), (Path::Fused, Reason::Requested), "{what}");
                assert_eq!((off.path, off.reason), (Path::Relay, Reason::NotRequested), "{what}");
                if listed {
                    fused += 1;
                    assert_eq!((on.path, on.reason), (Path::Fused, Reason::Requested), "{what}");
                } else {
                    relay += 1;
                    assert_eq!(
                        (on.path, on.reason),
                        (Path::Relay, Reason::NotFaster { cf, lmax: Some(lmax) }),
                        "{what}"
                    );
                    assert!(on.reason.to_string().contains("always"), "{}", on.reason);
                }
            }
            // Without an lmax: "on" if the regime lists Cf at any lmax.
            let any = fused_faster(&list, Precision::Exact, cf, None, gpu);
            let on = d.decide_backward_path(Dtype::F32, cf, Request::On);
            let want = if any {
                (Path::Fused, Reason::Requested)
            } else {
                (Path::Relay, Reason::NotFaster { cf, lmax: None })
            };
            assert_eq!((on.path, on.reason), want, "{gpu:?} cf {cf}");
        }
        // The H100 by its own entries (4 points), the others by the generic one (3).
        let want_fused = if gpu.is_some_and(|g| g.contains("H100")) { 4 } else { 3 };
        assert_eq!((fused, relay), (want_fused, 12 - want_fused), "{gpu:?}");
        // In another mode the exact entries do not count.
        let x3 = d.with_precision(Precision::Fp16x3);
        assert!(!x3.fused_faster(32, 3), "{gpu:?}");
        // Kernel conditions come first: Cf 96 and f64 say why the kernels cannot serve.
        let on = d.decide_backward_path_at(Dtype::F32, 96, 3, Request::On);
        assert_eq!(on.reason, Reason::CfTooLarge { cf: 96, limit: FUSED_CF_LIMIT });
        assert_eq!(d.decide_backward_path_at(Dtype::F64, 32, 3, Request::On).reason, Reason::Dtype(Dtype::F64));
    }
    // The build's regime by default: its first entry, on a device of its GPU
    // name, is seen; and it agrees with the lookup elsewhere.
    if let Some(x) = table::FUSED_FASTER.iter().find(|x| x.precision == Precision::Exact) {
        let device: Option<&'static str> = x.gpu.map(|g| &*Box::leak(format!("NVIDIA {g}").into_boxed_str()));
        assert!(Dispatch::new(&t).with_gpu(device).fused_faster(x.cf, x.lmax.0), "{x:?}");
    }
    for (cf, lmax) in [(32, 1), (32, 3), (32, 4), (64, 2)] {
        let gpu = Some("NVIDIA H100 80GB HBM3");
        let built = fused_faster(&table::FUSED_FASTER, Precision::Exact, cf, Some(lmax), gpu);
        assert_eq!(Dispatch::new(&t).with_gpu(gpu).fused_faster(cf, lmax), built);
    }
}

#[test]
fn decision_fused_when_requested_f32_cf32() {
    let t = full_table();
    for cf in [32, 64] {
        let d = decide_backward_path(&t, Dtype::F32, cf, Request::Always);
        assert_eq!(d.path, Path::Fused, "cf {cf}: {d}");
        assert_eq!(d.reason, Reason::Requested);
    }
}

#[test]
fn decision_not_requested() {
    let t = full_table();
    let d = decide_backward_path(&t, Dtype::F32, 32, Request::Off);
    assert_eq!(d.path, Path::Relay);
    assert_eq!(d.reason, Reason::NotRequested);
}

#[test]
fn decision_cf_96_128_relay() {
    let mut t = full_table();
    // Even with (hypothetical) fused kernels there, Cf >= 96 stays on the relay.
    for cf in [96, 128] {
        t.push(entry(Stage::BwdFused, Dtype::F32, cf, stream(64, 32, 32, 4, 4), true, true));
    }
    for cf in [96, 128] {
        let d = decide_backward_path(&t, Dtype::F32, cf, Request::Always);
        assert_eq!(d.path, Path::Relay);
        assert_eq!(d.reason, Reason::CfTooLarge { cf, limit: FUSED_CF_LIMIT });
        assert!(d.to_string().contains("96"), "{d}");
    }
}

#[test]
fn decision_f64_relay() {
    let t = full_table();
    let d = decide_backward_path(&t, Dtype::F64, 32, Request::Always);
    assert_eq!(d.path, Path::Relay);
    assert_eq!(d.reason, Reason::Dtype(Dtype::F64));
}

#[test]
fn decision_reason_order() {
    // Not requested wins over dtype and cf.
    let t = full_table();
    assert_eq!(decide_backward_path(&t, Dtype::F64, 128, Request::Off).reason, Reason::NotRequested);
    // Dtype wins over cf.
    assert_eq!(decide_backward_path(&t, Dtype::F64, 128, Request::Always).reason, Reason::Dtype(Dtype::F64));
}

#[test]
fn decision_spilling_only_fused_is_relay() {
    let mut t = relay_entries(Dtype::F32, 32);
    t.push(entry(Stage::BwdFused, Dtype::F32, 32, stream(64, 32, 32, 4, 4), false, true));
    let d = decide_backward_path(&t, Dtype::F32, 32, Request::Always);
    assert_eq!(d.path, Path::Relay);
    assert_eq!(d.reason, Reason::NoFusedKernel { stage: Stage::BwdFused, arch: Arch::Sm90 });
}

#[test]
fn decision_needs_a_streaming_tile_whose_block_k_divides_cf() {
    for (g, fused) in [
        (gemm(64, 32, 32, 4, 4), false),   // not streaming
        (stream(64, 32, 24, 4, 4), false), // BLOCK_K 24 does not divide 32
        (stream(64, 32, 16, 4, 4), true),
        (stream(64, 32, 32, 4, 4), true),
    ] {
        let mut t = relay_entries(Dtype::F32, 32);
        t.push(entry(Stage::BwdFused, Dtype::F32, 32, g, true, true));
        let d = decide_backward_path(&t, Dtype::F32, 32, Request::Always);
        assert_eq!(d.path == Path::Fused, fused, "{g:?}: {d}");
        if !fused {
            assert_eq!(d.reason, Reason::NoFusedKernel { stage: Stage::BwdFused, arch: Arch::Sm90 });
        }
    }
}

#[test]
fn decision_empty_table() {
    let d = decide_backward_path(&[], Dtype::F32, 32, Request::Always);
    assert_eq!(d.path, Path::Relay);
    assert_eq!(d.reason, Reason::NoFusedKernel { stage: Stage::BwdFused, arch: Arch::Sm90 });
}

// ----------------------------------------------------------------------
// kernel selection
// ----------------------------------------------------------------------

#[test]
fn select_prefers_default_among_accepted() {
    let t = full_table();
    let none = TileOverride::new();
    let e = select_kernel(&t, Stage::BwdFused, Dtype::F32, 32, 3, &none).unwrap();
    assert!(e.spec_default && e.accepted);
    assert_eq!(e.name, "ms_bwd_fused_f32_cf32_m128_n32_k32_t8x4_s2_b1_ps");
}

#[test]
fn select_names_the_shared_memory_when_no_kernel_fits() {
    // Kernels exist for the key but none fits the limit: the error says so,
    // naming the smallest and what it needs (it said "no accepted kernel").
    let none = TileOverride::new();
    let d = Dispatch::builtin().with_smem_limit(Some(1));
    match d.select(Stage::FwdM0, Dtype::F32, 32, 3, &none) {
        Err(e @ MixError::SharedMemory { bytes, limit: 1, .. }) => {
            assert!(bytes > 1, "{e}");
            assert!(e.to_string().contains("shared memory"), "{e}");
        }
        other => panic!("{other:?}"),
    }
    // A Cf without kernels stays an unsupported shape.
    assert!(matches!(
        d.select(Stage::FwdM0, Dtype::F32, 40, 3, &none),
        Err(MixError::UnsupportedShape { param: ShapeParam::Cf, .. })
    ));
}

#[test]
fn select_first_accepted_without_default() {
    let mut t = relay_entries(Dtype::F32, 32);
    t.retain(|e| e.stage != Stage::BwdGemm);
    t.push(entry(Stage::BwdGemm, Dtype::F32, 32, gemm(32, 32, 32, 4, 4), false, true)); // default, but spills
    t.push(entry(Stage::BwdGemm, Dtype::F32, 32, gemm(64, 32, 32, 4, 4), true, false));
    t.push(entry(Stage::BwdGemm, Dtype::F32, 32, gemm(128, 32, 32, 4, 4), true, false));
    let e = select_kernel(&t, Stage::BwdGemm, Dtype::F32, 32, 2, &TileOverride::new()).unwrap();
    assert_eq!(e.name, "ms_bwd_gemm_f32_cf32_m64_n32_k32_t4x4_s2_b1_pr");
}

#[test]
fn select_no_kernel_for_stage() {
    let mut t = relay_entries(Dtype::F32, 32);
    t.retain(|e| e.stage != Stage::BwdPointwise);
    let err = select_kernel(&t, Stage::BwdPointwise, Dtype::F32, 32, 2, &TileOverride::new()).unwrap_err();
    assert!(matches!(err, MixError::NoKernel { stage: Stage::BwdPointwise, dtype: Dtype::F32, cf: 32 }), "{err}");
}

#[test]
fn select_cf_without_kernels() {
    let t = full_table();
    let err = select_kernel(&t, Stage::FwdM0, Dtype::F32, 48, 2, &TileOverride::new()).unwrap_err();
    match err {
        MixError::UnsupportedShape { param: ShapeParam::Cf, value: 48, supported } => {
            assert!(supported.contains("32") && supported.contains("128"), "{supported}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn select_fused_f64_is_unsupported_dtype() {
    let t = full_table();
    let err = select_kernel(&t, Stage::BwdFused, Dtype::F64, 32, 2, &TileOverride::new()).unwrap_err();
    assert!(matches!(err, MixError::UnsupportedDtype { dtype: Dtype::F64, .. }), "{err}");
}

#[test]
fn lmax_out_of_range() {
    let t = full_table();
    let d = Dispatch::new(&t).with_lmax_range((1, 6));
    let none = TileOverride::new();
    for lmax in [0, 7, 100] {
        match d.select(Stage::FwdM0, Dtype::F32, 32, lmax, &none) {
            Err(MixError::UnsupportedShape { param: ShapeParam::Lmax, value, supported }) => {
                assert_eq!(value, lmax as u64);
                assert_eq!(supported, "1..=6");
            }
            other => panic!("lmax {lmax}: {other:?}"),
        }
    }
    for lmax in 1..=6 {
        d.select(Stage::FwdM0, Dtype::F32, 32, lmax, &none).unwrap();
    }
}

#[test]
fn override_by_name() {
    let t = full_table();
    let d = Dispatch::new(&t);
    let accepted = d.candidates(Stage::BwdFused, Dtype::F32, 64);
    assert_eq!(accepted.len(), 2, "spilling entry excluded");
    for want in &accepted {
        let tiles = TileOverride::new().with(Stage::BwdFused, want.name);
        let got = d.select(Stage::BwdFused, Dtype::F32, 64, 2, &tiles).unwrap();
        assert_eq!(got.name, want.name);
        // Other stages keep the default dispatch.
        let gemm = d.select(Stage::BwdGemm, Dtype::F32, 64, 2, &tiles).unwrap();
        assert!(gemm.spec_default);
        d.validate_override(Dtype::F32, 64, 2, &tiles).unwrap();
    }
}

#[test]
fn override_rejections() {
    let t = full_table();
    let d = Dispatch::new(&t);
    let cases: Vec<(Stage, &str, &str)> = vec![
        (Stage::BwdFused, "ms_nonexistent", "not in the kernel table"),
        (Stage::BwdFused, "ms_bwd_gemm_f32_cf32_m64_n64_k32_t4x4_s2_b1_pr", "bwd_gemm"),
        (Stage::BwdFused, "ms_bwd_fused_f32_cf64_m64_n32_k32_t4x4_s2_b1_ps", "Cf 64"),
        (Stage::BwdFused, "ms_bwd_fused_f32_cf32_m128_n64_k32_t8x8_s2_b1_ps", "not accepted"),
        (Stage::BwdGemm, "ms_bwd_gemm_f64_cf32_m64_n64_k32_t4x4_s2_b1_pr", "f64"),
    ];
    for (stage, name, why_part) in cases {
        let tiles = TileOverride::new().with(stage, name);
        let err = d.select(stage, Dtype::F32, 32, 2, &tiles).unwrap_err();
        match &err {
            MixError::BadOverride { stage: s, name: n, why, .. } => {
                assert_eq!(*s, stage);
                assert_eq!(n, name);
                assert!(why.contains(why_part), "{name}: {why}");
            }
            other => panic!("{name}: {other:?}"),
        }
        // validate_override catches it whatever stage runs.
        assert!(d.validate_override(Dtype::F32, 32, 2, &tiles).is_err());
    }
}

#[test]
fn forward_overrides_name_forward_stages_only() {
    let t = full_table();
    let d = Dispatch::new(&t);
    let m0 = d.select(Stage::FwdM0, Dtype::F32, 32, 2, &TileOverride::new()).unwrap();
    let ok = TileOverride::new().with(Stage::FwdM0, m0.name);
    d.validate_forward_override(Dtype::F32, 32, 2, &ok).unwrap();
    let gemm = d.select(Stage::BwdGemm, Dtype::F32, 32, 2, &TileOverride::new()).unwrap();
    let bad = ok.with(Stage::BwdGemm, gemm.name);
    d.validate_override(Dtype::F32, 32, 2, &bad).unwrap(); // a valid name for its stage...
    match d.validate_forward_override(Dtype::F32, 32, 2, &bad) {
        // ...but not one a forward call runs
        Err(MixError::BadOverride { stage: Stage::BwdGemm, why, .. }) => assert!(why.contains("forward"), "{why}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn report_lists_every_key() {
    let t = full_table();
    let r = Dispatch::new(&t).with_lmax_range((1, 6)).report();
    // (9 relay stages x 2 dtypes x 4 cfs + 1 fused stage x 2 cfs) x 6 lmax.
    assert_eq!(r.len(), (9 * 2 * 4 + 2) * 6);
    let fused = r.iter().find(|c| c.stage == Stage::BwdFused && c.cf == 64 && c.lmax == 3).unwrap();
    assert_eq!(fused.chosen, Some("ms_bwd_fused_f32_cf64_m128_n32_k32_t8x4_s2_b1_ps"));
    assert_eq!((fused.candidates, fused.total), (2, 3));
    // sorted by key
    let keys: Vec<_> = r.iter().map(|c| (c.stage, c.dtype, c.cf, c.lmax)).collect();
    let mut sorted = keys.clone();
    sorted.sort();
    assert_eq!(keys, sorted);

    let mut t2 = relay_entries(Dtype::F32, 32);
    t2.push(entry(Stage::BwdFused, Dtype::F32, 32, stream(64, 32, 32, 4, 4), false, true));
    let r2 = dispatch_report(&t2);
    let f = r2.iter().find(|c| c.stage == Stage::BwdFused).unwrap();
    assert_eq!(f.chosen, None);
    assert_eq!((f.candidates, f.total), (0, 1));
}

#[test]
fn tile_precedence_is_one_rule() {
    use mixstack::kinds::preferred;
    // the default among the usable, wherever it stands; else the first usable
    assert_eq!(preferred([1, 2, 3], |c| c == 2), Some(2));
    assert_eq!(preferred([1, 2, 3], |c| c == 9), Some(1));
    assert_eq!(preferred(std::iter::empty::<u32>(), |_| true), None);
    // the runtime applies it to its candidates: a default that does not fit
    // the shared memory at this lmax gives way to the first that does
    let mut t = relay_entries(Dtype::F32, 32);
    let mut big = entry(Stage::BwdFused, Dtype::F32, 32, stream(128, 64, 32, 8, 8), true, true);
    big.smem_fixed = 200_000;
    let small = entry(Stage::BwdFused, Dtype::F32, 32, stream(64, 32, 32, 4, 4), true, false);
    let (big_name, small_name) = (big.name, small.name);
    t.extend([big, small]);
    let none = TileOverride::new();
    let pick = |limit| Dispatch::new(&t).with_smem_limit(Some(limit)).select(Stage::BwdFused, Dtype::F32, 32, 3, &none);
    assert_eq!(pick(250_000).unwrap().name, big_name);
    assert_eq!(pick(100_000).unwrap().name, small_name);
}

#[test]
fn smem_limit_filters_per_lmax() {
    let mut t = relay_entries(Dtype::F32, 32);
    // big: 40000 + 1100 * L*Cf bytes; small: 1000 + 100 * L*Cf.
    let mut big = entry(Stage::BwdFused, Dtype::F32, 32, stream(128, 64, 32, 8, 8), true, true);
    big.smem_fixed = 40_000;
    big.smem_per_lg = 1100;
    let mut small = entry(Stage::BwdFused, Dtype::F32, 32, stream(64, 32, 32, 4, 4), true, false);
    small.smem_fixed = 1000;
    small.smem_per_lg = 100;
    let (big_name, small_name) = (big.name, small.name);
    t.extend([big, small]);
    let limit = 232_448u64; // sm_90 opt-in
    let d = Dispatch::new(&t).with_smem_limit(Some(limit));
    let none = TileOverride::new();
    let mut saw_both = (false, false);
    for lmax in 1..=6u32 {
        let need = 40_000 + 1100 * 32 * lmax as u64;
        let got = d.select(Stage::BwdFused, Dtype::F32, 32, lmax, &none).unwrap().name;
        let want = if need <= limit { big_name } else { small_name };
        assert_eq!(got, want, "lmax {lmax}");
        if want == big_name {
            saw_both.0 = true
        } else {
            saw_both.1 = true
        }
    }
    assert_eq!(saw_both, (true, true));
    // A tighter limit: big never fits, and overriding to it is rejected.
    let d = d.with_smem_limit(Some(60_000));
    let tiles = TileOverride::new().with(Stage::BwdFused, big_name);
    match d.select(Stage::BwdFused, Dtype::F32, 32, 1, &tiles) {
        Err(MixError::BadOverride { why, .. }) => assert!(why.contains("shared memory"), "{why}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(d.select(Stage::BwdFused, Dtype::F32, 32, 1, &none).unwrap().name, small_name);
    // Nothing fits at all: the fused decision at that lmax is relay.
    let d = d.with_smem_limit(Some(1000));
    let dec = d.decide_backward_path_at(Dtype::F32, 32, 2, Request::Always);
    assert_eq!(dec.path, Path::Relay);
    assert_eq!(dec.reason, Reason::NoFusedKernel { stage: Stage::BwdFused, arch: Arch::Sm90 });
    // The lmax-free decision ignores the limit.
    assert_eq!(d.decide_backward_path(Dtype::F32, 32, Request::Always).path, Path::Fused);
}

#[test]
fn builtin_choice_is_the_builds_dispatch_table() {
    // The runtime's rule over the build's table, at the arch's limit, picks
    // exactly the rows the build wrote into its manifest (one rule).
    let m: mixstack_gen::embed::Manifest = serde_json::from_str(table::BUILD_MANIFEST_JSON).unwrap();
    assert!(!m.dispatch.is_empty());
    assert_eq!(m.archs, table::ARCHS);
    let none = TileOverride::new();
    // Each row names an instance of its own mode, and the runtime in that
    // mode reproduces it.
    for r in &m.dispatch {
        let e = table::KERNELS.iter().find(|e| e.name == r.instance && e.arch == r.arch).unwrap();
        assert_eq!(e.geometry.precision(), r.precision, "{}", r.instance);
    }
    assert!(m.dispatch.iter().any(|r| r.precision == Precision::Fp16x3));
    for r in &m.dispatch {
        let d = Dispatch::builtin()
            .with_arch(r.arch)
            .with_smem_limit(Some(r.arch.max_smem() as u64))
            .with_precision(r.precision);
        let got = d.select(r.stage, r.dtype, r.cf, r.lmax, &none).unwrap();
        let key = format!("{} {} {} cf {} lmax {}", r.arch, r.stage, r.dtype, r.cf, r.lmax);
        assert_eq!(got.name, r.instance, "{key}");
        assert_eq!(got.arch, r.arch, "{key}");
        assert!(got.accepted);
        // and without a limit set, the arch's applies
        let d = Dispatch::builtin().with_arch(r.arch).with_precision(r.precision);
        assert_eq!(d.default_for(r.stage, r.dtype, r.cf, r.lmax).unwrap().name, r.instance, "{key}");
    }
    // Every arch has rows, and only the fused stage may lack them on one.
    for &arch in table::ARCHS {
        let stages: std::collections::BTreeSet<Stage> =
            m.dispatch.iter().filter(|r| r.arch == arch).map(|r| r.stage).collect();
        for s in Stage::ALL.into_iter().filter(|s| *s != Stage::BwdFused) {
            assert!(stages.contains(&s), "{arch}: no dispatch row for {s}");
        }
    }
}

#[test]
fn builtin_table_is_consistent() {
    // Whatever build.rs generated, on every target arch: the default choice
    // of every key is accepted, of that arch, and its geometry is
    // self-consistent.
    for &arch in table::ARCHS {
        let d = Dispatch::builtin().with_arch(arch);
        for c in d.report() {
            if let Some(name) = c.chosen {
                let e = d.by_name(name).unwrap();
                assert!(e.accepted && e.arch == arch, "{arch} {name}");
                let lg = (c.lmax * c.cf) as usize;
                launch_config(e, 1000, 128, 2, lg, None).unwrap_or_else(|err| panic!("{arch} {name}: {err}"));
            }
        }
    }
}

#[test]
fn builtin_table_serves_every_shape() {
    // Every target arch at its flagship's shared memory, every Cf the
    // project supports, every lmax, both dtypes: a stack can be built (CPU
    // part); f32 Cf 32/64 takes the fused path at every lmax where the arch
    // has fused kernels (sm_90), the relay elsewhere.
    if table::KERNELS.is_empty() {
        println!("SKIPPED (empty kernel table): builtin_table_serves_every_shape");
        return;
    }
    for &arch in table::ARCHS {
        let d = Dispatch::builtin().with_arch(arch).with_smem_limit(Some(arch.max_smem() as u64));
        let fused_here = arch == Arch::Sm90;
        let (lo, hi) = d.lmax_range();
        for cf in [32usize, 64, 96, 128] {
            for lmax in lo as usize..=hi as usize {
                let s = StackShape::new(2, cf, lmax, 3);
                validate_shape::<f32>(&d, &s).unwrap_or_else(|e| panic!("{arch} f32 {s:?}: {e}"));
                validate_shape::<f64>(&d, &s).unwrap_or_else(|e| panic!("{arch} f64 {s:?}: {e}"));
                let dec = d.decide_backward_path_at(Dtype::F32, cf as u32, lmax as u32, Request::Always);
                let want = if (cf as u32) < FUSED_CF_LIMIT && fused_here { Path::Fused } else { Path::Relay };
                assert_eq!(dec.path, want, "{arch} Cf {cf} lmax {lmax}: {dec}");
            }
        }
    }
}

// ----------------------------------------------------------------------
// shape validation (CPU part of Stack::new)
// ----------------------------------------------------------------------

#[test]
fn validate_shape_params() {
    let t = leak_table(full_table());
    let d = Dispatch::new(t).with_lmax_range((1, 6));
    validate_shape::<f32>(&d, &StackShape::new(2, 32, 3, 3)).unwrap();
    validate_shape::<f64>(&d, &StackShape::new(1, 128, 6, 1)).unwrap();
    let param = |s: StackShape| match validate_shape::<f32>(&d, &s) {
        Err(MixError::UnsupportedShape { param, .. }) => param,
        other => panic!("{s:?}: {other:?}"),
    };
    assert_eq!(param(StackShape::new(0, 32, 3, 3)), ShapeParam::F);
    assert_eq!(param(StackShape::new(70_000, 32, 3, 3)), ShapeParam::F);
    assert_eq!(param(StackShape::new(2, 40, 3, 3)), ShapeParam::Cf);
    assert_eq!(param(StackShape::new(2, 32, 0, 3)), ShapeParam::Lmax);
    assert_eq!(param(StackShape::new(2, 32, 7, 3)), ShapeParam::Lmax);
    assert_eq!(param(StackShape::new(2, 32, 3, 0)), ShapeParam::NLayers);
    // Bounded: a shape `supports` accepts is one a stack can be made with
    // and a call can plan (1 << 40 layers passed before, to fail later).
    validate_shape::<f32>(&d, &StackShape::new(2, 32, 3, MAX_LAYERS)).unwrap();
    for n in [MAX_LAYERS + 1, 1 << 40, usize::MAX] {
        assert_eq!(param(StackShape::new(2, 32, 3, n)), ShapeParam::NLayers);
    }
}

#[test]
fn shape_arithmetic() {
    let s = StackShape::new(2, 32, 3, 3);
    assert_eq!((s.m0(), s.m1(), s.row(), s.lg(), s.gated()), (128, 192, 320, 96, 2));
    assert_eq!(s.w0_len(), Some(3 * 2 * 128 * 128));
    assert_eq!(s.gw_len(), Some(2 * 2 * 32 * 96));
    assert_eq!(s.edges_from("u0", 2 * 320 * 77).unwrap(), 77);
    assert_eq!(s.edges_from("u0", 0).unwrap(), 0);
    assert!(matches!(
        s.edges_from("u0", 2 * 320 * 77 + 1),
        Err(MixError::BufferNotMultiple { tensor: "u0", unit: 640, .. })
    ));
    assert!(matches!(s.z_all_len(usize::MAX / 4), Err(MixError::SizeOverflow { .. })));
    assert!(s.check_edges(646_000, 4).is_ok());
    // E itself is bounded (the steps of a call are planned ahead)...
    assert!(s.check_edges(MAX_EDGES, 8).is_ok());
    for e in [MAX_EDGES + 1, usize::MAX / 1000] {
        assert!(matches!(s.check_edges(e, 8), Err(MixError::UnsupportedShape { param: ShapeParam::E, .. })));
    }
    // ...and within it the byte sizes of a large shape still overflow.
    let big = StackShape::new(65_535, 128, 6, MAX_LAYERS);
    assert!(matches!(big.check_edges(MAX_EDGES, 8), Err(MixError::SizeOverflow { .. })));
    // Sizes of shapes no stack accepts saturate into refusals, not panics.
    let absurd = StackShape::new(usize::MAX, usize::MAX / 2, usize::MAX, usize::MAX);
    assert_eq!((absurd.w0_len(), absurd.w1_len(), absurd.gw_len()), (None, None, None));
    assert!(absurd.surface_len(1).is_err() && absurd.check_edges(1, 4).is_err());
    assert!(absurd.edges_from("u0", 640).is_err());
}

#[test]
fn a_cap_that_cuts_a_call_into_too_many_chunks_is_refused() {
    use mixstack::runtime::chunk::{plan, Chunking, MAX_CHUNKS};
    // The seed's edges at 4,228 bytes a row: a cap of one row would plan
    // 2 x 646,000 chunks (23 million steps). The bound is per call: F foci
    // share it.
    let e = 646_000;
    let smallest = (e as u64).div_ceil(MAX_CHUNKS / 2);
    match plan(2, e, 4228, 4228, 1, 4300) {
        Err(MixError::ScratchCap { min_rows, .. }) => assert_eq!(min_rows, smallest),
        other => panic!("{other:?}"),
    }
    assert_eq!(plan(2, e, 4228, 4228, 1, smallest * 4228).unwrap(), Chunking::Chunks { rows: smallest as usize });
    // Granules (cuBLAS pieces) round the smallest chunk up.
    match plan(1, 65_536 * 32_768 + 1, 100, 100, 32_768, 32_768 * 100) {
        Err(MixError::ScratchCap { min_rows, .. }) => assert_eq!(min_rows, 32_768 * 2),
        other => panic!("{other:?}"),
    }
    // Small calls chunk as finely as the cap says.
    assert_eq!(plan(1, 2001, 64, 64, 1, 64 * 100).unwrap(), Chunking::Chunks { rows: 100 });
    // Many foci: fewer pieces each (F 1,000 at E 60,000 and a one-row cap
    // would have planned 60 million chunks).
    match plan(1000, 60_000, 8, 8, 1, 8) {
        Err(MixError::ScratchCap { min_rows, .. }) => assert_eq!(min_rows, 60_000u64.div_ceil(MAX_CHUNKS / 1000)),
        other => panic!("{other:?}"),
    }
    // At most F foci: whole foci are always allowed.
    assert_eq!(plan(65_535, 100, 8, 8, 1, 800).unwrap(), Chunking::Chunks { rows: 100 });
}

// ----------------------------------------------------------------------
// launch geometry
// ----------------------------------------------------------------------

#[test]
fn geometry_gemm() {
    let mut e = entry(Stage::BwdFused, Dtype::F32, 32, gemm(128, 32, 32, 8, 4), true, true);
    e.smem_per_lg = 8;
    e.smem_fixed = 1000;
    let cfg = launch_config(&e, 333, 128, 2, 96, None).unwrap();
    assert_eq!(cfg.block_dim, (128, 1, 1)); // (128/8)*(32/4)
    assert_eq!(cfg.grid_dim, (12, 1, 2)); // ceil(333/128) * ceil(128/32), flat; F
    assert_eq!(cfg.shared_mem_bytes, 1000 + 8 * 96);
    let cfg = launch_config(&e, 1, 192, 3, 96, None).unwrap();
    assert_eq!(cfg.grid_dim, (6, 1, 3));
}

#[test]
fn geometry_wgmma_keeps_each_block_on_one_column_tile() {
    // 66 resident blocks per focus: N = 256 has 4 column tiles, so 64 blocks
    // (each stays on one column tile, and its B panel is split once).
    let g = Geometry::Gemm {
        block_m: 128,
        bn: 64,
        block_k: 32,
        tm: 8,
        tn: 4,
        stages: 4,
        min_blocks: 1,
        pipe: mixstack::kinds::Pipe::Wgmma,
        precision: Precision::Fp16x3,
        regs: 0,
    };
    let e = entry(Stage::BwdGemm, Dtype::F32, 32, g, true, true);
    assert_eq!(e.threads, 256);
    assert_eq!(launch_config(&e, 646_000, 256, 2, 128, Some(132)).unwrap().grid_dim, (64, 1, 2));
    assert_eq!(launch_config(&e, 646_000, 192, 2, 96, Some(132)).unwrap().grid_dim, (66, 1, 2));
    // fewer tiles than blocks: one block a tile, as every pipe
    assert_eq!(launch_config(&e, 100, 256, 2, 128, Some(132)).unwrap().grid_dim, (4, 1, 2));
    // fewer resident blocks than column tiles: what there is
    assert_eq!(launch_config(&e, 646_000, 320, 1, 160, Some(3)).unwrap().grid_dim, (3, 1, 1));
    // bn 128: still a warpgroup per 64 rows; N 192 is two column blocks
    let wide = match g {
        Geometry::Gemm { block_m, block_k, tm, tn, stages, min_blocks, pipe, precision, regs, .. } => {
            Geometry::Gemm { block_m, bn: 128, block_k, tm, tn, stages, min_blocks, pipe, precision, regs }
        }
        _ => unreachable!(),
    };
    let e = entry(Stage::BwdGemm, Dtype::F32, 32, wide, true, true);
    assert_eq!((wide.threads(), e.threads), (256, 256));
    assert_eq!(launch_config(&e, 646_000, 192, 2, 96, Some(132)).unwrap().grid_dim, (66, 1, 2));
    assert_eq!(launch_config(&e, 646_000, 128, 2, 64, Some(132)).unwrap().grid_dim, (66, 1, 2));
    assert_eq!(launch_config(&e, 646_000, 192, 1, 96, Some(67)).unwrap().grid_dim, (66, 1, 1));
}

#[test]
fn geometry_fused_walks_row_blocks() {
    // The fused stage is launched with n = 0: one work item per row block
    // (its blocks walk both segments of each), at most the resident blocks.
    let e = entry(Stage::BwdFused, Dtype::F32, 32, stream(64, 64, 16, 8, 4), true, true);
    assert_eq!(e.threads, 128);
    let cfg = launch_config(&e, 646_000, 0, 2, 96, Some(528)).unwrap();
    assert_eq!(cfg.grid_dim, (264, 1, 2));
    // 333 edges: 6 row blocks per focus, one block each.
    let cfg = launch_config(&e, 333, 0, 2, 96, Some(528)).unwrap();
    assert_eq!(cfg.grid_dim, (6, 1, 2));
    // unknown residency: one block per row block
    let cfg = launch_config(&e, 646_000, 0, 1, 96, None).unwrap();
    assert_eq!(cfg.grid_dim, (646_000u32.div_ceil(64), 1, 1));
}

#[test]
fn geometry_stream_launches_at_most_the_resident_blocks() {
    let g = Geometry::Gemm {
        block_m: 128,
        bn: 64,
        block_k: 32,
        tm: 8,
        tn: 4,
        stages: 3,
        min_blocks: 2,
        pipe: mixstack::kinds::Pipe::Stream,
        precision: Precision::Exact,
        regs: 0,
    };
    let e = entry(Stage::BwdGemm, Dtype::F32, 32, g, true, true);
    // 646,000 edges, N = 192: 5047 * 3 tiles per focus; 264 resident blocks over F = 2.
    let cfg = launch_config(&e, 646_000, 192, 2, 96, Some(264)).unwrap();
    assert_eq!(cfg.grid_dim, (132, 1, 2));
    // fewer tiles than resident blocks: one block per tile
    let cfg = launch_config(&e, 333, 192, 2, 96, Some(264)).unwrap();
    assert_eq!(cfg.grid_dim, (9, 1, 2));
    // fewer resident blocks than focus streams: still one block per focus
    let cfg = launch_config(&e, 646_000, 192, 3, 96, Some(2)).unwrap();
    assert_eq!(cfg.grid_dim, (1, 1, 3));
    // unknown residency: one block per tile
    let cfg = launch_config(&e, 646_000, 192, 2, 96, None).unwrap();
    assert_eq!(cfg.grid_dim, (5047 * 3, 1, 2));
}

#[test]
fn geometry_rows() {
    let e =
        entry(Stage::BwdPointwise, Dtype::F64, 64, Geometry::Rows { rows: 4, threads: 256, min_blocks: 1 }, true, true);
    let cfg = launch_config(&e, 77, 0, 1, 128, None).unwrap();
    assert_eq!(cfg.block_dim, (256, 1, 1));
    assert_eq!(cfg.grid_dim, (20, 1, 1));
    assert_eq!(cfg.shared_mem_bytes, 0);
}

#[test]
fn geometry_grid_too_large() {
    let e =
        entry(Stage::BwdPointwise, Dtype::F32, 32, Geometry::Rows { rows: 1, threads: 32, min_blocks: 1 }, true, true);
    let err = launch_config(&e, 1 << 31, 0, 1, 96, None).unwrap_err();
    assert!(matches!(err, MixError::GridTooLarge { e: 2147483648, .. }), "{err}");
    launch_config(&e, (1 << 31) - 1, 0, 1, 96, None).unwrap();
}

#[test]
fn geometry_inconsistent_entry() {
    let mut e = entry(Stage::BwdGemm, Dtype::F32, 32, gemm(64, 64, 32, 4, 4), true, true);
    e.threads = 128; // should be 256
    assert!(matches!(launch_config(&e, 10, 128, 1, 96, None), Err(MixError::TableInconsistent { .. })));
}

#[test]
fn scratch_cap_spellings() {
    use mixstack::runtime::chunk::parse_cap;
    for (v, want) in [("123", 123u64), (" 64K ", 65536), ("8g", 8 << 30), ("2M", 2 << 20), ("1T", 1 << 40)] {
        assert_eq!(parse_cap(v).unwrap(), want, "{v:?}");
    }
    for bad in ["", "0", "0G", "-1", "1.5G", "G", "12Q", "99999999999T", "8 G"] {
        match parse_cap(bad) {
            Err(MixError::InvalidSwitch { variable, .. }) => assert_eq!(variable, "MIXSTACK_SCRATCH_CAP"),
            other => panic!("{bad:?}: expected InvalidSwitch, got {other:?}"),
        }
    }
}

#[test]
fn chunk_plan_bounds_scratch() {
    use mixstack::runtime::chunk::{plan, windows, Chunking};
    // fits: whole
    assert_eq!(plan(2, 1000, 10, 12, 1, 20_000).unwrap(), Chunking::Whole);
    // one byte over: one focus at a time, as many rows as the cap holds
    assert_eq!(plan(2, 1000, 10, 12, 1, 19_999).unwrap(), Chunking::Chunks { rows: 1000 });
    assert_eq!(plan(2, 1000, 10, 12, 1, 1_200).unwrap(), Chunking::Chunks { rows: 100 });
    assert_eq!(plan(2, 1000, 10, 12, 1, 1_211).unwrap(), Chunking::Chunks { rows: 100 });
    // below one row: a typed error naming the numbers
    match plan(2, 1000, 10, 12, 1, 11) {
        Err(MixError::ScratchCap { cap: 11, min_rows: 1, row_bytes: 12 }) => {}
        other => panic!("expected ScratchCap, got {other:?}"),
    }
    // a granule: chunks shorter than a focus hold a multiple of it
    assert_eq!(plan(2, 1000, 10, 12, 64, 1_200).unwrap(), Chunking::Chunks { rows: 64 });
    assert_eq!(plan(2, 1000, 10, 12, 64, 12 * 700).unwrap(), Chunking::Chunks { rows: 640 });
    // a whole focus fits: the granule does not matter
    assert_eq!(plan(2, 1000, 10, 12, 4096, 12_000).unwrap(), Chunking::Chunks { rows: 1000 });
    // below one granule (or the whole focus, if shorter): refused
    match plan(2, 1000, 10, 12, 64, 12 * 63) {
        Err(MixError::ScratchCap { min_rows: 64, .. }) => {}
        other => panic!("expected ScratchCap, got {other:?}"),
    }
    match plan(2, 50, 10, 12, 64, 12 * 49) {
        Err(MixError::ScratchCap { min_rows: 50, .. }) => {}
        other => panic!("expected ScratchCap, got {other:?}"),
    }
    // sizes that overflow u64 chunk rather than wrap
    assert!(matches!(plan(usize::MAX, 1 << 20, 8, 8, 1, 1 << 30).unwrap(), Chunking::Chunks { rows: 1_048_576 }));
    // no scratch, no edges: whole
    assert_eq!(plan(2, 1000, 0, 0, 1, 0).unwrap(), Chunking::Whole);
    assert_eq!(plan(2, 0, 10, 10, 1, 0).unwrap(), Chunking::Whole);
    // windows cover every row once, in order
    let w: Vec<_> = windows(10, 4).collect();
    assert_eq!(w, vec![(0, 4), (4, 4), (8, 2)]);
    assert_eq!(windows(3, 7).collect::<Vec<_>>(), vec![(0, 3)]);
}

/// Stage roles and the regime come from specs/stages.yaml (generated into
/// the table), and say what the pipeline needs.
#[test]
fn stage_roles_come_from_the_spec() {
    use mixstack::runtime::dispatch::{forward_stages, fused_stages, is_gated_stage, needs_cublas, relay_stages};
    assert_eq!(forward_stages(), vec![Stage::FwdM0, Stage::FwdGate, Stage::FwdGateAct, Stage::FwdM1, Stage::FwdFinal]);
    assert_eq!(
        relay_stages(),
        vec![
            Stage::BwdGradAlpha,
            Stage::BwdFinal,
            Stage::BwdRecompute,
            Stage::BwdPointwise,
            Stage::BwdGlogit,
            Stage::BwdGemm
        ]
    );
    assert_eq!(fused_stages(), vec![Stage::BwdFused]);
    let gated: Vec<Stage> = Stage::ALL.into_iter().filter(|s| is_gated_stage(*s)).collect();
    assert!(!gated.contains(&Stage::FwdFinal) && !gated.contains(&Stage::BwdFinal) && gated.contains(&Stage::BwdFused));
    let cublas: Vec<Stage> = Stage::ALL.into_iter().filter(|s| needs_cublas(*s)).collect();
    assert_eq!(cublas, vec![Stage::FwdGateAct, Stage::BwdGlogit]);
    let specs = mixstack_gen::spec::load(&std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("specs")).unwrap();
    assert_eq!(FUSED_CF_LIMIT, specs.stages.regime.fused_cf_below);
    assert_eq!(table::CUBLAS_GATE_FROM_CF, specs.stages.regime.cublas_gate_from_cf);
    assert_eq!(table::STAGE_ROLES.to_vec(), specs.roles());
    type Row = (u32, (u32, u32), Precision, Option<String>);
    let listed: Vec<Row> =
        table::FUSED_FASTER.iter().map(|x| (x.cf, x.lmax, x.precision, x.gpu.map(String::from))).collect();
    let spec: Vec<Row> = specs
        .stages
        .regime
        .fused_faster
        .iter()
        .map(|x| (x.cf, (x.lmax[0], x.lmax[1]), x.precision, x.gpu.clone()))
        .collect();
    assert_eq!(listed, spec, "the generated regime is stages.yaml's");
}

/// The chain of defaults: the device's own (tiles.yaml `gpu`), the generic
/// one, the first usable; and which link chose.
#[test]
fn gpu_defaults_chain() {
    use mixstack::kinds::{gpu_matches, preferred_ranked};
    use mixstack::runtime::dispatch::DefaultReason;
    assert_eq!(preferred_ranked([5, 6, 7], |c| if c == 7 { 0 } else { 1 }), Some(7));
    assert_eq!(preferred_ranked([5, 6, 7], |_| 2), Some(5));
    assert!(gpu_matches("h200", "NVIDIA H200") && gpu_matches(" H100 ", "NVIDIA H100 80GB HBM3"));
    assert!(!gpu_matches("H200", "NVIDIA H100"));

    let mut t = relay_entries(Dtype::F32, 32);
    let generic = entry(Stage::BwdFused, Dtype::F32, 32, stream(128, 32, 32, 8, 4), true, true);
    let mut on_h200 = entry(Stage::BwdFused, Dtype::F32, 32, stream(64, 32, 32, 4, 4), true, false);
    on_h200.gpu_defaults = &["H200"];
    let mut big_on_a100 = entry(Stage::BwdFused, Dtype::F32, 32, stream(128, 64, 32, 8, 8), true, false);
    big_on_a100.gpu_defaults = &["A100"];
    big_on_a100.smem_fixed = 200_000;
    let names = (generic.name, on_h200.name);
    t.extend([generic, on_h200, big_on_a100]);
    let choose = |gpu: Option<&'static str>| {
        let d = Dispatch::new(&t).with_smem_limit(Some(150_000)).with_gpu(gpu);
        let (e, why) = d.default_with_reason(Stage::BwdFused, Dtype::F32, 32, 3).unwrap();
        (e.name, why)
    };
    assert_eq!(choose(Some("NVIDIA H200")), (names.1, DefaultReason::GpuDefault("H200")));
    assert_eq!(choose(Some("NVIDIA H100 80GB HBM3")), (names.0, DefaultReason::SpecDefault));
    assert_eq!(choose(None), (names.0, DefaultReason::SpecDefault));
    // A100's own default does not fit the shared memory: the generic one
    assert_eq!(choose(Some("NVIDIA A100-SXM4-80GB")), (names.0, DefaultReason::SpecDefault));
    // no default at all: the first in table order, said so
    let plain = [
        entry(Stage::BwdGemm, Dtype::F32, 32, gemm(64, 64, 32, 4, 4), true, false),
        entry(Stage::BwdGemm, Dtype::F32, 32, gemm(128, 64, 32, 8, 4), true, false),
    ];
    let d = Dispatch::new(&plain).with_gpu(Some("NVIDIA H100"));
    let (e, why) = d.default_with_reason(Stage::BwdGemm, Dtype::F32, 32, 3).unwrap();
    assert_eq!((e.name, why), (plain[0].name, DefaultReason::FirstUsable));
}

/// The built table's fp16x3 defaults at Cf 64 (tiles.yaml): generic, so the
/// H100 takes them beside its own exact defaults, and where the wgmma panel
/// no longer fits the shared memory (lmax 5, 6) a usable tile, said so.
#[test]
fn fp16x3_defaults_follow_the_gpu_and_the_shared_memory() {
    use mixstack::runtime::dispatch::DefaultReason;
    let pick = |gpu: &'static str, lmax: u32| {
        let d = Dispatch::builtin().with_arch(Arch::Sm90).with_precision(Precision::Fp16x3).with_gpu(Some(gpu));
        let (e, why) = d.default_with_reason(Stage::FwdM1, Dtype::F32, 64, lmax).unwrap();
        (e.name, why)
    };
    // The H100 has exact defaults of its own; the mode's are generic, measured on both.
    let h100 = "NVIDIA H100 80GB HBM3";
    for gpu in [h100, "NVIDIA H200"] {
        assert_eq!(pick(gpu, 2), ("ms_fwd_m1_f32_cf64_m192_n64_k32_t8x4_s3_b1_pg_x3", DefaultReason::SpecDefault));
    }
    let exact = Dispatch::builtin().with_arch(Arch::Sm90).with_gpu(Some(h100));
    assert!(matches!(
        exact.default_with_reason(Stage::FwdM1, Dtype::F32, 32, 3).unwrap().1,
        DefaultReason::GpuDefault(_)
    ));
    for gpu in [h100, "NVIDIA H200"] {
        let (name, why) = pick(gpu, 5);
        assert!(name.ends_with("_x3") && !name.contains("_pg"), "{gpu}: {name}");
        assert_eq!(why, DefaultReason::FirstUsable, "{gpu}");
    }
}

// ----------------------------------------------------------------------
// architectures
// ----------------------------------------------------------------------

/// The relay tiles built for sm_80 and sm_90, the fused ones for sm_90 only
/// (as tiles.yaml builds them).
fn two_arch_table() -> &'static [KernelEntry] {
    let mut t = Vec::new();
    for arch in [Arch::Sm80, Arch::Sm90] {
        t.extend(relay_entries(Dtype::F32, 32).into_iter().map(|e| KernelEntry { arch, ..e }));
    }
    t.extend(fused_entries(32));
    leak_table(t)
}

#[test]
fn dispatch_serves_the_devices_compute_capability() {
    let d = Dispatch::new(two_arch_table());
    assert_eq!(d.archs(), [Arch::Sm80, Arch::Sm90]);
    assert_eq!(d.arch(), Arch::Sm90, "without a device: the newest arch");
    let none = TileOverride::new();
    // The newest arch not newer than the device: sm_80 cubins run on 8.6 and
    // 8.9; a newer major than the newest runs its PTX (JIT).
    for (cc, want) in
        [(80, Arch::Sm80), (86, Arch::Sm80), (89, Arch::Sm80), (90, Arch::Sm90), (100, Arch::Sm90), (120, Arch::Sm90)]
    {
        let on = d.for_device(cc).unwrap();
        assert_eq!(on.arch(), want, "cc {cc}");
        for s in [Stage::BwdGemm, Stage::FwdGate, Stage::BwdFinal] {
            assert_eq!(on.select(s, Dtype::F32, 32, 3, &none).unwrap().arch, want, "cc {cc} {s}");
        }
        assert!(on.candidates(Stage::FwdM0, Dtype::F32, 32).iter().all(|e| e.arch == want));
    }
    // Older than every target: a typed error naming what the build serves.
    match d.for_device(75) {
        Err(e @ MixError::UnsupportedArch { cc: 75, .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("sm_75") && msg.contains("sm_80, sm_90"), "{msg}");
        }
        other => panic!("cc 7.5: expected UnsupportedArch, got {other:?}"),
    }
}

/// A tile that moves registers with setmaxnreg (sm_90a code) serves a
/// device of compute capability 9.0 only: on a later one, whose driver
/// would JIT the sm_90 PTX, it is no candidate, and the default falls back
/// to the rest of the key's tiles.
#[test]
fn arch_specific_tiles_serve_their_own_compute_capability_only() {
    let split = |regs| Geometry::Gemm {
        block_m: 64,
        bn: 128,
        block_k: 16,
        tm: 8,
        tn: 8,
        stages: 2,
        min_blocks: 2,
        pipe: mixstack::kinds::Pipe::Split,
        precision: Precision::Exact,
        regs,
    };
    assert!(split(192).arch_specific() && !split(0).arch_specific());
    assert_eq!(split(192).setmaxnreg(), Some((64, 192)));
    assert_eq!(split(160).setmaxnreg(), Some((96, 160)));
    assert_eq!(split(0).setmaxnreg(), None);
    let mut t: Vec<KernelEntry> = relay_entries(Dtype::F32, 32);
    t.push(entry(Stage::BwdFused, Dtype::F32, 32, split(192), true, true));
    t.extend(fused_entries(32));
    let d = Dispatch::new(leak_table(t));
    let moved = |d: &Dispatch| d.candidates(Stage::BwdFused, Dtype::F32, 32).iter().any(|e| e.geometry.arch_specific());
    assert!(moved(&d), "no device named: the arch's own");
    assert!(moved(&d.for_device(90).unwrap()));
    let hopper = d.for_device(90).unwrap().default_for(Stage::BwdFused, Dtype::F32, 32, 3).unwrap();
    assert!(hopper.geometry.arch_specific(), "the default on 9.0");
    for cc in [100, 120] {
        let later = d.for_device(cc).unwrap();
        assert_eq!(later.arch(), Arch::Sm90);
        assert!(!moved(&later), "cc {cc}");
        let e = later.default_for(Stage::BwdFused, Dtype::F32, 32, 3).unwrap();
        assert!(!e.geometry.arch_specific(), "cc {cc}: {}", e.name);
        assert_eq!(later.decide_backward_path(Dtype::F32, 32, Request::Always).path, Path::Fused, "cc {cc}");
        // named: refused, saying why (not a JIT failure at launch)
        let tiles = TileOverride::new().with(Stage::BwdFused, hopper.name);
        match later.select(Stage::BwdFused, Dtype::F32, 32, 3, &tiles) {
            Err(e @ MixError::BadOverride { .. }) => {
                let msg = e.to_string();
                assert!(msg.contains("sm_90a") && msg.contains("9.0 only"), "cc {cc}: {msg}");
            }
            other => panic!("cc {cc}: expected BadOverride, got {other:?}"),
        }
    }
    let tiles = TileOverride::new().with(Stage::BwdFused, hopper.name);
    assert_eq!(d.for_device(90).unwrap().select(Stage::BwdFused, Dtype::F32, 32, 3, &tiles).unwrap().name, hopper.name);
}

#[test]
fn fused_backward_on_an_arch_without_fused_tiles_is_the_relay() {
    let d = Dispatch::new(two_arch_table());
    let ampere = d.for_device(80).unwrap();
    let dec = ampere.decide_backward_path(Dtype::F32, 32, Request::Always);
    assert_eq!(dec.path, Path::Relay);
    assert_eq!(dec.reason, Reason::NoFusedKernel { stage: Stage::BwdFused, arch: Arch::Sm80 });
    assert!(dec.to_string().contains("sm_80"), "{dec}");
    assert_eq!(d.for_device(90).unwrap().decide_backward_path(Dtype::F32, 32, Request::Always).path, Path::Fused);
    // Naming the sm_90-only tile there is refused, saying why.
    let fused = d.for_device(90).unwrap().default_for(Stage::BwdFused, Dtype::F32, 32, 3).unwrap().name;
    let tiles = TileOverride::new().with(Stage::BwdFused, fused);
    match ampere.select(Stage::BwdFused, Dtype::F32, 32, 3, &tiles) {
        Err(e @ MixError::BadOverride { .. }) => assert!(e.to_string().contains("not built for sm_80"), "{e}"),
        other => panic!("expected BadOverride, got {other:?}"),
    }
}

#[test]
fn builtin_table_builds_every_target_arch() {
    // The specs' targets, each with its own rows; the fused stage on sm_90
    // only (its tiles use Hopper's bulk L2 prefetch).
    if table::KERNELS.is_empty() {
        println!("SKIPPED (empty kernel table): builtin_table_builds_every_target_arch");
        return;
    }
    assert_eq!(table::ARCHS, [Arch::Sm80, Arch::Sm90]);
    let d = Dispatch::builtin();
    assert_eq!(d.archs(), table::ARCHS);
    let ampere = d.for_device(80).unwrap();
    assert!(ampere.candidates(Stage::BwdFused, Dtype::F32, 32).is_empty());
    assert!(!d.candidates(Stage::BwdFused, Dtype::F32, 32).is_empty());
    for cf in [32usize, 64, 96, 128] {
        let s = StackShape::new(2, cf, 3, 3);
        validate_shape::<f32>(&ampere, &s).unwrap_or_else(|e| panic!("sm_80 f32 {s:?}: {e}"));
        validate_shape::<f64>(&ampere, &s).unwrap_or_else(|e| panic!("sm_80 f64 {s:?}: {e}"));
    }
}

/// The fp16x3 instances are in the table (built and register-checked) but
/// the runtime serves the exact mode only: no exact key picks one, and an
/// override naming one is refused, saying why.
#[test]
fn fp16x3_entries_are_never_dispatched_in_the_exact_mode() {
    // accepted ones (a rejected one is refused for its spills), so that
    // only the precision rule can keep them out below
    let x3: Vec<&KernelEntry> =
        table::KERNELS.iter().filter(|e| e.geometry.precision() == Precision::Fp16x3 && e.accepted).collect();
    assert!(!x3.is_empty(), "the build has accepted fp16x3 instances");
    for e in x3 {
        let d = Dispatch::builtin().with_arch(e.arch);
        assert!(d.candidates(e.stage, e.dtype, e.cf).iter().all(|c| c.geometry.precision() == Precision::Exact));
        let tiles = TileOverride::new().with(e.stage, e.name);
        match d.select(e.stage, e.dtype, e.cf, 3, &tiles) {
            Err(MixError::BadOverride { why, .. }) => assert!(why.contains("fp16x3"), "{}: {why}", e.name),
            other => panic!("{}: {other:?}", e.name),
        }
    }
}

// ----------------------------------------------------------------------
// the precision mode (issue 20)
// ----------------------------------------------------------------------

#[test]
fn precision_spellings() {
    assert_eq!(parse_precision(None).unwrap(), Precision::Exact, "unset is exact");
    for v in ["", "  ", "exact", "EXACT", " Exact\n"] {
        assert_eq!(parse_precision(Some(v)).unwrap(), Precision::Exact, "{v:?}");
    }
    for v in ["fp16x3", "FP16X3", " Fp16x3 "] {
        assert_eq!(parse_precision(Some(v)).unwrap(), Precision::Fp16x3, "{v:?}");
    }
    for v in ["fp16", "x3", "tf32", "bf16x3", "1", "fp16x3x", "exact fp16x3"] {
        match parse_precision(Some(v)) {
            Err(MixError::InvalidSwitch { variable, value, allowed }) => {
                assert_eq!((variable, value.as_str()), (PRECISION_ENV, v));
                assert!(allowed.contains("exact") && allowed.contains("fp16x3"), "{allowed}");
            }
            other => panic!("{v:?}: expected InvalidSwitch, got {other:?}"),
        }
    }
    assert_eq!(PrecisionMode::default(), PrecisionMode::FromEnv);
}

#[test]
fn precision_from_env_reads_at_each_call() {
    // The only test of this binary that touches the variable.
    std::env::set_var(PRECISION_ENV, "fp16x3");
    assert_eq!(PrecisionMode::FromEnv.resolve().unwrap(), Precision::Fp16x3);
    assert_eq!(PrecisionMode::Set(Precision::Exact).resolve().unwrap(), Precision::Exact, "Set ignores it");
    std::env::set_var(PRECISION_ENV, "nope");
    assert!(matches!(PrecisionMode::FromEnv.resolve(), Err(MixError::InvalidSwitch { .. })));
    std::env::remove_var(PRECISION_ENV);
    assert_eq!(PrecisionMode::FromEnv.resolve().unwrap(), Precision::Exact);
}

/// In fp16x3 the GEMM stages take that mode's kernels and the row stages
/// exact ones, the fused backward its fp16x3 tiles; a mode without kernels
/// for the call is a typed error; an override of the other mode's kernel is
/// refused.
#[test]
fn fp16x3_mode_dispatch() {
    let (cf, lmax) = (32u32, 3u32);
    let exact = Dispatch::builtin().with_arch(Arch::Sm90);
    let x3 = exact.with_precision(Precision::Fp16x3);
    assert_eq!(x3.precision(), Precision::Fp16x3);
    x3.check_precision(Dtype::F32, cf).unwrap();
    let none = TileOverride::new();
    let mut gemm_stages = 0;
    for stage in forward_stages().into_iter().chain(relay_stages()) {
        if needs_cublas(stage) {
            continue; // the cuBLAS gate path's stages: Cf >= 96 only
        }
        let e = x3.select(stage, Dtype::F32, cf, lmax, &none).unwrap_or_else(|e| panic!("{stage}: {e}"));
        match e.geometry {
            Geometry::Gemm { .. } => {
                gemm_stages += 1;
                assert_eq!(e.geometry.precision(), Precision::Fp16x3, "{stage}: {}", e.name);
                assert!(e.name.ends_with("_x3"), "{}", e.name);
                // the exact dispatch of the same key picks an exact kernel
                let ex = exact.select(stage, Dtype::F32, cf, lmax, &none).unwrap();
                assert_eq!(ex.geometry.precision(), Precision::Exact, "{}", ex.name);
                // and in fp16x3 an override naming it is refused, saying why
                match x3.select(stage, Dtype::F32, cf, lmax, &TileOverride::new().with(stage, ex.name)) {
                    Err(MixError::BadOverride { why, .. }) => {
                        assert!(why.contains("is an exact kernel") && why.contains("fp16x3"), "{why}")
                    }
                    other => panic!("{stage}: {other:?}"),
                }
            }
            Geometry::Rows { .. } => {
                assert_eq!(e.geometry.precision(), Precision::Exact, "{stage}: {}", e.name);
                assert_eq!(e.name, exact.select(stage, Dtype::F32, cf, lmax, &none).unwrap().name, "{stage}");
            }
        }
    }
    assert_eq!(gemm_stages, 5, "fwd_m0, fwd_m1, fwd_final, bwd_final, bwd_gemm run in the mode");
    let d = x3.decide_backward_path_at(Dtype::F32, cf, lmax, Request::Always);
    assert_eq!((d.path, d.reason, d.precision), (Path::Fused, Reason::Requested, Precision::Fp16x3));
    assert!(d.to_string().starts_with("fused in fp16x3 ("), "{d}");
    let fused = x3.select(Stage::BwdFused, Dtype::F32, cf, lmax, &none).unwrap();
    assert_eq!(fused.geometry.precision(), Precision::Fp16x3, "{}", fused.name);
    // the mode's chunk width is one: fused and relay fp16x3 tiles share block_k
    let relay_gemm = x3.select(Stage::BwdGemm, Dtype::F32, cf, lmax, &none).unwrap();
    assert_eq!(fused.geometry.block_k(), relay_gemm.geometry.block_k());
    let d = x3.decide_backward_path_at(Dtype::F32, cf, lmax, Request::Off);
    assert_eq!((d.reason, d.precision), (Reason::NotRequested, Precision::Fp16x3));
    assert_eq!(exact.decide_backward_path_at(Dtype::F32, cf, lmax, Request::Always).precision, Precision::Exact);
    // what the mode does not serve: f64, and an arch without its kernels
    match x3.check_precision(Dtype::F64, cf) {
        Err(MixError::UnsupportedPrecision { precision, dtype, why, .. }) => {
            assert_eq!((precision, dtype), (Precision::Fp16x3, Dtype::F64));
            assert!(why.contains("f32 only"), "{why}");
        }
        other => panic!("{other:?}"),
    }
    match x3.with_arch(Arch::Sm80).check_precision(Dtype::F32, cf) {
        Err(e @ MixError::UnsupportedPrecision { .. }) => assert!(e.to_string().contains("sm_90 only"), "{e}"),
        other => panic!("{other:?}"),
    }
    exact.with_arch(Arch::Sm80).check_precision(Dtype::F64, cf).unwrap();
}

/// A build whose fp16x3 tiles serve the relay only: the fused request in the
/// mode takes the relay, and the decision says why (and in which mode).
#[test]
fn fused_without_kernels_of_the_mode_takes_the_relay() {
    let x3 = |g: Geometry| match g {
        Geometry::Gemm { block_m, bn, block_k, tm, tn, stages, min_blocks, pipe, regs, .. } => Geometry::Gemm {
            block_m,
            bn,
            block_k,
            tm,
            tn,
            stages,
            min_blocks,
            pipe,
            precision: Precision::Fp16x3,
            regs,
        },
        rows => rows,
    };
    let mut t = relay_entries(Dtype::F32, 32);
    let extra: Vec<KernelEntry> = t
        .iter()
        .filter(|e| matches!(e.geometry, Geometry::Gemm { .. }))
        .map(|e| entry(e.stage, e.dtype, e.cf, x3(e.geometry), true, false))
        .collect();
    t.extend(extra);
    t.push(entry(Stage::BwdFused, Dtype::F32, 32, stream(64, 64, 32, 8, 4), true, true));
    let d = Dispatch::new(&t).with_precision(Precision::Fp16x3);
    d.check_precision(Dtype::F32, 32).unwrap();
    let dec = d.decide_backward_path_at(Dtype::F32, 32, 3, Request::Always);
    assert_eq!((dec.path, dec.reason), (Path::Relay, Reason::Precision(Precision::Fp16x3)));
    assert!(dec.to_string().contains("no fp16x3 kernels"), "{dec}");
    // the exact mode over the same table takes its fused tile
    assert_eq!(Dispatch::new(&t).decide_backward_path_at(Dtype::F32, 32, 3, Request::Always).path, Path::Fused);
}
