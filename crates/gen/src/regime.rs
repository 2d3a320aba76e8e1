//! Writing a measured regime back into specs/stages.yaml as text: the
//! `regime.fused_faster` entries one GPU's sweep supports (relay against
//! fused, `mixstack tune --regime`) replace that GPU's entries for the swept
//! Cf and mode; every other line (comments, other GPUs' entries, order) is
//! kept, so the diff a reviewer reads is the regime's change only. The
//! caller checks the result by parsing the specs again.

use crate::kinds::{gpu_matches, Precision};
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

/// A measured entry: what stages.yaml gets, and the fused / relay range of
/// its points (the line's comment, for the reviewer of the diff).
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    pub spec: FusedFasterSpec,
    pub ratios: [f64; 2],
}

impl Entry {
    /// The list line, its measurement as a comment.
    pub fn line(&self, indent: &str) -> String {
        let [lo, hi] = self.ratios;
        format!("{}  # fused / relay {lo:.3}-{hi:.3} (mixstack tune --regime)", line(&self.spec, indent))
    }
}

/// The entries `points` support on `gpu` in `precision`: per Cf, each run of
/// consecutive lmax whose points are [`Point::faster`] (an lmax not swept
/// ends a run), in Cf then lmax order.
pub fn entries(points: &[Point], keep: f64, gpu: &str, precision: Precision) -> Vec<Entry> {
    let mut sorted: Vec<&Point> = points.iter().collect();
    sorted.sort_by_key(|p| (p.cf, p.lmax));
    let mut out: Vec<Entry> = Vec::new();
    let mut prev: Option<(u32, u32)> = None; // the last point in the regime
    for p in sorted.into_iter().filter(|p| p.faster(keep)) {
        let r = p.ratio.unwrap_or(f64::NAN); // faster: measured
        match out.last_mut() {
            Some(e) if prev == Some((p.cf, p.lmax.wrapping_sub(1))) => {
                e.spec.lmax[1] = p.lmax;
                e.ratios = [e.ratios[0].min(r), e.ratios[1].max(r)];
            }
            _ => out.push(Entry {
                spec: FusedFasterSpec { cf: p.cf, lmax: [p.lmax, p.lmax], precision, gpu: Some(gpu.to_string()) },
                ratios: [r, r],
            }),
        }
        prev = Some((p.cf, p.lmax));
    }
    out
}

