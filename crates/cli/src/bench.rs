//! `mixstack bench`: GPU medians of forward and backward (relay and fused
//! interleaved in one run, same inputs), with FLOP and byte rates, per-kernel
//! breakdown, extra peak memory and a bitwise relay-vs-fused check.

use super::CliResult;
use cudarc::driver::CudaSlice;
use mixstack::kinds::{Precision, Stage};
use mixstack::runtime::{
    open_device, BackwardOptions, CallMemory, ForwardOptions, GateGemm, Path, Stack, StackShape, TileOverride,
    FUSED_ENV,
};
use rand::{rngs::StdRng as SmallRng, Rng, SeedableRng};
use serde::Serialize;

use super::workload::{Workload, WorkloadArgs};
use std::sync::Arc;

#[derive(clap::Args, Clone, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub shape: WorkloadArgs,
    /// Timed repetitions per path (after warm-up).
    #[arg(long, default_value_t = 20)]
    pub reps: usize,
    /// Backward variants to time side by side (default: relay, fused). A
    /// variant is `relay` or `fused` (the fused kernels wherever they serve
    /// the shape, as the switch's "always"), optionally with kernel
    /// overrides: `fused:bwd_fused=NAME` (canonical names).
    #[arg(long = "variant")]
    pub variants: Vec<String>,
    /// Forward variants to time side by side (default: the dispatch
    /// defaults): kernel overrides `fwd_m0=NAME,fwd_m1=NAME,fwd_final=NAME`,
    /// or `default`. The first one's outputs feed the backward.
    #[arg(long = "forward-variant")]
    pub forward_variants: Vec<String>,
    /// Precision modes (exact, fp16x3) to run every variant in, side by
    /// side (default: exact alone). A variant in a mode past exact is
    /// labelled `VARIANT@MODE`; bitwise checks compare variants of one
    /// mode, and each mode's first variant is compared with the first
    /// mode's by relative L2 and max abs error.
    #[arg(long = "precision")]
    pub precisions: Vec<String>,
    /// Also time the relay's two gate contractions done by cuBLAS against
    /// the generated kernels that contain them (crates/cli/src/cublas_gate.rs);
    /// needs libcublas on the library path.
    #[arg(long)]
    pub cublas_gate: bool,
    /// Write the results as JSON.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

#[derive(Serialize, Clone, Debug)]
pub struct Timing {
    pub label: String,
    pub path: String,
    pub precision: Precision,
    pub median_ms: f64,
    pub min_ms: f64,
    pub max_ms: f64,
    pub reps: usize,
    pub tflops: f64,
    pub gbps_min_bytes: f64,
    pub peak_extra_bytes: u64,
    pub scratch_bytes: u64,
    pub per_kernel: Vec<(String, String, f64)>,
}

#[derive(Serialize, Debug)]
pub struct BenchReport {
    pub device: String,
    pub workload: Workload,
    pub seed: u64,
    pub forward: Timing,
    /// Every forward variant (the first is `forward`).
    pub forward_variants: Vec<Timing>,
    pub forward_bitwise_equal: Option<bool>,
    /// The scratch cap in force (bytes) and how the last calls walked their
    /// rows (whole, or chunks of one focus).
    pub scratch_cap_bytes: u64,
    pub chunking: String,
    pub backward: Vec<Timing>,
    pub fused_bitwise_equal_to_relay: Option<bool>,
    /// Each mode's first variant against the first mode's (out and z_all;
    /// grad_u0 and grad_alpha).
    pub accuracy: Vec<Accuracy>,
    pub cublas_gate: Option<super::cublas_gate::CublasGate>,
}

/// One variant's outputs against a reference variant's (another mode).
#[derive(Serialize, Clone, Debug)]
pub struct Accuracy {
    pub label: String,
    pub against: String,
    /// Per output buffer: (name, relative L2, max abs error, max |reference|).
    pub buffers: Vec<(String, f64, f64, f64)>,
}

