//! `mixstack bench --cublas-gate`: the relay's two gate contractions done
//! by cuBLAS (SgemmStridedBatched, fp32, one batch per focus), timed side by
//! side with the generated kernels that contain them, on the same inputs:
//! - gate projection s @ GW (E x Cf times Cf x LG), inside bwd_recompute
//!   (which also applies the sigmoid and stores sig);
//! - gate-logit contraction g_logit @ GW^T (E x LG times LG x Cf), inside
//!   bwd_pointwise (which also forms g_logit, gz and the silu' term).
//!
//! cuBLAS's time is that of its GEMM alone; a cuBLAS-based relay would add
//! the sigmoid pass and the g_logit round trip on top. So where a generated
//! kernel takes less than cuBLAS's GEMM alone, it is the faster choice
//! (MIXING_STACK.md asks for cuBLAS at Cf >= 96 unless a generated kernel
//! that does not spill is faster).

use cudarc::cublas::{sys, CudaBlas, Gemm, GemmConfig, StridedBatchedConfig};
use cudarc::driver::{CudaSlice, CudaStream};
use mixstack::kinds::Stage;
use mixstack::runtime::{BackwardOptions, Stack};
use serde::Serialize;
use std::sync::Arc;

use super::bench::Workload;

#[derive(Serialize, Clone, Debug)]
pub struct CublasGate {
    /// Medians over the repetitions, ms per launch (one launch covers every focus).
    pub cublas_projection_ms: f64,
    pub cublas_logit_ms: f64,
    pub recompute_ms: f64,
    pub pointwise_ms: f64,
    pub recompute_kernel: String,
    pub pointwise_kernel: String,
    pub reps: usize,
}

type Error = Box<dyn std::error::Error>;

