//! `mixstack tune`: every accepted instance of each chosen stage, timed on
//! this GPU at one workload, interleaved, each checked bit for bit against
//! the current default (a tile that gives other bits is reported, never
//! chosen); the fastest per stage printed, and with `--write` written into
//! specs/tiles.yaml's defaults under this GPU (mixstack_gen::defaults: one
//! line per key, everything else kept).

use std::io::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use mixstack::kinds::{Dtype, Precision, Stage};
use mixstack::runtime::dispatch::{forward_stages, is_fused_stage, Path};
use mixstack::runtime::table::{self, Layers, Serves, Variant};
use mixstack::runtime::{open_device, BackwardOptions, ForwardOptions, FusedMode, GateGemm, Request, TileOverride};
use mixstack_gen::defaults::{write, Default};
use rand::{rngs::StdRng as SmallRng, SeedableRng};

use super::bench::{bitwise_equal, interleaved, median, Problem, Stream};
use super::workload::{Workload, WorkloadArgs};
use super::CliResult;

#[derive(clap::Args, Clone, Debug)]
pub struct TuneArgs {
    #[command(flatten)]
    pub shape: WorkloadArgs,
    /// Stages to tune (comma-separated spellings); default: every stage this
    /// workload runs that has more than one candidate.
    #[arg(long, value_delimiter = ',')]
    pub stages: Vec<String>,
    /// Timed repetitions per candidate (after warm-up).
    #[arg(long, default_value_t = 10)]
    pub reps: usize,
    /// Write the winners into specs/tiles.yaml's defaults under this GPU.
    #[arg(long)]
    pub write: bool,
    /// The specs directory --write edits.
    #[arg(long, default_value = "specs")]
    pub specs: PathBuf,
    /// Instead of tiles: relay against fused backward over every Cf x lmax
    /// the fused path serves, at --preset's F, E and layers (default seed),
    /// and the switch's regime on this GPU (`--write`: into
    /// specs/stages.yaml `regime.fused_faster`).
    #[arg(long)]
    pub regime: bool,
    /// With --regime: the largest fused / relay that enters the regime (a
    /// margin for run-to-run spread).
    #[arg(long, default_value_t = 0.98, requires = "regime")]
    pub keep: f64,
}

/// One stage's result: (name, median ms, bitwise equal to the default).
struct Row {
    name: &'static str,
    ms: f64,
    equal: bool,
}

/// The GPU key a write uses: the device name without the vendor ("H200").
pub(crate) fn gpu_key(device: &str) -> String {
    device.trim_start_matches("NVIDIA ").trim().to_string()
}

/// The tile part of a canonical name (`ms_{stage}_{dtype}_cf{Cf}_{tile}`).
fn tile_of(name: &str, stage: Stage, dtype: Dtype, cf: u32) -> String {
    let prefix = format!("ms_{}_{}_cf{}_", stage.as_str(), dtype.as_str(), cf);
    name.strip_prefix(&prefix).unwrap_or(name).to_string()
}

