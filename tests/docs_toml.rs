//! Every TOML block of the README, deploy/README.md and docs/*.md loads with the binary's
//! `idemgate config check`, as docs/configuration.md ("TOML blocks in the docs") says: a
//! block as a whole file, one marked `<!-- toml: fragment -->` after a minimal file, and
//! one marked `<!-- toml: not-runnable (reason) -->` not at all. Files a block names under
//! `/etc/idemgate/` are made here (a CA, a certificate and its key), and the variables a
//! marker names (`env NAME ...`) are set to a placeholder.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::path::Path;
use std::process::Command;

use common::certs::{Ca, Dir};

/// What a fragment is loaded after: the one key a configuration cannot do without.
const MINIMAL: &str = "upstream = \"http://127.0.0.1:9000\"\n";
/// The value of each variable a marker names.
const PLACEHOLDER: &str = "placeholder-secret-0123456789abcdef";

#[derive(Debug)]
struct Block {
    at: String,
    text: String,
    /// `None`: a whole file; else the marker's words after `toml:`.
    marker: Option<String>,
}

fn blocks(path: &Path) -> Vec<Block> {
    let page = std::fs::read_to_string(path).unwrap();
    let lines: Vec<&str> = page.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        if lines[i].trim() == "```toml" {
            let marker = lines[..i]
                .iter()
                .rev()
                .find(|l| !l.trim().is_empty())
                .and_then(|l| l.trim().strip_prefix("<!-- toml:"))
                .map(|m| m.trim_end_matches("-->").trim().to_string());
            let start = i + 1;
            let end = start
                + lines[start..]
                    .iter()
                    .position(|l| l.trim() == "```")
                    .unwrap_or_else(|| panic!("{}:{}: unclosed block", path.display(), i + 1));
            // Blocks inside list items are indented like the fence.
            let indent = lines[i].len() - lines[i].trim_start().len();
            let text: String = lines[start..end]
                .iter()
                .map(|l| format!("{}\n", l.get(indent..).unwrap_or("")))
                .collect();
            out.push(Block {
                at: format!("{}:{}", path.display(), i + 1),
                text,
                marker,
            });
            i = end;
        } else if lines[i].trim().starts_with("<!-- toml:")
            && lines[i + 1..]
                .iter()
                .find(|l| !l.trim().is_empty())
                .is_none_or(|l| l.trim() != "```toml")
        {
            panic!(
                "{}:{}: a toml marker with no toml block after it",
                path.display(),
                i + 1
            );
        }
        i += 1;
    }
    out
}

/// `text` with each quoted path under `/etc/idemgate/` pointed at a file made in `dir`:
/// a CA where the name says `ca`, a key for `.key`, else a certificate for localhost.
fn with_files(text: &str, dir: &Dir, ca: &Ca) -> String {
    let leaf = ca.leaf(&["localhost"]);
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find("\"/etc/idemgate/") {
        out.push_str(&rest[..=at]);
        rest = &rest[at + 1..];
        let end = rest.find('"').unwrap();
        let name = rest[..end].trim_start_matches('/').replace('/', "_");
        let content = if name.ends_with(".key") {
            leaf.key.clone()
        } else if name.contains("ca") {
            ca.pem()
        } else {
            leaf.cert.clone()
        };
        out.push_str(&dir.write(&name, &content));
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

fn config_check(block: &Block) -> Result<(), String> {
    let marker = block.marker.as_deref().unwrap_or("");
    let mut words = marker.split_whitespace().peekable();
    let fragment = words.next_if_eq(&"fragment").is_some();
    let mut env = Vec::new();
    match words.next() {
        None => {}
        Some("env") => env.extend(words),
        Some(other) => return Err(format!("unknown marker word `{other}`")),
    }
    let dir = Dir::new();
    let ca = Ca::new("docs CA");
    let mut file = with_files(&block.text, &dir, &ca);
    if fragment {
        file = format!("{MINIMAL}{file}");
    }
    let path = dir.write("idemgate.toml", &file);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idemgate"));
    cmd.args(["config", "check", &path])
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default());
    for name in env {
        cmd.env(name, PLACEHOLDER);
    }
    let run = cmd.output().unwrap();
    if run.status.success() {
        Ok(())
    } else {
        Err(format!(
            "exit {:?}\n{}{}--- as loaded:\n{file}",
            run.status.code(),
            String::from_utf8_lossy(&run.stdout),
            String::from_utf8_lossy(&run.stderr)
        ))
    }
}

#[test]
fn every_toml_block_in_the_docs_loads_or_says_why_not() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut pages = vec![root.join("README.md"), root.join("deploy/README.md")];
    let mut docs: Vec<_> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    pages.extend(docs);
    let (mut loaded, mut skipped, mut failures) = (0, 0, Vec::new());
    for page in &pages {
        for block in blocks(page) {
            if let Some(reason) = block
                .marker
                .as_deref()
                .and_then(|m| m.strip_prefix("not-runnable"))
            {
                let reason = reason.trim();
                assert!(
                    reason.starts_with('(') && reason.ends_with(')') && reason.len() > 2,
                    "{}: not-runnable says why, in parentheses",
                    block.at
                );
                skipped += 1;
                continue;
            }
            match config_check(&block) {
                Ok(()) => loaded += 1,
                Err(e) => failures.push(format!("{}: {e}", block.at)),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    assert!(
        loaded >= 9,
        "only {loaded} blocks loaded ({skipped} not runnable)"
    );
}

/// The extraction itself: a marker is read from the line before the fence, indented blocks
/// lose their indent, and a block that does not load is reported.
#[test]
fn markers_are_read_and_a_broken_block_fails() {
    let dir = Dir::new();
    let page = dir.write(
        "page.md",
        "text\n\n<!-- toml: fragment -->\n```toml\n[defaults]\nmode = \"observe\"\n```\n\n  ```toml\n  upstream = \"http://127.0.0.1:1\"\n  no_such_key = 1\n  ```\n",
    );
    let found = blocks(Path::new(&page));
    assert_eq!(found.len(), 2);
    assert_eq!(found[0].marker.as_deref(), Some("fragment"));
    assert_eq!(found[1].marker, None);
    assert!(found[1].text.starts_with("upstream"), "{:?}", found[1].text);
    assert_eq!(config_check(&found[0]), Ok(()));
    let err = config_check(&found[1]).unwrap_err();
    assert!(err.contains("no_such_key"), "{err}");
}

/// docs/configuration.md's annotated example is a whole file with every setting: each key
/// that `idemgate config defaults` prints is in it, set or commented out.
#[test]
fn the_annotated_example_names_every_setting() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let page = root.join("docs/configuration.md");
    let example = blocks(&page)
        .into_iter()
        .find(|b| b.text.contains("[[routes]]") && b.text.contains("[defaults]"))
        .expect("the annotated example");
    let named = |text: &str| -> Vec<String> {
        text.lines()
            .filter_map(|l| {
                let l = l.trim_start_matches(['#', ' ']);
                let (key, _) = l.split_once(" = ")?;
                key.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
                    .then(|| key.to_string())
            })
            .collect()
    };
    let defaults = Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(["config", "defaults"])
        .env_clear()
        .output()
        .unwrap();
    assert!(defaults.status.success());
    let in_example = named(&example.text);
    let missing: Vec<String> = named(&String::from_utf8_lossy(&defaults.stdout))
        .into_iter()
        // `routes = []`: the example's `[[routes]]` entries.
        .filter(|k| k != "routes" && !in_example.contains(k))
        .collect();
    assert!(
        missing.is_empty(),
        "{}: the annotated example lacks {missing:?}",
        example.at
    );
}
