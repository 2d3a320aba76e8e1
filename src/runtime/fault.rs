//! Injected faults, for the tests that show a failed call frees what it took
//! and leaves the stack usable: the n-th allocation (refused as out of
//! memory) or the n-th launch (failed before it reaches the driver) after
//! [`FaultPoint::arm`] fails once.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

use cudarc::driver::{sys::CUresult, DriverError};

use super::error::MixError;

#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The n-th allocation (0-based, counted from arming) fails.
    Allocation(u32),
    /// The n-th launch (kernel or cuBLAS call) fails.
    Launch(u32),
}

#[derive(Default)]
pub(crate) struct FaultPoint {
    armed: Mutex<Option<Fault>>,
    allocations: AtomicU32,
    launches: AtomicU32,
}

impl FaultPoint {
    pub(crate) fn arm(&self, fault: Option<Fault>) {
        let mut a = self.armed.lock().unwrap_or_else(|p| p.into_inner());
        self.allocations.store(0, Ordering::SeqCst);
        self.launches.store(0, Ordering::SeqCst);
        *a = fault;
    }

    fn fire(&self, counter: &AtomicU32, matches: impl Fn(Fault) -> Option<u32>) -> bool {
        let mut a = self.armed.lock().unwrap_or_else(|p| p.into_inner());
        let Some(n) = a.and_then(matches) else { return false };
        if counter.fetch_add(1, Ordering::SeqCst) == n {
            *a = None;
            return true;
        }
        false
    }

    /// Before an allocation of `what`.
    pub(crate) fn allocation(&self, what: impl FnOnce() -> String) -> Result<(), MixError> {
        let hit = self.fire(&self.allocations, |f| match f {
            Fault::Allocation(n) => Some(n),
            _ => None,
        });
        if hit {
            let during = format!("{} (injected fault)", what());
            return Err(MixError::Driver { during, source: DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY) });
        }
        Ok(())
    }

    /// Before a launch of `what`.
    pub(crate) fn launch(&self, what: impl FnOnce() -> String) -> Result<(), MixError> {
        let hit = self.fire(&self.launches, |f| match f {
            Fault::Launch(n) => Some(n),
            _ => None,
        });
        if hit {
            let during = format!("launching {} (injected fault)", what());
            return Err(MixError::Driver { during, source: DriverError(CUresult::CUDA_ERROR_LAUNCH_FAILED) });
        }
        Ok(())
    }
}
