//! The plan of every call, checked on the CPU over the built kernel table:
//! for every (dtype, Cf, lmax, n_layers, F) the build serves, relay and
//! fused requested, with and without cuBLAS, whole and chunked. No GPU: a
//! plan is data (src/runtime/plan.rs).

use std::collections::BTreeMap;

use mixstack::runtime::args::StageCall;
use mixstack::runtime::chunk::Chunking;
use mixstack::runtime::dispatch::{Dispatch, Path, TileOverride};
use mixstack::runtime::error::MixError;
use mixstack::runtime::gate_blas::GATE_GEMM_ROWS;
use mixstack::runtime::plan::{Addr, Buf, Machine, Plan, Planner, Step};
use mixstack::runtime::shape::StackShape;
use mixstack::runtime::stack::validate_shape;
use mixstack::runtime::switch::Request;
use mixstack::runtime::table::{self, Dtype, Stage};

/// The H100 / H200 opt-in shared memory per block.
const SMEM_OPTIN: u64 = 232_448;
const E: usize = 1000;
const NO_CAP: u64 = u64::MAX;

fn dispatch() -> &'static Dispatch<'static> {
    Box::leak(Box::new(Dispatch::builtin().with_smem_limit(Some(SMEM_OPTIN))))
}

/// Every shape the build serves (validate_shape), over the axes that change a plan.
fn shapes(d: &Dispatch<'static>) -> Vec<(Dtype, StackShape)> {
    let mut v = Vec::new();
    let (lo, hi) = d.lmax_range();
    for dtype in [Dtype::F32, Dtype::F64] {
        for cf in d.cfs(dtype) {
            for lmax in lo..=hi {
                for n_layers in [1, 2, 3] {
                    for f in [1, 2] {
                        let sh = StackShape::new(f, cf as usize, lmax as usize, n_layers);
                        let ok = match dtype {
                            Dtype::F32 => validate_shape::<f32>(d, &sh),
                            Dtype::F64 => validate_shape::<f64>(d, &sh),
                        };
                        if ok.is_ok() {
                            v.push((dtype, sh));
                        }
                    }
                }
            }
        }
    }
    assert!(v.len() > 50, "only {} shapes served: the table looks empty", v.len());
    v
}

/// Scratch ids a step reads or writes.
fn scratch_of(step: &Step) -> Vec<usize> {
    let addrs: Vec<Addr> = match step {
        Step::Launch { call, .. } => call.pointers(),
        Step::Gemm { a, w, c, .. } => vec![*a, *w, *c],
        Step::Copy { src, dst, .. } | Step::Copy2d { src, dst, .. } => vec![*src, *dst],
        Step::Zero { dst, .. } => vec![*dst],
        Step::Alloc(_) | Step::Free(_) => vec![],
    };
    addrs
        .into_iter()
        .filter_map(|a| match a.buf {
            Buf::Scratch(i) => Some(i),
            _ => None,
        })
        .collect()
}

/// Structural checks every plan keeps: kernels of its own key, with the
/// arguments of their stage; scratch used only while allocated, freed once;
/// peak scratch within `cap`.
fn check_plan(what: &str, plan: &Plan, dtype: Dtype, sh: &StackShape, cap: u64) {
    let mut live = BTreeMap::new();
    let (mut now, mut peak) = (0u64, 0u64);
    for (i, step) in plan.steps.iter().enumerate() {
        match step {
            Step::Alloc(s) => {
                assert!(live.insert(*s, ()).is_none(), "{what}: step {i} allocates s{s} twice");
                now += (plan.scratch[*s].elems * dtype.size()) as u64;
                peak = peak.max(now);
            }
            Step::Free(s) => {
                assert!(live.remove(s).is_some(), "{what}: step {i} frees s{s}, not live");
                now -= (plan.scratch[*s].elems * dtype.size()) as u64;
            }
            Step::Launch { kernel, call, .. } => {
                assert_eq!(kernel.stage, call.stage(), "{what}: step {i}: {} with {:?}", kernel.name, call);
                assert_eq!((kernel.dtype, kernel.cf), (dtype, sh.cf as u32), "{what}: step {i}: {}", kernel.name);
                assert!(kernel.accepted, "{what}: step {i}: {} was rejected by the build", kernel.name);
            }
            _ => {}
        }
        for s in scratch_of(step) {
            assert!(live.contains_key(&s), "{what}: step {i} uses s{s} outside its allocation: {step:?}");
        }
    }
    assert!(live.is_empty(), "{what}: scratch never freed: {live:?}");
    assert!(peak <= cap, "{what}: peak scratch {peak} B over the cap {cap} B");
}

