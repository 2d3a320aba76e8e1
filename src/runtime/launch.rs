//! Launch geometry, lazy module loading, and the launch itself.
//!
//! Geometry follows docs/KERNELS.md: GEMM-like stages get
//! `(BLOCK_M/TM)*(BN/TN)` threads and a `(ceil(E/BLOCK_M), ceil(N/BN), F)`
//! grid; row-wise stages `THREADS` threads and `(ceil(E/ROWS), 1, F)`.
//! Dynamic shared memory is `smem_fixed + smem_per_lg * L*Cf` bytes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::sys::{CUdevice_attribute, CUdeviceptr, CUevent_flags, CUfunction_attribute};
use cudarc::driver::{CudaContext, CudaEvent, CudaFunction, CudaModule, CudaStream, LaunchConfig};
use cudarc::nvrtc::Ptx;

use super::args::StageCall;
use super::error::{DriverContext, MixError};
use super::table::{Geometry, KernelEntry, Pipe, Stage};

/// Dynamic shared memory a kernel gets without opting in.
pub const DEFAULT_DYNAMIC_SMEM: u64 = 48 * 1024;
/// `gridDim.x` limit.
pub const MAX_GRID_X: u64 = (1 << 31) - 1;
/// `gridDim.y` / `gridDim.z` limit.
pub const MAX_GRID_YZ: u64 = 65_535;
/// Threads per block limit.
pub const MAX_THREADS: u32 = 1024;

/// Launch configuration of `entry` for `e` edges, `n` output columns (GEMM
/// stages; ignored for row-wise ones; 0 for a GEMM stage that walks whole
/// row blocks, the fused backward), `f` focus streams and gate width `lg`.
/// `resident`: how many blocks of this kernel the device holds at once, if
/// known; a `pipe: stream` or `ws` kernel walks its tiles with at most that many
/// blocks (split over the `f` focus streams), else one block per tile.
/// Pure: checks the entry's own consistency and the grid limits.
pub fn launch_config(
    entry: &KernelEntry,
    e: usize,
    n: usize,
    f: usize,
    lg: usize,
    resident: Option<u64>,
) -> Result<LaunchConfig, MixError> {
    let bad = |why: String| MixError::TableInconsistent { kernel: entry.name, why };
    let (threads, gx, gy) = match entry.geometry {
        Geometry::Gemm { block_m, bn, tm, tn, pipe, .. } => {
            if block_m == 0 || bn == 0 || tm == 0 || tn == 0 || block_m % tm != 0 || bn % tn != 0 {
                return Err(bad(format!("GEMM tile {block_m}x{bn} with thread tile {tm}x{tn}")));
            }
            let t = entry.geometry.threads();
            if t != entry.threads {
                return Err(bad(format!("the tile's {t} threads but the entry's {}", entry.threads)));
            }
            // One flat x dimension, column blocks fastest: the blocks that
            // read the same A rows run together and share them through L2.
            let col_tiles = if n == 0 { 1 } else { (n as u64).div_ceil(bn as u64) };
            let tiles = (e as u64).div_ceil(block_m as u64) * col_tiles;
            let blocks = match resident {
                Some(r) if pipe.persistent() => {
                    let b = tiles.min((r / f.max(1) as u64).max(1));
                    // The relay's pipe wgmma splits a column tile's B into
                    // shared memory once per block, again whenever the
                    // block's column tile changes: a multiple of the column
                    // tiles keeps each block on one. (The fused walk is
                    // launched with n = 0: one column tile, no change.)
                    if pipe == Pipe::Wgmma && b > col_tiles {
                        b / col_tiles * col_tiles
                    } else {
                        b
                    }
                }
                _ => tiles,
            };
            (t, blocks, 1)
        }
        Geometry::Rows { rows, threads, .. } => {
            if rows == 0 {
                return Err(bad("ROWS = 0".into()));
            }
            if threads != entry.threads {
                return Err(bad(format!("geometry threads {threads} but entry threads {}", entry.threads)));
            }
            (threads, (e as u64).div_ceil(rows as u64), 1)
        }
    };
    if threads == 0 || threads > MAX_THREADS {
        return Err(bad(format!("{threads} threads per block")));
    }
    let grid = (gx, gy, f as u64);
    if gx > MAX_GRID_X || gy > MAX_GRID_YZ || grid.2 > MAX_GRID_YZ {
        return Err(MixError::GridTooLarge {
            kernel: entry.name,
            e: e as u64,
            grid,
            limit: (MAX_GRID_X, MAX_GRID_YZ, MAX_GRID_YZ),
        });
    }
    let smem = dynamic_smem(entry, lg);
    let smem = u32::try_from(smem).map_err(|_| MixError::SharedMemory {
        kernel: entry.name,
        bytes: smem,
        limit: u32::MAX as u64,
    })?;
    Ok(LaunchConfig { grid_dim: (gx as u32, gy as u32, f as u32), block_dim: (threads, 1, 1), shared_mem_bytes: smem })
}