pub fn run(args: &TuneArgs) -> CliResult {
    let w: Workload = args.shape.workload()?;
    if args.reps == 0 {
        return Err("--reps must be at least 1".into());
    }
    let ctx = open_device(0).map_err(|e| format!("tune needs a CUDA GPU: {e}"))?;
    let device = ctx.name().unwrap_or_else(|_| "unknown".into());
    let stream: Stream = ctx.default_stream();
    let mut rng = SmallRng::seed_from_u64(0x7u64 << 40 | w.e as u64);
    let Problem { stack, u0, grad_out, alpha, .. } = Problem::random(&stream, &w, &mut rng)?;
    let (out, z_all) = stack.forward(&stream, &u0, &alpha, w.apply_alpha)?;

    let d = stack.dispatch();
    let (dtype, cf, lmax) = (Dtype::F32, w.cf as u32, w.lmax as u32);
    let cublas = stack.gate_gemm() == GateGemm::Cublas;
    // Every fused kernel that serves the shape is measured, in or out of
    // the measured regime ("always").
    let fused_served = d.decide_backward_path_at(dtype, cf, lmax, Request::Always).path == Path::Fused;
    // The stages this workload runs (stages.yaml roles): gated ones only with
    // a gated layer, the gate stages of the path it takes, fused where served.
    let runs = |s: Stage| {
        let Some(r) = table::role(s) else { return false };
        (w.n_layers > 1 || r.layers == Layers::All)
            && match r.serves {
                Serves::Always => true,
                Serves::CublasGate => cublas,
                Serves::GeneratedGate => !cublas,
            }
            && (r.variant != Variant::Fused || fused_served)
    };
    let chosen: Vec<Stage> = if args.stages.is_empty() {
        Stage::ALL.into_iter().filter(|s| runs(*s) && d.candidates_at(*s, dtype, cf, lmax).len() > 1).collect()
    } else {
        args.stages
            .iter()
            .map(|s| Stage::parse(s).ok_or(format!("--stages: unknown stage {s:?}")))
            .collect::<Result<_, _>>()?
    };
    let total: usize = chosen.iter().map(|s| d.candidates_at(*s, dtype, cf, lmax).len()).sum();
    println!(
        "# tune on {device}: F={} E={} Cf={} lmax={} n_layers={} alpha={}; {} stages, {total} candidates, {} reps each",
        w.f,
        w.e,
        w.cf,
        w.lmax,
        w.n_layers,
        w.apply_alpha,
        chosen.len(),
        args.reps
    );
    let started = Instant::now();
    let mut done = 0usize;
    let mut winners = Vec::new();
    for stage in chosen {
        let default = d.default_for(stage, dtype, cf, lmax).ok_or(format!("{stage}: no kernel at this key"))?;
        let mut cands = d.candidates_at(stage, dtype, cf, lmax);
        cands.sort_by_key(|e| e.name != default.name); // the default first: the bits to match
        let forward = forward_stages().contains(&stage);
        let tiles: Vec<TileOverride> = cands.iter().map(|e| TileOverride::new().with(stage, e.name)).collect();
        // The exact mode, whatever MIXSTACK_PRECISION says: the defaults tuned are exact ones.
        let fwd_opts =
            |t: &TileOverride| ForwardOptions::default().with_precision(Precision::Exact).with_tiles(t.clone());
        let opts = |t: &TileOverride| {
            let fused = if is_fused_stage(stage) { FusedMode::Always } else { FusedMode::Off };
            BackwardOptions { fused, ..BackwardOptions::default() }
                .with_precision(Precision::Exact)
                .with_tiles(t.clone())
        };
        let outputs = |t: &TileOverride| -> Result<Vec<Vec<f32>>, Box<dyn std::error::Error>> {
            Ok(if forward {
                let (o, z) = stack.forward_with(&stream, &u0, &alpha, w.apply_alpha, &fwd_opts(t))?;
                vec![stream.clone_dtoh(&o)?, stream.clone_dtoh(&z)?]
            } else {
                let (gu, ga, _) = stack.backward(&stream, &grad_out, &out, &z_all, &alpha, w.apply_alpha, &opts(t))?;
                vec![stream.clone_dtoh(&gu)?, stream.clone_dtoh(&ga)?]
            })
        };
        let want = outputs(&tiles[0])?;
        let equal: Vec<bool> =
            tiles.iter().map(|t| outputs(t).map(|got| bitwise_equal(&want, &got))).collect::<Result<_, _>>()?;
        let mut ms = interleaved(&stream, tiles.len(), args.reps, &mut |v| {
            if forward {
                stack.forward_with(&stream, &u0, &alpha, w.apply_alpha, &fwd_opts(&tiles[v]))?;
            } else {
                stack.backward(&stream, &grad_out, &out, &z_all, &alpha, w.apply_alpha, &opts(&tiles[v]))?;
            }
            Ok(())
        })?;
        let rows: Vec<Row> = cands
            .iter()
            .zip(ms.iter_mut())
            .zip(&equal)
            .map(|((e, t), &eq)| Row { name: e.name, ms: median(t), equal: eq })
            .collect();
        done += rows.len();
        let elapsed = started.elapsed().as_secs_f64();
        let left = elapsed / done as f64 * (total - done) as f64;
        println!("\n## {stage} ({done}/{total} candidates, {elapsed:.0} s, about {left:.0} s left)");
        let base = rows[0].ms;
        for r in &rows {
            let note = if r.equal { "" } else { "  OTHER BITS: never chosen" };
            println!("{:<60} {:>9.3} ms  {:>6.3}x{note}", r.name, r.ms, r.ms / base);
        }
        let best =
            rows.iter().filter(|r| r.equal).min_by(|a, b| a.ms.total_cmp(&b.ms)).expect("the default matches itself");
        println!("winner: {} ({:.3} ms, default {:.3} ms)", best.name, best.ms, base);
        winners.push(Default {
            stage,
            dtype,
            cf,
            tile: tile_of(best.name, stage, dtype, cf),
            gpu: Some(gpu_key(&device)),
            precision: Precision::Exact,
        });
        std::io::stdout().flush()?;
    }
    if args.write {
        let path = args.specs.join("tiles.yaml");
        let before = std::fs::read_to_string(&path)?;
        let after = write(&before, &winners)?;
        // the result must still be a spec that loads
        let texts = ["ops.yaml", "stages.yaml"].map(|f| std::fs::read_to_string(args.specs.join(f)));
        let [ops, stages] = texts;
        mixstack_gen::spec::from_texts(&args.specs, [ops?, stages?, after.clone()])?;
        std::fs::write(&path, &after)?;
        println!("\nwrote {} (GPU {:?}):", path.display(), gpu_key(&device));
        print_changed_lines(&before, &after);
    }
    Ok(())
}

/// What a `--write` changed in a spec file: its lines gone (`-`), then its
/// lines new (`+`).
pub(crate) fn print_changed_lines(before: &str, after: &str) {
    let (old, new): (Vec<&str>, Vec<&str>) = (before.lines().collect(), after.lines().collect());
    for l in old.iter().filter(|l| !new.contains(l)) {
        println!("- {l}");
    }
    for l in new.iter().filter(|l| !old.contains(l)) {
        println!("+ {l}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_keys() {
        assert_eq!(gpu_key("NVIDIA H200"), "H200");
        assert_eq!(gpu_key("NVIDIA H100 80GB HBM3"), "H100 80GB HBM3");
        let name = "ms_bwd_fused_f32_cf32_m64_n64_k16_t8x4_s2_b4_ps";
        assert_eq!(tile_of(name, Stage::BwdFused, Dtype::F32, 32), "m64_n64_k16_t8x4_s2_b4_ps");
        // the key a write makes matches the device it came from
        assert!(mixstack::kinds::gpu_matches(&gpu_key("NVIDIA H200"), "NVIDIA H200"));
    }
}
