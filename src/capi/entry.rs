//! The exported `extern "C"` functions (include/mixstack.h). Each is thin:
//! scalar arguments, the handle, one validated value (checks.rs), the
//! driver-side checks with the stack's context bound, the runtime call; the
//! boundary (status.rs) maps a failure to its status.

use std::ffi::{c_char, c_int, c_void};
use std::panic::catch_unwind;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;

use cudarc::driver::result;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaContext, CudaStream};

use super::checks::{
    call_stream, check_device_memory, dim, dptr, edges, path_mode, precision_code, precision_mode, Tensor, Valid,
    ValidWeights,
};
use super::handle::{handle, mixstack_stack, register, unregister, CurrentContext, Inner, StackState};
use super::status::{
    boundary, fail, last_error_ptr, mixstack_status::*, Fail, MIXSTACK_ABI_VERSION, MIXSTACK_DTYPE_F32,
    MIXSTACK_DTYPE_F64, MIXSTACK_PATH_FUSED, MIXSTACK_PATH_RELAY, MIXSTACK_PRECISION_AUTO,
};
use crate::runtime::device::{driver_present, open_device};
use crate::runtime::dispatch::Dispatch;
use crate::runtime::dispatch::Path;
use crate::runtime::error::MixError;
use crate::runtime::stack::validate_shape;
use crate::runtime::{
    BackwardOptions, BackwardPtrs, BackwardWeights, Element, ForwardOptions, ForwardPtrs, ForwardWeights, FusedMode,
    Stack, StackShape,
};

// ----------------------------------------------------------------------
// create / destroy
// ----------------------------------------------------------------------

/// Copy `len` elements at device address `src` into a host vector, ordered
/// on `stream` (the caller's, where the weights were produced).
fn download<T: Element>(stream: &Arc<CudaStream>, src: CUdeviceptr, len: usize, what: &str) -> Result<Vec<T>, Fail> {
    let mut host = vec![T::default(); len];
    if len > 0 {
        // SAFETY: `src` addresses `len` elements of T (caller contract,
        // alignment and device checked); `host` is exactly that long.
        unsafe { result::memcpy_dtoh_async(host.as_mut_slice(), src, stream.cu_stream()) }
            .map_err(|e| fail(MIXSTACK_ERR_CUDA, format!("copying `{what}` device->host ({len} elements): {e}")))?;
    }
    Ok(host)
}

/// The arguments every create checks first: the out-parameter (cleared),
/// the dtype code, the device, the shape (f, cf, lmax, n_layers).
///
/// # Safety
/// `out` is null or points to writable storage for a handle.
unsafe fn create_args(
    out: *mut *mut mixstack_stack,
    dtype: c_int,
    device: c_int,
    [f, cf, lmax, n_layers]: [i64; 4],
) -> Result<(usize, StackShape), Fail> {
    if out.is_null() {
        return Err(fail(MIXSTACK_ERR_NULL_POINTER, "`out` (where the handle is stored) is null"));
    }
    // SAFETY: non-null out-parameter (caller contract: writable).
    unsafe { *out = std::ptr::null_mut() };
    if dtype != MIXSTACK_DTYPE_F32 && dtype != MIXSTACK_DTYPE_F64 {
        return Err(fail(MIXSTACK_ERR_BAD_DTYPE, format!("unknown dtype code {dtype}: 0 (f32) or 1 (f64)")));
    }
    let device = usize::try_from(device)
        .map_err(|_| fail(MIXSTACK_ERR_BAD_ARGUMENT, format!("device = {device} is negative")))?;
    let shape =
        StackShape::new(dim("F", f, 1)?, dim("Cf", cf, 1)?, dim("lmax", lmax, 1)?, dim("n_layers", n_layers, 1)?);
    Ok((device, shape))
}

/// The device's context, current on this thread until the returned guard
/// drops (the caller's comes back then); NoDriver without libcuda, checked
/// before the guard asks the driver anything.
fn bind_device(device: usize) -> Result<(CurrentContext, Arc<CudaContext>), Fail> {
    if !driver_present() {
        return Err(MixError::NoDriver { why: "libcuda could not be loaded".into() }.into());
    }
    let restore = CurrentContext::save();
    let ctx = open_device(device)?;
    bind(&ctx)?;
    Ok((restore, ctx))
}

fn bind(ctx: &CudaContext) -> Result<(), Fail> {
    ctx.bind_to_thread().map_err(|e| fail(MIXSTACK_ERR_CUDA, format!("binding the context: {e}")))
}

