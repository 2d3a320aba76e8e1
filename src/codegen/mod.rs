//! The generator, stage by stage: spec -> expand -> layout -> render ->
//! compile -> check -> embed (and the committed snapshot). build.rs runs
//! [`pipeline::run`]; the library exposes the same code to tests and the CLI.

pub mod check;
pub mod compile;
pub mod embed;
pub mod expand;
pub mod layout;
pub mod locate;
pub mod pipeline;
pub mod render;
pub mod snapshot;
pub mod spec;
pub mod vocab;
