//! The C ABI over [`crate::runtime::Stack`] (header: `include/mixstack.h`).
//!
//! An opaque handle, `mixstack_stack*`, names one `Stack<f32>` or
//! `Stack<f64>` on the primary context of one device (the context the CUDA
//! runtime, and so PyTorch, uses). Forward and backward run on the caller's
//! `CUstream` over caller-owned device buffers (layouts of
//! docs/MIXING_STACK.md); the weights are device pointers read once, at
//! create.
//!
//! Rules every function keeps:
//! - the body runs inside `catch_unwind`: no panic crosses the boundary (a
//!   panic is reported as `MIXSTACK_ERR_INTERNAL`);
//! - every argument is checked before anything is launched or allocated: a
//!   null pointer where data is needed (E > 0), a shape outside the build, a
//!   pointer not aligned to the element size, an unknown dtype or path code,
//!   outputs that overlap another tensor, a pointer the driver does not know
//!   as memory of the stack's device, a stream of another context;
//! - a handle is looked up in the process-wide registry of live handles
//!   before it is used: a destroyed handle or a value that never came from
//!   `mixstack_stack_create` is refused with `MIXSTACK_ERR_INVALID_HANDLE`
//!   (see [the handle registry](#the-handle-registry));
//! - E == 0 returns `MIXSTACK_OK` without touching any buffer;
//! - a failing call stores a message for [`mixstack_last_error`] (per
//!   thread); a successful call leaves it alone;
//! - the calling thread's current CUDA context is restored on return.
//!
//! # The handle registry
//!
//! A handle is not an address: it is a token, drawn from a process-wide
//! counter and never reused, that the registry (a map behind one mutex) maps
//! to the stack it names. On 64-bit targets every token has tag bits above
//! the user address range, so no pointer to real memory is ever a live
//! handle. Nothing behind the caller's pointer is ever read: a foreign,
//! garbage or destroyed handle costs one map lookup and is refused. Create
//! registers the stack; destroy removes it from the registry first, so a
//! second destroy finds nothing to free and records the error.
//!
//! The registry lock is held only for the lookup (or the insertion or
//! removal), never while a call runs: calls on independent stacks, and
//! concurrent calls on one stack, do not wait on each other. A call holds its
//! own reference (`Arc`) to the stack from the lookup to its return. The
//! registry protects against destroyed and foreign handles; the contract
//! (include/mixstack.h) still says a handle must not be destroyed while
//! another thread is in a call on it. Should that happen anyway, it stays
//! memory-safe: the call in flight finishes on a live stack, which is freed
//! when that call returns instead of inside destroy, and any later call with
//! the handle is refused.

#![allow(non_camel_case_types)]
#![allow(clippy::missing_safety_doc)]

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_void, CString};
use std::fmt::Display;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::sys::{self, CUcontext, CUdeviceptr, CUpointer_attribute, CUresult, CUstream};
use cudarc::driver::{result, CudaContext, CudaStream};

use crate::runtime::device::{driver_present, open_device};
use crate::runtime::dispatch::{Dispatch, Path};
use crate::runtime::error::MixError;
use crate::runtime::stack::validate_shape;
use crate::runtime::{BackwardOptions, BackwardPtrs, Element, ForwardPtrs, FusedMode, Stack, StackShape};

/// Version of the C ABI (`mixstack_abi_version`); bumped on any change of a
/// signature, a status code or a layout.
pub const MIXSTACK_ABI_VERSION: c_int = 1;

/// Status codes of the C functions (`mixstack_status` in the header).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum mixstack_status {
    /// Success.
    MIXSTACK_OK = 0,
    /// A pointer that must not be null is null (handle, out-parameter, or a
    /// tensor needed with E > 0).
    MIXSTACK_ERR_NULL_POINTER = 1,
    /// A shape parameter or E outside what the build supports (negative,
    /// zero where it must be positive, no kernel for it, sizes that overflow).
    MIXSTACK_ERR_BAD_SHAPE = 2,
    /// Unknown dtype code.
    MIXSTACK_ERR_BAD_DTYPE = 3,
    /// A tensor pointer not aligned to the element size.
    MIXSTACK_ERR_MISALIGNED = 4,
    /// A valid request this build or device cannot serve (e.g. shared memory).
    MIXSTACK_ERR_UNSUPPORTED = 5,
    /// The CUDA driver is missing or a driver call failed.
    MIXSTACK_ERR_CUDA = 6,
    /// A bug: a panic or an inconsistent kernel table.
    MIXSTACK_ERR_INTERNAL = 7,
    /// Any other invalid argument: unknown path code, negative device,
    /// overlapping outputs, a pointer that is not memory of the stack's
    /// device, a stream of another context, a malformed
    /// `MIXSTACK_STACK_BWD_FUSED`.
    MIXSTACK_ERR_BAD_ARGUMENT = 8,
    /// A non-null handle that is not live: destroyed already, or never
    /// returned by `mixstack_stack_create` (a foreign or garbage pointer).
    /// Nothing behind it is read.
    MIXSTACK_ERR_INVALID_HANDLE = 9,
}

