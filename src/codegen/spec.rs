//! Stage 1 of the generator: the YAML specs, parsed into typed values.
//! Unknown fields are rejected; every error names the file, and the line
//! and field where serde_yaml knows them, or the field path otherwise.

use crate::kinds::{Dtype, Stage, Variant};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("{file}: cannot read: {source}")]
    Io { file: PathBuf, source: std::io::Error },
    #[error("{file}:{line}:{column}: {message}")]
    Yaml { file: PathBuf, line: usize, column: usize, message: String },
    #[error("{file}: {field}: {message}")]
    Invalid { file: PathBuf, field: String, message: String },
}

// ------------------------------------------------------------ specs/ops.yaml

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpsSpec {
    pub constants: BTreeMap<String, f64>,
    pub operators: Vec<OperatorSpec>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OperatorSpec {
    pub name: String,
    pub doc: String,
    pub inputs: Vec<String>,
    pub steps: Vec<StepSpec>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepSpec {
    pub out: String,
    pub op: String,
    pub args: Vec<String>,
}

// --------------------------------------------------------- specs/stages.yaml

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StagesSpec {
    pub arch: String,
    pub lmax: LmaxRange,
    pub stages: Vec<StageSpec>,
}

#[derive(Debug, Deserialize, Clone, Copy)]
#[serde(deny_unknown_fields)]
pub struct LmaxRange {
    pub min: u32,
    pub max: u32,
}

#[derive(Debug, Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Gemm,
    Rows,
}

/// Shared-memory buffers a stage body uses (sizes: src/codegen/layout.rs).
#[derive(Debug, Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum SmemBuf {
    ATile,
    BTile,
    SRows,
    GzsRows,
    SigRows,
    GlogitRows,
    /// g_logit for [`GLOG_SUB_ROWS`](super::layout::GLOG_SUB_ROWS) rows at a
    /// time (the fused backward's scalar chain, sub-block by sub-block).
    GlogitSub,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageSpec {
    pub name: Stage,
    pub variant: Variant,
    pub kind: Kind,
    pub body: String,
    #[serde(default)]
    pub seg: Option<u32>,
    pub doc: String,
    pub dtypes: Vec<Dtype>,
    pub cf: Vec<u32>,
    pub tiles: String,
    pub smem: Vec<SmemBuf>,
    pub params: Vec<String>,
}

// ---------------------------------------------------------- specs/tiles.yaml

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TilesSpec {
    pub gemm: BTreeMap<String, Vec<GemmTileSpec>>,
    pub rows: BTreeMap<String, Vec<RowsTileSpec>>,
    pub defaults: Vec<DefaultSpec>,
}

#[derive(Debug, Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(untagged)]
pub enum BlockK {
    Fixed(u32),
    Named(CfWord),
}

/// `block_k: cf`: one K tile is one subtile.
#[derive(Debug, Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum CfWord {
    Cf,
}

#[derive(Debug, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct GemmTileSpec {
    pub dtypes: Vec<Dtype>,
    pub cf: Vec<u32>,
    pub block_m: u32,
    pub bn: u32,
    pub block_k: BlockK,
    pub tm: u32,
    pub tn: u32,
    /// Shared-memory stages of the K loop (see `pipe`).
    pub stages: u32,
    /// `__launch_bounds__` minimum blocks per SM (1: no register cap).
    pub min_blocks: u32,
    /// How the K loop is fed: regs (stages 1..2), async or stream (stages 2..4).
    pub pipe: crate::kinds::Pipe,
}

#[derive(Debug, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct RowsTileSpec {
    pub dtypes: Vec<Dtype>,
    pub cf: Vec<u32>,
    pub rows: u32,
    pub threads: u32,
    /// `__launch_bounds__` minimum blocks per SM (1: no register cap).
    pub min_blocks: u32,
}

#[derive(Debug, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct DefaultSpec {
    pub stage: Stage,
    pub dtype: Dtype,
    pub cf: u32,
    /// The tile part of the canonical name, e.g. `m32_n64_k32_t4x4`.
    pub tile: String,
}

// ----------------------------------------------------------------- loading

/// All specs of one directory, parsed and validated.
#[derive(Debug)]
pub struct Specs {
    pub dir: PathBuf,
    pub ops: OpsSpec,
    pub stages: StagesSpec,
    pub tiles: TilesSpec,
}