fn stages(plan: &Plan) -> Vec<Stage> {
    plan.launches().map(|(k, _)| k.stage).collect()
}

fn gemms(plan: &Plan) -> usize {
    plan.steps.iter().filter(|s| matches!(s, Step::Gemm { .. })).count()
}

#[test]
fn every_served_key_plans_forward_and_backward() {
    let mut checked = 0;
    // Every target arch, at its flagship's shared memory.
    for &arch in table::ARCHS {
        let d: &'static Dispatch<'static> =
            Box::leak(Box::new(Dispatch::builtin().with_arch(arch).with_smem_limit(Some(arch.max_smem() as u64))));
        for (dtype, sh) in shapes(d) {
            let p = Planner { shape: sh, dtype, dispatch: d };
            let gated = sh.gated();
            let blas_eligible = mixstack::runtime::plan::gate_blas_eligible(d, &sh, dtype).is_ok();
            for cublas in [false, true] {
                let machine = Machine { cublas, scratch_cap: NO_CAP };
                let blas = cublas && blas_eligible;
                let what = format!("{dtype} {sh:?} cublas {cublas}");

                let fwd = p.forward(E, true, &TileOverride::new(), &machine).unwrap();
                check_plan(&format!("forward {what}"), &fwd, dtype, &sh, NO_CAP);
                assert_eq!(fwd.chunking, Chunking::Whole);
                let gate = if blas { Stage::FwdGateAct } else { Stage::FwdGate };
                let mut want = Vec::new();
                for _ in 0..gated {
                    want.extend([Stage::FwdM0, gate, Stage::FwdM1]);
                }
                want.extend([Stage::FwdFinal, Stage::FwdFinal]);
                assert_eq!(stages(&fwd), want, "forward {what}");
                // one GEMM per focus (E < GATE_GEMM_ROWS: one piece)
                assert_eq!(gemms(&fwd), if blas { gated * sh.f } else { 0 }, "forward {what}");
                // the identity layer writes the caller's out, both segments
                let outs: Vec<Addr> = fwd
                    .launches()
                    .filter_map(|(_, c)| match c {
                        StageCall::FwdFinal(a) => Some(a.out),
                        _ => None,
                    })
                    .collect();
                assert_eq!(outs, vec![Addr::at(Buf::Out); 2], "forward {what}");

                for fused in [Request::Off, Request::On, Request::Always] {
                    let choice = p.backward_choice(fused, &TileOverride::new(), cublas).unwrap();
                    let what = format!("{what} fused requested {fused}");
                    // Judged apart from the decision: a fused kernel that fits,
                    // and for "on" the measured regime (none without a GPU name).
                    let (cf, lmax) = (sh.cf as u32, sh.lmax as u32);
                    let kernels = dtype == Dtype::F32
                        && sh.cf < 96
                        && !d.candidates_at(Stage::BwdFused, dtype, cf, lmax).is_empty();
                    let served = match fused {
                        Request::Off => false,
                        Request::On => kernels && d.fused_faster(cf, lmax),
                        Request::Always => kernels,
                    };
                    assert_eq!(choice.decision.path == Path::Fused, served, "{what}: {:?}", choice.decision);
                    let bwd = p.backward(E, true, &choice, &machine).unwrap();
                    check_plan(&format!("backward {what}"), &bwd, dtype, &sh, NO_CAP);
                    let mut want = vec![Stage::BwdGradAlpha, Stage::BwdFinal, Stage::BwdFinal];
                    let relay_blas = blas && !served;
                    for _ in 0..gated {
                        match (served, relay_blas) {
                            (true, _) => want.push(Stage::BwdFused),
                            (false, true) => want.extend([Stage::BwdGlogit, Stage::BwdGemm, Stage::BwdGemm]),
                            (false, false) => {
                                want.extend([Stage::BwdRecompute, Stage::BwdPointwise, Stage::BwdGemm, Stage::BwdGemm])
                            }
                        }
                    }
                    assert_eq!(stages(&bwd), want, "backward {what}");
                    assert_eq!(gemms(&bwd), if relay_blas { 2 * gated * sh.f } else { 0 }, "backward {what}");
                    // the last write lands in grad_u0
                    let last = bwd.launches().last().map(|(_, c)| c.clone()).unwrap();
                    let written = match last {
                        StageCall::BwdFinal(a) => a.g,
                        StageCall::BwdGemm(a) => a.g_next,
                        StageCall::BwdFused(a) => a.g_next,
                        other => panic!("backward {what}: ends with {other:?}"),
                    };
                    assert_eq!(written, Addr::at(Buf::GradU0), "backward {what}");
                    checked += 1;
                }
            }
        }
    }
    println!("{checked} backward plans checked");
}

