//! Element types of a stack: f32 and f64, mapped to the table's [`Dtype`].

use std::fmt::Debug;

use cudarc::driver::{DeviceRepr, ValidAsZeroBits};

use super::table::Dtype;

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
}

/// A floating-point element the kernels are generated for.
pub trait Element:
    DeviceRepr + ValidAsZeroBits + Copy + Default + Debug + PartialEq + Send + Sync + 'static + sealed::Sealed
{
    /// The table's dtype for this element.
    const DTYPE: Dtype;
    /// A quiet NaN (poisoning outputs in tests).
    const NAN: Self;
    /// The value as f64 (exact for both).
    fn to_f64(self) -> f64;
}

impl Element for f32 {
    const DTYPE: Dtype = Dtype::F32;
    const NAN: Self = f32::NAN;
    fn to_f64(self) -> f64 {
        self as f64
    }
}

impl Element for f64 {
    const DTYPE: Dtype = Dtype::F64;
    const NAN: Self = f64::NAN;
    fn to_f64(self) -> f64 {
        self
    }
}
