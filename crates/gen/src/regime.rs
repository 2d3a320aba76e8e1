//! Writing a measured regime back into specs/stages.yaml as text: the
//! `regime.fused_faster` entries one GPU's sweep supports (relay against
//! fused, `mixstack tune --regime`) replace that GPU's entries for the swept
//! Cf and mode; every other line (comments, other GPUs' entries, order) is
//! kept, so the diff a reviewer reads is the regime's change only. The
//! caller checks the result by parsing the specs again.

use crate::kinds::Precision;
use crate::spec::FusedFasterSpec;

/// One swept point: fused / relay backward medians at (Cf, lmax), and
/// whether the two gave the same bits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Point {
    pub cf: u32,
    pub lmax: u32,
    /// `None`: the fused backward does not serve this point.
    pub ratio: Option<f64>,
    pub bitwise_equal: bool,
}

impl Point {
    /// In the regime: served, the relay's bits, and fused / relay <= `keep`.
    pub fn faster(&self, keep: f64) -> bool {
        self.bitwise_equal && self.ratio.is_some_and(|r| r <= keep)
    }
}

/// The entries `points` support on `gpu` in `precision`: per Cf, each run of
/// consecutive lmax whose points are [`Point::faster`] (an lmax not swept
/// ends a run), in Cf then lmax order.
pub fn entries(points: &[Point], keep: f64, gpu: &str, precision: Precision) -> Vec<FusedFasterSpec> {
    let mut sorted: Vec<&Point> = points.iter().collect();
    sorted.sort_by_key(|p| (p.cf, p.lmax));
    let mut out: Vec<FusedFasterSpec> = Vec::new();
    let mut prev: Option<(u32, u32)> = None; // the last point in the regime
    for p in sorted.into_iter().filter(|p| p.faster(keep)) {
        match out.last_mut() {
            Some(e) if prev == Some((p.cf, p.lmax.wrapping_sub(1))) => e.lmax[1] = p.lmax,
            _ => out.push(FusedFasterSpec { cf: p.cf, lmax: [p.lmax, p.lmax], precision, gpu: Some(gpu.to_string()) }),
        }
        prev = Some((p.cf, p.lmax));
    }
    out
}

/// The list line of an entry, in the file's flow style.
pub fn line(e: &FusedFasterSpec, indent: &str) -> String {
    let prec = match e.precision {
        Precision::Exact => String::new(),
        p => format!(", precision: {p}"),
    };
    let gpu = e.gpu.as_deref().map_or(String::new(), |g| format!(", gpu: {g}"));
    format!("{indent}- {{cf: {}, lmax: [{}, {}]{prec}{gpu}}}", e.cf, e.lmax[0], e.lmax[1])
}

/// Why a text could not take the entries.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WriteError {
    #[error("stages.yaml has no `fused_faster:` list under `regime:` to write into")]
    NoList,
    #[error(
        "stages.yaml line {line} in `regime.fused_faster` is not a one-line flow entry ({text:?}); edit it by hand"
    )]
    Unreadable { line: usize, text: String },
}

fn indent_of(l: &str) -> usize {
    l.len() - l.trim_start().len()
}