#[test]
fn no_alpha_zeroes_grad_alpha_instead_of_launching() {
    let d = dispatch();
    let sh = StackShape::new(2, 32, 3, 3);
    let p = Planner { shape: sh, dtype: Dtype::F32, dispatch: d };
    let machine = Machine { cublas: false, scratch_cap: NO_CAP };
    let choice = p.backward_choice(Request::Off, &TileOverride::new(), false).unwrap();
    let bwd = p.backward(E, false, &choice, &machine).unwrap();
    assert_eq!(bwd.steps.iter().filter(|s| matches!(s, Step::Zero { .. })).count(), 1);
    assert!(!stages(&bwd).contains(&Stage::BwdGradAlpha));
    let Some(Step::Zero { dst, bytes }) = bwd.steps.iter().find(|s| matches!(s, Step::Zero { .. })) else { panic!() };
    assert_eq!((*dst, *bytes), (Addr::at(Buf::GradAlpha), E * 2 * 4));
}

/// Rows a chunked plan's launches cover through the byte offset `pick`
/// returns, as [start, end) rows of a focus-major (F, E, ROW) surface.
fn covered(plan: &Plan, row_bytes: u64, pick: impl Fn(&StageCall<Addr>) -> Option<u64>) -> Vec<(u64, u64)> {
    plan.steps
        .iter()
        .filter_map(|s| match s {
            Step::Launch { e, call, .. } => pick(call).map(|b| (b / row_bytes, b / row_bytes + *e as u64)),
            _ => None,
        })
        .collect()
}

fn assert_tiles(what: &str, mut spans: Vec<(u64, u64)>, total: u64) {
    spans.sort();
    let mut at = 0;
    for (a, b) in &spans {
        assert_eq!(*a, at, "{what}: rows {at}..{a} missed or overlapped: {spans:?}");
        at = *b;
    }
    assert_eq!(at, total, "{what}: rows up to {total} expected");
}