fn accuracy(label: &str, against: &str, names: &[&str], want: &[Vec<f32>], got: &[Vec<f32>]) -> Accuracy {
    let buffers = names
        .iter()
        .zip(want.iter().zip(got))
        .map(|(n, (w, g))| {
            let (mut d2, mut r2, mut dmax, mut rmax) = (0f64, 0f64, 0f64, 0f64);
            for (&a, &b) in w.iter().zip(g) {
                let (a, b) = (a as f64, b as f64);
                let d = if a.is_finite() && b.is_finite() { (a - b).abs() } else { f64::INFINITY };
                d2 += d * d;
                r2 += a * a;
                dmax = dmax.max(d);
                rmax = rmax.max(a.abs());
            }
            (n.to_string(), (d2 / r2.max(f64::MIN_POSITIVE)).sqrt(), dmax, rmax)
        })
        .collect();
    Accuracy { label: label.into(), against: against.into(), buffers }
}

fn print_accuracy(a: &Accuracy) {
    for (n, rel, dmax, rmax) in &a.buffers {
        println!(
            "{} vs {}: {n:<10} rel L2 {rel:.2e}  max abs err {dmax:.2e} (max |ref| {rmax:.2e})",
            a.label, a.against
        );
    }
}

/// The modes of `--precision` (default: exact), in order, each once.
fn modes(names: &[String]) -> Result<Vec<Precision>, String> {
    let mut out = Vec::new();
    for n in names {
        let p = Precision::parse(n.trim()).ok_or_else(|| format!("--precision {n}: not exact or fp16x3"))?;
        if !out.contains(&p) {
            out.push(p);
        }
    }
    if out.is_empty() {
        out.push(Precision::Exact);
    }
    Ok(out)
}

/// `label` in `p`: unchanged for exact, `label@mode` otherwise.
fn in_mode(label: &str, p: Precision) -> String {
    match p {
        Precision::Exact => label.to_string(),
        p => format!("{label}@{p}"),
    }
}

pub(crate) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

fn random(rng: &mut SmallRng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(lo..hi)).collect()
}

/// A stack with random weights (scaled 1/sqrt(fan_in)) and random inputs
/// for one workload: what bench and tune time.
pub(crate) struct Problem {
    pub stack: Stack<f32>,
    pub u0: CudaSlice<f32>,
    pub grad_out: CudaSlice<f32>,
    pub alpha: CudaSlice<f32>,
    /// GW on the host (the cuBLAS gate timing uploads its first layer).
    pub gw: Vec<f32>,
}

impl Problem {
    pub fn random(stream: &Stream, w: &Workload, rng: &mut SmallRng) -> Result<Self, Box<dyn std::error::Error>> {
        let shape = StackShape::new(w.f, w.cf, w.lmax, w.n_layers);
        let (m0, m1, row, lg) = (w.m0() as usize, w.m1() as usize, w.row() as usize, w.lg() as usize);
        let (s0, s1, sg) = ((3.0 / m0 as f32).sqrt(), (3.0 / m1 as f32).sqrt(), (3.0 / w.cf as f32).sqrt());
        let w0 = random(rng, w.n_layers * w.f * m0 * m0, -s0, s0);
        let w1 = random(rng, w.n_layers * w.f * m1 * m1, -s1, s1);
        let gw = random(rng, (w.n_layers - 1) * w.f * w.cf * lg, -sg, sg);
        Ok(Problem {
            stack: Stack::<f32>::new(stream, shape, &w0, &w1, &gw)?,
            u0: stream.clone_htod(&random(rng, w.f * w.e * row, -1.0, 1.0))?,
            grad_out: stream.clone_htod(&random(rng, w.f * w.e * row, -1.0, 1.0))?,
            alpha: stream.clone_htod(&random(rng, w.e * w.f, 0.25, 1.25))?,
            gw,
        })
    }
}

