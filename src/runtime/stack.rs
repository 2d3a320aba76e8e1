//! [`Stack`]: the mixing stack on one CUDA context — weights uploaded once,
//! forward and backward launched on the caller's stream.
//!
//! Launch sequences are those of docs/KERNELS.md; see [`Stack::forward_raw`]
//! and [`Stack::backward_raw`].

use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::sys::{CUdevice_attribute, CUdeviceptr};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};

use super::chunk::{Chunking, ScratchCap};
use super::dispatch::{
    forward_stages, is_gated_stage, needs_cublas, relay_stages, Dispatch, PathDecision, TileOverride,
};
use super::element::Element;
use super::error::{check_len, DriverContext, MixError, ShapeParam};
use super::exec::{self, Env, Io};
use super::fault::Fault;
use super::gate_blas::{GateBlas, GateGemm};
use super::launch::{KernelTiming, Kernels};
use super::memory::{CallMemory, ScratchPool, Tracker};
use super::plan::{self, BackwardChoice, Machine, Planner};
use super::precision::PrecisionMode;
use super::shape::{StackShape, MAX_F, MAX_LAYERS};
use super::switch::FusedMode;
use super::table::{KernelEntry, Precision};
use super::weights::Weights;

/// Options of one forward call.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ForwardOptions {
    /// The GEMMs' arithmetic (default: read the environment, exact if unset).
    pub precision: PrecisionMode,
    /// Per-stage kernel overrides of the forward stages (default: none).
    pub tiles: TileOverride,
}

impl ForwardOptions {
    pub fn with_precision(mut self, precision: Precision) -> Self {
        self.precision = PrecisionMode::Set(precision);
        self
    }
    pub fn with_tiles(mut self, tiles: TileOverride) -> Self {
        self.tiles = tiles;
        self
    }
}

/// Options of one backward call.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BackwardOptions {
    /// Whether the fused path is requested (default: read the environment).
    pub fused: FusedMode,
    /// The GEMMs' arithmetic (default: read the environment, exact if unset).
    pub precision: PrecisionMode,
    /// Per-stage kernel overrides (default: none).
    pub tiles: TileOverride,
}