/// Dynamic shared bytes of `entry` at gate width `lg` = L*Cf:
/// `smem_fixed + smem_per_lg * lg`.
pub fn dynamic_smem(entry: &KernelEntry, lg: usize) -> u64 {
    entry.smem_fixed as u64 + entry.smem_per_lg as u64 * lg as u64
}

/// What one profiled launch ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Launched {
    /// A generated kernel, by its canonical name.
    Kernel(&'static str),
    /// A library call (cuBLAS's gate GEMMs), by its label.
    Library(&'static str),
}

impl Launched {
    /// The canonical name, for a generated kernel.
    pub fn kernel(self) -> Option<&'static str> {
        match self {
            Launched::Kernel(name) => Some(name),
            Launched::Library(_) => None,
        }
    }
}

impl std::fmt::Display for Launched {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Launched::Kernel(name) | Launched::Library(name) => f.write_str(name),
        }
    }
}

/// Per-kernel time of one launch, from an event pair around it.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelTiming {
    pub stage: Stage,
    pub ran: Launched,
    pub ms: f32,
}

struct Timed {
    stage: Stage,
    ran: Launched,
    start: CudaEvent,
    end: CudaEvent,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Loaded functions of one stack (one context, one L*Cf), loaded lazily once
/// per entry, plus the optional profiler.
pub(crate) struct Kernels {
    ctx: Arc<CudaContext>,
    lg: usize,
    /// Loaded function and how many of its blocks the device holds at once.
    cache: Mutex<HashMap<&'static str, (CudaFunction, u64)>>,
    /// `Some` while profiling: event pairs of launches not yet collected.
    profile: Mutex<Option<Vec<Timed>>>,
    /// Injected faults (tests): allocations and launches of this stack.
    pub(crate) fault: super::fault::FaultPoint,
    /// Tests and sanitizers: at most this many blocks of a persistent kernel
    /// (0: the resident count), so a small E walks many tiles per block.
    pub(crate) block_cap: AtomicU64,
}

impl Kernels {
    pub(crate) fn new(ctx: Arc<CudaContext>, lg: usize) -> Self {
        Kernels {
            ctx,
            lg,
            cache: Mutex::new(HashMap::new()),
            profile: Mutex::new(None),
            fault: Default::default(),
            block_cap: AtomicU64::new(0),
        }
    }

    /// Names of the entries loaded so far.
    pub(crate) fn loaded(&self) -> Vec<&'static str> {
        let mut v: Vec<_> = lock(&self.cache).keys().copied().collect();
        v.sort_unstable();
        v
    }

    pub(crate) fn set_profiling(&self, on: bool) {
        let mut p = lock(&self.profile);
        match (on, p.is_some()) {
            (true, false) => *p = Some(Vec::new()),
            (false, true) => *p = None,
            _ => {}
        }
    }

    /// Collect (and clear) the timings recorded so far; waits for them.
    pub(crate) fn take_timings(&self) -> Result<Vec<KernelTiming>, MixError> {
        let recorded = match lock(&self.profile).as_mut() {
            Some(v) => std::mem::take(v),
            None => return Ok(Vec::new()),
        };
        recorded
            .into_iter()
            .map(|t| {
                let ms = t.start.elapsed_ms(&t.end).during(|| format!("timing {}", t.ran))?;
                Ok(KernelTiming { stage: t.stage, ran: t.ran, ms })
            })
            .collect()
    }

    fn load_module(&self, entry: &'static KernelEntry) -> Result<Arc<CudaModule>, MixError> {
        let mut cubin_err = None;
        if let Some(cubin) = entry.cubin {
            match self.ctx.load_module(Ptx::from_binary(cubin.to_vec())) {
                Ok(m) => return Ok(m),
                // e.g. a device of another architecture: fall back to the PTX.
                Err(e) => cubin_err = Some(e),
            }
        }
        if entry.ptx.is_empty() || entry.ptx.contains('\0') {
            let why = if entry.ptx.is_empty() { "has no PTX" } else { "has a NUL byte in its PTX" };
            return match cubin_err {
                Some(e) => Err(MixError::driver(
                    format!(
                        "loading the {} cubin of {} (which {why})",
                        entry.arch.target(entry.geometry.arch_specific()),
                        entry.name
                    ),
                    e,
                )),
                None => Err(MixError::TableInconsistent { kernel: entry.name, why: format!("no cubin and {why}") }),
            };
        }
        self.ctx.load_module(Ptx::from_src(entry.ptx)).during(|| match &cubin_err {
            Some(c) => format!("loading the PTX of {} (its cubin failed too: {c})", entry.name),
            None => format!("loading the PTX of {}", entry.name),
        })
    }

