//! The configuration reference, docs/configuration.md, against the binary, both ways: every
//! key that `idemgate config defaults` prints (or lists as having no default) is in the
//! page's tables with the same default and the right environment variable, and every key in
//! the tables is one the binary prints or, for route-only keys, accepts on a route.

#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Command, Output};

/// A value for each route-only key, to show that a `[[routes]]` entry accepts it.
const ROUTE_ONLY_SAMPLES: &[(&str, &str)] = &[("path", "/v1/transfers")];

const PAGE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/configuration.md");
const TOP: &str = "## Top-level keys";
const DEFAULTS: &str = "## `[defaults]` keys, also on each `[[routes]]` entry";
const ROUTE_ONLY: &str = "## `[[routes]]`-only keys";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Section {
    Top,
    Defaults,
    RouteOnly,
}

/// One row of the page's tables.
#[derive(Debug)]
struct Row {
    section: Section,
    /// As written in the table: `listen`, `lease`, `path`.
    key: String,
    /// The default cell without its backticks: `500ms`, `["POST", "PATCH"]`, `(unset)`.
    default: String,
    /// The environment cell as written.
    env: String,
}

impl Row {
    /// The key's dotted name, as `config defaults` names it: `listen`, `defaults.lease`,
    /// `routes.path`.
    fn dotted(&self) -> String {
        match self.section {
            Section::Top => self.key.clone(),
            Section::Defaults => format!("defaults.{}", self.key),
            Section::RouteOnly => format!("routes.{}", self.key),
        }
    }
}

fn idemgate(args: &[&str], env: &[(String, String)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idemgate"));
    cmd.args(args);
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("IDEMGATE_")) {
        cmd.env_remove(k);
    }
    cmd.envs(env.iter().map(|(k, v)| (k, v)));
    cmd.output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The rows of the three key tables of docs/configuration.md.
fn documented() -> Vec<Row> {
    let page = std::fs::read_to_string(PAGE).unwrap();
    let mut section = None;
    let mut rows = Vec::new();
    for line in page.lines() {
        if line.starts_with("## ") {
            section = match line.trim_end() {
                TOP => Some(Section::Top),
                DEFAULTS => Some(Section::Defaults),
                ROUTE_ONLY => Some(Section::RouteOnly),
                _ => None,
            };
            continue;
        }
        let Some(section) = section else { continue };
        if !line.starts_with("| `") {
            continue;
        }
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        assert!(cells.len() >= 4, "a row of four cells: {line}");
        let unquote = |c: &str| {
            c.strip_prefix('`')
                .and_then(|c| c.strip_suffix('`'))
                .unwrap_or(c)
                .to_string()
        };
        rows.push(Row {
            section,
            key: unquote(cells[0]),
            default: unquote(cells[1]),
            env: cells[2].to_string(),
        });
    }
    for (s, heading) in [
        (Section::Top, TOP),
        (Section::Defaults, DEFAULTS),
        (Section::RouteOnly, ROUTE_ONLY),
    ] {
        assert!(
            rows.iter().any(|r| r.section == s),
            "docs/configuration.md has no table under {heading}"
        );
    }
    rows
}

/// A value as the table writes it: strings without quotes, durations as printed, arrays as
/// printed (their strings quoted).
fn normalized(v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => s.clone(),
        toml::Value::Array(items) => {
            let items: Vec<String> = items
                .iter()
                .map(|i| match i {
                    toml::Value::String(s) => format!("\"{s}\""),
                    other => normalized(other),
                })
                .collect();
            format!("[{}]", items.join(", "))
        }
        other => other.to_string(),
    }
}

/// Tables flattened to dotted names (`defaults.lease`); arrays are values.
fn flatten(prefix: &str, table: &toml::Table, out: &mut BTreeMap<String, toml::Value>) {
    for (k, v) in table {
        let name = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        match v {
            toml::Value::Table(t) => flatten(&name, t, out),
            other => {
                out.insert(name, other.clone());
            }
        }
    }
}

