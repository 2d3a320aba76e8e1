//! Stage 1 of the generator: the YAML specs, parsed into typed values.
//! Unknown fields are rejected; every error names the file, the line and
//! column (serde_yaml's, or found from the field path by [`super::locate`])
//! and the field. Every number is bounded here, so the arithmetic of
//! expansion and layout cannot overflow (and checks that it does not).

use crate::kinds::{Arch, Dtype, Geometry, Layers, Pass, Pipe, Precision, Serves, Stage, StageRole, Variant};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("{file}: cannot read: {source}")]
    Io { file: PathBuf, source: std::io::Error },
    #[error("{file}:{line}:{column}: {message}")]
    Yaml { file: PathBuf, line: usize, column: usize, message: String },
    #[error("{file}{loc}: {field}: {message}")]
    Invalid { file: PathBuf, loc: Loc, field: String, message: String },
}

/// Where in a file an [`SpecError::Invalid`] points: `:line:column`, or
/// nothing when the path could not be followed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Loc(pub Option<super::locate::Pos>);

impl std::fmt::Display for Loc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some((line, column)) => write!(f, ":{line}:{column}"),
            None => Ok(()),
        }
    }
}

/// Upper bounds of the spec's numbers: beyond them no sm_90 kernel exists,
/// and under them every product the generator forms fits in u32.
pub mod bounds {
    /// Channels per focus.
    pub const CF: u32 = 1024;
    pub const LMAX: u32 = 32;
    /// Rows or columns of a block's tile.
    pub const TILE: u32 = 4096;
    /// Elements per thread along one axis.
    pub const PER_THREAD: u32 = 64;
    pub const THREADS: u32 = 1024;
    /// Resident blocks per SM on sm_90.
    pub const MIN_BLOCKS: u32 = 32;
}

// ------------------------------------------------------------ specs/ops.yaml

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpsSpec {
    #[serde(deserialize_with = "unique_keys")]
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
    /// Target architectures, oldest first: every instance is built for each
    /// one its tile allows; the newest one's PTX also serves newer GPUs.
    pub archs: Vec<Arch>,
    pub lmax: LmaxRange,
    pub regime: Regime,
    pub stages: Vec<StageSpec>,
}

/// Where each path serves (stages.yaml `regime`).
#[derive(Debug, Deserialize, Clone, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Regime {
    /// The fused backward serves Cf below this.
    pub fused_cf_below: u32,
    /// The gate GEMMs run on cuBLAS from this Cf.
    pub cublas_gate_from_cf: u32,
    /// Where the switch's "on" takes the fused backward: where it was
    /// measured faster than the relay (none listed: nowhere).
    #[serde(default)]
    pub fused_faster: Vec<FusedFasterSpec>,
}

/// One `regime.fused_faster` entry: Cf, an lmax range, and the GPUs it was
/// measured on (a part of the device name, matched without case, as
/// tiles.yaml defaults are; none: every GPU without entries of its own).
#[derive(Debug, Deserialize, Clone, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct FusedFasterSpec {
    pub cf: u32,
    /// `[min, max]`, inclusive.
    pub lmax: [u32; 2],
    /// The mode it was measured in (default exact).
    #[serde(default)]
    pub precision: Precision,
    #[serde(default)]
    pub gpu: Option<String>,
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

/// Shared-memory buffers a stage body uses (sizes: crates/gen/src/layout.rs).
#[derive(Debug, Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum SmemBuf {
    ATile,
    BTile,
    SRows,
    GzsRows,
    SigRows,
    GlogitRows,
    /// g_logit for `GLOG_SUB_ROWS` (layout.rs) rows at a
    /// time (the fused backward's scalar chain, sub-block by sub-block).
    GlogitSub,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageSpec {
    pub name: Stage,
    pub variant: Variant,
    pub pass: Pass,
    pub layers: Layers,
    pub serves: Serves,
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
    #[serde(deserialize_with = "unique_keys")]
    pub gemm: BTreeMap<String, Vec<GemmTileSpec>>,
    #[serde(deserialize_with = "unique_keys")]
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
    pub pipe: Pipe,
    /// The block products' arithmetic (default exact); fp16x3 tiles run the
    /// compensated tensor-core core (docs/PRECISION.md).
    #[serde(default)]
    pub precision: Precision,
    /// The target archs this tile is built for (default: all of stages.yaml's).
    #[serde(default)]
    pub archs: Option<Vec<Arch>>,
    /// Registers per consumer thread (pipe: split, archs [sm_90]): the
    /// consumers raise their count to this with `setmaxnreg`, the producer
    /// warpgroup lowers its own to the rest of the block's registers.
    #[serde(default)]
    pub regs: Option<u32>,
}