fn create_typed<T: Element>(
    device: usize,
    sh: StackShape,
    [w0, w1, gw]: [CUdeviceptr; 3],
    cu_stream: *mut c_void,
    wrap: fn(Stack<T>) -> Inner,
) -> Result<StackState, Fail> {
    // Every CPU check first: a bad shape is refused without a driver.
    let w = ValidWeights::new::<T>(sh, w0, w1, gw)?;
    let (_restore, ctx) = bind_device(device)?;
    for t in w.tensors.iter().filter(|t| t.bytes > 0) {
        check_device_memory(t, device)?;
    }
    let stream = call_stream(&ctx, cu_stream)?;
    let [w0, w1, gw] = w.tensors;
    let [w0_len, w1_len, gw_len] = w.lens;
    let w0 = download::<T>(&stream, w0.ptr, w0_len, "w0")?;
    let w1 = download::<T>(&stream, w1.ptr, w1_len, "w1")?;
    let gw = download::<T>(&stream, gw.ptr, gw_len, "gw")?;
    stream.synchronize().map_err(|e| fail(MIXSTACK_ERR_CUDA, format!("waiting for the weight download: {e}")))?;
    // The stack's weights live on the context's legacy default stream, not
    // on the caller's stream: they are freed at destroy, when the caller's
    // stream may be gone. `Stack::new` waits for the upload.
    let stack = Stack::<T>::new(&ctx.default_stream(), sh, &w0, &w1, &gw)?;
    Ok(StackState { inner: wrap(stack), ctx, device, shape: sh, precision: AtomicI32::new(MIXSTACK_PRECISION_AUTO) })
}

/// See `mixstack_stack_create` in include/mixstack.h.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn mixstack_stack_create(
    dtype: c_int,
    device: c_int,
    f: i64,
    cf: i64,
    lmax: i64,
    n_layers: i64,
    w0_dev: *const c_void,
    w1_dev: *const c_void,
    gw_dev: *const c_void,
    cu_stream: *mut c_void,
    out: *mut *mut mixstack_stack,
) -> c_int {
    boundary("mixstack_stack_create", || {
        // SAFETY: `out` is null or writable (caller contract).
        let (device, shape) = unsafe { create_args(out, dtype, device, [f, cf, lmax, n_layers]) }?;
        let w = [w0_dev, w1_dev, gw_dev].map(dptr);
        let state = if dtype == MIXSTACK_DTYPE_F32 {
            create_typed::<f32>(device, shape, w, cu_stream, Inner::F32)?
        } else {
            create_typed::<f64>(device, shape, w, cu_stream, Inner::F64)?
        };
        let h = register(state)?;
        // SAFETY: as above.
        unsafe { *out = h };
        Ok(())
    })
}

fn create_borrowing_typed<T: Element>(
    device: usize,
    sh: StackShape,
    wrap: fn(Stack<T>) -> Inner,
) -> Result<StackState, Fail> {
    // The shape first: refused without a driver.
    validate_shape::<T>(&Dispatch::builtin(), &sh)?;
    let (_restore, ctx) = bind_device(device)?;
    let stack = Stack::<T>::borrowing(&ctx.default_stream(), sh)?;
    Ok(StackState { inner: wrap(stack), ctx, device, shape: sh, precision: AtomicI32::new(MIXSTACK_PRECISION_AUTO) })
}

/// See `mixstack_stack_create_borrowing` in include/mixstack.h.
#[no_mangle]
pub unsafe extern "C" fn mixstack_stack_create_borrowing(
    dtype: c_int,
    device: c_int,
    f: i64,
    cf: i64,
    lmax: i64,
    n_layers: i64,
    out: *mut *mut mixstack_stack,
) -> c_int {
    boundary("mixstack_stack_create_borrowing", || {
        // SAFETY: `out` is null or writable (caller contract).
        let (device, shape) = unsafe { create_args(out, dtype, device, [f, cf, lmax, n_layers]) }?;
        let state = if dtype == MIXSTACK_DTYPE_F32 {
            create_borrowing_typed::<f32>(device, shape, Inner::F32)?
        } else {
            create_borrowing_typed::<f64>(device, shape, Inner::F64)?
        };
        let h = register(state)?;
        // SAFETY: as above.
        unsafe { *out = h };
        Ok(())
    })
}

