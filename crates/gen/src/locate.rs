//! Line and column of a field path in a spec file's text, for errors that
//! serde cannot place (cross-references, duplicates, bounds).
//!
//! Paths are those the errors print: `gemm.fused[3].block_m`,
//! `stages[2] (bwd_fused).cf`, `defaults[4]`; parenthesised names are
//! skipped and `a/b` alternatives locate `a`. The walk understands the block
//! and flow styles the specs use; where it cannot follow a path it returns
//! the deepest position it reached (or `None`).

/// 1-based (line, column).
pub type Pos = (usize, usize);

enum Seg<'a> {
    Key(&'a str),
    Index(usize),
}

fn segments(path: &str) -> Vec<Seg<'_>> {
    let mut out = Vec::new();
    for part in path.split('.') {
        // `stages[2] (bwd_fused)` -> `stages[2]`; `tm/tn` -> `tm`.
        let part = part.split(" (").next().unwrap_or(part).trim();
        let part = part.split('/').next().unwrap_or(part);
        let (key, rest) = match part.find('[') {
            Some(i) => (&part[..i], &part[i..]),
            None => (part, ""),
        };
        if !key.is_empty() {
            out.push(Seg::Key(key));
        }
        for idx in rest.split('[').filter(|s| !s.is_empty()) {
            if let Ok(i) = idx.trim_end_matches(']').parse() {
                out.push(Seg::Index(i));
            }
        }
    }
    out
}

struct Line<'a> {
    indent: usize,
    /// The line without its comment.
    text: &'a str,
}

fn lines(text: &str) -> Vec<Line<'_>> {
    text.lines()
        .map(|l| {
            let text = match l.find(" #") {
                Some(i) => &l[..i],
                None if l.trim_start().starts_with('#') => "",
                None => l,
            };
            Line { indent: l.len() - l.trim_start().len(), text }
        })
        .collect()
}

/// Column (0-based) of `key:` as a mapping key in `s` from byte `from`.
fn key_col(s: &str, key: &str, from: usize) -> Option<usize> {
    let mut at = from;
    while let Some(i) = s.get(at..)?.find(key) {
        let start = at + i;
        let before = s[..start].chars().next_back();
        let boundary = matches!(before, None | Some(' ' | '{' | ',' | '-'));
        if boundary && s[start + key.len()..].starts_with(':') {
            return Some(start);
        }
        at = start + key.len();
    }
    None
}

/// The lines of the value under line `k` (its block), as a range.
fn block_of(ls: &[Line<'_>], k: usize, end: usize) -> (usize, usize) {
    let base = ls[k].indent;
    let mut j = k + 1;
    while j < end {
        let l = &ls[j];
        let content = l.text.trim();
        if !content.is_empty() && (l.indent < base || (l.indent == base && !content.starts_with("- "))) {
            break;
        }
        j += 1;
    }
    (k + 1, j)
}

pub fn locate(text: &str, path: &str) -> Option<Pos> {
    let ls = lines(text);
    let (mut start, mut end) = (0, ls.len());
    // The line (and column) the walk has reached, and where keys may start
    // on it (after an item's `- `).
    let mut found: Option<Pos> = None;
    let mut on_line: Option<(usize, usize)> = None;
    for seg in segments(path) {
        match seg {
            Seg::Key(key) => {
                // The key may sit on the current item's own line (flow or `- key:`).
                let hit = on_line
                    .and_then(|(k, from)| key_col(ls[k].text, key, from).map(|c| (k, c)))
                    .or_else(|| (start..end).find_map(|k| key_col(ls[k].text, key, ls[k].indent).map(|c| (k, c))));
                let Some((k, c)) = hit else { return found };
                found = Some((k + 1, c + 1));
                let line = ls[k].text;
                let value = line[c + key.len() + 1..].trim();
                if value.is_empty() {
                    (start, end) = block_of(&ls, k, end);
                    on_line = None;
                } else {
                    // An inline value: a flow collection or scalar on this line.
                    (start, end) = (k + 1, k + 1);
                    on_line = Some((k, c + key.len() + 1));
                }
            }
            Seg::Index(i) => {
                let items: Vec<usize> = (start..end).filter(|&k| ls[k].text.trim_start().starts_with("- ")).collect();
                let Some(indent) = items.iter().map(|&k| ls[k].indent).min() else { return found };
                let items: Vec<usize> = items.into_iter().filter(|&k| ls[k].indent == indent).collect();
                let Some(&k) = items.get(i) else { return found };
                found = Some((k + 1, indent + 1));
                let next = items.get(i + 1).copied().unwrap_or(end);
                (start, end) = (k + 1, next);
                on_line = Some((k, indent + 2));
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::locate;

    const TEXT: &str = "# comment: gemm\ngemm:\n  relay:\n    - {dtypes: [f32], block_m: 64, bn: 32}\n    - {dtypes: [f64], block_m: 128, bn: 64}\n  fused:\n    - {dtypes: [f32], block_m: 32}\nstages:\n  - name: a\n    cf: [32]\n  - name: b\n    cf: [64]\ndefaults:\n- {stage: a}\n- {stage: b}\n";

    #[test]
    fn paths_land_on_their_lines() {
        assert_eq!(locate(TEXT, "gemm"), Some((2, 1)));
        assert_eq!(locate(TEXT, "gemm.relay[1].block_m"), Some((5, 23)));
        assert_eq!(locate(TEXT, "gemm.fused[0].block_m"), Some((7, 23)));
        assert_eq!(locate(TEXT, "stages[1] (b).cf"), Some((12, 5)));
        assert_eq!(locate(TEXT, "stages[0] (a).name"), Some((9, 5)));
        assert_eq!(locate(TEXT, "defaults[1]"), Some((15, 1)));
        // a path that cannot be followed stops at the deepest position reached
        assert_eq!(locate(TEXT, "gemm.relay[1].tm/tn"), Some((5, 5)));
        assert_eq!(locate(TEXT, "gemm.relay[7]"), Some((3, 3)));
        assert_eq!(locate(TEXT, "nothing"), None);
    }
}
