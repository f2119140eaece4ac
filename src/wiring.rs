//! Where the process is wired: the runtime objects that the plain [`Settings`] describe
//! (the TLS listener and the upstream's TLS client, how Redis is reached, the PostgreSQL
//! TLS files, the envelope of records at rest) are built here, once, before anything binds.
//!
//! `config` reads and checks values; what needs a runtime module to check (a certificate
//! that parses, a Redis URL the client accepts) is checked as it is built, and fails the
//! same way: a [`ConfigError`] naming the key, exit code 64. The checks run in the order
//! they always have: the listener's files and the store's settings before the rest, the
//! upstream's TLS once the upstream's URI is known.

use figment::Figment;

use crate::config::{Config, ConfigError, Policy, Settings};
use crate::scope::TenantSource;
use crate::store::postgres::tls::PostgresSetup;
use crate::store::seal::Envelope;
use crate::store::{RedisSetup, StoreKind};
use crate::tls::{ListenerTls, UpstreamTls};

/// Start-up's warning for the embedded in-memory store (said where it is opened).
pub use crate::store::open::MEMORY_STORE_WARNING;

/// Start-up's warning (and `config check`'s) for protected routes whose tenant is a raw
/// credential (`Authorization`, the default): a client that refreshes its token between a
/// request and its retry is a new tenant there, and the retry executes again.
pub fn raw_credential_warning(settings: &Settings) -> Option<String> {
    let raw = |p: &Policy| {
        !p.methods.is_empty()
            && match &p.tenant {
                TenantSource::Credentials => true,
                TenantSource::Headers(names) => names.contains(&hyper::header::AUTHORIZATION),
                _ => false,
            }
    };
    let mut routes: Vec<&str> = settings
        .routes
        .iter()
        .filter(|(_, p)| raw(p))
        .map(|(path, _)| path.as_str())
        .collect();
    if raw(&settings.default_policy) {
        routes.insert(0, "[defaults]");
    }
    if routes.is_empty() {
        return None;
    }
    Some(format!(
        "the tenant of {} is the raw Authorization credential: a refreshed token is a new tenant, so a retry made after a client refreshes its token executes again; name a stable principal with tenant_jwt_claim (a verified JWT claim) or tenant_headers (a stable header such as an account id)",
        routes.join(", ")
    ))
}

/// Start-up's warning for an admin listener that other hosts reach without a token.
pub fn open_admin_warning(c: &Config) -> Option<String> {
    let addr = c.admin_listen?;
    // An operator's token counts as a token: with one, nobody acts anonymously.
    let tokens = c.admin_token.is_some() || !c.admin_operators.is_empty();
    (!addr.ip().is_loopback() && !tokens).then(|| format!("the admin listener ({addr}) is reachable from other hosts without admin_token or admin_operators: anyone who reaches it can release records"))
}

/// The validated settings and what was built from them.
#[derive(Debug, Clone)]
pub struct Wired {
    /// The plain settings; `config.postgres_url` carries the files the `postgres_tls_*`
    /// keys named, as the parameters they stand for (the store is handed that URL alone).
    pub settings: Settings,
    /// The TLS listener (`tls_cert_file`), when `listen` speaks TLS.
    pub listener_tls: Option<ListenerTls>,
    /// How idemgate talks TLS to an `https://` upstream; `None` for `http://`.
    pub upstream_tls: Option<UpstreamTls>,
    /// The Redis store, when one is configured.
    pub redis: Option<RedisSetup>,
    /// How recorded answers are kept at rest (sealed, compressed).
    pub envelope: Envelope,
}

impl Wired {
    /// Validates `config` and builds its runtime objects.
    pub fn new(mut config: Config) -> Result<Wired, ConfigError> {
        let listener_tls = crate::tls::listener(&config)?;
        if let Some(pg) = PostgresSetup::from_config(&config)? {
            config.postgres_url = Some(pg.url.as_str().into());
        }
        let redis = RedisSetup::from_config(&config)?;
        let settings = Settings::new(config)?;
        let https = settings.upstream.scheme == hyper::http::uri::Scheme::HTTPS;
        let upstream_tls = crate::tls::upstream(&settings.config, https)?;
        let envelope = Envelope::new(&settings.at_rest);
        Ok(Wired {
            settings,
            listener_tls,
            upstream_tls,
            redis,
            envelope,
        })
    }

    /// Extracts the layered sources ([`Config::figment`]), validates and builds.
    pub fn load(figment: Figment) -> Result<Wired, ConfigError> {
        Wired::new(Config::extract(figment)?)
    }