/// See `mixstack_supports` in include/mixstack.h.
#[no_mangle]
pub unsafe extern "C" fn mixstack_supports(dtype: c_int, f: i64, cf: i64, lmax: i64, n_layers: i64) -> c_int {
    boundary("mixstack_supports", || {
        let shape =
            StackShape::new(dim("F", f, 1)?, dim("Cf", cf, 1)?, dim("lmax", lmax, 1)?, dim("n_layers", n_layers, 1)?);
        match dtype {
            MIXSTACK_DTYPE_F32 => validate_shape::<f32>(&Dispatch::builtin(), &shape)?,
            MIXSTACK_DTYPE_F64 => validate_shape::<f64>(&Dispatch::builtin(), &shape)?,
            _ => return Err(fail(MIXSTACK_ERR_BAD_DTYPE, format!("unknown dtype code {dtype}: 0 (f32) or 1 (f64)"))),
        }
        Ok(())
    })
}

/// See `mixstack_stack_destroy` in include/mixstack.h. A handle that is not
/// live (a second destroy, a foreign pointer) frees nothing and records
/// `MIXSTACK_ERR_INVALID_HANDLE` for [`mixstack_last_error`]; the C function
/// returns nothing.
#[no_mangle]
pub unsafe extern "C" fn mixstack_stack_destroy(stack: *mut mixstack_stack) {
    let _ = boundary("mixstack_stack_destroy", || {
        if stack.is_null() {
            return Ok(());
        }
        // Out of the registry first (under its lock), freed after the lock
        // is released: the stack's drop waits for the device.
        let last = unregister(stack)?;
        drop(last);
        Ok(())
    });
}

// ----------------------------------------------------------------------
// forward / backward
// ----------------------------------------------------------------------

/// Bind the stack's context (restored when the returned guard drops), then
/// the checks that need the driver: the stream belongs to the stack's
/// context, every tensor is memory of the stack's device.
fn enter(
    s: &StackState,
    cu_stream: *mut c_void,
    tensors: &[Tensor],
) -> Result<(CurrentContext, Arc<CudaStream>), Fail> {
    let restore = CurrentContext::save();
    bind(&s.ctx)?;
    let stream = call_stream(&s.ctx, cu_stream)?;
    for t in tensors {
        check_device_memory(t, s.device)?;
    }
    Ok((restore, stream))
}

/// A forward on `st`, with the call's weights or the stack's own.
fn forward_typed<T: Element>(
    s: &StackState,
    st: &Stack<T>,
    call: &ForwardCall,
    cu_stream: *mut c_void,
) -> Result<(), Fail> {
    let (e, aa) = (call.e, call.apply_alpha);
    let opts = ForwardOptions { precision: precision_mode(s.precision.load(Ordering::Relaxed))?, ..Default::default() };
    // SAFETY (both arms): `v` holds non-null, aligned pointers, outputs
    // disjoint from every input; `enter` found them memory of the stack's
    // device; sizes are the header's contract.
    match call.weights {
        None => {
            let v = Valid::<T, _>::forward(s.shape, e, call.ptrs)?;
            let (_restore, stream) = enter(s, cu_stream, &v.tensors)?;
            unsafe { st.forward_raw(&stream, &v.call, aa, &opts) }?;
        }
        Some(w) => {
            let v = Valid::<T, _>::forward_with(s.shape, e, call.ptrs, w)?;
            let (_restore, stream) = enter(s, cu_stream, &v.tensors)?;
            unsafe { st.forward_raw_with(&stream, &v.call, aa, &opts) }?;
        }
    }
    Ok(())
}

/// A backward on `st`, as [`forward_typed`].
fn backward_typed<T: Element>(
    s: &StackState,
    st: &Stack<T>,
    call: &BackwardCall,
    cu_stream: *mut c_void,
) -> Result<(), Fail> {
    let (e, aa) = (call.e, call.apply_alpha);
    let precision = precision_mode(s.precision.load(Ordering::Relaxed))?;
    let opts = BackwardOptions { fused: call.fused, precision, ..BackwardOptions::default() };
    // SAFETY (both arms): as in forward_typed.
    match call.weights {
        None => {
            let v = Valid::<T, _>::backward(s.shape, e, call.ptrs)?;
            let (_restore, stream) = enter(s, cu_stream, &v.tensors)?;
            unsafe { st.backward_raw(&stream, &v.call, aa, &opts) }?;
        }
        Some(w) => {
            let v = Valid::<T, _>::backward_with(s.shape, e, call.ptrs, w)?;
            let (_restore, stream) = enter(s, cu_stream, &v.tensors)?;
            unsafe { st.backward_raw_with(&stream, &v.call, aa, &opts) }?;
        }
    }
    Ok(())
}

/// One forward's arguments, from either entry point.
struct ForwardCall {
    e: usize,
    ptrs: ForwardPtrs,
    weights: Option<ForwardWeights>,
    apply_alpha: bool,
}

