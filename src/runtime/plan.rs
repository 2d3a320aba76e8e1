//! The plan of one call: a pure function from (shape, dtype, E, options,
//! what the machine offers) to the ordered steps the call runs — which
//! kernel instance launches with which arguments, which cuBLAS call, which
//! copy, which scratch is taken and given back when. [`super::stack`] runs a
//! plan step by step and decides nothing itself; `mixstack report --plan`
//! prints one; CPU tests check them for every (dtype, Cf, lmax, regime)
//! without a GPU.
//!
//! Addresses are symbolic ([`Addr`]: a buffer and a byte offset), so a plan
//! is data: the runner resolves each buffer once (the caller's tensors, the
//! stack's weights, the scratch it allocated for this call).

use std::fmt;

use super::args::{
    BwdFinalArgs, BwdFusedArgs, BwdGemmArgs, BwdGlogitArgs, BwdGradAlphaArgs, BwdPointwiseArgs, BwdRecomputeArgs,
    FwdFinalArgs, FwdGateActArgs, FwdGateArgs, FwdM0Args, FwdM1Args, StageCall,
};
use super::chunk::{self, Chunking};
use super::dispatch::{Dispatch, Path, PathDecision, TileOverride};
use super::error::MixError;
use super::gate_blas::{GATE_BLAS_MIN_CF, GATE_GEMM_ROWS};
use super::shape::StackShape;
use super::switch::Request;
use super::table::{Dtype, KernelEntry, Stage};

/// A buffer a plan reads or writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Buf {
    /// The caller's tensors (docs/MIXING_STACK.md layouts).
    U0,
    Alpha,
    Out,
    ZAll,
    GradOut,
    GradU0,
    GradAlpha,
    /// The stack's weights: W0, W1 (forward), their transposes (backward),
    /// GW and its transpose.
    W0,
    W1,
    Wt0,
    Wt1,
    Gw,
    Gwt,
    /// Scratch `i` of [`Plan::scratch`], live between its Alloc and Free steps.
    Scratch(usize),
}

/// A device address: `byte` bytes into `buf`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Addr {
    pub buf: Buf,
    pub byte: u64,
}

impl Addr {
    pub fn at(buf: Buf) -> Addr {
        Addr { buf, byte: 0 }
    }
    pub fn offset(self, bytes: u64) -> Addr {
        Addr { buf: self.buf, byte: self.byte + bytes }
    }
}

impl fmt::Debug for Addr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.buf {
            Buf::Scratch(i) => write!(f, "s{i}")?,
            b => write!(f, "{b:?}")?,
        }
        if self.byte > 0 {
            write!(f, "+{}", self.byte)?;
        }
        Ok(())
    }
}

/// The two gate contractions cuBLAS runs at Cf >= [`GATE_BLAS_MIN_CF`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateOp {
    /// logit = s @ GW (into the sig surface, activated by the next kernel).
    Projection,
    /// gz[:, :Cf] += g_logit @ GW^T.
    LogitContraction,
}

impl GateOp {
    pub fn label(self) -> &'static str {
        match self {
            GateOp::Projection => "cublas gemm: logit = s @ GW",
            GateOp::LogitContraction => "cublas gemm: gz_s += g_logit @ GW^T",
        }
    }
}

/// One scratch buffer of a call: `elems` elements of the call's dtype.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scratch {
    pub name: &'static str,
    pub elems: usize,
}

