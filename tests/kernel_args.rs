//! A kernel's arguments are written once, as `params` in specs/stages.yaml:
//! the CUDA bodies in templates/stages.cuh and the tables of docs/KERNELS.md
//! must say the same, and the generated Rust argument structs follow them
//! (crates/gen/src/args.rs). CPU only.

use std::path::PathBuf;

use mixstack_gen::args::{stage_args, stage_params, struct_name};
use mixstack_gen::params::Param;
use mixstack_gen::spec;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// "const T* __restrict__ u" -> "const T* u"; "i64 E" -> "long long E".
fn normalise(p: &str) -> String {
    let p = p.replace("__restrict__", "").replace("i64 ", "long long ");
    p.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The parameter list of device function `name` in `text`.
fn signature(text: &str, name: &str) -> Option<Vec<String>> {
    let at = text.find(&format!("void {name}("))? + format!("void {name}(").len();
    let end = at + text[at..].find(')')?;
    Some(text[at..end].split(',').map(normalise).collect())
}

#[test]
fn stage_bodies_take_the_spec_params() {
    let specs = spec::load(&root().join("specs")).unwrap();
    let text = std::fs::read_to_string(root().join("templates/stages.cuh")).unwrap();
    for s in &specs.stages.stages {
        let want: Vec<String> = s.params.iter().map(|p| normalise(p)).collect();
        let got = signature(&text, &s.body).unwrap_or_else(|| panic!("templates/stages.cuh has no body {}", s.body));
        assert_eq!(got, want, "stage {}: templates/stages.cuh's {} against specs/stages.yaml", s.name, s.body);
    }
}

#[test]
fn kernels_md_tables_match_the_specs() {
    let specs = spec::load(&root().join("specs")).unwrap();
    let doc = std::fs::read_to_string(root().join("docs/KERNELS.md")).unwrap();
    for s in &specs.stages.stages {
        let row = doc
            .lines()
            .find(|l| l.starts_with(&format!("| {} |", s.name.as_str())))
            .unwrap_or_else(|| panic!("docs/KERNELS.md has no row for stage {}", s.name));
        let cell = row.split('|').nth(3).unwrap().trim();
        let args = cell.strip_prefix('(').and_then(|c| c.split_once(')')).map(|(a, _)| a);
        let got: Vec<String> = args.unwrap_or_default().split(", ").map(normalise).collect();
        let want: Vec<String> = s.params.iter().map(|p| normalise(p)).collect();
        assert_eq!(got, want, "docs/KERNELS.md's row for {} against specs/stages.yaml", s.name);
    }
}

#[test]
fn params_parse_and_refuse() {
    let p = Param::parse("const T* g_next").unwrap();
    assert_eq!((p.field(), p.rust_type(), p.c_decl()), ("g_next".into(), "P", "const T* g_next".into()));
    assert_eq!(Param::parse("long long E").unwrap().field(), "e");
    assert_eq!(Param::parse("int L").unwrap().rust_type(), "i32");
    for bad in ["float* x", "T x", "const T* 9x", "T* a-b", "int", "", "unsigned int n", "T** p"] {
        assert_eq!(Param::parse(bad), None, "{bad:?}");
    }
}

#[test]
fn generated_structs_follow_the_spec_order() {
    let specs = spec::load(&root().join("specs")).unwrap();
    let text = stage_args(&specs);
    for (stage, _, params) in stage_params(&specs) {
        let head = format!("pub struct {}<P> {{", struct_name(stage));
        let at = text.find(&head).unwrap_or_else(|| panic!("no {head}")) + head.len();
        let body = &text[at..at + text[at..].find("\n}").unwrap()];
        let fields: Vec<&str> =
            body.lines().filter_map(|l| l.trim().strip_prefix("pub ")).map(|l| l.split(':').next().unwrap()).collect();
        let want: Vec<String> = params.iter().map(Param::field).collect();
        assert_eq!(fields, want, "{stage}");
        // and they are pushed in that order
        let push = format!("StageCall::{}(a) => {{", struct_name(stage).trim_end_matches("Args"));
        let at = text.rfind(&push).unwrap_or_else(|| panic!("no {push}")) + push.len();
        let pushed: Vec<&str> = text[at..]
            .lines()
            .skip(1)
            .map_while(|l| l.trim().strip_prefix("b.arg(&a.").and_then(|r| r.strip_suffix(");")))
            .collect();
        assert_eq!(pushed, want, "{stage}: marshalling order");
    }
}
