//! What the specs paste into CUDA (and the generated Rust) is checked where
//! it is written: names that become identifiers, comment text, constants,
//! map keys. Each refusal names the file, the line and the field; before
//! these checks each of the edits below was accepted and rendered (or
//! silently changed the math).

use mixstack_gen::spec;
use std::path::PathBuf;

fn specs_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../specs"))
}

fn shipped() -> [String; 3] {
    spec::FILES.map(|f| std::fs::read_to_string(specs_dir().join(f)).unwrap())
}

/// The error of the shipped specs with `file` (one of [`spec::FILES`])
/// rewritten by `edit`; the edited text beside it.
fn refused(file: &str, edit: impl Fn(&str) -> String) -> (String, String) {
    let mut texts = shipped();
    let i = spec::FILES.iter().position(|f| *f == file).unwrap();
    let edited = edit(&texts[i]);
    assert_ne!(edited, texts[i], "the edit of {file} changed nothing");
    texts[i] = edited.clone();
    match spec::from_texts(&specs_dir(), texts) {
        Ok(_) => panic!("the edited {file} was accepted:\n{edited}"),
        Err(e) => (e.to_string(), edited),
    }
}

/// The line number after `file:` in an error.
fn line_of(e: &str, file: &str) -> usize {
    let loc = e.split(&format!("{file}:")).nth(1).unwrap_or_else(|| panic!("no {file}: in {e}"));
    loc.split(':').next().unwrap().parse().unwrap_or_else(|_| panic!("no line number in {e}"))
}

/// The 1-based line of the last line of `text` containing `needle`.
fn last_line_with(text: &str, needle: &str) -> usize {
    text.lines().collect::<Vec<_>>().iter().rposition(|l| l.contains(needle)).unwrap_or_else(|| panic!("no {needle:?}"))
        + 1
}

/// Asserts that `e` is at the last line of `text` holding `needle`, names
/// `field` and says `says`.
fn assert_at(e: &str, file: &str, text: &str, needle: &str, field: &str, says: &str) {
    assert_eq!(line_of(e, file), last_line_with(text, needle), "{e}");
    assert!(e.contains(field), "no field {field:?} in: {e}");
    assert!(e.contains(says), "no {says:?} in: {e}");
}

/// ops.yaml with one more operator, on one line at the end.
fn with_operator(op: &str) -> impl Fn(&str) -> String + '_ {
    move |t: &str| format!("{t}\n  - {op}\n")
}

/// The index the appended operator gets.
fn next_operator() -> usize {
    shipped()[0].lines().filter(|l| l.trim_start().starts_with("- name:")).count()
}

#[test]
fn an_input_named_like_a_constant_is_refused() {
    // before: accepted, rendered as Prim<T>::mul(x, T(1e0))
    let op = "{name: probe_op, doc: x, inputs: [x, one], steps: [{out: pr, op: mul, args: [x, one]}]}";
    let (e, t) = refused("ops.yaml", with_operator(op));
    let i = next_operator();
    assert_at(
        &e,
        "ops.yaml",
        &t,
        "probe_op",
        &format!("operators[{i}] (probe_op).inputs"),
        "'one' is already a constant",
    );
}

#[test]
fn a_map_key_listed_twice_is_refused() {
    // before: the last `one` won, silently
    let (e, t) = refused("ops.yaml", |t| t.replacen("  one: 1.0\n", "  one: 1.0\n  one: 2.0\n", 1));
    assert_at(&e, "ops.yaml", &t, "one: 2.0", "constants.one", "listed twice");
    // flow style too
    let (e, _) =
        refused("ops.yaml", |t| {
            t.replacen("  one: 1.0\n  alpha_eps: 1.0e-12\n", "  {one: 1.0, alpha_eps: 1.0e-12, one: 2.0}\n", 1)
                .replacen("constants:\n", "constants:", 1)
        });
    assert!(e.contains("constants.one") && e.contains("listed twice"), "{e}");
    // tiles.yaml's tile sets: before, the second set replaced the first
    let (e, _) = refused("tiles.yaml", |t| t.replacen("  reduce_rows:\n", "  relay_rows:\n", 1));
    assert!(e.contains("tiles.yaml:") && e.contains("rows.relay_rows") && e.contains("listed twice"), "{e}");
    let (e, _) = refused("tiles.yaml", |t| t.replacen("  fused:\n", "  relay_gemm:\n", 1));
    assert!(e.contains("tiles.yaml:") && e.contains("gemm.relay_gemm") && e.contains("listed twice"), "{e}");
}