/// One step of a call, in stream order.
#[derive(Clone, Debug)]
pub enum Step {
    /// Take scratch `i` from the stack's pool.
    Alloc(usize),
    /// Give scratch `i` back (the pool reuses it in stream order).
    Free(usize),
    /// Launch `kernel` over `e` rows of `foci` foci and `n` output columns
    /// (0: a row kernel, or a fused kernel that walks whole row blocks).
    Launch { kernel: &'static KernelEntry, e: usize, n: usize, foci: usize, call: StageCall<Addr> },
    /// A cuBLAS gate GEMM over `e` rows of one focus, profiled under `stage`.
    Gemm { stage: Stage, op: GateOp, e: usize, a: Addr, w: Addr, c: Addr },
    /// Copy `bytes` bytes.
    Copy { src: Addr, dst: Addr, bytes: usize },
    /// Copy `height` rows of `width` bytes between pitched layouts.
    Copy2d { src: Addr, src_pitch: usize, dst: Addr, dst_pitch: usize, width: usize, height: usize },
    /// Zero `bytes` bytes.
    Zero { dst: Addr, bytes: usize },
}

/// What the machine and the stack offer a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Machine {
    /// cuBLAS is loaded for this stack and not turned off.
    pub cublas: bool,
    /// The scratch cap in force, bytes.
    pub scratch_cap: u64,
}

/// The kernels and path of a backward call, chosen before any buffer is
/// looked at (a call with E = 0 still reports them).
#[derive(Clone, Debug)]
pub struct BackwardChoice {
    pub decision: PathDecision,
    pub grad_alpha: &'static KernelEntry,
    pub final_: &'static KernelEntry,
    /// Per gated layer: relay (recompute, pointwise, gemm) or (glogit, gemm)
    /// where cuBLAS runs the gate GEMMs; fused (bwd_fused). Empty without a
    /// gated layer.
    pub layer: Vec<&'static KernelEntry>,
    pub gate_blas: bool,
}

/// An ordered list of steps over symbolic buffers.
#[derive(Clone, Debug)]
pub struct Plan {
    pub chunking: Chunking,
    pub scratch: Vec<Scratch>,
    pub steps: Vec<Step>,
}

impl Plan {
    /// The launches, in order.
    pub fn launches(&self) -> impl Iterator<Item = (&'static KernelEntry, &StageCall<Addr>)> + '_ {
        self.steps.iter().filter_map(|s| match s {
            Step::Launch { kernel, call, .. } => Some((*kernel, call)),
            _ => None,
        })
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "chunking: {:?}", self.chunking)?;
        for s in &self.steps {
            match s {
                Step::Alloc(i) => {
                    let sc = &self.scratch[*i];
                    writeln!(f, "  alloc  s{i} {} ({} elements)", sc.name, sc.elems)?
                }
                Step::Free(i) => writeln!(f, "  free   s{i}")?,
                Step::Launch { kernel, e, n, foci, call } => {
                    writeln!(f, "  launch {} (E {e}, n {n}, F {foci}) {call:?}", kernel.name)?
                }
                Step::Gemm { op, e, a, w, c, .. } => writeln!(f, "  {} (E {e}) a {a:?} w {w:?} c {c:?}", op.label())?,
                Step::Copy { src, dst, bytes } => writeln!(f, "  copy   {src:?} -> {dst:?} ({bytes} B)")?,
                Step::Copy2d { src, src_pitch, dst, dst_pitch, width, height } => writeln!(
                    f,
                    "  copy2d {src:?} (pitch {src_pitch}) -> {dst:?} (pitch {dst_pitch}), {height} x {width} B"
                )?,
                Step::Zero { dst, bytes } => writeln!(f, "  zero   {dst:?} ({bytes} B)")?,
            }
        }
        Ok(())
    }
}

/// The planner of one stack: its shape, dtype and kernel table.
#[derive(Clone, Copy, Debug)]
pub struct Planner<'d> {
    pub shape: StackShape,
    pub dtype: Dtype,
    pub dispatch: &'d Dispatch<'static>,
}

