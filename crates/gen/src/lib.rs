//! The generator, stage by stage: spec -> expand -> layout -> render ->
//! compile -> check -> embed (and the committed snapshot). The root
//! build.rs runs [`pipeline::run`]; tests and `mixstack report` use the rest.

pub mod args;
pub mod buildlog;
pub mod check;
pub mod compile;
pub mod defaults;
pub mod embed;
pub mod expand;
pub mod layout;
pub mod locate;
pub mod params;
pub mod pipeline;
pub mod regime;
pub mod render;
pub mod snapshot;
pub mod spec;
pub mod vocab;

/// The vocabulary shared with the runtime.
pub use mixstack_kinds as kinds;
