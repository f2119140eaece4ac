//! TLS on both sides, with rustls and its ring provider: the client configuration for an
//! `https://` upstream (its roots, the name checked, a client certificate), and the server
//! configuration of a TLS listener, whose certificate is reloaded when its files change.
//!
//! Everything read from a file is read and checked while the configuration is validated,
//! so a file that cannot be used stops start-up (exit 64) with the key that names it. A
//! reload that fails keeps the pair in use.
//!
//! TLS 1.3 early data stays off on both sides: a 0-RTT request can be replayed by anyone
//! who recorded it, which is exactly what idemgate exists to rule out.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, RootCertStore, ServerConfig};

pub use crate::config::ClientAuth;
use crate::config::{Config, ConfigError};

/// ALPN of the TLS listener, and of an upstream with `upstream_http2` on: h2 preferred.
const ALPN: [&[u8]; 2] = [b"h2", b"http/1.1"];

/// TLS handshakes that a listener runs at once (across its serving threads); a connection
/// beyond waits for one to finish, under its `header_read_timeout` like any other. A permit
/// is taken only once the connection's ClientHello has arrived (see [`CLIENT_HELLO_TIMEOUT`]):
/// silent sockets cost a file descriptor each, never a permit.
/// Handshakes are the CPU-heavy part of a connection (an RSA signature each): bounding
/// them keeps a burst of new connections from starving the requests of open ones.
pub const MAX_HANDSHAKES: usize = 256;

/// How long a new TLS connection may take to send its whole ClientHello, with no permit
/// held meanwhile; then it is closed. Real clients send it with their first packet.
pub const CLIENT_HELLO_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

/// The provider every TLS configuration here is built with, named rather than taken from
/// the process default: ring, never a provider that another crate happened to install.
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn invalid(key: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        reason: reason.into(),
    }
}

fn read(key: &str, path: &Path) -> Result<Vec<u8>, ConfigError> {
    std::fs::read(path).map_err(|e| invalid(key, format!("cannot read {}: {e}", path.display())))
}

/// The certificates of a PEM file, in order (leaf first for a chain).
pub(crate) fn parse_certs(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("not PEM certificates: {e}"))?;
    if certs.is_empty() {
        return Err("holds no CERTIFICATE block".into());
    }
    Ok(certs)
}

fn parse_key(pem: &[u8]) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| format!("holds no usable private key: {e}"))
}

/// Which of a pair's two files is at fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    Cert,
    Key,
}

/// Which end of a TLS connection a certificate is presented by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    /// The listener's certificate.
    Server,
    /// A client certificate (to the upstream, Redis, PostgreSQL).
    Client,
}