/// One backward's arguments, from either entry point.
struct BackwardCall {
    e: usize,
    ptrs: BackwardPtrs,
    weights: Option<BackwardWeights>,
    apply_alpha: bool,
    fused: FusedMode,
}

/// The handle, then the call (E == 0 touches no buffer).
fn forward(stack: *mut mixstack_stack, call: ForwardCall, cu_stream: *mut c_void) -> Result<(), Fail> {
    let s = handle(stack)?;
    if call.e == 0 {
        return Ok(());
    }
    match &s.inner {
        Inner::F32(st) => forward_typed(&s, st, &call, cu_stream),
        Inner::F64(st) => forward_typed(&s, st, &call, cu_stream),
    }
}

/// As [`forward`].
fn backward(stack: *mut mixstack_stack, call: BackwardCall, cu_stream: *mut c_void) -> Result<(), Fail> {
    let s = handle(stack)?;
    if call.e == 0 {
        return Ok(());
    }
    match &s.inner {
        Inner::F32(st) => backward_typed(&s, st, &call, cu_stream),
        Inner::F64(st) => backward_typed(&s, st, &call, cu_stream),
    }
}

fn backward_ptrs(
    grad_out: *const c_void,
    out: *const c_void,
    z_all: *const c_void,
    alpha: *const c_void,
    grad_u0: *mut c_void,
    grad_alpha: *mut c_void,
) -> BackwardPtrs {
    BackwardPtrs {
        grad_out: dptr(grad_out),
        out: dptr(out),
        z_all: dptr(z_all),
        alpha: dptr(alpha),
        grad_u0: dptr(grad_u0),
        grad_alpha: dptr(grad_alpha),
    }
}

/// See `mixstack_forward` in include/mixstack.h.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn mixstack_forward(
    stack: *mut mixstack_stack,
    e: i64,
    u0: *const c_void,
    alpha: *const c_void,
    apply_alpha: c_int,
    out: *mut c_void,
    z_all: *mut c_void,
    cu_stream: *mut c_void,
) -> c_int {
    boundary("mixstack_forward", || {
        let ptrs = ForwardPtrs { u0: dptr(u0), alpha: dptr(alpha), out: dptr(out), z_all: dptr(z_all) };
        let call = ForwardCall { e: edges(e)?, ptrs, weights: None, apply_alpha: apply_alpha != 0 };
        forward(stack, call, cu_stream)
    })
}

/// See `mixstack_forward_w` in include/mixstack.h.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn mixstack_forward_w(
    stack: *mut mixstack_stack,
    e: i64,
    u0: *const c_void,
    alpha: *const c_void,
    apply_alpha: c_int,
    w0: *const c_void,
    w1: *const c_void,
    gw: *const c_void,
    out: *mut c_void,
    z_all: *mut c_void,
    cu_stream: *mut c_void,
) -> c_int {
    boundary("mixstack_forward_w", || {
        let ptrs = ForwardPtrs { u0: dptr(u0), alpha: dptr(alpha), out: dptr(out), z_all: dptr(z_all) };
        let weights = Some(ForwardWeights { w0: dptr(w0), w1: dptr(w1), gw: dptr(gw) });
        let call = ForwardCall { e: edges(e)?, ptrs, weights, apply_alpha: apply_alpha != 0 };
        forward(stack, call, cu_stream)
    })
}

/// See `mixstack_backward` in include/mixstack.h.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn mixstack_backward(
    stack: *mut mixstack_stack,
    e: i64,
    grad_out: *const c_void,
    out: *const c_void,
    z_all: *const c_void,
    alpha: *const c_void,
    apply_alpha: c_int,
    grad_u0: *mut c_void,
    grad_alpha: *mut c_void,
    path: c_int,
    cu_stream: *mut c_void,
) -> c_int {
    boundary("mixstack_backward", || {
        let fused = path_mode(path)?;
        let ptrs = backward_ptrs(grad_out, out, z_all, alpha, grad_u0, grad_alpha);
        let call = BackwardCall { e: edges(e)?, ptrs, weights: None, apply_alpha: apply_alpha != 0, fused };
        backward(stack, call, cu_stream)
    })
}

