//! How idemgate reaches PostgreSQL, TLS included, validated from `postgres_url` and the
//! `postgres_tls_*` keys.
//!
//! libpq's `sslmode` values are read by idemgate itself, since tokio-postgres knows only
//! `disable`, `prefer` and `require`: `sslmode`, `sslrootcert`, `sslcert` and `sslkey` are
//! taken out of the connection string (URL or `key=value` form) before tokio-postgres parses
//! the rest, and TLS is applied here, with rustls and its ring provider:
//!
//! - `disable` (and no `sslmode` at all): plain TCP. Without `sslmode`, a host that is not
//!   this machine's gets a warning at start-up.
//! - `require`: encrypted, the server not verified, with a warning at start-up; with a root
//!   certificate, as `verify-ca` (as libpq does).
//! - `verify-ca`: the chain up to a trusted root, not the name.
//! - `verify-full`: the chain and the name (the host of the connection string, a DNS name
//!   or an IP address).
//! - `prefer` and `allow` are refused: both fall back to plain text whenever the server (or
//!   anyone on the path answering for it) declines TLS, so they protect against nobody who
//!   can touch the connection; the operator chooses `disable` or `require` instead.
//!
//! The trusted roots are `postgres_tls_ca_file` (or `sslrootcert`), else the system's
//! (`sslrootcert=system`, libpq's word for them, says the same). libpq's default files under
//! `~/.postgresql/` are not read. The client certificate (`postgres_tls_cert_file` and
//! `postgres_tls_key_file`, or `sslcert` and `sslkey`) is presented to servers that ask.
//!
//! A key and the URL parameter for the same file may both be given only with the same
//! value. Everything that can be checked without the network is checked at start (exit 64,
//! the key at fault named), files read included.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore};
use rustls::{Error as TlsError, SignatureScheme};

use super::conninfo::{join, split};
use crate::config::{Config, ConfigError};

/// ALPN of PostgreSQL 17's direct TLS (`sslnegotiation=direct`), which such a server
/// requires there; servers before 17 ignore it. libpq sends it too.
const ALPN: &[u8] = b"postgresql";

/// The connection string's key of each TLS parameter.
pub(super) const SSLMODE: &str = "sslmode";
pub(super) const SSLROOTCERT: &str = "sslrootcert";
pub(super) const SSLCERT: &str = "sslcert";
pub(super) const SSLKEY: &str = "sslkey";

/// libpq's `sslmode`, as far as idemgate offers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    /// Plain TCP.
    Disable,
    /// TLS, the server's certificate not verified at all.
    Require,
    /// TLS, the certificate's chain verified, not its name.
    VerifyCa,
    /// TLS, the chain and the name verified.
    VerifyFull,
}

impl SslMode {
    fn parse(value: &str) -> Result<SslMode, String> {
        match value {
            "disable" => Ok(SslMode::Disable),
            "require" => Ok(SslMode::Require),
            "verify-ca" => Ok(SslMode::VerifyCa),
            "verify-full" => Ok(SslMode::VerifyFull),
            "prefer" | "allow" => Err(format!(
                "sslmode={value} is not offered: it falls back to plain text whenever the server \
                 (or anyone on the path answering for it) declines TLS, so it protects against \
                 nobody who can reach the connection. Choose verify-full (or verify-ca, require) \
                 for TLS, or disable for plain text on a trusted network"
            )),
            _ => Err(format!(
                "sslmode `{value}` is not one of disable, require, verify-ca, verify-full"
            )),
        }
    }

    /// libpq's word for it.
    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a file's path was given: a key of its own, or a parameter of `postgres_url`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Key(&'static str),
    Url(&'static str),
}

impl Source {
    /// How an error message names it.
    fn name(self) -> String {
        match self {
            Source::Key(k) => k.to_string(),
            Source::Url(p) => format!("{p} in postgres_url"),
        }
    }

    fn invalid(self, reason: impl fmt::Display) -> ConfigError {
        match self {
            Source::Key(k) => invalid(k, reason.to_string()),
            Source::Url(p) => invalid("postgres_url", format!("{p}: {reason}")),
        }
    }
}

/// The trusted roots.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Roots {
    /// The system's.
    System,
    /// The certificates of this file.
    File(PathBuf, Source),
}