impl GemmTileSpec {
    /// The tile's geometry at K chunk `block_k`.
    pub fn geometry(&self, block_k: u32) -> Geometry {
        Geometry::Gemm {
            block_m: self.block_m,
            bn: self.bn,
            block_k,
            tm: self.tm,
            tn: self.tn,
            stages: self.stages,
            min_blocks: self.min_blocks,
            pipe: self.pipe,
            precision: self.precision,
            regs: self.regs.unwrap_or(0),
        }
    }
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
    /// The target archs this tile is built for (default: all of stages.yaml's).
    #[serde(default)]
    pub archs: Option<Vec<Arch>>,
}

#[derive(Debug, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct DefaultSpec {
    pub stage: Stage,
    pub dtype: Dtype,
    pub cf: u32,
    /// The tile part of the canonical name, e.g. `m32_n64_k32_t4x4`.
    pub tile: String,
    /// The GPUs this default is for: a part of the device name, matched
    /// without case ("H200", "A100"); none: every GPU without one of its own.
    #[serde(default)]
    pub gpu: Option<String>,
    /// The mode the default serves (default exact): each mode has its own
    /// defaults, and the tile named must be of that precision.
    #[serde(default)]
    pub precision: Precision,
}

// ------------------------------------------------------------ unique keys

/// A map whose keys are unique: YAML allows a key twice and serde keeps the
/// last, silently (`constants: {one: 1.0, one: 2.0}` would make `one` 2.0).
/// The second is refused as the field `map.key` (serde_yaml's path), at its
/// value's line, as struct fields listed twice are.
fn unique_keys<'de, D, V>(d: D) -> Result<BTreeMap<String, V>, D::Error>
where
    D: serde::Deserializer<'de>,
    V: Deserialize<'de>,
{
    struct Keys<V>(std::marker::PhantomData<V>);
    impl<'de, V: Deserialize<'de>> serde::de::Visitor<'de> for Keys<V> {
        type Value = BTreeMap<String, V>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a map")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut out = BTreeMap::new();
            while let Some(k) = map.next_key::<String>()? {
                if out.contains_key(&k) {
                    // Refused from inside the value, so that the error
                    // carries its path (`constants.one`) and line.
                    match map.next_value_seed(Twice)? {}
                }
                let v = map.next_value()?;
                out.insert(k, v);
            }
            Ok(out)
        }
    }
    d.deserialize_map(Keys(std::marker::PhantomData))
}

/// The value of a key listed twice: refused, whatever it is.
struct Twice;

impl<'de> serde::de::DeserializeSeed<'de> for Twice {
    type Value = std::convert::Infallible;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

macro_rules! refuse {
    ($($f:ident($($t:ty)?)),* $(,)?) => {$(
        fn $f<E: serde::de::Error>(self $(, _: $t)?) -> Result<Self::Value, E> {
            Err(E::custom(Self::MESSAGE))
        }
    )*};
}

impl Twice {
    const MESSAGE: &'static str = "listed twice: a key may appear once (YAML would keep the last, silently)";
}

impl<'de> serde::de::Visitor<'de> for Twice {
    type Value = std::convert::Infallible;
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a key listed once")
    }
    refuse!(
        visit_bool(bool),
        visit_i64(i64),
        visit_u64(u64),
        visit_i128(i128),
        visit_u128(u128),
        visit_f64(f64),
        visit_str(&str),
        visit_bytes(&[u8]),
        visit_none(),
        visit_unit(),
    );
    fn visit_some<D: serde::Deserializer<'de>>(self, _: D) -> Result<Self::Value, D::Error> {
        Err(serde::de::Error::custom(Self::MESSAGE))
    }
    fn visit_newtype_struct<D: serde::Deserializer<'de>>(self, _: D) -> Result<Self::Value, D::Error> {
        Err(serde::de::Error::custom(Self::MESSAGE))
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
        Err(serde::de::Error::custom(Self::MESSAGE))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
        Err(serde::de::Error::custom(Self::MESSAGE))
    }
    fn visit_enum<A: serde::de::EnumAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
        Err(serde::de::Error::custom(Self::MESSAGE))
    }
}

// ----------------------------------------------------------------- loading

/// All specs of one directory, parsed and validated.
#[derive(Debug)]
pub struct Specs {
    pub dir: PathBuf,
    pub ops: OpsSpec,
    pub stages: StagesSpec,
    pub tiles: TilesSpec,
    /// Each file's text (by file name), to place errors.
    texts: BTreeMap<&'static str, String>,
}

fn read(file: &Path) -> Result<String, SpecError> {
    std::fs::read_to_string(file).map_err(|source| SpecError::Io { file: file.to_path_buf(), source })
}

