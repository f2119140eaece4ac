//! Configuration as data: built-in defaults < TOML file < `IDEMGATE_` environment <
//! command-line flags, merged with figment, then validated into the plain [`Settings`] that
//! the proxy and the stores take. Every error names the key at fault.
//!
//! # Layout
//!
//! - `mod.rs`: the schema ([`Config`], [`Defaults`], [`Route`] and their enums) and
//!   [`ConfigError`].
//! - `defaults`: the built-in defaults, and `idemgate config defaults`.
//! - `operators`: `[[admin_operators]]` and `admin_hosts`.
//! - `load`: the layered sources (figment) and the environment names that are no setting.
//! - `live`: the settings in force, swapped whole by a reload, and what a reload changes.
//! - `validate`: [`Settings::new`], the checks of values, and [`Upstream`].
//! - `at_rest`: the sealing keys and compression of recorded answers, as values.
//! - `policy`: routes resolved into [`Policy`].
//! - `route`: which route a path leads to ([`Settings::route`]) and how it is forwarded.
//! - `redact`: `idemgate config check`'s output, its secrets replaced.
//!
//! It imports no runtime module (proxy, admin, stores, TLS, upstream client): they import
//! it. The objects the settings describe (TLS acceptors and connectors, store connections,
//! the envelope's keyring) are built in [`crate::wiring`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::fingerprint::QueryOrder;
use crate::scope::client_cert::CertField;
use load::describe;

mod at_rest;
mod defaults;
mod framework;
mod live;
mod load;
mod operators;
mod policy;
mod redact;
mod route;
mod validate;

pub use at_rest::{AtRest, SealingKey};
pub use defaults::defaults_toml;
pub use framework::Framework;
pub use live::{changes, Changes, Live, RELOADABLE};
pub use load::{mistyped_env_vars, unknown_env, unknown_env_vars};
pub use operators::{parse_host_entry, AdminOperator, Role, ADMIN_TOKEN_NAME};
pub use policy::Policy;
pub use redact::redacted_toml;
pub use route::{Forward, Routed};
pub use validate::{Settings, Upstream};

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

/// The shape of idemgate's own answers on a route (`error_format`): see
/// [`crate::problem::ErrorFormat`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorFormatName {
    /// RFC 9457 `application/problem+json` (the default).
    Problem,
    /// Stripe's `{"error": {"type", "code", "message", "doc_url"}}`.
    Stripe,
    /// `error_template`, a JSON document with placeholders.
    Template,
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

/// Whether a TLS listener asks clients for a certificate, once `tls_client_ca_file` is set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClientAuth {
    /// A client without a certificate is served; one with a certificate that does not
    /// verify is refused.
    Optional,
    /// A client without a verified certificate is refused in the handshake (the default
    /// with a client CA).
    Required,
}

/// `redis_record_format`: how a record is kept in Redis. Every version reads hashes;
/// only this one and later read values, so a fleet switches to `value` once every instance
/// runs a version that reads both (docs/production.md, "Namespaces and upgrades").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RedisRecordFormat {
    /// One hash per record, fields for its parts (every version reads it).
    #[default]
    Hash,
    /// One string value per record: a new key's claim and a replay are one bare
    /// `SET ... NX GET` each (Redis 7.0 or later).
    Value,
}

/// `upstream_http2`: `true` (the default) offers h2 besides http/1.1 to an `https://`
/// upstream by ALPN; `false` offers http/1.1 only; `"prior_knowledge"` says the upstream
/// speaks h2 and nothing else: cleartext h2 (h2c) to an `http://` upstream, ALPN offering
/// only h2 to an `https://` one. Only with `"prior_knowledge"` is the upstream known to be
/// h2 before a connection is opened, which lets protected requests share pooled
/// connections (see `upstream::h2_client`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UpstreamHttp2 {
    /// `false`: HTTP/1.1 only.
    Off,
    /// `true`: h2 or http/1.1, whichever an `https://` upstream picks by ALPN.
    #[default]
    Offer,
    /// `"prior_knowledge"`: h2 only.
    PriorKnowledge,
}

