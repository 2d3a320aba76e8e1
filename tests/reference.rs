//! Tests of the f64 CPU reference (`mixstack_reference::reference`) against the
//! independent reference vectors (`vectors/`, loaded by `mixstack_reference::vectors`),
//! against finite differences, and of the loader's error reporting.

use mixstack_reference::reference::{self, rel_err, Shape, Weights};
use mixstack_reference::vectors::{self, Case, VectorError};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

mod temp;
use temp::TempDir;

const VEC_TOL: f64 = 1e-10;

fn load_cases() -> Vec<Case> {
    let dir = vectors::default_dir();
    vectors::load_dir(&dir).unwrap_or_else(|e| panic!("loading {}: {e}", dir.display()))
}

#[test]
fn vectors_load_with_consistent_lengths() {
    let cases = load_cases();
    assert_eq!(cases.len(), 4, "manifest lists 4 cases");
    for c in &cases {
        let s = c.shape;
        assert_eq!(c.u0.len(), s.u0_len());
        assert_eq!(c.alpha.len(), s.alpha_len());
        assert_eq!(c.w0.len(), s.w0_len());
        assert_eq!(c.w1.len(), s.w1_len());
        assert_eq!(c.gw.len(), s.gw_len());
        assert_eq!(c.grad_out.len(), s.out_len());
        assert_eq!(c.out.len(), s.out_len());
        assert_eq!(c.z_all.len(), s.z_all_len());
        assert_eq!(c.grad_u0.len(), s.u0_len());
        assert_eq!(c.grad_alpha.len(), s.alpha_len());
        // f32 copies are the same values, widened exactly.
        assert_eq!(c.u0_f32.len(), c.u0.len());
        assert!(c.u0_f32.iter().zip(&c.u0).all(|(&a, &b)| a as f64 == b));
        assert!(c.gw_f32.iter().zip(&c.gw).all(|(&a, &b)| a as f64 == b));
        assert_eq!(c.alpha_f32.len(), c.alpha.len());
        assert_eq!(c.w0_f32.len(), c.w0.len());
        assert_eq!(c.w1_f32.len(), c.w1.len());
        assert_eq!(c.grad_out_f32.len(), c.grad_out.len());
    }
    // Keep the edge case: E = 1, F = 3.
    assert!(cases.iter().any(|c| c.shape.e == 1 && c.shape.f == 3));
}

#[test]
fn forward_matches_vectors() {
    for c in load_cases() {
        let (out, z_all) = reference::forward(&c.shape, &c.weights(), &c.u0, &c.alpha, c.apply_alpha);
        let (eo, ez) = (rel_err(&out, &c.out), rel_err(&z_all, &c.z_all));
        println!("case {} {:?} alpha={}: out {eo:.3e}, z_all {ez:.3e}", c.index, c.shape, c.apply_alpha);
        assert!(eo <= VEC_TOL, "case {}: out rel err {eo:e}", c.index);
        assert!(ez <= VEC_TOL, "case {}: z_all rel err {ez:e}", c.index);
    }
}

#[test]
fn backward_matches_vectors() {
    for c in load_cases() {
        let w = c.weights();
        // From the vectors' own saved forward outputs...
        let (gu, ga) = reference::backward(&c.shape, &w, &c.grad_out, &c.out, &c.z_all, &c.alpha, c.apply_alpha);
        // ...and end to end from this reference's forward.
        let (out, z_all) = reference::forward(&c.shape, &w, &c.u0, &c.alpha, c.apply_alpha);
        let (gu2, ga2) = reference::backward(&c.shape, &w, &c.grad_out, &out, &z_all, &c.alpha, c.apply_alpha);
        let errs = [
            ("grad_u0", rel_err(&gu, &c.grad_u0)),
            ("grad_alpha", rel_err(&ga, &c.grad_alpha)),
            ("grad_u0 (end to end)", rel_err(&gu2, &c.grad_u0)),
            ("grad_alpha (end to end)", rel_err(&ga2, &c.grad_alpha)),
        ];
        println!("case {}: {:?}", c.index, errs.map(|(n, e)| format!("{n} {e:.3e}")));
        for (name, e) in errs {
            assert!(e <= VEC_TOL, "case {}: {name} rel err {e:e}", c.index);
        }
        if !c.apply_alpha {
            assert!(ga.iter().all(|&x| x == 0.0), "case {}: grad_alpha must be zeros", c.index);
        }
    }
}

