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

/// The device's compute capability as major * 10 + minor (90 for an H200),
/// which picks the build arch that serves it (`Dispatch::for_device`).
pub fn compute_capability(ctx: &CudaContext) -> Result<u32, MixError> {
    use cudarc::driver::sys::CUdevice_attribute::{
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR as MAJOR, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR as MINOR,
    };
    let query = |a| ctx.attribute(a).during(|| "querying the compute capability".into());
    let (major, minor) = (query(MAJOR)?, query(MINOR)?);
    Ok((major.max(0) as u32) * 10 + minor.clamp(0, 9) as u32)
}
