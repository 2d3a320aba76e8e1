//! [`Stack`]: the mixing stack on one CUDA context — weights uploaded once,
//! forward and backward launched on the caller's stream.
//!
//! Launch sequences are those of docs/KERNELS.md; see [`Stack::forward_raw`]
//! and [`Stack::backward_raw`].

use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::sys::{CUdevice_attribute, CUdeviceptr};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use super::chunk::{self, Chunking, ScratchCap};
use super::dispatch::{is_gated_stage, Dispatch, Path, PathDecision, TileOverride, FORWARD_STAGES, RELAY_STAGES};
use super::element::Element;
use super::error::{DriverContext, MixError, ShapeParam};
use super::fault::Fault;
use super::gate_blas::{GateBlas, GateGemm, GATE_BLAS_MIN_CF};
use super::launch::{Arg, KernelTiming, Kernels};
use super::memory::{raw_ptr, CallMemory, ScratchPool, Tracker};
use super::shape::{StackShape, MAX_F};
use super::switch::FusedMode;
use super::table::{KernelEntry, Stage};

/// Options of one backward call.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BackwardOptions {
    /// Whether the fused path is requested (default: read the environment).
    pub fused: FusedMode,
    /// Per-stage kernel overrides (default: none).
    pub tiles: TileOverride,
}

impl BackwardOptions {
    /// Relay, whatever the environment says.
    pub fn relay() -> Self {
        BackwardOptions { fused: FusedMode::Off, tiles: TileOverride::new() }
    }
    /// Fused requested, whatever the environment says (falls back to the
    /// relay outside the fused regime).
    pub fn fused() -> Self {
        BackwardOptions { fused: FusedMode::On, tiles: TileOverride::new() }
    }
    pub fn with_tiles(mut self, tiles: TileOverride) -> Self {
        self.tiles = tiles;
        self
    }
}

/// Caller-owned device buffers of a forward call (raw addresses).
#[derive(Clone, Copy, Debug)]
pub struct ForwardPtrs {
    /// in: (F, E, ROW)
    pub u0: CUdeviceptr,
    /// in: (E, F)
    pub alpha: CUdeviceptr,
    /// out: (E, F, ROW)
    pub out: CUdeviceptr,
    /// out: (n_layers-1, F, E, ROW); may be 0 when n_layers == 1
    pub z_all: CUdeviceptr,
}

/// Caller-owned device buffers of a backward call (raw addresses).
#[derive(Clone, Copy, Debug)]
pub struct BackwardPtrs {
    /// in: (E, F, ROW)
    pub grad_out: CUdeviceptr,
    /// in: (E, F, ROW), the forward's output
    pub out: CUdeviceptr,
    /// in: (n_layers-1, F, E, ROW); may be 0 when n_layers == 1
    pub z_all: CUdeviceptr,
    /// in: (E, F)
    pub alpha: CUdeviceptr,
    /// out: (F, E, ROW)
    pub grad_u0: CUdeviceptr,
    /// out: (E, F)
    pub grad_alpha: CUdeviceptr,
}

/// The buffers of one raw call over `e` edges, checked for a stack of `shape`
/// and element `T`: every size and offset fits 64-bit arithmetic
/// ([`StackShape::check_edges`]) and, when e > 0, every pointer the call needs
/// is non-null. Only [`ForwardPtrs::check`] and [`BackwardPtrs::check`] make
/// one, and the raw entry points take nothing else: these checks run once per
/// call, before any caller-side check that relies on them (the C ABI's).
#[derive(Debug)]
pub struct Checked<T, P> {
    shape: StackShape,
    e: usize,
    ptrs: P,
    elem: PhantomData<fn() -> T>,
}

// Manual: a derive would bound T, which is only a marker here.
impl<T, P: Copy> Clone for Checked<T, P> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T, P: Copy> Copy for Checked<T, P> {}

impl<T, P> Checked<T, P> {
    /// Edges of the call.
    pub fn e(&self) -> usize {
        self.e
    }
    /// The checked buffers.
    pub fn ptrs(&self) -> &P {
        &self.ptrs
    }
    /// The shape they were checked for.
    pub fn shape(&self) -> StackShape {
        self.shape
    }
}

impl ForwardPtrs {
    /// Check these buffers for a forward of `e` edges on a stack of `shape`
    /// and element `T` (`z_all` only when the shape has a gated layer).
    pub fn check<T: Element>(self, shape: StackShape, e: usize) -> Result<Checked<T, ForwardPtrs>, MixError> {
        shape.check_edges(e, std::mem::size_of::<T>())?;
        if e > 0 {
            nonnull(self.u0, "u0")?;
            nonnull(self.alpha, "alpha")?;
            nonnull(self.out, "out")?;
            if shape.gated() > 0 {
                nonnull(self.z_all, "z_all")?;
            }
        }
        Ok(Checked { shape, e, ptrs: self, elem: PhantomData })
    }
}

