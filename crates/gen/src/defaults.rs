//! Writing measured defaults back into specs/tiles.yaml as text: one line
//! per (stage, dtype, Cf, GPU) key in the `defaults:` list, replaced in place
//! when the key has one, else added at the end of the list. Every other line
//! (comments, order, spacing) is kept, so the diff a reviewer reads is the
//! changed defaults only. The result is checked by parsing it again.

use crate::kinds::{Dtype, Precision, Stage};

/// One default to write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Default {
    pub stage: Stage,
    pub dtype: Dtype,
    pub cf: u32,
    /// The tile part of the canonical name.
    pub tile: String,
    /// The GPU key (a part of the device name), or None for the generic default.
    pub gpu: Option<String>,
    /// The mode it serves (written only when not exact).
    pub precision: Precision,
}

impl Default {
    /// The list line, in the file's flow style.
    pub fn line(&self) -> String {
        let gpu = self.gpu.as_deref().map_or(String::new(), |g| format!(", gpu: {g}"));
        let prec = match self.precision {
            Precision::Exact => String::new(),
            p => format!(", precision: {p}"),
        };
        format!("  - {{stage: {}, dtype: {}, cf: {}, tile: {}{gpu}{prec}}}", self.stage, self.dtype, self.cf, self.tile)
    }
}

/// Why a text could not take the defaults.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WriteError {
    #[error("tiles.yaml has no top-level `defaults:` list to write into")]
    NoDefaultsList,
    #[error("tiles.yaml line {line} in `defaults:` is not a one-line flow entry ({text:?}); edit it by hand")]
    Unreadable { line: usize, text: String },
}

/// The (stage, dtype, Cf, GPU, precision) key of a `- {stage: ..., ...}` line.
type Key = (String, String, String, Option<String>, String);

fn key_of(line: &str) -> Option<Key> {
    let body = line.trim().strip_prefix("- {")?.strip_suffix('}')?;
    let mut stage = None;
    let mut dtype = None;
    let mut cf = None;
    let mut gpu = None;
    let mut precision = Precision::Exact.as_str().to_string();
    for field in body.split(',') {
        let (k, v) = field.split_once(':')?;
        let v = v.trim().trim_matches(|c| c == '"' || c == '\'').to_string();
        match k.trim() {
            "stage" => stage = Some(v),
            "dtype" => dtype = Some(v),
            "cf" => cf = Some(v),
            "gpu" => gpu = Some(v.to_ascii_lowercase()),
            "precision" => precision = v,
            _ => {}
        }
    }
    Some((stage?, dtype?, cf?, gpu, precision))
}

/// `text` (tiles.yaml) with `defaults` written into its `defaults:` list.
pub fn write(text: &str, defaults: &[Default]) -> Result<String, WriteError> {
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    let start = lines.iter().position(|l| l.trim_end() == "defaults:").ok_or(WriteError::NoDefaultsList)?;
    // The list: the lines after `defaults:` that are entries, comments or
    // blank, up to the next top-level key or the end.
    let mut end = start + 1;
    while end < lines.len() {
        let l = &lines[end];
        let top_level = !l.is_empty() && !l.starts_with(' ') && !l.starts_with('#');
        if top_level {
            break;
        }
        end += 1;
    }
    for (i, l) in lines.iter().enumerate().take(end).skip(start + 1) {
        if l.trim().starts_with('-') && key_of(l).is_none() {
            return Err(WriteError::Unreadable { line: i + 1, text: l.clone() });
        }
    }
    // Insert after the last entry (before trailing comments or blank lines).
    let mut insert_at = (start + 1..end).rev().find(|&i| lines[i].trim().starts_with('-')).map_or(start + 1, |i| i + 1);
    for d in defaults {
        let key = (
            d.stage.as_str().to_string(),
            d.dtype.as_str().to_string(),
            d.cf.to_string(),
            d.gpu.as_deref().map(str::to_ascii_lowercase),
            d.precision.as_str().to_string(),
        );
        let existing = (start + 1..insert_at).find(|&i| key_of(&lines[i]).as_ref() == Some(&key));
        match existing {
            Some(i) => lines[i] = d.line(),
            None => {
                lines.insert(insert_at, d.line());
                insert_at += 1;
            }
        }
    }
    let mut out = lines.join("\n");
    if text.ends_with('\n') {
        out.push('\n');
    }
    Ok(out)
}
