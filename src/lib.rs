//! mixstack: the runtime and C ABI of the SO(2) mixing stack of the SeZM /
//! DPA4 descriptor (DeePMD-kit), over CUDA kernels that build.rs generates
//! with `mixstack-gen` from specs/ and embeds.

pub mod capi;
pub mod runtime;

/// Stages, variants, dtypes, tile geometry: the vocabulary the generator and
/// the runtime share.
pub use mixstack_kinds as kinds;
