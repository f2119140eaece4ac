//! Configuration: built-in defaults < TOML file < `IDEMGATE_` environment < command-line
//! flags, merged with figment, then validated into the typed [`Settings`] that the proxy
//! uses. Every error names the key at fault.

use std::borrow::Cow;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use hyper::header::HeaderName;
use hyper::{Method, Uri};
use serde::{Deserialize, Serialize};

use crate::fingerprint::{JsonPointer, QueryOrder, Rules};
use crate::retry_after::TypicalTime;
use crate::scope::client_cert::{CertField, ClientCert};
use crate::scope::jwt::JwtVerifier;
use crate::scope::{path, PathError, PathRules, ScopeSecret, TenantSource};
use crate::store::seal::{Envelope, Keyring};

/// What to do when the store cannot be reached at claim time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnStoreError {
    /// 503 + Retry-After; the upstream is not called (default: at most once wins).
    Reject,
    /// Forward the request unprotected (availability wins over at most once).
    Forward,
}

/// What to do with a record whose request was sent but got no complete answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnAmbiguous {
    /// Keep it as `unknown`: retries get 409 until an operator releases it (default).
    Hold,
    /// Delete it: a retry executes again (only for upstreams that dedupe themselves).
    Release,
}

/// When a new key's recorded answer is written, relative to the client's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordMode {
    /// The answer is recorded, then sent to the client (default): once the client has it,
    /// every retry gets the replay.
    BeforeResponse,
    /// The answer is sent to the client as soon as the upstream's answer is complete, and
    /// recorded meanwhile: one store round trip less on the client's wait, but until the
    /// record lands a retry gets 409 `in-progress`, and if idemgate dies in that window the
    /// key reads as `unknown` although its client got the answer.
    AfterResponse,
}

/// Whether a route acts on what it decides, or only counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Refuse, replay and answer 409/422 as the flow decides (default).
    Enforce,
    /// Forward every request as if idemgate were not there, while claiming and recording
    /// as when enforcing, and count what enforcing would have done
    /// (`idemgate_observed_total`, `GET /observe`): the first step of a rollout.
    Observe,
}

/// What a protected request without a tenant gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Anonymous {
    /// 400 `missing-tenant`, nothing claimed or forwarded (default).
    Refuse,
    /// One scope shared by every request without a tenant on the route: two anonymous
    /// clients that pick the same key see each other's records.
    Shared,
}

/// How a route compares path spellings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PathMatch {
    /// RFC 3986 normalization, repeated slashes collapsed, a trailing slash ignored.
    Normalized,
    /// RFC 3986 normalization only: `/a/` and `/a`, `/a//b` and `/a/b` differ.
    Strict,
}

/// The file/environment form of the configuration, as users write it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Where clients connect (`host:port`; a host name is resolved at start).
    #[serde(deserialize_with = "addr")]
    pub listen: SocketAddr,
    /// The upstream origin, `http://host:port` or `https://host[:port]`.
    pub upstream: String,
    /// PEM file of the CA(s) that signed an `https://` upstream's certificate; absent: the
    /// system's roots.
    #[serde(default)]
    pub upstream_tls_ca_file: Option<PathBuf>,
    /// The name sent (SNI) to an `https://` upstream and checked against its certificate,
    /// instead of the host of `upstream` (an IP address, or an internal name).
    #[serde(default)]
    pub upstream_tls_server_name: Option<String>,
    /// PEM client certificate chain presented to an `https://` upstream that asks for one.
    #[serde(default)]
    pub upstream_tls_cert_file: Option<PathBuf>,
    /// PEM private key of `upstream_tls_cert_file`.
    #[serde(default)]
    pub upstream_tls_key_file: Option<PathBuf>,
    /// Offer h2 besides http/1.1 to an `https://` upstream (ALPN); `false`: http/1.1 only.
    #[serde(default = "default_true")]
    pub upstream_http2: bool,
    /// PEM certificate chain (leaf first) that makes `listen` speak TLS, with
    /// `tls_key_file`. Reloaded when its content changes.
    #[serde(default)]
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of `tls_cert_file`.
    #[serde(default)]
    pub tls_key_file: Option<PathBuf>,
    /// PEM file of the CA(s) that client certificates are verified against: the TLS
    /// listener asks clients for a certificate.
    #[serde(default)]
    pub tls_client_ca_file: Option<PathBuf>,
    /// `required` (the default with `tls_client_ca_file`) or `optional`.
    #[serde(default)]
    pub tls_client_auth: Option<crate::tls::ClientAuth>,
    /// How often `tls_cert_file` and `tls_key_file` are read for a change.
    #[serde(default = "default_tls_reload_interval", with = "humantime_serde")]
    pub tls_reload_interval: Duration,
    /// The admin listener (`/healthz`, `/readyz`, `/metrics`, `/records/{id}`); absent: off.
    #[serde(default, deserialize_with = "optional_addr")]
    pub admin_listen: Option<SocketAddr>,
    /// When set, every admin endpoint but the probes (`/healthz`, `/readyz`) wants
    /// `Authorization: Bearer <token>`.
    pub admin_token: Option<Secret>,
    /// Directory of the persistent embedded store (an SQLite database): records survive a
    /// restart. Absent (and no `redis_url`): records live in this process's memory.
    pub store_path: Option<PathBuf>,
    /// PostgreSQL URL (`postgres://user:password@host/db`, or libpq's `key=value` form):
    /// records in one table that several instances share. TLS by libpq's `sslmode`
    /// (`disable`, `require`, `verify-ca`, `verify-full`) and `sslrootcert`, `sslcert`,
    /// `sslkey` in it.
    pub postgres_url: Option<Secret>,
    /// PEM file of the CA(s) that signed the PostgreSQL server's certificate (`sslrootcert`);
    /// absent: the system's roots.
    #[serde(default)]
    pub postgres_tls_ca_file: Option<PathBuf>,
    /// PEM client certificate chain, for servers that ask for one (`sslcert`).
    #[serde(default)]
    pub postgres_tls_cert_file: Option<PathBuf>,
    /// PEM private key of `postgres_tls_cert_file` (`sslkey`).
    #[serde(default)]
    pub postgres_tls_key_file: Option<PathBuf>,
    /// Redis URL; absent (and no sentinels, cluster nodes, `store_path` or
    /// `postgres_url`): the embedded in-memory store.
    pub redis_url: Option<String>,
    /// Sentinels (`host:port`, or `rediss://host:port` on every entry for TLS) that name
    /// the current primary of `redis_sentinel_master`.
    #[serde(default)]
    pub redis_sentinels: Vec<String>,
    /// The master name the sentinels monitor.
    #[serde(default)]
    pub redis_sentinel_master: Option<String>,
    /// Seed nodes (`host:port`, or `rediss://host:port` on every entry for TLS) of a Redis
    /// Cluster.
    #[serde(default)]
    pub redis_cluster_nodes: Vec<String>,
    /// TLS to sentinels and cluster nodes given as bare `host:port` (a URL, or `rediss://`
    /// entries, say it themselves).
    #[serde(default)]
    pub redis_tls: bool,
    /// PEM file of the CA(s) that signed the Redis servers' certificates; absent: the
    /// system's roots.
    #[serde(default)]
    pub redis_tls_ca_file: Option<std::path::PathBuf>,
    /// PEM client certificate chain, for servers with `tls-auth-clients yes`.
    #[serde(default)]
    pub redis_tls_cert_file: Option<std::path::PathBuf>,
    /// PEM private key of `redis_tls_cert_file`.
    #[serde(default)]
    pub redis_tls_key_file: Option<std::path::PathBuf>,
    /// Accept any server certificate: encrypted but not authenticated. Never in production.
    #[serde(default)]
    pub redis_tls_insecure: bool,
    /// ACL user for every Redis node and sentinel.
    #[serde(default)]
    pub redis_username: Option<String>,
    /// Its password (better from `IDEMGATE_REDIS_PASSWORD` than from a file).
    #[serde(default)]
    pub redis_password: Option<Secret>,
    /// Claims and records count as written only once this many replicas have them (`WAIT`).
    #[serde(default)]
    pub min_replicas_ack: u32,
    /// How long `WAIT` may take (shorter than `store_timeout`).
    #[serde(default = "default_replica_ack_timeout", with = "humantime_serde")]
    pub replica_ack_timeout: Duration,
    /// With `min_replicas_ack`: how many claims and records (each with its `WAIT`) may be
    /// on their way at once, per serving thread, each on a connection of its own.
    #[serde(default = "default_replica_ack_connections")]
    pub replica_ack_connections: usize,
    /// Whose records these are, when several services share one store: records of
    /// different namespaces never meet. Required with a shared store (Redis).
    pub namespace: Option<String>,
    /// Secret that HS256 bearer tokens are verified with, for `tenant_jwt_claim`.
    pub jwt_hs256_secret: Option<Secret>,
    /// JWKS file with the RS256/ES256 public keys that bearer tokens are verified with.
    pub jwks_file: Option<PathBuf>,
    /// The audience(s) a bearer token's `aud` must name (one of them); absent: `aud` is not
    /// checked.
    pub jwt_audience: Option<Audience>,
    /// Verified bearer tokens kept, until their `exp`, so that a retry with the same token
    /// is not verified again. `0`: none.
    pub jwt_cache_entries: usize,
    /// Keys that recorded answers are sealed with at rest, `<id>:<base64 of 32 bytes>`: the
    /// first seals, every one opens. Empty: answers are stored in clear.
    pub encryption_keys: Vec<Secret>,
    /// A file of `encryption_keys` entries, one a line (`#` comments): kept out of the
    /// configuration file. Its keys come after those of `encryption_keys`.
    pub encryption_keys_file: Option<PathBuf>,
    /// Recorded bodies of at least this many bytes are stored compressed (zstd) when that
    /// makes them smaller. Absent: never.
    pub compress_min_bytes: Option<usize>,
    /// Outer deadline of every store call (claim, record, release...).
    #[serde(with = "humantime_serde")]
    pub store_timeout: Duration,
    /// How long an idle connection to the upstream may be reused by pass-through requests
    /// (protected ones never reuse one: see `upstream::fresh_client`). Keep it below the
    /// upstream's own keep-alive timeout, so that a pass-through request rarely meets a
    /// connection the upstream is closing. `0`: a new connection for every request.
    #[serde(with = "humantime_serde")]
    pub upstream_idle_timeout: Duration,
    /// How long one attempt to connect to Redis may take.
    #[serde(with = "humantime_serde")]
    pub redis_connect_timeout: Duration,
    /// How often Redis `INFO` is read for the eviction and restart metrics.
    #[serde(with = "humantime_serde")]
    pub redis_info_interval: Duration,
    /// How often the records held `unknown` are counted for `idemgate_records_held_unknown`
    /// (a walk over the store's records, as `GET /records?state=unknown` does); `0s` turns
    /// the count off. Not on Redis Cluster, which cannot be walked.
    #[serde(with = "humantime_serde")]
    pub unknown_count_interval: Duration,
    /// The record-id secret, pinned by the operator (64 hex digits, e.g. from a Kubernetes
    /// Secret; or `IDEMGATE_SCOPE_SECRET`), so that no instance depends on the store
    /// keeping it. Absent: the store keeps one, made by the first instance.
    pub scope_secret: Option<Secret>,
    /// A file holding `scope_secret` (64 hex digits, surrounding whitespace ignored).
    pub scope_secret_file: Option<PathBuf>,
    /// How often a running instance checks that the store still holds its scope secret
    /// (and this namespace's verifier of it), putting back what is missing.
    #[serde(with = "humantime_serde")]
    pub scope_secret_check_interval: Duration,
    /// How long an instance that finds no scope secret in the store waits before it makes
    /// one, so that running instances put theirs back first: longer than
    /// `scope_secret_check_interval`. `0s` only for a store no other instance uses.
    #[serde(with = "humantime_serde")]
    pub scope_secret_create_delay: Duration,
    /// The embedded store answers 503 instead of holding more records than this.
    pub memory_max_records: usize,
    /// ... or more bytes than this (records, their headers and bodies, and their upkeep);
    /// an answer that would not fit is recorded without its body.
    pub memory_max_bytes: usize,
    /// How long a client may take to send a request head, counted from accept for its
    /// first request (a connection that sends nothing is closed after it too).
    #[serde(with = "humantime_serde")]
    pub header_read_timeout: Duration,
    /// How long a keep-alive connection may sit idle (no request, no bytes) before it is
    /// closed.
    #[serde(with = "humantime_serde")]
    pub idle_timeout: Duration,
    /// Open client connections at most; beyond, new ones are closed as soon as accepted.
    pub max_connections: usize,
    /// Requests one HTTP/2 client connection may have open at once (its
    /// `SETTINGS_MAX_CONCURRENT_STREAMS`): each may hold an upstream connection, so a few
    /// h2 clients must not outgrow what `max_connections` bounds for HTTP/1.1.
    pub h2_max_concurrent_streams: u32,
    /// Protected requests in flight at most (per instance), counted from their complete
    /// body to the end of their exchange; beyond, they wait in a queue.
    pub max_in_flight: usize,
    /// Requests that may wait for a slot (protected, and pass-through for theirs); beyond,
    /// 503 `overloaded` at once, before the body is read.
    pub max_queued: usize,
    /// How long a request may wait in the queue for a slot; then 503 `overloaded`.
    #[serde(with = "humantime_serde")]
    pub queue_timeout: Duration,
    /// Upstream connections in use at most: `max_in_flight` of them for protected requests,
    /// the rest (which must be at least 1) for pass-through requests, which wait in the
    /// queue beyond it. Idle pooled connections are kept up to the pass-through share.
    pub max_upstream_connections: usize,
    /// Bytes of bodies held in memory for clients that are slow to send or to read:
    /// protected request bodies still arriving or queued, and answers being written. A
    /// body or replay beyond it gets 503 `overloaded`; the answer of a request that ran is
    /// always sent.
    pub max_buffered_bytes: usize,
    /// How long a write to a client may make no progress (a client that stopped reading)
    /// before its connection is closed.
    #[serde(with = "humantime_serde")]
    pub send_timeout: Duration,
    /// How long a client may take to send a protected request's body (408 after).
    #[serde(with = "humantime_serde")]
    pub body_read_timeout: Duration,
    /// On SIGTERM/SIGINT, how long in-flight requests get to finish.
    #[serde(with = "humantime_serde")]
    pub shutdown_grace: Duration,
    /// Threads that serve requests (1: everything on one thread, the sidecar default).
    pub worker_threads: usize,
    /// OpenTelemetry collector, OTLP over HTTP with protobuf (`http://host:4318`;
    /// `/v1/traces` is added); absent: no tracing, unless the standard
    /// `OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT` names one.
    pub otlp_endpoint: Option<String>,
    /// Applies to every request unless a route overrides it.
    pub defaults: Defaults,
    /// Per-path overrides; the longest matching prefix wins.
    pub routes: Vec<Route>,
}