    /// What start-up warns about from the configuration alone (before it connects
    /// anywhere), in the words it logs: `idemgate config check` prints the same.
    pub fn warnings(&self) -> Vec<String> {
        let c = &self.settings.config;
        let mut out = Vec::new();
        match StoreKind::of(c) {
            StoreKind::Postgres => {
                let url = c
                    .postgres_url
                    .as_ref()
                    .map(|u| u.expose())
                    .unwrap_or_default();
                if let Some(w) = PostgresSetup::from_url(url).ok().and_then(|s| s.warning()) {
                    out.push(w);
                }
            }
            StoreKind::Memory => out.push(MEMORY_STORE_WARNING.to_string()),
            StoreKind::Redis | StoreKind::Sqlite => {}
        }
        if let Some(w) = open_admin_warning(c) {
            out.push(w);
        }
        if let Some(w) = raw_credential_warning(&self.settings) {
            out.push(w);
        }
        out
    }

    /// What `idemgate config check` runs, and a reload with it: the variables among `env`
    /// (the process's environment names) that look like a mistyped setting, then every
    /// invalid value ([`load_all`](Self::load_all)); each problem in the words `config
    /// check` prints it.
    pub fn check(
        figment: Figment,
        env: impl IntoIterator<Item = String>,
    ) -> Result<Wired, Vec<String>> {
        let mut problems: Vec<String> = crate::config::mistyped_env_vars(env.into_iter())
            .into_iter()
            .map(|(name, hint)| {
                format!("{name} names no setting, so its value does not apply: {hint}")
            })
            .collect();
        match Wired::load_all(figment) {
            Ok(wired) if problems.is_empty() => Ok(wired),
            Ok(_) => Err(problems),
            Err(invalid) => {
                problems.extend(invalid.iter().map(ToString::to_string));
                Err(problems)
            }
        }
    }

    /// As [`load`](Self::load), but every problem rather than the first (for start-up and
    /// `idemgate config check`): after each invalid value, that key is put back to its default and
    /// the checks run again, until they pass, a key comes up a second time (a problem
    /// between two keys, which the default does not lift), or the value cannot be put
    /// back. The problems of the sources themselves (a value of the wrong type, a key that
    /// is no setting where it is written, each named with its source) are reported
    /// without the checks of values, which would only repeat them.
    pub fn load_all(figment: Figment) -> Result<Wired, Vec<ConfigError>> {
        let mut config = Config::extract_all(&figment)?;
        let defaults = serde_json::to_value(Config::default()).unwrap_or_default();
        let mut problems: Vec<ConfigError> = Vec::new();
        let mut seen: Vec<String> = Vec::new();
        for _ in 0..64 {
            let key = match Wired::new(config.clone()) {
                Ok(wired) if problems.is_empty() => return Ok(wired),
                Ok(_) => break,
                Err(e) => {
                    let key = match &e {
                        ConfigError::Invalid { key, .. } => Some(key.clone()),
                        ConfigError::Source(_) | ConfigError::Read { .. } => None,
                    };
                    if key.as_ref().is_some_and(|k| seen.contains(k)) {
                        break;
                    }
                    problems.push(e);
                    match key {
                        Some(k) => k,
                        None => break,
                    }
                }
            };
            seen.push(key.clone());
            let Ok(mut value) = serde_json::to_value(&config) else {
                break;
            };
            if !reset(&mut value, &defaults, &key) {
                break;
            }
            match serde_json::from_value::<Config>(value) {
                Ok(c) => config = c,
                Err(_) => break,
            }
        }
        Err(problems)
    }
}

