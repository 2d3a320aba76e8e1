//! Stage 2: the cross product of stages x dtypes x Cf x tiles, pruned by cheap
//! static checks (logged with the reason), each instance with its canonical
//! name (crate::kinds::canonical_name).

use super::layout::{b_panel, layout, Layout};
use super::spec::{BlockK, Kind, SmemBuf, SpecError, Specs};
use crate::kinds::{canonical_name, Arch, Dtype, Geometry, Pipe, Stage, Variant};

#[derive(Debug, Clone)]
pub struct Instance {
    pub name: String,
    pub stage: Stage,
    pub variant: Variant,
    pub kind: Kind,
    pub dtype: Dtype,
    pub cf: u32,
    pub geometry: Geometry,
    pub layout: Layout,
    /// The archs it is built for, oldest first: its tile's (else every
    /// target), less those whose shared memory it exceeds at the smallest lmax.
    pub archs: Vec<Arch>,
    /// Device function in templates/stages.cuh and its extra template argument.
    pub body: String,
    pub seg: Option<u32>,
    pub params: Vec<String>,
    pub doc: String,
    /// Named by a tiles.yaml default without a GPU.
    pub is_default: bool,
    /// The GPUs whose tiles.yaml default names it.
    pub gpu_defaults: Vec<String>,
}

impl Instance {
    pub fn threads(&self) -> u32 {
        self.geometry.threads()
    }
}

/// An instance dropped before compiling, and why.
#[derive(Debug, Clone)]
pub struct Pruned {
    pub name: String,
    pub reason: String,
}

pub struct Expansion {
    pub instances: Vec<Instance>,
    pub pruned: Vec<Pruned>,
}

/// `only`: comma-separated substrings; an instance is kept if its name
/// contains all of them (MIXSTACK_ONLY, for quick development builds).
/// Two instances with one name are an error (the spec checks reject the
/// entries that would make them; this guards the rule itself).
pub fn expand(specs: &Specs, only: Option<&str>) -> Result<Expansion, SpecError> {
    let filters: Vec<&str> =
        only.map(|s| s.split(',').map(str::trim).filter(|f| !f.is_empty()).collect()).unwrap_or_default();
    let lmax_min = specs.stages.lmax.min;
    let mut out = Expansion { instances: Vec::new(), pruned: Vec::new() };
    let mut names = std::collections::BTreeSet::new();
    for st in &specs.stages.stages {
        for &dtype in &st.dtypes {
            for &cf in &st.cf {
                for (geometry, tile_archs) in geometries(specs, st.kind, &st.tiles, dtype, cf) {
                    let name = canonical_name(st.name, dtype, cf, &geometry);
                    if !names.insert(name.clone()) {
                        let set = match st.kind {
                            Kind::Gemm => format!("gemm.{}", st.tiles),
                            Kind::Rows => format!("rows.{}", st.tiles),
                        };
                        return Err(specs.invalid("tiles.yaml", set, format!("two instances named {name}")));
                    }
                    if !filters.iter().all(|f| name.contains(f)) {
                        continue;
                    }
                    let lay = layout(&st.smem, dtype, cf, &geometry, st.variant);
                    if let Some(reason) = prune_reason(st.variant, cf, &geometry) {
                        out.pruned.push(Pruned { name, reason });
                        continue;
                    }
                    // The relay's wgmma B panel takes the per-LG region (layout.rs).
                    if b_panel(&geometry, st.variant)
                        && st.smem.iter().any(|b| !matches!(b, SmemBuf::ATile | SmemBuf::BTile))
                    {
                        let reason = "pipe: wgmma's B panel takes the per-LG shared memory: a_tile and b_tile only";
                        out.pruned.push(Pruned { name, reason: reason.into() });
                        continue;
                    }
                    // Shared memory grows with lmax: an arch is dropped only if
                    // the instance cannot run there even at the smallest lmax;
                    // dispatch skips it where it does not fit.
                    let smem = lay.bytes(cf, lmax_min);
                    let (archs, dropped): (Vec<Arch>, Vec<Arch>) =
                        tile_archs.iter().copied().partition(|a| smem <= a.max_smem());
                    if archs.is_empty() {
                        let most = tile_archs.iter().map(|a| a.max_smem()).max().unwrap_or(0);
                        let reason = format!("{smem} bytes of shared memory at lmax {lmax_min} > {most}");
                        out.pruned.push(Pruned { name, reason });
                        continue;
                    }
                    for a in dropped {
                        let max = a.max_smem();
                        let reason =
                            format!("not built for {a}: {smem} bytes of shared memory at lmax {lmax_min} > {max}");
                        out.pruned.push(Pruned { name: name.clone(), reason });
                    }
                    let names_this = |d: &&crate::spec::DefaultSpec| {
                        d.stage == st.name && d.dtype == dtype && d.cf == cf && d.tile == geometry.tag()
                    };
                    let defaults = specs.tiles.defaults.iter().filter(names_this);
                    let is_default = defaults.clone().any(|d| d.gpu.is_none());
                    let gpu_defaults: Vec<String> = defaults.filter_map(|d| d.gpu.clone()).collect();
                    out.instances.push(Instance {
                        name,
                        stage: st.name,
                        variant: st.variant,
                        kind: st.kind,
                        dtype,
                        cf,
                        geometry,
                        layout: lay,
                        archs,
                        body: st.body.clone(),
                        seg: st.seg,
                        params: st.params.clone(),
                        doc: st.doc.clone(),
                        is_default,
                        gpu_defaults,
                    });
                }
            }
        }
    }
    Ok(out)
}