use mixstack_status::*;

impl mixstack_status {
    pub fn code(self) -> c_int {
        self as c_int
    }
    /// Every status, in code order.
    pub const ALL: [mixstack_status; 10] = [
        MIXSTACK_OK,
        MIXSTACK_ERR_NULL_POINTER,
        MIXSTACK_ERR_BAD_SHAPE,
        MIXSTACK_ERR_BAD_DTYPE,
        MIXSTACK_ERR_MISALIGNED,
        MIXSTACK_ERR_UNSUPPORTED,
        MIXSTACK_ERR_CUDA,
        MIXSTACK_ERR_INTERNAL,
        MIXSTACK_ERR_BAD_ARGUMENT,
        MIXSTACK_ERR_INVALID_HANDLE,
    ];
    pub fn name(self) -> &'static str {
        match self {
            MIXSTACK_OK => "MIXSTACK_OK",
            MIXSTACK_ERR_NULL_POINTER => "MIXSTACK_ERR_NULL_POINTER",
            MIXSTACK_ERR_BAD_SHAPE => "MIXSTACK_ERR_BAD_SHAPE",
            MIXSTACK_ERR_BAD_DTYPE => "MIXSTACK_ERR_BAD_DTYPE",
            MIXSTACK_ERR_MISALIGNED => "MIXSTACK_ERR_MISALIGNED",
            MIXSTACK_ERR_UNSUPPORTED => "MIXSTACK_ERR_UNSUPPORTED",
            MIXSTACK_ERR_CUDA => "MIXSTACK_ERR_CUDA",
            MIXSTACK_ERR_INTERNAL => "MIXSTACK_ERR_INTERNAL",
            MIXSTACK_ERR_BAD_ARGUMENT => "MIXSTACK_ERR_BAD_ARGUMENT",
            MIXSTACK_ERR_INVALID_HANDLE => "MIXSTACK_ERR_INVALID_HANDLE",
        }
    }
}

/// dtype codes of `mixstack_stack_create`.
pub const MIXSTACK_DTYPE_F32: c_int = 0;
pub const MIXSTACK_DTYPE_F64: c_int = 1;
/// path codes of `mixstack_backward` / `mixstack_last_path`.
pub const MIXSTACK_PATH_AUTO: c_int = 0;
pub const MIXSTACK_PATH_RELAY: c_int = 1;
pub const MIXSTACK_PATH_FUSED: c_int = 2;

// ----------------------------------------------------------------------
// errors
// ----------------------------------------------------------------------

/// A failed call: its status and message.
struct Fail {
    status: mixstack_status,
    msg: String,
}

fn fail(status: mixstack_status, msg: impl Display) -> Fail {
    Fail { status, msg: msg.to_string() }
}

/// The status a runtime error maps to.
pub fn status_of(e: &MixError) -> mixstack_status {
    match e {
        MixError::NullPointer { .. } => MIXSTACK_ERR_NULL_POINTER,
        MixError::UnsupportedShape { .. }
        | MixError::BufferLength { .. }
        | MixError::BufferNotMultiple { .. }
        | MixError::NoKernel { .. }
        | MixError::GridTooLarge { .. }
        | MixError::SizeOverflow { .. }
        | MixError::BlasSize { .. } => MIXSTACK_ERR_BAD_SHAPE,
        MixError::UnsupportedDtype { .. } => MIXSTACK_ERR_BAD_DTYPE,
        MixError::BadOverride { .. }
        | MixError::InvalidSwitch { .. }
        | MixError::ContextMismatch { .. }
        | MixError::ScratchCap { .. } => MIXSTACK_ERR_BAD_ARGUMENT,
        MixError::NoDriver { .. } | MixError::Driver { .. } | MixError::Blas { .. } => MIXSTACK_ERR_CUDA,
        MixError::SharedMemory { .. } => MIXSTACK_ERR_UNSUPPORTED,
        MixError::TableInconsistent { .. } | MixError::PlanInconsistent { .. } => MIXSTACK_ERR_INTERNAL,
    }
}

