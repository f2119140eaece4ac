//! The house's shape, checked: no import circle between `src/`'s top-level modules, and no
//! source file too long to read in one sitting.
//!
//! A top-level module is a file or a folder directly under `src/` (`main.rs` and `lib.rs`
//! aside). A module depends on another when one of its files names it: `crate::NAME`
//! anywhere outside comments (a `use`, a path in code), each name inside
//! `use crate::{...}`, and a `super::` chain that climbs out of a folder to the crate root.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Longer than this and a file holds more than one concept.
const MAX_LINES: usize = 800;

/// Files still over [`MAX_LINES`] whose split is under way: each must still be
/// over the limit, so that the entry goes when the file is split.
const BEING_SPLIT: &[&str] = &[];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src/") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module path of a file below `src/`: `store/redis/mod.rs` is `[store, redis]`.
fn module_path(relative: &Path) -> Vec<String> {
    let mut parts: Vec<String> = relative
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let file = parts.pop().expect("a file name");
    let stem = file.trim_end_matches(".rs");
    if stem != "mod" {
        parts.push(stem.to_string());
    }
    parts
}

/// The line without its `//` comment (a `//` inside a string literal is kept).
fn code_of(line: &str) -> &str {
    let bytes = line.as_bytes();
    let mut in_string = false;
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' if in_string => i += 1,
            b'"' => in_string = !in_string,
            b'/' if !in_string && bytes.get(i + 1) == Some(&b'/') => return &line[..i],
            _ => {}
        }
        i += 1;
    }
    line
}

fn ident_at(text: &str) -> &str {
    let end = text
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(text.len());
    &text[..end]
}

/// The first segment of each item of a `{...}` use group that starts at `text[0]`.
fn group_heads(text: &str) -> Vec<String> {
    let mut heads = Vec::new();
    let mut depth = 0;
    let mut expect_head = false;
    for (i, c) in text.char_indices() {
        match c {
            '{' => {
                depth += 1;
                expect_head = depth == 1;
            }
            '}' => {
                depth -= 1;
                if depth == 0 {
                    break;
                }
            }
            ',' if depth == 1 => expect_head = true,
            c if expect_head && (c.is_ascii_alphanumeric() || c == '_') => {
                heads.push(ident_at(&text[i..]).to_string());
                expect_head = false;
            }
            _ => {}
        }
    }
    heads
}

/// The top-level names one file refers to.
fn references(relative: &Path, text: &str) -> BTreeSet<String> {
    let path = module_path(relative);
    // Inline modules (`mod tests {`) add a level that `super::` climbs first; rustfmt puts
    // their closing brace alone at the opening line's indentation.
    let mut inline: Vec<String> = Vec::new();
    let mut code = String::new();
    let mut depth_by_line = Vec::new();
    for line in text.lines() {
        let line = code_of(line);
        let trimmed = line.trim_start();
        let indent = &line[..line.len() - trimmed.len()];
        if inline.last().is_some_and(|close| line == close) {
            inline.pop();
        }
        depth_by_line.push((code.len(), inline.len()));
        code.push_str(line);
        code.push('\n');
        let opens = trimmed
            .strip_prefix("pub ")
            .or(trimmed.strip_prefix("pub(crate) "))
            .unwrap_or(trimmed);
        if opens.starts_with("mod ") && opens.trim_end().ends_with('{') {
            inline.push(format!("{indent}}}"));
        }
    }
    let inline_depth_at = |offset: usize| {
        depth_by_line
            .iter()
            .take_while(|(start, _)| *start <= offset)
            .last()
            .map_or(0, |(_, d)| *d)
    };

    let mut names = BTreeSet::new();
    for (at, _) in code.match_indices("crate::") {
        let before = code[..at].chars().last();
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            continue; // `somecrate::`, not `crate::`
        }
        let rest = &code[at + "crate::".len()..];
        if rest.starts_with('{') {
            names.extend(group_heads(rest));
        } else {
            names.insert(ident_at(rest).to_string());
        }
    }
    for (at, _) in code.match_indices("super::") {
        let before = code[..at].chars().last();
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':') {
            continue; // the second `super::` of a chain
        }
        let mut rest = &code[at..];
        let mut climbs: usize = 0;
        while let Some(r) = rest.strip_prefix("super::") {
            climbs += 1;
            rest = r;
        }
        let climbs = climbs.saturating_sub(inline_depth_at(at));
        if climbs == 0 || climbs < path.len() {
            continue; // still inside this file or its folder
        }
        if rest.starts_with('{') {
            names.extend(group_heads(rest));
        } else {
            names.insert(ident_at(rest).to_string());
        }
    }
    names
}

