//! The primitive operations an operator sequence (specs/ops.yaml) may use,
//! with their CUDA C spelling per dtype. Each is one correctly rounded
//! operation, so a rendered sequence leaves the compiler nothing to contract.

use crate::kinds::Dtype;

pub struct Primitive {
    pub name: &'static str,
    pub arity: usize,
    /// Call pattern with `{0}`, `{1}`, `{2}` for the arguments.
    pub f32: &'static str,
    pub f64: &'static str,
}

pub const PRIMITIVES: &[Primitive] = &[
    Primitive { name: "add", arity: 2, f32: "__fadd_rn({0}, {1})", f64: "__dadd_rn({0}, {1})" },
    Primitive { name: "sub", arity: 2, f32: "__fsub_rn({0}, {1})", f64: "__dsub_rn({0}, {1})" },
    Primitive { name: "mul", arity: 2, f32: "__fmul_rn({0}, {1})", f64: "__dmul_rn({0}, {1})" },
    Primitive { name: "fma", arity: 3, f32: "__fmaf_rn({0}, {1}, {2})", f64: "__fma_rn({0}, {1}, {2})" },
    Primitive { name: "div", arity: 2, f32: "__fdiv_rn({0}, {1})", f64: "__ddiv_rn({0}, {1})" },
    Primitive { name: "neg", arity: 1, f32: "(-{0})", f64: "(-{0})" },
    Primitive { name: "exp", arity: 1, f32: "::expf({0})", f64: "::exp({0})" },
    Primitive { name: "max", arity: 2, f32: "::fmaxf({0}, {1})", f64: "::fmax({0}, {1})" },
];

pub fn primitive(name: &str) -> Option<&'static Primitive> {
    PRIMITIVES.iter().find(|p| p.name == name)
}

impl Primitive {
    pub fn pattern(&self, dtype: Dtype) -> &'static str {
        match dtype {
            Dtype::F32 => self.f32,
            Dtype::F64 => self.f64,
        }
    }

    /// `pattern` with the argument names substituted.
    pub fn call(&self, dtype: Dtype, args: &[String]) -> String {
        let mut s = self.pattern(dtype).to_string();
        for (i, a) in args.iter().enumerate() {
            s = s.replace(&format!("{{{i}}}"), a);
        }
        s
    }
}
