//! The workload a benchmark runs: a shape, E, alpha, and the presets of
//! docs/MIXING_STACK.md, with the FLOP and byte counts its rates use.

use serde::Serialize;

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
