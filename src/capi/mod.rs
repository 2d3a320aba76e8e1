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
//!   as memory of the stack's device, a stream of another context, an
//!   unknown precision code. Each
//!   check runs once: a call's tensors are checked into one validated value
//!   (checks.rs), whose null and size checks are the runtime's own
//!   ([`crate::runtime::Checked`], which the raw entry points take);
//! - a handle is looked up in the process-wide registry of live handles
//!   before it is used: a destroyed handle or a value that never came from
//!   `mixstack_stack_create` is refused with `MIXSTACK_ERR_INVALID_HANDLE`
//!   (handle.rs says how the registry works);
//! - E == 0 returns `MIXSTACK_OK` without touching any buffer;
//! - a failing call stores a message for [`mixstack_last_error`] (per
//!   thread); a successful call leaves it alone;
//! - the calling thread's current CUDA context is restored on return.
//!
//! Files: status.rs (status codes, the last error, the boundary), handle.rs
//! (handles and their registry), checks.rs (argument checks), entry.rs (the
//! exported functions).

#![allow(non_camel_case_types)]
#![allow(clippy::missing_safety_doc)]

mod checks;
mod entry;
mod handle;
mod status;

pub use entry::{
    mixstack_abi_version, mixstack_backward, mixstack_forward, mixstack_last_error, mixstack_last_path,
    mixstack_last_precision, mixstack_release_cached_memory, mixstack_set_precision, mixstack_stack_create,
    mixstack_stack_destroy,
};
pub use handle::mixstack_stack;
pub use status::{
    mixstack_status, status_of, MIXSTACK_ABI_VERSION, MIXSTACK_DTYPE_F32, MIXSTACK_DTYPE_F64, MIXSTACK_PATH_AUTO,
    MIXSTACK_PATH_FUSED, MIXSTACK_PATH_FUSED_ALWAYS, MIXSTACK_PATH_RELAY, MIXSTACK_PRECISION_AUTO,
    MIXSTACK_PRECISION_EXACT, MIXSTACK_PRECISION_FP16X3,
};