/// Whether the gate GEMMs may run on cuBLAS for this stack at all: a gated
/// layer, Cf at least [`GATE_BLAS_MIN_CF`] (below it the generated kernels
/// are faster: gate_blas.rs), and the stages that finish cuBLAS's work built.
/// Otherwise the reason.
pub fn gate_blas_eligible(dispatch: &Dispatch<'_>, shape: &StackShape, dtype: Dtype) -> Result<(), String> {
    if shape.gated() == 0 {
        return Err("no gated layer".into());
    }
    if shape.cf < GATE_BLAS_MIN_CF {
        return Err(format!(
            "Cf {} < {GATE_BLAS_MIN_CF}: the generated kernels are faster here (gate_blas.rs)",
            shape.cf
        ));
    }
    for stage in [Stage::FwdGateAct, Stage::BwdGlogit] {
        if dispatch.default_for(stage, dtype, shape.cf as u32, shape.lmax as u32).is_none() {
            return Err(format!("no {stage} kernel for {dtype} Cf {} lmax {}", shape.cf, shape.lmax));
        }
    }
    Ok(())
}

/// The rows one launch sequence covers: `rows` edges of `foci` foci from
/// focus `focus` on (the whole call: every focus; a chunk: one).
#[derive(Clone, Copy, Debug)]
struct Span {
    rows: usize,
    foci: usize,
    focus: usize,
}

/// The weights one sequence reads: W0/W1 (forward) or their transposes.
#[derive(Clone, Copy)]
struct Weights {
    m0: Buf,
    m1: Buf,
}

/// Steps under construction, with the scratch they take.
struct Builder {
    scratch: Vec<Scratch>,
    steps: Vec<Step>,
}

impl Builder {
    fn new() -> Self {
        Builder { scratch: Vec::new(), steps: Vec::new() }
    }
    fn alloc(&mut self, name: &'static str, elems: usize) -> Addr {
        self.scratch.push(Scratch { name, elems });
        let i = self.scratch.len() - 1;
        self.steps.push(Step::Alloc(i));
        Addr::at(Buf::Scratch(i))
    }
    fn free(&mut self, a: Option<Addr>) {
        if let Some(Addr { buf: Buf::Scratch(i), .. }) = a {
            self.steps.push(Step::Free(i));
        }
    }
    fn launch(&mut self, kernel: &'static KernelEntry, e: usize, n: usize, foci: usize, call: StageCall<Addr>) {
        debug_assert_eq!(kernel.stage, call.stage(), "{} launched with {:?}'s arguments", kernel.name, call.stage());
        self.steps.push(Step::Launch { kernel, e, n, foci, call });
    }
    fn finish(self, chunking: Chunking) -> Plan {
        Plan { chunking, scratch: self.scratch, steps: self.steps }
    }
}