/// `host:port` to a socket address: an IP address as it is, a host name (`localhost:8080`)
/// resolved, its first address taken.
pub fn resolve_addr(s: &str) -> Result<SocketAddr, String> {
    if let Ok(a) = s.parse() {
        return Ok(a);
    }
    use std::net::ToSocketAddrs;
    match s.to_socket_addrs() {
        Ok(mut addrs) => addrs
            .next()
            .ok_or_else(|| format!("`{s}` resolves to no address")),
        Err(e) => Err(format!("`{s}` is not host:port or does not resolve: {e}")),
    }
}

fn addr<'de, D: serde::Deserializer<'de>>(d: D) -> Result<SocketAddr, D::Error> {
    let s = String::deserialize(d)?;
    resolve_addr(&s).map_err(serde::de::Error::custom)
}

fn optional_addr<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<SocketAddr>, D::Error> {
    match Option::<String>::deserialize(d)? {
        Some(s) => resolve_addr(&s).map(Some).map_err(serde::de::Error::custom),
        None => Ok(None),
    }
}

/// A configuration value that must never be printed: its `Debug` is redacted, so a
/// `?config` in a log line cannot leak it.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    /// The secret itself, for comparing.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl From<&str> for Secret {
    fn from(s: &str) -> Secret {
        Secret(s.to_string())
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// `jwt_audience`: one audience or a list of them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Audience {
    /// One audience.
    One(String),
    /// Any of these.
    Any(Vec<String>),
}

impl Audience {
    /// The audiences, as a list.
    pub fn list(&self) -> Vec<String> {
        match self {
            Audience::One(a) => vec![a.clone()],
            Audience::Any(v) => v.clone(),
        }
    }
}

/// Policy for protected requests, as written under `[defaults]`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Defaults {
    /// Methods that are protected.
    pub methods: Vec<String>,
    /// Whether a protected request without a key gets 400.
    pub require_key: bool,
    /// How long a record lives, from its claim.
    #[serde(with = "humantime_serde")]
    pub retention: Duration,
    /// How long a claim stays `in_progress` without renewal.
    #[serde(with = "humantime_serde")]
    pub lease: Duration,
    /// How long the upstream gets for the whole exchange.
    #[serde(with = "humantime_serde")]
    pub upstream_timeout: Duration,
    /// Largest protected body that is buffered (413 above).
    pub max_body_bytes: u64,
    /// Largest upstream answer that is recorded; a larger one still reaches its client,
    /// streamed, but is recorded without its body.
    pub max_response_bytes: u64,
    /// Longest accepted key.
    pub max_key_length: usize,
    /// Headers whose values identify the tenant.
    pub tenant_headers: Vec<String>,
    /// When set, the tenant is this claim of the verified bearer JWT instead.
    pub tenant_jwt_claim: Option<String>,
    /// When set, the tenant is this field of the client certificate verified on the TLS
    /// listener (with the CA that verified it) instead: `"san_uri"` or `"subject"`.
    pub tenant_client_cert: Option<CertField>,
    /// See [`Anonymous`].
    pub anonymous: Anonymous,
    /// See [`PathMatch`].
    pub path_match: PathMatch,
    /// Compare paths case-insensitively (IIS/ASP.NET-style upstreams).
    pub case_insensitive_paths: bool,
    /// See [`OnStoreError`].
    pub on_store_error: OnStoreError,
    /// See [`OnAmbiguous`].
    pub on_ambiguous: OnAmbiguous,
    /// See [`RecordMode`].
    pub record_mode: RecordMode,
    /// See [`Mode`].
    pub mode: Mode,
    /// JSON pointers left out of the fingerprint.
    pub fingerprint_ignore: Vec<String>,
    /// Whether the order of the query's pairs counts in the fingerprint.
    pub query_order: QueryOrder,
    /// See [`PathParams`].
    pub path_params: PathParams,
    /// Format suffixes (`".json"`) that are the same operation as the route's path without
    /// them (`/v1/transfers.json` is `/v1/transfers`). Other suffixes of 1 to 5 letters or
    /// digits on a route's last segment are refused on protected methods.
    pub format_suffixes: Vec<String>,
    /// Headers that carry the key, in order of preference (aliases such as
    /// `PayPal-Request-Id`): the first present is the key.
    pub key_headers: Vec<String>,
    /// Answers with these statuses reach the client and release the claim instead of being
    /// recorded, so a retry executes: for upstreams that answer them without doing any work.
    pub release_on_status: Vec<u16>,
    /// Answers with these statuses show that nothing ran (authentication and authorization
    /// refusals): recorded, but kept only `short_retention`, and at the embedded store's
    /// record cap they make room before a new key is refused.
    pub short_retention_statuses: Vec<u16>,
    /// How long answers with a `short_retention_statuses` status are kept.
    #[serde(with = "humantime_serde")]
    pub short_retention: Duration,
    /// Method-override headers (`X-HTTP-Method-Override`...) that the upstream honours: a
    /// request is scoped, fingerprinted and protected as the method they name. Empty: a
    /// request that names another method in an override header or `_method` gets 400
    /// `invalid-method-override` where either method is protected.
    pub method_override_headers: Vec<String>,
}

/// What a route does with `;` path parameters (`/v1/transfers;jsessionid=A`), which servlet
/// containers (Jetty, Tomcat) cut off each segment before they route.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PathParams {
    /// Protected requests whose path has them get 400 `invalid-path` (default): with them,
    /// a request could reach the handler under a spelling that is another operation.
    #[default]
    Refuse,
    /// Left out of route matching, scope and fingerprint, and forwarded as sent: for
    /// upstreams whose clients put `;jsessionid=` into links.
    Strip,
}