fn parse_file<T: for<'de> Deserialize<'de>>(file: &Path) -> Result<T, SpecError> {
    let text = std::fs::read_to_string(file).map_err(|source| SpecError::Io { file: file.to_path_buf(), source })?;
    parse_str(file, &text)
}

/// Parses one spec text; `file` is only used in errors.
pub fn parse_str<T: for<'de> Deserialize<'de>>(file: &Path, text: &str) -> Result<T, SpecError> {
    serde_yaml::from_str(text).map_err(|e| {
        let (line, column) = e.location().map(|l| (l.line(), l.column())).unwrap_or((0, 0));
        SpecError::Yaml { file: file.to_path_buf(), line, column, message: e.to_string() }
    })
}

pub fn load(dir: &Path) -> Result<Specs, SpecError> {
    let specs = Specs {
        dir: dir.to_path_buf(),
        ops: parse_file(&dir.join("ops.yaml"))?,
        stages: parse_file(&dir.join("stages.yaml"))?,
        tiles: parse_file(&dir.join("tiles.yaml"))?,
    };
    specs.validate()?;
    Ok(specs)
}

impl Specs {
    fn invalid(&self, file: &str, field: String, message: impl Into<String>) -> SpecError {
        SpecError::Invalid { file: self.dir.join(file), field, message: message.into() }
    }

    /// Cross-reference checks serde cannot do.
    pub fn validate(&self) -> Result<(), SpecError> {
        self.validate_ops()?;
        self.validate_stages()?;
        self.validate_tiles()
    }

    fn validate_ops(&self) -> Result<(), SpecError> {
        let mut known: BTreeMap<&str, usize> = BTreeMap::new();
        for p in super::vocab::PRIMITIVES {
            known.insert(p.name, p.arity);
        }
        for (i, op) in self.ops.operators.iter().enumerate() {
            let field = |s: String| format!("operators[{i}] ({}).{s}", op.name);
            if known.contains_key(op.name.as_str()) {
                return Err(self.invalid("ops.yaml", field("name".into()), "name already defined"));
            }
            if op.steps.is_empty() {
                return Err(self.invalid("ops.yaml", field("steps".into()), "no steps"));
            }
            let mut values: Vec<&str> = op.inputs.iter().map(String::as_str).collect();
            for (j, st) in op.steps.iter().enumerate() {
                let Some(&arity) = known.get(st.op.as_str()) else {
                    return Err(self.invalid(
                        "ops.yaml",
                        field(format!("steps[{j}].op")),
                        format!("unknown op '{}' (a primitive or an operator defined above)", st.op),
                    ));
                };
                if st.args.len() != arity {
                    return Err(self.invalid(
                        "ops.yaml",
                        field(format!("steps[{j}].args")),
                        format!("'{}' takes {arity} arguments, got {}", st.op, st.args.len()),
                    ));
                }
                for a in &st.args {
                    if !values.contains(&a.as_str()) && !self.ops.constants.contains_key(a) {
                        return Err(self.invalid(
                            "ops.yaml",
                            field(format!("steps[{j}].args")),
                            format!("'{a}' is not an input, an earlier step or a constant"),
                        ));
                    }
                }
                if values.contains(&st.out.as_str()) || self.ops.constants.contains_key(&st.out) {
                    return Err(self.invalid(
                        "ops.yaml",
                        field(format!("steps[{j}].out")),
                        format!("'{}' is already defined", st.out),
                    ));
                }
                values.push(&st.out);
            }
            known.insert(&op.name, op.inputs.len());
        }
        Ok(())
    }