/// The validated PostgreSQL part of the configuration.
#[derive(Clone)]
pub struct PostgresSetup {
    /// The connection string without its TLS parameters, parsed by tokio-postgres.
    pub config: tokio_postgres::Config,
    /// The mode in force (`require` with a root certificate is `verify-ca`).
    pub mode: SslMode,
    /// Whether the connection string said `sslmode` at all.
    pub mode_given: bool,
    /// The TLS client configuration; `None` with `disable`.
    pub tls: Option<Arc<ClientConfig>>,
    /// The connection string with every TLS file that a key named written into it, in its
    /// own form: what the store is handed, and what its connections are opened with.
    pub url: String,
}

impl fmt::Debug for PostgresSetup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresSetup")
            .field("mode", &self.mode)
            .field("hosts", &self.hosts())
            .finish_non_exhaustive()
    }
}

fn invalid(key: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        reason: reason.into(),
    }
}

/// With TLS off, the first TLS file `given` (where it was given) is refused: it would
/// be ignored without a word. `said` is whether `postgres_url` names an `sslmode`.
fn files_without_tls(given: [Option<Source>; 4], said: bool) -> Result<(), ConfigError> {
    let Some(from) = given.into_iter().flatten().next() else {
        return Ok(());
    };
    let said = if said {
        "postgres_url says sslmode=disable"
    } else {
        "postgres_url has no sslmode, which is disable"
    };
    Err(from.invalid(format!(
        "TLS is off ({said}): add sslmode=verify-full (or verify-ca, require) to postgres_url"
    )))
}

/// A file named both by a key and by a URL parameter: the same file, or a conflict that
/// names the key.
fn merge(
    key: &'static str,
    setting: Option<&Path>,
    param: &'static str,
    url: Option<&str>,
) -> Result<Option<(PathBuf, Source)>, ConfigError> {
    match (setting, url) {
        (Some(s), Some(u)) if s != Path::new(u) => Err(invalid(
            key,
            format!(
                "conflicts with {param}={u} in postgres_url: give the file in one place, or the same file in both"
            ),
        )),
        (Some(s), _) => Ok(Some((s.to_path_buf(), Source::Key(key)))),
        (None, Some(u)) => Ok(Some((PathBuf::from(u), Source::Url(param)))),
        (None, None) => Ok(None),
    }
}

impl PostgresSetup {
    /// Validates `postgres_url` and the `postgres_tls_*` keys of `c`; `Ok(None)` without a
    /// `postgres_url` (when none of those keys may be set either).
    pub fn from_config(c: &Config) -> Result<Option<PostgresSetup>, ConfigError> {
        let Some(url) = &c.postgres_url else {
            for (key, set) in [
                ("postgres_tls_ca_file", c.postgres_tls_ca_file.is_some()),
                ("postgres_tls_cert_file", c.postgres_tls_cert_file.is_some()),
                ("postgres_tls_key_file", c.postgres_tls_key_file.is_some()),
            ] {
                if set {
                    return Err(invalid(key, "no postgres_url is configured"));
                }
            }
            return Ok(None);
        };
        Self::resolve(
            url.expose(),
            c.postgres_tls_ca_file.as_deref(),
            c.postgres_tls_cert_file.as_deref(),
            c.postgres_tls_key_file.as_deref(),
        )
        .map(Some)
    }

    /// As [`from_config`](Self::from_config), from a connection string alone: the one in
    /// [`url`](Self::url), which carries every file the keys named.
    pub fn from_url(url: &str) -> Result<PostgresSetup, ConfigError> {
        Self::resolve(url, None, None, None)
    }