pub fn run_default() -> CliResult {
    match open_device(0) {
        Ok(_) => run(&BenchArgs {
            shape: WorkloadArgs { preset: Some("seed".into()), ..WorkloadArgs::default() },
            reps: 20,
            variants: vec![],
            forward_variants: vec![],
            precisions: vec![],
            cublas_gate: false,
            json: None,
        }),
        Err(e) => {
            println!("bench SKIPPED: no CUDA device ({e})");
            Ok(())
        }
    }
}

pub(crate) type Stream = Arc<cudarc::driver::CudaStream>;

fn time_ms(stream: &Stream, f: &mut dyn FnMut() -> CliResult) -> Result<f64, Box<dyn std::error::Error>> {
    let ctx = stream.context();
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let (a, b) = (ctx.new_event(flags)?, ctx.new_event(flags)?);
    a.record(stream)?;
    f()?;
    b.record(stream)?;
    Ok(a.elapsed_ms(&b)? as f64)
}

/// Warm-up calls, then `reps` timed calls of `call(v)` for every variant v,
/// interleaved within each repetition so their ratios are side by side.
pub(crate) fn interleaved(
    stream: &Stream,
    variants: usize,
    reps: usize,
    call: &mut dyn FnMut(usize) -> CliResult,
) -> Result<Vec<Vec<f64>>, Box<dyn std::error::Error>> {
    const WARMUP: usize = 3;
    let mut ms = vec![Vec::with_capacity(reps); variants];
    for i in 0..WARMUP + reps {
        for (v, times) in ms.iter_mut().enumerate() {
            let t = time_ms(stream, &mut || call(v))?;
            if i >= WARMUP {
                times.push(t);
            }
        }
    }
    Ok(ms)
}

#[allow(clippy::too_many_arguments)]
fn summarise(
    label: &str,
    path: &str,
    precision: Precision,
    mut ms: Vec<f64>,
    flops: f64,
    bytes: f64,
    mem: CallMemory,
    per_kernel: Vec<(String, String, f64)>,
) -> Timing {
    let reps = ms.len();
    let med = median(&mut ms);
    Timing {
        label: label.into(),
        path: path.into(),
        precision,
        median_ms: med,
        min_ms: ms[0],
        max_ms: ms[reps - 1],
        reps,
        tflops: flops / (med * 1e-3) / 1e12,
        gbps_min_bytes: bytes / (med * 1e-3) / 1e9,
        peak_extra_bytes: mem.peak_bytes,
        scratch_bytes: mem.scratch_bytes,
        per_kernel,
    }
}

