//! Argument checks of the C functions. A call's tensor arguments are checked
//! once, into one validated value, before the driver is touched:
//! [`Valid`] for forward and backward, [`ValidWeights`] for create. The
//! runtime's raw entry points take the [`Checked`] inside a [`Valid`] and do
//! not check again. The checks that need the driver ([`call_stream`],
//! [`check_device_memory`]) follow with the stack's context bound.

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use cudarc::driver::sys::{self, CUcontext, CUdeviceptr, CUpointer_attribute, CUresult, CUstream};
use cudarc::driver::{CudaContext, CudaStream};

use super::status::{
    fail, mixstack_status::*, Fail, MIXSTACK_PATH_AUTO, MIXSTACK_PATH_FUSED, MIXSTACK_PATH_FUSED_ALWAYS,
    MIXSTACK_PATH_RELAY, MIXSTACK_PRECISION_AUTO, MIXSTACK_PRECISION_EXACT, MIXSTACK_PRECISION_FP16X3,
};
use crate::runtime::dispatch::Dispatch;
use crate::runtime::error::MixError;
use crate::runtime::stack::validate_shape;
use crate::runtime::{
    BackwardPtrs, BackwardWeights, Checked, Element, ForwardPtrs, ForwardWeights, FusedMode, Precision, PrecisionMode,
    StackShape,
};

// ----------------------------------------------------------------------
// scalars
// ----------------------------------------------------------------------

pub(super) fn edges(e: i64) -> Result<usize, Fail> {
    usize::try_from(e).map_err(|_| fail(MIXSTACK_ERR_BAD_SHAPE, format!("E = {e} is negative")))
}

pub(super) fn dim(name: &str, v: i64, min: i64) -> Result<usize, Fail> {
    if v < min {
        return Err(fail(MIXSTACK_ERR_BAD_SHAPE, format!("{name} = {v}: must be >= {min}")));
    }
    usize::try_from(v).map_err(|_| fail(MIXSTACK_ERR_BAD_SHAPE, format!("{name} = {v} does not fit usize")))
}

pub(super) fn path_mode(path: c_int) -> Result<FusedMode, Fail> {
    match path {
        MIXSTACK_PATH_AUTO => Ok(FusedMode::FromEnv),
        MIXSTACK_PATH_RELAY => Ok(FusedMode::Off),
        MIXSTACK_PATH_FUSED => Ok(FusedMode::On),
        MIXSTACK_PATH_FUSED_ALWAYS => Ok(FusedMode::Always),
        p => Err(fail(
            MIXSTACK_ERR_BAD_ARGUMENT,
            format!(
                "unknown path code {p}: 0 (auto, MIXSTACK_STACK_BWD_FUSED), 1 (relay), 2 (fused where measured \
                 faster) or 3 (fused wherever served)"
            ),
        )),
    }
}

/// A precision code of `mixstack_set_precision`.
pub(super) fn precision_mode(code: c_int) -> Result<PrecisionMode, Fail> {
    match code {
        MIXSTACK_PRECISION_AUTO => Ok(PrecisionMode::FromEnv),
        MIXSTACK_PRECISION_EXACT => Ok(PrecisionMode::Set(Precision::Exact)),
        MIXSTACK_PRECISION_FP16X3 => Ok(PrecisionMode::Set(Precision::Fp16x3)),
        p => Err(fail(
            MIXSTACK_ERR_BAD_ARGUMENT,
            format!("unknown precision code {p}: 0 (auto, MIXSTACK_PRECISION), 1 (exact) or 2 (fp16x3)"),
        )),
    }
}

/// The code of a mode that ran (`mixstack_last_precision`).
pub(super) fn precision_code(p: Precision) -> c_int {
    match p {
        Precision::Exact => MIXSTACK_PRECISION_EXACT,
        Precision::Fp16x3 => MIXSTACK_PRECISION_FP16X3,
    }
}

// ----------------------------------------------------------------------
// tensors (pure CPU, before any CUDA call)
// ----------------------------------------------------------------------