impl BackwardPtrs {
    /// As [`ForwardPtrs::check`]; inputs first, then outputs.
    pub fn check<T: Element>(self, shape: StackShape, e: usize) -> Result<Checked<T, BackwardPtrs>, MixError> {
        shape.check_edges(e, std::mem::size_of::<T>())?;
        if e > 0 {
            nonnull(self.grad_out, "grad_out")?;
            nonnull(self.out, "out")?;
            nonnull(self.alpha, "alpha")?;
            if shape.gated() > 0 {
                nonnull(self.z_all, "z_all")?;
            }
            nonnull(self.grad_u0, "grad_u0")?;
            nonnull(self.grad_alpha, "grad_alpha")?;
        }
        Ok(Checked { shape, e, ptrs: self, elem: PhantomData })
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn nonnull(p: CUdeviceptr, tensor: &'static str) -> Result<(), MixError> {
    if p == 0 {
        Err(MixError::NullPointer { tensor })
    } else {
        Ok(())
    }
}

fn check_len(tensor: &'static str, expected: usize, got: usize) -> Result<(), MixError> {
    if expected != got {
        Err(MixError::BufferLength { tensor, expected, got })
    } else {
        Ok(())
    }
}

/// The SO(2) mixing stack for element type `T` (f32 or f64) on one context.
pub struct Stack<T: Element> {
    ctx: Arc<CudaContext>,
    shape: StackShape,
    dispatch: Dispatch<'static>,
    w0: CudaSlice<T>,
    w1: CudaSlice<T>,
    wt0: CudaSlice<T>,
    wt1: CudaSlice<T>,
    /// `None` when n_layers == 1 (no gated layer).
    gw: Option<CudaSlice<T>>,
    /// gwt[k][f][c][j] = GW[k][f][j][c]: the gate-logit contraction reads
    /// it along j, coalesced.
    gwt: Option<CudaSlice<T>>,
    kernels: Kernels,
    /// Scratch and outputs of every call come from here (kept mapped).
    pool: Option<ScratchPool>,
    last_path: Mutex<Option<PathDecision>>,
    last_forward: Mutex<Option<CallMemory>>,
    last_backward: Mutex<Option<CallMemory>>,
    poison: AtomicBool,
    /// The gate contractions by cuBLAS (Cf >= 96, gate_blas.rs), or why the
    /// generated kernels run them.
    gate_blas: Result<GateBlas, String>,
    /// Tests and benches: run the generated gate kernels even where cuBLAS is up.
    gate_blas_off: AtomicBool,
    /// Where each call's scratch cap comes from, and the device's memory
    /// (the default cap is a share of it).
    scratch_cap: Mutex<ScratchCap>,
    device_bytes: u64,
    last_forward_chunking: Mutex<Option<Chunking>>,
    last_backward_chunking: Mutex<Option<Chunking>>,
}

/// wt[k][f][o][i] = W[k][f][i][o] for `blocks` square n x n blocks.
fn transpose_blocks<T: Copy>(w: &[T], n: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(w.len());
    for blk in w.chunks_exact(n * n) {
        for o in 0..n {
            out.extend((0..n).map(|i| blk[i * n + o]));
        }
    }
    out
}

/// The transpose of every rows x cols block (rows*cols elements each).
fn transpose_rect_blocks<T: Copy>(w: &[T], rows: usize, cols: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(w.len());
    if rows * cols == 0 {
        return out;
    }
    for blk in w.chunks_exact(rows * cols) {
        for c in 0..cols {
            out.extend((0..rows).map(|r| blk[r * cols + c]));
        }
    }
    out
}

impl<T: Element> Stack<T> {
    /// Validate the shape against the built kernel table, validate the
    /// weights' lengths, upload them (and the transposed copies) once on
    /// `stream`. The stack then belongs to `stream`'s context.
    ///
    /// `w0`: (n_layers, F, M0, M0), `w1`: (n_layers, F, M1, M1),
    /// `gw`: (n_layers-1, F, Cf, LG), all row-major (in, out).
    pub fn new(stream: &Arc<CudaStream>, shape: StackShape, w0: &[T], w1: &[T], gw: &[T]) -> Result<Self, MixError> {
        Self::with_dispatch(stream, Dispatch::builtin(), shape, w0, w1, gw)
    }

    /// [`Stack::new`] over another kernel table. Unless `dispatch` already
    /// has a shared-memory limit, the device's opt-in limit is set on it.
    pub fn with_dispatch(
        stream: &Arc<CudaStream>,
        dispatch: Dispatch<'static>,
        shape: StackShape,
        w0: &[T],
        w1: &[T],
        gw: &[T],
    ) -> Result<Self, MixError> {
        // Dispatch only what fits this device's shared memory at this lmax.
        let ctx = stream.context().clone();
        let dispatch = match dispatch.smem_limit() {
            Some(_) => dispatch,
            None => {
                let optin = ctx
                    .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
                    .during(|| "querying the opt-in shared memory limit".into())?;
                dispatch.with_smem_limit(Some(optin.max(0) as u64))
            }
        };
        validate_shape::<T>(&dispatch, &shape)?;
        let overflow = |tensor| MixError::UnsupportedShape {
            param: ShapeParam::NLayers,
            value: shape.n_layers as u64,
            supported: format!("sizes of `{tensor}` that fit usize"),
        };
        check_len("w0", shape.w0_len().ok_or_else(|| overflow("w0"))?, w0.len())?;
        check_len("w1", shape.w1_len().ok_or_else(|| overflow("w1"))?, w1.len())?;
        check_len("gw", shape.gw_len().ok_or_else(|| overflow("gw"))?, gw.len())?;

        let up = |what: &'static str, host: &[T]| {
            stream.clone_htod(host).during(|| format!("uploading `{what}` ({} elements)", host.len()))
        };
        let wt0_host = transpose_blocks(w0, shape.m0());
        let wt1_host = transpose_blocks(w1, shape.m1());
        let w0_d = up("w0", w0)?;
        let w1_d = up("w1", w1)?;
        let wt0_d = up("wt0", &wt0_host)?;
        let wt1_d = up("wt1", &wt1_host)?;
        let gw_d = if gw.is_empty() { None } else { Some(up("gw", gw)?) };
        let gwt_host = transpose_rect_blocks(gw, shape.cf, shape.lg());
        let gwt_d = if gw.is_empty() { None } else { Some(up("gwt", &gwt_host)?) };
        stream.synchronize().during(|| "waiting for the weight upload".into())?;

        let gate_blas = if shape.gated() == 0 {
            Err("no gated layer".into())
        } else if shape.cf < GATE_BLAS_MIN_CF {
            Err(format!("Cf {} < {GATE_BLAS_MIN_CF}: the generated kernels are faster here (gate_blas.rs)", shape.cf))
        } else if let Some(stage) = [Stage::FwdGateAct, Stage::BwdGlogit]
            .into_iter()
            .find(|st| dispatch.default_for(*st, T::DTYPE, shape.cf as u32, shape.lmax as u32).is_none())
        {
            Err(format!("no {stage} kernel for {} Cf {} lmax {}", T::DTYPE, shape.cf, shape.lmax))
        } else {
            GateBlas::new(stream)
        };

        let device_bytes = ctx.total_mem().during(|| "querying the device's memory".into())? as u64;
        Ok(Stack {
            scratch_cap: Mutex::new(ScratchCap::default()),
            device_bytes,
            last_forward_chunking: Mutex::new(None),
            last_backward_chunking: Mutex::new(None),
            gate_blas,
            gate_blas_off: AtomicBool::new(false),
            kernels: Kernels::new(ctx.clone(), shape.lg()),
            pool: ScratchPool::new(&ctx)?,
            ctx,
            shape,
            dispatch,
            w0: w0_d,
            w1: w1_d,
            wt0: wt0_d,
            wt1: wt1_d,
            gw: gw_d,
            gwt: gwt_d,
            last_path: Mutex::new(None),
            last_forward: Mutex::new(None),
            last_backward: Mutex::new(None),
            poison: AtomicBool::new(false),
        })
    }

    pub fn shape(&self) -> StackShape {
        self.shape
    }

    /// Where the gate contractions run (cuBLAS at Cf >= 96 where it loads),
    /// and why; [`Stack::set_generated_gate`] overrides it per call.
    pub fn gate_gemm(&self) -> GateGemm {
        match &self.gate_blas {
            Ok(_) if self.gate_blas_off.load(Ordering::Relaxed) => {
                GateGemm::Generated { why: "set_generated_gate(true)".into() }
            }
            Ok(_) => GateGemm::Cublas,
            Err(why) => GateGemm::Generated { why: why.clone() },
        }
    }

    /// Run the generated gate kernels (fwd_gate, bwd_recompute,
    /// bwd_pointwise) even where cuBLAS is up: for side-by-side tests and
    /// benches.
    pub fn set_generated_gate(&self, on: bool) {
        self.gate_blas_off.store(on, Ordering::Relaxed);
    }

    fn blas(&self) -> Option<&GateBlas> {
        self.gate_blas.as_ref().ok().filter(|_| !self.gate_blas_off.load(Ordering::Relaxed))
    }

    /// The cuBLAS gate path for one call, unless `tiles` names one of the
    /// generated gate stages `generated` (that asks for them); naming
    /// `blas_stage` where the cuBLAS path does not run is an error, never
    /// an override silently unused.
    fn gate_blas_for(
        &self,
        tiles: &TileOverride,
        generated: &[Stage],
        blas_stage: Stage,
    ) -> Result<Option<&GateBlas>, MixError> {
        let blas = self.blas().filter(|_| !generated.iter().any(|s| tiles.get(*s).is_some()));
        if let (None, Some(name)) = (blas, tiles.get(blas_stage)) {
            return Err(MixError::BadOverride {
                stage: blas_stage,
                dtype: T::DTYPE,
                cf: self.shape.cf as u32,
                name: name.to_string(),
                why: format!("runs only where the gate GEMMs run on cuBLAS; here: {:?}", self.gate_gemm()),
            });
        }
        Ok(blas)
    }
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    pub fn dispatch(&self) -> Dispatch<'static> {
        self.dispatch
    }
    /// Give the memory the stack keeps mapped between calls (its scratch
    /// pool, see `memory::ScratchPool`) back to the device. The next call
    /// maps it again.
    pub fn release_cached_memory(&self) -> Result<(), MixError> {
        self.ctx.synchronize().during(|| "waiting for the stack's work".into())?;
        self.pool.as_ref().map_or(Ok(()), ScratchPool::trim)
    }
    /// Device bytes held by the stack itself: W0, W1, GW and their transposes.
    pub fn weight_bytes(&self) -> u64 {
        let sz = std::mem::size_of::<T>() as u64;
        let gw = self.gw.as_ref().map_or(0, |g| g.len() as u64);
        (2 * self.w0.len() as u64 + 2 * self.w1.len() as u64 + 2 * gw) * sz
    }