/// Parses one spec text; `file` is only used in errors.
pub fn parse_str<T: for<'de> Deserialize<'de>>(file: &Path, text: &str) -> Result<T, SpecError> {
    serde_yaml::from_str(text).map_err(|e| {
        let (line, column) = e.location().map(|l| (l.line(), l.column())).unwrap_or((0, 0));
        SpecError::Yaml { file: file.to_path_buf(), line, column, message: e.to_string() }
    })
}

/// The three spec files, in the order [`from_texts`] takes them.
pub const FILES: [&str; 3] = ["ops.yaml", "stages.yaml", "tiles.yaml"];

pub fn load(dir: &Path) -> Result<Specs, SpecError> {
    let [ops, stages, tiles] = FILES.map(|f| read(&dir.join(f)));
    from_texts(dir, [ops?, stages?, tiles?])
}

/// Parse and validate the texts of [`FILES`]; `dir` names them in errors.
pub fn from_texts(dir: &Path, [ops, stages, tiles]: [String; 3]) -> Result<Specs, SpecError> {
    let texts = BTreeMap::from([(FILES[0], ops), (FILES[1], stages), (FILES[2], tiles)]);
    let specs = Specs {
        dir: dir.to_path_buf(),
        ops: parse_str(&dir.join("ops.yaml"), &texts["ops.yaml"])?,
        stages: parse_str(&dir.join("stages.yaml"), &texts["stages.yaml"])?,
        tiles: parse_str(&dir.join("tiles.yaml"), &texts["tiles.yaml"])?,
        texts,
    };
    specs.validate()?;
    Ok(specs)
}

impl Specs {
    /// An error at `field` of `file` (one of the three spec files), placed
    /// at its line and column.
    pub fn invalid(&self, file: &str, field: String, message: impl Into<String>) -> SpecError {
        let loc = Loc(self.texts.get(file).and_then(|t| super::locate::locate(t, &field)));
        SpecError::Invalid { file: self.dir.join(file), loc, field, message: message.into() }
    }

    /// Cross-reference checks serde cannot do.
    pub fn validate(&self) -> Result<(), SpecError> {
        self.validate_ops()?;
        self.validate_stages()?;
        self.validate_tiles()
    }