/// Checks the leaf (the first certificate of a chain) as the peer will: X.509 version 3
/// (webpki refuses older ones, and the peer's error then blames itself: "invalid peer
/// certificate"), valid now (neither expired nor not yet valid), a key usage that allows
/// signatures and an extended key usage that allows `role`, when those are present.
/// Its expiry, as seconds since the Unix epoch, when it passes.
pub(crate) fn check_leaf(chain: &[CertificateDer<'_>], role: Role) -> Result<i64, String> {
    use x509_parser::prelude::FromDer;
    let leaf = chain.first().ok_or("no certificate")?;
    let (_, cert) = x509_parser::certificate::X509Certificate::from_der(leaf)
        .map_err(|e| format!("the certificate does not parse: {e}"))?;
    if cert.version() != x509_parser::x509::X509Version::V3 {
        return Err(format!(
            "the certificate is X.509 version {} (TLS peers accept version 3 only; make it with the v3 extensions, e.g. openssl's -extfile or -addext)",
            cert.version().0 + 1
        ));
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    let validity = cert.validity();
    let (from, until) = (
        validity.not_before.timestamp(),
        validity.not_after.timestamp(),
    );
    if now > until {
        return Err(format!(
            "the certificate expired on {} (not valid after it)",
            validity.not_after
        ));
    }
    if now < from {
        return Err(format!(
            "the certificate is not valid before {}",
            validity.not_before
        ));
    }
    if let Ok(Some(ku)) = cert.key_usage() {
        if !ku.value.digital_signature() && !ku.value.key_encipherment() {
            return Err(format!(
                "the certificate's key usage ({}) allows neither digitalSignature nor keyEncipherment, which TLS needs",
                ku.value
            ));
        }
    }
    if let Ok(Some(eku)) = cert.extended_key_usage() {
        let e = eku.value;
        let allowed = e.any
            || match role {
                Role::Server => e.server_auth,
                Role::Client => e.client_auth,
            };
        if !allowed {
            let wanted = match role {
                Role::Server => "serverAuth",
                Role::Client => "clientAuth",
            };
            return Err(format!(
                "the certificate's extended key usage does not include {wanted}, which its peer requires"
            ));
        }
    }
    Ok(until)
}

/// When the first certificate of the PEM `pem` stops being valid (seconds since the Unix
/// epoch), if it parses.
pub fn leaf_expiry(pem: &[u8]) -> Option<i64> {
    use x509_parser::prelude::FromDer;
    let chain = parse_certs(pem).ok()?;
    let (_, cert) = x509_parser::certificate::X509Certificate::from_der(chain.first()?).ok()?;
    Some(cert.validity().not_after.timestamp())
}

/// A certificate chain and its private key, checked to belong together (the key's public
/// half is the leaf certificate's) and the leaf checked for `role` ([`check_leaf`]).
pub(crate) fn certified_key(
    cert_pem: &[u8],
    key_pem: &[u8],
    role: Role,
) -> Result<CertifiedKey, (Side, String)> {
    let chain = parse_certs(cert_pem).map_err(|e| (Side::Cert, e))?;
    check_leaf(&chain, role).map_err(|e| (Side::Cert, e))?;
    let key = parse_key(key_pem).map_err(|e| (Side::Key, e))?;
    let provider = provider();
    let signing = provider
        .key_provider
        .load_private_key(key)
        .map_err(|e| (Side::Key, format!("cannot load the private key: {e}")))?;
    let certified = CertifiedKey::new(chain, signing);
    // Unlike `CertifiedKey::from_der`, a pair whose match cannot be checked is refused too:
    // every key type ring loads can be checked.
    certified.keys_match().map_err(|e| {
        (
            Side::Key,
            format!("does not belong to the certificate (its leaf's public key is another): {e}"),
        )
    })?;
    Ok(certified)
}

/// A certificate file and its key file, named by their configuration keys.
#[derive(Debug, Clone)]
struct Pair {
    cert_key: &'static str,
    cert: PathBuf,
    key_key: &'static str,
    key: PathBuf,
}

impl Pair {
    /// Both of `cert_key` and `key_key`, or neither.
    fn from_config(
        cert_key: &'static str,
        cert: &Option<PathBuf>,
        key_key: &'static str,
        key: &Option<PathBuf>,
    ) -> Result<Option<Pair>, ConfigError> {
        match (cert, key) {
            (Some(cert), Some(key)) => Ok(Some(Pair {
                cert_key,
                cert: cert.clone(),
                key_key,
                key: key.clone(),
            })),
            (None, None) => Ok(None),
            (Some(_), None) => Err(invalid(key_key, format!("required with {cert_key}"))),
            (None, Some(_)) => Err(invalid(cert_key, format!("required with {key_key}"))),
        }
    }

    /// Reads and checks both files at start-up.
    fn load(&self, role: Role) -> Result<(CertifiedKey, Contents), ConfigError> {
        let contents = Contents {
            cert: read(self.cert_key, &self.cert)?,
            key: read(self.key_key, &self.key)?,
        };
        let certified =
            certified_key(&contents.cert, &contents.key, role).map_err(|(side, why)| {
                let (key, path) = match side {
                    Side::Cert => (self.cert_key, &self.cert),
                    Side::Key => (self.key_key, &self.key),
                };
                invalid(key, format!("{}: {why}", path.display()))
            })?;
        Ok((certified, contents))
    }
}

/// What a pair's two files held when last read.
#[derive(Clone, PartialEq, Eq)]
struct Contents {
    cert: Vec<u8>,
    key: Vec<u8>,
}

/// Trusted roots: the CA file's certificates, or the system's.
fn roots(ca_key: &str, ca_file: Option<&Path>) -> Result<RootCertStore, ConfigError> {
    let mut roots = RootCertStore::empty();
    match ca_file {
        Some(path) => {
            let pem = read(ca_key, path)?;
            let certs = parse_certs(&pem)
                .map_err(|e| invalid(ca_key, format!("{}: {e}", path.display())))?;
            for cert in certs {
                roots.add(cert).map_err(|e| {
                    invalid(
                        ca_key,
                        format!("{}: not a usable CA certificate: {e}", path.display()),
                    )
                })?;
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            for e in &found.errors {
                tracing::warn!(error = %e, "reading the system's CA certificates");
            }
            let (added, _ignored) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                return Err(invalid(
                    ca_key,
                    "the system has no CA certificates to verify the upstream with: install them (ca-certificates) or name the upstream's CA here",
                ));
            }
        }
    }
    Ok(roots)
}

/// How idemgate talks TLS to an `https://` upstream.
#[derive(Clone)]
pub struct UpstreamTls {
    /// Roots, client certificate, ALPN left to the connector (see `upstream::client`).
    pub config: Arc<ClientConfig>,
    /// `upstream_tls_server_name`: the name sent (SNI) and checked instead of the host of
    /// `upstream`.
    pub server_name: Option<ServerName<'static>>,
    /// Whether h2 is offered besides http/1.1 (`upstream_http2` other than `false`; with
    /// `"prior_knowledge"` the h2 client offers h2 alone).
    pub http2: bool,
}

impl fmt::Debug for UpstreamTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpstreamTls")
            .field("server_name", &self.server_name)
            .field("http2", &self.http2)
            .finish_non_exhaustive()
    }
}