    /// Path decision of the last backward call (`None` before the first).
    pub fn last_path(&self) -> Option<PathDecision> {
        *lock(&self.last_path)
    }
    /// Extra peak bytes of the last forward call, outputs included (see
    /// [`crate::runtime::memory`]).
    pub fn last_forward_peak_bytes(&self) -> Option<u64> {
        lock(&self.last_forward).map(|m| m.peak_bytes)
    }
    /// Extra peak bytes of the last backward call, outputs included (see
    /// [`crate::runtime::memory`]).
    pub fn last_backward_peak_bytes(&self) -> Option<u64> {
        lock(&self.last_backward).map(|m| m.peak_bytes)
    }
    pub fn last_forward_memory(&self) -> Option<CallMemory> {
        *lock(&self.last_forward)
    }
    pub fn last_backward_memory(&self) -> Option<CallMemory> {
        *lock(&self.last_backward)
    }

    /// Record an event pair around every launch from now on (for benches;
    /// off by default). Turning it off drops what was not collected.
    pub fn set_profiling(&self, on: bool) {
        self.kernels.set_profiling(on);
    }
    /// Per-kernel times of the launches since profiling was turned on or
    /// last collected, in launch order; waits for those kernels.
    pub fn timings(&self) -> Result<Vec<KernelTiming>, MixError> {
        self.kernels.take_timings()
    }
    /// Canonical names of the kernels loaded so far.
    pub fn loaded_kernels(&self) -> Vec<&'static str> {
        self.kernels.loaded()
    }

    /// Debug aid for tests: fill every buffer the stack allocates (outputs
    /// and scratch) with NaN before use.
    #[doc(hidden)]
    pub fn debug_poison_allocations(&self, on: bool) {
        self.poison.store(on, Ordering::Relaxed);
    }

    fn check_stream(&self, stream: &CudaStream) -> Result<(), MixError> {
        if **stream.context() != *self.ctx {
            return Err(MixError::ContextMismatch { what: "stream" });
        }
        Ok(())
    }

    fn check_slice(&self, s: &CudaSlice<T>, what: &'static str) -> Result<(), MixError> {
        if **s.context() != *self.ctx {
            return Err(MixError::ContextMismatch { what });
        }
        Ok(())
    }

    fn select(&self, stage: Stage, tiles: &TileOverride) -> Result<&'static KernelEntry, MixError> {
        self.dispatch.select(stage, T::DTYPE, self.shape.cf as u32, self.shape.lmax as u32, tiles)
    }

    /// The path and the kernels a backward call with `opts` would launch
    /// (reads the environment for [`FusedMode::FromEnv`]); launches nothing.
    pub fn backward_plan(&self, opts: &BackwardOptions) -> Result<(PathDecision, Vec<&'static KernelEntry>), MixError> {
        let plan = self.plan_backward(opts)?;
        let mut v = vec![plan.grad_alpha, plan.final_];
        v.extend(plan.layer.iter().copied());
        Ok((plan.decision, v))
    }

    fn plan_backward(&self, opts: &BackwardOptions) -> Result<BwdPlan, MixError> {
        let (cf, lmax) = (self.shape.cf as u32, self.shape.lmax as u32);
        self.dispatch.validate_override(T::DTYPE, cf, lmax, &opts.tiles)?;
        let requested = opts.fused.requested()?;
        let decision = self.dispatch.decide_backward_path_at(T::DTYPE, cf, lmax, requested);
        let grad_alpha = self.select(Stage::BwdGradAlpha, &opts.tiles)?;
        let final_ = self.select(Stage::BwdFinal, &opts.tiles)?;
        let mut layer = Vec::new();
        let gate_blas = decision.path == Path::Relay
            && self
                .gate_blas_for(&opts.tiles, &[Stage::BwdRecompute, Stage::BwdPointwise], Stage::BwdGlogit)?
                .is_some();
        if self.shape.gated() > 0 {
            let stages: &[Stage] = match decision.path {
                Path::Relay if gate_blas => &[Stage::BwdGlogit, Stage::BwdGemm],
                Path::Relay => &[Stage::BwdRecompute, Stage::BwdPointwise, Stage::BwdGemm],
                Path::Fused => &[Stage::BwdFused],
            };
            for &s in stages {
                layer.push(self.select(s, &opts.tiles)?);
            }
        }
        Ok(BwdPlan { decision, grad_alpha, final_, layer, gate_blas })
    }

    // ------------------------------------------------------------------
    // Slice API
    // ------------------------------------------------------------------

    /// Forward pass. `u0`: (F, E, ROW) (E is derived from its length, which
    /// must be a multiple of F*ROW), `alpha`: (E, F). Returns
    /// `(out (E, F, ROW), z_all (n_layers-1, F, E, ROW))`, allocated on
    /// `stream`. All work is enqueued on `stream`; nothing waits for it.
    pub fn forward(
        &self,
        stream: &Arc<CudaStream>,
        u0: &CudaSlice<T>,
        alpha: &CudaSlice<T>,
        apply_alpha: bool,
    ) -> Result<(CudaSlice<T>, CudaSlice<T>), MixError> {
        self.forward_with(stream, u0, alpha, apply_alpha, &TileOverride::new())
    }

    /// [`Stack::forward`] with per-stage kernel overrides (forward stages
    /// only; any candidate of this stack's key), for tile sweeps.
    pub fn forward_with(
        &self,
        stream: &Arc<CudaStream>,
        u0: &CudaSlice<T>,
        alpha: &CudaSlice<T>,
        apply_alpha: bool,
        tiles: &TileOverride,
    ) -> Result<(CudaSlice<T>, CudaSlice<T>), MixError> {
        let (cf, lmax) = (self.shape.cf as u32, self.shape.lmax as u32);
        self.dispatch.validate_forward_override(T::DTYPE, cf, lmax, tiles)?;
        self.check_stream(stream)?;
        self.check_slice(u0, "u0")?;
        self.check_slice(alpha, "alpha")?;
        let sh = self.shape;
        let e = sh.edges_from("u0", u0.len())?;
        check_len("alpha", sh.alpha_len(e)?, alpha.len())?;
        sh.check_edges(e, std::mem::size_of::<T>())?;

        let mut tr = Tracker::new(stream, self.pool.as_ref(), &self.kernels.fault, self.poison.load(Ordering::Relaxed));
        let mut out = tr.output::<T>(sh.surface_len(e)?, "out")?;
        let mut z_all = tr.output::<T>(sh.z_all_len(e)?, "z_all")?;
        if e > 0 {
            let (p_u0, _s0) = u0.device_ptr(stream);
            let (p_alpha, _s1) = alpha.device_ptr(stream);
            let (p_out, _s2) = out.device_ptr_mut(stream);
            let (p_z, _s3) = z_all.device_ptr_mut(stream);
            let ptrs = ForwardPtrs { u0: p_u0, alpha: p_alpha, out: p_out, z_all: p_z };
            self.forward_core(stream, e, &ptrs, apply_alpha, tiles, &mut tr)?;
        }
        *lock(&self.last_forward) = Some(tr.finish());
        Ok((out, z_all))
    }

    /// Backward pass (input gradients). `grad_out`, `out`: (E, F, ROW) (E
    /// from `grad_out`'s length), `z_all`: (n_layers-1, F, E, ROW), `alpha`:
    /// (E, F). Returns `(grad_u0 (F, E, ROW), grad_alpha (E, F), decision)`;
    /// grad_alpha is zeros when `!apply_alpha`.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        stream: &Arc<CudaStream>,
        grad_out: &CudaSlice<T>,
        out: &CudaSlice<T>,
        z_all: &CudaSlice<T>,
        alpha: &CudaSlice<T>,
        apply_alpha: bool,
        opts: &BackwardOptions,
    ) -> Result<(CudaSlice<T>, CudaSlice<T>, PathDecision), MixError> {
        self.check_stream(stream)?;
        self.check_slice(grad_out, "grad_out")?;
        self.check_slice(out, "out")?;
        self.check_slice(z_all, "z_all")?;
        self.check_slice(alpha, "alpha")?;
        let sh = self.shape;
        let e = sh.edges_from("grad_out", grad_out.len())?;
        check_len("out", sh.surface_len(e)?, out.len())?;
        check_len("z_all", sh.z_all_len(e)?, z_all.len())?;
        check_len("alpha", sh.alpha_len(e)?, alpha.len())?;
        sh.check_edges(e, std::mem::size_of::<T>())?;
        let plan = self.plan_backward(opts)?;

        let mut tr = Tracker::new(stream, self.pool.as_ref(), &self.kernels.fault, self.poison.load(Ordering::Relaxed));
        let mut grad_u0 = tr.output::<T>(sh.surface_len(e)?, "grad_u0")?;
        let mut grad_alpha = tr.output::<T>(sh.alpha_len(e)?, "grad_alpha")?;
        *lock(&self.last_path) = Some(plan.decision);
        if e > 0 {
            let (p_go, _s0) = grad_out.device_ptr(stream);
            let (p_out, _s1) = out.device_ptr(stream);
            let (p_z, _s2) = z_all.device_ptr(stream);
            let (p_alpha, _s3) = alpha.device_ptr(stream);
            let (p_gu, _s4) = grad_u0.device_ptr_mut(stream);
            let (p_ga, _s5) = grad_alpha.device_ptr_mut(stream);
            let ptrs = BackwardPtrs {
                grad_out: p_go,
                out: p_out,
                z_all: p_z,
                alpha: p_alpha,
                grad_u0: p_gu,
                grad_alpha: p_ga,
            };
            self.backward_core(stream, e, &ptrs, apply_alpha, &plan, &mut tr)?;
        }
        *lock(&self.last_backward) = Some(tr.finish());
        Ok((grad_u0, grad_alpha, plan.decision))
    }

    // ------------------------------------------------------------------
    // Raw API (caller-owned buffers, e.g. behind a C ABI)
    // ------------------------------------------------------------------

    /// Forward on caller-owned buffers, checked by [`ForwardPtrs::check`].
    /// Scratch is allocated (and accounted) here; the outputs are not.
    ///
    /// # Safety
    /// Every pointer must address device memory of this stack's context of at
    /// least the size its [`ForwardPtrs`] field documents (elements of `T`),
    /// valid until the enqueued work completes; `out`/`z_all` must not
    /// overlap each other or the inputs. Work is enqueued on `stream` only:
    /// the caller orders it against other streams.
    pub unsafe fn forward_raw(
        &self,
        stream: &Arc<CudaStream>,
        call: &Checked<T, ForwardPtrs>,
        apply_alpha: bool,
    ) -> Result<(), MixError> {
        self.check_stream(stream)?;
        // Checked for another shape (another stack's): check for this one.
        let call = if call.shape == self.shape { *call } else { call.ptrs.check(self.shape, call.e)? };
        let mut tr = Tracker::new(stream, self.pool.as_ref(), &self.kernels.fault, self.poison.load(Ordering::Relaxed));
        if call.e > 0 {
            self.forward_core(stream, call.e, &call.ptrs, apply_alpha, &TileOverride::new(), &mut tr)?;
        }
        *lock(&self.last_forward) = Some(tr.finish());
        Ok(())
    }

    /// Backward on caller-owned buffers, checked by [`BackwardPtrs::check`];
    /// returns the path taken.
    ///
    /// # Safety
    /// As [`Stack::forward_raw`], for the fields of [`BackwardPtrs`].
    pub unsafe fn backward_raw(
        &self,
        stream: &Arc<CudaStream>,
        call: &Checked<T, BackwardPtrs>,
        apply_alpha: bool,
        opts: &BackwardOptions,
    ) -> Result<PathDecision, MixError> {
        self.check_stream(stream)?;
        // As in forward_raw.
        let call = if call.shape == self.shape { *call } else { call.ptrs.check(self.shape, call.e)? };
        let plan = self.plan_backward(opts)?;
        *lock(&self.last_path) = Some(plan.decision);
        let mut tr = Tracker::new(stream, self.pool.as_ref(), &self.kernels.fault, self.poison.load(Ordering::Relaxed));
        if call.e > 0 {
            self.backward_core(stream, call.e, &call.ptrs, apply_alpha, &plan, &mut tr)?;
        }
        *lock(&self.last_backward) = Some(tr.finish());
        Ok(plan.decision)
    }

    // ------------------------------------------------------------------
    // Launch sequences
    // ------------------------------------------------------------------

    /// Byte offsets of layer `k`'s blocks for focus `focus`: (w0_k, w1_k, gw_k).
    fn layer_offsets(&self, k: usize, focus: usize) -> (u64, u64, u64) {
        let sh = &self.shape;
        let sz = std::mem::size_of::<T>() as u64;
        let (f, m0, m1, cf, lg) = (sh.f as u64, sh.m0() as u64, sh.m1() as u64, sh.cf as u64, sh.lg() as u64);
        let (k, q) = (k as u64, focus as u64);
        ((k * f + q) * m0 * m0 * sz, (k * f + q) * m1 * m1 * sz, (k * f + q) * cf * lg * sz)
    }

    /// Byte offset of row `e0` of focus `focus` in a focus-major (F, E, width) tensor.
    fn focus_rows(&self, e: usize, focus: usize, e0: usize, width: usize) -> u64 {
        ((focus * e + e0) * width * std::mem::size_of::<T>()) as u64
    }

    /// The scratch cap in force for the next call, in bytes (the stack's
    /// setting, else [`chunk::SCRATCH_CAP_ENV`], else a share of the device).
    pub fn scratch_cap(&self) -> Result<u64, MixError> {
        lock(&self.scratch_cap).resolve(self.device_bytes)
    }
    /// Set where the scratch cap comes from (default: the environment).
    pub fn set_scratch_cap(&self, cap: ScratchCap) {
        *lock(&self.scratch_cap) = cap;
    }
    /// How the last forward and backward calls walked their rows.
    pub fn last_chunking(&self) -> (Option<Chunking>, Option<Chunking>) {
        (*lock(&self.last_forward_chunking), *lock(&self.last_backward_chunking))
    }

    /// Tests: fail the n-th allocation or launch of the next calls, once.
    #[doc(hidden)]
    pub fn debug_inject_fault(&self, fault: Option<Fault>) {
        self.kernels.fault.arm(fault);
    }
    /// Tests: bytes of the stack's memory pool in use now (None without a pool).
    #[doc(hidden)]
    pub fn debug_pool_used_bytes(&self) -> Result<Option<u64>, MixError> {
        self.pool.as_ref().map(ScratchPool::used_bytes).transpose()
    }

    /// The chunking of a call over `e` edges, scratch `whole` bytes per
    /// (focus, edge) unchunked and `chunked` per edge of a chunk.
    fn chunking(&self, e: usize, whole: usize, chunked: usize) -> Result<Chunking, MixError> {
        let sz = std::mem::size_of::<T>() as u64;
        chunk::plan(self.shape.f, e, whole as u64 * sz, chunked as u64 * sz, self.scratch_cap()?)
    }

    fn forward_core(
        &self,
        stream: &Arc<CudaStream>,
        e: usize,
        p: &ForwardPtrs,
        apply_alpha: bool,
        tiles: &TileOverride,
        tr: &mut Tracker<'_>,
    ) -> Result<(), MixError> {
        let sh = self.shape;
        let gated = sh.gated();
        let blas = self.gate_blas_for(tiles, &[Stage::FwdGate], Stage::FwdGateAct)?;
        let layer_kernels = if gated > 0 {
            Some((
                self.select(Stage::FwdM0, tiles)?,
                self.select(if blas.is_some() { Stage::FwdGateAct } else { Stage::FwdGate }, tiles)?,
                self.select(Stage::FwdM1, tiles)?,
            ))
        } else {
            None
        };
        let k_final = self.select(Stage::FwdFinal, tiles)?;
        let (row, lg) = (sh.row(), sh.lg());
        let sz = std::mem::size_of::<T>() as u64;
        let z_stride = sh.surface_len(e)? as u64 * sz;
        // Weight guards live until every launch is enqueued, so their read
        // events are recorded after the kernels that read them.
        let (w0, _r0) = self.w0.device_ptr(stream);
        let (w1, _r1) = self.w1.device_ptr(stream);
        let gw_guard = self.gw.as_ref().map(|g| g.device_ptr(stream));
        let gw = gw_guard.as_ref().map_or(0, |(p, _)| *p);
        let w = LayerWeights { m0: w0, m1: w1, gw, gwt: 0 };

        // Scratch per row: the ping-pong pair of u (one suffices for a single
        // gated layer) and the gate surface sig; a chunk also stages its
        // rows of `out` and its column of alpha (edge-major tensors).
        let per_row = if gated == 0 { 0 } else { row * gated.min(2) + lg };
        let chunking = self.chunking(e, per_row, per_row + row + 1)?;
        *lock(&self.last_forward_chunking) = Some(chunking);
        let rows = match chunking {
            Chunking::Whole => sh.f * e,
            Chunking::Chunks { rows } => rows,
        };
        let u_a = if gated >= 1 { Some(tr.scratch::<T>(rows * row, "u (ping)")?) } else { None };
        let u_b = if gated >= 2 { Some(tr.scratch::<T>(rows * row, "u (pong)")?) } else { None };
        let sig = if gated >= 1 { Some(tr.scratch::<T>(rows * lg, "sig")?) } else { None };
        let scratch = [&u_a, &u_b, &sig].map(|b| b.as_ref().map_or(0, |b| raw_ptr(b, stream)));

        match chunking {
            Chunking::Whole => {
                let span = Span { rows: e, foci: sh.f, focus: 0 };
                let u = self.forward_layers(stream, span, layer_kernels, blas, &w, p.u0, p.z_all, z_stride, scratch)?;
                self.forward_final(stream, span, k_final, &w, u, p.alpha, p.out, apply_alpha)?;
            }
            Chunking::Chunks { rows } => {
                let out_stage = tr.scratch::<T>(rows * row, "out (chunk)")?;
                let alpha_stage = tr.scratch::<T>(rows, "alpha (chunk)")?;
                let (po, pa) = (raw_ptr(&out_stage, stream), raw_ptr(&alpha_stage, stream));
                for focus in 0..sh.f {
                    for (e0, n) in chunk::windows(e, rows) {
                        let span = Span { rows: n, foci: 1, focus };
                        let at = self.focus_rows(e, focus, e0, row);
                        let u = self.forward_layers(
                            stream,
                            span,
                            layer_kernels,
                            blas,
                            &w,
                            p.u0 + at,
                            p.z_all + at,
                            z_stride,
                            scratch,
                        )?;
                        // alpha[e0.., focus] -> a column; the chunk's rows of
                        // out leave through a pitched copy.
                        let edge_pitch = sh.f * row * sz as usize;
                        let edge_at = ((e0 * sh.f + focus) * sz as usize) as u64;
                        if apply_alpha {
                            copy_2d(stream, p.alpha + edge_at, sh.f * sz as usize, pa, sz as usize, sz as usize, n)?;
                        }
                        self.forward_final(stream, span, k_final, &w, u, pa, po, apply_alpha)?;
                        let out_at = edge_at * row as u64;
                        let row_bytes = row * sz as usize;
                        copy_2d(stream, po, row_bytes, p.out + out_at, edge_pitch, row_bytes, n)?;
                    }
                }
                tr.release(out_stage);
                tr.release(alpha_stage);
            }
        }
        for b in [u_a, u_b, sig].into_iter().flatten() {
            tr.release(b);
        }
        Ok(())
    }

    /// The gated layers of the forward over `span`; returns where u ends.
    /// `u0` and `z0` address the span's rows of u0 and of z_all's layer 0.
    #[allow(clippy::too_many_arguments)]
    fn forward_layers(
        &self,
        stream: &Arc<CudaStream>,
        span: Span,
        kernels: Option<(&'static KernelEntry, &'static KernelEntry, &'static KernelEntry)>,
        blas: Option<&GateBlas>,
        w: &LayerWeights,
        u0: CUdeviceptr,
        z0: CUdeviceptr,
        z_stride: u64,
        [pa, pb, psig]: [CUdeviceptr; 3],
    ) -> Result<CUdeviceptr, MixError> {
        let Some((k_m0, k_gate, k_m1)) = kernels else { return Ok(u0) };
        let sh = StackShape { f: span.foci, ..self.shape };
        let (f, e, m0, m1) = (span.foci, span.rows, sh.m0(), sh.m1());
        let ea = Arg::I64(e as i64);
        let la = Arg::I32(sh.lmax as i32);
        let mut u = u0;
        for k in 0..sh.gated() {
            let u_next = if k % 2 == 0 { pa } else { pb };
            let z_k = z0 + k as u64 * z_stride;
            let (o0, o1, og) = self.layer_offsets(k, span.focus);
            self.kernels.launch(stream, k_m0, e, m0, f, &[Arg::Ptr(u), Arg::Ptr(w.m0 + o0), Arg::Ptr(z_k), ea, la])?;
            // fwd_gate_act (after cuBLAS wrote the logits into sig) takes
            // fwd_gate's arguments but GW.
            let (with_gw, act) = (
                [Arg::Ptr(u), Arg::Ptr(z_k), Arg::Ptr(w.gw + og), Arg::Ptr(psig), Arg::Ptr(u_next), ea, la],
                [Arg::Ptr(u), Arg::Ptr(z_k), Arg::Ptr(psig), Arg::Ptr(u_next), ea, la],
            );
            let gate_args: &[Arg] = match blas {
                Some(blas) => {
                    // SAFETY: z_k is layer k of z_all over the span (foci x E x ROW),
                    // gw + og the span's (Cf, LG) blocks, sig foci x E x LG.
                    self.kernels.external(stream, Stage::FwdGateAct, "cublas gemm: logit = s @ GW", || unsafe {
                        blas.projection::<T>(stream, &sh, e, z_k, w.gw + og, psig)
                    })?;
                    &act
                }
                None => &with_gw,
            };
            self.kernels.launch(stream, k_gate, e, 0, f, gate_args)?;
            self.kernels.launch(
                stream,
                k_m1,
                e,
                m1,
                f,
                &[Arg::Ptr(u), Arg::Ptr(w.m1 + o1), Arg::Ptr(psig), Arg::Ptr(z_k), Arg::Ptr(u_next), ea, la],
            )?;
            u = u_next;
        }
        Ok(u)
    }

    /// The forward's identity layer over `span`: out (edge-major over the
    /// span's foci) from u.
    #[allow(clippy::too_many_arguments)]
    fn forward_final(
        &self,
        stream: &Arc<CudaStream>,
        span: Span,
        k_final: &'static KernelEntry,
        w: &LayerWeights,
        u: CUdeviceptr,
        alpha: CUdeviceptr,
        out: CUdeviceptr,
        apply_alpha: bool,
    ) -> Result<(), MixError> {
        let sh = self.shape;
        let (o0, o1, _) = self.layer_offsets(sh.n_layers - 1, span.focus);
        let (ea, la, aa) = (Arg::I64(span.rows as i64), Arg::I32(sh.lmax as i32), Arg::I32(apply_alpha as i32));
        for (seg, wp, n) in [(0, w.m0 + o0, sh.m0()), (1, w.m1 + o1, sh.m1())] {
            self.kernels.launch(
                stream,
                k_final,
                span.rows,
                n,
                span.foci,
                &[Arg::Ptr(u), Arg::Ptr(wp), Arg::Ptr(alpha), Arg::Ptr(out), ea, la, Arg::I32(seg), aa],
            )?;
        }
        Ok(())
    }

    fn backward_core(
        &self,
        stream: &Arc<CudaStream>,
        e: usize,
        p: &BackwardPtrs,
        apply_alpha: bool,
        plan: &BwdPlan,
        tr: &mut Tracker<'_>,
    ) -> Result<(), MixError> {
        let sh = self.shape;
        let gated = sh.gated();
        let (f, m0, m1, row, lg) = (sh.f, sh.m0(), sh.m1(), sh.row(), sh.lg());
        let sz = std::mem::size_of::<T>() as u64;
        let z_stride = sh.surface_len(e)? as u64 * sz;
        let ea = Arg::I64(e as i64);
        let la = Arg::I32(sh.lmax as i32);
        let aa = Arg::I32(apply_alpha as i32);
        let (wt0, _r0) = self.wt0.device_ptr(stream);
        let (wt1, _r1) = self.wt1.device_ptr(stream);
        let gw_guard = self.gw.as_ref().map(|g| g.device_ptr(stream));
        let gw = gw_guard.as_ref().map_or(0, |(p, _)| *p);
        let gwt_guard = self.gwt.as_ref().map(|g| g.device_ptr(stream));
        let gwt = gwt_guard.as_ref().map_or(0, |(p, _)| *p);
        let w = LayerWeights { m0: wt0, m1: wt1, gw, gwt };

        // Scratch per row: the g ping-pong partner, and on the relay sig and
        // gz (and g_logit where cuBLAS runs the gate GEMMs).
        let relay = plan.decision.path == Path::Relay;
        let per_row = match gated {
            0 => 0,
            _ if relay => 2 * row + lg * (1 + plan.gate_blas as usize),
            _ => row,
        };
        let chunking = self.chunking(e, per_row, per_row)?;
        *lock(&self.last_backward_chunking) = Some(chunking);

        // grad_alpha
        if apply_alpha {
            self.kernels.launch(
                stream,
                plan.grad_alpha,
                e,
                0,
                f,
                &[Arg::Ptr(p.grad_out), Arg::Ptr(p.out), Arg::Ptr(p.alpha), Arg::Ptr(p.grad_alpha), ea, la],
            )?;
        } else {
            let bytes = sh.alpha_len(e)? * std::mem::size_of::<T>();
            self.ctx.bind_to_thread().during(|| "binding the context".into())?;
            // SAFETY: grad_alpha holds E*F elements (caller contract).
            unsafe { cudarc::driver::result::memset_d8_async(p.grad_alpha, 0, bytes, stream.cu_stream()) }
                .during(|| format!("zeroing grad_alpha ({bytes} bytes)"))?;
        }

        let rows = match chunking {
            Chunking::Whole => f * e,
            Chunking::Chunks { rows } => rows,
        };
        let g_scratch = if gated > 0 { Some(tr.scratch::<T>(rows * row, "g (ping-pong)")?) } else { None };
        let (sig, gz, glog) = if gated > 0 && relay {
            (
                Some(tr.scratch::<T>(rows * lg, "sig")?),
                Some(tr.scratch::<T>(rows * row, "gz")?),
                if plan.gate_blas { Some(tr.scratch::<T>(rows * lg, "g_logit")?) } else { None },
            )
        } else {
            (None, None, None)
        };
        let gs = g_scratch.as_ref().map_or(0, |b| raw_ptr(b, stream));
        let scratch = [&sig, &gz, &glog].map(|b| b.as_ref().map_or(0, |b| raw_ptr(b, stream)));

        // The final identity layer writes g, with the ping-pong parity chosen
        // so that the last layer's write lands in grad_u0; a chunked walk
        // starts every chunk from grad_u0 (copied to scratch if the parity
        // asks for it).
        let odd = !gated.is_multiple_of(2);
        let g_final = if chunking == Chunking::Whole && odd { gs } else { p.grad_u0 };
        let (o0, o1, _) = self.layer_offsets(sh.n_layers - 1, 0);
        for (seg, wt, n) in [(0, wt0 + o0, m0), (1, wt1 + o1, m1)] {
            self.kernels.launch(
                stream,
                plan.final_,
                e,
                n,
                f,
                &[Arg::Ptr(p.grad_out), Arg::Ptr(p.alpha), Arg::Ptr(wt), Arg::Ptr(g_final), ea, la, Arg::I32(seg), aa],
            )?;
        }

        if gated > 0 {
            match chunking {
                Chunking::Whole => {
                    let span = Span { rows: e, foci: f, focus: 0 };
                    let (g, g_next) = if odd { (gs, p.grad_u0) } else { (p.grad_u0, gs) };
                    let last = self.backward_layers(stream, span, plan, &w, g, g_next, p.z_all, z_stride, scratch)?;
                    debug_assert_eq!(last, p.grad_u0, "the last backward write must land in grad_u0");
                }
                Chunking::Chunks { rows } => {
                    for focus in 0..f {
                        for (e0, n) in chunk::windows(e, rows) {
                            let span = Span { rows: n, foci: 1, focus };
                            let at = self.focus_rows(e, focus, e0, row);
                            let g0 = p.grad_u0 + at;
                            let (g, g_next) = if odd {
                                self.ctx.bind_to_thread().during(|| "binding the context".into())?;
                                let bytes = n * row * sz as usize;
                                // SAFETY: both ranges hold n rows (grad_u0's window, the chunk scratch).
                                unsafe { cudarc::driver::result::memcpy_dtod_async(gs, g0, bytes, stream.cu_stream()) }
                                    .during(|| format!("copying a chunk of g ({bytes} bytes)"))?;
                                (gs, g0)
                            } else {
                                (g0, gs)
                            };
                            let last = self.backward_layers(
                                stream,
                                span,
                                plan,
                                &w,
                                g,
                                g_next,
                                p.z_all + at,
                                z_stride,
                                scratch,
                            )?;
                            debug_assert_eq!(last, g0, "the last backward write must land in grad_u0");
                        }
                    }
                }
            }
        }
        for b in [g_scratch, sig, gz, glog].into_iter().flatten() {
            tr.release(b);
        }
        Ok(())
    }

    /// The gated layers of the backward over `span`, from g (ping-ponging
    /// with g_next); returns where the last layer wrote. `z0` addresses the
    /// span's rows of z_all's layer 0; `scratch` is (sig, gz, g_logit), used
    /// by the relay.
    #[allow(clippy::too_many_arguments)]
    fn backward_layers(
        &self,
        stream: &Arc<CudaStream>,
        span: Span,
        plan: &BwdPlan,
        w: &LayerWeights,
        mut g: CUdeviceptr,
        mut g_next: CUdeviceptr,
        z0: CUdeviceptr,
        z_stride: u64,
        [psig, pgz, pglog]: [CUdeviceptr; 3],
    ) -> Result<CUdeviceptr, MixError> {
        let sh = StackShape { f: span.foci, ..self.shape };
        let (f, e, m0, m1) = (span.foci, span.rows, sh.m0(), sh.m1());
        let ea = Arg::I64(e as i64);
        let la = Arg::I32(sh.lmax as i32);
        for k in (0..sh.gated()).rev() {
            let z_k = z0 + k as u64 * z_stride;
            let (o0, o1, og) = self.layer_offsets(k, span.focus);
            let gw_k = w.gw + og;
            match plan.decision.path {
                Path::Relay => {
                    // The plan's choice (made once per call, g_logit allocated
                    // for it), not the switch's now.
                    match (plan.gate_blas, &self.gate_blas) {
                        (true, Ok(blas)) => {
                            let k_glogit = plan.layer[0];
                            // SAFETY: z_k is layer k of z_all over the span (foci x E x ROW),
                            // gw_k the span's (Cf, LG) blocks, sig and g_logit foci x E x LG,
                            // gz foci x E x ROW.
                            self.kernels.external(
                                stream,
                                Stage::BwdGlogit,
                                "cublas gemm: logit = s @ GW",
                                || unsafe { blas.projection::<T>(stream, &sh, e, z_k, gw_k, psig) },
                            )?;
                            self.kernels.launch(
                                stream,
                                k_glogit,
                                e,
                                0,
                                f,
                                &[Arg::Ptr(g), Arg::Ptr(z_k), Arg::Ptr(psig), Arg::Ptr(pglog), Arg::Ptr(pgz), ea, la],
                            )?;
                            self.kernels.external(
                                stream,
                                Stage::BwdGlogit,
                                "cublas gemm: gz_s += g_logit @ GW^T",
                                || unsafe { blas.logit_contraction::<T>(stream, &sh, e, pglog, gw_k, pgz) },
                            )?;
                        }
                        _ => {
                            let (k_rec, k_pw) = (plan.layer[0], plan.layer[1]);
                            self.kernels.launch(
                                stream,
                                k_rec,
                                e,
                                0,
                                f,
                                &[Arg::Ptr(z_k), Arg::Ptr(gw_k), Arg::Ptr(psig), ea, la],
                            )?;
                            self.kernels.launch(
                                stream,
                                k_pw,
                                e,
                                0,
                                f,
                                &[
                                    Arg::Ptr(g),
                                    Arg::Ptr(z_k),
                                    Arg::Ptr(psig),
                                    Arg::Ptr(w.gwt + og),
                                    Arg::Ptr(pgz),
                                    ea,
                                    la,
                                ],
                            )?;
                        }
                    }
                    let k_gemm = plan.layer[plan.layer.len() - 1];
                    for (seg, wt, n) in [(0, w.m0 + o0, m0), (1, w.m1 + o1, m1)] {
                        self.kernels.launch(
                            stream,
                            k_gemm,
                            e,
                            n,
                            f,
                            &[Arg::Ptr(pgz), Arg::Ptr(g), Arg::Ptr(wt), Arg::Ptr(g_next), ea, la, Arg::I32(seg)],
                        )?;
                    }
                }
                Path::Fused => {
                    // n = 0: the kernel walks whole row blocks (both segments).
                    self.kernels.launch(
                        stream,
                        plan.layer[0],
                        e,
                        0,
                        f,
                        &[
                            Arg::Ptr(g),
                            Arg::Ptr(z_k),
                            Arg::Ptr(gw_k),
                            Arg::Ptr(w.gwt + og),
                            Arg::Ptr(w.m0 + o0),
                            Arg::Ptr(w.m1 + o1),
                            Arg::Ptr(g_next),
                            ea,
                            la,
                        ],
                    )?;
                }
            }
            std::mem::swap(&mut g, &mut g_next);
        }
        Ok(g)
    }
}