/// `text` (stages.yaml) with `new` in place of the `regime.fused_faster`
/// entries for `gpu` (the same key, without case) in `precision` at the Cf
/// in `swept`; `new` goes after the list's last remaining entry.
pub fn write(
    text: &str,
    gpu: &str,
    precision: Precision,
    swept: &[u32],
    new: &[FusedFasterSpec],
) -> Result<String, WriteError> {
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    let regime = lines.iter().position(|l| l.trim_end() == "regime:").ok_or(WriteError::NoList)?;
    let in_regime = |l: &String| l.is_empty() || l.starts_with(' ') || l.starts_with('#');
    let regime_end = (regime + 1..lines.len()).find(|&i| !in_regime(&lines[i])).unwrap_or(lines.len());
    let head = (regime + 1..regime_end)
        .find(|&i| matches!(lines[i].trim(), "fused_faster:" | "fused_faster: []"))
        .ok_or(WriteError::NoList)?;
    let key_indent = indent_of(&lines[head]);
    lines[head] = format!("{}fused_faster:", " ".repeat(key_indent));
    // The list: the lines after the key indented past it, comments and
    // blank lines, up to the regime's next key.
    let mut end = head + 1;
    while end < regime_end {
        let l = &lines[end];
        let t = l.trim();
        if !(t.is_empty() || t.starts_with('#') || indent_of(l) > key_indent) {
            break;
        }
        end += 1;
    }
    let mut entry_indent = " ".repeat(key_indent + 2);
    let mut keep: Vec<String> = Vec::new();
    let mut last_entry = None;
    for (i, l) in lines[head + 1..end].iter().enumerate() {
        if !l.trim_start().starts_with('-') {
            keep.push(l.clone());
            continue;
        }
        let body = l.trim_start().trim_start_matches('-');
        let parsed: FusedFasterSpec =
            serde_yaml::from_str(body).map_err(|_| WriteError::Unreadable { line: head + 2 + i, text: l.clone() })?;
        entry_indent = " ".repeat(indent_of(l));
        let same_gpu = parsed.gpu.as_deref().is_some_and(|g| g.trim().eq_ignore_ascii_case(gpu.trim()));
        if same_gpu && parsed.precision == precision && swept.contains(&parsed.cf) {
            continue; // replaced by this sweep
        }
        keep.push(l.clone());
        last_entry = Some(keep.len());
    }
    let at = last_entry.unwrap_or(0);
    let added: Vec<String> = new.iter().map(|e| line(e, &entry_indent)).collect();
    keep.splice(at..at, added);
    lines.splice(head + 1..end, keep);
    let mut out = lines.join("\n");
    if text.ends_with('\n') {
        out.push('\n');
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pt(cf: u32, lmax: u32, ratio: f64) -> Point {
        Point { cf, lmax, ratio: Some(ratio), bitwise_equal: true }
    }

    #[test]
    fn runs_of_faster_points() {
        let mut pts = vec![pt(32, 1, 0.95), pt(32, 2, 0.97), pt(32, 3, 0.99), pt(32, 4, 0.90), pt(64, 2, 0.5)];
        pts.push(Point { cf: 64, lmax: 3, ratio: Some(0.5), bitwise_equal: false }); // other bits: never
        pts.push(Point { cf: 64, lmax: 4, ratio: None, bitwise_equal: false }); // not served
        pts.push(pt(64, 5, 0.9));
        pts.reverse(); // order of measurement does not matter
        let got = entries(&pts, 0.98, "H200", Precision::Exact);
        let lmax: Vec<(u32, [u32; 2])> = got.iter().map(|e| (e.cf, e.lmax)).collect();
        assert_eq!(lmax, [(32, [1, 2]), (32, [4, 4]), (64, [2, 2]), (64, [5, 5])]);
        assert!(got.iter().all(|e| e.gpu.as_deref() == Some("H200") && e.precision == Precision::Exact));
        assert_eq!(line(&got[0], "    "), "    - {cf: 32, lmax: [1, 2], gpu: H200}");
        let x3 = FusedFasterSpec { precision: Precision::Fp16x3, ..got[0].clone() };
        assert_eq!(line(&x3, ""), "- {cf: 32, lmax: [1, 2], precision: fp16x3, gpu: H200}");
    }

    const TEXT: &str = "lmax: {min: 1, max: 6}\nregime:\n  fused_cf_below: 96\n  # the regime\n  fused_faster:\n    - {cf: 32, lmax: [1, 3], gpu: H100 80GB HBM3}  # run 95\n    - {cf: 32, lmax: [1, 2], gpu: h200}\n    - {cf: 64, lmax: [1, 1], gpu: H200, precision: fp16x3}\n    - {cf: 64, lmax: [2, 2], gpu: H200}\n\n  cublas_gate_from_cf: 96\n\nstages: []\n";

    #[test]
    fn replaces_this_gpus_entries_only() {
        let new = [FusedFasterSpec { cf: 32, lmax: [1, 4], precision: Precision::Exact, gpu: Some("H200".into()) }];
        let got = write(TEXT, "H200", Precision::Exact, &[32, 64], &new).unwrap();
        let want = "lmax: {min: 1, max: 6}\nregime:\n  fused_cf_below: 96\n  # the regime\n  fused_faster:\n    - {cf: 32, lmax: [1, 3], gpu: H100 80GB HBM3}  # run 95\n    - {cf: 64, lmax: [1, 1], gpu: H200, precision: fp16x3}\n    - {cf: 32, lmax: [1, 4], gpu: H200}\n\n  cublas_gate_from_cf: 96\n\nstages: []\n";
        assert_eq!(got, want);
        // A Cf not swept keeps its entries; nothing faster removes the rest.
        let got = write(TEXT, "H200", Precision::Exact, &[32], &[]).unwrap();
        assert!(got.contains("{cf: 64, lmax: [2, 2], gpu: H200}") && !got.contains("gpu: h200}"), "{got}");
        // Another GPU: its entries appended, nothing else touched.
        let got = write(TEXT, "H20", Precision::Exact, &[32, 64], &new).unwrap();
        assert_eq!(got.lines().count(), TEXT.lines().count() + 1);
    }

    #[test]
    fn an_empty_list_and_bad_texts() {
        let text = "regime:\n  fused_faster: []\n  cublas_gate_from_cf: 96\n";
        let new = [FusedFasterSpec { cf: 32, lmax: [2, 3], precision: Precision::Exact, gpu: Some("H200".into()) }];
        let got = write(text, "H200", Precision::Exact, &[32], &new).unwrap();
        assert_eq!(
            got,
            "regime:\n  fused_faster:\n    - {cf: 32, lmax: [2, 3], gpu: H200}\n  cublas_gate_from_cf: 96\n"
        );
        assert_eq!(write("stages: []\n", "H200", Precision::Exact, &[32], &new), Err(WriteError::NoList));
        assert_eq!(
            write("regime:\n  fused_cf_below: 96\n", "H200", Precision::Exact, &[32], &new),
            Err(WriteError::NoList)
        );
        let bad = "regime:\n  fused_faster:\n    - cf: 32\n      lmax: [1, 2]\n";
        assert!(matches!(
            write(bad, "H200", Precision::Exact, &[32], &new),
            Err(WriteError::Unreadable { line: 3, .. })
        ));
    }
}
