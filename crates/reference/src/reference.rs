//! Hand-written CPU reference of the SO(2) mixing stack, in f64.
//!
//! Written directly from the equations of `docs/MIXING_STACK.md` (forward and
//! closed-form backward), independently of any GPU code. It is meant for tests
//! and as an oracle, so it favours plainness over speed: every focus stream is
//! processed on its own, every GEMM is a triple loop.
//!
//! Layouts (row-major, see the document):
//!
//! | tensor     | shape                        |
//! | ---------- | ---------------------------- |
//! | u0         | (F, E, ROW)                  |
//! | W0         | (n_layers, F, M0, M0) (in, out) |
//! | W1         | (n_layers, F, M1, M1) (in, out) |
//! | GW         | (n_layers-1, F, Cf, LG) (in, out) |
//! | alpha      | (E, F)                       |
//! | out        | (E, F, ROW)                  |
//! | z_all      | (n_layers-1, F, E, ROW)      |
//! | grad_out   | (E, F, ROW)                  |
//! | grad_u0    | (F, E, ROW)                  |
//! | grad_alpha | (E, F)                       |

/// Shape of one stack problem.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Focus streams (independent weight sets).
    pub f: usize,
    /// Edges (rows).
    pub e: usize,
    /// Channels per focus (one subtile's width).
    pub cf: usize,
    /// Highest degree L (mmax is always 1).
    pub lmax: usize,
    /// SO(2) layers; the first `n_layers - 1` are gated, the last is identity.
    pub n_layers: usize,
}

impl Shape {
    /// Width of the m = 0 block: (L+1) * Cf.
    pub fn m0(&self) -> usize {
        (self.lmax + 1) * self.cf
    }
    /// Width of the |m| = 1 block: 2L * Cf.
    pub fn m1(&self) -> usize {
        2 * self.lmax * self.cf
    }
    /// One edge's row: (3L+1) * Cf = M0 + M1.
    pub fn row(&self) -> usize {
        (3 * self.lmax + 1) * self.cf
    }
    /// Gate width: L * Cf (L groups of Cf channels).
    pub fn lg(&self) -> usize {
        self.lmax * self.cf
    }
    /// Number of gated layers (n_layers - 1; 0 if n_layers is 0).
    fn gated(&self) -> usize {
        self.n_layers.saturating_sub(1)
    }

    /// Elements of u0: F * E * ROW.
    pub fn u0_len(&self) -> usize {
        self.f * self.e * self.row()
    }
    /// Elements of W0: n_layers * F * M0 * M0.
    pub fn w0_len(&self) -> usize {
        self.n_layers * self.f * self.m0() * self.m0()
    }
    /// Elements of W1: n_layers * F * M1 * M1.
    pub fn w1_len(&self) -> usize {
        self.n_layers * self.f * self.m1() * self.m1()
    }
    /// Elements of GW: (n_layers-1) * F * Cf * LG.
    pub fn gw_len(&self) -> usize {
        self.gated() * self.f * self.cf * self.lg()
    }
    /// Elements of alpha (and grad_alpha): E * F.
    pub fn alpha_len(&self) -> usize {
        self.e * self.f
    }
    /// Elements of out (and grad_out, grad_u0): E * F * ROW.
    pub fn out_len(&self) -> usize {
        self.e * self.f * self.row()
    }
    /// Elements of z_all: (n_layers-1) * F * E * ROW.
    pub fn z_all_len(&self) -> usize {
        self.gated() * self.f * self.e * self.row()
    }
}

/// The stack's weights, all layers and focus streams (layouts above).
pub struct Weights<'a> {
    pub w0: &'a [f64],
    pub w1: &'a [f64],
    pub gw: &'a [f64],
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

fn check_shape(s: &Shape, w: &Weights) {
    assert!(s.f >= 1, "Shape.f must be >= 1");
    assert!(s.cf >= 1, "Shape.cf must be >= 1");
    assert!(s.lmax >= 1, "Shape.lmax must be >= 1");
    assert!(s.n_layers >= 1, "Shape.n_layers must be >= 1");
    assert_eq!(w.w0.len(), s.w0_len(), "w0 length");
    assert_eq!(w.w1.len(), s.w1_len(), "w1 length");
    assert_eq!(w.gw.len(), s.gw_len(), "gw length");
}