impl BackwardOptions {
    /// Relay, whatever the environment says.
    pub fn relay() -> Self {
        BackwardOptions { fused: FusedMode::Off, ..Self::default() }
    }
    /// Fused requested where measured faster, whatever the environment
    /// says (the relay elsewhere, and outside the fused regime).
    pub fn fused() -> Self {
        BackwardOptions { fused: FusedMode::On, ..Self::default() }
    }
    /// Fused requested wherever its kernels serve the shape (the relay
    /// outside the fused regime only): to measure or test the kernels.
    pub fn fused_always() -> Self {
        BackwardOptions { fused: FusedMode::Always, ..Self::default() }
    }
    pub fn with_precision(mut self, precision: Precision) -> Self {
        self.precision = PrecisionMode::Set(precision);
        self
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

impl<T, P> Checked<T, P> {
    /// These buffers with the weights the call borrows, checked for the same
    /// shape (non-null where it needs them).
    pub fn with_weights<W: CallWeights>(self, weights: W) -> Result<Checked<T, (P, W)>, MixError> {
        if self.e > 0 {
            weights.check(&self.shape)?;
        }
        Ok(Checked { shape: self.shape, e: self.e, ptrs: (self.ptrs, weights), elem: PhantomData })
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

/// The buffers of a raw call ([`ForwardPtrs`], [`BackwardPtrs`]), checked
/// again where a call checked for one shape reaches a stack of another.
trait RawPtrs: Copy {
    fn check_for<T: Element>(self, shape: StackShape, e: usize) -> Result<Checked<T, Self>, MixError>;
}
impl RawPtrs for ForwardPtrs {
    fn check_for<T: Element>(self, shape: StackShape, e: usize) -> Result<Checked<T, Self>, MixError> {
        self.check(shape, e)
    }
}
impl RawPtrs for BackwardPtrs {
    fn check_for<T: Element>(self, shape: StackShape, e: usize) -> Result<Checked<T, Self>, MixError> {
        self.check(shape, e)
    }
}

/// Device weights one call borrows instead of the stack's own (layouts of
/// [`Stack::new`]): the forward reads W0, W1 and GW.
#[derive(Clone, Copy, Debug)]
pub struct ForwardWeights {
    /// (n_layers, F, M0, M0)
    pub w0: CUdeviceptr,
    /// (n_layers, F, M1, M1)
    pub w1: CUdeviceptr,
    /// (n_layers-1, F, Cf, LG); may be 0 when n_layers == 1
    pub gw: CUdeviceptr,
}

/// Device weights one backward call borrows: the transposes it reads,
/// wt[k][f][o][i] = W[k][f][i][o] and gwt[k][f][c][j] = GW[k][f][j][c], and GW.
#[derive(Clone, Copy, Debug)]
pub struct BackwardWeights {
    /// (n_layers, F, M0, M0), transposed blocks
    pub wt0: CUdeviceptr,
    /// (n_layers, F, M1, M1), transposed blocks
    pub wt1: CUdeviceptr,
    /// (n_layers-1, F, Cf, LG); may be 0 when n_layers == 1
    pub gw: CUdeviceptr,
    /// (n_layers-1, F, LG, Cf); may be 0 when n_layers == 1
    pub gwt: CUdeviceptr,
}

/// The weights one call borrows ([`ForwardWeights`], [`BackwardWeights`]).
pub trait CallWeights: Copy {
    /// Every pointer the shape needs is non-null.
    fn check(&self, shape: &StackShape) -> Result<(), MixError>;
}

impl CallWeights for ForwardWeights {
    fn check(&self, shape: &StackShape) -> Result<(), MixError> {
        nonnull(self.w0, "w0")?;
        nonnull(self.w1, "w1")?;
        if shape.gated() > 0 {
            nonnull(self.gw, "gw")?;
        }
        Ok(())
    }
}

impl ForwardWeights {
    fn bind(&self, io: &mut Io) {
        (io.w0, io.w1, io.gw) = (self.w0, self.w1, self.gw);
    }
}

impl CallWeights for BackwardWeights {
    fn check(&self, shape: &StackShape) -> Result<(), MixError> {
        nonnull(self.wt0, "wt0")?;
        nonnull(self.wt1, "wt1")?;
        if shape.gated() > 0 {
            nonnull(self.gw, "gw")?;
            nonnull(self.gwt, "gwt")?;
        }
        Ok(())
    }
}

impl BackwardWeights {
    fn bind(&self, io: &mut Io) {
        (io.wt0, io.wt1, io.gw, io.gwt) = (self.wt0, self.wt1, self.gw, self.gwt);
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

/// The SO(2) mixing stack for element type `T` (f32 or f64) on one context.
pub struct Stack<T: Element> {
    ctx: Arc<CudaContext>,
    shape: StackShape,
    dispatch: Dispatch<'static>,
    /// W0, W1, GW and their transposes, on the device (weights.rs); `None`
    /// for a stack that borrows the weights of each call.
    weights: Option<Weights<T>>,
    kernels: Kernels,
    /// Scratch and outputs of every call come from here (kept mapped).
    pool: Option<ScratchPool>,
    last_path: Mutex<Option<PathDecision>>,
    last_forward_precision: Mutex<Option<Precision>>,
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

    /// [`Stack::new`] over another kernel table. `dispatch` is set to serve
    /// the device's arch ([`Dispatch::for_device`]; an arch set on it is
    /// replaced) and, unless it already has a shared-memory limit, the
    /// device's opt-in limit.
    pub fn with_dispatch(
        stream: &Arc<CudaStream>,
        dispatch: Dispatch<'static>,
        shape: StackShape,
        w0: &[T],
        w1: &[T],
        gw: &[T],
    ) -> Result<Self, MixError> {
        let dispatch = Self::device_dispatch(stream, dispatch, &shape)?;
        let weights = Weights::upload(stream, &shape, w0, w1, gw)?;
        Self::build(stream, dispatch, shape, Some(weights))
    }

    /// A stack that holds no weights: every call borrows them
    /// ([`Stack::forward_raw_with`], [`Stack::backward_raw_with`]), as a
    /// model that assembles its weights from live parameters passes them.
    pub fn borrowing(stream: &Arc<CudaStream>, shape: StackShape) -> Result<Self, MixError> {
        let dispatch = Self::device_dispatch(stream, Dispatch::builtin(), &shape)?;
        Self::build(stream, dispatch, shape, None)
    }

    /// `dispatch` serving the device's architecture, limited to its opt-in
    /// shared memory and keyed to its name (unless set already), and the
    /// shape checked against it.
    fn device_dispatch(
        stream: &Arc<CudaStream>,
        dispatch: Dispatch<'static>,
        shape: &StackShape,
    ) -> Result<Dispatch<'static>, MixError> {
        let dispatch = dispatch.for_device(super::device::compute_capability(stream.context())?)?;
        let dispatch = match dispatch.smem_limit() {
            Some(_) => dispatch,
            None => {
                let optin = stream
                    .context()
                    .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
                    .during(|| "querying the opt-in shared memory limit".into())?;
                dispatch.with_smem_limit(Some(optin.max(0) as u64))
            }
        };
        // The defaults tiles.yaml keys by GPU: matched against this device's name.
        let dispatch = match dispatch.gpu() {
            Some(_) => dispatch,
            None => dispatch.with_gpu(Some(super::device::device_name(stream.context())?)),
        };
        validate_shape::<T>(&dispatch, shape)?;
        Ok(dispatch)
    }

    fn build(
        stream: &Arc<CudaStream>,
        dispatch: Dispatch<'static>,
        shape: StackShape,
        weights: Option<Weights<T>>,
    ) -> Result<Self, MixError> {
        let ctx = stream.context().clone();
        let gate_blas = plan::gate_blas_eligible(&dispatch, &shape, T::DTYPE).and_then(|()| GateBlas::new(stream));

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
            weights,
            last_path: Mutex::new(None),
            last_forward_precision: Mutex::new(None),
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
        self.weights.as_ref().map_or(0, Weights::bytes)
    }

    /// Path decision of the last backward call (`None` before the first);
    /// its `precision` is the mode that call ran.
    pub fn last_path(&self) -> Option<PathDecision> {
        *lock(&self.last_path)
    }
    /// The mode the last forward call ran (`None` before the first).
    pub fn last_forward_precision(&self) -> Option<Precision> {
        *lock(&self.last_forward_precision)
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

    /// The path and the kernels a backward call with `opts` would launch
    /// (reads the environment for [`FusedMode::FromEnv`]); launches nothing.
    pub fn backward_plan(&self, opts: &BackwardOptions) -> Result<(PathDecision, Vec<&'static KernelEntry>), MixError> {
        let c = self.backward_choice(opts, true)?;
        let mut v = vec![c.grad_alpha, c.final_];
        v.extend(c.layer.iter().copied());
        Ok((c.decision, v))
    }

    fn backward_choice(&self, opts: &BackwardOptions, own_weights: bool) -> Result<BackwardChoice, MixError> {
        let dispatch = self.dispatch_in(opts.precision, own_weights)?;
        self.planner(&dispatch).backward_choice(opts.fused.requested()?, &opts.tiles, self.blas().is_some())
    }

    /// This stack's dispatch in the call's mode, checked: the mode serves
    /// this dtype, Cf and arch, and the stack's own weights (when the call
    /// uses them) lie in its range.
    fn dispatch_in(&self, mode: PrecisionMode, own_weights: bool) -> Result<Dispatch<'static>, MixError> {
        let precision = mode.resolve()?;
        let dispatch = self.dispatch.with_precision(precision);
        dispatch.check_precision(T::DTYPE, self.shape.cf as u32)?;
        if let (Some(limit), Some(w), true) = (precision.max_abs_operand(), &self.weights, own_weights) {
            if w.gemm_max_abs.is_nan() || w.gemm_max_abs > limit {
                return Err(MixError::WeightRange { precision, tensor: "w0, w1", max_abs: w.gemm_max_abs, limit });
            }
        }
        Ok(dispatch)
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
        self.forward_with(stream, u0, alpha, apply_alpha, &ForwardOptions::default())
    }

    /// [`Stack::forward`] with options: the precision, and per-stage kernel
    /// overrides (forward stages only; any candidate of this stack's key in
    /// that mode), for tile sweeps.
    pub fn forward_with(
        &self,
        stream: &Arc<CudaStream>,
        u0: &CudaSlice<T>,
        alpha: &CudaSlice<T>,
        apply_alpha: bool,
        opts: &ForwardOptions,
    ) -> Result<(CudaSlice<T>, CudaSlice<T>), MixError> {
        let (cf, lmax) = (self.shape.cf as u32, self.shape.lmax as u32);
        let dispatch = self.dispatch_in(opts.precision, true)?;
        dispatch.validate_forward_override(T::DTYPE, cf, lmax, &opts.tiles)?;
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
            self.forward_core(stream, e, &ptrs, None, apply_alpha, &dispatch, &opts.tiles, &mut tr)?;
        }
        *lock(&self.last_forward_precision) = Some(dispatch.precision());
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
        let plan = self.backward_choice(opts, true)?;

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
            self.backward_core(stream, e, &ptrs, None, apply_alpha, &plan, &mut tr)?;
        }
        *lock(&self.last_backward) = Some(tr.finish());
        Ok((grad_u0, grad_alpha, plan.decision))
    }

    // ------------------------------------------------------------------
    // Raw API (caller-owned buffers, e.g. behind a C ABI)
    // ------------------------------------------------------------------

    /// `call` as checked for this stack: buffers checked for another shape
    /// (another stack's) are checked again for this one.
    fn for_this_shape<P: RawPtrs>(&self, call: &Checked<T, P>) -> Result<Checked<T, P>, MixError> {
        if call.shape == self.shape {
            Ok(*call)
        } else {
            call.ptrs.check_for(self.shape, call.e)
        }
    }

    /// [`Stack::for_this_shape`] for buffers with borrowed weights, which
    /// are checked again too.
    fn for_this_shape_with<P: RawPtrs, W: CallWeights>(
        &self,
        call: &Checked<T, (P, W)>,
    ) -> Result<(Checked<T, P>, W), MixError> {
        let (ptrs, weights) = call.ptrs;
        if call.shape != self.shape {
            weights.check(&self.shape)?;
        }
        Ok((self.for_this_shape(&Checked { shape: call.shape, e: call.e, ptrs, elem: PhantomData })?, weights))
    }

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
        opts: &ForwardOptions,
    ) -> Result<(), MixError> {
        // SAFETY: the caller's contract, as documented above.
        unsafe { self.forward_raw_inner(stream, call, None, apply_alpha, opts) }
    }

    /// [`Stack::forward_raw`] with the weights of this call (a stack made
    /// with [`Stack::borrowing`] has no others; another stack uses these
    /// instead of its own).
    ///
    /// # Safety
    /// As [`Stack::forward_raw`], and every weight pointer addresses device
    /// memory of this context of the size its [`ForwardWeights`] field
    /// documents, unchanged until the enqueued work completes.
    pub unsafe fn forward_raw_with(
        &self,
        stream: &Arc<CudaStream>,
        call: &Checked<T, (ForwardPtrs, ForwardWeights)>,
        apply_alpha: bool,
        opts: &ForwardOptions,
    ) -> Result<(), MixError> {
        let (ptrs, weights) = self.for_this_shape_with(call)?;
        // SAFETY: the caller's contract, as documented above.
        unsafe { self.forward_raw_inner(stream, &ptrs, Some(&weights), apply_alpha, opts) }
    }

    unsafe fn forward_raw_inner(
        &self,
        stream: &Arc<CudaStream>,
        call: &Checked<T, ForwardPtrs>,
        weights: Option<&ForwardWeights>,
        apply_alpha: bool,
        opts: &ForwardOptions,
    ) -> Result<(), MixError> {
        self.check_stream(stream)?;
        let (cf, lmax) = (self.shape.cf as u32, self.shape.lmax as u32);
        let dispatch = self.dispatch_in(opts.precision, weights.is_none())?;
        dispatch.validate_forward_override(T::DTYPE, cf, lmax, &opts.tiles)?;
        let call = self.for_this_shape(call)?;
        let mut tr = Tracker::new(stream, self.pool.as_ref(), &self.kernels.fault, self.poison.load(Ordering::Relaxed));
        if call.e > 0 {
            self.forward_core(stream, call.e, &call.ptrs, weights, apply_alpha, &dispatch, &opts.tiles, &mut tr)?;
        }
        *lock(&self.last_forward_precision) = Some(dispatch.precision());
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
        // SAFETY: the caller's contract, as documented above.
        unsafe { self.backward_raw_inner(stream, call, None, apply_alpha, opts) }
    }

    /// [`Stack::backward_raw`] with the weights of this call, as
    /// [`Stack::forward_raw_with`].
    ///
    /// # Safety
    /// As [`Stack::forward_raw_with`], for the fields of [`BackwardWeights`].
    pub unsafe fn backward_raw_with(
        &self,
        stream: &Arc<CudaStream>,
        call: &Checked<T, (BackwardPtrs, BackwardWeights)>,
        apply_alpha: bool,
        opts: &BackwardOptions,
    ) -> Result<PathDecision, MixError> {
        let (ptrs, weights) = self.for_this_shape_with(call)?;
        // SAFETY: the caller's contract, as documented above.
        unsafe { self.backward_raw_inner(stream, &ptrs, Some(&weights), apply_alpha, opts) }
    }

    unsafe fn backward_raw_inner(
        &self,
        stream: &Arc<CudaStream>,
        call: &Checked<T, BackwardPtrs>,
        weights: Option<&BackwardWeights>,
        apply_alpha: bool,
        opts: &BackwardOptions,
    ) -> Result<PathDecision, MixError> {
        self.check_stream(stream)?;
        let call = self.for_this_shape(call)?;
        let plan = self.backward_choice(opts, weights.is_none())?;
        *lock(&self.last_path) = Some(plan.decision);
        let mut tr = Tracker::new(stream, self.pool.as_ref(), &self.kernels.fault, self.poison.load(Ordering::Relaxed));
        if call.e > 0 {
            self.backward_core(stream, call.e, &call.ptrs, weights, apply_alpha, &plan, &mut tr)?;
        }
        *lock(&self.last_backward) = Some(tr.finish());
        Ok(plan.decision)
    }

    // ------------------------------------------------------------------
    // Launch sequences
    // ------------------------------------------------------------------

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
    /// Tests and sanitizers: launch a persistent kernel (pipe: stream, split,
    /// the fused walk) on at most `cap` blocks (None: as many as are resident),
    /// so that a small problem walks many tiles per block.
    #[doc(hidden)]
    pub fn debug_cap_blocks(&self, cap: Option<u32>) {
        self.kernels.block_cap.store(cap.map_or(0, u64::from), Ordering::Relaxed);
    }
    /// Tests: bytes of the stack's memory pool in use now (None without a pool).
    #[doc(hidden)]
    pub fn debug_pool_used_bytes(&self) -> Result<Option<u64>, MixError> {
        self.pool.as_ref().map(ScratchPool::used_bytes).transpose()
    }

    /// The planner over this stack's shape, dtype and kernel table.
    fn planner<'d>(&self, dispatch: &'d Dispatch<'static>) -> Planner<'d> {
        Planner { shape: self.shape, dtype: T::DTYPE, dispatch }
    }

    /// What this stack offers a call's plan now.
    fn machine(&self) -> Result<Machine, MixError> {
        Ok(Machine { cublas: self.blas().is_some(), scratch_cap: self.scratch_cap()? })
    }

    /// What a plan runs on: this stack's kernels and cuBLAS.
    fn exec_env(&self) -> Env<'_> {
        Env { shape: self.shape, kernels: &self.kernels, gate_blas: self.gate_blas.as_ref() }
    }

    /// The stack's own weights into `io` (guards to keep until the work is
    /// enqueued), or the error of a stack that borrows them.
    fn own_weights<'a>(
        &'a self,
        stream: &'a CudaStream,
        io: &mut Io,
        backward: bool,
    ) -> Result<Vec<SyncOnDrop<'a>>, MixError> {
        let w = self.weights.as_ref().ok_or(MixError::NoWeights)?;
        Ok(w.bind(stream, io, backward))
    }

    #[allow(clippy::too_many_arguments)]
    fn forward_core(
        &self,
        stream: &Arc<CudaStream>,
        e: usize,
        p: &ForwardPtrs,
        weights: Option<&ForwardWeights>,
        apply_alpha: bool,
        dispatch: &Dispatch<'static>,
        tiles: &TileOverride,
        tr: &mut Tracker<'_>,
    ) -> Result<(), MixError> {
        let mut io = Io { u0: p.u0, alpha: p.alpha, out: p.out, z_all: p.z_all, ..Io::default() };
        let _guards = match weights {
            Some(w) => {
                w.bind(&mut io);
                Vec::new()
            }
            None => self.own_weights(stream, &mut io, false)?,
        };
        let plan = self.planner(dispatch).forward(e, apply_alpha, tiles, &self.machine()?)?;
        *lock(&self.last_forward_chunking) = Some(plan.chunking);
        exec::run_plan::<T>(stream, &plan, &io, &self.exec_env(), tr)
    }

    #[allow(clippy::too_many_arguments)]
    fn backward_core(
        &self,
        stream: &Arc<CudaStream>,
        e: usize,
        p: &BackwardPtrs,
        weights: Option<&BackwardWeights>,
        apply_alpha: bool,
        choice: &BackwardChoice,
        tr: &mut Tracker<'_>,
    ) -> Result<(), MixError> {
        let mut io = Io {
            grad_out: p.grad_out,
            out: p.out,
            z_all: p.z_all,
            alpha: p.alpha,
            grad_u0: p.grad_u0,
            grad_alpha: p.grad_alpha,
            ..Io::default()
        };
        let _guards = match weights {
            Some(w) => {
                w.bind(&mut io);
                Vec::new()
            }
            None => self.own_weights(stream, &mut io, true)?,
        };
        let dispatch = self.dispatch.with_precision(choice.decision.precision);
        let plan = self.planner(&dispatch).backward(e, apply_alpha, choice, &self.machine()?)?;
        *lock(&self.last_backward_chunking) = Some(plan.chunking);
        exec::run_plan::<T>(stream, &plan, &io, &self.exec_env(), tr)
    }
}

