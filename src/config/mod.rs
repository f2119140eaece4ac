//! Configuration as data: built-in defaults < TOML file < `IDEMGATE_` environment <
//! command-line flags, merged with figment, then validated into the plain [`Settings`] that
//! the proxy and the stores take. Every error names the key at fault.
//!
//! # Layout
//!
//! - `mod.rs`: the schema's top level ([`Config`] and its enums) and [`ConfigError`].
//! - `route_keys`: the keys of `[defaults]` and `[[routes]]` ([`Defaults`], [`Route`]) and
//!   the enums of their values.
//! - `defaults`: the built-in defaults, and `idemgate config defaults`.
//! - `operators`: `[[admin_operators]]` and `admin_hosts`.
//! - `load`: the layered sources (figment) and the environment names that are no setting.
//! - `extract`: the sources read into [`Config`], every problem of their keys at once, each
//!   named with its key and its source.
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

use load::describe;

mod at_rest;
mod defaults;
mod extract;
mod framework;
mod live;
mod load;
mod operators;
mod policy;
mod redact;
mod route;
mod route_keys;
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
pub use route_keys::{
    Anonymous, Defaults, ErrorFormatName, MethodCase, Mode, OnAmbiguous, OnStoreError,
    OverrideParam, PathMatch, PathParams, RecordMode, Route,
};
pub use validate::{Settings, Upstream};

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

/// `postgres_synchronous_commit`: when a commit of idemgate's sessions returns. Each is
/// PostgreSQL's own value of the name; `off`, which returns before the commit is on disk
/// (a server crash loses the last claims, and their keys execute again), is not offered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PgSynchronousCommit {
    /// Flushed to the server's disk, and to the synchronous standbys' disks if any.
    #[default]
    On,
    /// Flushed locally; written (not flushed) by the synchronous standbys.
    RemoteWrite,
    /// Flushed locally, and applied by the synchronous standbys (visible on them).
    RemoteApply,
    /// Flushed to the server's disk only: synchronous standbys are not waited for.
    Local,
}

impl PgSynchronousCommit {
    /// The value as PostgreSQL spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            PgSynchronousCommit::On => "on",
            PgSynchronousCommit::RemoteWrite => "remote_write",
            PgSynchronousCommit::RemoteApply => "remote_apply",
            PgSynchronousCommit::Local => "local",
        }
    }
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
    /// `synchronous_commit` of idemgate's PostgreSQL sessions, whatever the server's or
    /// the database's default: see [`PgSynchronousCommit`].
    #[serde(default)]
    pub postgres_synchronous_commit: PgSynchronousCommit,
    /// Acknowledges that the PostgreSQL server has standbys it replicates to
    /// asynchronously (no `synchronous_standby_names`), which start-up otherwise warns
    /// about: a managed service that replicates below SQL, or a loss accepted.
    #[serde(default)]
    pub postgres_async_standbys_acknowledged: bool,
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
    /// A source could not be read or parsed (a file that is no TOML).
    #[error("{}", describe(.0))]
    Source(Box<figment::Error>),
    /// A source gave a key a value of the wrong type, or has a key that is no setting where
    /// it is written: `message` names the key and the source (the file, the environment
    /// variable).
    #[error("{message}")]
    Read {
        /// Dotted path of the key, e.g. `routes[0].lease`.
        key: String,
        /// What is wrong, where.
        message: String,
    },
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
