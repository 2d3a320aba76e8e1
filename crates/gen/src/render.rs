//! Stage 3: CUDA C from the specs with tera. Templates stay thin: every value
//! they print (C spellings, layouts, argument lists) is computed here.

use super::expand::Instance;
use super::spec::{Kind, Specs};
use super::vocab::{primitive, PRIMITIVES};
use crate::kinds::{Dtype, Geometry, Variant};
use crate::params::Param;
use serde::Serialize;
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum RenderError {
    #[error("template {template}: {message}")]
    Tera { template: String, message: String },
}

/// Hand-written headers copied verbatim next to the rendered files.
pub const STATIC_HEADERS: [&str; 2] = ["core.cuh", "stages.cuh"];
/// The tera templates under templates/.
pub const TEMPLATES: [&str; 2] = ["ops.cuh.tera", "instance.cu.tera"];

pub struct Renderer {
    tera: tera::Tera,
}

fn tera_err(template: &str, e: tera::Error) -> RenderError {
    let mut message = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        message.push_str(&format!(": {s}"));
        src = s.source();
    }
    RenderError::Tera { template: template.to_string(), message }
}

#[derive(Serialize)]
struct PrimFn {
    name: &'static str,
    params: String,
    body: String,
}

#[derive(Serialize)]
struct PrimSet {
    ctype: &'static str,
    functions: Vec<PrimFn>,
}

#[derive(Serialize)]
struct OpStep {
    out: String,
    expr: String,
}

#[derive(Serialize)]
struct OpFn {
    name: String,
    doc: String,
    params: String,
    steps: Vec<OpStep>,
    result: String,
}

fn literal(v: f64) -> String {
    // Exact decimal for the constant; T(...) converts once, at compile time.
    format!("T({v:e})")
}

impl Renderer {
    pub fn new(templates: &Path) -> Result<Renderer, RenderError> {
        let mut tera = tera::Tera::default();
        for name in TEMPLATES {
            let path = templates.join(name);
            tera.add_template_file(&path, Some(name)).map_err(|e| tera_err(name, e))?;
        }
        // Unknown placeholders are errors, never silently empty.
        tera.autoescape_on(vec![]);
        Ok(Renderer { tera })
    }

    /// ops.cuh: the Prim<T> spellings and one op_* function per operator.
    pub fn ops_header(&self, specs: &Specs) -> Result<String, RenderError> {
        let prims: Vec<PrimSet> = [Dtype::F32, Dtype::F64]
            .into_iter()
            .map(|d| {
                let ct = d.c_type();
                PrimSet {
                    ctype: ct,
                    functions: PRIMITIVES
                        .iter()
                        .map(|p| {
                            let names: Vec<String> = ["a", "b", "c"][..p.arity].iter().map(|s| s.to_string()).collect();
                            PrimFn {
                                name: p.name,
                                params: names.iter().map(|n| format!("{ct} {n}")).collect::<Vec<_>>().join(", "),
                                body: p.call(d, &names),
                            }
                        })
                        .collect(),
                }
            })
            .collect();
        let consts = &specs.ops.constants;
        let operators: Vec<OpFn> = specs
            .ops
            .operators
            .iter()
            .map(|op| {
                let steps = op
                    .steps
                    .iter()
                    .map(|s| {
                        let args: Vec<String> = s
                            .args
                            .iter()
                            .map(|a| consts.get(a).map(|&v| literal(v)).unwrap_or_else(|| a.clone()))
                            .collect();
                        let expr = if primitive(&s.op).is_some() {
                            format!("Prim<T>::{}({})", s.op, args.join(", "))
                        } else {
                            format!("op_{}<T>({})", s.op, args.join(", "))
                        };
                        OpStep { out: s.out.clone(), expr }
                    })
                    .collect();
                OpFn {
                    name: op.name.clone(),
                    doc: op.doc.clone(),
                    params: op.inputs.iter().map(|i| format!("T {i}")).collect::<Vec<_>>().join(", "),
                    steps,
                    result: op.steps.last().map(|s| s.out.clone()).unwrap_or_default(),
                }
            })
            .collect();
        let mut ctx = tera::Context::new();
        ctx.insert("prims", &prims);
        ctx.insert("operators", &operators);
        self.tera.render("ops.cuh.tera", &ctx).map_err(|e| tera_err("ops.cuh.tera", e))
    }