/// One (layer, focus) weight set, sliced out of `Weights`.
struct LayerWeights<'a> {
    /// (M0, M0), (in, out)
    w0: &'a [f64],
    /// (M1, M1), (in, out)
    w1: &'a [f64],
}

fn layer_weights<'a>(s: &Shape, w: &Weights<'a>, layer: usize, f: usize) -> LayerWeights<'a> {
    let (m0, m1) = (s.m0(), s.m1());
    let i = layer * s.f + f;
    LayerWeights { w0: &w.w0[i * m0 * m0..(i + 1) * m0 * m0], w1: &w.w1[i * m1 * m1..(i + 1) * m1 * m1] }
}

/// GW[layer, f]: (Cf, LG), (in, out).
fn gate_weights<'a>(s: &Shape, w: &Weights<'a>, layer: usize, f: usize) -> &'a [f64] {
    let n = s.cf * s.lg();
    let i = layer * s.f + f;
    &w.gw[i * n..(i + 1) * n]
}

/// `dst[:, off..off+n] = x[:, off..off+k] @ w` for a row-major (k, n) matrix `w`,
/// where `x` and `dst` are (E, ROW) with row stride `stride`. Used with
/// k == n (square block weights), so input and output share the column offset.
fn block_gemm(x: &[f64], dst: &mut [f64], stride: usize, off: usize, w: &[f64], k: usize, n: usize) {
    debug_assert_eq!(w.len(), k * n);
    for (xr, dr) in x.chunks_exact(stride).zip(dst.chunks_exact_mut(stride)) {
        let xin = &xr[off..off + k];
        let dout = &mut dr[off..off + n];
        dout.iter_mut().for_each(|v| *v = 0.0);
        for (i, &xi) in xin.iter().enumerate() {
            let wrow = &w[i * n..(i + 1) * n];
            for (d, &wij) in dout.iter_mut().zip(wrow) {
                *d += xi * wij;
            }
        }
    }
}

/// `dst[:, off..off+k] = x[:, off..off+n] @ w^T` for a row-major (k, n) matrix `w`
/// (the transpose-GEMM of the backward).
fn block_gemm_t(x: &[f64], dst: &mut [f64], stride: usize, off: usize, w: &[f64], k: usize, n: usize) {
    debug_assert_eq!(w.len(), k * n);
    for (xr, dr) in x.chunks_exact(stride).zip(dst.chunks_exact_mut(stride)) {
        let xin = &xr[off..off + n];
        let dout = &mut dr[off..off + k];
        for (i, d) in dout.iter_mut().enumerate() {
            let wrow = &w[i * n..(i + 1) * n];
            *d = xin.iter().zip(wrow).map(|(a, b)| a * b).sum();
        }
    }
}

/// `[x[:, :M0] @ W0 | x[:, M0:] @ W1]`, x is (E, ROW).
fn mix_forward(s: &Shape, lw: &LayerWeights, x: &[f64]) -> Vec<f64> {
    let (row, m0, m1) = (s.row(), s.m0(), s.m1());
    let mut z = vec![0.0; x.len()];
    block_gemm(x, &mut z, row, 0, lw.w0, m0, m0);
    block_gemm(x, &mut z, row, m0, lw.w1, m1, m1);
    z
}

/// `[g[:, :M0] @ W0^T | g[:, M0:] @ W1^T]`, g is (E, ROW).
fn mix_backward(s: &Shape, lw: &LayerWeights, g: &[f64]) -> Vec<f64> {
    let (row, m0, m1) = (s.row(), s.m0(), s.m1());
    let mut d = vec![0.0; g.len()];
    block_gemm_t(g, &mut d, row, 0, lw.w0, m0, m0);
    block_gemm_t(g, &mut d, row, m0, lw.w1, m1, m1);
    d
}