/// One tensor argument of a call: name, address, bytes.
#[derive(Clone, Copy, Debug)]
pub(super) struct Tensor {
    pub(super) name: &'static str,
    pub(super) ptr: CUdeviceptr,
    pub(super) bytes: u64,
}

pub(super) fn dptr(p: *const c_void) -> CUdeviceptr {
    p as usize as CUdeviceptr
}

fn check_nonnull(t: &Tensor) -> Result<(), Fail> {
    if t.ptr == 0 {
        return Err(fail(MIXSTACK_ERR_NULL_POINTER, format!("tensor `{}` is a null pointer", t.name)));
    }
    Ok(())
}

fn check_aligned(t: &Tensor, elem: usize) -> Result<(), Fail> {
    if !t.ptr.is_multiple_of(elem as u64) {
        return Err(fail(
            MIXSTACK_ERR_MISALIGNED,
            format!("tensor `{}` at {:#x} is not aligned to the element size ({elem} bytes)", t.name, t.ptr),
        ));
    }
    Ok(())
}

/// A tensor's bytes end inside the 64-bit address space: its end, one past
/// the last byte, is a 64-bit address.
fn check_in_address_space(t: &Tensor) -> Result<(), Fail> {
    if t.ptr.checked_add(t.bytes).is_none() {
        return Err(fail(
            MIXSTACK_ERR_BAD_ARGUMENT,
            format!(
                "tensor `{}` at {:#x} ({} bytes) extends past the end of the address space",
                t.name, t.ptr, t.bytes
            ),
        ));
    }
    Ok(())
}

/// Outputs must not overlap each other or any input (every end checked to
/// fit by [`check_in_address_space`]).
fn check_no_overlap(outputs: &[Tensor], inputs: &[Tensor]) -> Result<(), Fail> {
    let overlap =
        |a: &Tensor, b: &Tensor| a.bytes > 0 && b.bytes > 0 && a.ptr < b.ptr + b.bytes && b.ptr < a.ptr + a.bytes;
    for (i, o) in outputs.iter().enumerate() {
        for other in outputs[i + 1..].iter().chain(inputs) {
            if overlap(o, other) {
                return Err(fail(
                    MIXSTACK_ERR_BAD_ARGUMENT,
                    format!("output `{}` overlaps tensor `{}`", o.name, other.name),
                ));
            }
        }
    }
    Ok(())
}

fn bytes_of(len: usize, elem: usize, e: usize, what: &'static str) -> Result<u64, Fail> {
    len.checked_mul(elem).map(|b| b as u64).ok_or_else(|| Fail::from(MixError::SizeOverflow { e: e as u64, what }))
}

/// Bytes of the tensors of a call over `e` edges: (surface, alpha, z_all).
fn extents<T: Element>(sh: &StackShape, e: usize) -> Result<(u64, u64, u64), Fail> {
    let elem = std::mem::size_of::<T>();
    Ok((
        bytes_of(sh.surface_len(e)?, elem, e, "F*E*ROW bytes")?,
        bytes_of(sh.alpha_len(e)?, elem, e, "E*F bytes")?,
        bytes_of(sh.z_all_len(e)?, elem, e, "z_all bytes")?,
    ))
}

/// A forward or backward call's tensor arguments, every CPU check done, each
/// once: first the runtime's ([`ForwardPtrs::check`] / [`BackwardPtrs::check`]:
/// E's sizes fit, every pointer the call needs is non-null; that order keeps
/// a null pointer from reading as an overlap), then the C ABI's own: every
/// tensor aligned to the element size, the outputs disjoint from each other
/// and from the inputs.
pub(super) struct Valid<T, P> {
    /// What the runtime's raw entry point takes.
    pub(super) call: Checked<T, P>,
    /// The tensors the call touches, inputs then outputs, for the checks
    /// that need the driver.
    pub(super) tensors: Vec<Tensor>,
}

impl<T: Element, P> Valid<T, P> {
    /// The C ABI's checks of `call`: alignment over inputs then outputs
    /// (the header's argument order within each), then overlap.
    fn new(call: Checked<T, P>, inputs: &[Tensor], outputs: &[Tensor]) -> Result<Self, Fail> {
        for t in inputs.iter().chain(outputs) {
            check_aligned(t, std::mem::size_of::<T>())?;
            check_in_address_space(t)?;
        }
        check_no_overlap(outputs, inputs)?;
        Ok(Valid { call, tensors: inputs.iter().chain(outputs).copied().collect() })
    }
}

