//! Property test of the generator's front half: the shipped specs with
//! numbers swapped for edge values, lines duplicated or dropped. Whatever
//! the input, parse + validate + expand + the default check return a value
//! or a typed error (never a panic, never a wrapped number), and whatever is
//! accepted expands to instances with unique names and sane numbers.

use mixstack_gen::{expand::expand, pipeline, spec};
use proptest::prelude::*;
use std::path::{Path, PathBuf};

fn shipped() -> [String; 3] {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("specs");
    spec::FILES.map(|f| std::fs::read_to_string(dir.join(f)).unwrap())
}

#[derive(Debug, Clone)]
enum Edit {
    /// The n-th run of digits (mod their count) becomes `value`.
    Number(usize, u64),
    /// Line n (mod the line count) appears twice.
    DupLine(usize),
    DropLine(usize),
}

fn edge_value() -> impl Strategy<Value = u64> {
    prop_oneof![
        prop::sample::select(vec![
            0u64,
            1,
            2,
            3,
            4,
            7,
            8,
            16,
            31,
            32,
            33,
            64,
            96,
            128,
            1024,
            4096,
            4097,
            65535,
            (1 << 31) - 1,
            (1 << 31) + 128,
            (1 << 32) - 1,
            1 << 32,
            u64::MAX,
        ]),
        any::<u64>(),
    ]
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        4 => (any::<usize>(), edge_value()).prop_map(|(n, v)| Edit::Number(n, v)),
        1 => any::<usize>().prop_map(Edit::DupLine),
        1 => any::<usize>().prop_map(Edit::DropLine),
    ]
}

fn apply(text: &str, e: &Edit) -> String {
    match *e {
        Edit::Number(n, v) => {
            let runs: Vec<(usize, usize)> = {
                let b = text.as_bytes();
                let mut v = Vec::new();
                let mut i = 0;
                while i < b.len() {
                    if b[i].is_ascii_digit() {
                        let s = i;
                        while i < b.len() && b[i].is_ascii_digit() {
                            i += 1;
                        }
                        v.push((s, i));
                    } else {
                        i += 1;
                    }
                }
                v
            };
            let (s, t) = runs[n % runs.len()];
            format!("{}{v}{}", &text[..s], &text[t..])
        }
        Edit::DupLine(n) | Edit::DropLine(n) => {
            let mut lines: Vec<&str> = text.lines().collect();
            let i = n % lines.len();
            if matches!(e, Edit::DupLine(_)) {
                lines.insert(i, lines[i]);
            } else {
                lines.remove(i);
            }
            lines.join("\n") + "\n"
        }
    }
}

fn check(dir: &Path, texts: [String; 3]) {
    let Ok(specs) = spec::from_texts(dir, texts) else { return };
    let Ok(exp) = expand(&specs, None) else { return };
    let _ = pipeline::check_defaults(&specs, &exp);
    let mut names: Vec<&str> = exp.instances.iter().map(|i| i.name.as_str()).collect();
    names.sort();
    let n = names.len();
    names.dedup();
    assert_eq!(names.len(), n, "two instances share a name");
    let (lo, hi) = (specs.stages.lmax.min, specs.stages.lmax.max);
    for i in &exp.instances {
        let t = i.threads();
        assert!(t > 0 && t <= 1024 && t % 32 == 0, "{}: {t} threads", i.name);
        for l in lo..=hi {
            let _ = i.layout.bytes(i.cf, l);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 384, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn tiles_edits_never_panic(edits in prop::collection::vec(edit(), 1..5)) {
        let [ops, stages, mut tiles] = shipped();
        for e in &edits {
            tiles = apply(&tiles, e);
        }
        check(Path::new("specs"), [ops, stages, tiles]);
    }

    #[test]
    fn ops_edits_never_panic(edits in prop::collection::vec(edit(), 1..4)) {
        let [mut ops, stages, tiles] = shipped();
        for e in &edits {
            ops = apply(&ops, e);
        }
        // a duplicated line repeats a constant or a step; a number may
        // overflow f64 (`1.0e99999` reads as inf): all refused, or finite
        if let Ok(specs) = spec::from_texts(Path::new("specs"), [ops.clone(), stages.clone(), tiles.clone()]) {
            for (name, v) in &specs.ops.constants {
                prop_assert!(v.is_finite() && v.abs() <= f64::from(f32::MAX), "constant {name} = {v}");
            }
        }
        check(Path::new("specs"), [ops, stages, tiles]);
    }

    #[test]
    fn stages_edits_never_panic(edits in prop::collection::vec(edit(), 1..4)) {
        let [ops, mut stages, tiles] = shipped();
        for e in &edits {
            stages = apply(&stages, e);
        }
        check(Path::new("specs"), [ops, stages, tiles]);
    }
}
