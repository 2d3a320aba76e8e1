//! The runtime's one error type. Every request the runtime cannot serve is a
//! typed value here; nothing in the runtime panics on bad input.

use std::fmt;

use cudarc::driver::DriverError;

use super::table::{Arch, Dtype, Precision, Stage};

/// Which shape parameter a [`MixError::UnsupportedShape`] is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ShapeParam {
    /// F, the number of focus streams.
    F,
    /// Cf, channels per focus.
    Cf,
    /// lmax, the highest degree L.
    Lmax,
    /// n_layers, the number of SO(2) layers.
    NLayers,
    /// E, the edges of one call.
    E,
}

impl ShapeParam {
    pub fn as_str(self) -> &'static str {
        match self {
            ShapeParam::F => "F",
            ShapeParam::Cf => "Cf",
            ShapeParam::Lmax => "lmax",
            ShapeParam::NLayers => "n_layers",
            ShapeParam::E => "E",
        }
    }
}

impl fmt::Display for ShapeParam {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Everything that can go wrong in the runtime.
#[derive(Debug, thiserror::Error)]
pub enum MixError {
    /// A shape parameter outside what the kernel table (or the launch grid) supports.
    #[error("unsupported {param} = {value}: supported {supported}")]
    UnsupportedShape { param: ShapeParam, value: u64, supported: String },

    /// A host or device buffer has the wrong number of elements.
    #[error("tensor `{tensor}`: {got} elements, expected {expected}")]
    BufferLength { tensor: &'static str, expected: usize, got: usize },

    /// A buffer whose length must be a whole number of rows is not.
    #[error("tensor `{tensor}`: {got} elements is not a multiple of {unit} ({what})")]
    BufferNotMultiple { tensor: &'static str, got: usize, unit: usize, what: &'static str },

    /// A raw (pointer) call was given a null pointer for a tensor it needs.
    #[error("tensor `{tensor}`: null device pointer")]
    NullPointer { tensor: &'static str },

    /// The element type is not supported on this path.
    #[error("dtype {dtype} is not supported by the {path} path")]
    UnsupportedDtype { dtype: Dtype, path: &'static str },

    /// The device's architecture predates every one the build targets.
    #[error("the device is sm_{cc} (compute capability {}.{}); this build serves {built} and newer", cc / 10, cc % 10)]
    UnsupportedArch { cc: u32, built: String },

    /// A compensated precision mode the build does not serve for this call
    /// (dtype, Cf or architecture without kernels of that mode).
    #[error("the {precision} mode does not serve dtype {dtype}, Cf {cf} on {arch}: {why}")]
    UnsupportedPrecision { precision: Precision, dtype: Dtype, cf: u32, arch: Arch, why: String },

    /// A weight outside the range a compensated mode keeps its accuracy in
    /// (docs/PRECISION.md, the range contract).
    #[error("the {precision} mode needs |{tensor}| <= {limit:e}; the stack's weights reach {max_abs:e}")]
    WeightRange { precision: Precision, tensor: &'static str, max_abs: f64, limit: f64 },

    /// The table has no accepted kernel for this (stage, dtype, cf).
    #[error("no accepted kernel for stage {stage}, dtype {dtype}, Cf {cf}")]
    NoKernel { stage: Stage, dtype: Dtype, cf: u32 },

    /// A tile override names something that is not an accepted entry of its key.
    #[error("tile override for stage {stage} (dtype {dtype}, Cf {cf}): `{name}` {why}")]
    BadOverride { stage: Stage, dtype: Dtype, cf: u32, name: String, why: String },

    /// A switch (environment variable) holds an unrecognised value.
    #[error("{variable} = {value:?} is not a valid value; allowed: {allowed}")]
    InvalidSwitch { variable: &'static str, value: String, allowed: &'static str },

    /// A stream or buffer belongs to another CUDA context than the stack.
    #[error("{what} belongs to a different CUDA context than the stack")]
    ContextMismatch { what: &'static str },

    /// No usable CUDA driver (libcuda could not be loaded).
    #[error("no CUDA driver: {why}")]
    NoDriver { why: String },

    /// A CUDA driver call failed.
    #[error("CUDA driver error while {during}: {source}")]
    Driver {
        during: String,
        #[source]
        source: DriverError,
    },

    /// The edge count needs a launch grid beyond the device's limits.
    #[error("E = {e} is too large for the grid of kernel `{kernel}`: grid {grid:?} exceeds the limits {limit:?}")]
    GridTooLarge { kernel: &'static str, e: u64, grid: (u64, u64, u64), limit: (u64, u64, u64) },

    /// A size or offset derived from E does not fit 64-bit arithmetic.
    #[error("E = {e} is too large: {what} overflows 64-bit sizes")]
    SizeOverflow { e: u64, what: &'static str },

    /// A kernel needs more dynamic shared memory than the device grants.
    #[error("kernel `{kernel}` needs {bytes} bytes of shared memory; the device allows {limit}")]
    SharedMemory { kernel: &'static str, bytes: u64, limit: u64 },

    /// A cuBLAS call (the gate GEMMs at Cf >= 96) failed.
    #[error("cuBLAS error while {during}: {status}")]
    Blas { during: String, status: String },

    /// A size cuBLAS takes as a 32-bit int does not fit one.
    #[error("{what} = {value} exceeds cuBLAS's 32-bit int (the gate GEMMs at Cf >= 96)")]
    BlasSize { what: &'static str, value: u64 },

    /// The scratch cap cannot hold the smallest chunk: one edge, or on
    /// the cuBLAS gate path one GEMM piece of edges (gate_blas.rs), and
    /// enough edges that a call walks at most [`super::chunk::MAX_CHUNKS`].
    #[error("the scratch cap of {cap} bytes is below the smallest chunk's scratch ({min_rows} edges of {row_bytes} bytes): raise it (MIXSTACK_SCRATCH_CAP or Stack::set_scratch_cap)")]
    ScratchCap { cap: u64, min_rows: u64, row_bytes: u64 },

    /// A call without weights on a stack that holds none.
    #[error("this stack holds no weights (made to borrow them): pass the weights with the call")]
    NoWeights,

    /// A call's plan addresses a buffer the call does not have (a bug,
    /// reported, not assumed).
    #[error("the call's plan is inconsistent: {why}")]
    PlanInconsistent { why: String },

    /// A table entry contradicts itself (a build problem, reported, not assumed).
    #[error("kernel table entry `{kernel}` is inconsistent: {why}")]
    TableInconsistent { kernel: &'static str, why: String },
}

impl MixError {
    /// Wrap a driver error with what was being done.
    pub fn driver(during: impl Into<String>, source: DriverError) -> Self {
        MixError::Driver { during: during.into(), source }
    }
}

/// A buffer of `got` elements where `expected` are needed is an error.
pub(crate) fn check_len(tensor: &'static str, expected: usize, got: usize) -> Result<(), MixError> {
    if expected != got {
        Err(MixError::BufferLength { tensor, expected, got })
    } else {
        Ok(())
    }
}

/// `result.map_err(|e| MixError::driver(..))` in one call.
pub(crate) trait DriverContext<T> {
    fn during(self, what: impl FnOnce() -> String) -> Result<T, MixError>;
}

impl<T> DriverContext<T> for Result<T, DriverError> {
    fn during(self, what: impl FnOnce() -> String) -> Result<T, MixError> {
        self.map_err(|source| MixError::Driver { during: what(), source })
    }
}
