//! A kernel parameter as specs/stages.yaml writes it ("const T* u",
//! "T* z", "long long E", "int L"), parsed once for the spec checks, the
//! rendered signatures and the generated Rust argument structs.

/// The C type of a kernel parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamType {
    /// `const T* name`: read.
    ConstPtr,
    /// `T* name`: written (and possibly read).
    MutPtr,
    /// `long long name`.
    I64,
    /// `int name`.
    I32,
}

/// One kernel parameter, as written in the spec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Param {
    pub ty: ParamType,
    /// The CUDA name (`E`, `u`, `g_next`).
    pub name: String,
}

impl Param {
    /// "const T* u", "T* z", "long long E", "int L"; anything else is `None`.
    pub fn parse(p: &str) -> Option<Param> {
        let words: Vec<&str> = p.split_whitespace().collect();
        let (ty, name) = match words.as_slice() {
            ["const", "T*", name] => (ParamType::ConstPtr, *name),
            ["T*", name] => (ParamType::MutPtr, *name),
            ["long", "long", name] => (ParamType::I64, *name),
            ["int", name] => (ParamType::I32, *name),
            _ => return None,
        };
        let ident = name.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        ident.then(|| Param { ty, name: name.to_string() })
    }

    /// The Rust field: the CUDA name in lower case (`E` -> `e`).
    pub fn field(&self) -> String {
        self.name.to_ascii_lowercase()
    }

    /// The field's Rust type, `P` being the pointer type parameter.
    pub fn rust_type(&self) -> &'static str {
        match self.ty {
            ParamType::ConstPtr | ParamType::MutPtr => "P",
            ParamType::I64 => "i64",
            ParamType::I32 => "i32",
        }
    }

    /// The parameter in the spec's spelling.
    pub fn c_decl(&self) -> String {
        let ty = match self.ty {
            ParamType::ConstPtr => "const T*",
            ParamType::MutPtr => "T*",
            ParamType::I64 => "long long",
            ParamType::I32 => "int",
        };
        format!("{ty} {}", self.name)
    }

    pub fn is_ptr(&self) -> bool {
        matches!(self.ty, ParamType::ConstPtr | ParamType::MutPtr)
    }
}
