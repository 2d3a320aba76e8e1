//! mixstack: generated CUDA kernels and a runtime for the SO(2) mixing stack
//! of the SeZM / DPA4 descriptor (DeePMD-kit).

pub mod capi;
pub mod codegen;
pub mod kinds;
pub mod reference;
pub mod runtime;
pub mod vectors;
