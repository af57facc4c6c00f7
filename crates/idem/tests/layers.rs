//! The module graph of the workspace's library crates has no cycle, and `idem`'s top-level
//! modules import only the layers below them (the rule in the crate's front page).
//!
//! An import is any `crate::…`, `super::…` or `self::…` path, or a path through a child
//! module the file declares, outside `#[cfg(test)]` modules. An edge between a module and
//! its own ancestor is containment, not an import between rooms (a parent declares its
//! children; children see the parent's private types): the check is that, inside every
//! folder, the modules it holds form a directed acyclic graph.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Library crates whose modules are checked.
const CRATES: [&str; 4] = ["idem-core", "idem-datafusion", "idem", "idem-ballista"];

/// `idem`'s top-level modules by layer: a module may import only modules of a lower layer.
const IDEM_LAYERS: [(&str, u32); 17] = [
    ("error", 0),
    ("progress", 0),
    ("units", 1),
    ("storage", 1),
    ("generate", 2),
    ("read", 2),
    ("pg", 2),
    ("write", 2),
    ("datafusion_runtime", 2),
    ("state", 3),
    ("dedup", 4),
    ("merge", 5),
    ("verify", 5),
    ("sql", 6),
    ("cluster", 6),
    ("observe", 7),
    // The crate root, which declares and re-exports the others.
    ("", u32::MAX),
];

/// One crate's modules: module path (`a::b`) → the source outside test modules.
fn modules(src: &Path) -> BTreeMap<String, String> {
    let mut found = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read src dir") {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).expect("read source");
                found.insert(module_path(src, &path), without_tests(&text));
            }
        }
    }
    found
}

fn module_path(src: &Path, file: &Path) -> String {
    let relative = file
        .strip_prefix(src)
        .expect("under src")
        .with_extension("");
    let mut parts: Vec<String> = relative
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts.join("::")
}

/// The source without comments and without `#[cfg(test)] mod … { … }` blocks.
fn without_tests(text: &str) -> String {
    let code: String = text
        .lines()
        .map(|line| match line.find("//") {
            Some(at) => &line[..at],
            None => line,
        })
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = String::new();
    let mut rest = code.as_str();
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let after = &rest[at + "#[cfg(test)]".len()..];
        let item = after.trim_start();
        if item.starts_with("mod ") && item.find('{') < item.find(';') {
            let open = after.find('{').expect("brace");
            let mut depth = 0usize;
            let mut end = after.len();
            for (i, c) in after[open..].char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            end = open + i + 1;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            rest = &after[end..];
        } else {
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// Every path the source names that starts with `crate`, `super`, `self` or one of
/// `children`, expanded out of `use` groups: `crate::{a::X, b}` gives `crate::a::X` and
/// `crate::b`.
fn paths(code: &str, children: &BTreeSet<String>) -> Vec<String> {
    let bytes = code.as_bytes();
    let is_ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    let mut found = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if !is_ident(bytes[i]) || (i > 0 && (is_ident(bytes[i - 1]) || bytes[i - 1] == b':')) {
            i += 1;
            continue;
        }
        let start = i;
        while i < bytes.len() && is_ident(bytes[i]) {
            i += 1;
        }
        let word = &code[start..i];
        let rooted = matches!(word, "crate" | "super" | "self") || children.contains(word);
        if !rooted || !code[i..].starts_with("::") {
            continue;
        }
        let (path, end) = read_path(code, start);
        found.extend(path);
        i = end;
    }
    found
}

/// The path (or, for a `use` group, paths) starting at `start`, and where it ends.
fn read_path(code: &str, start: usize) -> (Vec<String>, usize) {
    let bytes = code.as_bytes();
    let mut i = start;
    let mut prefix = String::new();
    loop {
        let from = i;
        while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
            i += 1;
        }
        prefix.push_str(&code[from..i]);
        if !code[i..].starts_with("::") {
            return (vec![prefix], i);
        }
        i += 2;
        if code[i..].starts_with('{') {
            let mut depth = 0usize;
            let mut end = i;
            for (k, c) in code[i..].char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            end = i + k;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            let mut items = Vec::new();
            let mut depth = 0usize;
            let mut item = String::new();
            for c in code[i + 1..end].chars() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    _ => {}
                }
                if c == ',' && depth == 0 {
                    items.push(std::mem::take(&mut item));
                } else {
                    item.push(c);
                }
            }
            items.push(item);
            let mut out = Vec::new();
            for item in items {
                let item: String = item.split_whitespace().collect::<Vec<_>>().join("");
                if item.is_empty() || item == "self" || item == "*" {
                    out.push(prefix.clone());
                    continue;
                }
                let joined = format!("{prefix}::{item}");
                let (inner, _) = read_path(&joined, 0);
                out.extend(inner);
            }
            return (out, end + 1);
        }
        prefix.push_str("::");
    }
}

/// The module a path names, resolved from module `from` of a crate with modules `known`:
/// its longest prefix that is a module.
fn resolve(path: &str, from: &str, known: &BTreeMap<String, String>) -> Option<String> {
    let mut segments: Vec<&str> = Vec::new();
    let mut base: Vec<&str> = if from.is_empty() {
        Vec::new()
    } else {
        from.split("::").collect()
    };
    for (n, segment) in path.split("::").enumerate() {
        match segment {
            "crate" if n == 0 => base.clear(),
            "self" if n == 0 => {}
            "super" => {
                base.pop();
            }
            _ => segments.push(segment),
        }
    }
    let full: Vec<&str> = base.into_iter().chain(segments).collect();
    (0..=full.len())
        .rev()
        .map(|n| full[..n].join("::"))
        .find(|m| known.contains_key(m))
}

