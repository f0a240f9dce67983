//! The library's top-level modules form layers (ARCHITECTURE.md): no module reaches, through
//! any chain of `crate::` paths in its code (comments and unit tests aside), back to itself.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The `crate::NAME` paths of a file's code: before its unit tests, outside comments.
fn crate_paths(text: &str) -> BTreeSet<String> {
    let code = text.split("#[cfg(test)]").next().unwrap_or("");
    let mut out = BTreeSet::new();
    for line in code.lines() {
        let line = line.split("//").next().unwrap_or("");
        let mut rest = line;
        while let Some(i) = rest.find("crate::") {
            rest = &rest[i + "crate::".len()..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            out.insert(name);
        }
    }
    out
}

#[test]
fn no_module_reaches_back_to_itself() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut deps: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_stem().unwrap().to_string_lossy().to_string();
        if name == "lib" || name == "main" {
            continue;
        }
        let mut files = Vec::new();
        if p.is_dir() {
            rust_files(&p, &mut files);
        } else if p.extension().is_some_and(|x| x == "rs") {
            files.push(p.clone());
        } else {
            continue;
        }
        let d = deps.entry(name.clone()).or_default();
        for f in files {
            d.extend(crate_paths(&std::fs::read_to_string(&f).unwrap()));
        }
        d.remove(&name);
    }
    let modules: BTreeSet<String> = deps.keys().cloned().collect();
    assert!(modules.len() >= 15, "{modules:?}");
    for d in deps.values_mut() {
        d.retain(|m| modules.contains(m));
    }
    let mut cycles = Vec::new();
    for (a, ds) in &deps {
        for b in ds {
            // Does b reach a?
            let mut seen = BTreeSet::new();
            let mut todo = vec![b.clone()];
            while let Some(n) = todo.pop() {
                if &n == a {
                    cycles.push(format!("{a} -> {b} -> ... -> {a}"));
                    break;
                }
                if seen.insert(n.clone()) {
                    todo.extend(deps[&n].iter().cloned());
                }
            }
        }
    }
    assert!(cycles.is_empty(), "module cycles: {cycles:#?}");
    // The bottom layers stay at the bottom.
    for low in ["sys", "record", "procinfo"] {
        let above: Vec<&String> = deps[low]
            .iter()
            .filter(|m| !["sys", "record", "procinfo"].contains(&m.as_str()))
            .collect();
        assert!(above.is_empty(), "{low} uses {above:?}");
    }
}
