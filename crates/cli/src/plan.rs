//! `mixstack report --plan`: the steps a forward and a backward call would
//! run at one shape, from the runtime's own planner (src/runtime/plan.rs),
//! without a GPU: which instance launches with which arguments, which cuBLAS
//! call, which scratch is taken and given back.

use super::CliResult;
use mixstack::kinds::{Dtype, Precision};
use mixstack::runtime::chunk;
use mixstack::runtime::dispatch::{Dispatch, TileOverride};
use mixstack::runtime::plan::{Machine, Planner};
use mixstack::runtime::precision::{parse_precision, PRECISION_SPELLINGS};
use mixstack::runtime::shape::StackShape;
use mixstack::runtime::stack::validate_shape;
use mixstack::runtime::switch::{parse_switch, Request, SWITCH_SPELLINGS};

/// The shape and the machine of a plan to print (defaults: the seed's shape,
/// F 2, Cf 32, lmax 3, 3 layers, at 1,000 edges).
#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    #[arg(long, default_value = "f32")]
    dtype: String,
    #[arg(long, default_value_t = 2)]
    f: usize,
    #[arg(long, default_value_t = 32)]
    cf: usize,
    #[arg(long, default_value_t = 3)]
    lmax: usize,
    #[arg(long, default_value_t = 3)]
    layers: usize,
    /// Edges.
    #[arg(long, default_value_t = 1000)]
    e: usize,
    /// Request the fused backward, spelt as MIXSTACK_STACK_BWD_FUSED: bare
    /// or "on", where it was measured faster; "always", wherever it serves.
    #[arg(long, num_args = 0..=1, default_missing_value = "on", value_parser = fused_arg)]
    fused: Option<Request>,
    /// The mode, spelt as MIXSTACK_PRECISION: the GEMM stages' kernels of
    /// that mode (the row stages stay exact), in the plan and the table.
    #[arg(long, default_value = "exact", value_parser = precision_arg)]
    precision: Precision,
    /// Plan as if cuBLAS were not available (it is taken where it serves).
    #[arg(long)]
    no_cublas: bool,
    /// Scratch cap, spelt as MIXSTACK_SCRATCH_CAP: bytes, or with a K, M, G
    /// or T suffix (default: none; chunks appear below E * scratch per edge).
    #[arg(long, value_parser = cap_arg)]
    cap: Option<u64>,
    /// Opt-in shared memory per block the plan may use (default: the
    /// flagship of the arch serving --cc: 227 KiB for H100 / H200).
    #[arg(long)]
    smem: Option<u64>,
    /// The device name tiles.yaml's GPU-keyed defaults are matched against
    /// ("NVIDIA H200"); without --plan, prints the dispatch table it gets.
    /// The name does not pick the arch: pass --cc for that (an A100: --cc 80).
    #[arg(long)]
    pub gpu: Option<String>,
    /// The device's compute capability, major * 10 + minor (80: A100, 90:
    /// H100 / H200); picks the build arch that serves it. Default: the
    /// newest arch built. Without --plan, prints the dispatch table it gets.
    #[arg(long)]
    pub cc: Option<u32>,
}

/// `--fused` by the runtime's own parser ([`parse_switch`]).
fn fused_arg(s: &str) -> Result<Request, String> {
    parse_switch(Some(s)).map_err(|_| SWITCH_SPELLINGS.to_string())
}

/// `--precision` by the runtime's own parser ([`parse_precision`]).
fn precision_arg(s: &str) -> Result<Precision, String> {
    parse_precision(Some(s)).map_err(|_| PRECISION_SPELLINGS.to_string())
}

/// `--cap` by the runtime's own parser ([`chunk::parse_cap`]).
fn cap_arg(s: &str) -> Result<u64, String> {
    chunk::parse_cap(s).map_err(|_| chunk::CAP_SPELLINGS.to_string())
}

fn dispatch(a: &PlanArgs) -> Result<&'static Dispatch<'static>, Box<dyn std::error::Error>> {
    let gpu: Option<&'static str> = a.gpu.clone().map(|g| &*Box::leak(g.into_boxed_str()));
    let d = Dispatch::builtin();
    let d = match a.cc {
        Some(cc) => d.for_device(cc)?,
        None => d,
    };
    let smem = a.smem.unwrap_or(d.arch().max_smem() as u64);
    Ok(Box::leak(Box::new(d.with_smem_limit(Some(smem)).with_gpu(gpu).with_precision(a.precision))))
}

/// `mixstack report --gpu NAME --cc N`: each key's kernel on that GPU, and
/// which build arch and which link of the chain of defaults chose it.
pub fn gpu_table(a: &PlanArgs) -> CliResult {
    let d = dispatch(a)?;
    let name = a.gpu.as_deref().map_or("no GPU name".to_string(), |g| format!("GPU {g:?}"));
    let cc = a.cc.map_or("the newest built".to_string(), |c| format!("{}.{}", c / 10, c % 10));
    let built: Vec<&str> = d.archs().iter().map(|a| a.as_str()).collect();
    println!(
        "# dispatch on {name}, compute capability {cc}: the {} kernels (built: {}; the newest not newer than the device), smem {} B, precision {}: kernel, and why",
        d.arch(),
        built.join(", "),
        d.smem_limit().unwrap_or(0),
        d.precision().as_str()
    );
    let (lo, hi) = d.lmax_range();
    for dtype in [Dtype::F32, Dtype::F64] {
        for cf in d.cfs(dtype) {
            for stage in mixstack::kinds::Stage::ALL {
                for lmax in lo..=hi {
                    if let Some((e, why)) = d.default_with_reason(stage, dtype, cf, lmax) {
                        println!("{:<15} {dtype} cf {cf:>3} lmax {lmax}: {} ({why})", stage.as_str(), e.name);
                    }
                }
            }
        }
    }
    Ok(())
}

pub fn run(a: &PlanArgs) -> CliResult {
    let dtype = Dtype::parse(&a.dtype).ok_or_else(|| format!("--dtype {}: f32 or f64", a.dtype))?;
    if a.e == 0 {
        return Err("--e 0: a call with no edge runs no step".into());
    }
    let d = dispatch(a)?;
    d.check_precision(dtype, a.cf as u32)?;
    let shape = StackShape::new(a.f, a.cf, a.lmax, a.layers);
    match dtype {
        Dtype::F32 => validate_shape::<f32>(d, &shape)?,
        Dtype::F64 => validate_shape::<f64>(d, &shape)?,
    }
    let planner = Planner { shape, dtype, dispatch: d };
    let machine = Machine { cublas: !a.no_cublas, scratch_cap: a.cap.unwrap_or(u64::MAX) };
    let tiles = TileOverride::new();
    let gpu = a.gpu.as_deref().map_or(String::new(), |g| format!(", GPU {g:?}"));
    let arch = d.arch();
    println!(
        "# plan: {dtype} F {} Cf {} lmax {} layers {} E {}{gpu}, {arch}, precision {}; {machine:?}",
        a.f,
        a.cf,
        a.lmax,
        a.layers,
        a.e,
        a.precision.as_str()
    );
    print!("## forward\n{}", planner.forward(a.e, true, &tiles, &machine)?);
    let choice = planner.backward_choice(a.fused.unwrap_or(Request::Off), &tiles, machine.cublas)?;
    println!("## backward: {} ({})", choice.decision.path, choice.decision.reason);
    print!("{}", planner.backward(a.e, true, &choice, &machine)?);
    Ok(())
}