/// Edges between modules that are not ancestors of one another, lifted to the children of
/// their closest common ancestor: (folder, from, to).
fn sibling_edges(known: &BTreeMap<String, String>) -> BTreeSet<(String, String, String)> {
    let mut edges = BTreeSet::new();
    for (module, code) in known {
        let children: BTreeSet<String> = known
            .keys()
            .filter_map(|m| {
                let rest = if module.is_empty() {
                    m.as_str()
                } else {
                    m.strip_prefix(module.as_str())?.strip_prefix("::")?
                };
                (!rest.is_empty() && !rest.contains("::")).then(|| rest.to_owned())
            })
            .collect();
        for path in paths(code, &children) {
            let Some(target) = resolve(&path, module, known) else {
                continue;
            };
            let a: Vec<&str> = module.split("::").filter(|s| !s.is_empty()).collect();
            let b: Vec<&str> = target.split("::").filter(|s| !s.is_empty()).collect();
            let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
            if common == a.len() || common == b.len() {
                continue;
            }
            edges.insert((
                a[..common].join("::"),
                a[common].to_owned(),
                b[common].to_owned(),
            ));
        }
    }
    edges
}

/// A cycle among the edges of one folder, if there is one.
fn find_cycle(edges: &[(String, String)]) -> Option<Vec<String>> {
    let mut next: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (a, b) in edges {
        next.entry(a).or_default().push(b);
    }
    fn visit<'a>(
        node: &'a str,
        next: &BTreeMap<&'a str, Vec<&'a str>>,
        state: &mut BTreeMap<&'a str, u8>,
        stack: &mut Vec<&'a str>,
    ) -> Option<Vec<String>> {
        state.insert(node, 1);
        stack.push(node);
        for &to in next.get(node).into_iter().flatten() {
            match state.get(to).copied().unwrap_or(0) {
                1 => {
                    let from = stack.iter().position(|n| *n == to).unwrap_or(0);
                    let mut cycle: Vec<String> =
                        stack[from..].iter().map(|s| s.to_string()).collect();
                    cycle.push(to.to_owned());
                    return Some(cycle);
                }
                0 => {
                    if let Some(cycle) = visit(to, next, state, stack) {
                        return Some(cycle);
                    }
                }
                _ => {}
            }
        }
        stack.pop();
        state.insert(node, 2);
        None
    }
    let mut state = BTreeMap::new();
    let nodes: Vec<&str> = next.keys().copied().collect();
    for node in nodes {
        if state.get(node).copied().unwrap_or(0) == 0
            && let Some(cycle) = visit(node, &next, &mut state, &mut Vec::new())
        {
            return Some(cycle);
        }
    }
    None
}

fn crate_src(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(name)
        .join("src")
}

#[test]
fn no_module_imports_a_module_that_imports_it_back() {
    let mut cycles = Vec::new();
    for name in CRATES {
        let known = modules(&crate_src(name));
        assert!(known.len() > 1, "{name}: no modules found");
        let mut by_folder: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
        for (folder, a, b) in sibling_edges(&known) {
            by_folder.entry(folder).or_default().push((a, b));
        }
        for (folder, edges) in by_folder {
            if let Some(cycle) = find_cycle(&edges) {
                cycles.push(format!("{name}: in '{folder}': {}", cycle.join(" → ")));
            }
        }
    }
    assert!(cycles.is_empty(), "module cycles:\n{}", cycles.join("\n"));
}

#[test]
fn idem_modules_import_only_lower_layers() {
    let known = modules(&crate_src("idem"));
    let layer = |m: &str| IDEM_LAYERS.iter().find(|(n, _)| *n == m).map(|(_, l)| *l);
    let mut wrong = Vec::new();
    for module in known.keys() {
        let top = module.split("::").next().unwrap_or_default();
        if layer(top).is_none() {
            wrong.push(format!("'{top}' has no layer in IDEM_LAYERS: give it one"));
        }
    }
    for (folder, a, b) in sibling_edges(&known) {
        if !folder.is_empty() {
            continue;
        }
        if let (Some(from), Some(to)) = (layer(&a), layer(&b))
            && from <= to
        {
            wrong.push(format!("{a} (layer {from}) imports {b} (layer {to})"));
        }
    }
    assert!(wrong.is_empty(), "layer violations:\n{}", wrong.join("\n"));
}

#[test]
fn the_check_sees_cycles_and_group_imports() {
    let mut known = BTreeMap::new();
    known.insert(String::new(), "mod a; mod b;".to_owned());
    known.insert("a".to_owned(), "use crate::{b::Thing, c};".to_owned());
    known.insert(
        "b".to_owned(),
        "fn f() { super::a::g() }\n#[cfg(test)]\nmod tests { use crate::c; }".to_owned(),
    );
    known.insert("c".to_owned(), "// crate::a::h".to_owned());
    let known: BTreeMap<String, String> = known
        .into_iter()
        .map(|(m, code)| (m, without_tests(&code)))
        .collect();
    let edges: Vec<(String, String)> = sibling_edges(&known)
        .into_iter()
        .map(|(_, a, b)| (a, b))
        .collect();
    assert_eq!(
        edges,
        vec![
            ("a".to_owned(), "b".to_owned()),
            ("a".to_owned(), "c".to_owned()),
            ("b".to_owned(), "a".to_owned())
        ]
    );
    assert!(find_cycle(&edges).is_some());
    assert!(find_cycle(&edges[..2]).is_none());
}