    /// One instance's .cu file: constants, and one extern "C" entry calling its body.
    pub fn instance(&self, inst: &Instance) -> Result<String, RenderError> {
        let ct = inst.dtype.c_type();
        let params: Vec<String> = inst.params.iter().map(|p| p.replacen("T*", &format!("{ct}*"), 1)).collect();
        let args: Vec<String> = inst.params.iter().filter_map(|p| Param::parse(p).map(|p| p.name)).collect();
        let mut targs = vec![ct.to_string(), inst.cf.to_string()];
        match (inst.kind, inst.geometry) {
            (Kind::Gemm, Geometry::Gemm { block_m, bn, block_k, tm, tn, stages, pipe, precision, .. }) => {
                targs.extend(
                    [block_m, bn, block_k, tm, tn, stages, pipe.code(), precision.code()].map(|v| v.to_string()),
                );
            }
            (_, Geometry::Rows { rows, threads, .. }) => targs.extend([rows, threads].map(|v| v.to_string())),
            (Kind::Rows, Geometry::Gemm { .. }) => unreachable!("expand pairs kinds with geometries"),
        }
        targs.push("Smem".into());
        if let Some(seg) = inst.seg {
            targs.push(seg.to_string());
        }
        let l = &inst.layout;
        let producers = match inst.geometry {
            Geometry::Gemm { pipe, .. } if pipe.has_producers() => crate::kinds::WS_PRODUCER_THREADS,
            _ => 0,
        };
        // Every field is rendered; -1 marks a buffer the stage does not use.
        let opt = |v: Option<u32>| v.map(i64::from).unwrap_or(-1);
        let mut consts: Vec<(&str, i64)> = vec![
            ("apad", l.apad.into()),
            ("a_pitch", opt(l.a_pitch)),
            ("b_pitch", opt(l.b_pitch)),
            ("c_pitch", opt(l.c_pitch)),
            ("a_tile", opt(l.a_tile)),
            ("b_tile", opt(l.b_tile)),
            ("s_rows", opt(l.s_rows)),
            ("gzs_rows", opt(l.gzs_rows)),
            ("c_tile", opt(l.c_tile)),
            ("fixed", l.fixed.into()),
            ("sig_slot", opt(l.sig_slot)),
            ("glog_slot", opt(l.glog_slot)),
            ("glog_rows", opt(l.glog_rows)),
            ("panel", opt(l.panel)),
            ("producers", producers.into()),
        ];
        // setmaxnreg's counts, only where the tile sets `regs` (the
        // template's RegSplit reads 0 without them: other instances' files
        // stay as they were).
        if let Some((p, c)) = inst.geometry.setmaxnreg() {
            consts.extend([("producer_regs", p.into()), ("consumer_regs", c.into())]);
        }
        // gemm_wg's staged-epilogue batch, only in its instances (the relay's
        // wgmma tiles).
        if inst.variant == Variant::Relay {
            if let Some(b) = inst.geometry.epi_batch() {
                consts.push(("epi_batch", b.into()));
            }
        }
        // The split B chunks of the fused wgmma walks, likewise only where they are.
        if let Some(b) = l.b_split {
            consts.push(("b_split", b.into()));
        }
        let mut ctx = tera::Context::new();
        ctx.insert("name", &inst.name);
        ctx.insert("stage", inst.stage.as_str());
        ctx.insert("variant", inst.variant.as_str());
        ctx.insert("doc", &inst.doc);
        ctx.insert("dtype", inst.dtype.as_str());
        ctx.insert("cf", &inst.cf);
        ctx.insert("geometry", &inst.geometry.tag());
        ctx.insert("threads", &inst.threads());
        let min_blocks = match inst.geometry {
            Geometry::Gemm { min_blocks, .. } => min_blocks,
            Geometry::Rows { min_blocks, .. } => min_blocks,
        };
        ctx.insert("min_blocks", &min_blocks);
        ctx.insert("smem_fixed", &l.fixed);
        ctx.insert("smem_per_lg", &l.per_lg);
        ctx.insert("smem_consts", &consts);
        ctx.insert("params", &params);
        ctx.insert("args", &args);
        ctx.insert("body", &inst.body);
        ctx.insert("template_args", &targs);
        self.tera.render("instance.cu.tera", &ctx).map_err(|e| tera_err("instance.cu.tera", e))
    }
}