pub fn run(args: &BenchArgs) -> CliResult {
    let w = args.shape.workload()?;
    if args.reps == 0 {
        return Err("--reps must be at least 1".into());
    }
    // Every argument is parsed before a device is opened: a typo is named
    // at once, not after the inputs are uploaded.
    // forward variants, interleaved per repetition in each mode
    let fspecs =
        if args.forward_variants.is_empty() { vec!["default".to_string()] } else { args.forward_variants.clone() };
    let modes = modes(&args.precisions)?;
    let mut fparsed: Vec<(String, ForwardOptions)> = Vec::new();
    for &p in &modes {
        for v in &fspecs {
            let opts = ForwardOptions::default().with_precision(p).with_tiles(parse_overrides(v, v)?.1);
            fparsed.push((in_mode(v, p), opts));
        }
    }
    // backward variants, interleaved per repetition
    let specs =
        if args.variants.is_empty() { vec!["relay".to_string(), "fused".to_string()] } else { args.variants.clone() };
    let mut parsed: Vec<(String, BackwardOptions)> = Vec::new();
    for &p in &modes {
        for v in &specs {
            let (label, opts) = parse_variant(v)?;
            parsed.push((in_mode(&label, p), opts.with_precision(p)));
        }
    }
    let ctx = match open_device(0) {
        Ok(c) => c,
        Err(e) => return Err(format!("bench needs a CUDA GPU: {e}").into()),
    };
    let device = ctx.name().unwrap_or_else(|_| "unknown".into());
    let stream = ctx.default_stream();
    let seed: u64 = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_nanos() as u64;
    let mut rng = SmallRng::seed_from_u64(seed);
    println!(
        "# bench on {device}: F={} E={} Cf={} lmax={} n_layers={} apply_alpha={} (inputs: uniform random, seed {seed})",
        w.f, w.e, w.cf, w.lmax, w.n_layers, w.apply_alpha
    );

    let Problem { stack, u0, grad_out, alpha, gw } = Problem::random(&stream, &w, &mut rng)?;

    let mut saved = None;
    let fwd_ms = interleaved(&stream, fparsed.len(), args.reps, &mut |v| {
        let res = stack.forward_with(&stream, &u0, &alpha, w.apply_alpha, &fparsed[v].1)?;
        if v == 0 {
            saved = Some(res);
        }
        Ok(())
    })?;
    // Every variant's outputs against the first's, compared as they come (a
    // sweep's outputs would not fit in host memory together).
    let mut forward_variants = Vec::new();
    // Where the gate GEMMs run on cuBLAS (Cf >= 96), naming fwd_gate takes
    // the generated gate path, which sums in another order: such a variant
    // is compared only with variants on its own path.
    let on_cublas = stack.gate_gemm() == GateGemm::Cublas;
    let gate_path = |t: &TileOverride| on_cublas && t.get(Stage::FwdGate).is_none();
    // The first variant of each mode (index, the mode that ran, outputs):
    // the bits its mode's others must match.
    let mut firsts: Vec<(usize, Precision, Vec<Vec<f32>>)> = Vec::new();
    let mut forward_bitwise = None;
    let mut accuracies = Vec::new();
    for (v, (label, opts)) in fparsed.iter().enumerate() {
        stack.set_profiling(true);
        let (o, z) = stack.forward_with(&stream, &u0, &alpha, w.apply_alpha, opts)?;
        let kernels = kernel_rows(&stack)?;
        stack.set_profiling(false);
        let mem = stack.last_forward_memory().unwrap_or_default();
        let got = vec![stream.clone_dtoh(&o)?, stream.clone_dtoh(&z)?];
        let p = stack.last_forward_precision().ok_or("no forward ran")?;
        match firsts.iter().find(|(_, q, _)| *q == p) {
            None => {
                if let Some((i, _, f)) = firsts.first() {
                    accuracies.push(accuracy(label, &fparsed[*i].0, &["out", "z_all"], f, &got));
                }
                firsts.push((v, p, got));
            }
            Some((i, _, _)) if gate_path(&opts.tiles) != gate_path(&fparsed[*i].1.tiles) => {
                println!(
                    "{label}: another gate path than {}'s (cuBLAS / generated): not compared bitwise",
                    fparsed[*i].0
                )
            }
            Some((_, _, f)) => forward_bitwise = Some(forward_bitwise.unwrap_or(true) && bitwise_equal(f, &got)),
        }
        forward_variants.push(summarise(
            label,
            "relay",
            p,
            fwd_ms[v].clone(),
            w.forward_flops(),
            w.forward_bytes(),
            mem,
            kernels,
        ));
    }
    drop(firsts);
    let forward = forward_variants[0].clone();
    let (out, z_all) = saved.ok_or("no forward ran")?;

    // A variant this workload cannot run (say a tile whose shared memory does
    // not fit at this lmax) is reported and left out, not fatal to the rest.
    let mut variants = Vec::new();
    for (label, opts) in parsed {
        match stack.backward(&stream, &grad_out, &out, &z_all, &alpha, w.apply_alpha, &opts) {
            Ok(_) => variants.push((label, opts)),
            Err(e) if variants.is_empty() => return Err(format!("variant {label}: {e}").into()),
            Err(e) => println!("variant {label} left out: {e}"),
        }
    }
    let mut paths = vec![Path::Relay; variants.len()];
    let times = interleaved(&stream, variants.len(), args.reps, &mut |v| {
        let (_, _, d) = stack.backward(&stream, &grad_out, &out, &z_all, &alpha, w.apply_alpha, &variants[v].1)?;
        paths[v] = d.path;
        Ok(())
    })?;
    let mut backward = Vec::new();
    let mut firsts: Vec<(usize, Vec<Vec<f32>>)> = Vec::new();
    let (mut any_fused, mut all_equal, mut compared) = (false, true, false);
    for (v, (label, opts)) in variants.iter().enumerate() {
        stack.set_profiling(true);
        let (gu, ga, d) = stack.backward(&stream, &grad_out, &out, &z_all, &alpha, w.apply_alpha, opts)?;
        let kernels = kernel_rows(&stack)?;
        stack.set_profiling(false);
        let mem = stack.last_backward_memory().unwrap_or_default();
        any_fused |= d.path == Path::Fused;
        let got = vec![stream.clone_dtoh(&gu)?, stream.clone_dtoh(&ga)?];
        match firsts.iter().find(|(i, _)| variants[*i].1.precision == opts.precision) {
            None => {
                if let Some((i, f)) = firsts.first() {
                    accuracies.push(accuracy(label, &variants[*i].0, &["grad_u0", "grad_alpha"], f, &got));
                }
                firsts.push((v, got));
            }
            Some((_, f)) => {
                compared = true;
                all_equal &= bitwise_equal(f, &got)
            }
        }
        backward.push(summarise(
            label,
            paths[v].as_str(),
            d.precision,
            times[v].clone(),
            w.backward_flops(),
            w.backward_bytes(),
            mem,
            kernels,
        ));
    }
    drop(firsts);
    // Every variant against its mode's first (all must agree bit for bit).
    let bitwise = (any_fused && compared).then_some(all_equal);

    for t in &forward_variants {
        print_timing(t);
    }
    for (t, base) in against_firsts(&forward_variants) {
        println!("{} / {} forward median: {:.3}", t.label, base.label, t.median_ms / base.median_ms);
    }
    if let Some(b) = forward_bitwise {
        println!(
            "every forward variant vs {} bitwise (out, z_all, every element): {}",
            forward_variants[0].label,
            if b { "EQUAL" } else { "DIFFERENT" }
        );
    }
    for t in &backward {
        print_timing(t);
    }
    for a in &accuracies {
        print_accuracy(a);
    }
    for (t, base) in against_firsts(&backward) {
        println!("{} / {} backward median: {:.3}", t.label, base.label, t.median_ms / base.median_ms);
        if let Some((fused, gemm)) = gated_layer_times(&base.per_kernel, &t.per_kernel, w.n_layers - 1) {
            println!(
                "per gated layer: {} bwd_fused {fused:.3} ms / {} bwd_gemm {gemm:.3} ms = {:.3}",
                t.label,
                base.label,
                fused / gemm
            );
        }
    }
    match bitwise {
        Some(b) => println!(
            "every variant vs its mode's first ({}) bitwise (grad_u0, grad_alpha, every element): {}",
            backward[0].label,
            if b { "EQUAL" } else { "DIFFERENT" }
        ),
        None => println!("fused path not taken for this workload: relay only"),
    }
    // What the switch's plain "on" does here (the measured regime).
    let (on, _) = stack.backward_plan(&BackwardOptions::fused())?;
    println!("switch on ({FUSED_ENV}=1) at this shape on this GPU: {} ({})", on.path, on.reason);
    let cublas_gate = if args.cublas_gate {
        let gw0 = stream.clone_htod(&gw[..w.f * w.cf * w.lg() as usize])?;
        let g = super::cublas_gate::time(&stream, &w, &stack, (&grad_out, &out, &z_all, &alpha), &gw0, args.reps)?;
        super::cublas_gate::print(&g);
        Some(g)
    } else {
        None
    };
    let scratch_cap_bytes = stack.scratch_cap()?;
    let chunking = format!("{:?}", stack.last_chunking());
    println!(
        "scratch cap {:.2} GB (MIXSTACK_SCRATCH_CAP); last forward/backward walk: {chunking}",
        scratch_cap_bytes as f64 / 1e9
    );
    let report = BenchReport {
        scratch_cap_bytes,
        chunking,
        device,
        workload: w,
        seed,
        forward,
        forward_variants,
        forward_bitwise_equal: forward_bitwise,
        backward,
        fused_bitwise_equal_to_relay: bitwise,
        accuracy: accuracies,
        cublas_gate,
    };
    if let Some(p) = &args.json {
        std::fs::write(p, serde_json::to_string_pretty(&report)?)?;
        println!("wrote {}", p.display());
    }
    if bitwise == Some(false) {
        return Err("fused backward is not bitwise equal to the relay".into());
    }
    if forward_bitwise == Some(false) {
        return Err("forward variants are not bitwise equal".into());
    }
    Ok(())
}

