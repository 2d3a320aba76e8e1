//! The stack's static shape (F, Cf, lmax, n_layers) and every size derived
//! from it (docs/MIXING_STACK.md "Shapes and names"). Sizes that depend on E
//! are computed with checked arithmetic.

use super::error::{MixError, ShapeParam};

/// Largest F: F is `gridDim.z` of every launch.
pub const MAX_F: usize = 65_535;

/// Most edges one call may have: a call plans its steps ahead (one cuBLAS
/// call per 32,768 rows among them), and no device holds more (2^31 edges
/// of the narrowest row, 128 floats, are 1 TiB per surface).
pub const MAX_EDGES: usize = i32::MAX as usize;

/// Most layers a stack may have: far past DeePMD-kit's models (a few), and
/// a bound on what one call plans (a few steps per layer).
pub const MAX_LAYERS: usize = 1024;

/// Static shape of a stack; E is per call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StackShape {
    /// Focus streams.
    pub f: usize,
    /// Channels per focus.
    pub cf: usize,
    /// Highest degree L.
    pub lmax: usize,
    /// SO(2) layers; the first n_layers-1 are gated.
    pub n_layers: usize,
}

impl StackShape {
    pub fn new(f: usize, cf: usize, lmax: usize, n_layers: usize) -> Self {
        StackShape { f, cf, lmax, n_layers }
    }
    // The derived sizes saturate: on a shape no stack accepts
    // (validate_shape) they give usize::MAX, which every checked size below
    // refuses, never a wrapped value or a panic.
    /// (L+1) * Cf.
    pub fn m0(&self) -> usize {
        self.lmax.saturating_add(1).saturating_mul(self.cf)
    }
    /// 2L * Cf.
    pub fn m1(&self) -> usize {
        self.lmax.saturating_mul(2).saturating_mul(self.cf)
    }
    /// (3L+1) * Cf = M0 + M1.
    pub fn row(&self) -> usize {
        self.lmax.saturating_mul(3).saturating_add(1).saturating_mul(self.cf)
    }
    /// L * Cf.
    pub fn lg(&self) -> usize {
        self.lmax.saturating_mul(self.cf)
    }
    /// Gated layers: n_layers - 1.
    pub fn gated(&self) -> usize {
        self.n_layers.saturating_sub(1)
    }

    /// Elements of W0 (n_layers, F, M0, M0), `None` on overflow.
    pub fn w0_len(&self) -> Option<usize> {
        mul(&[self.n_layers, self.f, self.m0(), self.m0()])
    }
    /// Elements of W1 (n_layers, F, M1, M1).
    pub fn w1_len(&self) -> Option<usize> {
        mul(&[self.n_layers, self.f, self.m1(), self.m1()])
    }
    /// Elements of GW (n_layers-1, F, Cf, LG).
    pub fn gw_len(&self) -> Option<usize> {
        mul(&[self.gated(), self.f, self.cf, self.lg()])
    }

    /// Elements of one (F, E, ROW) / (E, F, ROW) surface: u0, out, grad_out, grad_u0.
    pub fn surface_len(&self, e: usize) -> Result<usize, MixError> {
        mul(&[self.f, e, self.row()]).ok_or(MixError::SizeOverflow { e: e as u64, what: "F*E*ROW" })
    }
    /// Elements of z_all: (n_layers-1) * F * E * ROW.
    pub fn z_all_len(&self, e: usize) -> Result<usize, MixError> {
        mul(&[self.gated(), self.f, e, self.row()])
            .ok_or(MixError::SizeOverflow { e: e as u64, what: "(n_layers-1)*F*E*ROW" })
    }
    /// Elements of the gate surface sig: F * E * LG.
    pub fn sig_len(&self, e: usize) -> Result<usize, MixError> {
        mul(&[self.f, e, self.lg()]).ok_or(MixError::SizeOverflow { e: e as u64, what: "F*E*LG" })
    }
    /// Elements of alpha / grad_alpha: E * F.
    pub fn alpha_len(&self, e: usize) -> Result<usize, MixError> {
        mul(&[e, self.f]).ok_or(MixError::SizeOverflow { e: e as u64, what: "E*F" })
    }

    /// E from the length of a (F, E, ROW)-sized tensor; the length must be an
    /// exact multiple of F*ROW.
    pub fn edges_from(&self, tensor: &'static str, len: usize) -> Result<usize, MixError> {
        let unit = self.f.saturating_mul(self.row());
        if unit == 0 || unit == usize::MAX {
            return Err(MixError::BufferNotMultiple { tensor, got: len, unit, what: "F*ROW" });
        }
        if !len.is_multiple_of(unit) {
            return Err(MixError::BufferNotMultiple { tensor, got: len, unit, what: "F*ROW" });
        }
        Ok(len / unit)
    }

    /// Check that `e` is at most [`MAX_EDGES`] and every byte size and offset
    /// a call with `e` edges makes fits 64-bit signed arithmetic (the kernels' `long long`), for
    /// elements of `elem_size` bytes.
    pub fn check_edges(&self, e: usize, elem_size: usize) -> Result<(), MixError> {
        if e > MAX_EDGES {
            return Err(MixError::UnsupportedShape {
                param: ShapeParam::E,
                value: e as u64,
                supported: format!("0..={MAX_EDGES} per call"),
            });
        }
        let worst = self.z_all_len(e)?.max(self.surface_len(e)?);
        let bytes = worst.checked_mul(elem_size).ok_or(MixError::SizeOverflow { e: e as u64, what: "byte size" })?;
        if i64::try_from(bytes).is_err() || i64::try_from(e).is_err() {
            return Err(MixError::SizeOverflow { e: e as u64, what: "byte size as i64" });
        }
        Ok(())
    }
}

fn mul(v: &[usize]) -> Option<usize> {
    v.iter().try_fold(1usize, |a, &d| a.checked_mul(d))
}
