//! Status codes, the mapping of runtime errors onto them, and the per-thread
//! message of the last failing call; [`boundary`] runs every entry point's
//! body and records its failure.

use std::cell::RefCell;
use std::ffi::{c_char, c_int, CString};
use std::fmt::Display;
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::runtime::error::MixError;

/// Version of the C ABI (`mixstack_abi_version`); bumped on any change of a
/// signature, a status code or a layout. 2: stacks that borrow their
/// weights, and calls that pass them (`mixstack_stack_create_borrowing`,
/// `mixstack_forward_w`, `mixstack_backward_w`) and `mixstack_supports`;
/// 3: the precision mode (`mixstack_set_precision`,
/// `mixstack_last_precision`); 4: path 2 (FUSED) is the measured regime and
/// path 3 (FUSED_ALWAYS) the old meaning of 2. Earlier functions are
/// unchanged.
pub const MIXSTACK_ABI_VERSION: c_int = 4;

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
pub const MIXSTACK_PATH_FUSED_ALWAYS: c_int = 3;
/// precision codes of `mixstack_set_precision` / `mixstack_last_precision`.
pub const MIXSTACK_PRECISION_AUTO: c_int = 0;
pub const MIXSTACK_PRECISION_EXACT: c_int = 1;
pub const MIXSTACK_PRECISION_FP16X3: c_int = 2;

/// A failed call: its status and message.
#[derive(Debug)]
pub(super) struct Fail {
    pub(super) status: mixstack_status,
    pub(super) msg: String,
}

pub(super) fn fail(status: mixstack_status, msg: impl Display) -> Fail {
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
        | MixError::ScratchCap { .. }
        | MixError::WeightRange { .. }
        | MixError::NoWeights => MIXSTACK_ERR_BAD_ARGUMENT,
        MixError::NoDriver { .. } | MixError::Driver { .. } | MixError::Blas { .. } => MIXSTACK_ERR_CUDA,
        MixError::SharedMemory { .. } | MixError::UnsupportedArch { .. } | MixError::UnsupportedPrecision { .. } => {
            MIXSTACK_ERR_UNSUPPORTED
        }
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
pub(super) fn boundary(func: &'static str, body: impl FnOnce() -> Result<(), Fail>) -> c_int {
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

/// The calling thread's last message ("" if none), as a C string that lives
/// until the thread's next failing call.
pub(super) fn last_error_ptr() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}