/// One `[[routes]]` entry: a path prefix and the settings it overrides.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)]
pub struct Route {
    /// A path prefix, matched at segment boundaries (`/v1/t` matches `/v1/t` and `/v1/t/9`).
    pub path: String,
    pub methods: Option<Vec<String>>,
    pub require_key: Option<bool>,
    #[serde(default, with = "humantime_serde")]
    pub retention: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub lease: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub upstream_timeout: Option<Duration>,
    pub max_body_bytes: Option<u64>,
    pub max_response_bytes: Option<u64>,
    pub max_key_length: Option<usize>,
    pub tenant_headers: Option<Vec<String>>,
    pub tenant_jwt_claim: Option<String>,
    pub tenant_client_cert: Option<CertField>,
    pub anonymous: Option<Anonymous>,
    pub path_match: Option<PathMatch>,
    pub case_insensitive_paths: Option<bool>,
    pub on_store_error: Option<OnStoreError>,
    pub on_ambiguous: Option<OnAmbiguous>,
    pub record_mode: Option<RecordMode>,
    pub mode: Option<Mode>,
    pub fingerprint_ignore: Option<Vec<String>>,
    pub query_order: Option<QueryOrder>,
    pub path_params: Option<PathParams>,
    pub format_suffixes: Option<Vec<String>>,
    pub key_headers: Option<Vec<String>>,
    pub release_on_status: Option<Vec<u16>>,
    pub short_retention_statuses: Option<Vec<u16>>,
    #[serde(default, with = "humantime_serde")]
    pub short_retention: Option<Duration>,
    pub method_override_headers: Option<Vec<String>>,
}

/// The default of [`Config::upstream_idle_timeout`]: half of the shortest keep-alive
/// timeout common servers use (1 s), so that upstreams closing idle connections after 1 s,
/// 2 s (gunicorn) or 5 s (Node, uvicorn, Apache) never close one that idemgate is about to
/// reuse, with half a second to spare for a loaded machine. Below 1 s, set it.
pub const UPSTREAM_IDLE_TIMEOUT: Duration = Duration::from_millis(500);

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            upstream: "http://127.0.0.1:9000".into(),
            upstream_tls_ca_file: None,
            upstream_tls_server_name: None,
            upstream_tls_cert_file: None,
            upstream_tls_key_file: None,
            upstream_http2: true,
            tls_cert_file: None,
            tls_key_file: None,
            tls_client_ca_file: None,
            tls_client_auth: None,
            tls_reload_interval: default_tls_reload_interval(),
            admin_listen: Some(SocketAddr::from(([127, 0, 0, 1], 9901))),
            admin_token: None,
            redis_url: None,
            store_path: None,
            postgres_url: None,
            postgres_tls_ca_file: None,
            postgres_tls_cert_file: None,
            postgres_tls_key_file: None,
            redis_sentinels: Vec::new(),
            redis_sentinel_master: None,
            redis_cluster_nodes: Vec::new(),
            redis_tls: false,
            redis_tls_ca_file: None,
            redis_tls_cert_file: None,
            redis_tls_key_file: None,
            redis_tls_insecure: false,
            redis_username: None,
            redis_password: None,
            min_replicas_ack: 0,
            replica_ack_timeout: default_replica_ack_timeout(),
            replica_ack_connections: default_replica_ack_connections(),
            namespace: None,
            jwt_hs256_secret: None,
            jwks_file: None,
            jwt_audience: None,
            jwt_cache_entries: 10_000,
            encryption_keys: Vec::new(),
            encryption_keys_file: None,
            compress_min_bytes: None,
            redis_info_interval: Duration::from_secs(15),
            unknown_count_interval: Duration::from_secs(300),
            scope_secret: None,
            scope_secret_file: None,
            scope_secret_check_interval: Duration::from_secs(5),
            scope_secret_create_delay: Duration::from_secs(12),
            store_timeout: Duration::from_millis(500),
            upstream_idle_timeout: UPSTREAM_IDLE_TIMEOUT,
            redis_connect_timeout: Duration::from_secs(1),
            memory_max_records: 1_000_000,
            memory_max_bytes: 1024 * 1024 * 1024,
            header_read_timeout: Duration::from_secs(10),
            // Longer than the usual load balancer's idle timeout (60 s), so that it is the
            // balancer, not idemgate, that closes an idle connection: otherwise a request it
            // sends just as idemgate closes is lost.
            idle_timeout: Duration::from_secs(75),
            max_connections: 4096,
            h2_max_concurrent_streams: 100,
            max_in_flight: 1024,
            max_queued: 1024,
            queue_timeout: Duration::from_secs(1),
            max_upstream_connections: 2048,
            max_buffered_bytes: 64 * 1024 * 1024,
            send_timeout: Duration::from_secs(60),
            body_read_timeout: Duration::from_secs(10),
            shutdown_grace: Duration::from_secs(30),
            worker_threads: 1,
            otlp_endpoint: None,
            defaults: Defaults::default(),
            routes: Vec::new(),
        }
    }
}

fn default_true() -> bool {
    true
}

fn default_tls_reload_interval() -> Duration {
    Duration::from_secs(5)
}

fn default_replica_ack_timeout() -> Duration {
    Duration::from_millis(200)
}

fn default_replica_ack_connections() -> usize {
    16
}

impl Default for Defaults {
    fn default() -> Self {
        Defaults {
            methods: vec!["POST".into(), "PATCH".into()],
            require_key: false,
            retention: Duration::from_secs(24 * 3600),
            lease: Duration::from_secs(10),
            upstream_timeout: Duration::from_secs(30),
            max_body_bytes: 1024 * 1024,
            max_response_bytes: 4 * 1024 * 1024,
            max_key_length: 255,
            tenant_headers: vec!["Authorization".into()],
            tenant_jwt_claim: None,
            tenant_client_cert: None,
            anonymous: Anonymous::Refuse,
            path_match: PathMatch::Normalized,
            case_insensitive_paths: false,
            on_store_error: OnStoreError::Reject,
            on_ambiguous: OnAmbiguous::Hold,
            record_mode: RecordMode::BeforeResponse,
            mode: Mode::Enforce,
            fingerprint_ignore: Vec::new(),
            query_order: QueryOrder::Sorted,
            path_params: PathParams::Refuse,
            format_suffixes: Vec::new(),
            key_headers: vec![crate::key::HEADER.into()],
            release_on_status: Vec::new(),
            short_retention_statuses: vec![401, 403, 407],
            short_retention: Duration::from_secs(60),
            method_override_headers: Vec::new(),
        }
    }
}

impl Config {
    /// Upstream connections that pass-through requests may use at once (and keep idle).
    pub fn pass_through_share(&self) -> usize {
        self.max_upstream_connections
            .saturating_sub(self.max_in_flight)
            .max(1)
    }

    /// All defaults, in front of `upstream`, listening on an ephemeral loopback port with the
    /// admin listener off: what tests and the lab start from.
    pub fn for_upstream(upstream: &str) -> Config {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            upstream: upstream.into(),
            admin_listen: None,
            ..Config::default()
        }
    }

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

    /// Extracts and validates.
    pub fn load(figment: Figment) -> Result<Settings, ConfigError> {
        let config: Config = figment
            .extract()
            .map_err(|e| ConfigError::Source(Box::new(e)))?;
        Settings::new(config)
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

/// A configuration error: the key at fault and what is wrong with it.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The sources could not be read or did not match the schema (figment names the key).
    #[error("{}", describe(.0))]
    Source(Box<figment::Error>),
    /// A value has the right type but cannot be used.
    #[error("invalid configuration value for `{key}`: {reason}")]
    Invalid {
        /// Dotted path of the key, e.g. `routes[0].lease`.
        key: String,
        /// What is wrong.
        reason: String,
    },
}

/// figment's message without its profile name (`default.`), which means nothing to
/// someone who never chose a profile: `what is wrong for key `defaults.lease` in file`.
fn describe(e: &figment::Error) -> String {
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

fn invalid(key: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        reason: reason.into(),
    }
}

/// The policy that applies to one request, resolved from defaults and its route.
#[derive(Debug, Clone)]
pub struct Policy {
    /// The route prefix that matched, or `None` for the defaults.
    pub route: Option<String>,
    /// Its place in [`Settings::modes`] (0 for the defaults, then the routes longest
    /// first): the row of its per-route metrics.
    pub index: usize,
    #[allow(missing_docs)]
    pub methods: Vec<Method>,
    #[allow(missing_docs)]
    pub require_key: bool,
    #[allow(missing_docs)]
    pub retention: Duration,
    #[allow(missing_docs)]
    pub lease: Duration,
    #[allow(missing_docs)]
    pub upstream_timeout: Duration,
    #[allow(missing_docs)]
    pub max_body_bytes: u64,
    #[allow(missing_docs)]
    pub max_response_bytes: u64,
    #[allow(missing_docs)]
    pub max_key_length: usize,
    /// Where the tenant comes from (`tenant_headers`, `tenant_jwt_claim` or
    /// `tenant_client_cert`).
    pub tenant: TenantSource,
    #[allow(missing_docs)]
    pub anonymous: Anonymous,
    /// `path_match` and `case_insensitive_paths`.
    pub path_rules: PathRules,
    #[allow(missing_docs)]
    pub on_store_error: OnStoreError,
    #[allow(missing_docs)]
    pub on_ambiguous: OnAmbiguous,
    #[allow(missing_docs)]
    pub record_mode: RecordMode,
    #[allow(missing_docs)]
    pub mode: Mode,
    #[allow(missing_docs)]
    pub fingerprint_ignore: Vec<JsonPointer>,
    #[allow(missing_docs)]
    pub query_order: QueryOrder,
    #[allow(missing_docs)]
    pub path_params: PathParams,
    /// `format_suffixes` without their dots (lower case on a case-insensitive route).
    pub format_suffixes: Vec<String>,
    /// Headers that carry the key, the preferred first.
    pub key_headers: Vec<HeaderName>,
    /// Statuses whose answers are passed on and not recorded (the claim is released).
    pub release_on_status: Vec<u16>,
    /// Statuses whose records are kept only `short_retention`.
    pub short_retention_statuses: Vec<u16>,
    #[allow(missing_docs)]
    pub short_retention: Duration,
    /// Override headers the upstream honours (`method_override_headers`), lowercase.
    pub method_override_headers: Vec<HeaderName>,
    /// How long this route's upstream typically takes (measured while running), for the
    /// `Retry-After` of a 409 in-progress.
    pub upstream_time: Arc<TypicalTime>,
}

