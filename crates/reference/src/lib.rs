//! The f64 CPU reference of the mixing stack ([`reference`]) and the reader
//! of the fp64 reference vectors DeePMD-kit's own code wrote ([`vectors`]).
//! Tests and `mixstack verify` check every GPU path against both.

pub mod reference;
pub mod vectors;