impl From<MixError> for Fail {
    fn from(e: MixError) -> Self {
        Fail { status: status_of(&e), msg: e.to_string() }
    }
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(msg: String) {
    // Interior NULs would truncate the C string: replace them.
    let c = CString::new(msg.replace('\0', "\\0")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "(non-string panic payload)".to_string()
    }
}

/// Run `body` behind the boundary: catch panics, record the message of a
/// failure, return the status code.
fn boundary(func: &'static str, body: impl FnOnce() -> Result<(), Fail>) -> c_int {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => MIXSTACK_OK.code(),
        Ok(Err(f)) => {
            set_last_error(format!("{func}: {} ({})", f.msg, f.status.name()));
            f.status.code()
        }
        Err(p) => {
            set_last_error(format!(
                "{func}: internal error (panic: {}) ({})",
                panic_text(p.as_ref()),
                MIXSTACK_ERR_INTERNAL.name()
            ));
            MIXSTACK_ERR_INTERNAL.code()
        }
    }
}

// ----------------------------------------------------------------------
// the handle
// ----------------------------------------------------------------------

enum Inner {
    F32(Stack<f32>),
    F64(Stack<f64>),
}

/// The opaque handle type of the C ABI. A `*mut mixstack_stack` is a token
/// of the handle registry, never the address of a value of this type: no
/// value of it is ever made, and nothing is ever read through the pointer.
#[repr(C)]
pub struct mixstack_stack {
    _opaque: [u8; 0],
}

/// What a live handle names: one stack on one device.
struct StackState {
    // Field order is drop order: the stack (it synchronizes the context and
    // frees the weights) before the context reference.
    inner: Inner,
    ctx: Arc<CudaContext>,
    device: usize,
    shape: StackShape,
}

// The stack is used from any thread (PyTorch runs backward on its own).
const _: fn() = || {
    fn send_sync<X: Send + Sync>() {}
    send_sync::<StackState>();
};

impl StackState {
    fn elem_size(&self) -> usize {
        match self.inner {
            Inner::F32(_) => 4,
            Inner::F64(_) => 8,
        }
    }
}

/// Restores the calling thread's current context on drop.
struct CurrentContext(Option<CUcontext>);

impl CurrentContext {
    /// Only call once the driver is known to be loadable.
    fn save() -> Self {
        CurrentContext(result::ctx::get_current().ok().flatten())
    }
}

impl Drop for CurrentContext {
    fn drop(&mut self) {
        let to = self.0.unwrap_or(std::ptr::null_mut());
        // SAFETY: `to` was current on this thread at entry (or null, which
        // unbinds); restoring it is what the caller expects.
        unsafe {
            let _ = sys::cuCtxSetCurrent(to);
        }
    }
}

// ----------------------------------------------------------------------
// the handle registry (see the module documentation)
// ----------------------------------------------------------------------

/// Tag bits of every token: above the user address range of 64-bit targets
/// (x86-64 and AArch64 user space ends below 2^48), so an address of real
/// memory is never a live handle. Zero (no tag) where usize is narrower.
const TOKEN_TAG: usize = (0x4d53_u64 << 48) as usize;

/// Live handles: token -> stack, and the counter tokens are drawn from.
struct Registry {
    /// Tokens handed out so far; the next token derives from `issued + 1`.
    issued: u64,
    live: BTreeMap<usize, Arc<StackState>>,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry { issued: 0, live: BTreeMap::new() });

/// The registry, locked. Nothing panics while it is held, but a poisoned
/// lock still guards a consistent map: take it over.
fn registry() -> std::sync::MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Register a new stack; returns its handle (never null, never reused).
fn register(state: StackState) -> Result<*mut mixstack_stack, Fail> {
    let state = Live(Some(Arc::new(state)));
    let token = {
        let mut reg = registry();
        reg.issued += 1;
        // 16-byte steps below the tag: 2^44 creates before the counter
        // reaches the tag bits.
        let token = TOKEN_TAG | ((reg.issued as usize) << 4);
        match reg.live.entry(token) {
            std::collections::btree_map::Entry::Vacant(v) => {
                v.insert(Arc::clone(state.0.as_ref().expect("just made")));
                Some(token)
            }
            std::collections::btree_map::Entry::Occupied(_) => None,
        }
    };
    // On failure `state` (the only reference) frees the stack here, after
    // the lock is released.
    let token =
        token.ok_or_else(|| fail(MIXSTACK_ERR_INTERNAL, "the handle registry ran out of fresh handle values"))?;
    Ok(token as *mut mixstack_stack)
}