/// Gate group of gated subtile `r` (1..=3L): r-1 in the m = 0 block
/// (r = 1..L), (r-L-1) mod L in the |m| = 1 block (r = L+1..3L).
fn gate_group(lmax: usize, r: usize) -> usize {
    debug_assert!(r >= 1 && r <= 3 * lmax);
    if r <= lmax {
        r - 1
    } else {
        (r - lmax - 1) % lmax
    }
}

/// `sigmoid(z[:, :Cf] @ GW)` for one edge row `z` (length ROW); returns LG values.
fn gate_sigmoid(s: &Shape, gw: &[f64], zrow: &[f64]) -> Vec<f64> {
    let (cf, lg) = (s.cf, s.lg());
    let mut logit = vec![0.0; lg];
    for (c, &sc) in zrow[..cf].iter().enumerate() {
        for (l, &g) in logit.iter_mut().zip(&gw[c * lg..(c + 1) * lg]) {
            *l += sc * g;
        }
    }
    logit.into_iter().map(sigmoid).collect()
}

/// Forward pass. Returns `(out (E, F, ROW), z_all (n_layers-1, F, E, ROW))`;
/// `out` includes the alpha scaling when `apply_alpha`.
pub fn forward(s: &Shape, w: &Weights, u0: &[f64], alpha: &[f64], apply_alpha: bool) -> (Vec<f64>, Vec<f64>) {
    check_shape(s, w);
    assert_eq!(u0.len(), s.u0_len(), "u0 length");
    assert_eq!(alpha.len(), s.alpha_len(), "alpha length");
    let (fn_, e, cf, lmax, row) = (s.f, s.e, s.cf, s.lmax, s.row());
    let per_focus = e * row;

    let mut out = vec![0.0; s.out_len()];
    let mut z_all = vec![0.0; s.z_all_len()];

    for f in 0..fn_ {
        let mut u = u0[f * per_focus..(f + 1) * per_focus].to_vec();

        for k in 0..s.gated() {
            let lw = layer_weights(s, w, k, f);
            let gw = gate_weights(s, w, k, f);
            let z = mix_forward(s, &lw, &u);
            for (ur, zr) in u.chunks_exact_mut(row).zip(z.chunks_exact(row)) {
                let sig = gate_sigmoid(s, gw, zr);
                // scalar slice: silu(s)
                for c in 0..cf {
                    let sc = zr[c];
                    ur[c] += sc * sigmoid(sc);
                }
                // gated subtiles
                for r in 1..=3 * lmax {
                    let g = gate_group(lmax, r);
                    for c in 0..cf {
                        ur[r * cf + c] += zr[r * cf + c] * sig[g * cf + c];
                    }
                }
            }
            let zoff = (k * fn_ + f) * per_focus;
            z_all[zoff..zoff + per_focus].copy_from_slice(&z);
        }

        // final identity layer
        let lw = layer_weights(s, w, s.n_layers - 1, f);
        let mixed = mix_forward(s, &lw, &u);
        for ei in 0..e {
            let scale = if apply_alpha { alpha[ei * fn_ + f] } else { 1.0 };
            let dst = &mut out[(ei * fn_ + f) * row..(ei * fn_ + f + 1) * row];
            let ur = &u[ei * row..(ei + 1) * row];
            let mr = &mixed[ei * row..(ei + 1) * row];
            for ((d, &a), &b) in dst.iter_mut().zip(ur).zip(mr) {
                *d = (a + b) * scale;
            }
        }
    }
    (out, z_all)
}