/// Times the two cuBLAS GEMMs and the relay's bwd_recompute and
/// bwd_pointwise (their first launch, layer n_layers-2), interleaved per
/// repetition. `z_all` from the stack's forward; `gw0`: GW of layer 0, the
/// (F, Cf, LG) block (any weights time the same).
#[allow(clippy::too_many_arguments)]
pub fn time(
    stream: &Arc<CudaStream>,
    w: &Workload,
    stack: &Stack<f32>,
    args: (&CudaSlice<f32>, &CudaSlice<f32>, &CudaSlice<f32>, &CudaSlice<f32>),
    gw0: &CudaSlice<f32>,
    reps: usize,
) -> Result<CublasGate, Error> {
    let (grad_out, out, z_all, alpha) = args;
    // SAFETY: only asks whether the library can be loaded.
    if !unsafe { sys::is_culib_present() } {
        return Err(
            "--cublas-gate: the cuBLAS library (libcublas.so) was not found; add its folder to LD_LIBRARY_PATH".into(),
        );
    }
    let blas = CudaBlas::new(stream.clone())?;
    let (f, e, cf) = (w.f, w.e, w.cf);
    let (lg, row) = (w.lmax * cf, (3 * w.lmax + 1) * cf);
    let int = |x: usize, what: &str| {
        i32::try_from(x).map_err(|_| format!("--cublas-gate: {what} = {x} exceeds cuBLAS's int"))
    };
    let mut sig = stream.alloc_zeros::<f32>(f * e * lg)?;
    let mut gzs = stream.alloc_zeros::<f32>(f * e * cf)?;
    // Row-major X (r x c) is column-major X^T: sig^T (LG x E) = GW^T . s^T,
    // with s the first Cf columns of z_all's rows (ld ROW).
    let proj = StridedBatchedConfig {
        gemm: GemmConfig {
            transa: sys::cublasOperation_t::CUBLAS_OP_N,
            transb: sys::cublasOperation_t::CUBLAS_OP_N,
            m: int(lg, "L*Cf")?,
            n: int(e, "E")?,
            k: int(cf, "Cf")?,
            alpha: 1.0f32,
            lda: int(lg, "L*Cf")?,
            ldb: int(row, "ROW")?,
            beta: 0.0f32,
            ldc: int(lg, "L*Cf")?,
        },
        batch_size: int(f, "F")?,
        stride_a: (cf * lg) as i64,
        stride_b: (e * row) as i64,
        stride_c: (e * lg) as i64,
    };
    // gzs^T (Cf x E) = GW . g_logit^T: GW's buffer read transposed; sig's
    // buffer stands in for g_logit (E x LG).
    let logit = StridedBatchedConfig {
        gemm: GemmConfig {
            transa: sys::cublasOperation_t::CUBLAS_OP_T,
            transb: sys::cublasOperation_t::CUBLAS_OP_N,
            m: int(cf, "Cf")?,
            n: int(e, "E")?,
            k: int(lg, "L*Cf")?,
            alpha: 1.0f32,
            lda: int(lg, "L*Cf")?,
            ldb: int(lg, "L*Cf")?,
            beta: 0.0f32,
            ldc: int(cf, "Cf")?,
        },
        batch_size: int(f, "F")?,
        stride_a: (cf * lg) as i64,
        stride_b: (e * lg) as i64,
        stride_c: (e * cf) as i64,
    };
    let ctx = stream.context();
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let (a, b) = (ctx.new_event(flags)?, ctx.new_event(flags)?);
    let timed = |f: &mut dyn FnMut() -> Result<(), Error>| -> Result<f64, Error> {
        a.record(stream)?;
        f()?;
        b.record(stream)?;
        Ok(a.elapsed_ms(&b)? as f64)
    };
    let relay = BackwardOptions::relay();
    let (mut p, mut l, mut r, mut q) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut rk, mut pk) = (String::new(), String::new());
    const WARMUP: usize = 2;
    for i in 0..WARMUP + reps {
        // SAFETY: every buffer holds what the configs address: z_all's layer
        // 0 is F blocks of E x ROW, gw0 F blocks of Cf x LG, sig F x E x LG,
        // gzs F x E x Cf (all f32, on this stream's context).
        let tp = timed(&mut || Ok(unsafe { blas.gemm_strided_batched(proj, gw0, z_all, &mut sig) }?))?;
        let tl = timed(&mut || Ok(unsafe { blas.gemm_strided_batched(logit, gw0, &sig, &mut gzs) }?))?;
        // The generated gate kernels, even where the stack runs cuBLAS (Cf >= 96).
        stack.set_generated_gate(true);
        stack.set_profiling(true);
        let ran = stack.backward(stream, grad_out, out, z_all, alpha, w.apply_alpha, &relay);
        let t = stack.timings();
        stack.set_profiling(false);
        stack.set_generated_gate(false);
        ran?;
        let t = t?;
        let first = |s: Stage| t.iter().find(|k| k.stage == s).map(|k| (k.ms as f64, k.kernel.to_string()));
        let (Some((tr, nr)), Some((tq, nq))) = (first(Stage::BwdRecompute), first(Stage::BwdPointwise)) else {
            return Err("--cublas-gate needs a gated layer (n_layers >= 2)".into());
        };
        if i >= WARMUP {
            p.push(tp);
            l.push(tl);
            r.push(tr);
            q.push(tq);
            (rk, pk) = (nr, nq);
        }
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    Ok(CublasGate {
        cublas_projection_ms: med(&mut p),
        cublas_logit_ms: med(&mut l),
        recompute_ms: med(&mut r),
        pointwise_ms: med(&mut q),
        recompute_kernel: rk,
        pointwise_kernel: pk,
        reps,
    })
}

pub fn print(g: &CublasGate) {
    println!("gate contractions, ms per launch (all foci), medians of {}:", g.reps);
    println!(
        "  projection s @ GW:      cuBLAS GEMM alone {:>7.3}   generated bwd_recompute (GEMM + sigmoid + store) {:>7.3}  ({})",
        g.cublas_projection_ms, g.recompute_ms, g.recompute_kernel
    );
    println!(
        "  logit g_logit @ GW^T:   cuBLAS GEMM alone {:>7.3}   generated bwd_pointwise (the whole pointwise pass) {:>7.3}  ({})",
        g.cublas_logit_ms, g.pointwise_ms, g.pointwise_kernel
    );
}
