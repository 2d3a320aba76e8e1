//! The gate contractions as cuBLAS GEMMs (one focus and at most
//! [`GATE_GEMM_ROWS`] edges per call), for Cf >= [`GATE_BLAS_MIN_CF`].
//!
//! The relay's gate projection s @ GW (E x Cf by Cf x LG) and gate-logit
//! contraction g_logit @ GW^T (E x LG by LG x Cf) run inside the generated
//! row kernels at every Cf: bwd_recompute / fwd_gate and bwd_pointwise,
//! register-tiled dots over one row tile with GW read from L1/L2. That
//! wins while GW is small, and loses once it is not: GW is Cf x L*Cf, and
//! every row tile reads all of it. Measured side by side with cuBLAS's GEMM
//! alone (`mixstack bench --cublas-gate`, BENCH.md run 49, H200):
//! - Cf 32, L 3: bwd_recompute 0.383 ms per launch, cuBLAS projection alone
//!   0.568: the generated kernel wins (and its sigmoid comes free);
//! - Cf 64, L 2: 0.782 against 0.741, before the pass that a cuBLAS
//!   projection needs for the sigmoid: still the generated kernel;
//! - Cf 128, L 6: 5.58 against 3.14, and bwd_pointwise 21.3 ms with its
//!   contraction inside, against 2.66 for cuBLAS's contraction alone.
//!
//! With this path the relay backward takes 0.926x the generated one at
//! Cf 128, L 6 (313.6 against 338.7 ms, E = 323,000, F = 2) and 0.939x at
//! Cf 96, L 3 (108.6 against 115.7 ms, E = 646,000); the forward is even
//! (0.994x and 1.008x: its gate pass is small beside its GEMMs). Run 50,
//! side by side in one bench, BENCH.md.
//!
//! So from Cf 96 (MIXING_STACK.md's threshold: the per-group register dot
//! of the fused path spills from there too) the relay runs both contractions
//! here and the generated stages around them (fwd_gate_act, bwd_glogit):
//! - forward: logit = s @ GW into the sig buffer, then fwd_gate_act (sigmoid
//!   in place, u_next[:, :M0]);
//! - backward: logit = s @ GW into the sig buffer, bwd_glogit (gz, g_logit,
//!   gz[:, :Cf] = g_s * silu'(s)), then gz[:, :Cf] += g_logit @ GW^T.
//!
//! cuBLAS in fp32 runs without TF32 (its default math mode); results differ
//! from the generated path's by summation order only (Cf >= 96 has no fused
//! path, so no bit-for-bit contract applies). cuBLAS is loaded at run time:
//! where the library is missing, the stack keeps the generated kernels and
//! says why ([`GateGemm`]).

use std::sync::{Arc, Mutex};

use cudarc::cublas::{result as blas, sys, CudaBlas};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::CudaStream;

use super::element::Element;
use super::error::MixError;
use super::shape::StackShape;
use super::table::Dtype;

/// The smallest Cf whose gate contractions run as cuBLAS GEMMs.
/// stages.yaml `regime.cublas_gate_from_cf`.
pub const GATE_BLAS_MIN_CF: usize = super::table::CUBLAS_GATE_FROM_CF as usize;

/// The edges of one cuBLAS gate GEMM. cuBLAS picks its kernel, and so a
/// result's summation order, by problem size: the plans run the gate GEMMs
/// one focus at a time, in pieces of this many edges on a grid from edge 0,
/// and a chunk on this path is a multiple of it (chunk.rs). A row's GEMM
/// then has the same size whether the call is chunked or not, and chunked
/// results stay bitwise those of the whole call. Large enough that a piece
/// runs at cuBLAS's full rate (about 1.8 GFLOP at Cf 96, L 3).
pub const GATE_GEMM_ROWS: usize = 32_768;

/// Where a stack's gate contractions run, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GateGemm {
    /// Inside the generated row kernels (fwd_gate, bwd_recompute, bwd_pointwise).
    Generated { why: String },
    /// As cuBLAS GEMMs around fwd_gate_act and bwd_glogit.
    Cublas,
}

/// A cuBLAS handle, pointed at the caller's stream at each call. Public so
/// that `mixstack bench --cublas-gate` times these very calls.
pub struct GateBlas {
    handle: Mutex<CudaBlas>,
}

fn blas_err(during: &str, e: blas::CublasError) -> MixError {
    MixError::Blas { during: during.to_string(), status: format!("{:?}", e.0) }
}

/// The sizes of one call, as the 32-bit ints cuBLAS takes.
struct Sizes {
    f: i32,
    e: i32,
    cf: i32,
    lg: i32,
    row: i32,
}

impl Sizes {
    fn new(sh: &StackShape, e: usize) -> Result<Self, MixError> {
        let int = |x: usize, what| i32::try_from(x).map_err(|_| MixError::BlasSize { what, value: x as u64 });
        Ok(Sizes {
            f: int(sh.f, "F")?,
            e: int(e, "E")?,
            cf: int(sh.cf, "Cf")?,
            lg: int(sh.lg(), "L*Cf")?,
            row: int(sh.row(), "ROW")?,
        })
    }
    /// Elements of `rows` rows of `cols`, one focus's block (64-bit).
    fn block(rows: i32, cols: i32) -> i64 {
        rows as i64 * cols as i64
    }
}

