//! The subcommands of the `mixstack` binary.
pub mod bench;
pub mod cublas_gate;
pub mod report;
pub mod verify;

/// A command's failure, printed by main.
pub type CliResult = Result<(), Box<dyn std::error::Error>>;