/// A forward's checked buffers and its tensors (inputs, outputs).
type Parts<T, P> = (Checked<T, P>, Vec<Tensor>, Vec<Tensor>);

fn forward_parts<T: Element>(sh: StackShape, e: usize, ptrs: ForwardPtrs) -> Result<Parts<T, ForwardPtrs>, Fail> {
    let gated = sh.gated() > 0;
    // Without a gated layer z_all is neither written nor checked.
    let ptrs = ForwardPtrs { z_all: if gated { ptrs.z_all } else { 0 }, ..ptrs };
    let call = ptrs.check::<T>(sh, e)?;
    let (surf, alpha, z_all) = extents::<T>(&sh, e)?;
    let t = |name, ptr, bytes| Tensor { name, ptr, bytes };
    let inputs = vec![t("u0", ptrs.u0, surf), t("alpha", ptrs.alpha, alpha)];
    let mut outputs = vec![t("out", ptrs.out, surf)];
    if gated {
        outputs.push(t("z_all", ptrs.z_all, z_all));
    }
    Ok((call, inputs, outputs))
}

fn backward_parts<T: Element>(sh: StackShape, e: usize, ptrs: BackwardPtrs) -> Result<Parts<T, BackwardPtrs>, Fail> {
    let gated = sh.gated() > 0;
    // Without a gated layer z_all is neither read nor checked.
    let ptrs = BackwardPtrs { z_all: if gated { ptrs.z_all } else { 0 }, ..ptrs };
    let call = ptrs.check::<T>(sh, e)?;
    let (surf, alpha, z_all) = extents::<T>(&sh, e)?;
    let t = |name, ptr, bytes| Tensor { name, ptr, bytes };
    let mut inputs = vec![t("grad_out", ptrs.grad_out, surf), t("out", ptrs.out, surf), t("alpha", ptrs.alpha, alpha)];
    if gated {
        inputs.push(t("z_all", ptrs.z_all, z_all));
    }
    let outputs = vec![t("grad_u0", ptrs.grad_u0, surf), t("grad_alpha", ptrs.grad_alpha, alpha)];
    Ok((call, inputs, outputs))
}

