//! `mixstack tune --regime`: where the switch's "on" should take the fused
//! backward on this GPU. At one workload's F, E, layers and alpha, every Cf
//! the fused backward serves x every lmax of the build: the relay and the
//! fused backward ("always", default tiles) interleaved on the same inputs,
//! checked bit for bit. Prints a row per point and the stages.yaml
//! `regime.fused_faster` entries the sweep supports (fused / relay <=
//! `--keep`, the relay's bits); `--write` puts them in place of this GPU's
//! entries (mixstack_gen::regime: one line per entry, everything else kept).

use std::io::Write as _;
use std::time::Instant;

use mixstack::kinds::{Dtype, Precision};
use mixstack::runtime::device::compute_capability;
use mixstack::runtime::dispatch::{Dispatch, Path};
use mixstack::runtime::{open_device, BackwardOptions, Request};
use mixstack_gen::regime::{entries, write, Point};
use rand::{rngs::StdRng as SmallRng, SeedableRng};

use super::bench::{bitwise_equal, interleaved, median, Problem, Stream};
use super::tune::{gpu_key, print_changed_lines, TuneArgs};
use super::workload::{preset, Workload};
use super::CliResult;

/// The workload whose F, E, layers and alpha the sweep keeps: `--preset`
/// (default seed), `--no-alpha`; Cf and lmax are swept, so the other shape
/// flags are refused.
fn base(args: &TuneArgs) -> Result<Workload, String> {
    let s = &args.shape;
    if s.focus.is_some() || s.edges.is_some() || s.cf.is_some() || s.lmax.is_some() || s.layers.is_some() {
        return Err(
            "--regime sweeps Cf and lmax at a preset's F, E and layers: give --preset (default seed), not shape flags"
                .into(),
        );
    }
    if !args.stages.is_empty() {
        return Err("--regime times the whole backward, relay against fused: --stages does not apply".into());
    }
    if !(args.keep > 0.0 && args.keep <= 1.0) {
        return Err(format!(
            "--keep {}: need 0 < keep <= 1 (fused / relay at most this to enter the regime)",
            args.keep
        ));
    }
    let w = preset(s.preset.as_deref().unwrap_or("seed"))?;
    Ok(Workload { apply_alpha: w.apply_alpha && !s.no_alpha, ..w })
}

pub fn run(args: &TuneArgs) -> CliResult {
    let w0 = base(args)?;
    if args.reps == 0 {
        return Err("--reps must be at least 1".into());
    }
    let ctx = open_device(0).map_err(|e| format!("tune needs a CUDA GPU: {e}"))?;
    let device = ctx.name().map_err(|e| {
        format!("tune --regime keys its entries by the GPU's name, which the driver did not give: {e:?}")
    })?;
    let gpu = gpu_key(&device);
    let stream: Stream = ctx.default_stream();
    let precision = Precision::Exact; // the switch's regime is measured in the exact mode
    let mut points = Vec::new();
    let started = Instant::now();
    let relay = BackwardOptions::relay().with_precision(precision);
    let fused = BackwardOptions::fused_always().with_precision(precision);
    println!(
        "# regime on {device}: F={} E={} n_layers={} alpha={}, relay against fused (always, default tiles), {} reps, keep <= {}",
        w0.f, w0.e, w0.n_layers, w0.apply_alpha, args.reps, args.keep
    );
    println!(
        "| Cf | lmax | relay bwd ms | fused bwd ms | fused / relay | bitwise |\n| --- | --- | --- | --- | --- | --- |"
    );
    // The Cf the fused backward serves on this arch and the build's lmax;
    // each point's stack judges its own shared memory.
    let d = Dispatch::builtin().for_device(compute_capability(&ctx)?)?;
    let (lo, hi) = d.lmax_range();
    let cfs: Vec<u32> = d
        .cfs(Dtype::F32)
        .into_iter()
        .filter(|&cf| d.decide_backward_path(Dtype::F32, cf, Request::Always).path == Path::Fused)
        .collect();
    if cfs.is_empty() {
        let why = d.decide_backward_path(Dtype::F32, 32, Request::Always).reason;
        return Err(format!("the fused backward serves no Cf on this GPU's arch ({why}): no regime to measure").into());
    }
    let mut failed = 0;
    for &cf in &cfs {
        for lmax in lo..=hi {
            let w = Workload { cf: cf as usize, lmax: lmax as usize, ..w0 };
            let ratio = match measure(&stream, &w, args.reps, [&relay, &fused]) {
                Ok(Measured::Timed { relay: r, fused: f, equal }) => {
                    let bits = if equal { "EQUAL" } else { "DIFFER (never in the regime)" };
                    println!("| {cf} | {lmax} | {r:.3} | {f:.3} | {:.3} | {bits} |", f / r);
                    Some((f / r, equal))
                }
                Ok(Measured::NotServed(why)) => {
                    println!("| {cf} | {lmax} | | | not served: {why} | |");
                    None
                }
                // A point too large for this GPU's memory, or a fault: out
                // of the regime, the others still measured.
                Err(e) => {
                    failed += 1;
                    println!("| {cf} | {lmax} | | | failed: {e} | |");
                    None
                }
            };
            std::io::stdout().flush()?;
            let (ratio, bitwise_equal) = ratio.map_or((None, false), |(r, eq)| (Some(r), eq));
            points.push(Point { cf, lmax, ratio, bitwise_equal });
        }
        // Each Cf's entries as soon as it is swept: a sweep cut short by a
        // time limit keeps what it measured.
        let this: Vec<Point> = points.iter().filter(|p| p.cf == cf).copied().collect();
        for e in entries(&this, args.keep, &gpu, precision) {
            println!("# so far:{}", e.line(" "));
        }
    }
    if failed > 0 {
        println!("\n# {failed} points failed (above): they are left out of the regime");
    }
    let found = entries(&points, args.keep, &gpu, precision);
    println!(
        "\n# {:.0} s; regime.fused_faster entries for {gpu:?} (fused / relay <= {}, bitwise equal):",
        started.elapsed().as_secs_f64(),
        args.keep
    );
    for e in &found {
        println!("{}", e.line("    "));
    }
    if found.is_empty() {
        println!("    (none: \"on\" runs the relay on this GPU, or the entries without `gpu` where there are any)");
    }
    if args.write && failed > 0 {
        return Err(format!(
            "{failed} points failed (above): nothing written, since they would drop this GPU's entries there"
        )
        .into());
    }
    if args.write {
        let path = args.specs.join("stages.yaml");
        let before = std::fs::read_to_string(&path)?;
        let after = write(&before, &device, precision, &cfs, &found)?;
        // the result must still be a spec that loads
        let read = |f: &str| std::fs::read_to_string(args.specs.join(f));
        mixstack_gen::spec::from_texts(&args.specs, [read("ops.yaml")?, after.clone(), read("tiles.yaml")?])?;
        std::fs::write(&path, &after)?;
        println!(
            "\nwrote {} (GPU {gpu:?}); `MIXSTACK_BLESS=1 cargo build --release` makes it the switch's regime and \
             blesses the snapshot (commit specs/ and generated-tests/ together):",
            path.display()
        );
        print_changed_lines(&before, &after);
    }
    Ok(())
}

