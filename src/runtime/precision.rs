//! The arithmetic mode of a call's block GEMMs (`MIXSTACK_PRECISION`).
//!
//! Exact by default. With [`PrecisionMode::FromEnv`] the environment
//! variable is read at every call (not cached), as the fused switch is;
//! [`PrecisionMode::Set`] overrides it. In a compensated mode the GEMM
//! stages run that mode's kernels and every pointwise stage stays exact
//! (docs/PRECISION.md); dispatch's rule for that is `Dispatch::with_precision`.

use super::error::MixError;
use super::switch::read_env;
use super::table::Precision;

/// The environment variable that selects the mode.
pub const PRECISION_ENV: &str = "MIXSTACK_PRECISION";

/// The spellings [`parse_precision`] accepts (case-insensitive, trimmed).
pub const PRECISION_SPELLINGS: &str = "exact or fp16x3 (empty or unset: exact)";

/// How a call decides its precision.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PrecisionMode {
    /// Read [`PRECISION_ENV`] at each call (default).
    #[default]
    FromEnv,
    /// This mode, whatever the environment says.
    Set(Precision),
}

impl PrecisionMode {
    /// The mode of this call, reading the environment now for
    /// [`PrecisionMode::FromEnv`]; a malformed value is an error.
    pub fn resolve(self) -> Result<Precision, MixError> {
        match self {
            PrecisionMode::Set(p) => Ok(p),
            PrecisionMode::FromEnv => parse_precision(read_env(PRECISION_ENV, PRECISION_SPELLINGS)?.as_deref()),
        }
    }
}

impl From<Precision> for PrecisionMode {
    fn from(p: Precision) -> Self {
        PrecisionMode::Set(p)
    }
}

/// Parse a value of [`PRECISION_ENV`]: a mode's name (case-insensitive,
/// trimmed); empty or unset (`None`) is exact. Anything else is
/// [`MixError::InvalidSwitch`].
pub fn parse_precision(value: Option<&str>) -> Result<Precision, MixError> {
    let Some(raw) = value else { return Ok(Precision::Exact) };
    let v = raw.trim();
    if v.is_empty() {
        return Ok(Precision::Exact);
    }
    Precision::parse(v).ok_or_else(|| invalid(raw))
}

fn invalid(value: &str) -> MixError {
    MixError::InvalidSwitch { variable: PRECISION_ENV, value: value.to_string(), allowed: PRECISION_SPELLINGS }
}
