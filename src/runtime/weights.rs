//! The stack's weights on the device: W0, W1 and GW as given, and the
//! transposed copies the backward reads (uploaded once, at create).

use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, SyncOnDrop};

use super::element::Element;
use super::error::{check_len, DriverContext, MixError, ShapeParam};
use super::exec::Io;
use super::shape::StackShape;

/// W0 (n_layers, F, M0, M0), W1 (n_layers, F, M1, M1), GW (n_layers-1, F,
/// Cf, LG), row-major (in, out), and their transposes.
pub(crate) struct Weights<T> {
    pub w0: CudaSlice<T>,
    pub w1: CudaSlice<T>,
    pub wt0: CudaSlice<T>,
    pub wt1: CudaSlice<T>,
    /// `None` when n_layers == 1 (no gated layer).
    pub gw: Option<CudaSlice<T>>,
    /// gwt[k][f][c][j] = GW[k][f][j][c]: the gate-logit contraction reads
    /// it along j, coalesced.
    pub gwt: Option<CudaSlice<T>>,
    /// max |w| over W0 and W1, the block GEMMs' weights (NaN if one is):
    /// what a compensated mode's range contract is checked against.
    pub gemm_max_abs: f64,
}

impl<T: Element> Weights<T> {
    /// Check the lengths against `shape`, transpose, upload on `stream` and
    /// wait for the upload.
    pub fn upload(
        stream: &Arc<CudaStream>,
        shape: &StackShape,
        w0: &[T],
        w1: &[T],
        gw: &[T],
    ) -> Result<Self, MixError> {
        let overflow = |tensor| MixError::UnsupportedShape {
            param: ShapeParam::NLayers,
            value: shape.n_layers as u64,
            supported: format!("sizes of `{tensor}` that fit usize"),
        };
        check_len("w0", shape.w0_len().ok_or_else(|| overflow("w0"))?, w0.len())?;
        check_len("w1", shape.w1_len().ok_or_else(|| overflow("w1"))?, w1.len())?;
        check_len("gw", shape.gw_len().ok_or_else(|| overflow("gw"))?, gw.len())?;

        let up = |what: &'static str, host: &[T]| {
            stream.clone_htod(host).during(|| format!("uploading `{what}` ({} elements)", host.len()))
        };
        let gemm_max_abs = w0.iter().chain(w1).map(|w| w.to_f64().abs()).fold(0.0, |m: f64, a| {
            if m.is_nan() || a.is_nan() {
                f64::NAN
            } else {
                m.max(a)
            }
        });
        let weights = Weights {
            gemm_max_abs,
            w0: up("w0", w0)?,
            w1: up("w1", w1)?,
            wt0: up("wt0", &transpose_blocks(w0, shape.m0()))?,
            wt1: up("wt1", &transpose_blocks(w1, shape.m1()))?,
            gw: if gw.is_empty() { None } else { Some(up("gw", gw)?) },
            gwt: if gw.is_empty() { None } else { Some(up("gwt", &transpose_rect_blocks(gw, shape.cf, shape.lg()))?) },
        };
        stream.synchronize().during(|| "waiting for the weight upload".into())?;
        Ok(weights)
    }

    /// The addresses a pass reads into `io` (the forward W0, W1, GW; the
    /// backward the transposes and GW, GWT), with the guards that order the
    /// stream's reads against the buffers' lifetime (keep them until the work
    /// is enqueued). Only those: a guard is stream work (an event wait and
    /// record where the context tracks them).
    pub fn bind<'a>(&'a self, stream: &'a CudaStream, io: &mut Io, backward: bool) -> Vec<SyncOnDrop<'a>> {
        let mut guards = Vec::with_capacity(4);
        let mut at = |buf: &'a CudaSlice<T>, dst: &mut CUdeviceptr| {
            let (p, g) = buf.device_ptr(stream);
            *dst = p;
            guards.push(g);
        };
        if backward {
            at(&self.wt0, &mut io.wt0);
            at(&self.wt1, &mut io.wt1);
        } else {
            at(&self.w0, &mut io.w0);
            at(&self.w1, &mut io.w1);
        }
        if let Some(gw) = &self.gw {
            at(gw, &mut io.gw);
        }
        if let (true, Some(gwt)) = (backward, &self.gwt) {
            at(gwt, &mut io.gwt);
        }
        guards
    }

    /// Device bytes: W0, W1, GW and their transposes.
    pub fn bytes(&self) -> u64 {
        let sz = std::mem::size_of::<T>() as u64;
        let gw = self.gw.as_ref().map_or(0, |g| g.len() as u64);
        (2 * self.w0.len() as u64 + 2 * self.w1.len() as u64 + 2 * gw) * sz
    }
}

/// wt[k][f][o][i] = W[k][f][i][o] for `blocks` square n x n blocks.
fn transpose_blocks<T: Copy>(w: &[T], n: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(w.len());
    for blk in w.chunks_exact(n * n) {
        for o in 0..n {
            out.extend((0..n).map(|i| blk[i * n + o]));
        }
    }
    out
}

/// The transpose of every rows x cols block (rows*cols elements each).
fn transpose_rect_blocks<T: Copy>(w: &[T], rows: usize, cols: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(w.len());
    if rows * cols == 0 {
        return out;
    }
    for blk in w.chunks_exact(rows * cols) {
        for c in 0..cols {
            out.extend((0..rows).map(|r| blk[r * cols + c]));
        }
    }
    out
}
