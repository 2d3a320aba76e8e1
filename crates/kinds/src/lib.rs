//! The vocabulary shared by the generator (build.rs) and the runtime:
//! stages, variants, dtypes. One spelling each, used in specs, canonical
//! names, reports and the generated table.

use serde::{Deserialize, Serialize};
use std::fmt;

/// One pipeline stage of the stack (see docs/KERNELS.md for each contract).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    FwdM0,
    FwdGate,
    FwdGateAct,
    FwdM1,
    FwdFinal,
    BwdGradAlpha,
    BwdFinal,
    BwdRecompute,
    BwdPointwise,
    BwdGlogit,
    BwdGemm,
    BwdFused,
}

impl Stage {
    pub const ALL: [Stage; 12] = [
        Stage::FwdM0,
        Stage::FwdGate,
        Stage::FwdGateAct,
        Stage::FwdM1,
        Stage::FwdFinal,
        Stage::BwdGradAlpha,
        Stage::BwdFinal,
        Stage::BwdRecompute,
        Stage::BwdPointwise,
        Stage::BwdGlogit,
        Stage::BwdGemm,
        Stage::BwdFused,
    ];
    /// The spelling used in specs, canonical names and reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::FwdM0 => "fwd_m0",
            Stage::FwdGate => "fwd_gate",
            Stage::FwdGateAct => "fwd_gate_act",
            Stage::FwdM1 => "fwd_m1",
            Stage::FwdFinal => "fwd_final",
            Stage::BwdGradAlpha => "bwd_grad_alpha",
            Stage::BwdFinal => "bwd_final",
            Stage::BwdRecompute => "bwd_recompute",
            Stage::BwdPointwise => "bwd_pointwise",
            Stage::BwdGlogit => "bwd_glogit",
            Stage::BwdGemm => "bwd_gemm",
            Stage::BwdFused => "bwd_fused",
        }
    }
    pub fn parse(s: &str) -> Option<Stage> {
        Stage::ALL.into_iter().find(|st| st.as_str() == s)
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The pass a stage belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Pass {
    Forward,
    Backward,
}

/// The layers a stage is launched for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Layers {
    /// Gated layers only: not needed when n_layers == 1.
    Gated,
    /// Every call (the identity layer, grad_alpha).
    All,
}

/// Where a stage serves, as to the gate GEMMs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Serves {
    Always,
    /// Only where cuBLAS runs the gate GEMMs (it finishes their work); a
    /// stack without cuBLAS runs without it.
    CublasGate,
    /// Where the generated kernels run the gate GEMMs.
    GeneratedGate,
}

/// A stage's role, from specs/stages.yaml (generated into the kernel table).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageRole {
    pub stage: Stage,
    pub variant: Variant,
    pub pass: Pass,
    pub layers: Layers,
    pub serves: Serves,
}

/// Where the switch's "on" takes the fused backward (stages.yaml
/// `regime.fused_faster`, generated into the kernel table): Cf, an inclusive
/// lmax range, the mode it was measured in, and the GPU (a part of the
/// device name; `None`: every GPU without entries of its own).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct FusedFaster {
    pub cf: u32,
    pub lmax: (u32, u32),
    pub precision: Precision,
    pub gpu: Option<&'static str>,
}

/// Whether `list` puts (cf, lmax) in `precision` in the measured regime on
/// `device` (its name; `None`: no GPU in particular); `lmax` `None`: at any
/// lmax. A device with entries of its own (`gpu_matches`; every matching
/// key counts) is judged by those only, any other by the generic ones.
pub fn fused_faster(
    list: &[FusedFaster],
    precision: Precision,
    cf: u32,
    lmax: Option<u32>,
    device: Option<&str>,
) -> bool {
    let own = |x: &FusedFaster| matches!((x.gpu, device), (Some(k), Some(d)) if gpu_matches(k, d));
    let has_own = list.iter().any(own);
    list.iter()
        .filter(|x| if has_own { own(x) } else { x.gpu.is_none() })
        .any(|x| x.precision == precision && x.cf == cf && lmax.is_none_or(|l| (x.lmax.0..=x.lmax.1).contains(&l)))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Variant {
    Relay,
    Fused,
}

impl Variant {
    pub fn as_str(self) -> &'static str {
        match self {
            Variant::Relay => "relay",
            Variant::Fused => "fused",
        }
    }
    pub fn parse(s: &str) -> Option<Variant> {
        [Variant::Relay, Variant::Fused].into_iter().find(|v| v.as_str() == s)
    }
}

