//! `mixstack report`: the build manifest (ptxas numbers per instance, the
//! rejected instances with their spills, the dispatch table per key) and the
//! backward path per (dtype, Cf).

use super::CliResult;
use mixstack::kinds::{Arch, Dtype, Precision};
use mixstack::runtime::table::{self, FusedFaster, BUILD_MANIFEST_JSON, BUILD_SOURCE};
use mixstack::runtime::{Dispatch, Request};
use mixstack_gen::buildlog;
use mixstack_gen::embed::{DispatchRow, Manifest, ManifestInstance};
use serde::Serialize;

#[derive(Serialize)]
struct BackwardRow {
    arch: Arch,
    dtype: Dtype,
    cf: u32,
    switch_off: String,
    switch_always: String,
    reason_always: String,
}

#[derive(Serialize)]
struct DispatchJson<'a> {
    kernels: &'a [DispatchRow],
    backward: Vec<BackwardRow>,
    fused_faster: &'a [FusedFaster],
}

/// An instance rejected on an arch because ptxas reports spills (the build
/// counts these).
#[derive(Serialize, Debug, PartialEq)]
struct RejectedRow {
    name: String,
    arch: Arch,
    spill_stores: u32,
    spill_loads: u32,
    registers: u32,
    stack_bytes: u32,
}

#[derive(Serialize)]
struct ReportJson<'a> {
    instances: &'a [ManifestInstance],
    rejected: Vec<RejectedRow>,
    dispatch: DispatchJson<'a>,
}

fn rejected_rows(m: &Manifest) -> Vec<RejectedRow> {
    m.instances
        .iter()
        .filter(|i| !i.accepted)
        .map(|i| RejectedRow {
            name: i.name.clone(),
            arch: i.arch,
            spill_stores: i.spill_stores,
            spill_loads: i.spill_loads,
            registers: i.registers,
            stack_bytes: i.stack_bytes,
        })
        .collect()
}

fn backward_rows(m: &Manifest) -> Vec<BackwardRow> {
    let mut keys: Vec<(Arch, Dtype, u32)> = m.instances.iter().map(|i| (i.arch, i.dtype, i.cf)).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .map(|(arch, dtype, cf)| {
            let d = Dispatch::builtin().with_arch(arch);
            let off = d.decide_backward_path(dtype, cf, Request::Off);
            let always = d.decide_backward_path(dtype, cf, Request::Always);
            BackwardRow {
                arch,
                dtype,
                cf,
                switch_off: off.path.to_string(),
                switch_always: always.path.to_string(),
                reason_always: always.reason.to_string(),
            }
        })
        .collect()
}

fn opt(v: Option<u32>) -> String {
    v.map(|v| v.to_string()).unwrap_or_else(|| "-".into())
}

