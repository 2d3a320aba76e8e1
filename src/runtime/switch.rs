//! The opt-in switch of the fused backward (`MIXSTACK_STACK_BWD_FUSED`).
//!
//! The fused path is off by default. "On" takes it where it was measured
//! faster than the relay on this GPU (stages.yaml `regime.fused_faster`);
//! "always" wherever its kernels serve the shape (to measure or test them).
//! With [`FusedMode::FromEnv`] the environment variable is read at every
//! backward call (not cached), so a process can flip it between calls; the
//! other modes override the environment.

use super::error::MixError;

/// The environment variable that requests the fused backward.
pub const FUSED_ENV: &str = "MIXSTACK_STACK_BWD_FUSED";

/// The spellings [`parse_switch`] accepts (case-insensitive, trimmed).
pub const SWITCH_SPELLINGS: &str =
    "1/true/on/yes (fused where measured faster), always (fused wherever served) or 0/false/off/no/empty/unset (relay)";

/// How a backward call decides whether the fused path is requested.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FusedMode {
    /// Read [`FUSED_ENV`] at each call (default).
    #[default]
    FromEnv,
    /// Request the fused path where it was measured faster, whatever the
    /// environment says.
    On,
    /// Request the fused path wherever its kernels serve the shape.
    Always,
    /// Never request the fused path.
    Off,
}

/// What one backward call asks of the fused path: a [`FusedMode`] resolved
/// (the environment read, for [`FusedMode::FromEnv`]), as the planner takes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Request {
    /// The relay.
    Off,
    /// The fused backward inside its measured regime, else the relay.
    On,
    /// The fused backward wherever its kernels serve the shape.
    Always,
}

impl std::fmt::Display for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Request::Off => "off",
            Request::On => "on",
            Request::Always => "always",
        })
    }
}

impl FusedMode {
    /// What is requested, reading the environment now for
    /// [`FusedMode::FromEnv`]. A malformed environment value is an error
    /// (not silently "off").
    pub fn requested(self) -> Result<Request, MixError> {
        match self {
            FusedMode::On => Ok(Request::On),
            FusedMode::Always => Ok(Request::Always),
            FusedMode::Off => Ok(Request::Off),
            FusedMode::FromEnv => parse_switch(read_env(FUSED_ENV, SWITCH_SPELLINGS)?.as_deref()),
        }
    }
}

/// Parse a value of [`FUSED_ENV`]: `1/true/on/yes` -> on; `always` ->
/// always; `0/false/off/no`, empty or unset (`None`) -> off;
/// case-insensitive and trimmed. Anything else is
/// [`MixError::InvalidSwitch`].
pub fn parse_switch(value: Option<&str>) -> Result<Request, MixError> {
    let Some(raw) = value else { return Ok(Request::Off) };
    let v = raw.trim().to_ascii_lowercase();
    match v.as_str() {
        "1" | "true" | "on" | "yes" => Ok(Request::On),
        "always" => Ok(Request::Always),
        "" | "0" | "false" | "off" | "no" => Ok(Request::Off),
        _ => Err(invalid(raw)),
    }
}

/// The value of `variable` now (`None`: unset), for the variables read at
/// each call; one that is not UTF-8 is [`MixError::InvalidSwitch`] listing
/// what `allowed` says.
pub(crate) fn read_env(variable: &'static str, allowed: &'static str) -> Result<Option<String>, MixError> {
    match std::env::var_os(variable) {
        None => Ok(None),
        Some(v) => v.into_string().map(Some).map_err(|v| MixError::InvalidSwitch {
            variable,
            value: v.to_string_lossy().into_owned(),
            allowed,
        }),
    }
}

fn invalid(value: &str) -> MixError {
    MixError::InvalidSwitch { variable: FUSED_ENV, value: value.to_string(), allowed: SWITCH_SPELLINGS }
}
