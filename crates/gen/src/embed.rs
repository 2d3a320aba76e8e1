//! Stage 6: what the runtime sees: the Rust kernel table (kernel_table.rs,
//! included by src/runtime/table.rs) and the JSON build manifest.

use super::check::Resources;
use super::expand::{Instance, Pruned};
use crate::kinds::{Arch, Dtype, Geometry, Precision, Stage, Variant};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::PathBuf;

/// An instance after compile and check, on one of its archs.
#[derive(Debug, Clone)]
pub struct Built {
    pub instance: Instance,
    pub arch: Arch,
    pub resources: Resources,
    pub accepted: bool,
    /// Chosen by dispatch for its (stage, dtype, cf) key on its arch.
    pub is_default: bool,
    pub ptx: Option<PathBuf>,
    pub cubin: Option<PathBuf>,
}

/// One row of the manifest (`mixstack report --json` prints these): an
/// instance on one arch.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ManifestInstance {
    pub name: String,
    pub arch: Arch,
    pub stage: Stage,
    pub variant: Variant,
    pub dtype: Dtype,
    /// The block products' arithmetic; absent: exact.
    #[serde(default, skip_serializing_if = "is_exact")]
    pub precision: Precision,
    pub cf: u32,
    /// lmax is a runtime argument of every kernel, not an axis: always null.
    pub lmax: Option<u32>,
    pub block_m: Option<u32>,
    pub bn: Option<u32>,
    pub block_k: Option<u32>,
    pub tm: Option<u32>,
    pub tn: Option<u32>,
    pub rows: Option<u32>,
    pub threads: u32,
    pub registers: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
    pub stack_bytes: u32,
    pub smem_static: u32,
    pub smem_fixed: u32,
    pub smem_per_lg: u32,
    pub accepted: bool,
    pub is_default: bool,
    /// The GPUs whose tiles.yaml default names this instance.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpu_defaults: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct DispatchRow {
    pub arch: Arch,
    pub stage: Stage,
    pub dtype: Dtype,
    /// The mode this row serves; absent: exact.
    #[serde(default, skip_serializing_if = "is_exact")]
    pub precision: Precision,
    pub cf: u32,
    pub lmax: u32,
    pub instance: String,
}