#[test]
fn chunked_plans_cover_every_row_once_within_the_cap() {
    let d = dispatch();
    for (dtype, cf, n_layers, fused) in [
        (Dtype::F32, 32, 3, false),
        (Dtype::F32, 32, 3, true),
        (Dtype::F32, 32, 2, true),
        (Dtype::F32, 64, 2, false),
        (Dtype::F64, 32, 3, false),
        (Dtype::F32, 128, 3, false),
    ] {
        let sh = StackShape::new(2, cf, 3, n_layers);
        let p = Planner { shape: sh, dtype, dispatch: d };
        let row_bytes = (sh.row() * dtype.size()) as u64;
        // cuBLAS's gate GEMMs: chunks of whole GEMM pieces (GATE_GEMM_ROWS)
        let (e, unit) = if cf >= 96 { (2 * GATE_GEMM_ROWS + 1001, GATE_GEMM_ROWS as u64 / 8) } else { (1001, 1) };
        for cap in [row_bytes * 40 * unit, row_bytes * 333 * unit, row_bytes * 5000 * unit] {
            let machine = Machine { cublas: cf >= 96, scratch_cap: cap };
            let what = format!("{dtype} Cf {cf} layers {n_layers} fused {fused} cap {cap}");
            let fwd = p.forward(e, true, &TileOverride::new(), &machine).unwrap();
            check_plan(&format!("forward {what}"), &fwd, dtype, &sh, cap);
            let request = if fused { Request::Always } else { Request::Off };
            let choice = p.backward_choice(request, &TileOverride::new(), machine.cublas).unwrap();
            let bwd = p.backward(e, true, &choice, &machine).unwrap();
            check_plan(&format!("backward {what}"), &bwd, dtype, &sh, cap);
            let total = (sh.f * e) as u64;
            match fwd.chunking {
                Chunking::Whole => {}
                Chunking::Chunks { .. } => {
                    // every row of every layer of z_all written once per layer
                    for k in 0..n_layers - 1 {
                        let base = k as u64 * total * row_bytes;
                        let spans = covered(&fwd, row_bytes, |c| match c {
                            StageCall::FwdM0(a) if a.z.byte >= base && a.z.byte < base + total * row_bytes => {
                                Some(a.z.byte - base)
                            }
                            _ => None,
                        });
                        assert_tiles(&format!("forward z layer {k} {what}"), spans, total);
                    }
                    // out leaves through pitched copies: every (edge, focus) once
                    let mut seen = vec![0u32; sh.f * e];
                    for s in &fwd.steps {
                        if let Step::Copy2d { dst, height, dst_pitch, .. } = s {
                            if dst.buf == Buf::Out {
                                let first = dst.byte / row_bytes;
                                for r in 0..*height as u64 {
                                    seen[(first + r * (*dst_pitch as u64 / row_bytes)) as usize] += 1;
                                }
                            }
                        }
                    }
                    assert!(seen.iter().all(|&n| n == 1), "forward out {what}: {seen:?}");
                }
            }
            if let Chunking::Chunks { .. } = bwd.chunking {
                assert!(n_layers > 1);
                // grad_u0: the first gated layer (k = 0, last in the walk) writes every row once
                let z0_end = total * row_bytes;
                let wt0_layer0_end = (sh.f * sh.m0() * sh.m0() * dtype.size()) as u64;
                let spans = covered(&bwd, row_bytes, |c| match c {
                    // layer 0's segment 0 (segment 1 writes the same rows)
                    StageCall::BwdGemm(a)
                        if a.g_next.buf == Buf::GradU0 && a.seg == 0 && a.wt.byte < wt0_layer0_end =>
                    {
                        Some(a.g_next.byte)
                    }
                    StageCall::BwdFused(a) if a.g_next.buf == Buf::GradU0 && a.z.byte < z0_end => Some(a.g_next.byte),
                    _ => None,
                });
                assert_tiles(&format!("backward grad_u0 {what}"), spans, total);
            }
            if cap == row_bytes * 40 * unit {
                assert!(matches!(fwd.chunking, Chunking::Chunks { .. }), "{what}: the smallest cap should chunk");
            }
        }
    }
}

#[test]
fn a_cap_below_one_row_is_a_typed_error() {
    let d = dispatch();
    let sh = StackShape::new(2, 32, 3, 3);
    let p = Planner { shape: sh, dtype: Dtype::F32, dispatch: d };
    let machine = Machine { cublas: false, scratch_cap: 16 };
    let r = p.forward(E, true, &TileOverride::new(), &machine);
    assert!(matches!(r, Err(MixError::ScratchCap { .. })), "{r:?}");
}

#[test]
fn overriding_a_cublas_stage_without_cublas_is_refused() {
    let d = dispatch();
    let sh = StackShape::new(2, 128, 3, 3);
    let p = Planner { shape: sh, dtype: Dtype::F32, dispatch: d };
    let name = d.default_for(Stage::FwdGateAct, Dtype::F32, 128, 3).expect("fwd_gate_act at Cf 128").name;
    let tiles = TileOverride::new().with(Stage::FwdGateAct, name);
    let machine = Machine { cublas: false, scratch_cap: NO_CAP };
    let r = p.forward(E, true, &tiles, &machine);
    assert!(matches!(r, Err(MixError::BadOverride { stage: Stage::FwdGateAct, .. })), "{r:?}");
    // with cuBLAS it is the kernel the plan launches
    let machine = Machine { cublas: true, scratch_cap: NO_CAP };
    let fwd = p.forward(E, true, &tiles, &machine).unwrap();
    assert!(fwd.launches().any(|(k, _)| k.name == name));
}

