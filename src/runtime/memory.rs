//! Device allocation accounting for one stack call.
//!
//! Every buffer a forward/backward call allocates (its outputs and its
//! scratch: ping-pong surfaces, and on the relay path `sig` and `gz`) goes
//! through a per-call tracker, which records current and peak bytes. The result of
//! a call is a [`CallMemory`]:
//!
//! - `peak_bytes` is the call's **extra peak**: the most bytes the call held
//!   allocated at once, outputs included. It does not count the stack's
//!   weights (allocated once at construction, see `Stack::weight_bytes`), the
//!   caller's inputs, or the CUDA memory pool's own rounding/caching.
//! - For the raw-pointer entry points the outputs are caller-owned, so
//!   `output_bytes` is 0 and `peak_bytes` is scratch only.
//!
//! Allocations are stream-ordered on the caller's stream (`cuMemAllocAsync`
//! where the device supports it), and scratch is released on that stream at
//! the end of the call.

use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use super::element::Element;
use super::error::{DriverContext, MixError};

/// Memory one call allocated (see the module docs for what is counted).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallMemory {
    /// Extra peak: most bytes held at once by the call, outputs included.
    pub peak_bytes: u64,
    /// Bytes of the outputs the call allocated and returned.
    pub output_bytes: u64,
    /// Bytes of scratch at the peak (`peak_bytes - output_bytes` when the
    /// outputs are allocated first, which the stack does).
    pub scratch_bytes: u64,
    /// Number of allocations made.
    pub allocations: u32,
}

/// Per-call allocation tracker. Allocates on one stream.
pub(crate) struct Tracker<'s> {
    stream: &'s Arc<CudaStream>,
    poison: bool,
    current: u64,
    peak: u64,
    outputs: u64,
    scratch_peak: u64,
    count: u32,
}

impl<'s> Tracker<'s> {
    /// `poison`: fill every allocation with NaN (a debug aid for tests:
    /// anything a kernel forgets to write shows up).
    pub(crate) fn new(stream: &'s Arc<CudaStream>, poison: bool) -> Self {
        Tracker { stream, poison, current: 0, peak: 0, outputs: 0, scratch_peak: 0, count: 0 }
    }

    fn alloc<T: Element>(&mut self, len: usize, tensor: &'static str) -> Result<CudaSlice<T>, MixError> {
        let buf = if len == 0 {
            self.stream.null::<T>().during(|| format!("allocating empty `{tensor}`"))?
        } else if self.poison {
            let host = vec![T::NAN; len];
            self.stream.clone_htod(&host).during(|| format!("allocating NaN-poisoned `{tensor}` ({len} elements)"))?
        } else {
            // SAFETY: any bit pattern is a valid f32/f64; every element is
            // written by a kernel before it is read.
            unsafe { self.stream.alloc::<T>(len) }.during(|| {
                format!("allocating `{tensor}` ({len} elements, {} bytes)", len * std::mem::size_of::<T>())
            })?
        };
        self.current += buf.num_bytes() as u64;
        self.peak = self.peak.max(self.current);
        self.count += 1;
        Ok(buf)
    }

    /// Allocate an output (returned to the caller, never freed here).
    pub(crate) fn output<T: Element>(&mut self, len: usize, tensor: &'static str) -> Result<CudaSlice<T>, MixError> {
        let b = self.alloc::<T>(len, tensor)?;
        self.outputs += b.num_bytes() as u64;
        Ok(b)
    }

    /// Allocate scratch; release it with [`Tracker::release`].
    pub(crate) fn scratch<T: Element>(&mut self, len: usize, tensor: &'static str) -> Result<CudaSlice<T>, MixError> {
        let b = self.alloc::<T>(len, tensor)?;
        self.scratch_peak = self.scratch_peak.max(self.current.saturating_sub(self.outputs));
        Ok(b)
    }

    /// Free scratch (stream-ordered) and account for it.
    pub(crate) fn release<T>(&mut self, buf: CudaSlice<T>) {
        self.current = self.current.saturating_sub(buf.num_bytes() as u64);
        drop(buf);
    }

    pub(crate) fn finish(self) -> CallMemory {
        CallMemory {
            peak_bytes: self.peak,
            output_bytes: self.outputs,
            scratch_bytes: self.scratch_peak,
            allocations: self.count,
        }
    }
}

/// The raw device address of a slice allocated on `stream` itself (scratch):
/// the slice must outlive its use, and since it is freed on `stream` after
/// the launches that use it, no read/write event needs to outlive this call.
pub(crate) fn raw_ptr<T>(buf: &CudaSlice<T>, stream: &CudaStream) -> CUdeviceptr {
    let (p, _sync) = buf.device_ptr(stream);
    p
}