    fn resolve(
        url: &str,
        ca_file: Option<&Path>,
        cert_file: Option<&Path>,
        key_file: Option<&Path>,
    ) -> Result<PostgresSetup, ConfigError> {
        let bad_url = |reason: String| invalid("postgres_url", reason);
        let split = split(url).map_err(bad_url)?;
        let config: tokio_postgres::Config = split
            .rest
            .parse()
            .map_err(|e: tokio_postgres::Error| bad_url(e.to_string()))?;
        let p = &split.params;
        let asked = match &p.sslmode {
            Some(m) => SslMode::parse(m).map_err(bad_url)?,
            None => SslMode::Disable,
        };
        let system = p.sslrootcert.as_deref() == Some("system");
        if system && ca_file.is_some() {
            return Err(invalid(
                "postgres_tls_ca_file",
                "conflicts with sslrootcert=system in postgres_url: give the roots in one place",
            ));
        }
        let ca = merge(
            "postgres_tls_ca_file",
            ca_file,
            SSLROOTCERT,
            p.sslrootcert.as_deref().filter(|_| !system),
        )?;
        let cert = merge(
            "postgres_tls_cert_file",
            cert_file,
            SSLCERT,
            p.sslcert.as_deref(),
        )?;
        let key = merge(
            "postgres_tls_key_file",
            key_file,
            SSLKEY,
            p.sslkey.as_deref(),
        )?;
        let roots = match &ca {
            Some((path, from)) => Some(Roots::File(path.clone(), *from)),
            None if system => Some(Roots::System),
            None => None,
        };
        // libpq: `require` with a root certificate verifies the chain, as verify-ca.
        let mode = match (asked, &roots) {
            (SslMode::Require, Some(_)) => SslMode::VerifyCa,
            (m, _) => m,
        };
        if mode == SslMode::Disable {
            let given = [
                ca.as_ref().map(|(_, f)| *f),
                system.then_some(Source::Url(SSLROOTCERT)),
                cert.as_ref().map(|(_, f)| *f),
                key.as_ref().map(|(_, f)| *f),
            ];
            files_without_tls(given, p.sslmode.is_some())?;
        }
        let tls = if mode == SslMode::Disable {
            None
        } else {
            if config
                .get_hosts()
                .iter()
                .any(|h| !matches!(h, tokio_postgres::config::Host::Tcp(_)))
            {
                return Err(bad_url(format!(
                    "sslmode={}: PostgreSQL does not speak TLS over a unix socket; connect to a TCP host, or use sslmode=disable on the socket",
                    mode
                )));
            }
            Some(Arc::new(client_config(
                mode,
                roots.as_ref(),
                cert.as_ref(),
                key.as_ref(),
            )?))
        };
        // What the store is handed: the keys' files written into the string, so that it
        // needs nothing else.
        let mut params = p.clone();
        for (slot, found) in [
            (&mut params.sslrootcert, &ca),
            (&mut params.sslcert, &cert),
            (&mut params.sslkey, &key),
        ] {
            if let Some((path, Source::Key(k))) = found {
                let text = path
                    .to_str()
                    .ok_or_else(|| invalid(k, format!("{} is not a UTF-8 path", path.display())))?;
                *slot = Some(text.to_string());
            }
        }
        Ok(PostgresSetup {
            config,
            mode,
            mode_given: p.sslmode.is_some(),
            tls,
            url: join(split.form, &split.rest, &params),
        })
    }