/// The list line of an entry, in the file's flow style (a GPU name with a
/// character YAML reads as syntax is quoted).
pub fn line(e: &FusedFasterSpec, indent: &str) -> String {
    let prec = match e.precision {
        Precision::Exact => String::new(),
        p => format!(", precision: {p}"),
    };
    let quote = |g: &str| {
        if g.contains(|c| ":#,[]{}'\"&*!|>%@`".contains(c)) {
            format!("'{}'", g.replace('\'', "''"))
        } else {
            g.to_string()
        }
    };
    let gpu = e.gpu.as_deref().map_or(String::new(), |g| format!(", gpu: {}", quote(g)));
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

/// A line without its comment and trailing blanks (no key here holds `#`).
fn code(l: &str) -> &str {
    l.split('#').next().unwrap_or("").trim_end()
}

/// `text` (stages.yaml) with `new` in place of the `regime.fused_faster`
/// entries that judge `device` (every key [`gpu_matches`] its name, as the
/// runtime reads them) in `precision` at the Cf in `swept`; `new` goes
/// after the list's last remaining entry. Line endings are kept.
pub fn write(
    text: &str,
    device: &str,
    precision: Precision,
    swept: &[u32],
    new: &[Entry],
) -> Result<String, WriteError> {
    debug_assert!(new.iter().map(|e| &e.spec).all(|e| e.precision == precision
        && swept.contains(&e.cf)
        && e.gpu.as_deref().is_some_and(|g| gpu_matches(g, device))));
    let eol = if text.contains("\r\n") { "\r\n" } else { "\n" };
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    let regime = lines.iter().position(|l| code(l) == "regime:").ok_or(WriteError::NoList)?;
    let in_regime = |l: &String| l.trim().is_empty() || l.starts_with(' ') || l.starts_with('#');
    let regime_end = (regime + 1..lines.len()).find(|&i| !in_regime(&lines[i])).unwrap_or(lines.len());
    let head = (regime + 1..regime_end)
        .find(|&i| matches!(code(&lines[i]).trim_start(), "fused_faster:" | "fused_faster: []"))
        .ok_or(WriteError::NoList)?;
    let key_indent = indent_of(&lines[head]);
    // The list: the lines after the key indented past it (or items at its
    // own indent, YAML's indentless sequence), comments and blank lines, up
    // to the regime's next key.
    let mut end = head + 1;
    while end < regime_end {
        let l = &lines[end];
        let t = l.trim();
        let item = indent_of(l) > key_indent || (indent_of(l) == key_indent && t.starts_with('-'));
        if !(t.is_empty() || t.starts_with('#') || item) {
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
        let judges = parsed.gpu.as_deref().is_some_and(|g| gpu_matches(g, device));
        if judges && parsed.precision == precision && swept.contains(&parsed.cf) {
            continue; // replaced by this sweep
        }
        keep.push(l.clone());
        last_entry = Some(keep.len());
    }
    let at = last_entry.unwrap_or(0);
    let added: Vec<String> = new.iter().map(|e| e.line(&entry_indent)).collect();
    keep.splice(at..at, added);
    let empty = !keep.iter().any(|l| l.trim_start().starts_with('-'));
    let suffix = if empty { " []" } else { "" };
    let comment = lines[head].find('#').map_or(String::new(), |i| format!("  {}", &lines[head][i..]));
    lines[head] = format!("{}fused_faster:{suffix}{comment}", " ".repeat(key_indent));
    lines.splice(head + 1..end, keep);
    let mut out = lines.join(eol);
    if text.ends_with('\n') {
        out.push_str(eol);
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
        let lmax: Vec<(u32, [u32; 2])> = got.iter().map(|e| (e.spec.cf, e.spec.lmax)).collect();
        assert_eq!(lmax, [(32, [1, 2]), (32, [4, 4]), (64, [2, 2]), (64, [5, 5])]);
        assert!(got.iter().all(|e| e.spec.gpu.as_deref() == Some("H200") && e.spec.precision == Precision::Exact));
        assert_eq!(got[0].ratios, [0.95, 0.97]);
        assert_eq!(
            got[0].line("    "),
            "    - {cf: 32, lmax: [1, 2], gpu: H200}  # fused / relay 0.950-0.970 (mixstack tune --regime)"
        );
        let x3 = FusedFasterSpec { precision: Precision::Fp16x3, ..got[0].spec.clone() };
        assert_eq!(line(&x3, ""), "- {cf: 32, lmax: [1, 2], precision: fp16x3, gpu: H200}");
    }

    const TEXT: &str = "lmax: {min: 1, max: 6}\nregime:\n  fused_cf_below: 96\n  # the regime\n  fused_faster:  # measured\n    - {cf: 32, lmax: [1, 3], gpu: H100 80GB HBM3}  # run 95\n    - {cf: 32, lmax: [1, 2], gpu: h200}\n    # an H20 entry: its key is part of \"NVIDIA H200\" too\n    - {cf: 32, lmax: [5, 5], gpu: H20}\n    - {cf: 64, lmax: [1, 1], gpu: H200, precision: fp16x3}\n    - {cf: 64, lmax: [2, 2], gpu: H200}\n\n  cublas_gate_from_cf: 96\n\nstages: []\n";

    fn spec(cf: u32, lmax: [u32; 2]) -> FusedFasterSpec {
        FusedFasterSpec { cf, lmax, precision: Precision::Exact, gpu: Some("H200".into()) }
    }
    /// An H200 entry measured at 0.9 (its comment: `NOTE`).
    fn h200(cf: u32, lmax: [u32; 2]) -> Entry {
        Entry { spec: spec(cf, lmax), ratios: [0.9, 0.9] }
    }
    const NOTE: &str = "  # fused / relay 0.900-0.900 (mixstack tune --regime)";

    #[test]
    fn replaces_the_entries_that_judge_this_gpu() {
        // Every key the runtime matches to "NVIDIA H200" goes (h200, H20),
        // in this mode at the swept Cf; the rest stays, line for line.
        let got = write(TEXT, "NVIDIA H200", Precision::Exact, &[32, 64], &[h200(32, [1, 4])]).unwrap();
        let want = "lmax: {min: 1, max: 6}\nregime:\n  fused_cf_below: 96\n  # the regime\n  fused_faster:  # measured\n    - {cf: 32, lmax: [1, 3], gpu: H100 80GB HBM3}  # run 95\n    # an H20 entry: its key is part of \"NVIDIA H200\" too\n    - {cf: 64, lmax: [1, 1], gpu: H200, precision: fp16x3}\n    - {cf: 32, lmax: [1, 4], gpu: H200}NOTE\n\n  cublas_gate_from_cf: 96\n\nstages: []\n";
        assert_eq!(got, want.replace("NOTE", NOTE));
        // A Cf not swept keeps its entries.
        let got = write(TEXT, "NVIDIA H200", Precision::Exact, &[32], &[]).unwrap();
        assert!(got.contains("{cf: 64, lmax: [2, 2], gpu: H200}") && !got.contains("gpu: h200}"), "{got}");
        // Another GPU: its entry appended after the last, nothing else touched.
        let h20 = Entry { spec: FusedFasterSpec { gpu: Some("H20".into()), ..spec(64, [3, 3]) }, ratios: [0.9, 0.9] };
        let got = write(TEXT, "NVIDIA H20", Precision::Exact, &[64], &[h20]).unwrap();
        let want = TEXT.replace(
            "    - {cf: 64, lmax: [2, 2], gpu: H200}\n",
            &format!("    - {{cf: 64, lmax: [2, 2], gpu: H200}}\n    - {{cf: 64, lmax: [3, 3], gpu: H20}}{NOTE}\n"),
        );
        assert_eq!(got, want);
        // Nothing faster and nothing left: an empty list, the comment kept.
        let got = write(TEXT, "NVIDIA H200 H100 80GB HBM3", Precision::Exact, &[32, 64], &[]).unwrap();
        assert!(
            got.contains("  fused_faster:  # measured\n    # an H20") && got.contains("precision: fp16x3"),
            "{got}"
        );
        let got = write(&got, "NVIDIA H200", Precision::Fp16x3, &[64], &[]).unwrap();
        assert!(got.contains("  fused_faster: []  # measured\n"), "{got}");
    }

    #[test]
    fn line_endings_indentless_lists_and_quoting() {
        let crlf = TEXT.replace('\n', "\r\n");
        let got = write(&crlf, "NVIDIA H200", Precision::Exact, &[32, 64], &[h200(32, [1, 4])]).unwrap();
        assert_eq!(got.matches("\r\n").count(), got.matches('\n').count(), "CRLF kept");
        let lf = write(TEXT, "NVIDIA H200", Precision::Exact, &[32, 64], &[h200(32, [1, 4])]).unwrap();
        assert_eq!(got, lf.replace('\n', "\r\n"));
        // YAML's indentless sequence: items at the key's own indent.
        let text = "regime:\n  fused_faster:\n  - {cf: 32, lmax: [1, 2], gpu: H200}\n  - {cf: 64, lmax: [1, 2], gpu: H100}\n  cublas_gate_from_cf: 96\n";
        let got = write(text, "NVIDIA H200", Precision::Exact, &[32], &[h200(32, [2, 3])]).unwrap();
        let want = "regime:\n  fused_faster:\n  - {cf: 64, lmax: [1, 2], gpu: H100}\n  - {cf: 32, lmax: [2, 3], gpu: H200}NOTE\n  cublas_gate_from_cf: 96\n";
        assert_eq!(got, want.replace("NOTE", NOTE));
        let odd = FusedFasterSpec { gpu: Some("A100: it's".into()), ..spec(32, [1, 1]) };
        let l = line(&odd, "");
        assert_eq!(l, "- {cf: 32, lmax: [1, 1], gpu: 'A100: it''s'}");
        let back: FusedFasterSpec = serde_yaml::from_str(l.trim_start_matches('-')).unwrap();
        assert_eq!(back, odd);
    }

    #[test]
    fn an_empty_list_and_bad_texts() {
        let text = "regime:  # where\n  fused_faster: []\n  cublas_gate_from_cf: 96\n";
        let got = write(text, "NVIDIA H200", Precision::Exact, &[32], &[h200(32, [2, 3])]).unwrap();
        assert_eq!(
            got,
            format!("regime:  # where\n  fused_faster:\n    - {{cf: 32, lmax: [2, 3], gpu: H200}}{NOTE}\n  cublas_gate_from_cf: 96\n")
        );
        let new = [h200(32, [2, 3])];
        assert_eq!(write("stages: []\n", "NVIDIA H200", Precision::Exact, &[32], &new), Err(WriteError::NoList));
        let no_list = "regime:\n  fused_cf_below: 96\n";
        assert_eq!(write(no_list, "NVIDIA H200", Precision::Exact, &[32], &new), Err(WriteError::NoList));
        let bad = "regime:\n  fused_faster:\n    - cf: 32\n      lmax: [1, 2]\n";
        let e = write(bad, "NVIDIA H200", Precision::Exact, &[32], &new);
        assert!(matches!(e, Err(WriteError::Unreadable { line: 3, .. })), "{e:?}");
    }
}