/// One strided-batched GEMM C = op(A) . B + beta C, column-major as cuBLAS
/// sees it (row-major X is column-major X^T), one batch per focus.
struct Batched {
    trans_a: bool,
    m: i32,
    n: i32,
    k: i32,
    ld: (i32, i32, i32),
    stride: (i64, i64, i64),
    batch: i32,
    beta: f64,
}

impl GateBlas {
    /// The reason, where cuBLAS cannot be loaded or started.
    pub fn new(stream: &Arc<CudaStream>) -> Result<Self, String> {
        // SAFETY: only asks whether the shared library can be loaded.
        if !unsafe { sys::is_culib_present() } {
            return Err("the cuBLAS library (libcublas.so) could not be loaded".into());
        }
        let handle = CudaBlas::new(stream.clone()).map_err(|e| format!("cublasCreate failed: {e:?}"))?;
        Ok(GateBlas { handle: Mutex::new(handle) })
    }

    /// # Safety
    /// a, b, c address the extents `g` implies, on `stream`'s context.
    unsafe fn run<T: Element>(
        &self,
        stream: &Arc<CudaStream>,
        g: &Batched,
        (a, b, c): (CUdeviceptr, CUdeviceptr, CUdeviceptr),
        during: &str,
    ) -> Result<(), MixError> {
        let mut h = self.handle.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the stream belongs to the handle's context (checked by the caller).
        unsafe { h.set_stream(stream.clone()) }.map_err(|e| blas_err(during, e))?;
        let ta = if g.trans_a { sys::cublasOperation_t::CUBLAS_OP_T } else { sys::cublasOperation_t::CUBLAS_OP_N };
        let tb = sys::cublasOperation_t::CUBLAS_OP_N;
        // The same call for each element type.
        macro_rules! gemm {
            ($f:path, $t:ty) => {{
                let (one, beta) = (1.0 as $t, g.beta as $t);
                // SAFETY: caller contract.
                unsafe {
                    $f(
                        *h.handle(),
                        ta,
                        tb,
                        g.m,
                        g.n,
                        g.k,
                        &one,
                        a as *const $t,
                        g.ld.0,
                        g.stride.0,
                        b as *const $t,
                        g.ld.1,
                        g.stride.1,
                        &beta,
                        c as *mut $t,
                        g.ld.2,
                        g.stride.2,
                        g.batch,
                    )
                }
            }};
        }
        let r = match T::DTYPE {
            Dtype::F32 => gemm!(blas::sgemm_strided_batched, f32),
            Dtype::F64 => gemm!(blas::dgemm_strided_batched, f64),
        };
        r.map_err(|e| blas_err(during, e))
    }

    /// logit[f] (E x LG) = s[f] @ GW[f], s the first Cf columns of z's rows:
    /// logit^T = GW^T . s^T.
    ///
    /// # Safety
    /// `z`: F blocks of E x ROW; `gw`: F blocks of Cf x LG; `logit`: F x E x
    /// LG; all on `stream`'s context.
    pub unsafe fn projection<T: Element>(
        &self,
        stream: &Arc<CudaStream>,
        sh: &StackShape,
        e: usize,
        z: CUdeviceptr,
        gw: CUdeviceptr,
        logit: CUdeviceptr,
    ) -> Result<(), MixError> {
        let s = Sizes::new(sh, e)?;
        let g = Batched {
            trans_a: false,
            m: s.lg,
            n: s.e,
            k: s.cf,
            ld: (s.lg, s.row, s.lg),
            stride: (Sizes::block(s.cf, s.lg), Sizes::block(s.e, s.row), Sizes::block(s.e, s.lg)),
            batch: s.f,
            beta: 0.0,
        };
        // SAFETY: caller contract.
        unsafe { self.run::<T>(stream, &g, (gw, z, logit), "the gate projection (cuBLAS)") }
    }

    /// gz[f][:, :Cf] += glog[f] (E x LG) @ GW[f]^T: gz^T (Cf x E, rows of
    /// ROW) += GW . glog^T, GW's buffer read transposed.
    ///
    /// # Safety
    /// `glog`: F x E x LG; `gw`: F blocks of Cf x LG; `gz`: F blocks of E x
    /// ROW; all on `stream`'s context.
    pub unsafe fn logit_contraction<T: Element>(
        &self,
        stream: &Arc<CudaStream>,
        sh: &StackShape,
        e: usize,
        glog: CUdeviceptr,
        gw: CUdeviceptr,
        gz: CUdeviceptr,
    ) -> Result<(), MixError> {
        let s = Sizes::new(sh, e)?;
        let g = Batched {
            trans_a: true,
            m: s.cf,
            n: s.e,
            k: s.lg,
            ld: (s.lg, s.lg, s.row),
            stride: (Sizes::block(s.cf, s.lg), Sizes::block(s.e, s.lg), Sizes::block(s.e, s.row)),
            batch: s.f,
            beta: 1.0,
        };
        // SAFETY: caller contract.
        unsafe { self.run::<T>(stream, &g, (gw, glog, gz), "the gate-logit contraction (cuBLAS)") }
    }
}