/// Puts the value at `path` (`redis_url`, `defaults.mode`, `routes[0].lease`) in `value`
/// back to what it is in `defaults` (absent there: unset). Whether the path was found.
fn reset(value: &mut serde_json::Value, defaults: &serde_json::Value, path: &str) -> bool {
    let mut segments: Vec<(String, Option<usize>)> = Vec::new();
    for part in path.split('.') {
        let (name, index) = match part.split_once('[') {
            Some((n, rest)) => (n, rest.trim_end_matches(']').parse::<usize>().ok()),
            None => (part, None),
        };
        segments.push((name.to_string(), index));
    }
    let mut at = value;
    let mut default = Some(defaults);
    let last = segments.len().saturating_sub(1);
    for (i, (name, index)) in segments.iter().enumerate() {
        let Some(map) = at.as_object_mut() else {
            return false;
        };
        default = default.and_then(|d| d.get(name));
        if i == last && index.is_none() {
            let put = default.cloned().unwrap_or(serde_json::Value::Null);
            map.insert(name.clone(), put);
            return true;
        }
        let Some(next) = map.get_mut(name) else {
            return false;
        };
        at = next;
        if let Some(n) = index {
            default = default.and_then(|d| d.get(n));
            let Some(item) = at.get_mut(*n) else {
                return false;
            };
            at = item;
            if i == last {
                // A whole entry of a list: no default to put back.
                return false;
            }
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use figment::providers::{Format, Serialized, Toml};

    use super::*;

    fn settings(toml: &str) -> Result<Wired, ConfigError> {
        Wired::load(
            Figment::from(Serialized::defaults(Config::default())).merge(Toml::string(toml)),
        )
    }

    #[test]
    fn upstream_http2_reads_booleans_and_prior_knowledge() {
        use crate::config::UpstreamHttp2;
        for (toml, want) in [
            ("", UpstreamHttp2::Offer),
            ("upstream_http2 = true", UpstreamHttp2::Offer),
            ("upstream_http2 = false", UpstreamHttp2::Off),
            (
                "upstream_http2 = \"prior_knowledge\"",
                UpstreamHttp2::PriorKnowledge,
            ),
        ] {
            let wired = settings(toml).unwrap();
            assert_eq!(wired.settings.config.upstream_http2, want, "{toml:?}");
        }
        // The ALPN of an https:// upstream's pass-through client offers h2 unless `false`.
        let https = "upstream = \"https://127.0.0.1:1\"\nupstream_http2 = \"prior_knowledge\"";
        assert!(settings(https).unwrap().upstream_tls.unwrap().http2);
    }

    #[test]
    fn bad_values_name_their_key() {
        for (toml, key) in [
            ("upstream = \"ftp://x:1\"", "upstream"),
            ("upstream_tls_ca_file = \"/ca.pem\"", "upstream_tls_ca_file"),
            (
                "upstream = \"https://x\"\nupstream_tls_cert_file = \"/c.pem\"",
                "upstream_tls_key_file",
            ),
            (
                "upstream = \"https://x\"\nupstream_tls_ca_file = \"/nonexistent/ca.pem\"",
                "upstream_tls_ca_file",
            ),
            (
                "upstream = \"https://x\"\nupstream_tls_server_name = \"not a name\"",
                "upstream_tls_server_name",
            ),
            ("tls_key_file = \"/k.pem\"", "tls_cert_file"),
            ("tls_client_auth = \"optional\"", "tls_client_auth"),
            (
                "tls_cert_file = \"/nonexistent/c.pem\"\ntls_key_file = \"/nonexistent/k.pem\"",
                "tls_cert_file",
            ),
            ("upstream = \"http://x:1/api\"", "upstream"),
            ("[defaults]\nlease = \"10ms\"", "defaults.lease"),
            ("[defaults]\nretention = \"1s\"", "defaults.retention"),
            (
                "[[routes]]\npath = \"/a\"\nmethods = [\"PO ST\"]",
                "routes[0].methods",
            ),
            ("[[routes]]\npath = \"a\"", "routes[0].path"),
            (
                "[[routes]]\npath = \"/a\"\nfingerprint_ignore = [\"x\"]",
                "routes[0].fingerprint_ignore",
            ),
            ("redis_url = \"nope://\"", "redis_url"),
            (
                "redis_url = \"redis://127.0.0.1:6379/0\"\nnamespace = \"p\"\nstore_path = \"/tmp/x\"",
                "store_path",
            ),
            ("postgres_url = \"postgres://x@127.0.0.1/db\"", "namespace"),
            ("postgres_url = \"postgres://x@127.0.0.1/db?sslmode=nope\"\nnamespace = \"p\"", "postgres_url"),
            ("max_in_flight = 0", "max_in_flight"),
            ("upstream_http2 = \"h2\"", "upstream_http2"),
            ("max_connections = 0", "max_connections"),
            ("idle_timeout = \"0s\"", "idle_timeout"),
            (
                "[[routes]]\npath = \"/a\"\nmax_response_bytes = 0",
                "routes[0].max_response_bytes",
            ),
        ] {
            let err = settings(toml).unwrap_err().to_string();
            assert!(err.contains(key), "{toml:?}: {err}");
        }
        let err = settings("[defaults]\nretention = \"soon\"")
            .unwrap_err()
            .to_string();
        assert!(err.contains("defaults.retention"), "{err}");
        let err = settings("listen_addr = \"x\"").unwrap_err().to_string();
        assert!(err.contains("listen_addr"), "{err}");
    }
}