pub fn run(json: bool) -> CliResult {
    let m: Manifest = serde_json::from_str(BUILD_MANIFEST_JSON)?;
    let backward = backward_rows(&m);
    let fused_faster: &[FusedFaster] = &table::FUSED_FASTER;
    if json {
        let r = ReportJson {
            instances: &m.instances,
            rejected: rejected_rows(&m),
            dispatch: DispatchJson { kernels: &m.dispatch, backward, fused_faster },
        };
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    println!(
        "# kernel instance builds ({} from {}, {}; lmax {}..{} is a runtime argument)",
        m.instances.len(),
        BUILD_SOURCE,
        m.archs.iter().map(|a| a.as_str()).collect::<Vec<_>>().join(" + "),
        m.lmax.0,
        m.lmax.1
    );
    // the name column as wide as the longest name, so every row lines up
    let w = m.instances.iter().map(|i| i.name.len()).max().unwrap_or(0).max("name".len());
    println!(
        "{:<w$} {:<5} {:<15} {:<6} {:<4} {:>4} {:>7} {:>4} {:>5} {:>5} {:>6} {:>6} {:>8}  dispatched",
        "name", "arch", "stage", "var", "dt", "cf", "block_m", "bn", "thr", "regs", "spillS", "spillL", "accepted"
    );
    for i in &m.instances {
        println!(
            "{:<w$} {:<5} {:<15} {:<6} {:<4} {:>4} {:>7} {:>4} {:>5} {:>5} {:>6} {:>6} {:>8}  {}",
            i.name,
            i.arch.as_str(),
            i.stage.as_str(),
            i.variant.as_str(),
            i.dtype.as_str(),
            i.cf,
            opt(i.block_m.or(i.rows)),
            opt(i.bn),
            i.threads,
            i.registers,
            i.spill_stores,
            i.spill_loads,
            match (i.accepted, i.spill_stores > 0 || i.spill_loads > 0) {
                (true, _) => "yes",
                (false, true) => "SPILLS",
                (false, false) => "REGS", // a register move sized from another count (check::accepts)
            },
            match (i.is_default, i.precision) {
                (false, _) => "",
                (true, Precision::Exact) => "yes",
                // a default of the mode's own keys (MIXSTACK_PRECISION=fp16x3)
                (true, _) => "yes (fp16x3)",
            }
        );
    }
    for p in &m.pruned {
        println!("pruned {}: {}", p.name, p.reason);
    }
    let rejected: Vec<&ManifestInstance> = m.instances.iter().filter(|i| !i.accepted).collect();
    println!(
        "\n# rejected {} (ptxas): {} instance builds, no code embedded, never dispatched",
        buildlog::rejected_for(&rejected),
        rejected.len()
    );
    for i in rejected {
        println!("{:<w$} {:<5} {}", i.name, i.arch.as_str(), buildlog::rejection(i));
    }
    println!("\n# dispatch per (arch, stage, dtype, precision, cf): instance [lmax range]");
    let mut i = 0;
    while i < m.dispatch.len() {
        let r = &m.dispatch[i];
        let mut j = i;
        while j + 1 < m.dispatch.len() {
            let n = &m.dispatch[j + 1];
            if (n.arch, n.stage, n.dtype, n.precision, n.cf, &n.instance)
                != (r.arch, r.stage, r.dtype, r.precision, r.cf, &r.instance)
            {
                break;
            }
            j += 1;
        }
        println!(
            "{:<5} {:<15} {:<4} {:<6} cf {:>3} lmax {}..{}: {}",
            r.arch.as_str(),
            r.stage.as_str(),
            r.dtype.as_str(),
            r.precision.as_str(),
            r.cf,
            r.lmax,
            m.dispatch[j].lmax,
            r.instance
        );
        i = j + 1;
    }
    println!("\n# backward path per (arch, dtype, cf): switch off / always (MIXSTACK_STACK_BWD_FUSED)");
    for b in &backward {
        let (arch, dt) = (b.arch.as_str(), b.dtype.as_str());
        println!("{arch:<5} {dt:<4} cf {:>3}: {} / {} ({})", b.cf, b.switch_off, b.switch_always, b.reason_always);
    }
    println!("# switch on: fused where measured faster than the relay (stages.yaml regime.fused_faster), else relay");
    if fused_faster.is_empty() {
        println!("(none listed: \"on\" runs the relay everywhere; `mixstack tune --regime --write` measures a GPU)");
    }
    for x in fused_faster {
        let on = x.gpu.map_or("every GPU without entries of its own".to_string(), |g| format!("GPUs named *{g}*"));
        println!("f32  {:<6} cf {:>3} lmax {}..{}: {on}", x.precision.as_str(), x.cf, x.lmax.0, x.lmax.1);
    }
    if !fused_faster.is_empty() && fused_faster.iter().all(|x| x.gpu.is_some()) {
        println!("any other GPU: the relay (`mixstack tune --regime --write` measures one and writes its entries)");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejected_rows_are_the_spilling_instances_with_their_numbers() {
        let mut m: Manifest = serde_json::from_str(BUILD_MANIFEST_JSON).unwrap();
        let rows = rejected_rows(&m);
        assert_eq!(rows.len(), m.instances.iter().filter(|i| !i.accepted).count());
        // One accepted instance made to spill shows up, numbers and all.
        let i = m.instances.iter_mut().find(|i| i.accepted).unwrap();
        (i.accepted, i.spill_stores, i.spill_loads, i.registers, i.stack_bytes) = (false, 20, 16, 255, 24);
        let (name, arch) = (i.name.clone(), i.arch);
        let rows = rejected_rows(&m);
        let row = rows.iter().find(|r| r.name == name && r.arch == arch).expect("listed");
        let want = RejectedRow { name, arch, spill_stores: 20, spill_loads: 16, registers: 255, stack_bytes: 24 };
        assert_eq!(*row, want);
    }
}
