//! Kernel arguments by name: one struct per stage and [`StageCall`], generated
//! by build.rs from the `params` of specs/stages.yaml (crates/gen/src/args.rs).
//! Generic over the pointer type: a plan holds symbolic addresses
//! (`StageCall<plan::Addr>`), a launch real ones (`StageCall<CUdeviceptr>`).

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{LaunchArgs, PushKernelArg};

use super::table::Stage;

include!(concat!(env!("OUT_DIR"), "/stage_args.rs"));