/// Closed-form backward (input gradients only). `out` and `z_all` are those
/// returned by [`forward`] (`out` already includes alpha). Returns
/// `(grad_u0 (F, E, ROW), grad_alpha (E, F))`; grad_alpha is all zeros when
/// `apply_alpha` is false.
pub fn backward(
    s: &Shape,
    w: &Weights,
    grad_out: &[f64],
    out: &[f64],
    z_all: &[f64],
    alpha: &[f64],
    apply_alpha: bool,
) -> (Vec<f64>, Vec<f64>) {
    check_shape(s, w);
    assert_eq!(grad_out.len(), s.out_len(), "grad_out length");
    assert_eq!(out.len(), s.out_len(), "out length");
    assert_eq!(z_all.len(), s.z_all_len(), "z_all length");
    assert_eq!(alpha.len(), s.alpha_len(), "alpha length");
    let (fn_, e, cf, lmax, row, lg) = (s.f, s.e, s.cf, s.lmax, s.row(), s.lg());
    let per_focus = e * row;

    let mut grad_u0 = vec![0.0; s.u0_len()];
    let mut grad_alpha = vec![0.0; s.alpha_len()];

    for f in 0..fn_ {
        // g = grad_out[:, f, :], with the alpha scaling and grad_alpha.
        let mut g = vec![0.0; per_focus];
        for ei in 0..e {
            let src = &grad_out[(ei * fn_ + f) * row..(ei * fn_ + f + 1) * row];
            let gr = &mut g[ei * row..(ei + 1) * row];
            if apply_alpha {
                let o = &out[(ei * fn_ + f) * row..(ei * fn_ + f + 1) * row];
                let a = alpha[ei * fn_ + f];
                let dot: f64 = src.iter().zip(o).map(|(x, y)| x * y).sum();
                grad_alpha[ei * fn_ + f] = dot / a.max(1e-12);
                for (d, &x) in gr.iter_mut().zip(src) {
                    *d = x * a;
                }
            } else {
                gr.copy_from_slice(src);
            }
        }

        // final identity layer: g = g + [g0 @ W0^T | g1 @ W1^T]
        let lw = layer_weights(s, w, s.n_layers - 1, f);
        let d = mix_backward(s, &lw, &g);
        g.iter_mut().zip(&d).for_each(|(a, b)| *a += b);

        for k in (0..s.gated()).rev() {
            let lw = layer_weights(s, w, k, f);
            let gw = gate_weights(s, w, k, f);
            let zoff = (k * fn_ + f) * per_focus;
            let z = &z_all[zoff..zoff + per_focus];

            let mut gz = vec![0.0; per_focus];
            for ((gr, zr), gzr) in g.chunks_exact(row).zip(z.chunks_exact(row)).zip(gz.chunks_exact_mut(row)) {
                let sig = gate_sigmoid(s, gw, zr);
                // silu' on the scalar slice
                for c in 0..cf {
                    let sc = zr[c];
                    let s0 = sigmoid(sc);
                    gzr[c] = gr[c] * s0 * (1.0 + sc * (1.0 - s0));
                }
                // gated subtiles, and the gradient reaching each gate group
                let mut g_sig = vec![0.0; lg];
                for r in 1..=3 * lmax {
                    let grp = gate_group(lmax, r);
                    for c in 0..cf {
                        let i = r * cf + c;
                        gzr[i] = gr[i] * sig[grp * cf + c];
                        g_sig[grp * cf + c] += gr[i] * zr[i];
                    }
                }
                // gate path: gz_s += (g_sig * sig * (1 - sig)) @ GW^T
                for c in 0..cf {
                    let wrow = &gw[c * lg..(c + 1) * lg];
                    let acc: f64 = (0..lg).map(|j| g_sig[j] * sig[j] * (1.0 - sig[j]) * wrow[j]).sum();
                    gzr[c] += acc;
                }
            }

            let d = mix_backward(s, &lw, &gz);
            g.iter_mut().zip(&d).for_each(|(a, b)| *a += b);
        }

        grad_u0[f * per_focus..(f + 1) * per_focus].copy_from_slice(&g);
    }
    (grad_u0, grad_alpha)
}

/// Relative error `||a - b|| / ||b||` (Euclidean norms).
///
/// Returns 0 when both are all zeros, `f64::INFINITY` when `b` is all zeros but
/// `a` is not, and `f64::INFINITY` when any element of either is NaN (or
/// infinite: a non-finite value is never "close").
pub fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "rel_err: length mismatch");
    if a.iter().chain(b).any(|x| !x.is_finite()) {
        return f64::INFINITY;
    }
    let diff: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum::<f64>().sqrt();
    let norm: f64 = b.iter().map(|y| y * y).sum::<f64>().sqrt();
    if diff == 0.0 {
        0.0
    } else if norm == 0.0 {
        f64::INFINITY
    } else {
        diff / norm
    }
}
