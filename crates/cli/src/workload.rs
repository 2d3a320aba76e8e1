//! The workload a benchmark runs: a shape, E, alpha, and the presets of
//! docs/MIXING_STACK.md, with the FLOP and byte counts its rates use.

use mixstack::runtime::dispatch::Dispatch;
use mixstack::runtime::shape::StackShape;
use mixstack::runtime::stack::validate_shape;
use serde::Serialize;

/// The workload flags `bench` and `tune` share.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct WorkloadArgs {
    /// A named workload: seed (F=2 E=646000 Cf=32 L=3 3 layers, alpha),
    /// cf64 (Cf=64 L=2, F=2, alpha), f1 (F=1 Cf=32 L=3, no alpha).
    #[arg(long, conflicts_with_all = ["focus", "edges", "cf", "lmax", "layers"])]
    pub preset: Option<String>,
    #[arg(long)]
    pub focus: Option<usize>,
    #[arg(long)]
    pub edges: Option<usize>,
    #[arg(long)]
    pub cf: Option<usize>,
    #[arg(long)]
    pub lmax: Option<usize>,
    #[arg(long)]
    pub layers: Option<usize>,
    /// Without the competition weight alpha.
    #[arg(long)]
    pub no_alpha: bool,
}

impl WorkloadArgs {
    /// The workload the flags name.
    pub fn workload(&self) -> Result<Workload, String> {
        let w = match &self.preset {
            Some(p) => preset(p)?,
            None => Workload {
                f: self.focus.ok_or("--focus (or --preset) is required")?,
                e: self.edges.ok_or("--edges (or --preset) is required")?,
                cf: self.cf.ok_or("--cf (or --preset) is required")?,
                lmax: self.lmax.ok_or("--lmax (or --preset) is required")?,
                n_layers: self.layers.ok_or("--layers (or --preset) is required")?,
                apply_alpha: !self.no_alpha,
            },
        };
        let w = Workload { apply_alpha: w.apply_alpha && !self.no_alpha, ..w };
        // Checked before any device is opened or buffer allocated: a shape
        // the runtime would refuse is refused here, by the same checks.
        if w.e == 0 {
            return Err("--edges must be at least 1 (a bench of no edges times nothing)".into());
        }
        let shape = StackShape::new(w.f, w.cf, w.lmax, w.n_layers);
        validate_shape::<f32>(&Dispatch::builtin(), &shape).map_err(|e| e.to_string())?;
        shape.check_edges(w.e, std::mem::size_of::<f32>()).map_err(|e| e.to_string())?;
        Ok(w)
    }
}

#[derive(Serialize, Clone, Copy, Debug)]
pub struct Workload {
    pub f: usize,
    pub e: usize,
    pub cf: usize,
    pub lmax: usize,
    pub n_layers: usize,
    pub apply_alpha: bool,
}

pub fn preset(name: &str) -> Result<Workload, String> {
    match name {
        "seed" => Ok(Workload { f: 2, e: 646_000, cf: 32, lmax: 3, n_layers: 3, apply_alpha: true }),
        "cf64" => Ok(Workload { f: 2, e: 646_000, cf: 64, lmax: 2, n_layers: 3, apply_alpha: true }),
        "f1" => Ok(Workload { f: 1, e: 646_000, cf: 32, lmax: 3, n_layers: 3, apply_alpha: false }),
        other => Err(format!("unknown preset '{other}' (seed, cf64, f1)")),
    }
}

impl Workload {
    pub fn m0(&self) -> f64 {
        ((self.lmax + 1) * self.cf) as f64
    }
    pub fn m1(&self) -> f64 {
        (2 * self.lmax * self.cf) as f64
    }
    pub fn row(&self) -> f64 {
        ((3 * self.lmax + 1) * self.cf) as f64
    }
    pub fn lg(&self) -> f64 {
        (self.lmax * self.cf) as f64
    }
    pub fn rows(&self) -> f64 {
        (self.f * self.e) as f64
    }
    pub fn gated(&self) -> f64 {
        (self.n_layers - 1) as f64
    }
    /// Block GEMMs of every layer plus the gate projections.
    pub fn forward_flops(&self) -> f64 {
        let gemm = 2.0 * (self.m0() * self.m0() + self.m1() * self.m1());
        self.rows() * (self.n_layers as f64 * gemm + self.gated() * 2.0 * self.cf as f64 * self.lg())
    }
    /// Block GEMMs (transposed) of every layer, plus per gated layer the gate
    /// recompute and the gate-logit contraction.
    pub fn backward_flops(&self) -> f64 {
        let gemm = 2.0 * (self.m0() * self.m0() + self.m1() * self.m1());
        self.rows() * (self.n_layers as f64 * gemm + self.gated() * 4.0 * self.cf as f64 * self.lg())
    }
    /// Fewest bytes: each input read once, each output written once (f32).
    pub fn forward_bytes(&self) -> f64 {
        4.0 * self.rows() * self.row() * (1.0 + 1.0 + self.gated())
    }
    pub fn backward_bytes(&self) -> f64 {
        4.0 * self.rows() * self.row() * (3.0 + self.gated())
    }
}
