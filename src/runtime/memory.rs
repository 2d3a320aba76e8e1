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
//! Allocations are stream-ordered on the caller's stream, from the stack's
//! own [`ScratchPool`] where the device has memory pools, and scratch is
//! released on that stream at the end of the call.

use std::sync::Arc;

use cudarc::driver::result::mem_pool;
use cudarc::driver::sys::{self, CUdeviceptr};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};

use super::element::Element;
use super::error::{DriverContext, MixError};
use super::fault::FaultPoint;

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

/// A stack's stream-ordered memory pool, kept mapped between calls.
///
/// The driver's default pool has a release threshold of 0: at every
/// synchronisation it unmaps what is free, so the next call maps its
/// gigabytes of scratch again, on the call's critical path. This pool's
/// threshold is unbounded, as PyTorch's caching allocator keeps its blocks:
/// after the first call, a call of the same size allocates without mapping.
/// The memory stays reserved while the stack lives; [`ScratchPool::trim`]
/// gives it back.
pub(crate) struct ScratchPool {
    pool: sys::CUmemoryPool,
}

// SAFETY: a memory pool handle may be used from any thread (driver API).
unsafe impl Send for ScratchPool {}
unsafe impl Sync for ScratchPool {}

impl ScratchPool {
    /// `None` on a device without memory pools (allocations then take
    /// cudarc's default path).
    pub(crate) fn new(ctx: &Arc<CudaContext>) -> Result<Option<Self>, MixError> {
        let supported = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)
            .during(|| "querying memory-pool support".into())?;
        if supported == 0 {
            return Ok(None);
        }
        ctx.bind_to_thread().during(|| "binding the context".into())?;
        // SAFETY: all-zero is a valid CUmemPoolProps (no handle types, no
        // size limit); the fields that matter are set below.
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
        props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = ctx.ordinal() as i32;
        // SAFETY: props is a valid, initialised CUmemPoolProps.
        let pool = unsafe { mem_pool::create(&props) }.during(|| "creating the scratch memory pool".into())?;
        let pool = ScratchPool { pool };
        let mut keep: u64 = u64::MAX;
        // SAFETY: the pool is valid; the attribute's value is a u64.
        unsafe {
            mem_pool::set_attribute(
                pool.pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut keep as *mut u64).cast(),
            )
        }
        .during(|| "setting the scratch pool's release threshold".into())?;
        Ok(Some(pool))
    }

    /// Bytes of the pool's allocations in use now (tests: a failed call must
    /// leave this where it was).
    pub(crate) fn used_bytes(&self) -> Result<u64, MixError> {
        let mut v: u64 = 0;
        // SAFETY: the pool is valid; the attribute's value is a u64.
        unsafe {
            mem_pool::get_attribute(
                self.pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
                (&mut v as *mut u64).cast(),
            )
        }
        .during(|| "reading the scratch pool's used memory".into())?;
        Ok(v)
    }

    /// Give the pool's free memory back to the device.
    pub(crate) fn trim(&self) -> Result<(), MixError> {
        // SAFETY: the pool is valid until drop.
        unsafe { mem_pool::trim_to(self.pool, 0) }.during(|| "trimming the scratch memory pool".into())
    }
}

impl Drop for ScratchPool {
    /// Allocations still held (returned outputs) stay valid: the driver
    /// releases the pool once the last of them is freed.
    fn drop(&mut self) {
        // SAFETY: the pool is valid and destroyed once.
        let _ = unsafe { mem_pool::destroy(self.pool) };
    }
}

/// Per-call allocation tracker. Allocates on one stream.
pub(crate) struct Tracker<'s> {
    stream: &'s Arc<CudaStream>,
    pool: Option<&'s ScratchPool>,
    fault: &'s FaultPoint,
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
    pub(crate) fn new(
        stream: &'s Arc<CudaStream>,
        pool: Option<&'s ScratchPool>,
        fault: &'s FaultPoint,
        poison: bool,
    ) -> Self {
        Tracker { stream, pool, fault, poison, current: 0, peak: 0, outputs: 0, scratch_peak: 0, count: 0 }
    }

    fn alloc<T: Element>(&mut self, len: usize, tensor: &'static str) -> Result<CudaSlice<T>, MixError> {
        let what = || format!("allocating `{tensor}` ({len} elements, {} bytes)", len * std::mem::size_of::<T>());
        self.fault.allocation(what)?;
        let buf = if len == 0 {
            self.stream.null::<T>().during(|| format!("allocating empty `{tensor}`"))?
        } else if let Some(pool) = self.pool {
            // SAFETY: the pool and stream are valid; the slice takes
            // ownership of the allocation and frees it on `stream`. Any bit
            // pattern is a valid f32/f64, and every element is written by a
            // kernel before it is read (or poisoned below).
            let mut buf = unsafe {
                let ptr = mem_pool::alloc_async(pool.pool, len * std::mem::size_of::<T>(), self.stream.cu_stream())
                    .during(what)?;
                self.stream.upgrade_device_ptr::<T>(ptr, len)
            };
            if self.poison {
                self.stream.memcpy_htod(&vec![T::NAN; len], &mut buf).during(|| format!("poisoning `{tensor}`"))?;
            }
            buf
        } else if self.poison {
            let host = vec![T::NAN; len];
            self.stream.clone_htod(&host).during(|| format!("allocating NaN-poisoned `{tensor}` ({len} elements)"))?
        } else {
            // SAFETY: as above.
            unsafe { self.stream.alloc::<T>(len) }.during(what)?
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