impl Serialize for UpstreamHttp2 {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            UpstreamHttp2::Off => s.serialize_bool(false),
            UpstreamHttp2::Offer => s.serialize_bool(true),
            UpstreamHttp2::PriorKnowledge => s.serialize_str("prior_knowledge"),
        }
    }
}

impl<'de> Deserialize<'de> for UpstreamHttp2 {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = UpstreamHttp2;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("true, false or \"prior_knowledge\"")
            }
            fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<UpstreamHttp2, E> {
                Ok(if v {
                    UpstreamHttp2::Offer
                } else {
                    UpstreamHttp2::Off
                })
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<UpstreamHttp2, E> {
                match v {
                    "true" => Ok(UpstreamHttp2::Offer),
                    "false" => Ok(UpstreamHttp2::Off),
                    "prior_knowledge" => Ok(UpstreamHttp2::PriorKnowledge),
                    other => Err(E::invalid_value(serde::de::Unexpected::Str(other), &self)),
                }
            }
        }
        d.deserialize_any(Visitor)
    }
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
    /// Which HTTP the upstream is spoken to in: see [`UpstreamHttp2`].
    #[serde(default)]
    pub upstream_http2: UpstreamHttp2,
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
    pub tls_client_auth: Option<ClientAuth>,
    /// How often `tls_cert_file` and `tls_key_file` are read for a change.
    #[serde(
        default = "defaults::default_tls_reload_interval",
        with = "humantime_serde"
    )]
    pub tls_reload_interval: Duration,
    /// The admin listener (`/healthz`, `/readyz`, `/metrics`, `/records/{id}`); absent: off.
    #[serde(default, deserialize_with = "optional_addr")]
    pub admin_listen: Option<SocketAddr>,
    /// When set, every admin endpoint but the probes (`/healthz`, `/readyz`) wants
    /// `Authorization: Bearer <token>`: this token acts as the operator `admin`, role
    /// `admin`. Changes on reload.
    pub admin_token: Option<Secret>,
    /// The people of the admin listener, each with their own token (by its SHA-256) and a
    /// role (`read`, `decide`, `admin`); once any is set (or `admin_token`), a request
    /// without a valid token gets 401. Changes on reload.
    #[serde(default)]
    pub admin_operators: Vec<AdminOperator>,
    /// Names (case-insensitive, `name` or `name:port`) under which the admin listener
    /// answers, besides IP literals and `localhost`: any other `Host` gets 421.
    #[serde(default)]
    pub admin_hosts: Vec<String>,
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
    /// How new records are kept in Redis: see [`RedisRecordFormat`].
    #[serde(default)]
    pub redis_record_format: RedisRecordFormat,
    /// Claims and records count as written only once this many replicas have them (`WAIT`).
    #[serde(default)]
    pub min_replicas_ack: u32,
    /// How long `WAIT` may take (shorter than `store_timeout`).
    #[serde(
        default = "defaults::default_replica_ack_timeout",
        with = "humantime_serde"
    )]
    pub replica_ack_timeout: Duration,
    /// With `min_replicas_ack`: how many claims and records (each with its `WAIT`) may be
    /// on their way at once, per serving thread, each on a connection of its own.
    #[serde(default = "defaults::default_replica_ack_connections")]
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
    /// Bytes of `max_buffered_bytes` that the replays of one client connection may hold at
    /// once (unset: a quarter of it): beyond, its further replays get 503 `overloaded`
    /// while other connections keep theirs. A single replay larger than this is still
    /// served, alone on its connection.
    pub max_buffered_bytes_per_connection: Option<usize>,
    /// Bytes of `max_buffered_bytes` that one tenant's replays and answers waiting for its
    /// clients may hold at once, over all its connections (unset: a quarter of it): beyond,
    /// its further protected requests get 503 `overloaded` while other tenants keep being
    /// served. A single replay larger than this is still served, alone for its tenant.
    pub max_buffered_bytes_per_tenant: Option<usize>,
    /// Pass-through requests that one client connection may have at once, from admission
    /// to the last byte of their answers (unset: a quarter of the pass-through share of
    /// `max_upstream_connections`): beyond, its further ones get 503 `overloaded` while
    /// other connections keep theirs. One is always allowed.
    pub max_pass_through_per_connection: Option<usize>,
    /// Pass-through requests that one tenant may have at once over all its connections,
    /// from admission to the last byte of their answers (unset: a quarter of the
    /// pass-through share): beyond, its further ones wait within `queue_timeout` for one of
    /// its own, then get 503 `overloaded`, while other tenants keep theirs. The tenant is
    /// read as the route reads it, but a bearer token is not verified: each distinct
    /// credential counts as a tenant. Requests without one are bounded per connection only.
    /// One is always allowed.
    pub max_pass_through_per_tenant: Option<usize>,
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
    /// What is logged, in `RUST_LOG`'s syntax (`info`, `warn,idemgate=debug`); absent:
    /// `RUST_LOG`, else `info`. When set it wins over `RUST_LOG`, and a reload applies a
    /// change of it.
    pub log_level: Option<String>,
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
    /// How the upstream treats letter case in paths: `true` compares them
    /// case-insensitively (IIS/ASP.NET, Express, Koa), `false` case-sensitively. Unset (the
    /// default, unless a framework preset knows): a protected path that is a route's only
    /// when case is ignored is refused.
    pub case_insensitive_paths: Option<bool>,
    /// How the upstream reads a raw `+` in a path: `true` as a space (`%2B` the plus), as
    /// @koa/router 13 and older decode parameters; `false` as a plus. Unset (the default,
    /// unless a framework preset knows): a protected path with a raw `+` is refused.
    pub plus_is_space: Option<bool>,
    /// Whether the upstream reads raw bytes beyond ASCII in a path as UTF-8 (the same as
    /// their percent-escapes). Unset or `false` (the default): a protected path with such a
    /// byte is refused, since some frameworks read it as Latin-1 (Tornado).
    pub raw_utf8_paths: Option<bool>,
    /// The upstream's framework (`express`, `koa`, `fastify`, `flask`, `fastapi`, `django`,
    /// `rails`, `laravel`, `spring`, `jetty`, `go`): the path, method and override rules it
    /// uses, where this route (or `[defaults]`) does not set them itself.
    pub framework: Option<Framework>,
    /// See [`OnStoreError`].
    pub on_store_error: OnStoreError,
    /// See [`OnAmbiguous`].
    pub on_ambiguous: OnAmbiguous,
    /// See [`RecordMode`].
    pub record_mode: RecordMode,
    /// See [`Mode`].
    pub mode: Mode,
    /// See [`ErrorFormatName`].
    pub error_format: ErrorFormatName,
    /// With `error_format = "template"`: the JSON document of idemgate's own answers, its
    /// strings holding `{status}`, `{code}`, `{title}`, `{detail}`, `{record_id}`,
    /// `{retry_after}`.
    pub error_template: Option<String>,
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
    /// A response header by which the upstream declines to have an answer kept (its value
    /// `no-store`): the answer reaches the client, the claim is released, and a retry
    /// executes again. Never forwarded to the client; read from the upstream only.
    pub record_control_header: Option<String>,
    /// A JSON pointer (RFC 6901) to the key in the request's JSON body (Square's
    /// `/idempotency_key`): the key comes from there, the header still accepted when both
    /// agree (400 when they differ); the member is left out of the fingerprint. Needs
    /// `require_key = true`.
    pub key_json_pointer: Option<String>,
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
    /// Where the upstream reads a `_method` override (`"query"`, `"body"`): there, the
    /// method it names is scoped, fingerprinted and protected. Elsewhere a `_method` naming
    /// another method gets 400 `invalid-method-override` where either method is protected.
    pub method_override_params: Vec<OverrideParam>,
    /// See [`MethodCase`].
    pub method_case: MethodCase,
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