/// The tiles of `set` for (dtype, cf), each with the archs it is built for.
fn geometries(specs: &Specs, kind: Kind, set: &str, dtype: Dtype, cf: u32) -> Vec<(Geometry, Vec<Arch>)> {
    let mut v = Vec::new();
    match kind {
        Kind::Gemm => {
            for t in specs.tiles.gemm.get(set).into_iter().flatten() {
                if t.dtypes.contains(&dtype) && t.cf.contains(&cf) {
                    let block_k = match t.block_k {
                        BlockK::Fixed(k) => k,
                        BlockK::Named(_) => cf,
                    };
                    v.push((t.geometry(block_k), specs.archs_of(t.archs.as_deref())));
                }
            }
        }
        Kind::Rows => {
            for t in specs.tiles.rows.get(set).into_iter().flatten() {
                if t.dtypes.contains(&dtype) && t.cf.contains(&cf) {
                    let g = Geometry::Rows { rows: t.rows, threads: t.threads, min_blocks: t.min_blocks };
                    v.push((g, specs.archs_of(t.archs.as_deref())));
                }
            }
        }
    }
    v
}

/// Why a tile cannot serve a stage at this Cf, on any arch.
fn prune_reason(variant: Variant, cf: u32, g: &Geometry) -> Option<String> {
    if let Geometry::Gemm { block_k, bn, pipe, .. } = *g {
        if variant == Variant::Fused && !pipe.persistent() {
            return Some("the fused backward streams: it needs pipe: stream, ws, split, wgmma or split_wgmma".into());
        }
        if variant != Variant::Fused && pipe.has_producers() {
            return Some("pipe: ws, split and split_wgmma serve the fused backward only".into());
        }
        if variant == Variant::Fused && pipe.wgmma() && g.rows() > 128 {
            return Some("the fused wgmma walks run one or two warpgroups of 64 rows: block_m 64 or 128".into());
        }
        if variant == Variant::Fused && pipe.wgmma() && bn != 64 {
            return Some("the fused wgmma walks multiply 64-column tiles: bn 64".into());
        }
        let sub = super::layout::GLOG_SUB_ROWS;
        if variant == Variant::Fused && g.rows() > sub && !g.rows().is_multiple_of(sub) {
            return Some(format!(
                "the fused backward forms g_logit {sub} rows at a time: BLOCK_M must be a multiple of {sub}"
            ));
        }
        // K (M0 or M1) is a multiple of Cf; a K chunk must not straddle it.
        if block_k == 0 || !cf.is_multiple_of(block_k) {
            return Some(format!("BLOCK_K {block_k} does not divide Cf {cf}"));
        }
        // The K-chunk prefetch gives every thread the same number of loads.
        let (threads, bm, bn, pipe) = match *g {
            Geometry::Gemm { block_m, bn, pipe, .. } => (g.threads(), block_m, bn, pipe),
            _ => unreachable!(),
        };
        let (a_chunk, b_chunk) = (bm as u64 * block_k as u64, block_k as u64 * bn as u64);
        if pipe == Pipe::Regs && (!a_chunk.is_multiple_of(threads as u64) || !b_chunk.is_multiple_of(threads as u64)) {
            return Some(format!(
                "{threads} threads do not divide the A ({bm}x{block_k}) and B ({block_k}x{bn}) chunks"
            ));
        }
    }
    None
}
