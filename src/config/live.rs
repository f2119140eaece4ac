//! The settings in force, and what a reload would change in them.
//!
//! A reload builds new [`Settings`] from the sources, exactly as start-up and `idemgate
//! config check` do, and swaps them in whole: every request loads the settings once, at its
//! start, and keeps that snapshot to its end, so a request in flight finishes under the
//! settings it started with while the next one takes the new ones. What is swapped is only
//! what the request path reads from the settings (routes, their modes, timeouts and limits
//! under `[defaults]` and `[[routes]]`), the log filter (`log_level`) and who may do what
//! on the admin listener (`admin_token`, `admin_operators`, `admin_hosts`); everything wired at start-up (listeners, the store,
//! TLS, threads, the scope secret, connection limits) needs a restart, and a reload that
//! changes any of it is refused whole ([`Changes::restart`]).

use std::sync::Arc;

use arc_swap::ArcSwap;

use super::{Config, Settings};

/// The settings that new requests take; swapped whole by a reload.
pub struct Live(ArcSwap<Settings>);

impl Live {
    /// Starts with `settings`.
    pub fn new(settings: Settings) -> Arc<Live> {
        Arc::new(Live(ArcSwap::from_pointee(settings)))
    }

    /// The settings in force now: a snapshot that a reload does not change.
    pub fn get(&self) -> Arc<Settings> {
        self.0.load_full()
    }

    /// Puts `settings` in force for every request that starts from now on.
    pub fn set(&self, settings: Settings) {
        self.0.store(Arc::new(settings));
    }
}

/// Top-level settings that a reload applies: everything the request path reads from the
/// settings per request, the log filter and the admin listener's operators and hosts. Every other top-level setting needs a restart.
pub const RELOADABLE: [&str; 6] = [
    "admin_hosts",
    "admin_operators",
    "admin_token",
    "defaults",
    "log_level",
    "routes",
];

/// What changed between two configurations, by setting name (never a value).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// Settings a reload applies (`defaults.mode`, `routes[0].upstream_timeout`, `routes[2]`
    /// for a route added or removed).
    pub applied: Vec<String>,
    /// Settings that only a restart applies (`listen`, `redis_url`, `worker_threads`...).
    pub restart: Vec<String>,
}

/// What changed from `old` to `new`.
pub fn changes(old: &Config, new: &Config) -> Changes {
    let as_map = |c: &Config| match serde_json::to_value(c) {
        Ok(serde_json::Value::Object(m)) => m,
        _ => serde_json::Map::new(),
    };
    let (old, new) = (as_map(old), as_map(new));
    let null = serde_json::Value::Null;
    let mut out = Changes::default();
    let mut keys: Vec<&String> = old.keys().chain(new.keys()).collect();
    keys.sort();
    keys.dedup();
    for key in keys {
        let (a, b) = (old.get(key).unwrap_or(&null), new.get(key).unwrap_or(&null));
        if a == b {
            continue;
        }
        match key.as_str() {
            "defaults" => out.applied.extend(fields(key, a, b)),
            "routes" => {
                let list = |v: &serde_json::Value| v.as_array().cloned().unwrap_or_default();
                let (a, b) = (list(a), list(b));
                for i in 0..a.len().max(b.len()) {
                    let name = format!("routes[{i}]");
                    match (a.get(i), b.get(i)) {
                        (Some(x), Some(y)) if x != y => out.applied.extend(fields(&name, x, y)),
                        (Some(_), Some(_)) => {}
                        _ => out.applied.push(name),
                    }
                }
            }
            "log_level" | "admin_token" | "admin_operators" | "admin_hosts" => {
                out.applied.push(key.clone())
            }
            _ => out.restart.push(key.clone()),
        }
    }
    out
}

/// The fields of two objects at `prefix` that differ, as `prefix.field`.
fn fields(prefix: &str, a: &serde_json::Value, b: &serde_json::Value) -> Vec<String> {
    let (Some(a), Some(b)) = (a.as_object(), b.as_object()) else {
        return vec![prefix.to_string()];
    };
    let null = serde_json::Value::Null;
    let mut names: Vec<&String> = a.keys().chain(b.keys()).collect();
    names.sort();
    names.dedup();
    names
        .into_iter()
        .filter(|n| a.get(*n).unwrap_or(&null) != b.get(*n).unwrap_or(&null))
        .map(|n| format!("{prefix}.{n}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(toml: &str) -> Config {
        use figment::providers::{Format, Serialized, Toml};
        figment::Figment::from(Serialized::defaults(Config::default()))
            .merge(Toml::string(toml))
            .extract()
            .unwrap()
    }

    #[test]
    fn names_what_changed_and_what_needs_a_restart() {
        let old = config("[[routes]]\npath = \"/a\"\nmode = \"observe\"");
        let new = config(
            "listen = \"127.0.0.1:1\"\nworker_threads = 2\nlog_level = \"warn\"\n[defaults]\nupstream_timeout = \"5s\"\n[[routes]]\npath = \"/a\"\n[[routes]]\npath = \"/b\"",
        );
        let c = changes(&old, &new);
        assert_eq!(
            c.applied,
            [
                "defaults.upstream_timeout",
                "log_level",
                "routes[0].mode",
                "routes[1]"
            ]
        );
        assert_eq!(c.restart, ["listen", "worker_threads"]);
        assert_eq!(changes(&old, &old), Changes::default());
        for key in RELOADABLE {
            assert!(
                serde_json::to_value(&old).unwrap().get(key).is_some(),
                "{key}"
            );
        }
    }

    #[test]
    fn a_secret_is_named_not_shown() {
        let old = config("");
        let new = config("admin_token = \"0123456789abcdef-secret\"");
        let c = changes(&old, &new);
        assert_eq!(c.applied, ["admin_token"]);
        assert!(!format!("{c:?}").contains("0123456789abcdef"), "{c:?}");
    }
}
