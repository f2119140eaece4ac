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

use crate::config::{Config, ConfigError, Settings};
use crate::store::postgres_tls::PostgresSetup;
use crate::store::seal::Envelope;
use crate::store::RedisSetup;
use crate::tls::{ListenerTls, UpstreamTls};

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