fn invalid_handle(stack: *const mixstack_stack) -> Fail {
    fail(
        MIXSTACK_ERR_INVALID_HANDLE,
        format!(
            "{stack:p} is not a live stack handle: destroyed already, or not returned by mixstack_stack_create \
             (nothing behind it was read)"
        ),
    )
}

/// A call's reference to a live stack, taken from the registry. Dropping the
/// last reference (the handle was destroyed while this call ran) frees the
/// stack here, with the thread's current context restored afterwards.
struct Live(Option<Arc<StackState>>);

impl std::ops::Deref for Live {
    type Target = StackState;
    fn deref(&self) -> &StackState {
        self.0.as_deref().expect("a Live holds its stack until dropped")
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        if let Some(last) = self.0.take().and_then(Arc::into_inner) {
            // A stack exists, so the driver is loaded.
            let _restore = CurrentContext::save();
            drop(last);
        }
    }
}

/// The stack behind a handle: null is `MIXSTACK_ERR_NULL_POINTER`, a handle
/// not in the registry `MIXSTACK_ERR_INVALID_HANDLE`. The registry lock is
/// held only for the lookup; the pointer is never dereferenced.
fn handle(stack: *const mixstack_stack) -> Result<Live, Fail> {
    if stack.is_null() {
        return Err(fail(MIXSTACK_ERR_NULL_POINTER, "the stack handle is null"));
    }
    let found = registry().live.get(&(stack as usize)).cloned();
    found.map(|s| Live(Some(s))).ok_or_else(|| invalid_handle(stack))
}

/// Remove a live handle from the registry (null is an error here too; the
/// caller treats it first). The stack is freed when the returned reference
/// drops, unless a call on another thread still holds one.
fn unregister(stack: *const mixstack_stack) -> Result<Live, Fail> {
    if stack.is_null() {
        return Err(fail(MIXSTACK_ERR_NULL_POINTER, "the stack handle is null"));
    }
    let removed = registry().live.remove(&(stack as usize));
    removed.map(|s| Live(Some(s))).ok_or_else(|| invalid_handle(stack))
}

// ----------------------------------------------------------------------
// argument checks (pure CPU, before any CUDA call)
// ----------------------------------------------------------------------

/// One tensor argument of a call: name, address, bytes.
#[derive(Clone, Copy)]
struct Tensor {
    name: &'static str,
    ptr: CUdeviceptr,
    bytes: u64,
}

