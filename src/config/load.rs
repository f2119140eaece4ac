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

    /// Extracts the configuration from the layered sources.
    pub fn extract(figment: Figment) -> Result<Config, ConfigError> {
        figment
            .extract()
            .map_err(|e| ConfigError::Source(Box::new(e)))
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
}