/// What `idemgate config defaults` prints: each key with its default, and the keys it lists
/// as having none.
fn printed() -> (BTreeMap<String, toml::Value>, BTreeSet<String>) {
    let o = idemgate(&["config", "defaults"], &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let out = text(&o.stdout);
    let table: toml::Table = out.parse().unwrap();
    let mut values = BTreeMap::new();
    flatten("", &table, &mut values);
    let unset = out
        .lines()
        .skip_while(|l| !l.starts_with("# Without a default"))
        .skip(1)
        .filter_map(|l| l.strip_prefix("# "))
        .map(str::to_string)
        .collect();
    (values, unset)
}

/// The environment variable the table should name for a row, by figment's mapping
/// (`Env::prefixed("IDEMGATE_").split("__")`), or `None` for a route-only key.
fn expected_env(row: &Row) -> Option<String> {
    match row.section {
        Section::Top => Some(format!("IDEMGATE_{}", row.key.to_ascii_uppercase())),
        Section::Defaults => Some(format!(
            "IDEMGATE_DEFAULTS__{}",
            row.key.to_ascii_uppercase()
        )),
        Section::RouteOnly => None,
    }
}

/// The first `code` span of a cell.
fn first_code(cell: &str) -> Option<&str> {
    cell.split('`').nth(1)
}

#[test]
fn the_configuration_reference_matches_the_binary() {
    let rows = documented();
    let (values, unset) = printed();
    let mut problems = Vec::new();

    let mut by_key: BTreeMap<String, &Row> = BTreeMap::new();
    for row in &rows {
        if by_key.insert(row.dotted(), row).is_some() {
            problems.push(format!("`{}` is in the tables twice", row.dotted()));
        }
    }

    // The binary to the page: every key printed, with its default.
    for (key, value) in &values {
        match by_key.get(key) {
            None => problems.push(format!(
                "`{key}` (default `{}`) is not in docs/configuration.md",
                normalized(value)
            )),
            Some(row) if row.default != normalized(value) => problems.push(format!(
                "`{key}`: the page says the default is `{}`, the binary prints `{}`",
                row.default,
                normalized(value)
            )),
            Some(_) => {}
        }
    }
    for key in &unset {
        match by_key.get(key) {
            None => problems.push(format!(
                "`{key}` (no default) is not in docs/configuration.md"
            )),
            Some(row) if row.default != "(unset)" => problems.push(format!(
                "`{key}`: the page says the default is `{}`, the binary has none: (unset)",
                row.default
            )),
            Some(_) => {}
        }
    }

    // The page to the binary: every documented key exists, and its variable is right.
    for row in &rows {
        let key = row.dotted();
        let known = values.contains_key(&key) || unset.contains(&key);
        match row.section {
            Section::Top | Section::Defaults => {
                if !known {
                    problems.push(format!(
                        "`{key}` is documented, but `idemgate config defaults` knows no such key"
                    ));
                }
                let want = expected_env(row).unwrap();
                if first_code(&row.env) != Some(want.as_str()) {
                    problems.push(format!(
                        "`{key}`: the environment variable is `{want}`, the page says {}",
                        row.env
                    ));
                }
            }
            Section::RouteOnly => {
                if row.env != "route-only" {
                    problems.push(format!(
                        "`{}`: a route-only key has no variable, the page says {}",
                        row.key, row.env
                    ));
                }
                if values.contains_key(&format!("defaults.{}", row.key))
                    || values.contains_key(&row.key)
                {
                    problems.push(format!(
                        "`{}` is documented as route-only, but the binary has it elsewhere",
                        row.key
                    ));
                }
            }
        }
    }

    assert!(
        problems.is_empty(),
        "docs/configuration.md and the binary disagree:\n{}",
        problems.join("\n")
    );
}

/// Every variable the tables name is one the binary reads as a setting: with all of them
/// set to the printed defaults, `config check` warns about none and prints the defaults.
#[test]
fn the_documented_environment_variables_name_settings() {
    let rows = documented();
    let (values, _) = printed();
    let mut env = Vec::new();
    for row in &rows {
        let Some(value) = values.get(&row.dotted()) else {
            continue;
        };
        let name = first_code(&row.env).unwrap().to_string();
        let value = match value {
            // Read verbatim, comma-separated (`IDEMGATE_ENCRYPTION_KEYS`).
            toml::Value::Array(items) if row.env.contains("comma-separated") => {
                items.iter().map(normalized).collect::<Vec<_>>().join(",")
            }
            other => normalized(other),
        };
        env.push((name, value));
    }
    assert!(env.len() > 50, "{env:?}");
    let o = idemgate(&["config", "check"], &env);
    let err = text(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(!err.contains("ignored"), "{err}");
    let effective: toml::Table = text(&o.stdout).parse().unwrap();
    let mut got = BTreeMap::new();
    flatten("", &effective, &mut got);
    for (key, value) in &values {
        assert_eq!(got.get(key), Some(value), "`{key}` from {env:?}");
    }
}

/// A `[[routes]]` entry accepts every route-only key of the page and every `[defaults]` key
/// the binary prints; a route without `path` is refused (the page says it is required).
#[test]
fn a_route_accepts_the_documented_keys() {
    let rows = documented();
    let (values, _) = printed();
    let mut route = toml::Table::new();
    for row in rows.iter().filter(|r| r.section == Section::RouteOnly) {
        let sample = ROUTE_ONLY_SAMPLES
            .iter()
            .find(|(k, _)| *k == row.key)
            .unwrap_or_else(|| {
                panic!(
                    "route-only `{}`: add a sample value to ROUTE_ONLY_SAMPLES",
                    row.key
                )
            });
        route.insert(row.key.clone(), toml::Value::String(sample.1.into()));
    }
    for (key, value) in &values {
        if let Some(k) = key.strip_prefix("defaults.") {
            route.insert(k.to_string(), value.clone());
        }
    }
    let mut file = toml::Table::new();
    file.insert(
        "routes".into(),
        toml::Value::Array(vec![toml::Value::Table(route.clone())]),
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idemgate.toml");
    std::fs::write(&path, toml::to_string(&file).unwrap()).unwrap();
    let o = idemgate(&["config", "check", path.to_str().unwrap()], &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let effective: toml::Table = text(&o.stdout).parse().unwrap();
    let checked = effective["routes"].as_array().unwrap()[0]
        .as_table()
        .unwrap();
    for k in route.keys() {
        assert!(
            checked.contains_key(k),
            "`{k}` lost on the route: {checked:?}"
        );
    }

    route.remove("path");
    file.insert(
        "routes".into(),
        toml::Value::Array(vec![toml::Value::Table(route)]),
    );
    std::fs::write(&path, toml::to_string(&file).unwrap()).unwrap();
    let o = idemgate(&["config", "check", path.to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(64), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("path"), "{}", text(&o.stderr));
}