impl Planner<'_> {
    fn sz(&self) -> u64 {
        self.dtype.size() as u64
    }
    fn select(&self, stage: Stage, tiles: &TileOverride) -> Result<&'static KernelEntry, MixError> {
        self.dispatch.select(stage, self.dtype, self.shape.cf as u32, self.shape.lmax as u32, tiles)
    }

    /// Whether this call runs the gate GEMMs on cuBLAS: the machine offers
    /// it, the stack is eligible, and `tiles` names none of the generated
    /// gate stages `generated` (that asks for them). Naming `blas_stage`
    /// where cuBLAS does not run is an error, never an override silently
    /// unused.
    fn gate_blas(
        &self,
        cublas: bool,
        tiles: &TileOverride,
        generated: &[Stage],
        blas_stage: Stage,
    ) -> Result<bool, MixError> {
        let eligible = gate_blas_eligible(self.dispatch, &self.shape, self.dtype);
        let on = cublas && eligible.is_ok() && !generated.iter().any(|s| tiles.get(*s).is_some());
        if let (false, Some(name)) = (on, tiles.get(blas_stage)) {
            let why = match eligible {
                Err(why) => why,
                Ok(()) if !cublas => "cuBLAS is not in use for this stack".into(),
                Ok(()) => "a generated gate stage is overridden in the same call".into(),
            };
            return Err(MixError::BadOverride {
                stage: blas_stage,
                dtype: self.dtype,
                cf: self.shape.cf as u32,
                name: name.to_string(),
                why: format!("runs only where the gate GEMMs run on cuBLAS; here: {why}"),
            });
        }
        Ok(on)
    }

    /// Byte offsets of layer `k`'s blocks for focus `focus`: (w0_k, w1_k, gw_k).
    fn layer_offsets(&self, k: usize, focus: usize) -> (u64, u64, u64) {
        let sh = &self.shape;
        let (f, m0, m1, cf, lg) = (sh.f as u64, sh.m0() as u64, sh.m1() as u64, sh.cf as u64, sh.lg() as u64);
        let (k, q, sz) = (k as u64, focus as u64, self.sz());
        ((k * f + q) * m0 * m0 * sz, (k * f + q) * m1 * m1 * sz, (k * f + q) * cf * lg * sz)
    }

    /// Byte offset of row `e0` of focus `focus` in a focus-major (F, E, width) tensor.
    fn focus_rows(&self, e: usize, focus: usize, e0: usize, width: usize) -> u64 {
        (focus * e + e0) as u64 * width as u64 * self.sz()
    }

    /// `whole` and `chunked`: scratch elements per row; `blas`: the call
    /// runs cuBLAS gate GEMMs, whose pieces a chunk must not split.
    fn chunking(
        &self,
        e: usize,
        whole: usize,
        chunked: usize,
        blas: bool,
        machine: &Machine,
    ) -> Result<Chunking, MixError> {
        let sz = self.sz();
        let granule = if blas { GATE_GEMM_ROWS } else { 1 };
        chunk::plan(self.shape.f, e, whole as u64 * sz, chunked as u64 * sz, granule, machine.scratch_cap)
    }

    /// One cuBLAS gate GEMM per focus of `span` and per piece of
    /// [`GATE_GEMM_ROWS`] rows (gate_blas.rs says why): `a` and `c` address
    /// the span's rows, `a_width` and `c_width` elements each, layer `k`'s GW.
    #[allow(clippy::too_many_arguments)]
    fn gate_gemms(
        &self,
        b: &mut Builder,
        span: Span,
        k: usize,
        stage: Stage,
        op: GateOp,
        (a, a_width): (Addr, usize),
        (c, c_width): (Addr, usize),
    ) {
        for q in 0..span.foci {
            let w = Addr::at(Buf::Gw).offset(self.layer_offsets(k, span.focus + q).2);
            for (p0, n) in chunk::windows(span.rows, GATE_GEMM_ROWS) {
                let row = (q * span.rows + p0) as u64 * self.sz();
                let (a, c) = (a.offset(row * a_width as u64), c.offset(row * c_width as u64));
                b.steps.push(Step::Gemm { stage, op, e: n, a, w, c });
            }
        }
    }

    /// The forward over `e` > 0 edges.
    pub fn forward(
        &self,
        e: usize,
        apply_alpha: bool,
        tiles: &TileOverride,
        machine: &Machine,
    ) -> Result<Plan, MixError> {
        let sh = self.shape;
        sh.check_edges(e, self.sz() as usize)?;
        let gated = sh.gated();
        let blas = self.gate_blas(machine.cublas, tiles, &[Stage::FwdGate], Stage::FwdGateAct)?;
        let layer = if gated > 0 {
            Some([
                self.select(Stage::FwdM0, tiles)?,
                self.select(if blas { Stage::FwdGateAct } else { Stage::FwdGate }, tiles)?,
                self.select(Stage::FwdM1, tiles)?,
            ])
        } else {
            None
        };
        let k_final = self.select(Stage::FwdFinal, tiles)?;
        let (row, lg, sz) = (sh.row(), sh.lg(), self.sz());
        let z_stride = sh.surface_len(e)? as u64 * sz;

        // Scratch per row: the ping-pong pair of u (one suffices for a single
        // gated layer) and the gate surface sig; a chunk also stages its
        // rows of `out` and its column of alpha (edge-major tensors).
        let per_row = if gated == 0 { 0 } else { row * gated.min(2) + lg };
        let chunking = self.chunking(e, per_row, per_row + row + 1, blas, machine)?;
        let rows = match chunking {
            Chunking::Whole => sh.f * e,
            Chunking::Chunks { rows } => rows,
        };
        let mut b = Builder::new();
        let u_a = (gated >= 1).then(|| b.alloc("u (ping)", rows * row));
        let u_b = (gated >= 2).then(|| b.alloc("u (pong)", rows * row));
        let sig = (gated >= 1).then(|| b.alloc("sig", rows * lg));
        let ping = [u_a, u_b, sig];
        let w = Weights { m0: Buf::W0, m1: Buf::W1 };

        match chunking {
            Chunking::Whole => {
                let span = Span { rows: e, foci: sh.f, focus: 0 };
                let u = self.forward_layers(
                    &mut b,
                    span,
                    layer,
                    blas,
                    Addr::at(Buf::U0),
                    Addr::at(Buf::ZAll),
                    z_stride,
                    ping,
                );
                let (alpha, out) = (Addr::at(Buf::Alpha), Addr::at(Buf::Out));
                self.forward_final(&mut b, span, k_final, w, u, alpha, out, apply_alpha);
            }
            Chunking::Chunks { rows } => {
                let out_stage = b.alloc("out (chunk)", rows * row);
                let alpha_stage = b.alloc("alpha (chunk)", rows);
                let (esz, row_bytes) = (sz as usize, row * sz as usize);
                for focus in 0..sh.f {
                    for (e0, n) in chunk::windows(e, rows) {
                        let span = Span { rows: n, foci: 1, focus };
                        let at = self.focus_rows(e, focus, e0, row);
                        let u0 = Addr::at(Buf::U0).offset(at);
                        let z0 = Addr::at(Buf::ZAll).offset(at);
                        let u = self.forward_layers(&mut b, span, layer, blas, u0, z0, z_stride, ping);
                        // alpha[e0.., focus] -> a column; the chunk's rows of
                        // out leave through a pitched copy.
                        let edge_at = ((e0 * sh.f + focus) * esz) as u64;
                        if apply_alpha {
                            b.steps.push(Step::Copy2d {
                                src: Addr::at(Buf::Alpha).offset(edge_at),
                                src_pitch: sh.f * esz,
                                dst: alpha_stage,
                                dst_pitch: esz,
                                width: esz,
                                height: n,
                            });
                        }
                        self.forward_final(&mut b, span, k_final, w, u, alpha_stage, out_stage, apply_alpha);
                        b.steps.push(Step::Copy2d {
                            src: out_stage,
                            src_pitch: row_bytes,
                            dst: Addr::at(Buf::Out).offset(edge_at * row as u64),
                            dst_pitch: sh.f * row_bytes,
                            width: row_bytes,
                            height: n,
                        });
                    }
                }
                b.free(Some(out_stage));
                b.free(Some(alpha_stage));
            }
        }
        for a in ping {
            b.free(a);
        }
        Ok(b.finish(chunking))
    }

    /// The gated layers of the forward over `span`; returns where u ends.
    /// `u0` and `z0` address the span's rows of u0 and of z_all's layer 0.
    #[allow(clippy::too_many_arguments)]
    fn forward_layers(
        &self,
        b: &mut Builder,
        span: Span,
        kernels: Option<[&'static KernelEntry; 3]>,
        blas: bool,
        u0: Addr,
        z0: Addr,
        z_stride: u64,
        [pa, pb, psig]: [Option<Addr>; 3],
    ) -> Addr {
        let Some([k_m0, k_gate, k_m1]) = kernels else { return u0 };
        let (pa, pb, sig) = (pa.expect("u (ping)"), pb.unwrap_or(pa.expect("u (ping)")), psig.expect("sig"));
        let sh = self.shape;
        let (f, e, l) = (span.foci, span.rows as i64, sh.lmax as i32);
        let mut u = u0;
        for k in 0..sh.gated() {
            let u_next = if k % 2 == 0 { pa } else { pb };
            let z = z0.offset(k as u64 * z_stride);
            let (o0, o1, og) = self.layer_offsets(k, span.focus);
            let w0 = Addr::at(Buf::W0).offset(o0);
            b.launch(k_m0, span.rows, sh.m0(), f, StageCall::FwdM0(FwdM0Args { u, w0, z, e, l }));
            let gate = if blas {
                let (row, lg) = (sh.row(), sh.lg());
                self.gate_gemms(b, span, k, Stage::FwdGateAct, GateOp::Projection, (z, row), (sig, lg));
                StageCall::FwdGateAct(FwdGateActArgs { u, z, sig, u_next, e, l })
            } else {
                let gw = Addr::at(Buf::Gw).offset(og);
                StageCall::FwdGate(FwdGateArgs { u, z, gw, sig, u_next, e, l })
            };
            b.launch(k_gate, span.rows, 0, f, gate);
            let w1 = Addr::at(Buf::W1).offset(o1);
            b.launch(k_m1, span.rows, sh.m1(), f, StageCall::FwdM1(FwdM1Args { u, w1, sig, z, u_next, e, l }));
            u = u_next;
        }
        u
    }

    /// The forward's identity layer over `span`: out (edge-major over the
    /// span's foci) from u.
    #[allow(clippy::too_many_arguments)]
    fn forward_final(
        &self,
        b: &mut Builder,
        span: Span,
        k_final: &'static KernelEntry,
        w: Weights,
        u: Addr,
        alpha: Addr,
        out: Addr,
        apply_alpha: bool,
    ) {
        let sh = self.shape;
        let (o0, o1, _) = self.layer_offsets(sh.n_layers - 1, span.focus);
        let (e, l, apply_alpha) = (span.rows as i64, sh.lmax as i32, apply_alpha as i32);
        for (seg, w, n) in [(0, Addr::at(w.m0).offset(o0), sh.m0()), (1, Addr::at(w.m1).offset(o1), sh.m1())] {
            let call = StageCall::FwdFinal(FwdFinalArgs { u, w, alpha, out, e, l, seg, apply_alpha });
            b.launch(k_final, span.rows, n, span.foci, call);
        }
    }

    /// The path and kernels of a backward call; `request` is the caller's
    /// opt-in (already read from the environment where asked).
    pub fn backward_choice(
        &self,
        request: Request,
        tiles: &TileOverride,
        cublas: bool,
    ) -> Result<BackwardChoice, MixError> {
        let (cf, lmax) = (self.shape.cf as u32, self.shape.lmax as u32);
        self.dispatch.validate_override(self.dtype, cf, lmax, tiles)?;
        let decision = self.dispatch.decide_backward_path_at(self.dtype, cf, lmax, request);
        let grad_alpha = self.select(Stage::BwdGradAlpha, tiles)?;
        let final_ = self.select(Stage::BwdFinal, tiles)?;
        let gate_blas = decision.path == Path::Relay
            && self.gate_blas(cublas, tiles, &[Stage::BwdRecompute, Stage::BwdPointwise], Stage::BwdGlogit)?;
        let mut layer = Vec::new();
        if self.shape.gated() > 0 {
            let stages: &[Stage] = match decision.path {
                Path::Relay if gate_blas => &[Stage::BwdGlogit, Stage::BwdGemm],
                Path::Relay => &[Stage::BwdRecompute, Stage::BwdPointwise, Stage::BwdGemm],
                Path::Fused => &[Stage::BwdFused],
            };
            for &s in stages {
                layer.push(self.select(s, tiles)?);
            }
        }
        Ok(BackwardChoice { decision, grad_alpha, final_, layer, gate_blas })
    }

    /// The backward over `e` > 0 edges with the kernels of `choice`.
    pub fn backward(
        &self,
        e: usize,
        apply_alpha: bool,
        choice: &BackwardChoice,
        machine: &Machine,
    ) -> Result<Plan, MixError> {
        let sh = self.shape;
        sh.check_edges(e, self.sz() as usize)?;
        let gated = sh.gated();
        let (f, row, lg, sz) = (sh.f, sh.row(), sh.lg(), self.sz());
        let z_stride = sh.surface_len(e)? as u64 * sz;
        let (el, l, aa) = (e as i64, sh.lmax as i32, apply_alpha as i32);

        // Scratch per row: the g ping-pong partner, and on the relay sig and
        // gz (and g_logit where cuBLAS runs the gate GEMMs).
        let relay = choice.decision.path == Path::Relay;
        let per_row = match gated {
            0 => 0,
            _ if relay => 2 * row + lg * (1 + choice.gate_blas as usize),
            _ => row,
        };
        let chunking = self.chunking(e, per_row, per_row, choice.gate_blas, machine)?;
        let mut b = Builder::new();

        if apply_alpha {
            let call = StageCall::BwdGradAlpha(BwdGradAlphaArgs {
                grad_out: Addr::at(Buf::GradOut),
                out: Addr::at(Buf::Out),
                alpha: Addr::at(Buf::Alpha),
                grad_alpha: Addr::at(Buf::GradAlpha),
                e: el,
                l,
            });
            b.launch(choice.grad_alpha, e, 0, f, call);
        } else {
            b.steps.push(Step::Zero { dst: Addr::at(Buf::GradAlpha), bytes: sh.alpha_len(e)? * sz as usize });
        }

        let rows = match chunking {
            Chunking::Whole => f * e,
            Chunking::Chunks { rows } => rows,
        };
        let gs = (gated > 0).then(|| b.alloc("g (ping-pong)", rows * row));
        let (sig, gz, glog) = if gated > 0 && relay {
            (
                Some(b.alloc("sig", rows * lg)),
                Some(b.alloc("gz", rows * row)),
                choice.gate_blas.then(|| b.alloc("g_logit", rows * lg)),
            )
        } else {
            (None, None, None)
        };

        // The final identity layer writes g, with the ping-pong parity chosen
        // so that the last layer's write lands in grad_u0; a chunked walk
        // starts every chunk from grad_u0 (copied to scratch if the parity
        // asks for it).
        let odd = !gated.is_multiple_of(2);
        let grad_u0 = Addr::at(Buf::GradU0);
        let g_final = match gs {
            Some(gs) if chunking == Chunking::Whole && odd => gs,
            _ => grad_u0,
        };
        let (o0, o1, _) = self.layer_offsets(sh.n_layers - 1, 0);
        for (seg, wt, n) in [(0, Addr::at(Buf::Wt0).offset(o0), sh.m0()), (1, Addr::at(Buf::Wt1).offset(o1), sh.m1())] {
            let call = StageCall::BwdFinal(BwdFinalArgs {
                grad_out: Addr::at(Buf::GradOut),
                alpha: Addr::at(Buf::Alpha),
                wt,
                g: g_final,
                e: el,
                l,
                seg,
                apply_alpha: aa,
            });
            b.launch(choice.final_, e, n, f, call);
        }

        if let Some(gs) = gs {
            let scratch = (sig, gz, glog);
            match chunking {
                Chunking::Whole => {
                    let span = Span { rows: e, foci: f, focus: 0 };
                    let (g, g_next) = if odd { (gs, grad_u0) } else { (grad_u0, gs) };
                    let last =
                        self.backward_layers(&mut b, span, choice, g, g_next, Addr::at(Buf::ZAll), z_stride, scratch);
                    debug_assert_eq!(last, grad_u0, "the last backward write must land in grad_u0");
                }
                Chunking::Chunks { rows } => {
                    for focus in 0..f {
                        for (e0, n) in chunk::windows(e, rows) {
                            let span = Span { rows: n, foci: 1, focus };
                            let at = self.focus_rows(e, focus, e0, row);
                            let g0 = grad_u0.offset(at);
                            let (g, g_next) = if odd {
                                b.steps.push(Step::Copy { src: g0, dst: gs, bytes: n * row * sz as usize });
                                (gs, g0)
                            } else {
                                (g0, gs)
                            };
                            let z0 = Addr::at(Buf::ZAll).offset(at);
                            let last = self.backward_layers(&mut b, span, choice, g, g_next, z0, z_stride, scratch);
                            debug_assert_eq!(last, g0, "the last backward write must land in grad_u0");
                        }
                    }
                }
            }
        }
        for a in [gs, sig, gz, glog] {
            b.free(a);
        }
        Ok(b.finish(chunking))
    }

    /// The gated layers of the backward over `span`, from g (ping-ponging
    /// with g_next); returns where the last layer wrote. `z0` addresses the
    /// span's rows of z_all's layer 0; `scratch` is (sig, gz, g_logit), used
    /// by the relay.
    #[allow(clippy::too_many_arguments)]
    fn backward_layers(
        &self,
        b: &mut Builder,
        span: Span,
        choice: &BackwardChoice,
        mut g: Addr,
        mut g_next: Addr,
        z0: Addr,
        z_stride: u64,
        (sig, gz, glog): (Option<Addr>, Option<Addr>, Option<Addr>),
    ) -> Addr {
        let sh = self.shape;
        let (f, rows, e, l) = (span.foci, span.rows, span.rows as i64, sh.lmax as i32);
        for k in (0..sh.gated()).rev() {
            let z = z0.offset(k as u64 * z_stride);
            let (o0, o1, og) = self.layer_offsets(k, span.focus);
            let (gw, gwt) = (Addr::at(Buf::Gw).offset(og), Addr::at(Buf::Gwt).offset(og));
            let (wt0, wt1) = (Addr::at(Buf::Wt0).offset(o0), Addr::at(Buf::Wt1).offset(o1));
            match choice.decision.path {
                Path::Relay => {
                    let (sig, gz) = (sig.expect("relay sig"), gz.expect("relay gz"));
                    if choice.gate_blas {
                        let glog = glog.expect("relay g_logit");
                        let (stage, row, lg) = (Stage::BwdGlogit, sh.row(), sh.lg());
                        self.gate_gemms(b, span, k, stage, GateOp::Projection, (z, row), (sig, lg));
                        let call = StageCall::BwdGlogit(BwdGlogitArgs { g, z, logit: sig, glog, gz, e, l });
                        b.launch(choice.layer[0], rows, 0, f, call);
                        self.gate_gemms(b, span, k, stage, GateOp::LogitContraction, (glog, lg), (gz, row));
                    } else {
                        let call = StageCall::BwdRecompute(BwdRecomputeArgs { z, gw, sig, e, l });
                        b.launch(choice.layer[0], rows, 0, f, call);
                        let call = StageCall::BwdPointwise(BwdPointwiseArgs { g, z, sig, gwt, gz, e, l });
                        b.launch(choice.layer[1], rows, 0, f, call);
                    }
                    let k_gemm = choice.layer[choice.layer.len() - 1];
                    for (seg, wt, n) in [(0, wt0, sh.m0()), (1, wt1, sh.m1())] {
                        b.launch(k_gemm, rows, n, f, StageCall::BwdGemm(BwdGemmArgs { gz, g, wt, g_next, e, l, seg }));
                    }
                }
                Path::Fused => {
                    // n = 0: the kernel walks whole row blocks (both segments).
                    let call = StageCall::BwdFused(BwdFusedArgs { g, z, gw, gwt, wt0, wt1, g_next, e, l });
                    b.launch(choice.layer[0], rows, 0, f, call);
                }
            }
            std::mem::swap(&mut g, &mut g_next);
        }
        g
    }
}