/// A random problem, fixed seed: weights scaled by 1/sqrt(fan_in), alpha in
/// [0.25, 1.25), everything else uniform in [-1, 1).
struct Problem {
    s: Shape,
    w0: Vec<f64>,
    w1: Vec<f64>,
    gw: Vec<f64>,
    u0: Vec<f64>,
    alpha: Vec<f64>,
    grad_out: Vec<f64>,
}

impl Problem {
    fn random(s: Shape, seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut uni = |n: usize, scale: f64| -> Vec<f64> { (0..n).map(|_| rng.gen_range(-1.0..1.0) * scale).collect() };
        let w0 = uni(s.w0_len(), 1.0 / (s.m0() as f64).sqrt());
        let w1 = uni(s.w1_len(), 1.0 / (s.m1() as f64).sqrt());
        let gw = uni(s.gw_len(), 1.0 / (s.cf as f64).sqrt());
        let u0 = uni(s.u0_len(), 1.0);
        let grad_out = uni(s.out_len(), 1.0);
        let alpha = uni(s.alpha_len(), 0.5).into_iter().map(|x| x + 0.75).collect();
        Problem { s, w0, w1, gw, u0, alpha, grad_out }
    }

    fn weights(&self) -> Weights<'_> {
        Weights { w0: &self.w0, w1: &self.w1, gw: &self.gw }
    }

    /// L = sum(grad_out * out).
    fn loss(&self, u0: &[f64], alpha: &[f64], apply_alpha: bool) -> f64 {
        let (out, _) = reference::forward(&self.s, &self.weights(), u0, alpha, apply_alpha);
        out.iter().zip(&self.grad_out).map(|(a, b)| a * b).sum()
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn axpy(x: &[f64], t: f64, d: &[f64]) -> Vec<f64> {
    x.iter().zip(d).map(|(a, b)| a + t * b).collect()
}

fn check_fd(s: Shape, apply_alpha: bool, seed: u64) {
    let p = Problem::random(s, seed);
    let w = p.weights();
    let (out, z_all) = reference::forward(&s, &w, &p.u0, &p.alpha, apply_alpha);
    let (gu, ga) = reference::backward(&s, &w, &p.grad_out, &out, &z_all, &p.alpha, apply_alpha);

    let h = 1e-6;
    let tol = 1e-6;
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
    for trial in 0..3 {
        // along u0
        let du: Vec<f64> = (0..p.u0.len()).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let fd = (p.loss(&axpy(&p.u0, h, &du), &p.alpha, apply_alpha)
            - p.loss(&axpy(&p.u0, -h, &du), &p.alpha, apply_alpha))
            / (2.0 * h);
        let an = dot(&gu, &du);
        let err = (fd - an).abs() / an.abs().max(1e-3);
        println!("{s:?} alpha={apply_alpha} trial {trial}: d/du0 analytic {an:.6e}, rel err {err:.2e}");
        assert!(err <= tol, "{s:?} alpha={apply_alpha} trial {trial}: d/du0 fd {fd} vs analytic {an} (rel {err:e})");

        // along alpha
        let da: Vec<f64> = (0..p.alpha.len()).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let fd = (p.loss(&p.u0, &axpy(&p.alpha, h, &da), apply_alpha)
            - p.loss(&p.u0, &axpy(&p.alpha, -h, &da), apply_alpha))
            / (2.0 * h);
        let an = dot(&ga, &da);
        if apply_alpha {
            let err = (fd - an).abs() / an.abs().max(1e-3);
            println!("{s:?} trial {trial}: d/dalpha analytic {an:.6e}, rel err {err:.2e}");
            assert!(err <= tol, "{s:?} trial {trial}: d/dalpha fd {fd} vs analytic {an} (rel {err:e})");
        } else {
            assert_eq!(fd, 0.0, "alpha must not matter when not applied");
            assert!(ga.iter().all(|&x| x == 0.0), "grad_alpha must be zeros when not applied");
        }
    }
}

const FD_SHAPES: [Shape; 2] =
    [Shape { f: 2, e: 3, cf: 4, lmax: 2, n_layers: 3 }, Shape { f: 1, e: 2, cf: 3, lmax: 3, n_layers: 4 }];

#[test]
fn backward_matches_finite_differences_with_alpha() {
    for (i, s) in FD_SHAPES.into_iter().enumerate() {
        check_fd(s, true, 1234 + i as u64);
    }
}

#[test]
fn backward_matches_finite_differences_without_alpha() {
    for (i, s) in FD_SHAPES.into_iter().enumerate() {
        check_fd(s, false, 4321 + i as u64);
    }
}

#[test]
fn rel_err_basics_and_nan_is_infinite() {
    assert_eq!(rel_err(&[0.0, 0.0], &[0.0, 0.0]), 0.0);
    assert_eq!(rel_err(&[], &[]), 0.0);
    assert_eq!(rel_err(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
    assert!((rel_err(&[3.0, 5.0], &[0.0, 5.0]) - 0.6).abs() < 1e-15);
    assert_eq!(rel_err(&[1.0], &[0.0]), f64::INFINITY);
    assert_eq!(rel_err(&[f64::NAN, 1.0], &[1.0, 1.0]), f64::INFINITY);
    assert_eq!(rel_err(&[1.0, 1.0], &[1.0, f64::NAN]), f64::INFINITY);
    assert_eq!(rel_err(&[f64::NAN], &[f64::NAN]), f64::INFINITY);
}

// ---- loader errors -------------------------------------------------------

/// A scratch copy of the vectors directory holding only case 3 (the smallest).
struct Scratch(TempDir);

impl Scratch {
    fn new(tag: &str) -> Self {
        let src = vectors::default_dir();
        let dir = TempDir::new(&format!("mixstack-vectors-{tag}"));
        let manifest: serde_json::Value =
            serde_json::from_slice(&std::fs::read(src.join("manifest.json")).unwrap()).unwrap();
        let case3 = manifest.as_array().unwrap().iter().find(|c| c["case"] == 3).unwrap().clone();
        for t in case3["tensors"].as_object().unwrap().values() {
            let f = t["file"].as_str().unwrap();
            std::fs::copy(src.join(f), dir.join(f)).unwrap();
        }
        std::fs::write(dir.join("manifest.json"), serde_json::to_vec(&vec![case3]).unwrap()).unwrap();
        Scratch(dir)
    }
}

#[test]
fn loader_reports_missing_file_bad_length_and_bad_json() {
    // sanity: the scratch copy loads
    let ok = Scratch::new("ok");
    assert_eq!(vectors::load_dir(&ok.0).unwrap().len(), 1);

    let missing = Scratch::new("missing");
    std::fs::remove_file(missing.0.join("case3_w1.f32")).unwrap();
    match vectors::load_dir(&missing.0) {
        Err(e @ VectorError::MissingFile { .. }) => {
            assert!(e.to_string().contains("case3_w1.f32"), "{e}")
        }
        other => panic!("expected MissingFile, got {other:?}"),
    }

    let short = Scratch::new("short");
    let p = short.0.join("case3_z_all.f64");
    let mut bytes = std::fs::read(&p).unwrap();
    bytes.truncate(bytes.len() - 8);
    std::fs::write(&p, bytes).unwrap();
    match vectors::load_dir(&short.0) {
        Err(e @ VectorError::ByteLength { .. }) => {
            assert!(e.to_string().contains("case3_z_all.f64"), "{e}")
        }
        other => panic!("expected ByteLength, got {other:?}"),
    }

    let json = Scratch::new("json");
    std::fs::write(json.0.join("manifest.json"), b"[{\"case\": 3,").unwrap();
    match vectors::load_dir(&json.0) {
        Err(e @ VectorError::ManifestJson { .. }) => {
            assert!(e.to_string().contains("manifest.json"), "{e}")
        }
        other => panic!("expected ManifestJson, got {other:?}"),
    }

    let empty = std::env::temp_dir().join(format!("mixstack-vectors-none-{}", std::process::id()));
    match vectors::load_dir(&empty) {
        Err(VectorError::MissingFile { path }) => assert!(path.ends_with("manifest.json")),
        other => panic!("expected MissingFile for the manifest, got {other:?}"),
    }
}