impl<T: Element> Drop for Stack<T> {
    /// Waits for the context's work before the weights are freed and the
    /// modules unloaded (work on a stream other than the construction one
    /// may still read them).
    fn drop(&mut self) {
        let _ = self.ctx.synchronize();
    }
}

/// Check (F, Cf, lmax, n_layers) against the limits and the table: every
/// forward and relay stage the shape needs must have an accepted kernel.
/// Within these bounds every weight's byte size fits signed 64-bit offsets
/// (W1, the largest, is under 2^51 bytes at F 65,535, Cf 128, lmax 6, f64 and
/// 1,024 layers).
pub fn validate_shape<T: Element>(dispatch: &Dispatch<'_>, shape: &StackShape) -> Result<(), MixError> {
    if shape.f == 0 || shape.f > MAX_F {
        return Err(MixError::UnsupportedShape {
            param: ShapeParam::F,
            value: shape.f as u64,
            supported: format!("1..={MAX_F}"),
        });
    }
    if shape.n_layers == 0 || shape.n_layers > MAX_LAYERS {
        return Err(MixError::UnsupportedShape {
            param: ShapeParam::NLayers,
            value: shape.n_layers as u64,
            supported: format!("1..={MAX_LAYERS} (the last layer is the identity layer)"),
        });
    }
    let lmax = u32::try_from(shape.lmax).unwrap_or(u32::MAX);
    dispatch.check_lmax(lmax)?;
    let cf = u32::try_from(shape.cf).unwrap_or(u32::MAX);
    let none = TileOverride::new();
    for stage in forward_stages().into_iter().chain(relay_stages()) {
        if (shape.gated() == 0 && is_gated_stage(stage)) || needs_cublas(stage) {
            continue;
        }
        dispatch.select(stage, T::DTYPE, cf, lmax, &none)?;
    }
    Ok(())
}
