//! The layered sources: built-in defaults < TOML file < `IDEMGATE_` environment, and the
//! environment names that are no setting.

use std::path::Path;
use std::sync::Arc;

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;

use super::{Config, ConfigError, Settings};

impl Config {
    /// The layered sources: defaults < TOML file (if any) < `IDEMGATE_` environment.
    /// Command-line flags are merged on top by the caller.
    pub fn figment(file: Option<&Path>) -> Figment {
        let mut f = Figment::from(Serialized::defaults(Config::default()));
        if let Some(path) = file {
            f = f.merge(Toml::file_exact(path));
        }
        // Variables that name no setting are left out (the binary names them in one
        // warning, see `unknown_env`) instead of stopping start-up: Kubernetes injects
        // `IDEMGATE_PORT`, `IDEMGATE_SERVICE_HOST`... into every pod of a namespace that has
        // a Service called `idemgate`. A TOML file's unknown keys stay an error: a file is
        // written for idemgate alone.
        let known = KnownKeys::new();
        f = f.merge(
            Env::prefixed("IDEMGATE_")
                .ignore(NOT_SETTINGS)
                .filter(move |key| known.contains(key.as_str()))
                .split("__"),
        );
        // Taken verbatim: the environment provider would read a value such as `1e5` or
        // `[x]` as a number or an array.
        for (var, key) in [
            ("IDEMGATE_ADMIN_TOKEN", "admin_token"),
            ("IDEMGATE_JWT_HS256_SECRET", "jwt_hs256_secret"),
            ("IDEMGATE_NAMESPACE", "namespace"),
            ("IDEMGATE_REDIS_PASSWORD", "redis_password"),
            ("IDEMGATE_SCOPE_SECRET", "scope_secret"),
        ] {
            if let Ok(value) = std::env::var(var) {
                f = f.merge(Serialized::global(key, value));
            }
        }
        if let Ok(value) = std::env::var("IDEMGATE_ENCRYPTION_KEYS") {
            let keys: Vec<&str> = value.split(',').filter(|k| !k.trim().is_empty()).collect();
            f = f.merge(Serialized::global("encryption_keys", keys));
        }
        f
    }

    /// Extracts the configuration from the layered sources: its first problem, where
    /// [`extract_all`](Config::extract_all) says every one.
    pub fn extract(figment: Figment) -> Result<Config, ConfigError> {
        Config::extract_all(&figment).map_err(|problems| {
            problems
                .into_iter()
                .next()
                .unwrap_or_else(|| super::invalid("", "the configuration does not read"))
        })
    }

    /// Extracts and validates (the values alone: the runtime objects are built and their
    /// files checked in `wiring::Wired::load`).
    pub fn load(figment: Figment) -> Result<Settings, ConfigError> {
        Settings::new(Config::extract(figment)?)
    }
}

/// `IDEMGATE_` variables that are read elsewhere, not settings.
/// (The secrets and the namespace are read verbatim, see [`Config::figment`].)
const NOT_SETTINGS: &[&str] = &[
    "CONFIG",
    "LOG_FORMAT",
    "ADMIN_TOKEN",
    "ADMIN_URL",
    "JWT_HS256_SECRET",
    "NAMESPACE",
    "ENCRYPTION_KEYS",
    "REDIS_PASSWORD",
];

/// The shape of the configuration, as the defaults serialize: which environment names
/// (`listen`, `defaults__lease`) name a setting.
#[derive(Clone)]
struct KnownKeys(Arc<serde_json::Value>);

impl KnownKeys {
    fn new() -> KnownKeys {
        KnownKeys(Arc::new(
            serde_json::to_value(Config::default()).unwrap_or_default(),
        ))
    }

    /// Whether an environment name without its prefix (`DEFAULTS__LEASE`, any case) names a
    /// setting. Below a value that is not a table (an absent option, the route list) every
    /// name is left to the deserializer, which reports what is wrong with it.
    fn contains(&self, key: &str) -> bool {
        let mut at = &*self.0;
        for segment in key.split("__") {
            match at {
                serde_json::Value::Object(map) => match map.get(&segment.to_ascii_lowercase()) {
                    Some(v) => at = v,
                    None => return false,
                },
                _ => return true,
            }
        }
        true
    }
}

/// The `IDEMGATE_` variables of this process that name no setting, sorted: [`Config::figment`]
/// leaves them out, and the binary names them in one warning.
pub fn unknown_env() -> Vec<String> {
    unknown_env_vars(std::env::vars_os().filter_map(|(k, _)| k.into_string().ok()))
}

