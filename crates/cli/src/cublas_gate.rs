//! `mixstack bench --cublas-gate`: the relay's two gate contractions done
//! by cuBLAS, through the runtime's own calls ([`GateBlas`], one batch per
//! focus, fp32), timed side by side with the generated kernels that contain
//! them, on the same inputs:
//! - gate projection s @ GW (E x Cf times Cf x LG), inside bwd_recompute
//!   (which also applies the sigmoid and stores sig);
//! - gate-logit contraction g_logit @ GW^T (E x LG times LG x Cf, added
//!   into gz's scalar columns), inside bwd_pointwise (which also forms
//!   g_logit, gz and the silu' term).
//!
//! cuBLAS's time is that of its GEMM alone; a cuBLAS-based relay adds the
//! sigmoid and the g_logit round trip on top. So where a generated kernel
//! takes less than cuBLAS's GEMM alone, it is the faster choice
//! (src/runtime/gate_blas.rs says where the runtime switches).

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use mixstack::kinds::Stage;
use mixstack::runtime::{BackwardOptions, GateBlas, Stack, StackShape};
use serde::Serialize;
use std::sync::Arc;

use super::workload::Workload;

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
pub fn time(
    stream: &Arc<CudaStream>,
    w: &Workload,
    stack: &Stack<f32>,
    args: (&CudaSlice<f32>, &CudaSlice<f32>, &CudaSlice<f32>, &CudaSlice<f32>),
    gw0: &CudaSlice<f32>,
    reps: usize,
) -> Result<CublasGate, Error> {
    let (grad_out, out, z_all, alpha) = args;
    let blas =
        GateBlas::new(stream).map_err(|why| format!("--cublas-gate: {why}; add its folder to LD_LIBRARY_PATH"))?;
    let shape = StackShape::new(w.f, w.cf, w.lmax, w.n_layers);
    let (f, e) = (w.f, w.e);
    let mut logit = stream.alloc_zeros::<f32>(f * e * shape.lg())?;
    let mut gz = stream.alloc_zeros::<f32>(f * e * shape.row())?;
    let (pz, _gz_all) = z_all.device_ptr(stream);
    let (pgw, _ggw) = gw0.device_ptr(stream);
    let (plogit, _glogit) = logit.device_ptr_mut(stream);
    let (pgz, _ggz) = gz.device_ptr_mut(stream);
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
        // SAFETY: z_all's layer 0 is F blocks of E x ROW, gw0 F blocks of
        // Cf x LG, logit F x E x LG, gz F x E x ROW (f32, this stream's
        // context); logit stands in for g_logit in the contraction.
        let tp = timed(&mut || Ok(unsafe { blas.projection::<f32>(stream, &shape, e, pz, pgw, plogit) }?))?;
        let tl = timed(&mut || Ok(unsafe { blas.logit_contraction::<f32>(stream, &shape, e, plogit, pgw, pgz) }?))?;
        // The generated gate kernels, even where the stack runs cuBLAS (Cf >= 96).
        stack.set_generated_gate(true);
        stack.set_profiling(true);
        let ran = stack.backward(stream, grad_out, out, z_all, alpha, w.apply_alpha, &relay);
        let t = stack.timings();
        stack.set_profiling(false);
        stack.set_generated_gate(false);
        ran?;
        let t = t?;
        let first = |s: Stage| t.iter().find(|k| k.stage == s).map(|k| (k.ms as f64, k.ran.to_string()));
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
