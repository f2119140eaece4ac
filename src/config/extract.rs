//! Reading the layered sources into a [`Config`], every problem at once: each value of the
//! wrong type and each key that is no setting where it is written, named with its key and
//! the source that set it (the file, the environment variable).
//!
//! figment's `extract` stops at the first problem, as serde's derived deserializers do. When
//! it fails, the sources' merged value is read again with the key at fault put back to its
//! default (or left out), and again, until the rest reads: the same way `config check` goes
//! on past an invalid value. Checking each key's type by hand instead would write the schema
//! a second time, beside the one serde derives; this way the schema stays the only word on
//! what a key takes, and a new key needs nothing here.

use figment::error::Kind;
use figment::providers::Serialized;
use figment::value::Value;
use figment::Figment;

use super::{Config, ConfigError, Route};

/// Keys whose values are never quoted in a message, even a value of the wrong type.
const SECRETS: &[&str] = &[
    "admin_token",
    "encryption_keys",
    "jwt_hs256_secret",
    "postgres_url",
    "redis_password",
    "redis_url",
    "scope_secret",
];

impl Config {
    /// Extracts the configuration from the layered sources, or says every problem of the
    /// sources: a file that cannot be read or parsed (alone: there is nothing to read past
    /// it), else each key with a value of the wrong type or that is no setting there.
    pub fn extract_all(figment: &Figment) -> Result<Config, Vec<ConfigError>> {
        let first = match figment.extract::<Config>() {
            Ok(config) => return Ok(config),
            Err(e) => e,
        };
        let Ok(merged) = figment.find_value("") else {
            return Err(vec![ConfigError::Source(Box::new(first))]);
        };
        let defaults = Value::serialize(Config::default()).ok();
        let mut working = merged.clone();
        let mut problems = Vec::new();
        let mut seen: Vec<Vec<String>> = Vec::new();
        let mut error = first;
        // Each round lifts one key, so this ends; the bound only guards a key that cannot
        // be lifted in a way not foreseen here.
        for _ in 0..256 {
            problems.push(problem(figment, &merged, &error));
            if seen.contains(&error.path) || !lift(&mut working, defaults.as_ref(), &error) {
                break;
            }
            seen.push(error.path.clone());
            match Figment::from(Serialized::defaults(&working)).extract::<Config>() {
                Ok(_) => break,
                Err(e) => error = e,
            }
        }
        Err(problems)
    }
}

/// Takes the key at fault out of the way: a key that is no setting is left out, a value of
/// the wrong type is put back to its default (left out where there is none, as on a
/// route), a missing key is given its default. Whether it could.
fn lift(working: &mut Value, defaults: Option<&Value>, e: &figment::Error) -> bool {
    let Some((last, parent)) = e.path.split_last() else {
        return false;
    };
    let default_of = |path: &[String]| defaults.and_then(|d| find(d, path)).cloned();
    match &e.kind {
        Kind::MissingField(field) => {
            let mut path = e.path.clone();
            path.push(field.to_string());
            match (default_of(&path), dict_at(working, &e.path)) {
                (Some(v), Some(dict)) => {
                    dict.insert(field.to_string(), v);
                    true
                }
                _ => false,
            }
        }
        Kind::UnknownField(..) => dict_at(working, parent)
            .and_then(|dict| dict.remove(last))
            .is_some(),
        _ => {
            // The key of the nearest table on the path (for `methods[0]`, `methods`).
            let Some(n) = (1..=e.path.len())
                .rev()
                .find(|n| dict_at(working, &e.path[..n - 1]).is_some())
            else {
                return false;
            };
            let (key, table) = (&e.path[n - 1], &e.path[..n - 1]);
            let default = default_of(&e.path[..n]);
            let Some(dict) = dict_at(working, table) else {
                return false;
            };
            match default {
                Some(v) => dict.insert(key.clone(), v).is_some(),
                None => dict.remove(key).is_some(),
            }
        }
    }
}

/// The value at `path` (dictionary keys, and list indices in decimal).
fn find<'v>(mut v: &'v Value, path: &[String]) -> Option<&'v Value> {
    for segment in path {
        v = match v {
            Value::Dict(_, dict) => dict.get(segment)?,
            Value::Array(_, items) => items.get(segment.parse::<usize>().ok()?)?,
            _ => return None,
        };
    }
    Some(v)
}

/// The dictionary at `path`, to change.
fn dict_at<'v>(mut v: &'v mut Value, path: &[String]) -> Option<&'v mut figment::value::Dict> {
    for segment in path {
        v = match v {
            Value::Dict(_, dict) => dict.get_mut(segment)?,
            Value::Array(_, items) => items.get_mut(segment.parse::<usize>().ok()?)?,
            _ => return None,
        };
    }
    match v {
        Value::Dict(_, dict) => Some(dict),
        _ => None,
    }
}