impl Policy {
    /// This route's settings of the fingerprint.
    pub fn fingerprint_rules(&self) -> Rules<'_> {
        Rules {
            ignore: &self.fingerprint_ignore,
            query_order: self.query_order,
        }
    }

    /// Whether requests with this method are protected.
    pub fn protects(&self, method: &Method) -> bool {
        self.methods.contains(method)
    }
}

/// The upstream origin, split for building request URIs.
#[derive(Debug, Clone)]
pub struct Upstream {
    /// `http` or `https`.
    pub scheme: hyper::http::uri::Scheme,
    /// `host:port` (or `host` alone: the scheme's port).
    pub authority: hyper::http::uri::Authority,
    /// The `Host` header every forwarded request carries: the authority, made once.
    pub host: hyper::header::HeaderValue,
    /// How idemgate talks TLS to an `https://` upstream; `None` for `http://`.
    pub tls: Option<crate::tls::UpstreamTls>,
    /// The `X-Forwarded-Proto` of every forwarded request: how clients reached idemgate
    /// (`https` when `listen` speaks TLS).
    pub forwarded_proto: hyper::header::HeaderValue,
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Settings {
    /// What it was made from (for start-up logging and the admin API).
    pub config: Config,
    /// The upstream origin.
    pub upstream: Upstream,
    /// Policy for requests that match no route. Shared (`Arc`) because every protected
    /// request carries its policy into its own task: a clone must not allocate.
    pub default_policy: Arc<Policy>,
    /// Routes, longest prefix first, each prefix in the normal form of its own rules.
    pub routes: Vec<(String, Arc<Policy>)>,
    /// The Redis store, when one is configured.
    pub redis: Option<crate::store::RedisSetup>,
    /// The namespace of every record id (`default` on the embedded store).
    pub namespace: String,
    /// Verifies bearer tokens for `tenant_jwt_claim`; present when keys are configured.
    pub jwt: Option<Arc<JwtVerifier>>,
    /// How recorded answers are kept at rest (sealed, compressed).
    pub envelope: Envelope,
    /// The operator's scope secret (`scope_secret`, `scope_secret_file`), if pinned.
    pub pinned_secret: Option<ScopeSecret>,
    /// The TLS listener (`tls_cert_file`), when `listen` speaks TLS.
    pub listener_tls: Option<crate::tls::ListenerTls>,
    // Whether any policy protects a method: decides between 400 and pass-through for a
    // path that cannot be normalized (and so matched to a route).
    protected_methods: Vec<Method>,
    // The same, of routes that enforce: a path that cannot be normalized on a method only
    // observed routes protect is forwarded and counted, never refused.
    enforced_methods: Vec<Method>,
}

impl Settings {
    /// Each route's configured path (`default` for the defaults) and its mode.
    pub fn modes(&self) -> Vec<(String, Mode)> {
        std::iter::once(&self.default_policy)
            .chain(self.routes.iter().map(|(_, p)| p))
            .map(|p| (p.route.clone().unwrap_or_else(|| "default".into()), p.mode))
            .collect()
    }
}

/// Where a request's path led: its policy, and the path's normal form when it differs from
/// the spelling the client sent.
#[derive(Debug)]
pub struct Routed<'a> {
    /// The policy of the longest matching route, or the defaults.
    pub policy: &'a Arc<Policy>,
    /// The path in the normal form of that policy's rules (what scope and fingerprint
    /// use); `None` when that is the path as sent.
    pub normalized: Option<String>,
    /// What the upstream gets instead of `normalized`, where the two differ: the client's
    /// letter case on a case-insensitive route, the `;` parameters a `strip` route leaves out
    /// of the scope, a folded format suffix.
    pub forward: Forward,
    /// A spelling this route refuses on the methods it protects (`;` parameters where
    /// `path_params = "refuse"`, a format suffix it does not list). The path was routed
    /// as if it had none: a request on an unprotected method passes through as sent.
    pub refused: Option<PathError>,
}

/// The path a protected request is forwarded with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Forward {
    /// `Routed::normalized` (or the path as sent when that is `None`).
    Normalized,
    /// The path as sent: it already is the form to forward.
    AsSent,
    /// This path.
    Path(String),
}