    fn validate_ops(&self) -> Result<(), SpecError> {
        let consts = &self.ops.constants;
        for (name, &v) in consts {
            let field = format!("constants.{name}");
            // Rendered as literals, never by name: an identifier to read.
            if let Some(m) = crate::params::not_ident(name) {
                return Err(self.invalid("ops.yaml", field, m));
            }
            if !v.is_finite() {
                return Err(self.invalid("ops.yaml", field, format!("{v:e}: not a finite number")));
            }
            // Rendered T(v): where T is float, beyond f32's range is inf.
            if v.abs() > f64::from(f32::MAX) {
                return Err(self.invalid(
                    "ops.yaml",
                    field,
                    format!("{v:e}: beyond f32's range (inf in the f32 kernels)"),
                ));
            }
        }
        let mut known: BTreeMap<&str, usize> = BTreeMap::new();
        for p in super::vocab::PRIMITIVES {
            known.insert(p.name, p.arity);
        }
        for (i, op) in self.ops.operators.iter().enumerate() {
            let field = |s: String| format!("operators[{i}] ({}).{s}", op.name);
            // A value of the rendered op_* function: a usable identifier
            // (`op_*` are the operators' functions), not a constant.
            let value_problem = |v: &str| {
                crate::params::ident_problem(v).or_else(|| {
                    v.starts_with("op_").then(|| format!("'{v}' is reserved: op_* name the operators' functions"))
                })
            };
            // Rendered as the function op_<name>.
            if let Some(m) = crate::params::ident_problem(&format!("op_{}", op.name)) {
                return Err(self.invalid("ops.yaml", field("name".into()), m));
            }
            if known.contains_key(op.name.as_str()) {
                return Err(self.invalid("ops.yaml", field("name".into()), "name already defined"));
            }
            if let Some(m) = crate::params::comment_problem(&op.doc) {
                return Err(self.invalid("ops.yaml", field("doc".into()), m));
            }
            for (j, x) in op.inputs.iter().enumerate() {
                let m = if let Some(m) = value_problem(x) {
                    m
                } else if consts.contains_key(x) {
                    format!("'{x}' is already a constant")
                } else if op.inputs[..j].contains(x) {
                    format!("'{x}' listed twice")
                } else {
                    continue;
                };
                return Err(self.invalid("ops.yaml", field("inputs".into()), m));
            }
            if op.steps.is_empty() {
                return Err(self.invalid("ops.yaml", field("steps".into()), "no steps"));
            }
            let mut values: Vec<&str> = op.inputs.iter().map(String::as_str).collect();
            for (j, st) in op.steps.iter().enumerate() {
                if let Some(m) = value_problem(&st.out) {
                    return Err(self.invalid("ops.yaml", field(format!("steps[{j}].out")), m));
                }
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

    /// `regime.fused_faster`: each entry a Cf the fused stage is built for,
    /// an lmax range inside the build's, a non-empty GPU name; no two
    /// entries for one GPU key (or both generic) overlap at a Cf and mode.
    fn validate_fused_faster(&self) -> Result<(), SpecError> {
        let st = &self.stages;
        let fused_cf: Vec<u32> =
            st.stages.iter().filter(|s| s.variant == Variant::Fused).flat_map(|s| s.cf.iter().copied()).collect();
        let gpu_of = |x: &FusedFasterSpec| x.gpu.as_deref().map(|g| g.trim().to_ascii_lowercase());
        let list = &st.regime.fused_faster;
        for (i, x) in list.iter().enumerate() {
            let field = |f: &str| format!("regime.fused_faster[{i}].{f}");
            if !fused_cf.contains(&x.cf) {
                return Err(self.invalid(
                    "stages.yaml",
                    field("cf"),
                    format!("Cf {}: no fused stage is built for it (built: {fused_cf:?})", x.cf),
                ));
            }
            let [lo, hi] = x.lmax;
            if lo < st.lmax.min || lo > hi || hi > st.lmax.max {
                return Err(self.invalid(
                    "stages.yaml",
                    field("lmax"),
                    format!("[{lo}, {hi}]: need {} <= min <= max <= {} (stages.yaml lmax)", st.lmax.min, st.lmax.max),
                ));
            }
            if x.gpu.as_deref().is_some_and(|g| g.trim().is_empty()) {
                return Err(self.invalid("stages.yaml", field("gpu"), "an empty GPU name"));
            }
            if let Some(j) = list[..i].iter().position(|y| {
                (y.cf, y.precision) == (x.cf, x.precision)
                    && gpu_of(y) == gpu_of(x)
                    && y.lmax[0] <= hi
                    && lo <= y.lmax[1]
            }) {
                return Err(self.invalid(
                    "stages.yaml",
                    field("lmax"),
                    format!("overlaps regime.fused_faster[{j}] at Cf {} in {} for the same GPU", x.cf, x.precision),
                ));
            }
        }
        Ok(())
    }

    fn validate_stages(&self) -> Result<(), SpecError> {
        let st = &self.stages;
        if st.lmax.min < 1 || st.lmax.min > st.lmax.max || st.lmax.max > bounds::LMAX {
            return Err(self.invalid(
                "stages.yaml",
                "lmax".into(),
                format!("need 1 <= min <= max <= {}", bounds::LMAX),
            ));
        }
        for (name, v) in
            [("fused_cf_below", st.regime.fused_cf_below), ("cublas_gate_from_cf", st.regime.cublas_gate_from_cf)]
        {
            if v == 0 || v > bounds::CF + 1 {
                return Err(self.invalid(
                    "stages.yaml",
                    format!("regime.{name}"),
                    format!("{v}: must be positive and at most {}", bounds::CF + 1),
                ));
            }
        }
        self.validate_fused_faster()?;
        if st.archs.is_empty() || !st.archs.windows(2).all(|w| w[0] < w[1]) {
            return Err(self.invalid(
                "stages.yaml",
                "archs".into(),
                "need at least one arch, oldest first, none twice",
            ));
        }
        let mut seen = Vec::new();
        for (i, s) in st.stages.iter().enumerate() {
            let field = |f: &str| format!("stages[{i}] ({}).{f}", s.name);
            if seen.contains(&s.name) {
                return Err(self.invalid("stages.yaml", field("name"), "stage listed twice"));
            }
            seen.push(s.name);
            // `body` is the template function of templates/stages.cuh the
            // instance calls (`ms::body<...>(...)`); `doc` a comment line.
            if let Some(m) = crate::params::ident_problem(&s.body) {
                return Err(self.invalid("stages.yaml", field("body"), m));
            }
            if let Some(m) = crate::params::comment_problem(&s.doc) {
                return Err(self.invalid("stages.yaml", field("doc"), m));
            }
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
            if let Some(&bad) = s.cf.iter().find(|&&c| c == 0 || c % 8 != 0 || c > bounds::CF) {
                return Err(self.invalid(
                    "stages.yaml",
                    field("cf"),
                    format!("Cf {bad} is not a positive multiple of 8 up to {}", bounds::CF),
                ));
            }
            if let Some(dup) = first_repeat(&s.cf) {
                return Err(self.invalid("stages.yaml", field("cf"), format!("Cf {dup} listed twice")));
            }
            if let Some(dup) = first_repeat(&s.dtypes) {
                return Err(self.invalid("stages.yaml", field("dtypes"), format!("{dup} listed twice")));
            }
            if s.variant == Variant::Fused {
                if s.dtypes.iter().any(|&d| d != Dtype::F32) {
                    return Err(self.invalid("stages.yaml", field("dtypes"), "the fused backward is f32 only"));
                }
                let below = self.stages.regime.fused_cf_below;
                if let Some(c) = s.cf.iter().find(|&&c| c >= below) {
                    return Err(self.invalid(
                        "stages.yaml",
                        field("cf"),
                        format!("Cf {c}: the fused backward serves Cf below regime.fused_cf_below = {below}"),
                    ));
                }
                if (s.pass, s.layers) != (Pass::Backward, Layers::Gated) {
                    return Err(self.invalid(
                        "stages.yaml",
                        field("pass"),
                        "a fused stage is a backward gated-layer stage",
                    ));
                }
            }
            if s.serves == Serves::CublasGate {
                let from = self.stages.regime.cublas_gate_from_cf;
                if let Some(c) = s.cf.iter().find(|&&c| c < from) {
                    return Err(self.invalid(
                        "stages.yaml",
                        field("cf"),
                        format!("Cf {c}: a cublas_gate stage serves from regime.cublas_gate_from_cf = {from}"),
                    ));
                }
            }
            let mut params: Vec<crate::params::Param> = Vec::new();
            for p in &s.params {
                let Some(p) = crate::params::Param::parse(p) else {
                    return Err(self.invalid("stages.yaml", field("params"), format!("cannot read parameter '{p}'")));
                };
                let m = if let Some(m) = p.name_problem() {
                    m
                } else if params.iter().any(|q| q.name == p.name) {
                    format!("'{}' listed twice", p.name)
                } else if let Some(q) = params.iter().find(|q| q.field() == p.field()) {
                    format!("'{}' and '{}' are both the Rust field '{}'", q.name, p.name, p.field())
                } else {
                    params.push(p);
                    continue;
                };
                return Err(self.invalid("stages.yaml", field("params"), m));
            }
        }
        Ok(())
    }

    /// Every stage's role, in spec order.
    pub fn roles(&self) -> Vec<StageRole> {
        let r = |s: &StageSpec| StageRole {
            stage: s.name,
            variant: s.variant,
            pass: s.pass,
            layers: s.layers,
            serves: s.serves,
        };
        self.stages.stages.iter().map(r).collect()
    }

    /// `name` within `1..=max`, or an error at `field`.
    fn bounded(&self, field: String, name: &str, v: u32, max: u32) -> Result<(), SpecError> {
        if v == 0 || v > max {
            return Err(self.invalid("tiles.yaml", field, format!("{name} {v}: must be positive and at most {max}")));
        }
        Ok(())
    }

    /// An entry's dtypes and Cf lists: non-empty, no repeats.
    fn axes(&self, field: &dyn Fn(&str) -> String, dtypes: &[Dtype], cf: &[u32]) -> Result<(), SpecError> {
        if dtypes.is_empty() || cf.is_empty() {
            return Err(self.invalid("tiles.yaml", field("dtypes"), "empty dtypes or cf: the entry builds nothing"));
        }
        if let Some(d) = first_repeat(dtypes) {
            return Err(self.invalid("tiles.yaml", field("dtypes"), format!("{d} listed twice")));
        }
        if let Some(c) = first_repeat(cf) {
            return Err(self.invalid("tiles.yaml", field("cf"), format!("Cf {c} listed twice")));
        }
        Ok(())
    }

    fn validate_tiles(&self) -> Result<(), SpecError> {
        use bounds::{MIN_BLOCKS, PER_THREAD, THREADS, TILE};
        // The first fp16x3 tile: (set, index, block_k).
        let mut first_x3: Option<(&str, usize, BlockK)> = None;
        for (set, tiles) in &self.tiles.gemm {
            for (i, t) in tiles.iter().enumerate() {
                let field = |f: &str| format!("gemm.{set}[{i}].{f}");
                self.axes(&field, &t.dtypes, &t.cf)?;
                self.tile_archs(field("archs"), t.archs.as_deref())?;
                for (name, v, max) in [
                    ("block_m", t.block_m, TILE),
                    ("bn", t.bn, TILE),
                    ("tm", t.tm, PER_THREAD),
                    ("tn", t.tn, PER_THREAD),
                    ("min_blocks", t.min_blocks, MIN_BLOCKS),
                ] {
                    self.bounded(field(name), name, v, max)?;
                }
                if let BlockK::Fixed(k) = t.block_k {
                    self.bounded(field("block_k"), "block_k", k, TILE)?;
                }
                let stages_ok = match t.pipe {
                    Pipe::Regs => (1..=2).contains(&t.stages),
                    Pipe::Async | Pipe::Stream | Pipe::Ws | Pipe::Split | Pipe::Wgmma | Pipe::SplitWgmma => {
                        (2..=4).contains(&t.stages)
                    }
                };
                if !stages_ok {
                    return Err(self.invalid(
                        "tiles.yaml",
                        field("stages"),
                        "1 or 2 with pipe: regs, 2 to 4 with pipe: async, stream, ws, split, wgmma or split_wgmma",
                    ));
                }
                if t.pipe.wgmma() && t.precision != Precision::Fp16x3 {
                    return Err(self.invalid(
                        "tiles.yaml",
                        field("pipe"),
                        "pipe wgmma and split_wgmma run the fp16x3 products: precision fp16x3",
                    ));
                }
                if t.precision == Precision::Fp16x3 {
                    self.fp16x3_tile(&field, t)?;
                    // The chunk width is part of the mode's arithmetic (a
                    // scale and a fold per chunk): one for every fp16x3 tile,
                    // so that any of them, relay or fused, gives the same bits.
                    let (fs, fi, fk) = *first_x3.get_or_insert((set.as_str(), i, t.block_k));
                    if fk != t.block_k {
                        return Err(self.invalid(
                            "tiles.yaml",
                            field("block_k"),
                            format!(
                                "precision fp16x3: every fp16x3 tile must have one block_k (the mode's chunk width: relay and fused give the same bits only with one), as gemm.{fs}[{fi}] (line {})",
                                self.line_of("tiles.yaml", &format!("gemm.{fs}[{fi}]"))
                            ),
                        ));
                    }
                }
                if t.block_m % t.tm != 0 || t.bn % t.tn != 0 {
                    return Err(self.invalid("tiles.yaml", field("tm"), "tm must divide block_m and tn divide bn"));
                }
                // Threads move 16-byte vectors: 4 floats (and 2 doubles).
                if t.tm % 4 != 0 || t.tn % 4 != 0 || t.bn % 4 != 0 {
                    return Err(self.invalid(
                        "tiles.yaml",
                        field("tm"),
                        "tm, tn and bn must be multiples of 4 (16-byte vectors)",
                    ));
                }
                // The block: the GEMM's threads, and the producers beside them
                // with pipe: ws or split.
                let producers = if t.pipe.has_producers() { crate::kinds::WS_PRODUCER_THREADS } else { 0 };
                let n = crate::kinds::gemm_threads(t.block_m, t.bn, t.tm, t.tn, t.pipe);
                if !n.is_multiple_of(32) || n + producers as u64 > THREADS as u64 {
                    let plus = if producers > 0 { format!(" (+ {producers} producers)") } else { String::new() };
                    let how =
                        if t.pipe.wgmma() { "2 * block_m (a warpgroup per 64 rows)" } else { "(block_m/tm) * (bn/tn)" };
                    return Err(self.invalid(
                        "tiles.yaml",
                        field("block_m"),
                        format!("{how} = {n} threads{plus}: need a multiple of 32, at most {THREADS} in all"),
                    ));
                }
                if let Some(regs) = t.regs {
                    self.regs_tile(&field, t, regs)?;
                }
                if let Some(j) = tiles[..i].iter().position(|u| same_tile(u, t)) {
                    return Err(self.invalid(
                        "tiles.yaml",
                        field("block_m"),
                        format!(
                            "the same tile as gemm.{set}[{j}] (line {}) for a shared dtype and Cf: two instances would share one name",
                            self.line_of("tiles.yaml", &format!("gemm.{set}[{j}]"))
                        ),
                    ));
                }
            }
        }
        for (set, tiles) in &self.tiles.rows {
            for (i, t) in tiles.iter().enumerate() {
                let field = |f: &str| format!("rows.{set}[{i}].{f}");
                self.axes(&field, &t.dtypes, &t.cf)?;
                self.tile_archs(field("archs"), t.archs.as_deref())?;
                self.bounded(field("rows"), "rows", t.rows, TILE)?;
                self.bounded(field("threads"), "threads", t.threads, THREADS)?;
                self.bounded(field("min_blocks"), "min_blocks", t.min_blocks, MIN_BLOCKS)?;
                if t.threads % 32 != 0 {
                    return Err(self.invalid("tiles.yaml", field("threads"), "threads must be a multiple of 32"));
                }
                let dup = tiles[..i].iter().position(|u| {
                    (u.rows, u.threads, u.min_blocks) == (t.rows, t.threads, t.min_blocks) && overlaps(u, t)
                });
                if let Some(j) = dup {
                    return Err(self.invalid(
                        "tiles.yaml",
                        field("rows"),
                        format!(
                            "the same tile as rows.{set}[{j}] (line {}) for a shared dtype and Cf: two instances would share one name",
                            self.line_of("tiles.yaml", &format!("rows.{set}[{j}]"))
                        ),
                    ));
                }
            }
        }
        self.validate_defaults()
    }

    /// `regs`: `setmaxnreg` (sm_90a) between the split pipe's two
    /// warpgroup-aligned sides, each side's count in 24..=256 and a
    /// multiple of 8, the consumers' above the launch cap (else the move
    /// gives nothing), and the two within the block's registers.
    fn regs_tile(&self, field: &dyn Fn(&str) -> String, t: &GemmTileSpec, regs: u32) -> Result<(), SpecError> {
        let bad = |m: String| Err(self.invalid("tiles.yaml", field("regs"), m));
        if t.pipe != Pipe::Split {
            return bad("regs moves registers from the producers to the consumers: pipe split only".into());
        }
        if t.archs.as_deref() != Some(&[Arch::Sm90]) {
            return bad("regs uses setmaxnreg, an sm_90a instruction: the tile needs `archs: [sm_90]`".into());
        }
        let g = t.geometry(0);
        let consumers = g.consumer_threads();
        if !consumers.is_multiple_of(128) {
            return bad(format!(
                "setmaxnreg runs per warpgroup: (block_m/tm) * (bn/tn) = {consumers} consumers, not a multiple of 128"
            ));
        }
        if !regs.is_multiple_of(8) {
            return bad(format!("{regs}: setmaxnreg takes a multiple of 8"));
        }
        if !(24..=256).contains(&regs) {
            return bad(format!("{regs}: setmaxnreg takes 24 to 256 registers per thread"));
        }
        let cap = g.launch_regs();
        if regs <= cap {
            return bad(format!("{regs} is not above the launch cap of {cap} registers per thread: nothing to move"));
        }
        match g.setmaxnreg() {
            Some((producers, _)) if producers >= 24 => Ok(()),
            _ => bad(format!(
                "{consumers} consumers at {regs} leave the {} producers fewer than 24 registers each (the block has {cap} per thread)",
                crate::kinds::WS_PRODUCER_THREADS
            )),
        }
    }

    /// What the fp16x3 core (templates/core.cuh: x3::chunk) is written for:
    /// f32 operands, a persistent cp.async ring (pipe: stream; the fused
    /// backward's split walk too; pipe: wgmma, gemm_wg in the relay and the
    /// fused stream walk, and split_wgmma, the split walk on wgmma: each
    /// their own shape), one warp per 32 x 32
    /// output tile (tm 8 x tn 4 outputs per thread) and whole m16n8k16 steps
    /// per K chunk.
    fn fp16x3_tile(&self, field: &dyn Fn(&str) -> String, t: &GemmTileSpec) -> Result<(), SpecError> {
        let bad = |f: &str, m: &str| Err(self.invalid("tiles.yaml", field(f), format!("precision fp16x3: {m}")));
        if t.dtypes != [Dtype::F32] {
            return bad("dtypes", "the compensated products take f32 operands: dtypes [f32]");
        }
        if !matches!(t.pipe, Pipe::Stream | Pipe::Split | Pipe::Wgmma | Pipe::SplitWgmma) {
            return bad(
                "pipe",
                "the core runs on the persistent ring: pipe stream (or split, fused; or wgmma, split_wgmma)",
            );
        }
        if t.pipe.wgmma() {
            // A warpgroup per 64 rows, one m64n64k16 product per k16 step
            // and column tile, Hopper only (the fused walks take block_m
            // 64 or 128: expand.rs prunes 192 there).
            if !matches!(t.block_m, 64 | 128 | 192) {
                return bad("block_m", "pipe wgmma and split_wgmma: block_m 64, 128 or 192 (a warpgroup per 64 rows)");
            }
            // pipe wgmma: one A split for bn / 64 m64n64k16 tiles (gemm_wg;
            // the fused set takes 64: expand.rs prunes the rest there)
            let split = t.pipe == Pipe::SplitWgmma;
            if !matches!(t.bn, 64 | 128 | 192) || (split && t.bn != 64) {
                return bad("bn", "pipe wgmma: bn 64, 128 or 192 (m64n64k16 tiles); split_wgmma: bn 64");
            }
        }
        if t.pipe.wgmma() && t.archs.as_deref() != Some(&[Arch::Sm90][..]) {
            return bad("archs", "pipe wgmma and split_wgmma use Hopper's warpgroup MMA: archs [sm_90]");
        }
        for (f, v, want) in [("tm", t.tm, 8), ("tn", t.tn, 4)] {
            if v != want {
                return bad(f, "one warp per 32 x 32 output tile: tm 8, tn 4");
            }
        }
        for (f, v) in [("block_m", t.block_m), ("bn", t.bn)] {
            if !v.is_multiple_of(32) {
                return bad(f, "block_m and bn must be multiples of 32 (whole warp tiles)");
            }
        }
        if !matches!(t.block_k, BlockK::Fixed(k) if k.is_multiple_of(16)) {
            return bad("block_k", "a number, a multiple of 16 (whole m16n8k16 steps)");
        }
        Ok(())
    }

    /// A tile's own `archs`: a non-empty subset of stages.yaml's, none twice.
    fn tile_archs(&self, field: String, archs: Option<&[Arch]>) -> Result<(), SpecError> {
        let Some(archs) = archs else { return Ok(()) };
        let targets = &self.stages.archs;
        if archs.is_empty() || first_repeat(archs).is_some() {
            return Err(self.invalid("tiles.yaml", field, "need at least one arch, none twice"));
        }
        if let Some(a) = archs.iter().find(|a| !targets.contains(a)) {
            let built: Vec<&str> = targets.iter().map(|t| t.as_str()).collect();
            return Err(self.invalid(
                "tiles.yaml",
                field,
                format!("{a} is not a target of stages.yaml `archs` ({})", built.join(", ")),
            ));
        }
        Ok(())
    }

    /// The archs a tile is built for: its own `archs`, else every target,
    /// oldest first.
    pub fn archs_of(&self, tile_archs: Option<&[Arch]>) -> Vec<Arch> {
        let targets = &self.stages.archs;
        targets.iter().copied().filter(|a| tile_archs.is_none_or(|t| t.contains(a))).collect()
    }

    /// One default per (stage, dtype, Cf, GPU, precision): with two, the
    /// winner would be whichever the table met first.
    fn validate_defaults(&self) -> Result<(), SpecError> {
        let d = &self.tiles.defaults;
        let gpu_of = |x: &DefaultSpec| x.gpu.as_deref().map(str::to_ascii_lowercase);
        for (i, x) in d.iter().enumerate() {
            if x.gpu.as_deref().is_some_and(|g| g.trim().is_empty()) {
                return Err(self.invalid("tiles.yaml", format!("defaults[{i}].gpu"), "an empty GPU name"));
            }
            let key = (x.stage, x.dtype, x.cf, gpu_of(x), x.precision);
            if let Some(j) = d[..i].iter().position(|y| (y.stage, y.dtype, y.cf, gpu_of(y), y.precision) == key) {
                let on = x.gpu.as_deref().map_or(String::new(), |g| format!(" on GPU {g}"));
                let on = match x.precision {
                    Precision::Exact => on,
                    p => format!("{on} in the {p} mode"),
                };
                return Err(self.invalid(
                    "tiles.yaml",
                    format!("defaults[{i}]"),
                    format!(
                        "a second default for ({}, {}, Cf {}){on}: defaults[{j}] (line {}) names {}",
                        x.stage,
                        x.dtype,
                        x.cf,
                        self.line_of("tiles.yaml", &format!("defaults[{j}]")),
                        d[j].tile
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The line of `field` in `file`, or `?`.
    pub fn line_of(&self, file: &str, field: &str) -> String {
        self.texts
            .get(file)
            .and_then(|t| super::locate::locate(t, field))
            .map_or_else(|| "?".into(), |(line, _)| line.to_string())
    }
}

/// The first value listed twice.
fn first_repeat<T: PartialEq + Copy>(v: &[T]) -> Option<T> {
    v.iter().enumerate().find(|(i, x)| v[..*i].contains(x)).map(|(_, x)| *x)
}

fn shares_axis<T: PartialEq>(a: &[T], b: &[T]) -> bool {
    a.iter().any(|x| b.contains(x))
}

fn overlaps(a: &RowsTileSpec, b: &RowsTileSpec) -> bool {
    shares_axis(&a.dtypes, &b.dtypes) && shares_axis(&a.cf, &b.cf)
}

/// Two GEMM entries that give one (dtype, Cf) the same geometry, hence one
/// name (`block_k: cf` equals the number Cf).
fn same_tile(a: &GemmTileSpec, b: &GemmTileSpec) -> bool {
    let rest = |t: &GemmTileSpec| (t.block_m, t.bn, t.tm, t.tn, t.stages, t.min_blocks, t.pipe, t.precision, t.regs);
    if rest(a) != rest(b) || !shares_axis(&a.dtypes, &b.dtypes) {
        return false;
    }
    a.cf.iter().filter(|c| b.cf.contains(c)).any(|&c| {
        let k = |t: &GemmTileSpec| match t.block_k {
            BlockK::Fixed(k) => k,
            BlockK::Named(_) => c,
        };
        k(a) == k(b)
    })
}