/// `e` in words, with its key and the source that set it.
fn problem(figment: &Figment, merged: &Value, e: &figment::Error) -> ConfigError {
    let key = dotted(&e.path);
    let origin = origin(figment, merged, &e.path);
    let message = match &e.kind {
        Kind::UnknownField(field, expected) => {
            let parent = &e.path[..e.path.len().saturating_sub(1)];
            format!("{} (in {origin})", unknown_key(parent, field, expected))
        }
        kind => {
            let secret = e
                .path
                .first()
                .is_some_and(|k| SECRETS.contains(&k.as_str()));
            format!("{} for key `{key}` in {origin}", reason(kind, secret))
        }
    };
    ConfigError::Read { key, message }
}

/// `routes[0].lease` for `["routes", "0", "lease"]`, as [`ConfigError::Invalid`] names keys.
fn dotted(path: &[String]) -> String {
    let mut out = String::new();
    for segment in path {
        if segment.parse::<usize>().is_ok() {
            out.push_str(&format!("[{segment}]"));
        } else {
            if !out.is_empty() {
                out.push('.');
            }
            out.push_str(segment);
        }
    }
    out
}

/// What is wrong with a value, each value and expected word quoted once.
fn reason(kind: &Kind, secret: bool) -> String {
    match kind {
        Kind::UnknownVariant(_, expected) if secret => {
            format!("unknown value, expected {}", one_of(expected))
        }
        Kind::UnknownVariant(found, expected) => {
            format!("unknown value `{found}`, expected {}", one_of(expected))
        }
        Kind::InvalidType(_, expected) if secret => format!("invalid type, expected {expected}"),
        Kind::InvalidType(found, expected) => {
            format!("invalid type: found {found}, expected {expected}")
        }
        Kind::InvalidValue(_, expected) if secret => {
            format!("invalid value, expected {expected}")
        }
        Kind::InvalidValue(found, expected) => {
            format!("invalid value: found {found}, expected {expected}")
        }
        kind => kind.to_string(),
    }
}

/// `` `a` ``, `` `a` or `b` ``, `` one of `a`, `b`, `c` ``.
fn one_of(names: &[&str]) -> String {
    let quoted: Vec<String> = names.iter().map(|n| format!("`{n}`")).collect();
    match quoted.as_slice() {
        [] => "none".into(),
        [one] => one.clone(),
        [a, b] => format!("{a} or {b}"),
        _ => format!("one of {}", quoted.join(", ")),
    }
}