/// The pairs a ratio is printed for: each variant against its own mode's
/// first, and each mode's variants against the first mode's first.
fn against_firsts(ts: &[Timing]) -> Vec<(&Timing, &Timing)> {
    let mut out = Vec::new();
    for (i, t) in ts.iter().enumerate().skip(1) {
        let own = ts.iter().position(|x| x.precision == t.precision).unwrap_or(0);
        if own != i {
            out.push((t, &ts[own]));
        }
        if t.precision != ts[0].precision {
            out.push((t, &ts[0]));
        }
    }
    out
}

/// Same length and the same bit pattern in every element of every buffer.
pub(crate) fn bitwise_equal(a: &[Vec<f32>], b: &[Vec<f32>]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()))
}

/// `relay` | `fused` [`:STAGE=NAME,...`].
fn parse_variant(v: &str) -> Result<(String, BackwardOptions), String> {
    let (path, overrides) = v.split_once(':').unwrap_or((v, ""));
    let mut opts = match path {
        "relay" => BackwardOptions::relay(),
        "fused" => BackwardOptions::fused_always(),
        other => return Err(format!("variant '{v}': path '{other}' is not relay or fused")),
    };
    opts.tiles = parse_overrides(v, overrides)?.1;
    Ok((v.to_string(), opts))
}