#[test]
fn operator_names_inputs_and_outs_must_be_identifiers() {
    let i = next_operator();
    let cases = [
        // before: each accepted, pasted into ops.cuh as it is
        (
            "{name: \"probe op; int z\", doc: x, inputs: [x], steps: [{out: pr, op: neg, args: [x]}]}",
            "name",
            "'op_probe op; int z' is not an identifier",
        ),
        (
            "{name: probe_op, doc: x, inputs: [a-b], steps: [{out: pr, op: neg, args: [a-b]}]}",
            "inputs",
            "'a-b' is not an identifier",
        ),
        ("{name: probe_op, doc: x, inputs: [T], steps: [{out: pr, op: neg, args: [T]}]}", "inputs", "'T' is reserved"),
        (
            "{name: probe_op, doc: x, inputs: [x, x], steps: [{out: pr, op: add, args: [x, x]}]}",
            "inputs",
            "'x' listed twice",
        ),
        (
            "{name: probe_op, doc: x, inputs: [x], steps: [{out: float, op: neg, args: [x]}]}",
            "steps[0].out",
            "'float' is reserved",
        ),
        (
            "{name: probe_op, doc: x, inputs: [x], steps: [{out: op_sigmoid, op: neg, args: [x]}]}",
            "steps[0].out",
            "'op_sigmoid' is reserved",
        ),
        (
            "{name: probe_op, doc: x, inputs: [__x], steps: [{out: pr, op: neg, args: [__x]}]}",
            "inputs",
            "'__x' is reserved",
        ),
        (
            "{name: probe_op, doc: x, inputs: [x], steps: [{out: \"p r\", op: neg, args: [x]}]}",
            "steps[0].out",
            "'p r' is not an identifier",
        ),
    ];
    for (op, field, says) in cases {
        let (e, t) = refused("ops.yaml", with_operator(op));
        let name = if op.contains("probe op;") { "probe op; int z" } else { "probe_op" };
        assert_at(&e, "ops.yaml", &t, name, &format!("operators[{i}] ({name}).{field}"), says);
    }
}

#[test]
fn comment_text_stays_on_its_line() {
    let i = next_operator();
    // before: the newline put `#error injected` on a line of its own in ops.cuh
    for (doc, says) in [
        ("\"x\\n#error injected\"", "a line break"),
        ("\"x\\r#error injected\"", "a line break"),
        ("\"x */ y\"", "'*/'"),
        // a line comment ending in a backslash continues onto the next line
        ("\"x \\\\\"", "a backslash"),
    ] {
        let op = format!("{{name: probe_op, doc: {doc}, inputs: [x], steps: [{{out: pr, op: neg, args: [x]}}]}}");
        let (e, t) = refused("ops.yaml", with_operator(&op));
        assert_at(&e, "ops.yaml", &t, "probe_op", &format!("operators[{i}] (probe_op).doc"), says);
    }
    // a stage's doc is rendered into each instance's header comment (and the Rust docs)
    let doc = "    doc: \"z0 = u[:, :M0] @ W0, stored into z_all\"\n";
    let (e, t) = refused("stages.yaml", |t| t.replacen(doc, "    doc: \"z0\\n#error injected\"\n", 1));
    assert_at(&e, "stages.yaml", &t, "#error injected", "stages[0] (fwd_m0).doc", "a line break");
}

#[test]
fn constants_are_finite_identifiers() {
    for (line, field, says) in [
        // before: accepted (a name never used), or rendered T(NaN) / T(inf)
        ("  bad name: 1.0\n", "constants.bad name", "'bad name' is not an identifier"),
        ("  nan_c: .nan\n", "constants.nan_c", "not a finite number"),
        ("  inf_c: .inf\n", "constants.inf_c", "not a finite number"),
        ("  ninf_c: -.inf\n", "constants.ninf_c", "not a finite number"),
        // T(1e39) is inf where T is float
        ("  big: 1.0e39\n", "constants.big", "f32"),
    ] {
        let (e, t) = refused("ops.yaml", |t| t.replacen("  one: 1.0\n", &format!("  one: 1.0\n{line}"), 1));
        assert_at(&e, "ops.yaml", &t, line.trim_end(), field, says);
    }
}

#[test]
fn a_stage_body_names_a_template_function() {
    // before: rendered as `ms::x); system(1<float, ...>(...)`
    let (e, t) = refused("stages.yaml", |t| t.replacen("    body: fwd_m0\n", "    body: \"x); system(1\"\n", 1));
    assert_at(&e, "stages.yaml", &t, "system(1", "stages[0] (fwd_m0).body", "'x); system(1' is not an identifier");
}

#[test]
fn kernel_parameters_are_unique_usable_names() {
    let p = "    params: [\"const T* u\", \"const T* w0\", \"T* z\", \"long long E\", \"int L\"]\n";
    for (with, says) in [
        // before: accepted: a kernel `(..., int L, int L)`; `int int`; Rust fields `e` and `e`
        ("\"int L\", \"int L\"", "'L' listed twice"),
        ("\"int L\", \"int int\"", "'int' is reserved"),
        ("\"int L\", \"int e\"", "both the Rust field 'e'"),
        ("\"int L\", \"int type\"", "'type' is reserved"),
    ] {
        let (e, t) = refused("stages.yaml", |t| t.replacen(p, &p.replace("\"int L\"", with), 1));
        assert_at(&e, "stages.yaml", &t, with, "stages[0] (fwd_m0).params", says);
    }
}

#[test]
fn the_shipped_specs_pass() {
    spec::from_texts(&specs_dir(), shipped()).unwrap();
}
