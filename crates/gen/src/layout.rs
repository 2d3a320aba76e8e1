//! Shared-memory layout of an instance, computed once here and rendered into
//! the instance file as constants; the runtime launches with the same numbers
//! from the generated table. Nothing re-derives it in a template or kernel.

use super::spec::SmemBuf;
use crate::kinds::{Dtype, Geometry, Pipe, Variant};
use serde::Serialize;

/// Rows of a `glogit_sub` buffer at most (the kernel reads the rows it got
/// as the rendered constant `glog_rows`): g_logit is formed that many rows
/// at a time, so BLOCK_M must be at most this or a multiple of it.
pub const GLOG_SUB_ROWS: u32 = 16;

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Layout {
    /// 16 bytes in elements: the pad of a row of the ws panel.
    pub apad: u32,
    /// Pitches in elements of the GEMM rings' rows (None for row stages):
    /// A's chunk (k-major for `pipe: regs`, rows of BLOCK_M + pad; row-major
    /// otherwise, rows of BLOCK_K + pad), B's k-major chunk, the C tile.
    pub a_pitch: Option<u32>,
    pub b_pitch: Option<u32>,
    pub c_pitch: Option<u32>,
    /// Byte offsets of the fixed buffers (absent ones: None); with pipe
    /// wgmma, `b_tile` is the B panel at `fixed`, in the per-LG region.
    pub a_tile: Option<u32>,
    pub b_tile: Option<u32>,
    pub s_rows: Option<u32>,
    pub gzs_rows: Option<u32>,
    /// GEMM output tile, staged for coalesced epilogues; aliases the fixed
    /// buffers above (dead by then), never the per-LG ones.
    pub c_tile: Option<u32>,
    /// Bytes of the fixed part.
    pub fixed: u32,
    /// Per-LG buffers follow `fixed`, slot i at `fixed + i * rows*LG*size`
    /// (a `glogit_sub` buffer, of `glog_rows` rows, comes last).
    pub sig_slot: Option<u32>,
    pub glog_slot: Option<u32>,
    /// Rows of the g_logit buffer: `rows`, or min(rows, GLOG_SUB_ROWS) for
    /// a `glogit_sub` one.
    pub glog_rows: Option<u32>,
    /// Bytes per gate column: launch with `fixed + per_lg * L*Cf`.
    pub per_lg: u32,
    /// The fused backward's wgmma walks (`pipe: wgmma` or `split_wgmma`):
    /// byte offset of two B chunks split into fp16 head and tail halves
    /// (BK x BN each, wgmma's core matrices), in `fixed`.
    pub b_split: Option<u32>,
    /// `pipe: ws`: byte offset of the A panel (BLOCK_M rows of ROW + pad),
    /// which sig (BLOCK_M x L*Cf) and the g_logit rows follow; the kernel
    /// places them from L at run time and `fixed` / `per_lg` count them.
    pub panel: Option<u32>,
}

/// Rounded up to 16 bytes; saturates (a saturated size never fits).
fn align16(x: u32) -> u32 {
    x.div_ceil(16).saturating_mul(16)
}

/// Checked product, saturating at u32::MAX: the specs' bounds keep every
/// product in range, and one that is not is pruned as too large, never wrapped.
fn prod(xs: &[u32]) -> u32 {
    xs.iter().try_fold(1u32, |a, &x| a.checked_mul(x)).unwrap_or(u32::MAX)
}

/// Whether the tile keeps a column tile's whole B as a panel (the relay's
/// wgmma GEMM, gemm_wg), in the per-LG region; the fused wgmma walks split
/// each ring chunk into `b_split` instead.
pub fn b_panel(g: &Geometry, variant: Variant) -> bool {
    g.pipe() == Some(Pipe::Wgmma) && variant != Variant::Fused
}