/// `STAGE=NAME,...` (or `default`: none) of variant `v`.
fn parse_overrides(v: &str, overrides: &str) -> Result<(String, TileOverride), String> {
    let mut tiles = TileOverride::new();
    for kv in overrides.split(',').filter(|s| !s.is_empty() && *s != "default") {
        let (stage, name) = kv.split_once('=').ok_or_else(|| format!("variant '{v}': '{kv}' is not STAGE=NAME"))?;
        let stage =
            mixstack::kinds::Stage::parse(stage).ok_or_else(|| format!("variant '{v}': unknown stage '{stage}'"))?;
        tiles.set(stage, name);
    }
    Ok((v.to_string(), tiles))
}

/// (stage, kernel, ms) per launch.
type KernelRows = Vec<(String, String, f64)>;

fn kernel_rows(stack: &Stack<f32>) -> Result<KernelRows, Box<dyn std::error::Error>> {
    Ok(stack.timings()?.into_iter().map(|k| (k.stage.as_str().to_string(), k.ran.to_string(), k.ms as f64)).collect())
}

/// Per gated layer, the fused kernel's time and the relay's GEMM time (both
/// segments), from one call's per-launch times: issue 16's "the per-row work
/// hidden" measure. None unless `relay` ran bwd_gemm and `fused` bwd_fused.
fn gated_layer_times(
    relay: &[(String, String, f64)],
    fused: &[(String, String, f64)],
    gated: usize,
) -> Option<(f64, f64)> {
    // None where the stage never ran: no ratio from an absent kernel.
    let total = |k: &[(String, String, f64)], stage: &str| {
        k.iter().filter(|x| x.0 == stage).map(|x| x.2).fold(None, |acc: Option<f64>, ms| Some(acc.unwrap_or(0.0) + ms))
    };
    let (f, g) = (total(fused, "bwd_fused")?, total(relay, "bwd_gemm")?);
    (gated > 0).then(|| (f / gated as f64, g / gated as f64))
}