/// The weight tensors a call borrows, (name, address, elements) each; an
/// empty one (GW without a gated layer) is not a tensor of the call.
fn weight_tensors<T: Element>(named: &[(&'static str, CUdeviceptr, usize)]) -> Result<Vec<Tensor>, Fail> {
    let elem = std::mem::size_of::<T>();
    named
        .iter()
        .filter(|(_, _, len)| *len > 0)
        .map(|&(name, ptr, len)| Ok(Tensor { name, ptr, bytes: bytes_of(len, elem, 0, "weight bytes")? }))
        .collect()
}

/// Element counts of (W0, W1, GW) for `sh`.
fn weight_lens(sh: &StackShape) -> Result<[usize; 3], Fail> {
    match (sh.w0_len(), sh.w1_len(), sh.gw_len()) {
        (Some(a), Some(b), Some(c)) => Ok([a, b, c]),
        _ => Err(fail(MIXSTACK_ERR_BAD_SHAPE, "the weight sizes overflow usize")),
    }
}

impl<T: Element> Valid<T, ForwardPtrs> {
    /// A forward over `e` > 0 edges (E == 0 returns before any tensor check).
    pub(super) fn forward(sh: StackShape, e: usize, ptrs: ForwardPtrs) -> Result<Self, Fail> {
        let (call, inputs, outputs) = forward_parts::<T>(sh, e, ptrs)?;
        Valid::new(call, &inputs, &outputs)
    }
}

impl<T: Element> Valid<T, (ForwardPtrs, ForwardWeights)> {
    /// A forward with the weights the call borrows: inputs too (aligned, on
    /// the device, not overlapped by an output).
    pub(super) fn forward_with(sh: StackShape, e: usize, ptrs: ForwardPtrs, w: ForwardWeights) -> Result<Self, Fail> {
        let (call, mut inputs, outputs) = forward_parts::<T>(sh, e, ptrs)?;
        // Without a gated layer GW is neither read nor checked (as z_all).
        let w = ForwardWeights { gw: if sh.gated() > 0 { w.gw } else { 0 }, ..w };
        let call = call.with_weights(w)?;
        let [w0, w1, gw] = weight_lens(&sh)?;
        inputs.extend(weight_tensors::<T>(&[("w0", w.w0, w0), ("w1", w.w1, w1), ("gw", w.gw, gw)])?);
        Valid::new(call, &inputs, &outputs)
    }
}

impl<T: Element> Valid<T, BackwardPtrs> {
    /// As [`Valid::forward`], for a backward.
    pub(super) fn backward(sh: StackShape, e: usize, ptrs: BackwardPtrs) -> Result<Self, Fail> {
        let (call, inputs, outputs) = backward_parts::<T>(sh, e, ptrs)?;
        Valid::new(call, &inputs, &outputs)
    }
}

impl<T: Element> Valid<T, (BackwardPtrs, BackwardWeights)> {
    /// As [`Valid::forward_with`], for a backward.
    pub(super) fn backward_with(
        sh: StackShape,
        e: usize,
        ptrs: BackwardPtrs,
        w: BackwardWeights,
    ) -> Result<Self, Fail> {
        let (call, mut inputs, outputs) = backward_parts::<T>(sh, e, ptrs)?;
        let gated = sh.gated() > 0;
        let w = BackwardWeights { gw: if gated { w.gw } else { 0 }, gwt: if gated { w.gwt } else { 0 }, ..w };
        let call = call.with_weights(w)?;
        let [w0, w1, gw] = weight_lens(&sh)?;
        let named = [("wt0", w.wt0, w0), ("wt1", w.wt1, w1), ("gw", w.gw, gw), ("gwt", w.gwt, gw)];
        inputs.extend(weight_tensors::<T>(&named)?);
        Valid::new(call, &inputs, &outputs)
    }
}

/// The weights of a create, checked on the CPU: the shape against the build's
/// table (so a bad shape is refused without a driver), their sizes, and each
/// non-empty one non-null and aligned.
pub(super) struct ValidWeights {
    /// w0, w1, gw.
    pub(super) tensors: [Tensor; 3],
    /// Their lengths in elements.
    pub(super) lens: [usize; 3],
}

impl ValidWeights {
    pub(super) fn new<T: Element>(
        sh: StackShape,
        w0: CUdeviceptr,
        w1: CUdeviceptr,
        gw: CUdeviceptr,
    ) -> Result<Self, Fail> {
        let elem = std::mem::size_of::<T>();
        validate_shape::<T>(&Dispatch::builtin(), &sh)?;
        let lens = weight_lens(&sh)?;
        let mut tensors = [("w0", w0), ("w1", w1), ("gw", gw)].map(|(name, ptr)| Tensor { name, ptr, bytes: 0 });
        for (t, len) in tensors.iter_mut().zip(lens) {
            t.bytes = bytes_of(len, elem, 0, "weight bytes")?;
        }
        for t in tensors.iter().filter(|t| t.bytes > 0) {
            check_nonnull(t)?;
            check_aligned(t, elem)?;
        }
        Ok(ValidWeights { tensors, lens })
    }
}

// ----------------------------------------------------------------------
// checks that need the driver (the stack's context bound)
// ----------------------------------------------------------------------

/// Wrap the caller's stream (null: the legacy default stream) and check that
/// it belongs to `ctx`. `ctx` must be bound to the thread.
pub(super) fn call_stream(ctx: &Arc<CudaContext>, cu_stream: *mut c_void) -> Result<Arc<CudaStream>, Fail> {
    let s = cu_stream as CUstream;
    let mut owner: CUcontext = std::ptr::null_mut();
    // SAFETY: the caller passes a live stream handle (header contract); the
    // driver only reads it. Null and the per-thread handle name the current
    // context's default streams.
    let r = unsafe { sys::cuStreamGetCtx(s, &mut owner) };
    if r != CUresult::CUDA_SUCCESS {
        return Err(fail(MIXSTACK_ERR_CUDA, format!("cuStreamGetCtx on the stream {s:?} failed: {r:?}")));
    }
    if owner != ctx.cu_ctx() {
        return Err(fail(
            MIXSTACK_ERR_BAD_ARGUMENT,
            format!("the stream {s:?} belongs to another CUDA context than the stack's (device {})", ctx.ordinal()),
        ));
    }
    // SAFETY: a live stream of `ctx` (checked above); the wrapper does not
    // destroy it and lives only for this call.
    Ok(unsafe { ctx.wrap_borrowed_stream(s) })
}

/// Reject pointers the driver does not know (host memory) or knows as memory
/// of another device. Other driver answers (e.g. attributes a memory kind
/// does not report) are let through: the check must never refuse valid memory.
pub(super) fn check_device_memory(t: &Tensor, device: usize) -> Result<(), Fail> {
    if t.ptr == 0 {
        return Ok(());
    }
    let mut ordinal: c_int = -1;
    // SAFETY: queries an attribute of an address; writes one int.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            &mut ordinal as *mut c_int as *mut c_void,
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            t.ptr,
        )
    };
    match r {
        CUresult::CUDA_SUCCESS if ordinal >= 0 && ordinal as usize != device => Err(fail(
            MIXSTACK_ERR_BAD_ARGUMENT,
            format!("tensor `{}` is memory of device {ordinal}, the stack is on device {device}", t.name),
        )),
        CUresult::CUDA_ERROR_INVALID_VALUE => Err(fail(
            MIXSTACK_ERR_BAD_ARGUMENT,
            format!("tensor `{}` at {:#x} is not CUDA device memory (host pointer?)", t.name, t.ptr),
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    //! The checks of forward and backward need no handle now, so each
    //! rejected tensor's status, and which check wins when several fail, is
    //! tested here without a GPU.

    use super::*;
    use crate::capi::mixstack_status;

    /// F = 2, Cf = 32, lmax = 3, n_layers = 3: ROW = 320, a surface of E
    /// edges is 2 * 320 * E elements.
    const SH: StackShape = StackShape { f: 2, cf: 32, lmax: 3, n_layers: 3 };
    const E: usize = 97;
    /// Well apart: no two tensors of E edges overlap.
    const GAP: u64 = 1 << 24;

    fn fwd() -> ForwardPtrs {
        ForwardPtrs { u0: GAP, alpha: 2 * GAP, out: 3 * GAP, z_all: 4 * GAP }
    }

    fn bwd() -> BackwardPtrs {
        BackwardPtrs {
            grad_out: GAP,
            out: 2 * GAP,
            z_all: 3 * GAP,
            alpha: 4 * GAP,
            grad_u0: 5 * GAP,
            grad_alpha: 6 * GAP,
        }
    }

    #[track_caller]
    fn refused<V>(r: Result<V, Fail>, status: mixstack_status, needles: &[&str]) {
        let Err(f) = r else { panic!("accepted; expected {}", status.name()) };
        assert_eq!(f.status, status, "{}", f.msg);
        for n in needles {
            assert!(f.msg.contains(n), "message should mention `{n}`: {}", f.msg);
        }
    }

    fn names(tensors: &[Tensor]) -> Vec<&'static str> {
        tensors.iter().map(|t| t.name).collect()
    }

    #[test]
    fn valid_calls_carry_their_tensors() {
        let v = Valid::<f32, _>::forward(SH, E, fwd()).unwrap();
        assert_eq!(names(&v.tensors), ["u0", "alpha", "out", "z_all"]);
        assert_eq!(v.tensors[0].bytes, (2 * 320 * E * 4) as u64);
        assert_eq!(v.tensors[1].bytes, (2 * E * 4) as u64);
        assert_eq!(v.tensors[3].bytes, (2 * 2 * 320 * E * 4) as u64);
        assert_eq!((v.call.e(), v.call.shape(), v.call.ptrs().u0), (E, SH, GAP));
        let v = Valid::<f64, _>::backward(SH, E, bwd()).unwrap();
        assert_eq!(names(&v.tensors), ["grad_out", "out", "alpha", "z_all", "grad_u0", "grad_alpha"]);
        assert_eq!(v.tensors[0].bytes, (2 * 320 * E * 8) as u64);
        // Touching is not overlapping.
        let surf = (2 * 320 * E * 4) as u64;
        let p = ForwardPtrs { u0: GAP, alpha: GAP + surf, out: GAP + surf + (2 * E * 4) as u64, z_all: 4 * GAP };
        Valid::<f32, _>::forward(SH, E, p).unwrap();
    }

    #[test]
    fn each_null_tensor_is_refused_by_name() {
        for (name, p) in [
            ("u0", ForwardPtrs { u0: 0, ..fwd() }),
            ("alpha", ForwardPtrs { alpha: 0, ..fwd() }),
            ("out", ForwardPtrs { out: 0, ..fwd() }),
            ("z_all", ForwardPtrs { z_all: 0, ..fwd() }),
        ] {
            // The runtime's check and message: the C ABI does not repeat it.
            let needles = [&format!("`{name}`: null device pointer")[..]];
            refused(Valid::<f32, _>::forward(SH, E, p), MIXSTACK_ERR_NULL_POINTER, &needles);
        }
        for (name, p) in [
            ("grad_out", BackwardPtrs { grad_out: 0, ..bwd() }),
            ("out", BackwardPtrs { out: 0, ..bwd() }),
            ("alpha", BackwardPtrs { alpha: 0, ..bwd() }),
            ("z_all", BackwardPtrs { z_all: 0, ..bwd() }),
            ("grad_u0", BackwardPtrs { grad_u0: 0, ..bwd() }),
            ("grad_alpha", BackwardPtrs { grad_alpha: 0, ..bwd() }),
        ] {
            let needles = [&format!("`{name}`: null device pointer")[..]];
            refused(Valid::<f64, _>::backward(SH, E, p), MIXSTACK_ERR_NULL_POINTER, &needles);
        }
    }

    #[test]
    fn a_tensor_past_the_end_of_the_address_space_is_refused_by_name() {
        // Aligned, non-null, and its end wraps past 2^64: an input (whose
        // overlap test added past the end and panicked) and an output (whose
        // wrapped end read as no overlap, so the call was accepted).
        let top = u64::MAX - 63;
        for (name, p) in [("u0", ForwardPtrs { u0: top, ..fwd() }), ("out", ForwardPtrs { out: top, ..fwd() })] {
            let needles = [&format!("`{name}`")[..], "past the end of the address space"];
            refused(Valid::<f32, _>::forward(SH, E, p), MIXSTACK_ERR_BAD_ARGUMENT, &needles);
        }
        let p = BackwardPtrs { grad_alpha: top, ..bwd() };
        refused(Valid::<f64, _>::backward(SH, E, p), MIXSTACK_ERR_BAD_ARGUMENT, &["`grad_alpha`", "address space"]);
        // Ending just below the top is inside.
        let surf = (2 * 320 * E * 4) as u64;
        Valid::<f32, _>::forward(SH, E, ForwardPtrs { out: (u64::MAX - surf) / 16 * 16, ..fwd() }).unwrap();
    }

    #[test]
    fn each_misaligned_tensor_is_refused_by_name() {
        for (name, p) in [
            ("u0", ForwardPtrs { u0: GAP + 2, ..fwd() }),
            ("alpha", ForwardPtrs { alpha: 2 * GAP + 1, ..fwd() }),
            ("out", ForwardPtrs { out: 3 * GAP + 2, ..fwd() }),
            ("z_all", ForwardPtrs { z_all: 4 * GAP + 3, ..fwd() }),
        ] {
            refused(Valid::<f32, _>::forward(SH, E, p), MIXSTACK_ERR_MISALIGNED, &[&format!("`{name}`"), "4 bytes"]);
        }
        // f64: aligned to 4 only is misaligned.
        for (name, p) in [
            ("grad_out", BackwardPtrs { grad_out: GAP + 4, ..bwd() }),
            ("out", BackwardPtrs { out: 2 * GAP + 4, ..bwd() }),
            ("alpha", BackwardPtrs { alpha: 4 * GAP + 4, ..bwd() }),
            ("z_all", BackwardPtrs { z_all: 3 * GAP + 4, ..bwd() }),
            ("grad_u0", BackwardPtrs { grad_u0: 5 * GAP + 4, ..bwd() }),
            ("grad_alpha", BackwardPtrs { grad_alpha: 6 * GAP + 4, ..bwd() }),
        ] {
            refused(Valid::<f64, _>::backward(SH, E, p), MIXSTACK_ERR_MISALIGNED, &[&format!("`{name}`"), "8 bytes"]);
        }
        Valid::<f32, _>::backward(SH, E, BackwardPtrs { grad_u0: 5 * GAP + 4, ..bwd() }).unwrap();
    }

    #[test]
    fn outputs_overlapping_anything_are_refused() {
        let arg = MIXSTACK_ERR_BAD_ARGUMENT;
        let last_byte = |p: u64, bytes: usize| p + bytes as u64 - 1;
        let surf = 2 * 320 * E * 4;
        for (p, o, other) in [
            (ForwardPtrs { out: fwd().u0, ..fwd() }, "out", "u0"),
            (ForwardPtrs { out: last_byte(fwd().alpha, 2 * E * 4) & !3, ..fwd() }, "out", "alpha"),
            (ForwardPtrs { z_all: last_byte(fwd().out, surf) & !3, ..fwd() }, "out", "z_all"),
            (ForwardPtrs { z_all: fwd().u0 + 64, ..fwd() }, "z_all", "u0"),
        ] {
            refused(Valid::<f32, _>::forward(SH, E, p), arg, &[&format!("output `{o}` overlaps tensor `{other}`")]);
        }
        for (p, o, other) in [
            (BackwardPtrs { grad_u0: bwd().grad_out, ..bwd() }, "grad_u0", "grad_out"),
            (BackwardPtrs { grad_u0: bwd().z_all + 8, ..bwd() }, "grad_u0", "z_all"),
            (BackwardPtrs { grad_alpha: bwd().alpha, ..bwd() }, "grad_alpha", "alpha"),
            (BackwardPtrs { grad_alpha: bwd().grad_u0 + 8, ..bwd() }, "grad_u0", "grad_alpha"),
        ] {
            refused(Valid::<f32, _>::backward(SH, E, p), arg, &[&format!("output `{o}` overlaps tensor `{other}`")]);
        }
        // Inputs may alias each other (out and grad_out, say).
        Valid::<f32, _>::backward(SH, E, BackwardPtrs { out: bwd().grad_out, ..bwd() }).unwrap();
    }

    #[test]
    fn without_a_gated_layer_z_all_is_ignored() {
        let sh = StackShape { n_layers: 1, ..SH };
        for z_all in [0, 1, fwd().u0] {
            let v = Valid::<f32, _>::forward(sh, E, ForwardPtrs { z_all, ..fwd() }).unwrap();
            assert_eq!(names(&v.tensors), ["u0", "alpha", "out"]);
            assert_eq!(v.call.ptrs().z_all, 0, "the runtime never sees an unchecked z_all");
            let v = Valid::<f32, _>::backward(sh, E, BackwardPtrs { z_all, ..bwd() }).unwrap();
            assert_eq!(names(&v.tensors), ["grad_out", "out", "alpha", "grad_u0", "grad_alpha"]);
            assert_eq!(v.call.ptrs().z_all, 0);
        }
    }

    #[test]
    fn which_check_wins_when_several_fail() {
        // E's sizes first, even over null pointers.
        let huge = usize::MAX / 4;
        let nulls = ForwardPtrs { u0: 0, alpha: 0, out: 0, z_all: 0 };
        refused(Valid::<f32, _>::forward(SH, huge, nulls), MIXSTACK_ERR_BAD_SHAPE, &["E = "]);
        let nulls = BackwardPtrs { grad_out: 0, out: 0, z_all: 0, alpha: 0, grad_u0: 0, grad_alpha: 0 };
        refused(Valid::<f64, _>::backward(SH, huge, nulls), MIXSTACK_ERR_BAD_SHAPE, &["E = "]);
        // A null pointer before alignment and overlap: two null outputs are
        // not an overlap, a null input beside a misaligned output is null.
        refused(
            Valid::<f32, _>::forward(SH, E, ForwardPtrs { out: 0, z_all: 0, ..fwd() }),
            MIXSTACK_ERR_NULL_POINTER,
            &["`out`"],
        );
        refused(
            Valid::<f32, _>::forward(SH, E, ForwardPtrs { u0: 0, out: 3 * GAP + 1, ..fwd() }),
            MIXSTACK_ERR_NULL_POINTER,
            &["`u0`"],
        );
        // Backward names the first null in the header's order: inputs, then outputs.
        refused(
            Valid::<f32, _>::backward(SH, E, BackwardPtrs { z_all: 0, grad_u0: 0, ..bwd() }),
            MIXSTACK_ERR_NULL_POINTER,
            &["`z_all`"],
        );
        // Alignment before overlap.
        refused(
            Valid::<f32, _>::forward(SH, E, ForwardPtrs { out: fwd().u0, z_all: 4 * GAP + 2, ..fwd() }),
            MIXSTACK_ERR_MISALIGNED,
            &["`z_all`"],
        );
    }

    fn fwd_w() -> ForwardWeights {
        ForwardWeights { w0: 8 * GAP, w1: 9 * GAP, gw: 10 * GAP }
    }

    fn bwd_w() -> BackwardWeights {
        BackwardWeights { wt0: 8 * GAP, wt1: 9 * GAP, gw: 10 * GAP, gwt: 11 * GAP }
    }

    #[test]
    fn borrowed_weights_are_checked_as_inputs() {
        let v = Valid::<f32, _>::forward_with(SH, E, fwd(), fwd_w()).unwrap();
        assert_eq!(names(&v.tensors), ["u0", "alpha", "w0", "w1", "gw", "out", "z_all"]);
        let v = Valid::<f32, _>::backward_with(SH, E, bwd(), bwd_w()).unwrap();
        assert_eq!(
            names(&v.tensors),
            ["grad_out", "out", "alpha", "z_all", "wt0", "wt1", "gw", "gwt", "grad_u0", "grad_alpha"]
        );
        // null, misaligned, overlapped by an output
        for (w, name) in [
            (ForwardWeights { w0: 0, ..fwd_w() }, "w0"),
            (ForwardWeights { w1: 0, ..fwd_w() }, "w1"),
            (ForwardWeights { gw: 0, ..fwd_w() }, "gw"),
        ] {
            refused(Valid::<f32, _>::forward_with(SH, E, fwd(), w), MIXSTACK_ERR_NULL_POINTER, &[name]);
        }
        for (w, name) in
            [(BackwardWeights { wt0: 0, ..bwd_w() }, "wt0"), (BackwardWeights { gwt: 0, ..bwd_w() }, "gwt")]
        {
            refused(Valid::<f32, _>::backward_with(SH, E, bwd(), w), MIXSTACK_ERR_NULL_POINTER, &[name]);
        }
        let w = BackwardWeights { wt1: 9 * GAP + 2, ..bwd_w() };
        refused(Valid::<f32, _>::backward_with(SH, E, bwd(), w), MIXSTACK_ERR_MISALIGNED, &["wt1"]);
        let p = ForwardPtrs { out: fwd_w().gw + 16, ..fwd() };
        refused(Valid::<f32, _>::forward_with(SH, E, p, fwd_w()), MIXSTACK_ERR_BAD_ARGUMENT, &["out", "gw"]);
        // without a gated layer GW is no tensor of the call: null is fine
        let sh1 = StackShape { n_layers: 1, ..SH };
        let v = Valid::<f32, _>::forward_with(sh1, E, fwd(), ForwardWeights { gw: 0, ..fwd_w() }).unwrap();
        assert_eq!(names(&v.tensors), ["u0", "alpha", "w0", "w1", "out"]);
        let w = BackwardWeights { gw: 0, gwt: 0, ..bwd_w() };
        Valid::<f32, _>::backward_with(sh1, E, bwd(), w).unwrap();
    }
}