impl Settings {
    /// Validates a configuration.
    pub fn new(mut config: Config) -> Result<Settings, ConfigError> {
        let listener_tls = crate::tls::listener(&config)?;
        let upstream = parse_upstream(&config, listener_tls.is_some())?;
        for (key, d) in [
            ("store_timeout", config.store_timeout),
            ("redis_connect_timeout", config.redis_connect_timeout),
            ("header_read_timeout", config.header_read_timeout),
            ("redis_info_interval", config.redis_info_interval),
            (
                "scope_secret_check_interval",
                config.scope_secret_check_interval,
            ),
            ("body_read_timeout", config.body_read_timeout),
            ("idle_timeout", config.idle_timeout),
            ("send_timeout", config.send_timeout),
        ] {
            if d.is_zero() {
                return Err(invalid(key, "must be greater than zero"));
            }
        }
        if let Some(token) = &config.admin_token {
            let t = token.expose();
            if t.len() < 16 || !t.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(invalid(
                    "admin_token",
                    "must be at least 16 visible ASCII characters (e.g. `openssl rand -hex 32`)",
                ));
            }
        }
        for (key, n) in [
            ("memory_max_records", config.memory_max_records),
            ("memory_max_bytes", config.memory_max_bytes),
            (
                "h2_max_concurrent_streams",
                config.h2_max_concurrent_streams as usize,
            ),
            ("max_connections", config.max_connections),
            ("max_in_flight", config.max_in_flight),
            ("max_buffered_bytes", config.max_buffered_bytes),
        ] {
            if n == 0 {
                return Err(invalid(key, "must be at least 1"));
            }
        }
        if config.max_upstream_connections <= config.max_in_flight {
            return Err(invalid(
                "max_upstream_connections",
                format!(
                    "must be greater than max_in_flight ({}): protected requests use up to max_in_flight upstream connections, and pass-through requests need the rest",
                    config.max_in_flight
                ),
            ));
        }
        if config.worker_threads == 0 {
            return Err(invalid("worker_threads", "must be at least 1"));
        }
        let stores = [
            config.redis_url.is_some(),
            config.store_path.is_some(),
            config.postgres_url.is_some(),
        ];
        if stores.iter().filter(|s| **s).count() > 1 {
            return Err(invalid(
                "store_path",
                "redis_url, store_path and postgres_url exclude each other: choose one store",
            ));
        }
        // The store is handed `postgres_url` alone: the TLS files that the postgres_tls_*
        // keys name are written into it, as the parameters they stand for.
        if let Some(pg) = crate::store::postgres_tls::PostgresSetup::from_config(&config)? {
            config.postgres_url = Some(Secret::from(pg.url.as_str()));
        }
        if let Some(endpoint) = &config.otlp_endpoint {
            let ok = endpoint
                .parse::<Uri>()
                .ok()
                .is_some_and(|u| u.scheme_str() == Some("http") && u.authority().is_some());
            if !ok {
                return Err(invalid(
                    "otlp_endpoint",
                    "must be http://host:port (OTLP over HTTP, no TLS: run the collector beside idemgate)",
                ));
            }
        }
        let redis = crate::store::RedisSetup::from_config(&config)?;
        if redis.is_some() && (config.store_path.is_some() || config.postgres_url.is_some()) {
            return Err(invalid(
                "store_path",
                "Redis, store_path and postgres_url exclude each other: choose one store",
            ));
        }
        let shared = redis.is_some() || config.postgres_url.is_some();
        let namespace = match (&config.namespace, shared) {
            (Some(ns), _) => {
                let ok = (1..=64).contains(&ns.len())
                    && ns
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(&b));
                if !ok {
                    return Err(invalid(
                        "namespace",
                        "must be 1 to 64 characters of letters, digits, '.', '_', ':' or '-'",
                    ));
                }
                ns.clone()
            }
            (None, true) => {
                return Err(invalid(
                    "namespace",
                    "is required with Redis and PostgreSQL: name the service whose records these are (e.g. `payments`), so that two services sharing one store never see each other's records",
                ))
            }
            (None, false) => "default".to_string(),
        };
        if let Some(secret) = &config.jwt_hs256_secret {
            if secret.expose().len() < 32 {
                return Err(invalid(
                    "jwt_hs256_secret",
                    "must be at least 32 bytes (RFC 7518 3.2: a key as long as the hash)",
                ));
            }
        }
        let jwks =
            match &config.jwks_file {
                Some(p) => Some(std::fs::read_to_string(p).map_err(|e| {
                    invalid("jwks_file", format!("cannot read {}: {e}", p.display()))
                })?),
                None => None,
            };
        let jwt = if config.jwt_hs256_secret.is_some() || jwks.is_some() {
            let secret = config
                .jwt_hs256_secret
                .as_ref()
                .map(|s| s.expose().as_bytes());
            let mut verifier =
                JwtVerifier::new(secret, jwks.as_deref()).map_err(|e| invalid("jwks_file", e))?;
            if let Some(aud) = &config.jwt_audience {
                let list = aud.list();
                if list.is_empty() || list.iter().any(|a| a.is_empty()) {
                    return Err(invalid(
                        "jwt_audience",
                        "must be a non-empty audience or a list of them",
                    ));
                }
                verifier = verifier.with_audience(list);
            }
            Some(Arc::new(verifier.with_cache(config.jwt_cache_entries)))
        } else {
            None
        };
        if config.jwt_audience.is_some() && jwt.is_none() {
            return Err(invalid(
                "jwt_audience",
                "needs keys to verify tokens with: set jwt_hs256_secret and/or jwks_file",
            ));
        }
        if config.jwt_cache_entries > 10_000_000 {
            return Err(invalid(
                "jwt_cache_entries",
                "must be at most 10000000 (each entry may hold a 4 KiB token)",
            ));
        }
        let envelope = envelope(&config)?;
        let client_ca = listener_tls
            .as_ref()
            .is_some_and(|t| t.authorities.is_some());
        let d = &config.defaults;
        let default_policy = Arc::new(resolve(
            "defaults",
            None,
            d,
            &Route::default(),
            jwt.is_some(),
            client_ca,
        )?);
        let mut routes = Vec::new();
        for (i, r) in config.routes.iter().enumerate() {
            let at = format!("routes[{i}]");
            if !r.path.starts_with('/') {
                return Err(invalid(format!("{at}.path"), "must start with '/'"));
            }
            let policy = resolve(&at, Some(r.path.clone()), d, r, jwt.is_some(), client_ca)?;
            let prefix = path::normalize(&r.path, policy.path_rules)
                .map_err(|e| invalid(format!("{at}.path"), e.to_string()))?
                .into_owned();
            if routes
                .iter()
                .any(|(p, _): &(String, Arc<Policy>)| *p == prefix)
            {
                return Err(invalid(
                    format!("{at}.path"),
                    "another route has the same path (after normalization)",
                ));
            }
            routes.push((prefix, Arc::new(policy)));
        }
        // The embedded store reserves room for the largest answer a route records with each
        // claim: below one reservation, every new key would get 503 forever.
        let embedded = config.redis_url.is_none()
            && config.redis_sentinels.is_empty()
            && config.redis_cluster_nodes.is_empty()
            && config.store_path.is_none()
            && config.postgres_url.is_none();
        if embedded {
            let named = std::iter::once((
                "defaults.max_response_bytes".to_string(),
                default_policy.max_response_bytes,
            ))
            .chain(
                config
                    .routes
                    .iter()
                    .zip(&routes)
                    .enumerate()
                    .filter(|(_, (r, _))| r.max_response_bytes.is_some())
                    .map(|(i, (_, (_, p)))| {
                        (
                            format!("routes[{i}].max_response_bytes"),
                            p.max_response_bytes,
                        )
                    }),
            );
            if let Some((key, largest)) = named.max_by_key(|(_, n)| *n) {
                let needed = largest.saturating_add(crate::limits::ANSWER_HEAD_ROOM as u64);
                if (config.memory_max_bytes as u64) < needed {
                    return Err(invalid(
                        "memory_max_bytes",
                        format!(
                            "must be at least {needed} bytes: each new key reserves room for its answer ({key} = {largest}, plus 65536 for its head and upkeep), so every new key would get 503; raise memory_max_bytes or lower {key}"
                        ),
                    ));
                }
            }
        }
        routes.sort_by_key(|(p, _)| std::cmp::Reverse(p.len()));
        for (i, (_, policy)) in routes.iter_mut().enumerate() {
            Arc::make_mut(policy).index = i + 1;
        }
        let policies = routes.iter().map(|(_, p)| p).chain([&default_policy]);
        let mut protected_methods: Vec<Method> = Vec::new();
        let mut enforced_methods: Vec<Method> = Vec::new();
        for p in policies {
            for m in &p.methods {
                if !protected_methods.contains(m) {
                    protected_methods.push(m.clone());
                }
                if p.mode == Mode::Enforce && !enforced_methods.contains(m) {
                    enforced_methods.push(m.clone());
                }
            }
        }
        // What a replay may inflate to: the largest answer any route records, or what an
        // operator may complete a record with.
        let mut envelope = envelope;
        let largest = std::iter::once(&default_policy)
            .chain(routes.iter().map(|(_, p)| p))
            .map(|p| usize::try_from(p.max_response_bytes).unwrap_or(usize::MAX))
            .max()
            .unwrap_or(0);
        envelope.max_body = Some(largest.max(crate::limits::ADMIN_MAX_BODY));
        let pinned_secret = pinned_secret(&config)?;
        let (check, create) = (
            config.scope_secret_check_interval,
            config.scope_secret_create_delay,
        );
        if !create.is_zero() && create <= check {
            return Err(invalid(
                "scope_secret_create_delay",
                format!("must be longer than scope_secret_check_interval ({}), so that running instances put a lost secret back before a new one is made; 0s only for a store no other instance uses", humantime_serde::re::humantime::format_duration(check)),
            ));
        }
        Ok(Settings {
            pinned_secret,
            listener_tls,
            config,
            upstream,
            default_policy,
            routes,
            redis,
            namespace,
            jwt,
            envelope,
            protected_methods,
            enforced_methods,
        })
    }

    /// The policy for a request path: the longest route prefix that matches at a segment
    /// boundary, else the defaults. Each route is matched against the path in the normal
    /// form of that route's own rules. An error: the path cannot be normalized safely.
    pub fn route<'a>(&'a self, raw: &str) -> Result<Routed<'a>, PathError> {
        // Normal forms already computed, per rules: a path is normalized at most once per
        // distinct rule set (there are four), and a path in normal form costs no copy.
        // No allocation for the bookkeeping: there are four rule sets at most.
        let mut forms: [Option<(PathRules, Cow<'_, str>)>; 4] = Default::default();
        fn form_for<'p>(
            forms: &mut [Option<(PathRules, Cow<'p, str>)>; 4],
            raw: &'p str,
            rules: PathRules,
        ) -> Result<usize, PathError> {
            for (i, slot) in forms.iter_mut().enumerate() {
                match slot {
                    Some((r, _)) if *r == rules => return Ok(i),
                    Some(_) => {}
                    None => {
                        *slot = Some((rules, path::normalize(raw, rules)?));
                        return Ok(i);
                    }
                }
            }
            // Two booleans make four rule sets, so a slot was free or matched above.
            Err(PathError::NotAbsolute)
        }
        // Longest prefix first; a route also takes its own path plus a format suffix
        // (`/v1/transfers.json`), which frameworks such as Rails route to the same
        // handler: it must not fall through to a shorter route or the defaults.
        let mut chosen = None;
        for (prefix, policy) in &self.routes {
            let i = form_for(&mut forms, raw, policy.path_rules)?;
            let Some((_, form)) = forms[i].as_ref() else {
                continue;
            };
            if prefix_matches(prefix, form) {
                chosen = Some((policy, i, None));
                break;
            }
            if let Some(ext) = format_suffix(prefix, form) {
                chosen = Some((policy, i, Some(ext)));
                break;
            }
        }
        let (policy, i, suffix) = match chosen {
            Some(c) => c,
            None => (
                &self.default_policy,
                form_for(&mut forms, raw, self.default_policy.path_rules)?,
                None,
            ),
        };
        let rules = policy.path_rules;
        let mut refused = None;
        // `;` is never in a normal form: a raw one is a parameter, left out above.
        let params = raw.contains(';');
        if params && policy.path_params == PathParams::Refuse {
            refused = Some(PathError::PathParams);
        }
        let mut normalized = match forms[i].take() {
            Some((_, Cow::Owned(s))) => Some(s),
            _ => None,
        };
        let mut fold_suffix = false;
        if let Some(ext) = suffix {
            if policy.format_suffixes.iter().any(|f| f == ext.as_str()) {
                fold_suffix = true;
                let form = normalized.as_deref().unwrap_or(raw);
                normalized = Some(form[..form.len() - ext.as_str().len() - 1].to_string());
            } else {
                refused = refused.or(Some(PathError::FormatSuffix(ext)));
            }
        }
        // The scope's form decodes every escape, so it is not a path to send: a path that
        // was not already normal goes in its RFC 3986 form (path::forward_form).
        let forward = if rules.case_insensitive
            || (params && refused.is_none())
            || fold_suffix
            || normalized.is_some()
        {
            match path::forward_form(raw, rules)? {
                Cow::Borrowed(_) => Forward::AsSent,
                Cow::Owned(p) => Forward::Path(p),
            }
        } else {
            Forward::Normalized
        };
        Ok(Routed {
            policy,
            normalized,
            forward,
            refused,
        })
    }

    /// The policy for a path, for callers that need no normal form (a path that cannot be
    /// normalized gets the defaults).
    pub fn policy_for(&self, raw: &str) -> &Arc<Policy> {
        self.route(raw)
            .map(|r| r.policy)
            .unwrap_or(&self.default_policy)
    }

    /// The tenant of a request on `policy`'s route: its own principal, or the shared
    /// anonymous one where the route allows it. `Ok(None)`: refused for want of a tenant.
    /// The proxy and the operator's lookup both use this, so they compute the same ids.
    pub fn tenant(
        &self,
        headers: &hyper::HeaderMap,
        cert: Option<&ClientCert>,
        policy: &Policy,
    ) -> Result<Option<crate::scope::Tenant>, crate::scope::TenantError> {
        match crate::scope::tenant::resolve(headers, cert, &policy.tenant, self.jwt.as_deref())? {
            Some(tenant) => Ok(Some(tenant)),
            None if policy.anonymous == Anonymous::Shared => {
                Ok(Some(crate::scope::Tenant::anonymous()))
            }
            None => Ok(None),
        }
    }

    /// Whether any route (or the defaults) reads its tenant from client certificates.
    pub fn reads_client_certs(&self) -> bool {
        std::iter::once(&self.default_policy)
            .chain(self.routes.iter().map(|(_, p)| p))
            .any(|p| matches!(p.tenant, TenantSource::ClientCert(_)))
    }

    /// Whether any route (or the defaults) protects this method.
    pub fn protects_anywhere(&self, method: &Method) -> bool {
        self.protected_methods.contains(method)
    }

    /// Whether a route that enforces (not `mode = "observe"`) protects `method`.
    pub fn enforces_anywhere(&self, method: &Method) -> bool {
        self.enforced_methods.contains(method)
    }
}

/// The format suffix of `path` when it is `prefix` (a route's path, ending in a segment)
/// plus `.` and 1 to 5 letters or digits.
fn format_suffix(prefix: &str, path: &str) -> Option<path::FormatExt> {
    if prefix.ends_with('/') {
        return None;
    }
    path::FormatExt::of(path.strip_prefix(prefix)?)
}

fn prefix_matches(prefix: &str, path: &str) -> bool {
    match path.strip_prefix(prefix) {
        Some(rest) => rest.is_empty() || prefix.ends_with('/') || rest.starts_with('/'),
        None => false,
    }
}

/// The operator's pinned scope secret, if any (`scope_secret` or `scope_secret_file`).
fn pinned_secret(config: &Config) -> Result<Option<ScopeSecret>, ConfigError> {
    let (key, hex) = match (&config.scope_secret, &config.scope_secret_file) {
        (Some(_), Some(_)) => {
            return Err(invalid(
                "scope_secret_file",
                "set scope_secret or scope_secret_file (IDEMGATE_SCOPE_SECRET counts as scope_secret), not both",
            ))
        }
        (Some(s), None) => ("scope_secret", s.expose().to_string()),
        (None, Some(p)) => {
            let text = std::fs::read_to_string(p).map_err(|e| {
                invalid("scope_secret_file", format!("cannot read {}: {e}", p.display()))
            })?;
            ("scope_secret_file", text)
        }
        (None, None) => return Ok(None),
    };
    ScopeSecret::from_hex(hex.trim())
        .map(Some)
        .ok_or_else(|| invalid(key, "must be 64 hex digits (as `GET /scope-secret` on the admin listener shows the current one)"))
}

/// The keys and the compression threshold of recorded answers.
fn envelope(config: &Config) -> Result<Envelope, ConfigError> {
    let mut entries: Vec<String> = config
        .encryption_keys
        .iter()
        .map(|k| k.expose().to_string())
        .collect();
    if let Some(p) = &config.encryption_keys_file {
        let text = std::fs::read_to_string(p).map_err(|e| {
            invalid(
                "encryption_keys_file",
                format!("cannot read {}: {e}", p.display()),
            )
        })?;
        entries.extend(
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(String::from),
        );
    }
    let keys = if entries.is_empty() {
        None
    } else {
        Some(Keyring::parse(&entries).map_err(|e| invalid("encryption_keys", e))?)
    };
    if config.compress_min_bytes == Some(0) {
        return Err(invalid("compress_min_bytes", "must be at least 1"));
    }
    Ok(Envelope {
        keys,
        compress_min_bytes: config.compress_min_bytes,
        max_body: None,
    })
}

fn parse_upstream(config: &Config, tls_listener: bool) -> Result<Upstream, ConfigError> {
    let s = &config.upstream;
    let uri: Uri = s
        .parse()
        .map_err(|e| invalid("upstream", format!("not a URI: {e}")))?;
    let scheme = uri.scheme().cloned().ok_or_else(|| {
        invalid(
            "upstream",
            "must be http://host:port or https://host[:port]",
        )
    })?;
    let https = scheme == hyper::http::uri::Scheme::HTTPS;
    if scheme != hyper::http::uri::Scheme::HTTP && !https {
        return Err(invalid("upstream", "must be an http:// or https:// origin"));
    }
    let authority = uri
        .authority()
        .cloned()
        .ok_or_else(|| invalid("upstream", "must name a host"))?;
    if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
        return Err(invalid(
            "upstream",
            "must be an origin without path or query (http://host:port)",
        ));
    }
    let host = hyper::header::HeaderValue::from_str(authority.as_str())
        .map_err(|_| invalid("upstream", "its host:port is not a valid Host header"))?;
    let tls = crate::tls::upstream(config, https)?;
    let forwarded_proto =
        hyper::header::HeaderValue::from_static(if tls_listener { "https" } else { "http" });
    Ok(Upstream {
        scheme,
        authority,
        host,
        tls,
        forwarded_proto,
    })
}