/// The upstream's TLS settings, validated: `None` for an `http://` upstream, which must not
/// have any (`https`: whether `upstream` is `https://`).
pub fn upstream(c: &Config, https: bool) -> Result<Option<UpstreamTls>, ConfigError> {
    if !https {
        for (key, set) in [
            ("upstream_tls_ca_file", c.upstream_tls_ca_file.is_some()),
            ("upstream_tls_cert_file", c.upstream_tls_cert_file.is_some()),
            ("upstream_tls_key_file", c.upstream_tls_key_file.is_some()),
            (
                "upstream_tls_server_name",
                c.upstream_tls_server_name.is_some(),
            ),
        ] {
            if set {
                return Err(invalid(key, "applies to an https:// upstream only"));
            }
        }
        return Ok(None);
    }
    let server_name = match &c.upstream_tls_server_name {
        Some(name) => Some(ServerName::try_from(name.clone()).map_err(|e| {
            invalid(
                "upstream_tls_server_name",
                format!("`{name}` is not a DNS name or IP address: {e}"),
            )
        })?),
        None => None,
    };
    let pair = Pair::from_config(
        "upstream_tls_cert_file",
        &c.upstream_tls_cert_file,
        "upstream_tls_key_file",
        &c.upstream_tls_key_file,
    )?;
    let roots = roots("upstream_tls_ca_file", c.upstream_tls_ca_file.as_deref())?;
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| invalid("upstream", format!("TLS: {e}")))?
        .with_root_certificates(roots);
    let mut config = match pair {
        Some(pair) => {
            let (certified, _) = pair.load(Role::Client)?;
            builder.with_client_cert_resolver(Arc::new(rustls::sign::SingleCertAndKey::from(
                certified,
            )))
        }
        None => builder.with_no_client_auth(),
    };
    // Off by default in rustls; said here so that it stays off: an upstream that accepts
    // 0-RTT data could be handed a replay of it by anyone on the path.
    config.enable_early_data = false;
    assert!(!config.enable_early_data);
    Ok(Some(UpstreamTls {
        config: Arc::new(config),
        server_name,
        http2: c.upstream_http2 != crate::config::UpstreamHttp2::Off,
    }))
}