/// One point's outcome.
enum Measured {
    /// Backward medians in ms, and whether the fused bits are the relay's.
    Timed { relay: f64, fused: f64, equal: bool },
    /// The fused path does not serve this shape here (the reason).
    NotServed(String),
}

/// Relay against fused at one workload: a random problem, its forward, each
/// backward once for the bits, then `reps` interleaved timings.
fn measure(
    stream: &Stream,
    w: &Workload,
    reps: usize,
    [relay, fused]: [&BackwardOptions; 2],
) -> Result<Measured, Box<dyn std::error::Error>> {
    let (cf, lmax) = (w.cf as u32, w.lmax as u32);
    let mut rng = SmallRng::seed_from_u64(0x5e << 40 | (cf as u64) << 8 | lmax as u64);
    let Problem { stack, u0, grad_out, alpha, .. } = Problem::random(stream, w, &mut rng)?;
    let served = stack.dispatch().decide_backward_path_at(Dtype::F32, cf, lmax, Request::Always);
    if served.path != Path::Fused {
        return Ok(Measured::NotServed(served.reason.to_string()));
    }
    let (out, z_all) = stack.forward(stream, &u0, &alpha, w.apply_alpha)?;
    let grads = |o: &BackwardOptions| -> Result<Vec<Vec<f32>>, Box<dyn std::error::Error>> {
        let (gu, ga, _) = stack.backward(stream, &grad_out, &out, &z_all, &alpha, w.apply_alpha, o)?;
        Ok(vec![stream.clone_dtoh(&gu)?, stream.clone_dtoh(&ga)?])
    };
    let equal = bitwise_equal(&grads(relay)?, &grads(fused)?);
    if stack.last_path().map(|d| d.path) != Some(Path::Fused) {
        return Err("the fused backward was requested but did not run".into());
    }
    let opts = [relay, fused];
    let mut ms = interleaved(stream, 2, reps, &mut |v| {
        stack.backward(stream, &grad_out, &out, &z_all, &alpha, w.apply_alpha, opts[v])?;
        Ok(())
    })?;
    Ok(Measured::Timed { relay: median(&mut ms[0]), fused: median(&mut ms[1]), equal })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::WorkloadArgs;

    fn args(shape: WorkloadArgs) -> TuneArgs {
        TuneArgs { shape, stages: vec![], reps: 4, write: false, specs: "specs".into(), regime: true, keep: 0.98 }
    }

    #[test]
    fn the_base_workload_and_refusals() {
        let w = base(&args(WorkloadArgs::default())).unwrap();
        assert_eq!((w.f, w.e, w.n_layers, w.apply_alpha), (2, 646_000, 3, true));
        let f1 = base(&args(WorkloadArgs { preset: Some("f1".into()), ..Default::default() })).unwrap();
        assert_eq!((f1.f, f1.apply_alpha), (1, false));
        let no_alpha = base(&args(WorkloadArgs { no_alpha: true, ..Default::default() })).unwrap();
        assert!(!no_alpha.apply_alpha);
        let e = base(&args(WorkloadArgs { cf: Some(32), ..Default::default() })).unwrap_err();
        assert!(e.contains("--regime sweeps Cf and lmax"), "{e}");
        let e = base(&args(WorkloadArgs { preset: Some("big".into()), ..Default::default() })).unwrap_err();
        assert!(e.contains("unknown preset"), "{e}");
        let e = base(&TuneArgs { stages: vec!["bwd_gemm".into()], ..args(WorkloadArgs::default()) }).unwrap_err();
        assert!(e.contains("--stages"), "{e}");
        for keep in [0.0, 1.5, f64::NAN] {
            let e = base(&TuneArgs { keep, ..args(WorkloadArgs::default()) }).unwrap_err();
            assert!(e.contains("--keep"), "{e}");
        }
    }
}