/// The rows one launch sequence covers: `rows` edges of `foci` foci from
/// focus `focus` on (the whole call: every focus; a chunk: one).
#[derive(Clone, Copy, Debug)]
struct Span {
    rows: usize,
    foci: usize,
    focus: usize,
}

/// Device addresses of the stack's weights for one call: W0 and W1 (or
/// their transposes in the backward), GW and its transpose.
struct LayerWeights {
    m0: CUdeviceptr,
    m1: CUdeviceptr,
    gw: CUdeviceptr,
    gwt: CUdeviceptr,
}

/// A pitched device-to-device copy of `height` rows of `width` bytes.
fn copy_2d(
    stream: &CudaStream,
    src: CUdeviceptr,
    src_pitch: usize,
    dst: CUdeviceptr,
    dst_pitch: usize,
    width: usize,
    height: usize,
) -> Result<(), MixError> {
    use cudarc::driver::sys;
    // SAFETY: all-zero is a valid CUDA_MEMCPY2D (host pointers null, no
    // arrays); the device fields are set below.
    let mut c: sys::CUDA_MEMCPY2D = unsafe { std::mem::zeroed() };
    c.srcMemoryType = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE;
    c.srcDevice = src;
    c.srcPitch = src_pitch;
    c.dstMemoryType = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE;
    c.dstDevice = dst;
    c.dstPitch = dst_pitch;
    c.WidthInBytes = width;
    c.Height = height;
    stream.context().bind_to_thread().during(|| "binding the context".into())?;
    // SAFETY: both ranges are device memory the caller sized for `height`
    // rows at their pitches.
    unsafe { sys::cuMemcpy2DAsync_v2(&c, stream.cu_stream()) }
        .result()
        .during(|| format!("a pitched copy of {height} rows of {width} bytes"))
}