/// A TLS listener: its configuration, and the key pair it serves, which the reloader swaps.
#[derive(Clone)]
pub struct ListenerTls {
    /// The acceptor's configuration, built once; the key pair is looked up per handshake.
    pub config: Arc<ServerConfig>,
    current: Arc<CurrentKey>,
    files: Pair,
    loaded: Contents,
    /// How often the files are read for a change (`tls_reload_interval`).
    pub reload_interval: Duration,
    /// The CAs of `tls_client_ca_file`, one by one: which of them verified a client's
    /// certificate is part of a `tenant_client_cert` tenant. `None` without a client CA.
    pub authorities: Option<Arc<crate::scope::client_cert::Authorities>>,
}

impl fmt::Debug for ListenerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ListenerTls")
            .field("cert", &self.files.cert)
            .field("key", &self.files.key)
            .field("reload_interval", &self.reload_interval)
            .finish_non_exhaustive()
    }
}

/// The TLS listener's settings, validated: `None` without `tls_cert_file`/`tls_key_file`.
pub fn listener(c: &Config) -> Result<Option<ListenerTls>, ConfigError> {
    let pair = Pair::from_config(
        "tls_cert_file",
        &c.tls_cert_file,
        "tls_key_file",
        &c.tls_key_file,
    )?;
    let Some(pair) = pair else {
        for (key, set) in [
            ("tls_client_ca_file", c.tls_client_ca_file.is_some()),
            ("tls_client_auth", c.tls_client_auth.is_some()),
        ] {
            if set {
                return Err(invalid(
                    key,
                    "needs a TLS listener: set tls_cert_file and tls_key_file",
                ));
            }
        }
        return Ok(None);
    };
    if c.tls_reload_interval.is_zero() {
        return Err(invalid("tls_reload_interval", "must be greater than zero"));
    }
    let (certified, loaded) = pair.load(Role::Server)?;
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| invalid("tls_cert_file", format!("TLS: {e}")))?;
    let mut authorities = None;
    let builder = match (&c.tls_client_ca_file, c.tls_client_auth) {
        (None, Some(_)) => {
            return Err(invalid(
                "tls_client_auth",
                "needs tls_client_ca_file: the CA that client certificates are verified against",
            ))
        }
        (None, None) => builder.with_no_client_auth(),
        (Some(ca), auth) => {
            let roots = roots("tls_client_ca_file", Some(ca))?;
            let cas = parse_certs(&read("tls_client_ca_file", ca)?)
                .map_err(|e| invalid("tls_client_ca_file", e))?;
            let each = crate::scope::client_cert::Authorities::new(&cas, provider())
                .map_err(|e| invalid("tls_client_ca_file", e))?;
            authorities = Some(Arc::new(each));
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider());
            let verifier = match auth.unwrap_or(ClientAuth::Required) {
                ClientAuth::Required => verifier,
                ClientAuth::Optional => verifier.allow_unauthenticated(),
            };
            let verifier = verifier
                .build()
                .map_err(|e| invalid("tls_client_ca_file", e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let current = Arc::new(CurrentKey(RwLock::new(Arc::new(certified))));
    let mut config = builder.with_cert_resolver(current.clone());
    config.alpn_protocols = ALPN.iter().map(|p| p.to_vec()).collect();
    // 0 is rustls' default: no 0-RTT data is accepted, so no request can be replayed by
    // whoever recorded a client's first flight.
    config.max_early_data_size = 0;
    assert_eq!(config.max_early_data_size, 0);
    Ok(Some(ListenerTls {
        config: Arc::new(config),
        current,
        files: pair,
        loaded,
        reload_interval: c.tls_reload_interval,
        authorities,
    }))
}

/// The key pair that new handshakes get: swapped whole by the reloader, so that a handshake
/// sees the old pair or the new one, never half of each. Handshakes in progress and open
/// connections keep what they started with.
#[derive(Debug)]
struct CurrentKey(RwLock<Arc<CertifiedKey>>);

impl CurrentKey {
    fn get(&self) -> Arc<CertifiedKey> {
        // A writer only ever assigns a whole Arc: a poisoned lock still holds a pair.
        self.0.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn set(&self, key: CertifiedKey) {
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(key);
    }
}

impl ResolvesServerCert for CurrentKey {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.get())
    }
}

/// What one look at the files found.
#[derive(Debug, PartialEq, Eq)]
pub enum Reload {
    /// Same content as the pair in use (or as the last pair that failed).
    Unchanged,
    /// A new pair is in use.
    Reloaded,
    /// New content that cannot be used; the pair in use stays.
    Failed(String),
}

/// Reads a listener's files every `reload_interval` and swaps in a changed pair.
pub struct Reloader {
    tls: ListenerTls,
    // The content of the last attempt that failed, so that one bad pair is counted and
    // logged once, not every interval.
    failed: Option<Result<Contents, String>>,
    reloads: Counter,
    failures: Counter,
    expiry: Option<prometheus_client::metrics::gauge::Gauge>,
}

impl Reloader {
    /// Sets `expiry` (`idemgate_tls_certificate_expiry_seconds{certificate="listener"}`)
    /// now and after each reload.
    pub fn with_expiry(mut self, expiry: prometheus_client::metrics::gauge::Gauge) -> Reloader {
        if let Some(t) = leaf_expiry(&self.tls.loaded.cert) {
            expiry.set(t);
        }
        self.expiry = Some(expiry);
        self
    }

    /// Counts into `reloads` (`idemgate_tls_reloads_total`) and `failures`
    /// (`idemgate_tls_reload_failures_total`).
    pub fn new(tls: &ListenerTls, reloads: Counter, failures: Counter) -> Reloader {
        Reloader {
            tls: tls.clone(),
            failed: None,
            reloads,
            failures,
            expiry: None,
        }
    }

    /// Reads the files once. Content, not modification times, decides: a Kubernetes Secret
    /// volume swaps a `..data` symlink, which leaves the files' own times as they were.
    pub async fn check(&mut self) -> Reload {
        let files = &self.tls.files;
        let read = async {
            let cert = tokio::fs::read(&files.cert)
                .await
                .map_err(|e| format!("cannot read {}: {e}", files.cert.display()))?;
            let key = tokio::fs::read(&files.key)
                .await
                .map_err(|e| format!("cannot read {}: {e}", files.key.display()))?;
            Ok::<_, String>(Contents { cert, key })
        };
        let attempt = read.await;
        if attempt.as_ref().ok() == Some(&self.tls.loaded) {
            self.failed = None;
            return Reload::Unchanged;
        }
        if self.failed.as_ref() == Some(&attempt) {
            return Reload::Unchanged;
        }
        let outcome = attempt.as_ref().map_err(Clone::clone).and_then(|contents| {
            certified_key(&contents.cert, &contents.key, Role::Server).map_err(|(side, why)| {
                let path = match side {
                    Side::Cert => &files.cert,
                    Side::Key => &files.key,
                };
                format!("{}: {why}", path.display())
            })
        });
        match outcome {
            Ok(certified) => {
                self.tls.current.set(certified);
                if let Ok(contents) = attempt {
                    if let (Some(g), Some(t)) = (&self.expiry, leaf_expiry(&contents.cert)) {
                        g.set(t);
                    }
                    self.tls.loaded = contents;
                }
                self.failed = None;
                self.reloads.inc();
                Reload::Reloaded
            }
            Err(why) => {
                self.failed = Some(attempt);
                self.failures.inc();
                Reload::Failed(why)
            }
        }
    }

    /// Checks every `reload_interval`, forever (the caller aborts it at shutdown).
    pub async fn run(mut self) {
        let mut tick = tokio::time::interval(self.tls.reload_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            match self.check().await {
                Reload::Unchanged => {}
                Reload::Reloaded => tracing::info!(
                    cert = %self.tls.files.cert.display(),
                    "TLS certificate reloaded: new connections get the new pair"
                ),
                Reload::Failed(why) => tracing::error!(
                    error = %why,
                    "TLS certificate not reloaded: keeping the pair in use"
                ),
            }
        }
    }
}