impl fmt::Display for Variant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    F32,
    F64,
}

impl Dtype {
    pub fn as_str(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::F64 => "f64",
        }
    }
    pub fn parse(s: &str) -> Option<Dtype> {
        [Dtype::F32, Dtype::F64].into_iter().find(|d| d.as_str() == s)
    }
    /// The CUDA C type of this dtype.
    pub fn c_type(self) -> &'static str {
        match self {
            Dtype::F32 => "float",
            Dtype::F64 => "double",
        }
    }
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F64 => 8,
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a GEMM's K loop feeds shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Pipe {
    /// Loads staged through registers (`stages` 1 or 2), A stored k-major.
    Regs,
    /// cp.async pipeline of `stages` (2..4) chunks, A stored row-major; the A
    /// operand goes async where it is a plain surface, else it is computed.
    Async,
    /// Persistent blocks walking many tiles through one cp.async ring of
    /// `stages` (2..4) chunks that does not drain between tiles; epilogue
    /// straight from registers. Launched with at most the resident blocks.
    Stream,
    /// Warp-specialised persistent blocks (the fused backward only): besides
    /// the (BLOCK_M/TM)*(BN/TN) consumer threads that run the GEMM from a
    /// whole row block's A panel in shared memory (B through a ring of
    /// `stages` chunks), [`WS_PRODUCER_THREADS`] producer threads form the
    /// next row block's panel. Launched as `Stream` is.
    Ws,
    /// `Stream`'s walk (gz formed per chunk from the A ring) with the per-row
    /// work on [`WS_PRODUCER_THREADS`] producer threads (the fused backward
    /// only): they run it for the next row block into one of two per-row
    /// buffer sets while the (BLOCK_M/TM)*(BN/TN) consumer threads run the
    /// GEMM. Launched as `Stream` is.
    Split,
    /// The fp16x3 products on Hopper's warpgroup MMA (wgmma, sm_90a), a
    /// warpgroup per 64 rows. The relay's GEMMs: `Stream`'s persistent walk,
    /// a warpgroup per 64 rows each with its own cp.async ring of A chunks, the
    /// block's column tile of B split once into a shared-memory panel
    /// (templates/core.cuh: gemm_wg). The fused backward: `Stream`'s row-block
    /// walk, each B chunk split into fp16 halves in shared memory by the
    /// threads that copied it (gemm_rowblock).
    Wgmma,
    /// `Split`'s walk with the fp16x3 products on Hopper's warpgroup MMA
    /// (the fused backward only, sm_90a): a consumer warpgroup per 64 rows;
    /// each B chunk is split into fp16 halves in shared memory by the
    /// threads that copied it (templates/core.cuh: gemm_rowblock).
    #[serde(rename = "split_wgmma")]
    SplitWgmma,
}

/// Producer threads of a `pipe: ws`, `split` or `split_wgmma` block (four warps: one
/// per scheduler; one warpgroup, as `setmaxnreg` needs).
pub const WS_PRODUCER_THREADS: u32 = 128;

/// 32-bit registers per SM (every arch built).
pub const REGISTER_FILE: u64 = 65_536;

impl Pipe {
    pub fn tag(self) -> &'static str {
        match self {
            Pipe::Regs => "pr",
            Pipe::Async => "pa",
            Pipe::Stream => "ps",
            Pipe::Ws => "pw",
            Pipe::Split => "px",
            Pipe::Wgmma => "pg",
            Pipe::SplitWgmma => "pxg",
        }
    }
    /// Whether blocks are persistent and walk many tiles (launched with at
    /// most the resident blocks). The fused backward needs one (expand.rs
    /// prunes the rest).
    pub fn persistent(self) -> bool {
        matches!(self, Pipe::Stream | Pipe::Ws | Pipe::Split | Pipe::Wgmma | Pipe::SplitWgmma)
    }
    /// Whether the block has producer threads besides the GEMM's.
    pub fn has_producers(self) -> bool {
        matches!(self, Pipe::Ws | Pipe::Split | Pipe::SplitWgmma)
    }
    /// Whether the block products run on Hopper's warpgroup MMA (sm_90a).
    pub fn wgmma(self) -> bool {
        matches!(self, Pipe::Wgmma | Pipe::SplitWgmma)
    }
    /// The value of the kernels' PIPE template argument.
    pub fn code(self) -> u32 {
        match self {
            Pipe::Regs => 0,
            Pipe::Async => 1,
            Pipe::Stream => 2,
            Pipe::Ws => 3,
            Pipe::Split => 4,
            Pipe::Wgmma => 5,
            Pipe::SplitWgmma => 6,
        }
    }
}

