//! Stage 5: read ptxas's resource report and gate on spills.

use crate::kinds::Geometry;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resources {
    pub registers: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
    pub stack_bytes: u32,
    pub smem_static: u32,
}

impl Resources {
    /// An instance that spills is rejected: spills turn the register tile
    /// into local-memory traffic.
    pub fn spills(&self) -> bool {
        self.spill_stores > 0 || self.spill_loads > 0
    }
}

#[derive(Debug, thiserror::Error)]
#[error("ptxas report has no {what} for entry '{entry}'")]
pub struct ReportError {
    pub entry: String,
    pub what: &'static str,
}

/// Whether an instance goes into dispatch: it does not spill, and where
/// its tile moves registers (tiles.yaml `regs`) its block starts with
/// exactly the count the move was sized from (`Geometry::launch_regs`):
/// with fewer, the consumers' `setmaxnreg.inc` would wait forever for
/// registers the producers never had.
pub fn accepts(geometry: &Geometry, r: &Resources) -> bool {
    !r.spills() && (geometry.setmaxnreg().is_none() || r.registers == geometry.launch_regs())
}

fn number_before(line: &str, unit: &str) -> Option<u32> {
    let at = line.find(unit)?;
    line[..at].split_whitespace().last()?.parse().ok()
}

/// Parse `ptxas -v` output for `entry`:
/// ```text
/// ptxas info    : Compiling entry function 'NAME' for 'sm_90'
/// ptxas info    : Function properties for NAME
///     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
/// ptxas info    : Used 40 registers, used 1 barriers, 380 bytes cmem[0]
/// ```
pub fn parse_report(report: &str, entry: &str) -> Result<Resources, ReportError> {
    let err = |what| ReportError { entry: entry.to_string(), what };
    let lines: Vec<&str> = report.lines().collect();
    let start = lines
        .iter()
        .position(|l| l.contains("Compiling entry function") && l.contains(&format!("'{entry}'")))
        .ok_or_else(|| err("'Compiling entry function' line"))?;
    let mut r = Resources::default();
    let (mut props, mut used) = (false, false);
    for l in &lines[start + 1..] {
        if l.contains("Compiling entry function") {
            break;
        }
        if l.contains("stack frame") {
            r.stack_bytes = number_before(l, "bytes stack frame").ok_or_else(|| err("stack frame"))?;
            r.spill_stores = number_before(l, "bytes spill stores").ok_or_else(|| err("spill stores"))?;
            r.spill_loads = number_before(l, "bytes spill loads").ok_or_else(|| err("spill loads"))?;
            props = true;
        }
        if l.contains("Used") && l.contains("registers") {
            r.registers = number_before(l, "registers").ok_or_else(|| err("register count"))?;
            r.smem_static = number_before(l, "bytes smem").unwrap_or(0);
            used = true;
        }
    }
    if !props {
        return Err(err("function properties line"));
    }
    if !used {
        return Err(err("'Used N registers' line"));
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "ptxas info    : 0 bytes gmem\n\
ptxas info    : Compiling entry function 'ms_a' for 'sm_90'\n\
ptxas info    : Function properties for ms_a\n\
    24 bytes stack frame, 20 bytes spill stores, 16 bytes spill loads\n\
ptxas info    : Used 255 registers, used 1 barriers, 24 bytes cumulative stack size, 4096 bytes smem, 400 bytes cmem[0]\n\
ptxas info    : Compiling entry function 'ms_b' for 'sm_90'\n\
ptxas info    : Function properties for ms_b\n\
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
ptxas info    : Used 40 registers, used 1 barriers, 380 bytes cmem[0]\n";

    #[test]
    fn parses_spilling_and_clean_entries() {
        let a = parse_report(SAMPLE, "ms_a").unwrap();
        assert_eq!(
            a,
            Resources { registers: 255, spill_stores: 20, spill_loads: 16, stack_bytes: 24, smem_static: 4096 }
        );
        assert!(a.spills());
        let b = parse_report(SAMPLE, "ms_b").unwrap();
        assert_eq!(b.registers, 40);
        assert!(!b.spills());
    }

    #[test]
    fn a_register_move_needs_the_count_it_was_sized_from() {
        use crate::kinds::{Pipe, Precision};
        let split = |regs| Geometry::Gemm {
            block_m: 64,
            bn: 128,
            block_k: 16,
            tm: 8,
            tn: 8,
            stages: 2,
            min_blocks: 2,
            pipe: Pipe::Split,
            precision: Precision::Exact,
            regs,
        };
        let at = |registers| Resources { registers, ..Default::default() };
        assert!(accepts(&split(192), &at(128)), "2 blocks of 256 start at 128");
        assert!(!accepts(&split(192), &at(120)), "fewer: the consumers' inc would never be met");
        assert!(accepts(&split(0), &at(120)), "no move: ptxas's own count");
        let spilled = Resources { spill_stores: 4, ..at(128) };
        assert!(!accepts(&split(192), &spilled) && !accepts(&split(0), &spilled));
    }

    #[test]
    fn missing_entry_or_lines_are_errors() {
        assert!(parse_report(SAMPLE, "ms_c").is_err());
        let cut = "ptxas info    : Compiling entry function 'ms_x' for 'sm_90'\n";
        assert!(parse_report(cut, "ms_x").is_err());
    }
}