/// What a route does with a protected method spelt in another letter case (`post`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MethodCase {
    /// 400 `invalid-method` (default): Django upper-cases `post` and runs the POST view,
    /// Express and most others route it nowhere, so it may be the protected operation.
    #[default]
    Refuse,
    /// The upstream upper-cases the method (Django): `post` is protected as `POST`, and
    /// forwarded as sent.
    Fold,
}

/// Where a `_method` field is a method override the upstream honours.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OverrideParam {
    /// `?_method=PATCH` (Express's `method-override('_method')`, Symfony, Laravel).
    Query,
    /// A `_method` field of a form-encoded or multipart POST body (Rack's
    /// `MethodOverride` in Rails and Sinatra, Laravel, Symfony).
    Body,
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
    pub plus_is_space: Option<bool>,
    pub raw_utf8_paths: Option<bool>,
    pub framework: Option<Framework>,
    pub on_store_error: Option<OnStoreError>,
    pub on_ambiguous: Option<OnAmbiguous>,
    pub record_mode: Option<RecordMode>,
    pub mode: Option<Mode>,
    pub error_format: Option<ErrorFormatName>,
    pub error_template: Option<String>,
    pub fingerprint_ignore: Option<Vec<String>>,
    pub query_order: Option<QueryOrder>,
    pub path_params: Option<PathParams>,
    pub format_suffixes: Option<Vec<String>>,
    pub key_headers: Option<Vec<String>>,
    pub release_on_status: Option<Vec<u16>>,
    pub record_control_header: Option<String>,
    pub key_json_pointer: Option<String>,
    pub short_retention_statuses: Option<Vec<u16>>,
    #[serde(default, with = "humantime_serde")]
    pub short_retention: Option<Duration>,
    pub method_override_headers: Option<Vec<String>>,
    pub method_override_params: Option<Vec<OverrideParam>>,
    pub method_case: Option<MethodCase>,
}

