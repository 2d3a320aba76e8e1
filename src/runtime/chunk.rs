//! Bounded scratch: a call whose scratch would pass the cap walks its edges
//! in chunks, one focus at a time, reusing one chunk's scratch.
//!
//! Edges are independent in every stage of the stack, and a chunk runs
//! exactly the kernels of the whole call on a window of rows, so the
//! results are bitwise those of the unchunked call. The cap is the stack's
//! setting ([`ScratchCap::Bytes`]), else [`SCRATCH_CAP_ENV`] read at each
//! call, else 1/[`DEFAULT_CAP_DIVISOR`] of the device's memory.

use super::error::MixError;

/// The environment variable that sets the scratch cap (bytes).
pub const SCRATCH_CAP_ENV: &str = "MIXSTACK_SCRATCH_CAP";

/// The spellings [`parse_cap`] accepts.
pub const CAP_SPELLINGS: &str = "a positive byte count, optionally with a K, M, G or T suffix (powers of 1024): 8G";

/// Default cap: this fraction of the device's memory (an H200: 17.6 GB, so
/// the seed workload never chunks; a 24 GB card: 3 GB).
pub const DEFAULT_CAP_DIVISOR: u64 = 8;

/// Most chunks one call walks (F foci, each cut into the same pieces): a
/// call plans every step ahead, so a cap that would cut it finer is refused
/// as too small (the seed's 646,000 edges at a cap of one edge would plan 23
/// million steps). Whole foci are always allowed (F <= 65,535).
pub const MAX_CHUNKS: u64 = 65_536;

/// Where a call's scratch cap comes from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ScratchCap {
    /// [`SCRATCH_CAP_ENV`] when set (read at each call), else the default.
    #[default]
    FromEnv,
    /// This many bytes, whatever the environment says.
    Bytes(u64),
}

impl ScratchCap {
    /// The cap in force for a device of `device_bytes`.
    pub fn resolve(self, device_bytes: u64) -> Result<u64, MixError> {
        match self {
            ScratchCap::Bytes(b) => Ok(b),
            ScratchCap::FromEnv => match super::switch::read_env(SCRATCH_CAP_ENV, CAP_SPELLINGS)? {
                None => Ok(device_bytes / DEFAULT_CAP_DIVISOR),
                Some(v) => parse_cap(&v),
            },
        }
    }
}

/// Parse a cap: `123`, `64M`, `8G`, `1T` (case-insensitive, trimmed).
pub fn parse_cap(value: &str) -> Result<u64, MixError> {
    let bad =
        || MixError::InvalidSwitch { variable: SCRATCH_CAP_ENV, value: value.to_string(), allowed: CAP_SPELLINGS };
    let v = value.trim();
    let (digits, shift) = match v.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => return Err(bad()),
            };
            (&v[..i], shift)
        }
        _ => (v, 0),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let bytes = n.checked_mul(1u64 << shift).ok_or_else(bad)?;
    if bytes == 0 {
        return Err(bad());
    }
    Ok(bytes)
}

/// How one call walks its rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Chunking {
    /// Every focus and edge in one launch sequence (scratch within the cap).
    Whole,
    /// One focus at a time, `rows` edges per chunk (the last may be shorter).
    Chunks { rows: usize },
}

/// The chunking of a call over `f` foci and `e` edges whose scratch is
/// `whole_row_bytes` per (focus, edge) unchunked, and `chunk_row_bytes` per
/// edge of a one-focus chunk (it may stage more), under `cap` bytes. A
/// chunk shorter than a focus holds a multiple of `granule` edges (the
/// cuBLAS gate path's GEMM piece, gate_blas.rs; 1 elsewhere), so that its
/// windows start on the granule's grid.
pub fn plan(
    f: usize,
    e: usize,
    whole_row_bytes: u64,
    chunk_row_bytes: u64,
    granule: usize,
    cap: u64,
) -> Result<Chunking, MixError> {
    let whole = (f as u64).checked_mul(e as u64).and_then(|n| n.checked_mul(whole_row_bytes));
    if whole.is_some_and(|b| b <= cap) || e == 0 {
        return Ok(Chunking::Whole);
    }
    let fit = cap / chunk_row_bytes.max(1);
    if fit >= e as u64 {
        return Ok(Chunking::Chunks { rows: e });
    }
    let granule = granule.max(1) as u64;
    let rows = fit / granule * granule;
    // The smallest chunk: one granule, and no more than MAX_CHUNKS in all
    // (MAX_CHUNKS / F per focus).
    let per_focus = (MAX_CHUNKS / (f as u64).max(1)).max(1);
    let min_rows = (e as u64).div_ceil(per_focus).div_ceil(granule).saturating_mul(granule).min(e as u64);
    // (e >= 1 here, so min_rows >= 1: a cap below one row is refused too.)
    if rows < min_rows {
        return Err(MixError::ScratchCap { cap, min_rows, row_bytes: chunk_row_bytes });
    }
    Ok(Chunking::Chunks { rows: rows as usize })
}

/// The windows `[e0, e0 + rows)` of a chunked walk over `e` edges.
pub fn windows(e: usize, rows: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..e).step_by(rows.max(1)).map(move |e0| (e0, rows.min(e - e0)))
}
