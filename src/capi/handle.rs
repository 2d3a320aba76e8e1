//! Handles: what a live handle names ([`StackState`]), and the registry
//! that maps handles to it.
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

use std::collections::BTreeMap;
use std::sync::atomic::AtomicI32;
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::result;
use cudarc::driver::sys::{self, CUcontext};
use cudarc::driver::CudaContext;

use super::status::{fail, mixstack_status::*, Fail};
use crate::runtime::{Stack, StackShape};

/// The stack of a handle, by element type.
pub(super) enum Inner {
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
pub(super) struct StackState {
    // Field order is drop order: the stack (it synchronizes the context and
    // frees the weights) before the context reference.
    pub(super) inner: Inner,
    pub(super) ctx: Arc<CudaContext>,
    pub(super) device: usize,
    pub(super) shape: StackShape,
    /// `mixstack_set_precision`'s code (default auto: the environment).
    pub(super) precision: AtomicI32,
}

// The stack is used from any thread (PyTorch runs backward on its own).
const _: fn() = || {
    fn send_sync<X: Send + Sync>() {}
    send_sync::<StackState>();
};

/// Restores the calling thread's current context on drop.
pub(super) struct CurrentContext(Option<CUcontext>);

impl CurrentContext {
    /// Only call once the driver is known to be loadable.
    pub(super) fn save() -> Self {
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
// the registry
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
pub(super) fn register(state: StackState) -> Result<*mut mixstack_stack, Fail> {
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
pub(super) struct Live(Option<Arc<StackState>>);

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
pub(super) fn handle(stack: *const mixstack_stack) -> Result<Live, Fail> {
    if stack.is_null() {
        return Err(fail(MIXSTACK_ERR_NULL_POINTER, "the stack handle is null"));
    }
    let found = registry().live.get(&(stack as usize)).cloned();
    found.map(|s| Live(Some(s))).ok_or_else(|| invalid_handle(stack))
}

/// Remove a live handle from the registry (null is an error here too; the
/// caller treats it first). The stack is freed when the returned reference
/// drops, unless a call on another thread still holds one.
pub(super) fn unregister(stack: *const mixstack_stack) -> Result<Live, Fail> {
    if stack.is_null() {
        return Err(fail(MIXSTACK_ERR_NULL_POINTER, "the stack handle is null"));
    }
    let removed = registry().live.remove(&(stack as usize));
    removed.map(|s| Live(Some(s))).ok_or_else(|| invalid_handle(stack))
}