fn resolve(
    at: &str,
    route: Option<String>,
    d: &Defaults,
    r: &Route,
    jwt_keys: bool,
    client_ca: bool,
) -> Result<Policy, ConfigError> {
    let methods = r.methods.as_ref().unwrap_or(&d.methods);
    let key_of = |name: &str| {
        if matches_override(r, name) {
            format!("{at}.{name}")
        } else {
            format!("defaults.{name}")
        }
    };
    let methods = methods
        .iter()
        .map(|m| {
            Method::from_bytes(m.to_ascii_uppercase().as_bytes())
                .map_err(|_| invalid(key_of("methods"), format!("`{m}` is not an HTTP method")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let tenant_header_names = r
        .tenant_headers
        .as_ref()
        .unwrap_or(&d.tenant_headers)
        .iter()
        .map(|h| {
            HeaderName::from_bytes(h.as_bytes()).map_err(|_| {
                invalid(
                    key_of("tenant_headers"),
                    format!("`{h}` is not a header name"),
                )
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    // A certificate is a route's one principal source: a route that names it with a claim
    // or headers is refused, as are defaults naming both a claim and a certificate field
    // (the defaults' headers always have a value, so they give way to either). A claim
    // beside headers keeps its older meaning: the claim wins.
    let named = [
        ("tenant_jwt_claim", r.tenant_jwt_claim.is_some()),
        ("tenant_client_cert", r.tenant_client_cert.is_some()),
        ("tenant_headers", r.tenant_headers.is_some()),
    ];
    let set: Vec<&str> = named.iter().filter(|(_, s)| *s).map(|(n, _)| *n).collect();
    if r.tenant_client_cert.is_some() {
        if let Some(other) = set.iter().find(|n| **n != "tenant_client_cert") {
            return Err(invalid(
                format!("{at}.tenant_client_cert"),
                format!("a route reads its tenant from one source: {other} is set too"),
            ));
        }
    }
    if d.tenant_jwt_claim.is_some() && d.tenant_client_cert.is_some() {
        return Err(invalid(
            "defaults.tenant_client_cert",
            "a route reads its tenant from one source: tenant_jwt_claim is set too",
        ));
    }
    // A route's own choice wins: its `tenant_jwt_claim`, `tenant_client_cert` or
    // `tenant_headers`, else the defaults' claim or certificate field, else the defaults'
    // headers.
    let own = !set.is_empty();
    let cert = match (r.tenant_client_cert, own) {
        (Some(f), _) => Some(f),
        (None, true) => None,
        (None, false) => d.tenant_client_cert,
    };
    if cert.is_some() && !client_ca {
        return Err(invalid(
            key_of("tenant_client_cert"),
            "needs verified client certificates: a TLS listener (tls_cert_file, tls_key_file) with tls_client_ca_file",
        ));
    }
    let claim = match (&r.tenant_jwt_claim, own) {
        (Some(c), _) => Some(c),
        (None, true) => None,
        (None, false) => d.tenant_jwt_claim.as_ref(),
    };
    let tenant = match claim {
        Some(c) if c.is_empty() => {
            return Err(invalid(key_of("tenant_jwt_claim"), "must name a claim"))
        }
        Some(_) if !jwt_keys => {
            return Err(invalid(
                key_of("tenant_jwt_claim"),
                "needs keys to verify tokens with: set jwt_hs256_secret (or IDEMGATE_JWT_HS256_SECRET) and/or jwks_file",
            ))
        }
        Some(c) => TenantSource::JwtClaim(c.clone()),
        None => match cert {
            Some(field) => TenantSource::ClientCert(field),
            None => TenantSource::Headers(tenant_header_names),
        },
    };
    let path_rules = PathRules {
        strict: r.path_match.unwrap_or(d.path_match) == PathMatch::Strict,
        case_insensitive: r.case_insensitive_paths.unwrap_or(d.case_insensitive_paths),
    };
    let mut format_suffixes = Vec::new();
    for f in r.format_suffixes.as_ref().unwrap_or(&d.format_suffixes) {
        let ext = path::FormatExt::of(f).ok_or_else(|| {
            invalid(
                key_of("format_suffixes"),
                format!("`{f}` is not a format suffix: a '.' and 1 to 5 letters or digits, such as \".json\""),
            )
        })?;
        let ext = if path_rules.case_insensitive {
            ext.as_str().to_ascii_lowercase()
        } else {
            ext.as_str().to_string()
        };
        if !format_suffixes.contains(&ext) {
            format_suffixes.push(ext);
        }
    }
    let fingerprint_ignore = r
        .fingerprint_ignore
        .as_ref()
        .unwrap_or(&d.fingerprint_ignore)
        .iter()
        .map(|p| {
            JsonPointer::parse(p)
                .map_err(|e| invalid(key_of("fingerprint_ignore"), format!("`{p}`: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut key_headers: Vec<HeaderName> = Vec::new();
    for h in r.key_headers.as_ref().unwrap_or(&d.key_headers) {
        let name = HeaderName::from_bytes(h.as_bytes())
            .map_err(|_| invalid(key_of("key_headers"), format!("`{h}` is not a header name")))?;
        if key_headers.contains(&name) {
            return Err(invalid(
                key_of("key_headers"),
                format!("`{h}` is listed twice"),
            ));
        }
        key_headers.push(name);
    }
    if key_headers.is_empty() {
        return Err(invalid(
            key_of("key_headers"),
            "must name at least one header",
        ));
    }
    let release_on_status = r
        .release_on_status
        .clone()
        .unwrap_or_else(|| d.release_on_status.clone());
    if let Some(bad) = release_on_status.iter().find(|s| !(400..=599).contains(*s)) {
        return Err(invalid(
            key_of("release_on_status"),
            format!("{bad}: only 4xx and 5xx answers can say that nothing was done"),
        ));
    }
    let short_retention_statuses = r
        .short_retention_statuses
        .clone()
        .unwrap_or_else(|| d.short_retention_statuses.clone());
    if let Some(bad) = short_retention_statuses
        .iter()
        .find(|s| !(400..=499).contains(*s))
    {
        return Err(invalid(
            key_of("short_retention_statuses"),
            format!("{bad}: only 4xx answers can show that nothing ran"),
        ));
    }
    let mut method_override_headers: Vec<HeaderName> = Vec::new();
    for h in r
        .method_override_headers
        .as_ref()
        .unwrap_or(&d.method_override_headers)
    {
        let name = HeaderName::from_bytes(h.as_bytes()).map_err(|_| {
            invalid(
                key_of("method_override_headers"),
                format!("`{h}` is not a header name"),
            )
        })?;
        if method_override_headers.contains(&name) {
            return Err(invalid(
                key_of("method_override_headers"),
                format!("`{h}` is listed twice"),
            ));
        }
        if key_headers.contains(&name) || name == hyper::header::AUTHORIZATION {
            return Err(invalid(
                key_of("method_override_headers"),
                format!("`{h}` already carries the key or the credential"),
            ));
        }
        method_override_headers.push(name);
    }
    let p = Policy {
        route,
        methods,
        require_key: r.require_key.unwrap_or(d.require_key),
        retention: r.retention.unwrap_or(d.retention),
        lease: r.lease.unwrap_or(d.lease),
        upstream_timeout: r.upstream_timeout.unwrap_or(d.upstream_timeout),
        max_body_bytes: r.max_body_bytes.unwrap_or(d.max_body_bytes),
        max_response_bytes: r.max_response_bytes.unwrap_or(d.max_response_bytes),
        max_key_length: r.max_key_length.unwrap_or(d.max_key_length),
        tenant,
        anonymous: r.anonymous.unwrap_or(d.anonymous),
        path_rules,
        on_store_error: r.on_store_error.unwrap_or(d.on_store_error),
        on_ambiguous: r.on_ambiguous.unwrap_or(d.on_ambiguous),
        record_mode: r.record_mode.unwrap_or(d.record_mode),
        mode: r.mode.unwrap_or(d.mode),
        fingerprint_ignore,
        query_order: r.query_order.unwrap_or(d.query_order),
        path_params: r.path_params.unwrap_or(d.path_params),
        format_suffixes,
        key_headers,
        release_on_status,
        short_retention_statuses,
        short_retention: r.short_retention.unwrap_or(d.short_retention),
        method_override_headers,
        upstream_time: Arc::default(),
        index: 0,
    };
    if p.short_retention.is_zero() {
        return Err(invalid(
            key_of("short_retention"),
            "must be greater than zero (remove the status from short_retention_statuses to keep its answers for retention)",
        ));
    }
    if p.lease < Duration::from_millis(100) {
        return Err(invalid(key_of("lease"), "must be at least 100ms"));
    }
    if p.upstream_timeout.is_zero() {
        return Err(invalid(
            key_of("upstream_timeout"),
            "must be greater than zero",
        ));
    }
    if p.retention <= p.upstream_timeout || p.retention <= p.lease {
        return Err(invalid(
            key_of("retention"),
            "must be longer than both lease and upstream_timeout, or records would expire while their request runs",
        ));
    }
    if !(1..=4096).contains(&p.max_key_length) {
        return Err(invalid(
            key_of("max_key_length"),
            "must be between 1 and 4096",
        ));
    }
    if p.max_body_bytes == 0 {
        return Err(invalid(key_of("max_body_bytes"), "must be at least 1"));
    }
    if p.max_response_bytes == 0 {
        return Err(invalid(key_of("max_response_bytes"), "must be at least 1"));
    }
    Ok(p)
}

fn matches_override(r: &Route, name: &str) -> bool {
    match name {
        "methods" => r.methods.is_some(),
        "tenant_headers" => r.tenant_headers.is_some(),
        "tenant_jwt_claim" => r.tenant_jwt_claim.is_some(),
        "tenant_client_cert" => r.tenant_client_cert.is_some(),
        "fingerprint_ignore" => r.fingerprint_ignore.is_some(),
        "key_headers" => r.key_headers.is_some(),
        "release_on_status" => r.release_on_status.is_some(),
        "short_retention_statuses" => r.short_retention_statuses.is_some(),
        "short_retention" => r.short_retention.is_some(),
        "method_override_headers" => r.method_override_headers.is_some(),
        "lease" => r.lease.is_some(),
        "upstream_timeout" => r.upstream_timeout.is_some(),
        "retention" => r.retention.is_some(),
        "max_key_length" => r.max_key_length.is_some(),
        "max_body_bytes" => r.max_body_bytes.is_some(),
        "max_response_bytes" => r.max_response_bytes.is_some(),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(toml: &str) -> Result<Settings, ConfigError> {
        Config::load(
            Figment::from(Serialized::defaults(Config::default())).merge(Toml::string(toml)),
        )
    }

    #[test]
    fn defaults_are_valid_and_match_the_design() {
        let s = settings("").unwrap();
        let p = &s.default_policy;
        assert_eq!(p.methods, vec![Method::POST, Method::PATCH]);
        assert!(!p.require_key);
        assert_eq!(p.retention, Duration::from_secs(86400));
        assert_eq!(p.lease, Duration::from_secs(10));
        assert_eq!(p.max_body_bytes, 1048576);
        assert_eq!(p.max_response_bytes, 4 * 1048576);
        assert_eq!(
            s.config.admin_listen,
            Some("127.0.0.1:9901".parse().unwrap())
        );
    }

    #[test]
    fn longest_prefix_wins_at_segment_boundaries() {
        let s = settings(
            r#"
            [[routes]]
            path = "/v1"
            require_key = true
            [[routes]]
            path = "/v1/transfers"
            methods = ["post"]
            retention = "48h"
            fingerprint_ignore = ["/client_time"]
            "#,
        )
        .unwrap();
        assert_eq!(
            s.policy_for("/v1/transfers").retention,
            Duration::from_secs(48 * 3600)
        );
        assert_eq!(
            s.policy_for("/v1/transfers/7").route.as_deref(),
            Some("/v1/transfers")
        );
        assert_eq!(s.policy_for("/v1/transfersx").route.as_deref(), Some("/v1"));
        assert!(s.policy_for("/v1/x").require_key);
        assert_eq!(s.policy_for("/v2").route, None);
        assert_eq!(s.policy_for("/v1/transfers").methods, vec![Method::POST]);
    }

    #[test]
    fn query_order_is_a_route_setting() {
        let s = settings(
            r#"
            [defaults]
            query_order = "significant"
            [[routes]]
            path = "/v1/sorted"
            query_order = "sorted"
            "#,
        )
        .unwrap();
        assert_eq!(s.policy_for("/v1/x").query_order, QueryOrder::Significant);
        assert_eq!(s.policy_for("/v1/sorted").query_order, QueryOrder::Sorted);
        let s = settings("").unwrap();
        assert_eq!(s.policy_for("/").query_order, QueryOrder::Sorted);
        assert!(settings("[defaults]\nquery_order = \"random\"").is_err());
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

    #[test]
    fn listen_addresses_may_name_a_host() {
        let s = settings("listen = \"localhost:8088\"\nadmin_listen = \"localhost:9988\"").unwrap();
        assert!(s.config.listen.ip().is_loopback());
        assert_eq!(s.config.listen.port(), 8088);
        assert_eq!(s.config.admin_listen.map(|a| a.port()), Some(9988));
        let err = settings("listen = \"localhost\"").unwrap_err().to_string();
        assert!(err.contains("listen"), "{err}");
    }

    #[test]
    fn errors_do_not_name_the_profile() {
        let err = settings("[defaults]\nretention = \"soon\"")
            .unwrap_err()
            .to_string();
        assert!(err.contains("for key `defaults.retention`"), "{err}");
        assert!(!err.contains("default."), "{err}");
    }

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

    #[test]
    fn scope_settings_are_validated_naming_their_key() {
        for (toml, key) in [
            ("redis_url = \"redis://127.0.0.1:6379/0\"", "namespace"),
            ("namespace = \"has space\"", "namespace"),
            (
                "[defaults]\ntenant_jwt_claim = \"sub\"",
                "defaults.tenant_jwt_claim",
            ),
            (
                "[[routes]]\npath = \"/a\"\ntenant_jwt_claim = \"sub\"",
                "routes[0].tenant_jwt_claim",
            ),
            ("jwt_hs256_secret = \"short\"", "jwt_hs256_secret"),
            ("jwks_file = \"/nonexistent/jwks.json\"", "jwks_file"),
            (
                "[[routes]]\npath = \"/a/\"\n[[routes]]\npath = \"/a\"",
                "routes[1].path",
            ),
            ("[[routes]]\npath = \"/a%2Fb\"", "routes[0].path"),
            ("[defaults]\nanonymous = \"open\"", "anonymous"),
            ("[defaults]\npath_match = \"loose\"", "path_match"),
        ] {
            let err = settings(toml).unwrap_err().to_string();
            assert!(err.contains(key), "{toml:?}: {err}");
        }
        let s =
            settings("redis_url = \"redis://127.0.0.1:6379/0\"\nnamespace = \"payments\"").unwrap();
        assert_eq!(s.namespace, "payments");
        assert_eq!(settings("").unwrap().namespace, "default");
        let err = settings("jwt_hs256_secret = \"short\"")
            .unwrap_err()
            .to_string();
        assert!(
            !err.contains("short\""),
            "the secret is never printed: {err}"
        );
    }

    #[test]
    fn record_mode_defaults_to_before_response_and_routes_override_it() {
        let s = settings("").unwrap();
        assert_eq!(s.default_policy.record_mode, RecordMode::BeforeResponse);
        let s = settings(
            r#"
            [defaults]
            record_mode = "after_response"
            [[routes]]
            path = "/v1/transfers"
            record_mode = "before_response"
            [[routes]]
            path = "/v1/quotes"
            "#,
        )
        .unwrap();
        assert_eq!(s.default_policy.record_mode, RecordMode::AfterResponse);
        assert_eq!(
            s.policy_for("/v1/transfers").record_mode,
            RecordMode::BeforeResponse
        );
        assert_eq!(
            s.policy_for("/v1/quotes").record_mode,
            RecordMode::AfterResponse
        );
        let s = settings("[[routes]]\npath = \"/a\"\nrecord_mode = \"after_response\"").unwrap();
        assert_eq!(s.policy_for("/a").record_mode, RecordMode::AfterResponse);
        assert_eq!(s.default_policy.record_mode, RecordMode::BeforeResponse);
        // The environment's form: `IDEMGATE_DEFAULTS__RECORD_MODE=after_response` names a
        // setting, and its value is read as this string.
        assert!(
            unknown_env_vars(["IDEMGATE_DEFAULTS__RECORD_MODE".to_string()].into_iter()).is_empty()
        );
        let env = Figment::from(Serialized::defaults(Config::default())).merge(
            Serialized::default("defaults.record_mode", "after_response"),
        );
        let s = Config::load(env).unwrap();
        assert_eq!(s.default_policy.record_mode, RecordMode::AfterResponse);
        for (toml, key) in [
            (
                "[defaults]\nrecord_mode = \"after\"",
                "defaults.record_mode",
            ),
            (
                "[defaults]\nrecord_mode = \"AfterResponse\"",
                "defaults.record_mode",
            ),
            (
                "[[routes]]\npath = \"/a\"\nrecord_mode = \"later\"",
                "record_mode",
            ),
        ] {
            let err = settings(toml).unwrap_err().to_string();
            assert!(err.contains(key), "{toml:?}: {err}");
        }
    }

    #[test]
    fn routes_match_the_normal_form_of_the_path() {
        let s = settings(
            r#"
            [defaults]
            tenant_jwt_claim = "sub"
            [[routes]]
            path = "/v1/transfers/"
            tenant_headers = ["X-Account-Id"]
            [[routes]]
            path = "/IIS"
            case_insensitive_paths = true
            [[routes]]
            path = "/strict"
            path_match = "strict"
            "#
            .replace(
                "[defaults]",
                "jwt_hs256_secret = \"0123456789abcdef0123456789abcdef\"\n[defaults]",
            )
            .as_str(),
        )
        .unwrap();
        let r = s.route("/v1//%74ransfers/7/").unwrap();
        assert_eq!(r.policy.route.as_deref(), Some("/v1/transfers/"));
        assert_eq!(r.normalized.as_deref(), Some("/v1/transfers/7"));
        assert_eq!(
            r.policy.tenant,
            TenantSource::Headers(vec![HeaderName::from_static("x-account-id")])
        );
        let r = s.route("/v1/transfers").unwrap();
        assert_eq!(r.normalized, None);
        assert_eq!(r.policy.route.as_deref(), Some("/v1/transfers/"));
        let r = s.route("/iis/Pay").unwrap();
        assert_eq!(r.policy.route.as_deref(), Some("/IIS"));
        assert_eq!(r.normalized.as_deref(), Some("/iis/pay"));
        assert_eq!(s.route("/strict//x").unwrap().normalized, None);
        let d = s.route("/other").unwrap().policy;
        assert_eq!(d.tenant, TenantSource::JwtClaim("sub".into()));
        assert!(s.route("/a%2fb").is_err());
    }

    #[test]
    fn path_parameters_and_format_suffixes_are_routed_then_refused_or_folded() {
        let s = settings(
            r#"
            [[routes]]
            path = "/v1/transfers"
            [[routes]]
            path = "/v1/payees"
            path_params = "strip"
            format_suffixes = [".json", ".XML"]
            [[routes]]
            path = "/v1"
            methods = []
            [[routes]]
            path = "/IIS/Pay"
            case_insensitive_paths = true
            format_suffixes = [".JSON"]
            "#,
        )
        .unwrap();
        // Refused where the route does not accept them, after routing as if absent: never
        // the shorter, unprotected `/v1`.
        for p in ["/v1/transfers;jsessionid=A", "/v1;v=2/transfers"] {
            let r = s.route(p).unwrap();
            assert_eq!(r.policy.route.as_deref(), Some("/v1/transfers"), "{p}");
            assert_eq!(r.refused, Some(PathError::PathParams), "{p}");
        }
        let r = s.route("/v1/transfers.json").unwrap();
        assert_eq!(r.policy.route.as_deref(), Some("/v1/transfers"));
        assert!(matches!(r.refused, Some(PathError::FormatSuffix(e)) if e.as_str() == "json"));
        // Not a format suffix: another path under `/v1`.
        let r = s.route("/v1/transfers.toolong").unwrap();
        assert_eq!(r.policy.route.as_deref(), Some("/v1"));
        assert_eq!(r.refused, None);
        // Stripped: the scope leaves them out, the upstream gets them as sent.
        let r = s.route("/v1//payees;jsessionid=A/7").unwrap();
        assert_eq!(r.policy.route.as_deref(), Some("/v1/payees"));
        assert_eq!(r.refused, None);
        assert_eq!(r.normalized.as_deref(), Some("/v1/payees/7"));
        assert_eq!(r.forward, Forward::Path("/v1/payees;jsessionid=A/7".into()));
        // A listed suffix is the route's own path.
        let r = s.route("/v1/payees.json").unwrap();
        assert_eq!(r.refused, None);
        assert_eq!(r.normalized.as_deref(), Some("/v1/payees"));
        assert_eq!(r.forward, Forward::AsSent);
        let r = s.route("/v1/payees.XML").unwrap();
        assert_eq!(r.normalized.as_deref(), Some("/v1/payees"));
        assert!(s.route("/v1/payees.csv").unwrap().refused.is_some());
        // Case-insensitive: suffixes compared in lower case, trailing dots folded.
        let r = s.route("/iis/pay.Json").unwrap();
        assert_eq!(r.policy.route.as_deref(), Some("/IIS/Pay"));
        assert_eq!(r.refused, None);
        assert_eq!(r.normalized.as_deref(), Some("/iis/pay"));
        assert_eq!(r.forward, Forward::AsSent);
        let r = s.route("/IIS/Pay.").unwrap();
        assert_eq!(r.normalized.as_deref(), Some("/iis/pay"));
        assert_eq!(r.forward, Forward::Path("/IIS/Pay".into()));
        assert!(settings("[defaults]\nformat_suffixes = [\"json\"]").is_err());
        assert!(settings("[defaults]\nformat_suffixes = [\".toolong\"]").is_err());
        assert!(settings("[defaults]\npath_params = \"keep\"").is_err());
    }
}

/// Every setting with its default, as TOML, then the settings without a default (absent
/// unless set) as comments: what `idemgate config defaults` prints.
pub fn defaults_toml() -> Result<String, String> {
    let value = serde_json::to_value(Config::default()).map_err(|e| e.to_string())?;
    let mut unset = Vec::new();
    unset_keys(&value, "", &mut unset);
    let mut out = to_toml(value)?;
    out.push_str("\n# Without a default (absent unless set):\n");
    for key in unset {
        out.push_str(&format!("# {key}\n"));
    }
    Ok(out)
}

/// The configuration as TOML with its secrets replaced by placeholders that still pass
/// validation (so the output is a configuration `idemgate config check` accepts): what
/// `idemgate config check` prints.
pub fn redacted_toml(config: &Config) -> Result<String, String> {
    let mut value = serde_json::to_value(config).map_err(|e| e.to_string())?;
    if let serde_json::Value::Object(map) = &mut value {
        for (key, placeholder) in [
            ("admin_token", REDACTED_TOKEN),
            ("jwt_hs256_secret", REDACTED_JWT),
            ("redis_password", REDACTED),
            ("scope_secret", REDACTED_SCOPE),
        ] {
            if map.get(key).is_some_and(|v| !v.is_null()) {
                map.insert(key.into(), serde_json::Value::String(placeholder.into()));
            }
        }
        if let Some(serde_json::Value::Array(keys)) = map.get_mut("encryption_keys") {
            for k in keys.iter_mut() {
                if let serde_json::Value::String(s) = k {
                    let id = s.split(':').next().unwrap_or("").to_string();
                    *s = format!("{id}:{REDACTED_KEY}");
                }
            }
        }
        for key in ["redis_url", "postgres_url"] {
            if let Some(serde_json::Value::String(s)) = map.get_mut(key) {
                *s = redact_url(s);
            }
        }
    }
    let mut out = String::from(
        "# The effective configuration. Secrets that are set are shown as placeholders\n# (REDACTED..., an all-zero scope secret and all-zero encryption keys).\n",
    );
    out.push_str(&to_toml(value)?);
    Ok(out)
}

const REDACTED: &str = "REDACTED";
const REDACTED_TOKEN: &str = "REDACTED-REDACTED-REDACTED";
const REDACTED_JWT: &str = "REDACTED-REDACTED-REDACTED-REDACTED";
const REDACTED_SCOPE: &str = "0000000000000000000000000000000000000000000000000000000000000000";
const REDACTED_KEY: &str = "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";

/// A URL's password (`scheme://user:password@host`, `password=` in a query or in a
/// key=value connection string) replaced by `REDACTED`.
fn redact_url(url: &str) -> String {
    let mut out = url.to_string();
    if let Some(scheme_end) = out.find("://") {
        let rest = scheme_end + 3;
        let authority_end = out[rest..]
            .find(['/', '?', '#'])
            .map_or(out.len(), |i| rest + i);
        if let Some(at) = out[rest..authority_end].rfind('@') {
            let userinfo = &out[rest..rest + at];
            if let Some(colon) = userinfo.find(':') {
                let (start, end) = (rest + colon + 1, rest + at);
                out.replace_range(start..end, REDACTED);
            }
        }
    }
    let mut searched = 0;
    while let Some(i) = out[searched..].find("password=") {
        let start = searched + i + "password=".len();
        let end = out[start..]
            .find(['&', ' ', '#'])
            .map_or(out.len(), |j| start + j);
        out.replace_range(start..end, REDACTED);
        searched = start + REDACTED.len();
    }
    out
}

/// Dotted names of the settings that are absent (`null`) in `value`.
fn unset_keys(value: &serde_json::Value, prefix: &str, out: &mut Vec<String>) {
    if let serde_json::Value::Object(map) = value {
        for (k, v) in map {
            let name = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            match v {
                serde_json::Value::Null => out.push(name),
                serde_json::Value::Object(_) => unset_keys(v, &name, out),
                _ => {}
            }
        }
    }
}

/// `value` without its nulls, as TOML.
fn to_toml(mut value: serde_json::Value) -> Result<String, String> {
    fn strip(v: &mut serde_json::Value) {
        match v {
            serde_json::Value::Object(map) => {
                map.retain(|_, v| !v.is_null());
                map.values_mut().for_each(strip);
            }
            serde_json::Value::Array(items) => items.iter_mut().for_each(strip),
            _ => {}
        }
    }
    strip(&mut value);
    toml::to_string(&value).map_err(|e| e.to_string())
}

#[cfg(test)]
mod redaction_tests {
    use super::*;

    #[test]
    fn passwords_in_urls_are_redacted() {
        assert_eq!(
            redact_url("rediss://idemgate:s3cret@redis:6380/0"),
            "rediss://idemgate:REDACTED@redis:6380/0"
        );
        assert_eq!(redact_url("redis://redis:6379/0"), "redis://redis:6379/0");
        assert_eq!(
            redact_url("postgres://app:p%40ss@db/pay?sslmode=disable"),
            "postgres://app:REDACTED@db/pay?sslmode=disable"
        );
        assert_eq!(
            redact_url("host=db user=app password=hunter2 dbname=pay"),
            "host=db user=app password=REDACTED dbname=pay"
        );
    }
}