/// The cuBLAS gate GEMMs of a chunked call are those of the whole call:
/// one focus and one piece of GATE_GEMM_ROWS rows each, on the same rows
/// of z_all with the same GW (cuBLAS picks its kernel by size, so equal
/// sizes are what keeps chunked results bitwise those of the whole call).
#[test]
fn chunked_cublas_gate_gemms_are_the_whole_calls() {
    let d = dispatch();
    let sh = StackShape::new(2, 96, 2, 3);
    let p = Planner { shape: sh, dtype: Dtype::F32, dispatch: d };
    let e = 2 * GATE_GEMM_ROWS + 77;
    let row_bytes = (sh.row() * 4) as u64;
    let projections = |plan: &Plan| -> Vec<(Addr, Addr, usize)> {
        let mut v: Vec<_> = plan
            .steps
            .iter()
            .filter_map(|s| match s {
                Step::Gemm { a, w, c: _, e, .. } if a.buf == Buf::ZAll => Some((*a, *w, *e)),
                _ => None,
            })
            .collect();
        v.sort_by_key(|(a, w, e)| (a.byte, w.byte, *e));
        v
    };
    let sizes = |plan: &Plan| -> Vec<usize> {
        let mut v: Vec<usize> = plan
            .steps
            .iter()
            .filter_map(|s| match s {
                Step::Gemm { e, .. } => Some(*e),
                _ => None,
            })
            .collect();
        v.sort();
        v
    };
    let whole_machine = Machine { cublas: true, scratch_cap: NO_CAP };
    let choice = p.backward_choice(Request::Off, &TileOverride::new(), true).unwrap();
    assert!(choice.gate_blas);
    let fwd_whole = p.forward(e, true, &TileOverride::new(), &whole_machine).unwrap();
    let bwd_whole = p.backward(e, true, &choice, &whole_machine).unwrap();
    assert_eq!(fwd_whole.chunking, Chunking::Whole);
    assert!(sizes(&fwd_whole).iter().all(|&n| n <= GATE_GEMM_ROWS));
    // 2 foci x 2 gated layers x 3 pieces
    assert_eq!(projections(&fwd_whole).len(), 12);
    // a chunk's row takes 3.3 rows of scratch forward, 2.6 backward (the
    // whole call's: 2.3 per focus): one piece, two pieces, one focus a chunk
    for rows_cap in [GATE_GEMM_ROWS as u64, 2 * GATE_GEMM_ROWS as u64 + 5000, e as u64] {
        let machine = Machine { cublas: true, scratch_cap: rows_cap * row_bytes * 4 };
        let what = format!("cap {} B", machine.scratch_cap);
        let fwd = p.forward(e, true, &TileOverride::new(), &machine).unwrap();
        let bwd = p.backward(e, true, &choice, &machine).unwrap();
        assert!(matches!(fwd.chunking, Chunking::Chunks { .. }), "{what}: {:?}", fwd.chunking);
        assert!(matches!(bwd.chunking, Chunking::Chunks { .. }), "{what}: {:?}", bwd.chunking);
        for plan in [&fwd, &bwd] {
            if let Chunking::Chunks { rows } = plan.chunking {
                assert!(rows == e || rows % GATE_GEMM_ROWS == 0, "{what}: chunks of {rows} rows split a GEMM piece");
            }
        }
        assert_eq!(projections(&fwd), projections(&fwd_whole), "{what}: forward projections");
        assert_eq!(projections(&bwd), projections(&bwd_whole), "{what}: backward projections");
        assert_eq!(sizes(&fwd), sizes(&fwd_whole), "{what}: forward GEMM sizes");
        assert_eq!(sizes(&bwd), sizes(&bwd_whole), "{what}: backward GEMM sizes");
    }
    // below one piece: refused, naming the piece
    let machine = Machine { cublas: true, scratch_cap: 100 * row_bytes * 4 };
    match p.forward(e, true, &TileOverride::new(), &machine) {
        Err(MixError::ScratchCap { min_rows, .. }) => assert_eq!(min_rows, GATE_GEMM_ROWS as u64),
        other => panic!("expected ScratchCap, got {other:?}"),
    }
}