struct House {
    /// Top-level module → the top-level modules it refers to.
    graph: BTreeMap<String, BTreeSet<String>>,
    /// Files over [`MAX_LINES`], with their line counts.
    long: Vec<(String, usize)>,
}

fn read_house() -> House {
    let root = src();
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    files.sort();
    let top: BTreeSet<String> = files
        .iter()
        .map(|f| module_path(f.strip_prefix(&root).expect("below src/"))[0].clone())
        .filter(|m| m != "main" && m != "lib")
        .collect();
    let mut graph: BTreeMap<String, BTreeSet<String>> =
        top.iter().map(|m| (m.clone(), BTreeSet::new())).collect();
    let mut long = Vec::new();
    for file in &files {
        let relative = file.strip_prefix(&root).expect("below src/");
        let text = std::fs::read_to_string(file).expect("read a source file");
        let lines = text.lines().count();
        if lines > MAX_LINES {
            long.push((relative.display().to_string(), lines));
        }
        let from = module_path(relative)[0].clone();
        let Some(edges) = graph.get_mut(&from) else {
            continue; // main.rs, lib.rs
        };
        for name in references(relative, &text) {
            if name != from && top.contains(&name) {
                edges.insert(name);
            }
        }
    }
    House { graph, long }
}

/// The strongly connected components with more than one module (Tarjan).
fn circles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct Walk<'a> {
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        found: Vec<Vec<String>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, node: &'a str) {
            let i = self.index.len();
            self.index.insert(node, i);
            self.low.insert(node, i);
            self.stack.push(node);
            self.on_stack.insert(node);
            for next in &self.graph[node] {
                let next = next.as_str();
                if !self.index.contains_key(next) {
                    self.visit(next);
                    let low = self.low[node].min(self.low[next]);
                    self.low.insert(node, low);
                } else if self.on_stack.contains(next) {
                    let low = self.low[node].min(self.index[next]);
                    self.low.insert(node, low);
                }
            }
            if self.low[node] == self.index[node] {
                let mut component = Vec::new();
                loop {
                    let top = self.stack.pop().expect("on the stack");
                    self.on_stack.remove(top);
                    component.push(top.to_string());
                    if top == node {
                        break;
                    }
                }
                if component.len() > 1 {
                    component.sort();
                    self.found.push(component);
                }
            }
        }
    }
    let mut walk = Walk {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for node in graph.keys() {
        if !walk.index.contains_key(node.as_str()) {
            walk.visit(node);
        }
    }
    walk.found
}

#[test]
fn no_import_circle_between_top_level_modules() {
    let house = read_house();
    for (module, uses) in &house.graph {
        let uses: Vec<&str> = uses.iter().map(String::as_str).collect();
        println!("{module} -> {}", uses.join(", "));
    }
    let found = circles(&house.graph);
    for circle in &found {
        println!("circle: {}", circle.join(", "));
    }
    assert!(
        found.is_empty(),
        "top-level modules that import each other: {found:?}"
    );
}

#[test]
fn no_source_file_over_the_limit() {
    let house = read_house();
    let long: Vec<&(String, usize)> = house
        .long
        .iter()
        .filter(|(file, _)| !BEING_SPLIT.contains(&file.as_str()))
        .collect();
    assert!(long.is_empty(), "files over {MAX_LINES} lines: {long:?}");
    for file in BEING_SPLIT {
        assert!(
            house.long.iter().any(|(f, _)| f == file),
            "{file} is no longer over {MAX_LINES} lines: take it off BEING_SPLIT"
        );
    }
}

#[test]
fn the_reader_sees_what_a_file_refers_to() {
    let text = "use crate::{config::{A, B}, store};\n\
                // crate::proxy in a comment\n\
                fn f() { crate::tls::x(); let s = \"a//b\"; crate::upstream::y(); }\n\
                mod tests {\n    use super::super::super::admin;\n}\n";
    let names = references(Path::new("lab/x.rs"), text);
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    assert_eq!(names, ["admin", "config", "store", "tls", "upstream"]);
    // Inside a folder, `super::` stays in the folder.
    assert!(references(Path::new("store/redis/x.rs"), "use super::super::Store;").is_empty());
    assert!(references(Path::new("store/x.rs"), "use super::Store;").is_empty());
}

#[test]
fn a_circle_is_found() {
    let graph: BTreeMap<String, BTreeSet<String>> = [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a"]),
        ("d", vec!["a"]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.into_iter().map(String::from).collect()))
    .collect();
    assert_eq!(circles(&graph), [vec!["a", "b", "c"]]);
}
