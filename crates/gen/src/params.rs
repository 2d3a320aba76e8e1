//! A kernel parameter as specs/stages.yaml writes it ("const T* u",
//! "T* z", "long long E", "int L"), parsed once for the spec checks, the
//! rendered signatures and the generated Rust argument structs.

/// A C identifier: a letter or `_`, then letters, digits and `_`.
pub fn is_ident(name: &str) -> bool {
    name.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Why `name` is not an identifier (`None`: it is one).
pub fn not_ident(name: &str) -> Option<String> {
    (!is_ident(name)).then(|| format!("'{name}' is not an identifier (a letter or _, then letters, digits and _)"))
}

/// Names the specs may not give what the rendered code declares: C++ keywords
/// and alternative tokens, CUDA's built-in variables, and the names in scope
/// where spec names are rendered (ops.cuh's template parameter `T`; `Prim`,
/// `Vec`, `Smem`, the namespace `ms`).
#[rustfmt::skip]
const RESERVED: &[&str] = &[
    // C++20 keywords
    "alignas", "alignof", "asm", "auto", "bool", "break", "case", "catch", "char", "char8_t", "char16_t",
    "char32_t", "class", "concept", "const", "consteval", "constexpr", "constinit", "const_cast", "continue",
    "co_await", "co_return", "co_yield", "decltype", "default", "delete", "do", "double", "dynamic_cast", "else",
    "enum", "explicit", "export", "extern", "false", "float", "for", "friend", "goto", "if", "inline", "int",
    "long", "mutable", "namespace", "new", "noexcept", "nullptr", "operator", "private", "protected", "public",
    "register", "reinterpret_cast", "requires", "return", "short", "signed", "sizeof", "static", "static_assert",
    "static_cast", "struct", "switch", "template", "this", "thread_local", "throw", "true", "try", "typedef",
    "typeid", "typename", "union", "unsigned", "using", "virtual", "void", "volatile", "wchar_t", "while",
    // alternative tokens
    "and", "and_eq", "bitand", "bitor", "compl", "not", "not_eq", "or", "or_eq", "xor", "xor_eq",
    // CUDA built-ins
    "threadIdx", "blockIdx", "blockDim", "gridDim", "warpSize",
    // what is in scope where spec names are rendered
    "T", "Prim", "Vec", "Smem", "ms",
];

/// Rust's keywords: a kernel parameter is also a Rust field (in lower case).
#[rustfmt::skip]
const RUST_KEYWORDS: &[&str] = &[
    "as", "async", "await", "break", "const", "continue", "crate", "dyn", "else", "enum", "extern", "false", "fn",
    "for", "if", "impl", "in", "let", "loop", "match", "mod", "move", "mut", "pub", "ref", "return", "self", "static",
    "struct", "super", "trait", "true", "type", "unsafe", "use", "where", "while", "abstract", "become", "box", "do",
    "final", "gen", "macro", "override", "priv", "try", "typeof", "unsized", "virtual", "yield",
];

/// Why `name` cannot be an identifier of the rendered CUDA (`None`: it can):
/// not an identifier, or a reserved one (see [`RESERVED`]; names with `__`
/// or a leading `_` and capital are the compiler's).
pub fn ident_problem(name: &str) -> Option<String> {
    if let Some(m) = not_ident(name) {
        return Some(m);
    }
    let compilers =
        name.contains("__") || (name.starts_with('_') && name[1..].starts_with(|c: char| c.is_ascii_uppercase()));
    if compilers {
        return Some(format!("'{name}' is reserved: names with __, or _ and a capital, are the compiler's"));
    }
    if RESERVED.contains(&name) {
        return Some(format!("'{name}' is reserved: a C++ keyword or a name the templates declare"));
    }
    None
}

/// Why `text` cannot be rendered into a `//` comment (`None`: it can): a
/// line break or other control character would end the comment and paste
/// the rest as code, a backslash at its end continues it onto the next
/// line, and `*/` would end a block comment (none today: refused so that
/// a template may use one).
pub fn comment_problem(text: &str) -> Option<&'static str> {
    if text.contains(['\n', '\r']) {
        Some("a line break: the text is rendered into a one-line comment")
    } else if text.chars().any(char::is_control) {
        Some("a control character: the text is rendered into a one-line comment")
    } else if text.trim_end().ends_with('\\') {
        Some("a backslash at the end: it would continue the rendered comment onto the next line")
    } else if text.contains("*/") {
        Some("'*/': the text is rendered into a comment")
    } else {
        None
    }
}

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
        is_ident(name).then(|| Param { ty, name: name.to_string() })
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

    /// Why the name cannot be this parameter's (`None`: it can): as
    /// [`ident_problem`], or its Rust field is a Rust keyword.
    pub fn name_problem(&self) -> Option<String> {
        ident_problem(&self.name).or_else(|| {
            let f = self.field();
            RUST_KEYWORDS
                .contains(&f.as_str())
                .then(|| format!("'{}' is reserved: its Rust field '{f}' is a Rust keyword", self.name))
        })
    }

    pub fn is_ptr(&self) -> bool {
        matches!(self.ty, ParamType::ConstPtr | ParamType::MutPtr)
    }
}
