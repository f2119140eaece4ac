//! idemgate: a reverse proxy that gives any upstream HTTP idempotency through the
//! `Idempotency-Key` header, so a client that lost a response can retry a payment safely.
//!
//! # Layout
//!
//! - [`config`]: the layered configuration (defaults < TOML < env < flags) and its
//!   validation into per-route [`config::Policy`].
//! - [`key`]: parsing the `Idempotency-Key` header; the [`key::RecordId`] type.
//! - [`scope`]: who owns a record: the normalized path, the tenant (headers or a verified
//!   JWT claim), the namespace, and the keyed hash that makes them a record id.
//! - [`fingerprint`]: what makes two requests "the same": canonical JSON, forms, raw bytes.
//! - [`store`]: the [`store::Store`] trait, the embedded [`store::MemoryStore`] and
//!   [`store::RedisStore`]; `store::redis_setup` validates how Redis is reached (one
//!   server, Sentinel, Cluster, TLS, ACL user, replica acknowledgement) and
//!   `store::redis_link` holds the connection for each topology.
//! - [`admission`]: the slots of `max_in_flight` and of pass-through, the queue in front of
//!   them, and the budget of bodies held for slow clients.
//! - [`proxy`]: the hyper service. A request is first decided as a value, without I/O
//!   (pass through, refuse, or protect as which operation), then enforced (claim → forward →
//!   record → replay) or observed (forwarded as sent, counted as what enforcing would do).
//! - [`answer`]: reading an upstream's answer up to `max_response_bytes`, streaming the
//!   rest.
//! - [`releases`]: claims never forwarded that this instance is still taking back.
//! - [`secret`]: one store, one scope secret: start-up's, restoring a lost one, refusing on
//!   disagreement.
//! - [`request_id`]: `X-Request-Id`, kept or made up, passed on and logged.
//! - [`retry_after`]: the `Retry-After` of a 409 in-progress, from the lease and the
//!   route's typical upstream time.
//! - [`upstream`]: the client to the upstream, header rewriting, failure classification.
//! - [`problem`]: idemgate's own `application/problem+json` responses.
//! - [`admin`]: health, readiness, `/metrics` and record inspection/release.
//! - [`operator`]: the admin listener's record resolution: listing by state, finding a
//!   request's record, completing an `unknown` one with the outcome an operator found.
//! - [`metrics`]: the Prometheus registry, the timing store wrapper and the Redis `INFO`
//!   watcher.
//! - [`probe`]: `idemgate probe URL`, the container health check.
//! - [`connection`]: what one client connection may hold: head and idle deadlines from
//!   accept on, and the cap on open connections.
//! - [`server`]: start-up checks, accept loops and graceful shutdown.
//! - [`telemetry`]: OpenTelemetry spans for protected requests (`otlp_endpoint`).
//! - [`tls`]: TLS to an `https://` upstream, and the TLS listener with its certificate
//!   reloaded on change.
//! - [`body`]: the body type shared by all of the above.
//! - [`lab`]: beside the product, not in its request path: a deliberately non-idempotent
//!   bank, a day of retrying traffic and an auditor (`idemgate bank`, `idemgate lab`).

pub mod admin;
pub mod admission;
pub mod answer;
pub mod body;
pub mod config;
pub mod connection;
pub mod fingerprint;
pub mod key;
pub mod lab;
pub mod limits;
pub mod metrics;
pub mod operator;
pub mod outcome;
pub mod probe;
pub mod problem;
pub mod proxy;
pub mod records_cli;
pub mod releases;
pub mod request_id;
pub mod retry_after;
pub mod scope;
pub mod secret;
pub mod server;
pub mod store;
pub mod telemetry;
pub mod tls;
pub mod upstream;

pub use config::Config;
pub use server::{run, start, Error, Running};