/// The default of [`Config::upstream_idle_timeout`]: half of the shortest keep-alive
/// timeout common servers use (1 s), so that upstreams closing idle connections after 1 s,
/// 2 s (gunicorn) or 5 s (Node, uvicorn, Apache) never close one that idemgate is about to
/// reuse, with half a second to spare for a loaded machine. Below 1 s, set it.
pub const UPSTREAM_IDLE_TIMEOUT: Duration = Duration::from_millis(500);

impl Config {
    /// What one client connection's replays may hold of `max_buffered_bytes`.
    pub fn buffered_share_per_connection(&self) -> usize {
        self.max_buffered_bytes_per_connection
            .unwrap_or(self.max_buffered_bytes / 4)
            .max(1)
    }

    /// What one tenant's replays and answers may hold of `max_buffered_bytes`.
    pub fn buffered_share_per_tenant(&self) -> usize {
        self.max_buffered_bytes_per_tenant
            .unwrap_or(self.max_buffered_bytes / 4)
            .max(1)
    }

    /// Pass-through requests one client connection may have at once.
    pub fn pass_through_per_connection(&self) -> usize {
        self.max_pass_through_per_connection
            .unwrap_or(self.pass_through_share() / 4)
            .max(1)
    }

    /// Pass-through requests one tenant may have at once, over all its connections.
    pub fn pass_through_per_tenant(&self) -> usize {
        self.max_pass_through_per_tenant
            .unwrap_or(self.pass_through_share() / 4)
            .max(1)
    }

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

/// A [`ConfigError::Invalid`] for `key`.
pub(crate) fn invalid(key: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        reason: reason.into(),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use figment::providers::{Format, Serialized, Toml};
    use figment::Figment;

    use super::*;

    /// The settings that `toml` over the defaults makes.
    pub fn settings(toml: &str) -> Result<Settings, ConfigError> {
        Config::load(
            Figment::from(Serialized::defaults(Config::default())).merge(Toml::string(toml)),
        )
    }
}