    /// `host:port` of each host, for messages (never the credentials).
    pub fn hosts(&self) -> String {
        let ports = self.config.get_ports();
        self.config
            .get_hosts()
            .iter()
            .enumerate()
            .map(|(i, h)| {
                let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
                match h {
                    tokio_postgres::config::Host::Tcp(name) if name.contains(':') => {
                        format!("[{name}]:{port}")
                    }
                    tokio_postgres::config::Host::Tcp(name) => format!("{name}:{port}"),
                    tokio_postgres::config::Host::Unix(path) => path.display().to_string(),
                }
            })
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Whether every host is this machine: a loopback address, `localhost`, or a unix
    /// socket (no host at all is one too).
    pub fn local(&self) -> bool {
        let addrs_local = self.config.get_hostaddrs().iter().all(|a| a.is_loopback());
        let hosts_local = self.config.get_hosts().iter().all(|h| match h {
            tokio_postgres::config::Host::Tcp(name) => {
                name.eq_ignore_ascii_case("localhost")
                    || name
                        .trim_start_matches('[')
                        .trim_end_matches(']')
                        .parse::<std::net::IpAddr>()
                        .is_ok_and(|ip| ip.is_loopback())
            }
            tokio_postgres::config::Host::Unix(_) => true,
        });
        if self.config.get_hostaddrs().is_empty() {
            hosts_local
        } else {
            addrs_local
        }
    }

    /// What start-up warns about: a server that is not verified, or plain text to another
    /// machine because no `sslmode` was given.
    pub fn warning(&self) -> Option<String> {
        match self.mode {
            SslMode::Require => Some(format!(
                "PostgreSQL at {} over TLS with sslmode=require: the connection is encrypted but the server is not verified (anyone on the path can pose as it); set sslmode=verify-full and postgres_tls_ca_file",
                self.hosts()
            )),
            SslMode::Disable if !self.mode_given && !self.local() => Some(format!(
                "PostgreSQL at {} without TLS: postgres_url has no sslmode, so records and credentials cross the network in plain text; add sslmode=verify-full (or sslmode=disable on a trusted network)",
                self.hosts()
            )),
            _ => None,
        }
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read(from: Source, path: &Path) -> Result<Vec<u8>, ConfigError> {
    std::fs::read(path).map_err(|e| from.invalid(format!("cannot read {}: {e}", path.display())))
}

fn root_store(roots: Option<&Roots>) -> Result<RootCertStore, ConfigError> {
    let mut store = RootCertStore::empty();
    match roots {
        Some(Roots::File(path, from)) => {
            let pem = read(*from, path)?;
            let certs = crate::tls::parse_certs(&pem)
                .map_err(|e| from.invalid(format!("{}: {e}", path.display())))?;
            for cert in certs {
                store.add(cert).map_err(|e| {
                    from.invalid(format!(
                        "{}: not a usable CA certificate: {e}",
                        path.display()
                    ))
                })?;
            }
        }
        Some(Roots::System) | None => {
            let found = rustls_native_certs::load_native_certs();
            for e in &found.errors {
                tracing::warn!(error = %e, "reading the system's CA certificates");
            }
            let (added, _ignored) = store.add_parsable_certificates(found.certs);
            if added == 0 {
                return Err(invalid(
                    "postgres_tls_ca_file",
                    "the system has no CA certificates to verify PostgreSQL with: name the server's CA here (or install ca-certificates)",
                ));
            }
        }
    }
    Ok(store)
}

fn client_config(
    mode: SslMode,
    roots: Option<&Roots>,
    cert: Option<&(PathBuf, Source)>,
    key: Option<&(PathBuf, Source)>,
) -> Result<ClientConfig, ConfigError> {
    let provider = provider();
    let verifier: Arc<dyn ServerCertVerifier> = match mode {
        SslMode::Require => Arc::new(Forgiving {
            chain: None,
            provider: provider.clone(),
        }),
        SslMode::VerifyCa | SslMode::VerifyFull => {
            let webpki = WebPkiServerVerifier::builder_with_provider(
                Arc::new(root_store(roots)?),
                provider.clone(),
            )
            .build()
            .map_err(|e| invalid("postgres_tls_ca_file", format!("no usable roots: {e}")))?;
            if mode == SslMode::VerifyCa {
                Arc::new(Forgiving {
                    chain: Some(webpki),
                    provider: provider.clone(),
                })
            } else {
                webpki
            }
        }
        SslMode::Disable => unreachable!("no TLS configuration for sslmode=disable"),
    };
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| invalid("postgres_url", format!("TLS: {e}")))?
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    let mut config = match (cert, key) {
        (Some((cert, cert_from)), Some((key, key_from))) => {
            let cert_pem = read(*cert_from, cert)?;
            let key_pem = read(*key_from, key)?;
            let certified =
                crate::tls::certified_key(&cert_pem, &key_pem, crate::tls::Role::Client).map_err(
                    |(side, why)| {
                        let (from, path) = match side {
                            crate::tls::Side::Cert => (cert_from, cert),
                            crate::tls::Side::Key => (key_from, key),
                        };
                        from.invalid(format!("{}: {why}", path.display()))
                    },
                )?;
            builder.with_client_cert_resolver(Arc::new(rustls::sign::SingleCertAndKey::from(
                certified,
            )))
        }
        (None, None) => builder.with_no_client_auth(),
        (Some((_, from)), None) => {
            return Err(half_pair(*from, "postgres_tls_key_file", SSLKEY));
        }
        (None, Some((_, from))) => {
            return Err(half_pair(*from, "postgres_tls_cert_file", SSLCERT));
        }
    };
    config.alpn_protocols = vec![ALPN.to_vec()];
    // Off by default in rustls; said here so that it stays off: 0-RTT data can be replayed
    // by anyone who recorded it.
    config.enable_early_data = false;
    assert!(!config.enable_early_data);
    Ok(config)
}

/// A client certificate without its key, or a key without its certificate: the missing
/// one is named (a key when the other half came from a key).
fn half_pair(given: Source, missing_key: &'static str, missing_param: &str) -> ConfigError {
    let reason = format!(
        "required with {}: give the client certificate and its key together ({missing_key}, or {missing_param} in postgres_url)",
        given.name()
    );
    match given {
        Source::Key(_) => invalid(missing_key, reason),
        Source::Url(_) => invalid("postgres_url", reason),
    }
}

/// What an `sslmode` below `verify-full` forgives of a server certificate.
///
/// `verify-ca` (`chain`): the chain up to a trusted root (validity dates, usage,
/// signatures) as webpki verifies it, and nothing about the name. webpki checks the name
/// last, once the chain is verified, so a name that does not match is the only failure
/// forgiven.
///
/// DANGER, `sslmode=require` without a root certificate (no `chain`): ANY server
/// certificate is accepted, expired, self-signed or another server's. The handshake's
/// signature is still checked against the certificate presented, which proves nothing
/// about who the server is. Encryption against passive listeners only; start-up warns that
/// the server is not verified.
///
/// Either way the handshake's signatures are checked with the provider's algorithms, as
/// webpki checks them.
#[derive(Debug)]
struct Forgiving {
    chain: Option<Arc<WebPkiServerVerifier>>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for Forgiving {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, TlsError> {
        let Some(chain) = &self.chain else {
            return Ok(ServerCertVerified::assertion());
        };
        match chain.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            Err(TlsError::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, TlsError> {
        let algorithms = &self.provider.signature_verification_algorithms;
        rustls::crypto::verify_tls12_signature(message, cert, dss, algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, TlsError> {
        let algorithms = &self.provider.signature_verification_algorithms;
        rustls::crypto::verify_tls13_signature(message, cert, dss, algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// The rustls error under a tokio-postgres one, when TLS is what failed: its words name
/// the reason (an unknown issuer, an expired certificate, a name the certificate is not
/// for, a client certificate the server wanted).
pub fn tls_failure(e: &tokio_postgres::Error) -> Option<String> {
    let text = e.to_string();
    let rest = text.strip_prefix("error performing TLS handshake")?;
    let cause = std::error::Error::source(e);
    let rustls = cause
        .and_then(|c| c.downcast_ref::<std::io::Error>())
        .and_then(|io| io.get_ref())
        .and_then(|inner| inner.downcast_ref::<TlsError>());
    Some(match rustls {
        Some(r) => r.to_string(),
        None => rest.trim_start_matches(": ").to_string(),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::super::conninfo::{Form, Params, Split};
    use super::*;

    fn split_ok(s: &str) -> Split {
        split(s).unwrap()
    }

    /// Why `url` is refused.
    fn refusal(url: &str) -> String {
        PostgresSetup::from_url(url).unwrap_err().to_string()
    }

    #[test]
    fn url_parameters_are_taken_out_and_the_rest_kept() {
        let s = split_ok(
            "postgres://app:p%3Fss@db:5432/pay?application_name=x&sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem&connect_timeout=3",
        );
        assert_eq!(s.form, Form::Url);
        assert_eq!(
            s.rest,
            "postgres://app:p%3Fss@db:5432/pay?application_name=x&connect_timeout=3"
        );
        assert_eq!(s.params.sslmode.as_deref(), Some("verify-full"));
        assert_eq!(s.params.sslrootcert.as_deref(), Some("/etc/ca.pem"));
        let s = split_ok("postgresql://db/pay?sslmode=require");
        assert_eq!(s.rest, "postgresql://db/pay");
        // A `?` in the password is not the query.
        let s = split_ok("postgres://app:a?sslmode=x@db/pay");
        assert_eq!(s.rest, "postgres://app:a?sslmode=x@db/pay");
        assert_eq!(s.params, Params::default());
    }

    #[test]
    fn key_value_parameters_are_taken_out_and_the_rest_kept() {
        let s = split_ok(
            r"host=db user=app password='it\'s' sslmode = verify-ca sslcert='/a b/c.pem' sslkey=/k\ x.pem dbname=pay",
        );
        assert_eq!(s.form, Form::KeyValue);
        assert_eq!(s.params.sslmode.as_deref(), Some("verify-ca"));
        assert_eq!(s.params.sslcert.as_deref(), Some("/a b/c.pem"));
        assert_eq!(s.params.sslkey.as_deref(), Some("/k x.pem"));
        assert!(
            s.rest.starts_with("host=db user=app password="),
            "{}",
            s.rest
        );
        assert!(s.rest.ends_with(" dbname=pay"), "{}", s.rest);
        assert!(!s.rest.contains("ssl"), "{}", s.rest);
    }

    #[test]
    fn a_parameter_given_twice_differently_is_refused() {
        assert!(split("postgres://db/x?sslmode=require&sslmode=disable").is_err());
        assert!(split("host=db sslkey=/a sslkey=/b").is_err());
        assert!(split("postgres://db/x?sslmode=require&sslmode=require").is_ok());
    }

    #[test]
    fn joined_back_the_parameters_read_the_same() {
        let params = Params {
            sslmode: Some("verify-full".into()),
            sslrootcert: Some("/a b/it's&?.pem".into()),
            sslcert: None,
            sslkey: Some(r"C:\k.pem".into()),
        };
        for (form, rest) in [
            (Form::Url, "postgres://u:p@db/x"),
            (Form::Url, "postgres://u:p@db/x?application_name=y"),
            (Form::KeyValue, "host=db user=u"),
            (Form::KeyValue, ""),
        ] {
            let s = join(form, rest, &params);
            let back = split_ok(&s);
            assert_eq!(back.params, params, "{s}");
            assert_eq!(back.rest, rest, "{s}");
        }
    }

    #[test]
    fn modes() {
        for (url, mode) in [
            ("postgres://db/x", SslMode::Disable),
            ("postgres://db/x?sslmode=disable", SslMode::Disable),
            ("postgres://db/x?sslmode=require", SslMode::Require),
            ("host=db sslmode=require", SslMode::Require),
        ] {
            assert_eq!(PostgresSetup::from_url(url).unwrap().mode, mode, "{url}");
        }
        for bad in ["prefer", "allow", "verify", "VERIFY-FULL"] {
            let e = refusal(&format!("postgres://db/x?sslmode={bad}"));
            assert!(e.contains("postgres_url"), "{e}");
        }
        let e = refusal("postgres://db/x?sslmode=prefer");
        assert!(e.contains("plain text"), "{e}");
    }

    #[test]
    fn warnings() {
        let warn = |url: &str| PostgresSetup::from_url(url).unwrap().warning();
        assert!(warn("postgres://db.internal/x").is_some());
        assert!(warn("postgres://10.0.0.5/x").is_some());
        assert!(warn("postgres://127.0.0.1/x").is_none());
        assert!(warn("postgres://localhost/x").is_none());
        assert!(warn("postgres://[::1]:5433/x").is_none());
        assert!(warn("host=/var/run/postgresql dbname=x").is_none());
        assert!(warn("postgres://db.internal/x?sslmode=disable").is_none());
        let w = warn("postgres://127.0.0.1/x?sslmode=require").unwrap();
        assert!(w.contains("not verified"), "{w}");
    }

    #[test]
    fn tls_files_without_tls_or_over_a_unix_socket_are_refused() {
        let e = refusal("postgres://db/x?sslrootcert=/ca.pem");
        assert!(
            e.contains("`postgres_url`") && e.contains("TLS is off"),
            "{e}"
        );
        let e = PostgresSetup::resolve(
            "postgres://db/x?sslmode=disable",
            Some(Path::new("/ca.pem")),
            None,
            None,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("`postgres_tls_ca_file`"), "{e}");
        let e = refusal("host=/tmp sslmode=require");
        assert!(e.contains("unix socket"), "{e}");
    }

    #[test]
    fn hosts_name_no_credentials() {
        let s = PostgresSetup::from_url("postgres://app:hunter2@db:6432,[::1]/x").unwrap();
        assert_eq!(s.hosts(), "db:6432, [::1]:5432");
        assert!(!format!("{s:?}").contains("hunter2"));
    }
}