fn print_timing(t: &Timing) {
    println!(
        "{:<10} {:<6} median {:>8.3} ms (min {:.3}, max {:.3}, n={})  {:>6.1} TFLOP/s  {:>7.1} GB/s of min bytes  extra peak {:.2} GB (scratch {:.2} GB)",
        t.label, t.path, t.median_ms, t.min_ms, t.max_ms, t.reps, t.tflops, t.gbps_min_bytes,
        t.peak_extra_bytes as f64 / 1e9, t.scratch_bytes as f64 / 1e9
    );
    let mut by_stage: Vec<(String, f64, usize)> = Vec::new();
    for (stage, _, ms) in &t.per_kernel {
        match by_stage.iter_mut().find(|s| &s.0 == stage) {
            Some(s) => {
                s.1 += ms;
                s.2 += 1;
            }
            None => by_stage.push((stage.clone(), *ms, 1)),
        }
    }
    for (stage, ms, n) in by_stage {
        println!("    {stage:<15} {ms:>8.3} ms ({n} launches)");
    }
}

#[cfg(test)]
mod tests {
    use super::{against_firsts, gated_layer_times, Precision, Timing};

    fn k(stage: &str, ms: f64) -> (String, String, f64) {
        (stage.to_string(), format!("ms_{stage}"), ms)
    }

    fn t(label: &str, precision: Precision) -> Timing {
        Timing {
            label: label.into(),
            path: "relay".into(),
            precision,
            median_ms: 1.0,
            min_ms: 1.0,
            max_ms: 1.0,
            reps: 1,
            tflops: 0.0,
            gbps_min_bytes: 0.0,
            peak_extra_bytes: 0,
            scratch_bytes: 0,
            per_kernel: vec![],
        }
    }

    #[test]
    fn ratios_are_taken_within_a_mode_and_against_the_first_mode() {
        let ts = [
            t("relay", Precision::Exact),
            t("fused", Precision::Exact),
            t("relay@fp16x3", Precision::Fp16x3),
            t("fused@fp16x3", Precision::Fp16x3),
        ];
        let pairs: Vec<(&str, &str)> =
            against_firsts(&ts).into_iter().map(|(a, b)| (a.label.as_str(), b.label.as_str())).collect();
        assert_eq!(
            pairs,
            [
                ("fused", "relay"),
                ("relay@fp16x3", "relay"),
                ("fused@fp16x3", "relay@fp16x3"),
                ("fused@fp16x3", "relay"),
            ]
        );
    }

    #[test]
    fn gated_layer_times_divide_by_gated_layers() {
        let relay =
            [k("bwd_final", 1.7), k("bwd_gemm", 1.0), k("bwd_gemm", 2.0), k("bwd_gemm", 1.0), k("bwd_gemm", 2.0)];
        let fused = [k("bwd_final", 1.7), k("bwd_fused", 5.0), k("bwd_fused", 7.0)];
        assert_eq!(gated_layer_times(&relay, &fused, 2), Some((6.0, 3.0)));
        assert_eq!(gated_layer_times(&relay, &relay, 2), None, "no bwd_fused: no ratio");
        assert_eq!(gated_layer_times(&fused, &fused, 2), None, "no bwd_gemm: no ratio");
        assert_eq!(gated_layer_times(&relay, &fused, 0), None);
    }
}