/// See `mixstack_backward_w` in include/mixstack.h.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn mixstack_backward_w(
    stack: *mut mixstack_stack,
    e: i64,
    grad_out: *const c_void,
    out: *const c_void,
    z_all: *const c_void,
    alpha: *const c_void,
    apply_alpha: c_int,
    wt0: *const c_void,
    wt1: *const c_void,
    gw: *const c_void,
    gwt: *const c_void,
    grad_u0: *mut c_void,
    grad_alpha: *mut c_void,
    path: c_int,
    cu_stream: *mut c_void,
) -> c_int {
    boundary("mixstack_backward_w", || {
        let fused = path_mode(path)?;
        let ptrs = backward_ptrs(grad_out, out, z_all, alpha, grad_u0, grad_alpha);
        let weights = Some(BackwardWeights { wt0: dptr(wt0), wt1: dptr(wt1), gw: dptr(gw), gwt: dptr(gwt) });
        let call = BackwardCall { e: edges(e)?, ptrs, weights, apply_alpha: apply_alpha != 0, fused };
        backward(stack, call, cu_stream)
    })
}

// ----------------------------------------------------------------------
// queries
// ----------------------------------------------------------------------

/// See `mixstack_last_path` in include/mixstack.h.
#[no_mangle]
pub unsafe extern "C" fn mixstack_last_path(
    stack: *const mixstack_stack,
    path: *mut c_int,
    reason: *mut c_char,
    reason_len: usize,
) -> c_int {
    boundary("mixstack_last_path", || {
        let s = handle(stack)?;
        if path.is_null() {
            return Err(fail(MIXSTACK_ERR_NULL_POINTER, "`path` (where the path code is stored) is null"));
        }
        let decision = match &s.inner {
            Inner::F32(st) => st.last_path(),
            Inner::F64(st) => st.last_path(),
        };
        let (code, text) = match decision {
            None => (0, "no backward call yet".to_string()),
            Some(d) => (
                match d.path {
                    Path::Relay => MIXSTACK_PATH_RELAY,
                    Path::Fused => MIXSTACK_PATH_FUSED,
                },
                d.reason.to_string(),
            ),
        };
        // SAFETY: non-null, writable (caller contract).
        unsafe { *path = code };
        if !reason.is_null() && reason_len > 0 {
            let bytes = text.as_bytes();
            let n = bytes.len().min(reason_len - 1);
            // SAFETY: `reason` holds `reason_len` bytes (caller contract);
            // n + 1 <= reason_len.
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), reason as *mut u8, n);
                *reason.add(n) = 0;
            }
        }
        Ok(())
    })
}

/// See `mixstack_set_precision` in include/mixstack.h.
#[no_mangle]
pub unsafe extern "C" fn mixstack_set_precision(stack: *mut mixstack_stack, precision: c_int) -> c_int {
    boundary("mixstack_set_precision", || {
        let s = handle(stack)?;
        precision_mode(precision)?;
        s.precision.store(precision, Ordering::Relaxed);
        Ok(())
    })
}

/// See `mixstack_last_precision` in include/mixstack.h.
#[no_mangle]
pub unsafe extern "C" fn mixstack_last_precision(
    stack: *const mixstack_stack,
    forward: *mut c_int,
    backward: *mut c_int,
) -> c_int {
    boundary("mixstack_last_precision", || {
        let s = handle(stack)?;
        if forward.is_null() || backward.is_null() {
            return Err(fail(
                MIXSTACK_ERR_NULL_POINTER,
                "`forward` or `backward` (where the codes are stored) is null",
            ));
        }
        let (f, b) = match &s.inner {
            Inner::F32(st) => (st.last_forward_precision(), st.last_path().map(|d| d.precision)),
            Inner::F64(st) => (st.last_forward_precision(), st.last_path().map(|d| d.precision)),
        };
        // SAFETY: non-null, writable (caller contract).
        unsafe {
            *forward = f.map_or(0, precision_code);
            *backward = b.map_or(0, precision_code);
        }
        Ok(())
    })
}

/// See `mixstack_release_cached_memory` in include/mixstack.h.
#[no_mangle]
pub unsafe extern "C" fn mixstack_release_cached_memory(stack: *mut mixstack_stack) -> c_int {
    boundary("mixstack_release_cached_memory", || {
        let s = handle(stack)?;
        match &s.inner {
            Inner::F32(st) => st.release_cached_memory()?,
            Inner::F64(st) => st.release_cached_memory()?,
        }
        Ok(())
    })
}

/// See `mixstack_last_error` in include/mixstack.h.
#[no_mangle]
pub extern "C" fn mixstack_last_error() -> *const c_char {
    catch_unwind(last_error_ptr).unwrap_or(c"mixstack_last_error: internal error".as_ptr())
}

/// See `mixstack_abi_version` in include/mixstack.h.
#[no_mangle]
pub extern "C" fn mixstack_abi_version() -> c_int {
    MIXSTACK_ABI_VERSION
}
