//! `mixstack verify`: the CPU reference, then every GPU path in every
//! precision mode, against a vectors directory. One line per case and path;
//! fails if any exceeds its tolerance (f64 <= 1e-10, f32 <= 1e-5 relative,
//! in either mode), and if nothing was
//! checked: a manifest that lists no case is refused by the loader
//! ([`vectors::VectorError::NoCases`]), and success is never reported after
//! zero checks.

use super::CliResult;
use mixstack::kinds::Precision;
use mixstack::runtime::{open_device, BackwardOptions, Element, ForwardOptions, MixError, Path, Stack, StackShape};
use mixstack_reference::reference::{self, rel_err};
use mixstack_reference::vectors::{self, Case};
use std::sync::Arc;

pub const TOL_F64: f64 = 1e-10;
pub const TOL_F32: f64 = 1e-5;

/// Host conversions the harness needs on top of [`Element`].
pub trait Host: Element {
    fn from_f64(v: f64) -> Self;
    fn bits(self) -> u64;
}
impl Host for f32 {
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    fn bits(self) -> u64 {
        self.to_bits() as u64
    }
}
impl Host for f64 {
    fn from_f64(v: f64) -> Self {
        v
    }
    fn bits(self) -> u64 {
        self.to_bits()
    }
}

struct Tally {
    checked: usize,
    failed: usize,
}

impl Tally {
    fn line(&mut self, case: usize, path: &str, tensor: &str, err: f64, tol: f64) {
        self.checked += 1;
        let ok = err <= tol;
        if !ok {
            self.failed += 1;
        }
        println!(
            "case {case} {path:<18} {tensor:<10} rel {err:.3e} (tol {tol:.0e}) {}",
            if ok { "PASS" } else { "FAIL" }
        );
    }
}

fn conv<T: Host>(v: &[f64]) -> Vec<T> {
    v.iter().map(|&x| T::from_f64(x)).collect()
}

fn widen<T: Host>(v: &[T]) -> Vec<f64> {
    v.iter().map(|&x| x.to_f64()).collect()
}

/// Host outputs of one GPU run: out, z_all, grad_u0, grad_alpha, path.
pub struct GpuRun<T> {
    pub out: Vec<T>,
    pub z_all: Vec<T>,
    pub grad_u0: Vec<T>,
    pub grad_alpha: Vec<T>,
    pub path: Path,
}

/// Forward then backward of `case` on the GPU in `precision`, inputs
/// rounded to T from the vectors' exact f32 values; outputs poisoned with
/// NaN before the run.
pub fn run_case<T: Host>(
    stream: &Arc<cudarc::driver::CudaStream>,
    c: &Case,
    precision: Precision,
    opts: &BackwardOptions,
) -> Result<GpuRun<T>, MixError> {
    let s = c.shape;
    let shape = StackShape::new(s.f, s.cf, s.lmax, s.n_layers);
    let stack = Stack::<T>::new(stream, shape, &conv::<T>(&c.w0), &conv::<T>(&c.w1), &conv::<T>(&c.gw))?;
    stack.debug_poison_allocations(true);
    let up = |v: &[f64]| stream.clone_htod(&conv::<T>(v)).map_err(|e| MixError::driver("copying in", e));
    let (u0, alpha, grad_out) = (up(&c.u0)?, up(&c.alpha)?, up(&c.grad_out)?);
    let (out, z_all) =
        stack.forward_with(stream, &u0, &alpha, c.apply_alpha, &ForwardOptions::default().with_precision(precision))?;
    let opts = opts.clone().with_precision(precision);
    let (grad_u0, grad_alpha, decision) =
        stack.backward(stream, &grad_out, &out, &z_all, &alpha, c.apply_alpha, &opts)?;
    let host = |b: &cudarc::driver::CudaSlice<T>| stream.clone_dtoh(b).map_err(|e| MixError::driver("copying out", e));
    Ok(GpuRun {
        out: host(&out)?,
        z_all: host(&z_all)?,
        grad_u0: host(&grad_u0)?,
        grad_alpha: host(&grad_alpha)?,
        path: decision.path,
    })
}

