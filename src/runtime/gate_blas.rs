//! The gate contractions as cuBLAS GEMMs (strided batched, one batch per
//! focus), for Cf >= [`GATE_BLAS_MIN_CF`].
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
pub const GATE_BLAS_MIN_CF: usize = 96;

/// Where a stack's gate contractions run, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GateGemm {
    /// Inside the generated row kernels (fwd_gate, bwd_recompute, bwd_pointwise).
    Generated { why: String },
    /// As cuBLAS GEMMs around fwd_gate_act and bwd_glogit.
    Cublas,
}

/// A cuBLAS handle, pointed at the caller's stream at each call.
pub(crate) struct GateBlas {
    handle: Mutex<CudaBlas>,
}

// cuBLAS takes int sizes; E, L*Cf and ROW are checked against them here.
fn int(x: usize, what: &'static str) -> Result<i32, MixError> {
    i32::try_from(x).map_err(|_| MixError::BlasSize { what, value: x as u64 })
}

fn blas_err(during: &str, e: blas::CublasError) -> MixError {
    MixError::Blas { during: during.to_string(), status: format!("{:?}", e.0) }
}

/// One strided-batched GEMM, column-major as cuBLAS sees it.
struct Batched {
    trans_a: bool,
    m: i32,
    n: i32,
    k: i32,
    lda: i32,
    ldb: i32,
    ldc: i32,
    stride: (i64, i64, i64),
    batch: i32,
    beta: f64,
}

impl GateBlas {
    /// `None` (with the reason) where cuBLAS cannot be loaded or started.
    pub(crate) fn new(stream: &Arc<CudaStream>) -> Result<Self, String> {
        // SAFETY: only asks whether the shared library can be loaded.
        if !unsafe { sys::is_culib_present() } {
            return Err("the cuBLAS library (libcublas.so) could not be loaded".into());
        }
        let handle = CudaBlas::new(stream.clone()).map_err(|e| format!("cublasCreate failed: {e:?}"))?;
        Ok(GateBlas { handle: Mutex::new(handle) })
    }

    /// # Safety
    /// a, b, c address the extents the config implies (the callers below).
    unsafe fn run<T: Element>(
        &self,
        stream: &Arc<CudaStream>,
        g: &Batched,
        a: CUdeviceptr,
        b: CUdeviceptr,
        c: CUdeviceptr,
        during: &str,
    ) -> Result<(), MixError> {
        let mut h = self.handle.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the stream belongs to the handle's context (checked by the stack).
        unsafe { h.set_stream(stream.clone()) }.map_err(|e| blas_err(during, e))?;
        let op = |t: bool| {
            if t {
                sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let (ta, tb) = (op(g.trans_a), op(false));
        let r = match T::DTYPE {
            Dtype::F32 => {
                let (one, beta) = (1.0f32, g.beta as f32);
                // SAFETY: caller contract.
                unsafe {
                    blas::sgemm_strided_batched(
                        *h.handle(),
                        ta,
                        tb,
                        g.m,
                        g.n,
                        g.k,
                        &one,
                        a as *const f32,
                        g.lda,
                        g.stride.0,
                        b as *const f32,
                        g.ldb,
                        g.stride.1,
                        &beta,
                        c as *mut f32,
                        g.ldc,
                        g.stride.2,
                        g.batch,
                    )
                }
            }
            Dtype::F64 => {
                let (one, beta) = (1.0f64, g.beta);
                // SAFETY: caller contract.
                unsafe {
                    blas::dgemm_strided_batched(
                        *h.handle(),
                        ta,
                        tb,
                        g.m,
                        g.n,
                        g.k,
                        &one,
                        a as *const f64,
                        g.lda,
                        g.stride.0,
                        b as *const f64,
                        g.ldb,
                        g.stride.1,
                        &beta,
                        c as *mut f64,
                        g.ldc,
                        g.stride.2,
                        g.batch,
                    )
                }
            }
        };
        r.map_err(|e| blas_err(during, e))
    }

    /// logit[f] (E x LG) = s[f] @ GW[f], s = the first Cf columns of z's rows.
    /// Row-major X is column-major X^T: logit^T = GW^T . s^T.
    ///
    /// # Safety
    /// `z`: F blocks of E x ROW; `gw`: F blocks of Cf x LG; `logit`: F x E x LG.
    pub(crate) unsafe fn projection<T: Element>(
        &self,
        stream: &Arc<CudaStream>,
        sh: &StackShape,
        e: usize,
        z: CUdeviceptr,
        gw: CUdeviceptr,
        logit: CUdeviceptr,
    ) -> Result<(), MixError> {
        let (cf, lg, row) = (sh.cf, sh.lg(), sh.row());
        let g = Batched {
            trans_a: false,
            m: int(lg, "L*Cf")?,
            n: int(e, "E")?,
            k: int(cf, "Cf")?,
            lda: int(lg, "L*Cf")?,
            ldb: int(row, "ROW")?,
            ldc: int(lg, "L*Cf")?,
            stride: ((cf * lg) as i64, (e as i64) * row as i64, (e as i64) * lg as i64),
            batch: int(sh.f, "F")?,
            beta: 0.0,
        };
        // SAFETY: caller contract.
        unsafe { self.run::<T>(stream, &g, gw, z, logit, "the gate projection (cuBLAS)") }
    }

    /// gz[f][:, :Cf] += glog[f] (E x LG) @ GW[f]^T: gz^T (Cf x E, rows of
    /// ROW) += GW . glog^T, GW's buffer read transposed.
    ///
    /// # Safety
    /// `glog`: F x E x LG; `gw`: F blocks of Cf x LG; `gz`: F blocks of E x ROW.
    pub(crate) unsafe fn logit_contraction<T: Element>(
        &self,
        stream: &Arc<CudaStream>,
        sh: &StackShape,
        e: usize,
        glog: CUdeviceptr,
        gw: CUdeviceptr,
        gz: CUdeviceptr,
    ) -> Result<(), MixError> {
        let (cf, lg, row) = (sh.cf, sh.lg(), sh.row());
        let g = Batched {
            trans_a: true,
            m: int(cf, "Cf")?,
            n: int(e, "E")?,
            k: int(lg, "L*Cf")?,
            lda: int(lg, "L*Cf")?,
            ldb: int(lg, "L*Cf")?,
            ldc: int(row, "ROW")?,
            stride: ((cf * lg) as i64, (e as i64) * lg as i64, (e as i64) * row as i64),
            batch: int(sh.f, "F")?,
            beta: 1.0,
        };
        // SAFETY: caller contract.
        unsafe { self.run::<T>(stream, &g, gw, glog, gz, "the gate-logit contraction (cuBLAS)") }
    }
}
