//! Running a plan (plan.rs) on a stream: resolve its symbolic buffers (the
//! caller's tensors, the stack's weights, scratch taken from the pool for
//! this call), then launch, call cuBLAS, copy and zero, step by step. Nothing
//! here decides what runs.

use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, CudaStream};

use super::element::Element;
use super::error::{DriverContext, MixError};
use super::gate_blas::GateBlas;
use super::launch::Kernels;
use super::memory::{raw_ptr, Tracker};
use super::plan::{Addr, Buf, GateOp, Plan, Step};
use super::shape::StackShape;

/// What a plan runs on: one stack's shape, kernels and cuBLAS (or why there
/// is none).
pub(crate) struct Env<'a> {
    pub shape: StackShape,
    pub kernels: &'a Kernels,
    pub gate_blas: Result<&'a GateBlas, &'a String>,
}

/// The buffers of one call (0 where the call has none): the caller's
/// tensors and the weights (the stack's own, or borrowed for the call).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Io {
    pub u0: CUdeviceptr,
    pub alpha: CUdeviceptr,
    pub out: CUdeviceptr,
    pub z_all: CUdeviceptr,
    pub grad_out: CUdeviceptr,
    pub grad_u0: CUdeviceptr,
    pub grad_alpha: CUdeviceptr,
    pub w0: CUdeviceptr,
    pub w1: CUdeviceptr,
    pub wt0: CUdeviceptr,
    pub wt1: CUdeviceptr,
    pub gw: CUdeviceptr,
    pub gwt: CUdeviceptr,
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
    // Every field named: CUmemorytype has no zero value, so an all-zero
    // struct is invalid in Rust (std::mem::zeroed aborts on it).
    let c = sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        srcHost: std::ptr::null(),
        srcDevice: src,
        srcArray: std::ptr::null_mut(),
        srcPitch: src_pitch,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        dstHost: std::ptr::null_mut(),
        dstDevice: dst,
        dstArray: std::ptr::null_mut(),
        dstPitch: dst_pitch,
        WidthInBytes: width,
        Height: height,
    };
    stream.context().bind_to_thread().during(|| "binding the context".into())?;
    // SAFETY: both ranges are device memory the caller sized for `height`
    // rows at their pitches.
    unsafe { sys::cuMemcpy2DAsync_v2(&c, stream.cu_stream()) }
        .result()
        .during(|| format!("a pitched copy of {height} rows of {width} bytes"))
}

/// Run `plan` on `stream` over the caller's buffers `io`: every step in
/// order, scratch from the pool through `tr`. On an error the scratch
/// taken so far is freed (dropped) and the error returned.
pub(crate) fn run_plan<T: Element>(
    stream: &Arc<CudaStream>,
    plan: &Plan,
    io: &Io,
    env: &Env<'_>,
    tr: &mut Tracker<'_>,
) -> Result<(), MixError> {
    let mut scratch: Vec<Option<CudaSlice<T>>> = plan.scratch.iter().map(|_| None).collect();
    let mut at: Vec<CUdeviceptr> = vec![0; plan.scratch.len()];
    let resolve = |a: &Addr, at: &[CUdeviceptr]| -> Result<CUdeviceptr, MixError> {
        let base = match a.buf {
            Buf::U0 => io.u0,
            Buf::Alpha => io.alpha,
            Buf::Out => io.out,
            Buf::ZAll => io.z_all,
            Buf::GradOut => io.grad_out,
            Buf::GradU0 => io.grad_u0,
            Buf::GradAlpha => io.grad_alpha,
            Buf::W0 => io.w0,
            Buf::W1 => io.w1,
            Buf::Wt0 => io.wt0,
            Buf::Wt1 => io.wt1,
            Buf::Gw => io.gw,
            Buf::Gwt => io.gwt,
            Buf::Scratch(i) => at.get(i).copied().unwrap_or(0),
        };
        if base == 0 {
            return Err(MixError::PlanInconsistent { why: format!("{a:?} is not a live buffer of this call") });
        }
        Ok(base + a.byte)
    };
    for step in &plan.steps {
        match step {
            Step::Alloc(i) => {
                let s = &plan.scratch[*i];
                let buf = tr.scratch::<T>(s.elems, s.name)?;
                at[*i] = raw_ptr(&buf, stream);
                scratch[*i] = Some(buf);
            }
            Step::Free(i) => {
                if let Some(buf) = scratch[*i].take() {
                    tr.release(buf);
                }
                at[*i] = 0;
            }
            Step::Launch { kernel, e, n, foci, call } => {
                let call = call.try_map(|a| resolve(a, &at))?;
                env.kernels.launch(stream, kernel, *e, *n, *foci, &call)?;
            }
            Step::Gemm { stage, op, e, a, w, c } => {
                let blas = env.gate_blas.map_err(|why| MixError::PlanInconsistent {
                    why: format!("the plan runs a cuBLAS gate GEMM, but cuBLAS is not in use: {why}"),
                })?;
                let sh = StackShape { f: 1, ..env.shape };
                let (a, w, c) = (resolve(a, &at)?, resolve(w, &at)?, resolve(c, &at)?);
                // SAFETY: the plan addresses one focus's rows (E) of
                // z_all or g_logit, its (Cf, LG) gate blocks, and sig or gz,
                // each as large as the GEMM reads or writes.
                env.kernels.external(stream, *stage, op.label(), || unsafe {
                    match op {
                        GateOp::Projection => blas.projection::<T>(stream, &sh, *e, a, w, c),
                        GateOp::LogitContraction => blas.logit_contraction::<T>(stream, &sh, *e, a, w, c),
                    }
                })?;
            }
            Step::Copy { src, dst, bytes } => {
                let (src, dst) = (resolve(src, &at)?, resolve(dst, &at)?);
                stream.context().bind_to_thread().during(|| "binding the context".into())?;
                // SAFETY: both ranges hold `bytes` bytes (the plan's chunk rows).
                unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, *bytes, stream.cu_stream()) }
                    .during(|| format!("copying a chunk ({bytes} bytes)"))?;
            }
            Step::Copy2d { src, src_pitch, dst, dst_pitch, width, height } => {
                let (src, dst) = (resolve(src, &at)?, resolve(dst, &at)?);
                copy_2d(stream, src, *src_pitch, dst, *dst_pitch, *width, *height)?;
            }
            Step::Zero { dst, bytes } => {
                let dst = resolve(dst, &at)?;
                stream.context().bind_to_thread().during(|| "binding the context".into())?;
                // SAFETY: dst holds `bytes` bytes (grad_alpha: E*F elements, caller contract).
                unsafe { cudarc::driver::result::memset_d8_async(dst, 0, *bytes, stream.cu_stream()) }
                    .during(|| format!("zeroing {dst:#x} ({bytes} bytes)"))?;
            }
        }
    }
    Ok(())
}