/// The `IDEMGATE_` variables among `names` that name no setting, sorted.
pub fn unknown_env_vars(names: impl Iterator<Item = String>) -> Vec<String> {
    let known = KnownKeys::new();
    let mut unknown: Vec<String> = names
        .filter_map(|name| {
            let key = name
                .get(..9)
                .filter(|p| p.eq_ignore_ascii_case("IDEMGATE_"))
                .and_then(|_| name.get(9..))?;
            let ignored = NOT_SETTINGS.iter().any(|k| k.eq_ignore_ascii_case(key));
            (!ignored && !known.contains(key)).then_some(name)
        })
        .collect();
    unknown.sort();
    unknown
}

/// The `IDEMGATE_` variables among `names` that name no setting but look meant to, each
/// with what it probably meant: one edit away from a setting's name
/// (`IDEMGATE_DEFAULT__MODE`), or under the name of a table or list
/// (`IDEMGATE_DEFAULTS_MODE`, `IDEMGATE_ROUTES_0_PATH`). Their value does not apply, so a
/// team that believes it set `mode = "observe"` would be enforcing: `config check` fails
/// on them and start-up warns. Names far from every setting (Kubernetes'
/// `IDEMGATE_PORT`, `IDEMGATE_SERVICE_HOST`) are not among them.
pub fn mistyped_env_vars(names: impl Iterator<Item = String>) -> Vec<(String, String)> {
    let known = KnownKeys::new();
    let mut paths = Vec::new();
    setting_paths(&known.0, "", &mut paths);
    let tables: Vec<String> = match &*known.0 {
        serde_json::Value::Object(map) => map
            .iter()
            .filter(|(_, v)| v.is_object() || v.is_array())
            .map(|(k, _)| k.clone())
            .collect(),
        _ => Vec::new(),
    };
    let mut out: Vec<(String, String)> = unknown_env_vars(names)
        .into_iter()
        .filter_map(|name| {
            let key = name[9..].to_ascii_lowercase();
            if let Some(p) = paths
                .iter()
                .filter(|p| p.len() >= 4)
                .find(|p| within_one_edit(&key, p))
            {
                return Some((name, format!("did you mean IDEMGATE_{}?", p.to_ascii_uppercase())));
            }
            let table = tables.iter().find(|t| {
                key.strip_prefix(t.as_str())
                    .is_some_and(|rest| rest.starts_with('_'))
            })?;
            let rest = key[table.len()..].trim_start_matches('_');
            let nested = format!("{table}__{rest}");
            let hint = if paths.contains(&nested) {
                format!("did you mean IDEMGATE_{}?", nested.to_ascii_uppercase())
            } else if known.0.get(table.as_str()).is_some_and(|v| v.is_array()) {
                format!(
                    "did you mean IDEMGATE_{}? (a list: set it in the file, or the whole list in that variable)",
                    table.to_ascii_uppercase()
                )
            } else {
                format!(
                    "did you mean a setting under IDEMGATE_{}__ (two underscores between the parts)?",
                    table.to_ascii_uppercase()
                )
            };
            Some((name, hint))
        })
        .collect();
    out.sort();
    out
}

/// Every setting's environment name without the prefix, lower case (`defaults__mode`).
fn setting_paths(v: &serde_json::Value, prefix: &str, out: &mut Vec<String>) {
    if let serde_json::Value::Object(map) = v {
        for (k, v) in map {
            let path = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}__{k}")
            };
            setting_paths(v, &path, out);
            out.push(path);
        }
    }
}

/// Whether `a` becomes `b` by at most one insertion, deletion or substitution.
pub(super) fn within_one_edit(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let (short, long) = if a.len() <= b.len() { (a, b) } else { (b, a) };
    if long.len() - short.len() > 1 {
        return false;
    }
    let prefix = short.iter().zip(long).take_while(|(x, y)| x == y).count();
    if short.len() == long.len() {
        short[prefix + 1.min(short.len() - prefix)..] == long[prefix + 1.min(long.len() - prefix)..]
    } else {
        short[prefix..] == long[prefix + 1..]
    }
}

