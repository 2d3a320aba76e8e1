//! Opening a device without panicking when there is no driver.

use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::error::{DriverContext, MixError};

/// Whether the CUDA driver library (libcuda) can be loaded at all.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library by its usual names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// The primary context of device `ordinal`. A missing driver is
/// [`MixError::NoDriver`] (cudarc itself would panic); no device or any other
/// driver failure is [`MixError::Driver`].
pub fn open_device(ordinal: usize) -> Result<Arc<CudaContext>, MixError> {
    if !driver_present() {
        return Err(MixError::NoDriver { why: "libcuda could not be loaded".into() });
    }
    CudaContext::new(ordinal).during(|| format!("creating the primary context of device {ordinal}"))
}

/// The device's name ("NVIDIA H200"), which tiles.yaml's GPU-keyed defaults
/// are matched against; kept for the process (one string per distinct name).
pub fn device_name(ctx: &CudaContext) -> Result<&'static str, MixError> {
    static NAMES: std::sync::Mutex<Vec<&'static str>> = std::sync::Mutex::new(Vec::new());
    let name = ctx.name().during(|| "querying the device's name".into())?;
    let mut names = NAMES.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(n) = names.iter().find(|n| **n == name) {
        return Ok(n);
    }
    let n: &'static str = Box::leak(name.into_boxed_str());
    names.push(n);
    Ok(n)
}
