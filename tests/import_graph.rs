//! Each module imports only modules below it in the pipeline: no import
//! circles inside the generator, the runtime or the CLI (issue 17). Reads
//! the sources: a `crate::m` or `super::m` path outside comments is an edge.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// module -> the sibling modules it names.
fn graph(dir: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.retain(|p| p.extension().is_some_and(|x| x == "rs"));
    let names: BTreeSet<String> = files.iter().map(|p| p.file_stem().unwrap().to_string_lossy().into()).collect();
    let mut g = BTreeMap::new();
    for f in &files {
        let me = f.file_stem().unwrap().to_string_lossy().to_string();
        let text = std::fs::read_to_string(f).unwrap();
        let mut deps = BTreeSet::new();
        for line in text.lines().map(str::trim).filter(|l| !l.starts_with("//")) {
            for prefix in ["crate::", "super::", "crate::runtime::"] {
                for (i, _) in line.match_indices(prefix) {
                    let rest = &line[i + prefix.len()..];
                    let m: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                    if names.contains(&m) && m != me {
                        deps.insert(m);
                    }
                }
            }
        }
        g.insert(me, deps);
    }
    g
}

/// A cycle through `g`, if any (depth-first search).
fn cycle(g: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        g: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == n) {
            return Some(path[i..].to_vec());
        }
        if done.contains(n) {
            return None;
        }
        path.push(n.to_string());
        for d in g.get(n).into_iter().flatten() {
            if let Some(c) = visit(d, g, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(n.to_string());
        None
    }
    let mut done = BTreeSet::new();
    g.keys().find_map(|n| visit(n, g, &mut Vec::new(), &mut done))
}

#[test]
fn no_import_circles() {
    for dir in ["crates/gen/src", "crates/cli/src", "crates/reference/src", "src/runtime"] {
        let g = graph(&root().join(dir));
        assert!(g.len() > 1, "{dir}: no modules read");
        if let Some(c) = cycle(&g) {
            panic!("{dir}: import circle {}", c.join(" -> "));
        }
    }
}

#[test]
fn a_circle_is_seen() {
    let mut g = BTreeMap::new();
    g.insert("a".to_string(), BTreeSet::from(["b".to_string()]));
    g.insert("b".to_string(), BTreeSet::from(["c".to_string()]));
    g.insert("c".to_string(), BTreeSet::from(["a".to_string()]));
    assert_eq!(cycle(&g), Some(vec!["a".into(), "b".into(), "c".into()]));
    g.get_mut("c").unwrap().clear();
    assert_eq!(cycle(&g), None);
}