fn is_exact(p: &Precision) -> bool {
    *p == Precision::Exact
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PrunedRow {
    pub name: String,
    pub reason: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    /// Target architectures, oldest first.
    pub archs: Vec<Arch>,
    pub lmax: (u32, u32),
    pub fingerprint: String,
    pub instances: Vec<ManifestInstance>,
    pub dispatch: Vec<DispatchRow>,
    pub pruned: Vec<PrunedRow>,
}

pub fn manifest_instance(b: &Built) -> ManifestInstance {
    let i = &b.instance;
    let (mut block_m, mut bn, mut block_k, mut tm, mut tn, mut rows) = (None, None, None, None, None, None);
    match i.geometry {
        Geometry::Gemm { block_m: m, bn: n, block_k: k, tm: a, tn: c, .. } => {
            (block_m, bn, block_k, tm, tn) = (Some(m), Some(n), Some(k), Some(a), Some(c));
        }
        Geometry::Rows { rows: r, .. } => rows = Some(r),
    }
    let r = &b.resources;
    ManifestInstance {
        name: i.name.clone(),
        arch: b.arch,
        stage: i.stage,
        variant: i.variant,
        dtype: i.dtype,
        precision: i.geometry.precision(),
        cf: i.cf,
        lmax: None,
        block_m,
        bn,
        block_k,
        tm,
        tn,
        rows,
        threads: i.threads(),
        registers: r.registers,
        spill_stores: r.spill_stores,
        spill_loads: r.spill_loads,
        stack_bytes: r.stack_bytes,
        smem_static: r.smem_static,
        smem_fixed: i.layout.fixed,
        smem_per_lg: i.layout.per_lg,
        accepted: b.accepted,
        is_default: b.is_default,
        gpu_defaults: b.instance.gpu_defaults.clone(),
    }
}

#[derive(Debug, thiserror::Error)]
#[error("no accepted {arch} instance serves {stage} {dtype} Cf {cf} lmax {lmax}: every candidate spilled, was pruned, is built for other archs or needs too much shared memory ({candidates}); add a tile for it to specs/tiles.yaml")]
pub struct NoInstance {
    pub arch: Arch,
    pub stage: Stage,
    pub dtype: Dtype,
    pub cf: u32,
    pub lmax: u32,
    pub candidates: String,
}

/// The dispatch table, per arch and (stage, dtype, precision, cf, lmax)
/// key, by the one tile precedence rule (`kinds::preferred`) over the
/// instances accepted on that arch and fitting its shared memory at that
/// lmax. Marks `is_default` on the rows chosen for at least one key. Every
/// exact key a stage serves must get an instance on every arch, except the
/// fused stage's on an arch it has no tile for (the runtime runs the relay
/// there); a compensated mode serves where its tiles are built and fit.
pub fn resolve_dispatch(
    built: &mut [Built],
    archs: &[Arch],
    lmax: (u32, u32),
) -> Result<Vec<(DispatchRow, usize)>, NoInstance> {
    let mut keys: BTreeMap<(Stage, Dtype, Precision, u32), Vec<usize>> = BTreeMap::new();
    for (i, b) in built.iter().enumerate() {
        let x = &b.instance;
        keys.entry((x.stage, x.dtype, x.geometry.precision(), x.cf)).or_default().push(i);
    }
    let mut rows = Vec::new();
    for &arch in archs {
        for (&(stage, dtype, precision, cf), idx) in &keys {
            let optional = built[idx[0]].instance.variant == Variant::Fused || precision != Precision::Exact;
            let on_arch: Vec<usize> = idx.iter().copied().filter(|&i| built[i].arch == arch).collect();
            if on_arch.is_empty() && optional {
                continue;
            }
            for l in lmax.0..=lmax.1 {
                let usable =
                    |i: &usize| built[*i].accepted && built[*i].instance.layout.bytes(cf, l) <= arch.max_smem();
                let pick =
                    crate::kinds::preferred(on_arch.iter().copied().filter(usable), |i| built[i].instance.is_default);
                if pick.is_none() && precision != Precision::Exact {
                    continue;
                }
                let Some(p) = pick else {
                    let names = on_arch.iter().map(|&i| built[i].instance.name.as_str()).collect::<Vec<_>>();
                    let candidates = if names.is_empty() { "none built for it".to_string() } else { names.join(", ") };
                    return Err(NoInstance { arch, stage, dtype, cf, lmax: l, candidates });
                };
                let instance = built[p].instance.name.clone();
                rows.push((DispatchRow { arch, stage, dtype, precision, cf, lmax: l, instance }, p));
            }
        }
    }
    for b in built.iter_mut() {
        b.is_default = false;
    }
    for (_, p) in &rows {
        built[*p].is_default = true;
    }
    Ok(rows)
}

pub fn manifest(
    archs: &[Arch],
    lmax: (u32, u32),
    fingerprint: &str,
    built: &[Built],
    dispatch: Vec<DispatchRow>,
    pruned: &[Pruned],
) -> Manifest {
    Manifest {
        archs: archs.to_vec(),
        lmax,
        fingerprint: fingerprint.to_string(),
        instances: built.iter().map(manifest_instance).collect(),
        dispatch,
        pruned: pruned.iter().map(|p| PrunedRow { name: p.name.clone(), reason: p.reason.clone() }).collect(),
    }
}

/// kernel_table.rs: one `KernelEntry` per instance and arch; for accepted
/// instances the cubin, and the PTX where there is no cubin (snapshot
/// builds) or the arch is the newest target (the driver JITs it for newer
/// GPUs).
pub fn kernel_table(
    built: &[Built],
    archs: &[Arch],
    lmax: (u32, u32),
    source: &str,
    manifest_path: &std::path::Path,
) -> String {
    let newest = archs.iter().copied().max();
    let mut s = String::from("// Generated by build.rs -- do not edit.\npub static KERNELS: &[KernelEntry] = &[\n");
    for b in built {
        let i = &b.instance;
        let r = &b.resources;
        let geometry = match i.geometry {
            Geometry::Gemm { block_m, bn, block_k, tm, tn, stages, min_blocks, pipe, precision, regs } => {
                format!("Geometry::Gemm {{ block_m: {block_m}, bn: {bn}, block_k: {block_k}, tm: {tm}, tn: {tn}, stages: {stages}, min_blocks: {min_blocks}, pipe: Pipe::{pipe:?}, precision: Precision::{precision:?}, regs: {regs} }}")
            }
            Geometry::Rows { rows, threads, min_blocks } => {
                format!("Geometry::Rows {{ rows: {rows}, threads: {threads}, min_blocks: {min_blocks} }}")
            }
        };
        // The cubin is what loads on its own arch; PTX only where there is
        // no cubin or for newer GPUs, which keeps binaries small. `ptx_file`
        // names it.
        let jit = b.cubin.is_none() || Some(b.arch) == newest;
        let ptx = match (&b.ptx, b.accepted && jit) {
            (Some(p), true) => format!("include_str!({:?})", p.display().to_string()),
            _ => "\"\"".to_string(),
        };
        let ptx_file = match (&b.ptx, b.accepted) {
            (Some(p), true) => format!("{:?}", p.display().to_string()),
            _ => "\"\"".to_string(),
        };
        let cubin = match (&b.cubin, b.accepted) {
            (Some(p), true) => format!("Some(include_bytes!({:?}))", p.display().to_string()),
            _ => "None".to_string(),
        };
        let _ = writeln!(
            s,
            "    KernelEntry {{ name: {:?}, arch: Arch::{:?}, stage: Stage::{:?}, variant: Variant::{:?}, dtype: Dtype::{:?}, cf: {}, geometry: {geometry}, threads: {}, smem_fixed: {}, smem_per_lg: {}, registers: {}, spill_stores: {}, spill_loads: {}, stack_bytes: {}, smem_static: {}, accepted: {}, spec_default: {}, gpu_defaults: &{:?}, ptx: {ptx}, ptx_file: {ptx_file}, cubin: {cubin} }},",
            i.name, b.arch, i.stage, i.variant, i.dtype, i.cf, i.threads(), i.layout.fixed, i.layout.per_lg,
            r.registers, r.spill_stores, r.spill_loads, r.stack_bytes, r.smem_static, b.accepted, i.is_default, i.gpu_defaults
        );
    }
    s.push_str("];\n");
    let _ = writeln!(s, "/// The target architectures, oldest first (stages.yaml `archs`).");
    let list = archs.iter().map(|a| format!("Arch::{a:?}")).collect::<Vec<_>>().join(", ");
    let _ = writeln!(s, "pub const ARCHS: &[Arch] = &[{list}];");
    let _ = writeln!(s, "pub const LMAX_RANGE: (u32, u32) = ({}, {});", lmax.0, lmax.1);
    let _ = writeln!(s, "pub const BUILD_SOURCE: &str = {source:?};");
    let _ =
        writeln!(s, "pub const BUILD_MANIFEST_JSON: &str = include_str!({:?});", manifest_path.display().to_string());
    s
}

/// stage_roles.rs: every stage's role and the regime, from stages.yaml, for
/// the runtime's dispatch (no role or threshold is written in Rust).
pub fn stage_roles(specs: &crate::spec::Specs) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ =
        writeln!(s, "// @generated by mixstack-gen (crates/gen/src/embed.rs) from specs/stages.yaml: do not edit.\n");
    let regime = &specs.stages.regime;
    let _ = writeln!(s, "/// The fused backward serves Cf below this (stages.yaml `regime.fused_cf_below`).");
    let _ = writeln!(s, "pub const FUSED_CF_BELOW: u32 = {};", regime.fused_cf_below);
    let _ = writeln!(s, "/// The gate GEMMs run on cuBLAS from this Cf (stages.yaml `regime.cublas_gate_from_cf`).");
    let _ = writeln!(s, "pub const CUBLAS_GATE_FROM_CF: u32 = {};", regime.cublas_gate_from_cf);
    let _ = writeln!(s, "/// Where the switch's \"on\" takes the fused backward (stages.yaml `regime.fused_faster`).");
    let _ = writeln!(s, "pub static FUSED_FASTER: [FusedFaster; {}] = [", regime.fused_faster.len());
    for x in &regime.fused_faster {
        let gpu = x.gpu.as_deref().map_or("None".to_string(), |g| format!("Some({:?})", g.trim()));
        let _ = writeln!(
            s,
            "    FusedFaster {{ cf: {}, lmax: ({}, {}), precision: Precision::{:?}, gpu: {gpu} }},",
            x.cf, x.lmax[0], x.lmax[1], x.precision
        );
    }
    let _ = writeln!(s, "];");
    let roles = specs.roles();
    let _ = writeln!(s, "/// Each stage's role (stages.yaml `variant`, `pass`, `layers`, `serves`).");
    let _ = writeln!(s, "pub static STAGE_ROLES: [StageRole; {}] = [", roles.len());
    for r in roles {
        let _ = writeln!(
            s,
            "    StageRole {{ stage: Stage::{:?}, variant: Variant::{:?}, pass: Pass::{:?}, layers: Layers::{:?}, serves: Serves::{:?} }},",
            r.stage, r.variant, r.pass, r.layers, r.serves
        );
    }
    let _ = writeln!(s, "];");
    s
}
