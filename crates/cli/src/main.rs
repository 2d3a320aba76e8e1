//! `mixstack`: report the generated kernels, verify them, benchmark them.

mod bench;
mod cublas_gate;
mod plan;
mod regime;
mod report;
mod tune;
mod verify;
mod workload;

/// A command's failure, printed by main.
pub type CliResult = Result<(), Box<dyn std::error::Error>>;

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "mixstack", version, about = "Kernels of the SO(2) mixing stack: report, verify, bench")]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Every kernel instance with ptxas's numbers, the rejected ones, and the dispatch table.
    Report {
        /// Print JSON (top-level keys `instances`, `rejected` and `dispatch`).
        #[arg(long)]
        json: bool,
        /// Print instead the steps of one forward and one backward call at
        /// a shape (`--plan --cf 64 --fused always ...`; the seed's shape at 1,000 edges by default).
        #[arg(long)]
        plan: bool,
        #[command(flatten)]
        shape: plan::PlanArgs,
    },
    /// Check the CPU reference and (with a GPU) every GPU path against vectors.
    Verify {
        /// A directory in the vectors format (manifest.json + raw files).
        #[arg(long)]
        vectors: Option<PathBuf>,
    },
    /// GPU medians of forward and backward, relay and fused, side by side.
    Bench(bench::BenchArgs),
    /// Time every accepted tile of each stage on this GPU (bitwise checked
    /// against the default); `--write` records the winners in specs/tiles.yaml.
    /// `--regime`: relay against fused over Cf x lmax, and where the switch's
    /// "on" should take the fused backward here (`--write`: specs/stages.yaml).
    Tune(tune::TuneArgs),
}

fn main() -> ExitCode {
    // A closed pipe (`mixstack report | head`) ends the process quietly, as
    // for any Unix filter, instead of panicking in println!.
    #[cfg(unix)]
    // SAFETY: restores the default action of one signal before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let args = Cli::parse();
    let result = match args.command {
        Some(Command::Report { plan: true, shape, .. }) => plan::run(&shape),
        Some(Command::Report { shape, .. }) if shape.gpu.is_some() || shape.cc.is_some() => plan::gpu_table(&shape),
        Some(Command::Report { json, .. }) => report::run(json),
        Some(Command::Verify { vectors }) => verify::run(vectors.as_deref()),
        Some(Command::Bench(args)) => bench::run(&args),
        Some(Command::Tune(args)) if args.regime => regime::run(&args),
        Some(Command::Tune(args)) => tune::run(&args),
        None => report::run(false).and_then(|_| verify::run(None)).and_then(|_| bench::run_default()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mixstack: {e}");
            ExitCode::FAILURE
        }
    }
}