/// The arithmetic of a GEMM tile's block products (docs/PRECISION.md).
/// Every pointwise value stays the exact operator sequences of ops.yaml in
/// either mode; only the block GEMMs change.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// fp32 FFMA (f64: DFMA), k ascending: the reference arithmetic.
    #[default]
    Exact,
    /// Compensated tensor-core products: each fp32 operand split into an
    /// fp16 head and an fp16 tail (scaled by 2^11), three fp16 products per
    /// K step accumulated in fp32 (mma.sync m16n8k16), with a power-of-two
    /// scale per (row, K chunk) of A.
    Fp16x3,
}

impl Precision {
    pub const ALL: [Precision; 2] = [Precision::Exact, Precision::Fp16x3];
    /// A mode by its name ([`Precision::as_str`]), case-insensitive.
    pub fn parse(name: &str) -> Option<Precision> {
        Self::ALL.into_iter().find(|p| p.as_str().eq_ignore_ascii_case(name))
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Precision::Exact => "exact",
            Precision::Fp16x3 => "fp16x3",
        }
    }
    /// The largest |operand| the mode's unscaled operand (the weights, B)
    /// keeps finite: fp16's largest finite value for fp16x3; none for exact.
    pub fn max_abs_operand(self) -> Option<f64> {
        match self {
            Precision::Exact => None,
            Precision::Fp16x3 => Some(65504.0),
        }
    }
    /// The value of the kernels' PREC template argument.
    pub fn code(self) -> u32 {
        match self {
            Precision::Exact => 0,
            Precision::Fp16x3 => 1,
        }
    }
    /// The suffix of a tile's name part: none for exact, so that every
    /// exact instance keeps its name.
    pub fn tag(self) -> &'static str {
        match self {
            Precision::Exact => "",
            Precision::Fp16x3 => "_x3",
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a stage is launched (docs/KERNELS.md "Launch geometry").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Geometry {
    /// A BLOCK_M x BN output tile per block, (BLOCK_M/TM)*(BN/TN) threads
    /// (plus the producers with `pipe: ws`).
    /// `stages`: shared-memory stages of the K loop (2: the next chunk is
    /// loaded while this one computes); `min_blocks`: the second argument of
    /// `__launch_bounds__` (>1 caps registers for occupancy).
    /// `precision`: the block products' arithmetic. `regs` (pipe: split,
    /// sm_90; 0: none): the consumer threads' registers, which `setmaxnreg`
    /// moves from the producer warpgroup ([`Geometry::setmaxnreg`]).
    Gemm {
        block_m: u32,
        bn: u32,
        block_k: u32,
        tm: u32,
        tn: u32,
        stages: u32,
        min_blocks: u32,
        pipe: Pipe,
        precision: Precision,
        regs: u32,
    },
    /// ROWS edges per block, THREADS threads; `min_blocks` as for Gemm.
    Rows { rows: u32, threads: u32, min_blocks: u32 },
}

/// The threads that run a GEMM tile (tiles.yaml's check and
/// [`Geometry::consumer_threads`]): one per (tm x tn) piece of the tile, or
/// with pipe wgmma and split_wgmma a warpgroup per 64 rows, whatever the
/// columns (gemm_wg runs bn / 64 tiles of 64). u64: a spec's numbers may be
/// anything.
pub fn gemm_threads(block_m: u32, bn: u32, tm: u32, tn: u32, pipe: Pipe) -> u64 {
    if pipe.wgmma() {
        2 * block_m as u64
    } else {
        (block_m / tm.max(1)) as u64 * (bn / tn.max(1)) as u64
    }
}

impl Geometry {
    pub fn threads(&self) -> u32 {
        match *self {
            Geometry::Gemm { pipe, .. } if pipe.has_producers() => self.consumer_threads() + WS_PRODUCER_THREADS,
            _ => self.consumer_threads(),
        }
    }
    /// A GEMM tile's pipe (row stages: none).
    pub fn pipe(&self) -> Option<Pipe> {
        match *self {
            Geometry::Gemm { pipe, .. } => Some(pipe),
            Geometry::Rows { .. } => None,
        }
    }
    /// The threads that run the block's GEMM, one (tm x tn) piece of the
    /// tile each (pipe ws / split: the consumers); a row stage's threads.
    pub fn consumer_threads(&self) -> u32 {
        match *self {
            Geometry::Gemm { block_m, bn, tm, tn, pipe, .. } => {
                gemm_threads(block_m, bn, tm, tn, pipe).try_into().unwrap_or(u32::MAX)
            }
            Geometry::Rows { threads, .. } => threads,
        }
    }
    /// The block products' arithmetic (row stages: exact).
    pub fn precision(&self) -> Precision {
        match *self {
            Geometry::Gemm { precision, .. } => precision,
            Geometry::Rows { .. } => Precision::Exact,
        }
    }
    /// The K chunk of a GEMM tile (in fp16x3 part of the arithmetic); none
    /// for a row stage.
    pub fn block_k(&self) -> Option<u32> {
        match *self {
            Geometry::Gemm { block_k, .. } => Some(block_k),
            Geometry::Rows { .. } => None,
        }
    }
    /// Edges per block.
    pub fn rows(&self) -> u32 {
        match *self {
            Geometry::Gemm { block_m, .. } => block_m,
            Geometry::Rows { rows, .. } => rows,
        }
    }
    /// The registers per thread a block starts with: ptxas's cap from
    /// `__launch_bounds__(threads, min_blocks)` (the register file, 64 K,
    /// shared by min_blocks blocks; 255 at most; whole 8-register steps).
    pub fn launch_regs(&self) -> u32 {
        let min_blocks = match *self {
            Geometry::Gemm { min_blocks, .. } | Geometry::Rows { min_blocks, .. } => min_blocks,
        };
        let per_thread = REGISTER_FILE / (self.threads().max(1) as u64 * min_blocks.max(1) as u64);
        (per_thread.min(255) as u32) / 8 * 8
    }
    /// Fragments per batch of gemm_wg's staged epilogue (pipe: wgmma, the
    /// relay core): their loads issue together, then their stores. By the
    /// register cap ([`Geometry::launch_regs`]): all of a 64-column tile's
    /// eight from 224 (fwd_m1 at block_m 128, one block per SM: 219
    /// registers) where the block holds one tile's accumulators (bn 64), two
    /// from 136 (block_m 192 and three blocks of 64 rows per SM: 168, where
    /// eight spill; bn 128 and 192: 32 more accumulators per tile), one
    /// below (two blocks per SM: 128, where bwd_gemm spills with two).
    /// `None`: not a gemm_wg tile.
    pub fn epi_batch(&self) -> Option<u32> {
        match (*self, self.launch_regs()) {
            (Geometry::Gemm { bn: 64, pipe: Pipe::Wgmma, .. }, r) if r >= 224 => Some(8),
            (Geometry::Gemm { pipe: Pipe::Wgmma, .. }, r) if r >= 136 => Some(2),
            (Geometry::Gemm { pipe: Pipe::Wgmma, .. }, _) => Some(1),
            _ => None,
        }
    }
    /// `setmaxnreg`'s two counts, (producers, consumers), where the tile
    /// sets `regs` (pipe: split, the only walk whose producer warpgroup
    /// gives registers away): the consumers take `regs` each and the producers keep
    /// the rest of the block's registers ([`Geometry::launch_regs`] per
    /// thread), in whole 8-register steps. `None`: ptxas allocates alone.
    pub fn setmaxnreg(&self) -> Option<(u32, u32)> {
        match *self {
            Geometry::Gemm { regs, pipe: Pipe::Split, .. } if regs > 0 => {
                let consumers = self.consumer_threads() as u64;
                let pool = self.launch_regs() as u64 * self.threads() as u64;
                let left = pool.checked_sub(consumers * regs as u64)? / WS_PRODUCER_THREADS as u64;
                Some(((left.min(256) as u32) / 8 * 8, regs))
            }
            _ => None,
        }
    }
    /// Whether the instance uses instructions of its arch's "a" target
    /// (sm_90a: `setmaxnreg`, `wgmma`): its code runs on that compute capability
    /// only, never on a later one through the driver's JIT.
    pub fn arch_specific(&self) -> bool {
        self.setmaxnreg().is_some() || self.pipe().is_some_and(Pipe::wgmma)
    }
    /// The tile part of the canonical name.
    pub fn tag(&self) -> String {
        match *self {
            Geometry::Gemm { block_m, bn, block_k, tm, tn, stages, min_blocks, pipe, precision, regs } => {
                let regs = if regs > 0 { format!("_r{regs}") } else { String::new() };
                format!(
                    "m{block_m}_n{bn}_k{block_k}_t{tm}x{tn}_s{stages}_b{min_blocks}_{}{regs}{}",
                    pipe.tag(),
                    precision.tag()
                )
            }
            Geometry::Rows { rows, threads, min_blocks } => format!("r{rows}_t{threads}_b{min_blocks}"),
        }
    }
}

/// One canonical name per kernel instance, every axis in a fixed order:
/// it is the file name, the `extern "C"` entry, the table key and log key.
pub fn canonical_name(stage: Stage, dtype: Dtype, cf: u32, geometry: &Geometry) -> String {
    name_with_tag(stage, dtype, cf, &geometry.tag())
}

/// [`canonical_name`] from the tile part of the name (as `tiles.yaml`'s
/// `defaults` spell it).
pub fn name_with_tag(stage: Stage, dtype: Dtype, cf: u32, tag: &str) -> String {
    format!("ms_{}_{}_cf{}_{}", stage.as_str(), dtype.as_str(), cf, tag)
}

/// Tile precedence, the one rule of both the build's dispatch table and the
/// runtime's choice: among a key's usable instances, in spec order, the one
/// tiles.yaml names as the key's default, else the first.
pub fn preferred<T: Copy>(usable: impl IntoIterator<Item = T>, is_default: impl Fn(T) -> bool) -> Option<T> {
    preferred_ranked(usable, |c| if is_default(c) { 0 } else { 1 })
}

/// [`preferred`] over a chain of defaults: the usable instance of the lowest
/// rank, the first in spec order among equals (the runtime ranks the
/// device's own default 0, the generic default 1, the rest 2).
pub fn preferred_ranked<T: Copy>(usable: impl IntoIterator<Item = T>, rank: impl Fn(T) -> u8) -> Option<T> {
    let mut best: Option<(u8, T)> = None;
    for c in usable {
        let r = rank(c);
        if best.is_none_or(|(b, _)| r < b) {
            best = Some((r, c));
        }
    }
    best.map(|(_, c)| c)
}

/// Whether a tiles.yaml GPU key names this device: a part of its name,
/// without case ("H200" names "NVIDIA H200").
pub fn gpu_matches(key: &str, device_name: &str) -> bool {
    // Without allocating: it runs in every backward call's path decision.
    let key = key.trim().as_bytes();
    key.is_empty() || device_name.as_bytes().windows(key.len()).any(|w| w.eq_ignore_ascii_case(key))
}

/// A target architecture of the build (stages.yaml `archs`; a tile may
/// narrow it with its own `archs`). Every instance is compiled and
/// register-checked once per arch it targets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize, Serialize)]
pub enum Arch {
    /// Ampere (A100; its cubins also run on sm_86 and sm_89).
    #[serde(rename = "sm_80")]
    Sm80,
    /// Hopper (H100, H200).
    #[serde(rename = "sm_90")]
    Sm90,
}

impl Arch {
    pub const ALL: [Arch; 2] = [Arch::Sm80, Arch::Sm90];
    pub fn as_str(self) -> &'static str {
        match self {
            Arch::Sm80 => "sm_80",
            Arch::Sm90 => "sm_90",
        }
    }
    pub fn parse(s: &str) -> Option<Arch> {
        Arch::ALL.into_iter().find(|a| a.as_str() == s)
    }
    /// Compute capability, major * 10 + minor.
    pub fn cc(self) -> u32 {
        match self {
            Arch::Sm80 => 80,
            Arch::Sm90 => 90,
        }
    }
    /// The most shared memory a block may opt in to on the arch's flagship
    /// (A100: 163 KiB, H100/H200: 227 KiB): the build's limit; at run time
    /// the device's own opt-in limit applies.
    pub fn max_smem(self) -> u32 {
        match self {
            Arch::Sm80 => 163 * 1024,
            Arch::Sm90 => 227 * 1024,
        }
    }
    /// The ptxas target of an instance: the arch, or its "a" variant
    /// (sm_90a) for code that uses arch-specific instructions.
    pub fn target(self, arch_specific: bool) -> &'static str {
        match (self, arch_specific) {
            (Arch::Sm90, true) => "sm_90a",
            (a, _) => a.as_str(),
        }
    }
    /// Which of the `built` archs serves a device of compute capability
    /// `cc` (major * 10 + minor): the newest not newer than the device. Its
    /// cubin runs on later minors of its major; a later major runs its PTX
    /// through the driver's JIT. `None`: the device predates every one.
    pub fn serving(cc: u32, built: &[Arch]) -> Option<Arch> {
        built.iter().copied().filter(|a| a.cc() <= cc).max()
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