fn check_gpu<T: Host>(t: &mut Tally, label: &str, c: &Case, r: &GpuRun<T>, tol: f64) {
    t.line(c.index, label, "out", rel_err(&widen(&r.out), &c.out), tol);
    t.line(c.index, label, "z_all", rel_err(&widen(&r.z_all), &c.z_all), tol);
    t.line(c.index, label, "grad_u0", rel_err(&widen(&r.grad_u0), &c.grad_u0), tol);
    t.line(c.index, label, "grad_alpha", rel_err(&widen(&r.grad_alpha), &c.grad_alpha), tol);
}

pub fn run(dir: Option<&std::path::Path>) -> CliResult {
    let dir = dir.map(|d| d.to_path_buf()).unwrap_or_else(vectors::default_dir);
    let cases = vectors::load_dir(&dir)?;
    println!("# verify against {} ({} cases)", dir.display(), cases.len());
    let mut t = Tally { checked: 0, failed: 0 };
    for c in &cases {
        let w = c.weights();
        let (out, z_all) = reference::forward(&c.shape, &w, &c.u0, &c.alpha, c.apply_alpha);
        let (gu, ga) = reference::backward(&c.shape, &w, &c.grad_out, &out, &z_all, &c.alpha, c.apply_alpha);
        t.line(c.index, "cpu-f64", "out", rel_err(&out, &c.out), TOL_F64);
        t.line(c.index, "cpu-f64", "z_all", rel_err(&z_all, &c.z_all), TOL_F64);
        t.line(c.index, "cpu-f64", "grad_u0", rel_err(&gu, &c.grad_u0), TOL_F64);
        t.line(c.index, "cpu-f64", "grad_alpha", rel_err(&ga, &c.grad_alpha), TOL_F64);
    }
    match open_device(0) {
        Err(e) => println!("GPU paths SKIPPED: no CUDA device ({e})"),
        Ok(ctx) => {
            let stream = ctx.default_stream();
            for c in &cases {
                let r64 = run_case::<f64>(&stream, c, Precision::Exact, &BackwardOptions::relay())?;
                check_gpu(&mut t, "gpu-f64-relay", c, &r64, TOL_F64);
                for p in Precision::ALL {
                    let tag = |path: &str| match p {
                        Precision::Exact => format!("gpu-f32-{path}"),
                        p => format!("gpu-f32-{p}-{path}"),
                    };
                    let relay = match run_case::<f32>(&stream, c, p, &BackwardOptions::relay()) {
                        Ok(r) => r,
                        // A compensated mode this build or device does not serve.
                        Err(e @ MixError::UnsupportedPrecision { .. }) => {
                            println!("case {} {:<18} not run: {e}", c.index, tag("relay"));
                            continue;
                        }
                        Err(e) => return Err(e.into()),
                    };
                    check_gpu(&mut t, &tag("relay"), c, &relay, TOL_F32);
                    let fused = run_case::<f32>(&stream, c, p, &BackwardOptions::fused_always())?;
                    if fused.path == Path::Fused {
                        check_gpu(&mut t, &tag("fused"), c, &fused, TOL_F32);
                        let same = fused.grad_u0.iter().zip(&relay.grad_u0).all(|(a, b)| a.bits() == b.bits())
                            && fused.grad_alpha.iter().zip(&relay.grad_alpha).all(|(a, b)| a.bits() == b.bits());
                        println!(
                            "case {} {:<18} bitwise equal to relay: {}",
                            c.index,
                            tag("fused"),
                            if same { "PASS" } else { "FAIL" }
                        );
                        t.checked += 1;
                        t.failed += usize::from(!same);
                    } else {
                        println!("case {} {:<18} not run: relay (outside the fused regime)", c.index, tag("fused"));
                    }
                }
            }
        }
    }
    if t.failed > 0 {
        return Err(format!("{} checks failed", t.failed).into());
    }
    if t.checked == 0 {
        return Err(format!("verify against {}: no check ran: nothing was verified", dir.display()).into());
    }
    println!("verify: all checks passed ({} checks)", t.checked);
    Ok(())
}