/// A key that is no setting where it is written (`parent`): where it belongs when it is a
/// setting of another table, else the setting one edit away, if any.
fn unknown_key(parent: &[String], field: &str, expected: &[&str]) -> String {
    let schema = serde_json::to_value(Config::default()).unwrap_or_default();
    let top = |k: &str| schema.get(k).is_some();
    let policy = |k: &str| schema.get("defaults").is_some_and(|d| d.get(k).is_some());
    let route = serde_json::to_value(Route::default()).unwrap_or_default();
    let route_only = |k: &str| route.get(k).is_some() && !policy(k);
    let parent: Vec<&str> = parent.iter().map(String::as_str).collect();
    let in_route = matches!(parent.as_slice(), ["routes", i] if i.parse::<usize>().is_ok());
    match parent.as_slice() {
        [] if policy(field) => {
            return format!(
                "`{field}` at the top level is a route key: put it under [defaults] or a [[routes]] entry"
            )
        }
        [] if route_only(field) => {
            return format!("`{field}` at the top level is a route key: put it in a [[routes]] entry")
        }
        ["defaults"] if top(field) => {
            return format!(
                "`{field}` under [defaults] is a top-level key: put it above the file's first [table]"
            )
        }
        ["defaults"] if route_only(field) => {
            return format!("`{field}` under [defaults] is a key of a [[routes]] entry only")
        }
        _ if in_route && top(field) => {
            return format!(
                "`{field}` in a [[routes]] entry is a top-level key: put it above the file's first [table]"
            )
        }
        _ => {}
    }
    let place = match parent.as_slice() {
        [] => " at the top level".to_string(),
        ["defaults"] => " under [defaults]".to_string(),
        _ if in_route => " in a [[routes]] entry".to_string(),
        _ => format!(
            " in `{}`",
            dotted(&parent.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        ),
    };
    let near = expected
        .iter()
        .find(|k| k.len() >= 4 && super::load::within_one_edit(field, k));
    match near {
        Some(k) => format!("`{field}` is no setting{place}: did you mean `{k}`?"),
        None => format!("`{field}` is no setting{place}"),
    }
}

/// Where the value at `path` was set: `file <path>`, `environment variable <NAME>`.
fn origin(figment: &Figment, merged: &Value, path: &[String]) -> String {
    // The deepest value on the path that is there (a missing key: its table).
    let tag = (0..=path.len())
        .rev()
        .find_map(|n| find(merged, &path[..n]))
        .map(Value::tag);
    let Some(md) = tag.and_then(|t| figment.get_metadata(t)) else {
        return "the configuration".into();
    };
    match &md.source {
        Some(figment::Source::File(file)) => format!("file {}", file.display()),
        _ if md.name.contains("environment variable") => match env_var(path) {
            Some(name) => format!("environment variable {name}"),
            None => md.name.to_string(),
        },
        _ => md.name.to_string(),
    }
}

/// The `IDEMGATE_` variable of this process that set the value at `path`: the longest
/// leading part of the path, up to a list index, that names one (`IDEMGATE_DEFAULTS__LEASE`,
/// or `IDEMGATE_ROUTES` for `routes[0].lease`).
fn env_var(path: &[String]) -> Option<String> {
    let keys: Vec<&String> = path
        .iter()
        .take_while(|s| s.parse::<usize>().is_err())
        .collect();
    let names: Vec<String> = std::env::vars_os()
        .filter_map(|(k, _)| k.into_string().ok())
        .collect();
    (1..=keys.len()).rev().find_map(|n| {
        let parts: Vec<&str> = keys[..n].iter().map(|s| s.as_str()).collect();
        let wanted = format!("IDEMGATE_{}", parts.join("__"));
        names
            .iter()
            .find(|name| name.eq_ignore_ascii_case(&wanted))
            .cloned()
    })
}

#[cfg(test)]
mod tests {
    use figment::providers::{Format, Serialized, Toml};

    use super::*;

    fn problems(toml: &str) -> Vec<String> {
        let figment =
            Figment::from(Serialized::defaults(Config::default())).merge(Toml::string(toml));
        match Config::extract_all(&figment) {
            Ok(_) => Vec::new(),
            Err(problems) => problems.iter().map(ToString::to_string).collect(),
        }
    }

    #[test]
    fn every_key_of_the_wrong_type_is_named() {
        let got = problems(
            "store_timeout = \"fast\"\nmax_in_flight = \"many\"\n[defaults]\nlease = \"10 seconds please\"\nanonymous = \"yes\"\n[[routes]]\npath = \"/a\"\nretention = 5\n",
        );
        assert_eq!(got.len(), 5, "{got:#?}");
        for key in [
            "`store_timeout`",
            "`max_in_flight`",
            "`defaults.lease`",
            "`defaults.anonymous`",
            "`routes[0].retention`",
        ] {
            assert!(got.iter().any(|p| p.contains(key)), "{key}: {got:#?}");
        }
        let anonymous = got.iter().find(|p| p.contains("anonymous")).unwrap();
        assert!(
            anonymous.contains("unknown value `yes`, expected `refuse` or `shared`"),
            "{anonymous}"
        );
    }

    #[test]
    fn a_key_in_the_wrong_table_is_told_where_it_belongs() {
        let got = problems("lease = \"1s\"\npath = \"/a\"\n[defaults]\nstore_timeout = \"1s\"\nleese = \"1s\"\n[[routes]]\npath = \"/b\"\nnamespace = \"x\"\n");
        let text = got.join("\n");
        for said in [
            "`lease` at the top level is a route key: put it under [defaults] or a [[routes]] entry",
            "`path` at the top level is a route key: put it in a [[routes]] entry",
            "`store_timeout` under [defaults] is a top-level key",
            "`leese` is no setting under [defaults]: did you mean `lease`?",
            "`namespace` in a [[routes]] entry is a top-level key",
        ] {
            assert!(text.contains(said), "{said}:\n{text}");
        }
        assert_eq!(got.len(), 5, "{text}");
        assert!(
            !text.contains("upstream_tls_ca_file"),
            "no list of keys: {text}"
        );
    }

    #[test]
    fn a_secret_of_the_wrong_type_is_not_quoted() {
        let got = problems("jwt_hs256_secret = 123456789\n");
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(got[0].contains("`jwt_hs256_secret`"), "{got:?}");
        assert!(!got[0].contains("123456789"), "{got:?}");
    }

    #[test]
    fn a_file_that_does_not_parse_is_one_problem() {
        let got = problems("listen = \n");
        assert_eq!(got.len(), 1, "{got:?}");
    }
}
