//! Generates, compiles, checks and embeds the CUDA kernels of the mixing
//! stack with the generator crate (crates/gen, `mixstack_gen::pipeline`).
//! Environment:
//!   MIXSTACK_CUDA_ROOT  a CUDA 13.0 root (default: .toolchain/nvidia/cu13)
//!   MIXSTACK_ONLY       comma-separated name filters, for quick dev builds
//!   MIXSTACK_BLESS=1    write the snapshot generated-tests/ from this build

use mixstack_gen as codegen;
use std::path::PathBuf;

fn main() {
    let crate_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    // The generator's own sources are a build-dependency: cargo reruns this
    // script when they change.
    for p in ["specs", "templates", "generated-tests", ".toolchain/nvidia/cu13/bin"] {
        println!("cargo:rerun-if-changed={p}");
    }
    for v in ["MIXSTACK_CUDA_ROOT", "MIXSTACK_ONLY", "MIXSTACK_BLESS", "MIXSTACK_CACHE_DIR"] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    // target/<profile>/build/<pkg>/out -> target/mixstack-kernel-cache, shared by profiles.
    let cache_dir = std::env::var_os("MIXSTACK_CACHE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| out_dir.ancestors().nth(4).unwrap_or(&out_dir).join("mixstack-kernel-cache"));
    let opts = codegen::pipeline::Options {
        crate_dir,
        out_dir,
        cache_dir,
        only: std::env::var("MIXSTACK_ONLY").ok().filter(|s| !s.is_empty()),
        bless: std::env::var("MIXSTACK_BLESS").map(|v| v == "1").unwrap_or(false),
    };
    match codegen::pipeline::run(&opts) {
        // One summary line, plus what the committed snapshot does not
        // already say (mixstack_gen::buildlog).
        Ok(outcome) => {
            for line in &outcome.log {
                build_print::info!("{line}");
            }
        }
        Err(e) => {
            build_print::error!("mixstack kernel generation failed: {e}");
            std::process::exit(1);
        }
    }
}