pub fn layout(bufs: &[SmemBuf], dtype: Dtype, cf: u32, g: &Geometry, variant: Variant) -> Layout {
    let sz = dtype.size() as u32;
    let apad = 16 / sz;
    let rows = g.rows();
    let (bm, bn, bk, stages, pipe) = match *g {
        Geometry::Gemm { block_m, bn, block_k, stages, pipe, .. } => (block_m, bn, block_k, stages, pipe),
        Geometry::Rows { rows, .. } => (rows, 0, 0, 0, Pipe::Regs),
    };
    // A 16-byte pad per row keeps vector accesses aligned and spreads a
    // warp's column reads over the banks. The fp16x3 core (core.cuh: x3)
    // pads for conflict-free mma fragment loads instead: A rows of BK + 8
    // floats, B rows of BN + 4.
    let x3 = g.precision() == crate::kinds::Precision::Fp16x3;
    let (a_rows, a_pitch, b_pitch) = match pipe {
        _ if x3 => (bm, bk.saturating_add(8), bn.saturating_add(4)),
        Pipe::Regs => (bk, bm.saturating_add(apad), bn),
        Pipe::Async | Pipe::Stream | Pipe::Ws | Pipe::Split | Pipe::Wgmma | Pipe::SplitWgmma => {
            (bm, bk.saturating_add(apad), bn)
        }
    };
    let c_pitch = bn.saturating_add(apad);
    let gemm = matches!(g, Geometry::Gemm { .. });
    let mut at = 0u32;
    let mut place = |bytes: u32| {
        let off = at;
        at = align16(at.saturating_add(bytes));
        Some(off)
    };
    let mut l = Layout {
        apad,
        a_pitch: gemm.then_some(a_pitch),
        b_pitch: gemm.then_some(b_pitch),
        c_pitch: gemm.then_some(c_pitch),
        a_tile: None,
        b_tile: None,
        s_rows: None,
        gzs_rows: None,
        c_tile: None,
        fixed: 0,
        sig_slot: None,
        glog_slot: None,
        glog_rows: None,
        per_lg: 0,
        b_split: None,
        panel: None,
    };
    if pipe == Pipe::Ws {
        return ws_layout(l, bufs, sz, cf, bm, bk, bn, stages);
    }
    // pipe: split keeps two sets of the per-row buffers (s and sig), one
    // being read by the GEMM's threads while the producers fill the other:
    // s slot j at s_rows + j * rows * Cf values, sig slot j at per-LG slot
    // sig_slot + j.
    let sets = if matches!(pipe, Pipe::Split | Pipe::SplitWgmma) { 2 } else { 1 };
    let b_panel = b_panel(g, variant);
    let b_split = pipe.wgmma() && !b_panel;
    for b in bufs {
        match b {
            // A ring of `stages` chunks: the next ones load while one computes.
            SmemBuf::ATile => l.a_tile = place(prod(&[stages, a_rows, a_pitch, sz])),
            // B is a panel of the whole K (below), not a ring.
            SmemBuf::BTile if b_panel => {}
            SmemBuf::BTile => {
                l.b_tile = place(prod(&[stages, bk, b_pitch, sz]));
                if b_split {
                    // two chunks' head and tail halves (by chunk parity)
                    l.b_split = place(prod(&[2, 4, bk, bn]));
                }
            }
            SmemBuf::SRows => l.s_rows = place(prod(&[sets, rows, cf, sz])),
            SmemBuf::GzsRows => l.gzs_rows = place(prod(&[rows, cf, sz])),
            _ => {}
        }
    }
    l.fixed = at;
    if gemm {
        l.c_tile = Some(0);
        // The streaming pipes' epilogue leaves from registers: no C tile.
        if !matches!(pipe, Pipe::Stream | Pipe::Split | Pipe::Wgmma | Pipe::SplitWgmma) {
            l.fixed = l.fixed.max(align16(prod(&[bm, c_pitch, sz])));
        }
    }
    let mut slots = 0u32;
    for b in bufs {
        match b {
            SmemBuf::SigRows => {
                l.sig_slot = Some(slots);
                slots += sets;
            }
            SmemBuf::GlogitRows => {
                l.glog_slot = Some(slots);
                l.glog_rows = Some(rows);
                slots += 1;
            }
            _ => {}
        }
    }
    l.per_lg = prod(&[slots, rows, sz]);
    if b_panel && bufs.contains(&SmemBuf::BTile) {
        // The column tile's B, K x BN as fp16 head and tail halves (gemm_wg):
        // 4 * BN bytes per K row, and K (M0 or M1) is at most 2 * L*Cf.
        l.b_tile = Some(l.fixed);
        l.per_lg = l.per_lg.saturating_add(prod(&[8, bn]));
    }
    if bufs.contains(&SmemBuf::GlogitSub) {
        let sub = GLOG_SUB_ROWS.min(rows);
        l.glog_slot = Some(slots);
        l.glog_rows = Some(sub);
        l.per_lg = l.per_lg.saturating_add(prod(&[sub, sz]));
    }
    l
}

/// `pipe: ws` (the fused backward): the B ring and s, then the panel (whose
/// row is ROW = 3*L*Cf + Cf plus a 16-byte pad: the Cf + pad part counts in
/// `fixed`, 3 * BLOCK_M values in `per_lg`), sig and the g_logit rows. No A
/// ring: the consumers read A from the panel.
#[allow(clippy::too_many_arguments)]
fn ws_layout(mut l: Layout, bufs: &[SmemBuf], sz: u32, cf: u32, bm: u32, bk: u32, bn: u32, stages: u32) -> Layout {
    let mut at = 0u32;
    let mut place = |bytes: u32| {
        let off = at;
        at = align16(at.saturating_add(bytes));
        off
    };
    l.b_tile = Some(place(prod(&[stages, bk, l.b_pitch.unwrap_or(bn), sz])));
    if bufs.contains(&SmemBuf::SRows) {
        l.s_rows = Some(place(prod(&[bm, cf, sz])));
    }
    l.panel = Some(at);
    l.fixed = at.saturating_add(prod(&[bm, cf.saturating_add(l.apad), sz]));
    let sub = GLOG_SUB_ROWS.min(bm);
    l.glog_rows = Some(sub);
    // panel 3 * bm, sig bm, g_logit sub rows per gate column
    l.per_lg = prod(&[bm.saturating_mul(4).saturating_add(sub), sz]);
    l
}

impl Layout {
    /// Dynamic shared bytes at launch for a given lmax (u32::MAX where the
    /// sum overflows: never a size that fits).
    pub fn bytes(&self, cf: u32, lmax: u32) -> u32 {
        let b = self.fixed as u64 + self.per_lg as u64 * cf as u64 * lmax as u64;
        u32::try_from(b).unwrap_or(u32::MAX)
    }
}
