//! Shared by the GPU test suites: the device, or a plain skip line.

use std::sync::Arc;

use cudarc::driver::CudaContext;
use mixstack::runtime::{open_device, Dispatch};

/// Device 0's primary context, or `None` after printing
/// `SKIPPED (no CUDA device): <test>`. A device with an empty kernel table
/// (a stub build) is a failure, not a skip.
pub fn device(test: &str) -> Option<Arc<CudaContext>> {
    let ctx = match open_device(0) {
        Ok(c) => c,
        Err(e) => {
            println!("SKIPPED (no CUDA device): {test}");
            println!("  ({e})");
            return None;
        }
    };
    assert!(
        !Dispatch::builtin().entries().is_empty(),
        "a CUDA device is present but the kernel table is empty (stub build.rs?)"
    );
    Some(ctx)
}