    fn validate_stages(&self) -> Result<(), SpecError> {
        let st = &self.stages;
        if st.lmax.min < 1 || st.lmax.min > st.lmax.max {
            return Err(self.invalid("stages.yaml", "lmax".into(), "need 1 <= min <= max"));
        }
        let mut seen = Vec::new();
        for (i, s) in st.stages.iter().enumerate() {
            let field = |f: &str| format!("stages[{i}] ({}).{f}", s.name);
            if seen.contains(&s.name) {
                return Err(self.invalid("stages.yaml", field("name"), "stage listed twice"));
            }
            seen.push(s.name);
            let sets_known = match s.kind {
                Kind::Gemm => self.tiles.gemm.contains_key(&s.tiles),
                Kind::Rows => self.tiles.rows.contains_key(&s.tiles),
            };
            if !sets_known {
                return Err(self.invalid(
                    "stages.yaml",
                    field("tiles"),
                    format!("no {:?} tile set '{}' in tiles.yaml", s.kind, s.tiles),
                ));
            }
            if s.dtypes.is_empty() || s.cf.is_empty() {
                return Err(self.invalid("stages.yaml", field("dtypes/cf"), "empty axis"));
            }
            if let Some(&bad) = s.cf.iter().find(|&&c| c == 0 || c % 8 != 0) {
                return Err(self.invalid(
                    "stages.yaml",
                    field("cf"),
                    format!("Cf {bad} is not a positive multiple of 8"),
                ));
            }
            if s.variant == Variant::Fused {
                if s.dtypes.iter().any(|&d| d != Dtype::F32) {
                    return Err(self.invalid("stages.yaml", field("dtypes"), "the fused backward is f32 only"));
                }
                if s.cf.iter().any(|&c| c >= 96) {
                    return Err(self.invalid("stages.yaml", field("cf"), "the fused backward supports Cf < 96 only"));
                }
            }
            for p in &s.params {
                if super::render::param_name(p).is_none() {
                    return Err(self.invalid("stages.yaml", field("params"), format!("cannot read parameter '{p}'")));
                }
            }
        }
        Ok(())
    }

    fn validate_tiles(&self) -> Result<(), SpecError> {
        for (set, tiles) in &self.tiles.gemm {
            for (i, t) in tiles.iter().enumerate() {
                let field = |f: &str| format!("gemm.{set}[{i}].{f}");
                for (name, v) in [("block_m", t.block_m), ("bn", t.bn), ("tm", t.tm), ("tn", t.tn)] {
                    if v == 0 {
                        return Err(self.invalid("tiles.yaml", field(name), "must be positive"));
                    }
                }
                let stages_ok = match t.pipe {
                    crate::kinds::Pipe::Regs => (1..=2).contains(&t.stages),
                    crate::kinds::Pipe::Async | crate::kinds::Pipe::Stream => (2..=4).contains(&t.stages),
                };
                if !stages_ok {
                    return Err(self.invalid(
                        "tiles.yaml",
                        field("stages"),
                        "1 or 2 with pipe: regs, 2 to 4 with pipe: async or stream",
                    ));
                }
                if t.min_blocks == 0 {
                    return Err(self.invalid("tiles.yaml", field("min_blocks"), "must be positive"));
                }
                if t.block_m % t.tm != 0 || t.bn % t.tn != 0 {
                    return Err(self.invalid("tiles.yaml", field("tm/tn"), "tm must divide block_m and tn divide bn"));
                }
                // Threads move 16-byte vectors: 4 floats (and 2 doubles).
                if t.tm % 4 != 0 || t.tn % 4 != 0 || t.bn % 4 != 0 {
                    return Err(self.invalid(
                        "tiles.yaml",
                        field("tm/tn/bn"),
                        "tm, tn and bn must be multiples of 4 (16-byte vectors)",
                    ));
                }
                let threads = (t.block_m / t.tm) * (t.bn / t.tn);
                if threads % 32 != 0 || threads > 1024 {
                    return Err(self.invalid(
                        "tiles.yaml",
                        field("block_m/bn/tm/tn"),
                        format!("{threads} threads: need a multiple of 32, at most 1024"),
                    ));
                }
            }
        }
        for (set, tiles) in &self.tiles.rows {
            for (i, t) in tiles.iter().enumerate() {
                if t.rows == 0 || t.threads == 0 || t.threads % 32 != 0 || t.threads > 1024 {
                    return Err(self.invalid(
                        "tiles.yaml",
                        format!("rows.{set}[{i}]"),
                        "rows > 0 and threads a multiple of 32, at most 1024",
                    ));
                }
                if t.min_blocks == 0 {
                    return Err(self.invalid("tiles.yaml", format!("rows.{set}[{i}].min_blocks"), "must be positive"));
                }
            }
        }
        Ok(())
    }
}