    /// The loaded function of `entry` (loads its module on first use and
    /// opts in to more than 48 KiB of dynamic shared memory where needed),
    /// with the number of its blocks resident on the whole device at once.
    pub(crate) fn function(&self, entry: &'static KernelEntry) -> Result<(CudaFunction, u64), MixError> {
        let mut cache = lock(&self.cache);
        if let Some(f) = cache.get(entry.name) {
            return Ok(f.clone());
        }
        if entry.name.contains('\0') {
            return Err(MixError::TableInconsistent { kernel: entry.name, why: "NUL byte in the name".into() });
        }
        let module = self.load_module(entry)?;
        let func =
            module.load_function(entry.name).during(|| format!("looking up entry `{}` in its module", entry.name))?;
        let smem = dynamic_smem(entry, self.lg);
        if smem > DEFAULT_DYNAMIC_SMEM {
            let optin = self
                .ctx
                .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
                .during(|| "querying the opt-in shared memory limit".into())? as u64;
            let total = smem + entry.smem_static as u64;
            if total > optin {
                return Err(MixError::SharedMemory { kernel: entry.name, bytes: total, limit: optin });
            }
            self.ctx.bind_to_thread().during(|| "binding the context".into())?;
            func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
                .during(|| format!("setting {} bytes of dynamic shared memory on {}", smem, entry.name))?;
        }
        let per_sm = func
            .occupancy_max_active_blocks_per_multiprocessor(entry.threads, smem as usize, None)
            .during(|| format!("querying the occupancy of {}", entry.name))?;
        let sms = self
            .ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .during(|| "querying the multiprocessor count".into())?;
        let resident = per_sm.max(1) as u64 * sms.max(1) as u64;
        cache.insert(entry.name, (func.clone(), resident));
        Ok((func, resident))
    }

    /// Launch `entry` on `stream` over `e` edges and `n` output columns with
    /// the arguments of its stage (`call` of another stage is refused).
    pub(crate) fn launch(
        &self,
        stream: &CudaStream,
        entry: &'static KernelEntry,
        e: usize,
        n: usize,
        f: usize,
        call: &StageCall<CUdeviceptr>,
    ) -> Result<(), MixError> {
        if call.stage() != entry.stage {
            return Err(MixError::TableInconsistent {
                kernel: entry.name,
                why: format!("launched with the arguments of stage {}", call.stage()),
            });
        }
        let (func, resident) = self.function(entry)?;
        let resident = match self.block_cap.load(Ordering::Relaxed) {
            0 => resident,
            cap => resident.min(cap),
        };
        let cfg = launch_config(entry, e, n, f, self.lg, Some(resident))?;
        self.fault.launch(|| entry.name.to_string())?;
        let profiling = lock(&self.profile).is_some();
        let mut b = stream.launch_builder(&func);
        call.push(&mut b);
        if profiling {
            b.record_kernel_launch(CUevent_flags::CU_EVENT_DEFAULT);
        }
        // SAFETY: the arguments are the stage's, in its signature's order
        // (generated from the same spec as the kernel), and every pointer
        // addresses a buffer of the size the contract implies (the plan).
        let events = unsafe { b.launch(cfg) }.during(|| {
            format!(
                "launching {} (grid {:?}, block {:?}, {} B dynamic shared)",
                entry.name, cfg.grid_dim, cfg.block_dim, cfg.shared_mem_bytes
            )
        })?;
        if let Some((start, end)) = events {
            if let Some(v) = lock(&self.profile).as_mut() {
                v.push(Timed { stage: entry.stage, ran: Launched::Kernel(entry.name), start, end });
            }
        }
        Ok(())
    }

    /// Run `work` (a library call on `stream`, e.g. cuBLAS), profiled like
    /// a launch: under `stage`, named `name`.
    pub(crate) fn external(
        &self,
        stream: &CudaStream,
        stage: Stage,
        name: &'static str,
        work: impl FnOnce() -> Result<(), MixError>,
    ) -> Result<(), MixError> {
        self.fault.launch(|| name.to_string())?;
        if lock(&self.profile).is_none() {
            return work();
        }
        let ctx = stream.context();
        let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let start = ctx.new_event(flags).during(|| format!("creating a timing event for {name}"))?;
        let end = ctx.new_event(flags).during(|| format!("creating a timing event for {name}"))?;
        start.record(stream).during(|| format!("recording a timing event for {name}"))?;
        work()?;
        end.record(stream).during(|| format!("recording a timing event for {name}"))?;
        if let Some(v) = lock(&self.profile).as_mut() {
            v.push(Timed { stage, ran: Launched::Library(name), start, end });
        }
        Ok(())
    }
}
