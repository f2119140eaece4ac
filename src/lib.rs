//! idemgate: a reverse proxy that gives any upstream HTTP idempotency through the
//! `Idempotency-Key` header, so a client that lost a response can retry a payment safely.
//!
//! # Layout
//!
//! - [`config`]: configuration as data: the schema and defaults, the layered sources
//!   (defaults < TOML < env < flags) read with every problem of their keys named at once,
//!   validation into plain [`config::Settings`] and
//!   per-route [`config::Policy`], and `config check`'s redacted output. It imports no
//!   runtime module; the runtime modules import it.
//! - [`limits`], [`outcome`]: what both the configuration and the request path need (the
//!   head room of a recorded answer, the admin body limit; a request's outcome), below
//!   both.
//! - [`wiring`]: where the process is wired: the runtime objects the settings describe
//!   (the TLS listener and the upstream's TLS client, the Redis and PostgreSQL setups,
//!   the envelope of records at rest) are built here, their errors naming keys as
//!   configuration errors do.
//! - [`key`]: parsing the `Idempotency-Key` header; the [`key::RecordId`] type.
//! - [`scope`]: who owns a record: the normalized path, the tenant (headers or a verified
//!   JWT claim), the namespace, and the keyed hash that makes them a record id.
//! - [`fingerprint`]: what makes two requests "the same": canonical JSON, forms, raw bytes.
//! - [`store`]: the [`store::Store`] trait and one backend each: `memory/` (shards, their
//!   records and expiry, the calls), `redis/` (scripts, the calls, large bodies in
//!   pieces, replica acknowledgement, the secret's cluster copies, replies; `setup`
//!   validates how Redis is reached, `link` holds the connection for each topology,
//!   `renewing` gives one up and makes it anew), `sqlite/` (the claim, the calls),
//!   `postgres/` (the statements in `sql`; `conninfo`, the connection string; `tls`, its
//!   `sslmode`s), sharing `row`, a record's columns as operators see them; `open` says
//!   which backend the settings choose ([`store::StoreKind`]) and opens it;
//!   [`store::Layer`], a wrapper that states only the calls it changes (sealing at rest in
//!   `store::seal`, the metrics' timing, the lab's tracking). A store may read the
//!   configuration's plain values, never the other way round.
//! - [`admission`]: the slots of `max_in_flight` and of pass-through, the queue in front of
//!   them, and the budget of bodies held for slow clients.
//! - [`proxy`]: the hyper service. A request is first decided as a value, without I/O
//!   (pass through, refuse, or protect as which operation); a protected one goes through
//!   one body stage (body, identity, claim) that ends in a verdict, which is enforced
//!   (forward → record, replay, or answer why not) or observed (forwarded as sent, counted
//!   as what enforcing would do). Every answer idemgate makes itself is made in one place
//!   (`proxy/rescue.rs`).
//! - [`answer`]: reading an upstream's answer up to `max_response_bytes`, streaming the
//!   rest.
//! - [`reload`]: hot reload of the configuration (`SIGHUP`, `POST /config/reload`):
//!   checked as `config check` checks it, applied whole or refused naming what needs a
//!   restart.
//! - [`releases`]: claims never forwarded that this instance is still taking back.
//! - [`late_writes`]: records whose write failed and that this instance is still writing.
//! - [`secret`]: one store, one scope secret: start-up's, restoring a lost one, refusing on
//!   disagreement.
//! - [`request_id`]: `X-Request-Id`, kept or made up, passed on and logged.
//! - [`retry_after`]: the `Retry-After` of a 409 in-progress, from the lease and the
//!   route's typical upstream time.
//! - [`upstream`]: the client to the upstream, header rewriting, failure classification.
//! - [`problem`]: idemgate's own answers: the problem types, their statuses and retry hints
//!   (one table behind `x-should-retry`), and the error formats (RFC 9457, Stripe's, a
//!   template with `error_codes`).
//! - [`admin`]: health, readiness, `/metrics` and record inspection/release.
//! - [`operator`]: the admin listener's record resolution: listing by state, finding a
//!   request's record, completing an `unknown` one with the outcome an operator found.
//! - [`metrics`]: the Prometheus registry, observe mode's counts, the timing store wrapper
//!   and the Redis `INFO` watcher.
//! - [`probe`]: `idemgate probe URL`, the container health check.
//! - [`connection`]: what one client connection may hold: head and idle deadlines from
//!   accept on, and the cap on open connections.
//! - [`listener`]: the listening sockets and their accept queue.
//! - [`server`]: start-up and shutdown: `build` opens the store with its checks, binds the
//!   listeners and builds the app (the proxy, the admin API, their metrics and the tasks
//!   beside them); `serve` runs the accept loops (`accept`, one listener's; `handshake`,
//!   the TLS listener's; `threads`, the serving threads besides the first); `drain`, the
//!   graceful shutdown within one grace.
//! - [`telemetry`]: OpenTelemetry spans for protected requests (`otlp_endpoint`).
//! - [`tls`]: TLS to an `https://` upstream, and the TLS listener with its certificate
//!   reloaded on change.
//! - [`body`]: the body type shared by all of the above.
//! - [`cli`]: the binary's subcommands, one module each (`serve`, the proxy; `config`,
//!   `records`, `probe`, `bank`, `lab`); `main.rs` parses the command line and calls one.
//! - [`lab`]: beside the product, not in its request path: a deliberately non-idempotent
//!   bank, a day of retrying traffic and an auditor (`idemgate bank`, `idemgate lab`).
//!
//! Imports run one way: `server` and `wiring` at the top import the runtime modules
//! (`proxy`, `admin`, `store`, `tls`, `upstream`, `metrics`), which import `config`, which
//! imports only the value types below it (`scope`, `fingerprint`, `key`, `limits`,
//! `retry_after`). `tests/layout.rs` fails on any circle between top-level modules.

pub mod admin;
pub mod admin_access;
pub mod admission;
pub mod answer;
pub mod body;
pub mod cli;
pub mod config;
pub mod connection;
pub mod fingerprint;
pub mod key;
pub mod lab;
pub mod late_writes;
pub mod limits;
pub mod listener;
pub mod metrics;
pub mod operator;
pub mod outcome;
pub mod probe;
pub mod problem;
pub mod proxy;
pub mod releases;
pub mod reload;
pub mod request_id;
pub mod retry_after;
pub mod scope;
pub mod secret;
pub mod server;
pub mod starting;
pub mod store;
pub mod telemetry;
pub mod tls;
pub mod upstream;
pub mod wiring;

pub use config::Config;
pub use server::{run, start, Error, Running};