/// figment's message without its profile name (`default.`), which means nothing to
/// someone who never chose a profile: `what is wrong for key `defaults.lease` in file`.
pub(super) fn describe(e: &figment::Error) -> String {
    let mut out = Vec::new();
    for e in e.clone() {
        let mut line = e.kind.to_string();
        if !e.path.is_empty() {
            line.push_str(&format!(" for key `{}`", e.path.join(".")));
        }
        if let Some(md) = &e.metadata {
            match &md.source {
                Some(source) => line.push_str(&format!(" in {} {}", source, md.name)),
                None => line.push_str(&format!(" in {}", md.name)),
            }
        }
        out.push(line);
    }
    out.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn environment_names_that_are_no_setting_are_told_apart() {
        let names = [
            // What a Service called `idemgate` injects into every pod.
            "IDEMGATE_PORT",
            "IDEMGATE_PORT_80_TCP_ADDR",
            "IDEMGATE_SERVICE_HOST",
            "IDEMGATE_DEFAULTS__LEASEE",
            // Settings, in any case, top level and nested.
            "IDEMGATE_LISTEN",
            "idemgate_upstream",
            "IDEMGATE_REDIS_URL",
            "IDEMGATE_DEFAULTS__ON_AMBIGUOUS",
            "IDEMGATE_DEFAULTS",
            // Read elsewhere.
            "IDEMGATE_CONFIG",
            "IDEMGATE_LOG_FORMAT",
            "IDEMGATE_ADMIN_TOKEN",
            "IDEMGATE_NAMESPACE",
            // Not ours.
            "PATH",
            "IDEMGATEWAY",
        ];
        let mistyped = mistyped_env_vars(names.iter().map(|s| s.to_string()));
        assert_eq!(
            mistyped,
            [(
                "IDEMGATE_DEFAULTS__LEASEE".to_string(),
                "did you mean IDEMGATE_DEFAULTS__LEASE?".to_string()
            )]
        );
        let unknown = unknown_env_vars(names.iter().map(|s| s.to_string()));
        assert_eq!(
            unknown,
            [
                "IDEMGATE_DEFAULTS__LEASEE",
                "IDEMGATE_PORT",
                "IDEMGATE_PORT_80_TCP_ADDR",
                "IDEMGATE_SERVICE_HOST"
            ]
        );
    }

    #[test]
    fn names_one_edit_away_or_under_a_table_are_mistyped() {
        let names = [
            "IDEMGATE_DEFAULT__MODE",
            "IDEMGATE_DEFAULTS_MODE",
            "IDEMGATE_DEFAULTS__MODEE",
            "IDEMGATE_ROUTES_0_PATH",
            "IDEMGATE_REDIS_UR",
            "IDEMGATE_UPSTREEM",
            // Kubernetes' service links, and other names far from every setting.
            "IDEMGATE_PORT",
            "IDEMGATE_PORT_80_TCP",
            "IDEMGATE_PORT_80_TCP_ADDR",
            "IDEMGATE_PORT_80_TCP_PORT",
            "IDEMGATE_PORT_80_TCP_PROTO",
            "IDEMGATE_SERVICE_HOST",
            "IDEMGATE_SERVICE_PORT",
            "IDEMGATE_SERVICE_PORT_HTTP",
            "IDEMGATE_NOT_A_SETTING",
        ];
        let mistyped = mistyped_env_vars(names.iter().map(|s| s.to_string()));
        let hint = |n: &str| {
            mistyped
                .iter()
                .find(|(name, _)| name == n)
                .map(|(_, h)| h.clone())
        };
        assert_eq!(
            hint("IDEMGATE_DEFAULT__MODE").as_deref(),
            Some("did you mean IDEMGATE_DEFAULTS__MODE?")
        );
        assert_eq!(
            hint("IDEMGATE_DEFAULTS_MODE").as_deref(),
            Some("did you mean IDEMGATE_DEFAULTS__MODE?")
        );
        assert_eq!(
            hint("IDEMGATE_DEFAULTS__MODEE").as_deref(),
            Some("did you mean IDEMGATE_DEFAULTS__MODE?")
        );
        assert!(hint("IDEMGATE_ROUTES_0_PATH")
            .unwrap()
            .contains("IDEMGATE_ROUTES"));
        assert_eq!(
            hint("IDEMGATE_REDIS_UR").as_deref(),
            Some("did you mean IDEMGATE_REDIS_URL?")
        );
        assert_eq!(
            hint("IDEMGATE_UPSTREEM").as_deref(),
            Some("did you mean IDEMGATE_UPSTREAM?")
        );
        assert_eq!(mistyped.len(), 6, "{mistyped:?}");
    }

    #[test]
    fn one_edit_is_one_edit() {
        assert!(within_one_edit("mode", "mode"));
        assert!(within_one_edit("mode", "modes"));
        assert!(!within_one_edit("mdoe", "mode"), "a swap is two edits");
        assert!(within_one_edit("mxde", "mode"));
        assert!(within_one_edit("ode", "mode"));
        assert!(!within_one_edit("port", "mode"));
        assert!(!within_one_edit("abc", "abcde"));
    }
}