impl<T: Element> Drop for Stack<T> {
    /// Waits for the context's work before the weights are freed and the
    /// modules unloaded (work on a stream other than the construction one
    /// may still read them).
    fn drop(&mut self) {
        let _ = self.ctx.synchronize();
    }
}

/// What one backward call launches.
struct BwdPlan {
    decision: PathDecision,
    grad_alpha: &'static KernelEntry,
    final_: &'static KernelEntry,
    /// Per gated layer: relay [recompute, pointwise, gemm], relay with the
    /// gate GEMMs by cuBLAS [glogit, gemm], or fused [fused]; empty when
    /// there is no gated layer.
    layer: Vec<&'static KernelEntry>,
    gate_blas: bool,
}

/// Check (F, Cf, lmax, n_layers) against the limits and the table: every
/// forward and relay stage the shape needs must have an accepted kernel.
pub fn validate_shape<T: Element>(dispatch: &Dispatch<'_>, shape: &StackShape) -> Result<(), MixError> {
    if shape.f == 0 || shape.f > MAX_F {
        return Err(MixError::UnsupportedShape {
            param: ShapeParam::F,
            value: shape.f as u64,
            supported: format!("1..={MAX_F}"),
        });
    }
    if shape.n_layers == 0 {
        return Err(MixError::UnsupportedShape {
            param: ShapeParam::NLayers,
            value: 0,
            supported: ">= 1 (the last layer is the identity layer)".into(),
        });
    }
    let lmax = u32::try_from(shape.lmax).unwrap_or(u32::MAX);
    dispatch.check_lmax(lmax)?;
    let cf = u32::try_from(shape.cf).unwrap_or(u32::MAX);
    let none = TileOverride::new();
    for stage in FORWARD_STAGES.iter().chain(RELAY_STAGES.iter()) {
        if (shape.gated() == 0 && is_gated_stage(*stage)) || stage.optional() {
            continue;
        }
        dispatch.select(*stage, T::DTYPE, cf, lmax, &none)?;
    }
    Ok(())
}