fn dptr(p: *const c_void) -> CUdeviceptr {
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

/// Outputs must not overlap each other or any input.
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

fn edges(e: i64) -> Result<usize, Fail> {
    usize::try_from(e).map_err(|_| fail(MIXSTACK_ERR_BAD_SHAPE, format!("E = {e} is negative")))
}

fn dim(name: &str, v: i64, min: i64) -> Result<usize, Fail> {
    if v < min {
        return Err(fail(MIXSTACK_ERR_BAD_SHAPE, format!("{name} = {v}: must be >= {min}")));
    }
    usize::try_from(v).map_err(|_| fail(MIXSTACK_ERR_BAD_SHAPE, format!("{name} = {v} does not fit usize")))
}

fn bytes_of(len: usize, elem: usize, e: usize, what: &'static str) -> Result<u64, Fail> {
    len.checked_mul(elem).map(|b| b as u64).ok_or_else(|| Fail::from(MixError::SizeOverflow { e: e as u64, what }))
}

fn path_mode(path: c_int) -> Result<FusedMode, Fail> {
    match path {
        MIXSTACK_PATH_AUTO => Ok(FusedMode::FromEnv),
        MIXSTACK_PATH_RELAY => Ok(FusedMode::Off),
        MIXSTACK_PATH_FUSED => Ok(FusedMode::On),
        p => Err(fail(
            MIXSTACK_ERR_BAD_ARGUMENT,
            format!("unknown path code {p}: 0 (auto, MIXSTACK_STACK_BWD_FUSED), 1 (relay) or 2 (fused)"),
        )),
    }
}

// ----------------------------------------------------------------------
// CUDA-side checks
// ----------------------------------------------------------------------

/// Wrap the caller's stream (null: the legacy default stream) and check that
/// it belongs to `ctx`. `ctx` must be bound to the thread.
fn call_stream(ctx: &Arc<CudaContext>, cu_stream: *mut c_void) -> Result<Arc<CudaStream>, Fail> {
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
fn check_device_memory(t: &Tensor, device: usize) -> Result<(), Fail> {
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

struct CreateArgs {
    device: usize,
    shape: StackShape,
    w0: Tensor,
    w1: Tensor,
    gw: Tensor,
    cu_stream: *mut c_void,
}

fn create_typed<T: Element>(a: &CreateArgs, wrap: fn(Stack<T>) -> Inner) -> Result<StackState, Fail> {
    let elem = std::mem::size_of::<T>();
    let sh = a.shape;
    // Shape against the build's table first (CPU only, no driver needed).
    validate_shape::<T>(&Dispatch::builtin(), &sh)?;
    let (w0_len, w1_len, gw_len) = match (sh.w0_len(), sh.w1_len(), sh.gw_len()) {
        (Some(a), Some(b), Some(c)) => (a, b, c),
        _ => return Err(fail(MIXSTACK_ERR_BAD_SHAPE, "the weight sizes overflow usize")),
    };
    let mut w = [a.w0, a.w1, a.gw];
    for (t, len) in w.iter_mut().zip([w0_len, w1_len, gw_len]) {
        t.bytes = bytes_of(len, elem, 0, "weight bytes")?;
    }
    for t in &w {
        if t.bytes > 0 {
            check_nonnull(t)?;
            check_aligned(t, elem)?;
        }
    }

    if !driver_present() {
        return Err(MixError::NoDriver { why: "libcuda could not be loaded".into() }.into());
    }
    let _restore = CurrentContext::save();
    let ctx = open_device(a.device)?;
    ctx.bind_to_thread().map_err(|e| fail(MIXSTACK_ERR_CUDA, format!("binding the context: {e}")))?;
    for t in w.iter().filter(|t| t.bytes > 0) {
        check_device_memory(t, a.device)?;
    }
    let stream = call_stream(&ctx, a.cu_stream)?;
    let w0 = download::<T>(&stream, a.w0.ptr, w0_len, "w0")?;
    let w1 = download::<T>(&stream, a.w1.ptr, w1_len, "w1")?;
    let gw = download::<T>(&stream, a.gw.ptr, gw_len, "gw")?;
    stream.synchronize().map_err(|e| fail(MIXSTACK_ERR_CUDA, format!("waiting for the weight download: {e}")))?;
    // The stack's weights live on the context's legacy default stream, not
    // on the caller's stream: they are freed at destroy, when the caller's
    // stream may be gone. `Stack::new` waits for the upload.
    let stack = Stack::<T>::new(&ctx.default_stream(), sh, &w0, &w1, &gw)?;
    Ok(StackState { inner: wrap(stack), ctx, device: a.device, shape: sh })
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
        let t = |name, p| Tensor { name, ptr: dptr(p), bytes: 0 };
        let args =
            CreateArgs { device, shape, w0: t("w0", w0_dev), w1: t("w1", w1_dev), gw: t("gw", gw_dev), cu_stream };
        let state = if dtype == MIXSTACK_DTYPE_F32 {
            create_typed::<f32>(&args, Inner::F32)?
        } else {
            create_typed::<f64>(&args, Inner::F64)?
        };
        let h = register(state)?;
        // SAFETY: as above.
        unsafe { *out = h };
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

/// Common part of a call on a live handle: bind the context (restored on
/// drop of the returned guard), wrap and check the stream, check that every
/// tensor is memory of the stack's device.
fn enter(
    s: &StackState,
    cu_stream: *mut c_void,
    tensors: &[Tensor],
) -> Result<(CurrentContext, Arc<CudaStream>), Fail> {
    let restore = CurrentContext::save();
    s.ctx.bind_to_thread().map_err(|e| fail(MIXSTACK_ERR_CUDA, format!("binding the context: {e}")))?;
    let stream = call_stream(&s.ctx, cu_stream)?;
    for t in tensors {
        check_device_memory(t, s.device)?;
    }
    Ok((restore, stream))
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
        let e = edges(e)?;
        let s = handle(stack)?;
        if e == 0 {
            return Ok(());
        }
        let (sh, elem) = (s.shape, s.elem_size());
        sh.check_edges(e, elem)?;
        let surf = bytes_of(sh.surface_len(e)?, elem, e, "F*E*ROW bytes")?;
        let t = |name, p: *const c_void, bytes| Tensor { name, ptr: dptr(p), bytes };
        let u0_t = t("u0", u0, surf);
        let alpha_t = t("alpha", alpha, bytes_of(sh.alpha_len(e)?, elem, e, "E*F bytes")?);
        let out_t = t("out", out, surf);
        let z_t = t("z_all", z_all, bytes_of(sh.z_all_len(e)?, elem, e, "z_all bytes")?);
        let mut all = vec![u0_t, alpha_t, out_t];
        if sh.gated() > 0 {
            all.push(z_t);
        }
        for x in &all {
            check_nonnull(x)?;
        }
        for x in &all {
            check_aligned(x, elem)?;
        }
        let outputs: Vec<Tensor> = all[2..].to_vec();
        check_no_overlap(&outputs, &all[..2])?;

        let (_restore, stream) = enter(&s, cu_stream, &all)?;
        let ptrs = ForwardPtrs {
            u0: u0_t.ptr,
            alpha: alpha_t.ptr,
            out: out_t.ptr,
            z_all: if sh.gated() > 0 { z_t.ptr } else { 0 },
        };
        let aa = apply_alpha != 0;
        // SAFETY: every pointer is non-null, aligned, memory of the stack's
        // device, outputs disjoint; sizes are the header's contract.
        match &s.inner {
            Inner::F32(st) => unsafe { st.forward_raw(&stream, e, &ptrs, aa) }?,
            Inner::F64(st) => unsafe { st.forward_raw(&stream, e, &ptrs, aa) }?,
        }
        Ok(())
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
        let mode = path_mode(path)?;
        let e = edges(e)?;
        let s = handle(stack)?;
        if e == 0 {
            return Ok(());
        }
        let (sh, elem) = (s.shape, s.elem_size());
        sh.check_edges(e, elem)?;
        let surf = bytes_of(sh.surface_len(e)?, elem, e, "F*E*ROW bytes")?;
        let ab = bytes_of(sh.alpha_len(e)?, elem, e, "E*F bytes")?;
        let t = |name, p: *const c_void, bytes| Tensor { name, ptr: dptr(p), bytes };
        let go_t = t("grad_out", grad_out, surf);
        let out_t = t("out", out, surf);
        let alpha_t = t("alpha", alpha, ab);
        let z_t = t("z_all", z_all, bytes_of(sh.z_all_len(e)?, elem, e, "z_all bytes")?);
        let gu_t = t("grad_u0", grad_u0, surf);
        let ga_t = t("grad_alpha", grad_alpha, ab);
        let mut inputs = vec![go_t, out_t, alpha_t];
        if sh.gated() > 0 {
            inputs.push(z_t);
        }
        let outputs = [gu_t, ga_t];
        for x in inputs.iter().chain(&outputs) {
            check_nonnull(x)?;
        }
        for x in inputs.iter().chain(&outputs) {
            check_aligned(x, elem)?;
        }
        check_no_overlap(&outputs, &inputs)?;

        let all: Vec<Tensor> = inputs.iter().chain(&outputs).copied().collect();
        let (_restore, stream) = enter(&s, cu_stream, &all)?;
        let ptrs = BackwardPtrs {
            grad_out: go_t.ptr,
            out: out_t.ptr,
            z_all: if sh.gated() > 0 { z_t.ptr } else { 0 },
            alpha: alpha_t.ptr,
            grad_u0: gu_t.ptr,
            grad_alpha: ga_t.ptr,
        };
        let opts = BackwardOptions { fused: mode, ..BackwardOptions::default() };
        let aa = apply_alpha != 0;
        // SAFETY: as in mixstack_forward.
        match &s.inner {
            Inner::F32(st) => unsafe { st.backward_raw(&stream, e, &ptrs, aa, &opts) }?,
            Inner::F64(st) => unsafe { st.backward_raw(&stream, e, &ptrs, aa, &opts) }?,
        };
        Ok(())
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
    catch_unwind(|| LAST_ERROR.with(|e| e.borrow().as_ptr())).unwrap_or(c"mixstack_last_error: internal error".as_ptr())
}

/// See `mixstack_abi_version` in include/mixstack.h.
#[no_mangle]
pub extern "C" fn mixstack_abi_version() -> c_int {
    MIXSTACK_ABI_VERSION
}
