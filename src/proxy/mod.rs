//! The hyper service and the request flow (`docs/requests.md`; what a client gets when
//! something fails: `docs/guarantees.md`):
//!
//! ```text
//! parse key -> buffer body (limit) -> fingerprint -> claim (1 store round trip)
//!   claimed            -> forward -> record (1 round trip, owner-checked) -> respond
//!   same fp, completed -> replay + `Idempotent-Replayed: true`
//!   same fp, in flight -> 409 + Retry-After
//!   other fp           -> 422
//! ```
//!
//! A route with `record_mode = "after_response"` answers before the record and writes it
//! meanwhile, in a task of its own.
//!
//! Unprotected requests are streamed through untouched. A claimed request's upstream
//! exchange runs in its own task, so it completes and is recorded even when the client that
//! sent it has gone: that client is the one the product exists for.
//!
//! # Layout
//!
//! A request is decided first; a protected one then goes through one body stage that ends
//! in a verdict, which the route's mode acts on, enforcing or observing:
//!
//! - `mod.rs`: the service ([`Proxy`]), what it shares across connections, `respond` (decide,
//!   then hand the decision to the route's mode), pass-through forwarding and the log line.
//! - `decision.rs`: what a request *is*, without I/O: pass through, refuse (for which
//!   reason), or protect (tenant, method, normalized path, key); the body step's rules
//!   (declared length, fingerprint inputs). Every rule about routes, methods, overrides,
//!   paths, tenants and keys is there, and the mode is read there only.
//! - `pipeline.rs`: the body stage, once for both modes: admission, body read, slot,
//!   identity, scope secret, claim; it ends in a verdict (forward the won claim, or stop
//!   for a reason). The modes differ only in the guard it runs under (the shares of the
//!   buffer budget, or observe mode's store breaker).
//! - `rescue.rs`: every answer idemgate makes itself, from its reason: problem type,
//!   detail, record id, `Retry-After`, outcome label and observe mode's `would` label; what
//!   enforcing does with each claim result.
//! - `enforce.rs`: acting on a decision and a verdict: forward, replay, or answer why not.
//! - `observe.rs`: forwarding as sent and counting what the verdict says enforcing would
//!   have done; duplicates let through, the store breaker and the log rate limit of
//!   observe mode.
//! - `body_read.rs`: reading a protected body within its size, time and memory budget.
//! - `claim.rs`: fingerprint and record id from the body, the claim and its take-back
//!   guard, background releases of claims never forwarded.
//! - `late.rs`: record writes whose first try failed, tried again until they land.
//! - `exchange.rs`: a claimed request's upstream exchange in its own task, settled when
//!   it is told (the record before the answer, after it, with or without the breaker).
//! - `recording.rs`: the record of that exchange: the answer as its record keeps it, the
//!   lease renewed while the upstream works, and the record completed, released or left
//!   unknown.
//! - `allowance.rs`: what one protected request holds of the buffer budget and of its
//!   connection's and tenant's shares while its answer waits for its client.
//! - `replay.rs`: a recorded answer sent again.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hyper::body::Incoming;
use hyper::header::HeaderValue;
use hyper::{Request, Response};
use tokio_util::task::TaskTracker;
use tracing::Span;

mod allowance;
mod body_read;
mod claim;
mod decision;
mod enforce;
mod exchange;
mod late;
mod observe;
mod pipeline;
mod recording;
mod replay;
mod rescue;

use crate::admission::{Buffers, Refusal as NotAdmitted, Slots};
use crate::body::{self, Body};
use crate::config::UpstreamHttp2;
use crate::config::{Live, Mode, Policy, Settings};
use crate::key::RecordId;
use crate::late_writes::LateWrites;
use crate::metrics::Metrics;
pub use crate::outcome::Outcome;
use crate::releases::Releases;
use crate::request_id::{self, X_REQUEST_ID};
use crate::scope::client_cert::ClientCert;
use crate::scope::Scoper;
use crate::secret::SecretHealth;
use crate::store::Store;
use crate::telemetry;
use crate::tls::UpstreamTls;
use crate::upstream::{self, Failure, Link};
use decision::{Action, Pass, Refusal};
use observe::{Breaker, RateLimit};
use rescue::{Reason, Unanswered};

/// Header added to every replayed response.
pub const REPLAYED: &str = "idempotent-replayed";

/// The proxy service. Cheap to clone: one per connection.
#[derive(Clone)]
pub struct Proxy {
    shared: Arc<Shared>,
}

struct Shared {
    // The settings as at start-up. Only their top-level values are read from here (the
    // store's timeout, the upstream, body and buffer limits), which a reload never changes;
    // what a reload may change (routes, their modes, timeouts and limits) is read from the
    // snapshot of `live` that each request takes as it starts.
    settings: Arc<Settings>,
    // The settings in force: swapped whole by a configuration reload.
    live: Arc<Live>,
    // How the clients below talk TLS to an `https://` upstream (built at start-up).
    upstream_tls: Option<UpstreamTls>,
    store: Arc<dyn Store>,
    // Record ids: this store's secret and this instance's namespace.
    scoper: Scoper,
    // Pass-through requests: pooled connections.
    client: Link,
    // Protected requests: a fresh connection each, so none is written onto a connection the
    // upstream may be closing (see `upstream::fresh_client`); streams on the pooled h2
    // connections of `client` to an upstream known to be h2 (see `upstream::h2_client`).
    fresh: Link,
    // Upstream exchanges that outlive their client connection, and records written after
    // their client's answer (`record_mode = "after_response"`); shutdown waits for them.
    tasks: TaskTracker,
    // Outcomes and latencies; shared with the admin listener's /metrics.
    metrics: Arc<Metrics>,
    // One slot per protected request from its complete body to the end of its exchange (a
    // detached exchange included): `max_in_flight` bounds the bodies and answers held at
    // once, and the upstream connections protected requests open. Per instance.
    protected: Arc<Slots>,
    // Pass-through requests' own share of `max_upstream_connections`, held until the
    // answer's body is done.
    passing: Arc<Slots>,
    // Bodies being buffered or written (`max_buffered_bytes`).
    buffers: Arc<Buffers>,
    // What each tenant holds now: of the buffer budget (`max_buffered_bytes_per_tenant`)
    // and of the pass-through slots (`max_pass_through_per_tenant`).
    tenants: Arc<crate::connection::Tenants>,
    // Since when the store has failed claims (the `Retry-After` of their 503s).
    store_outage: Arc<crate::admission::Spell>,
    // Observe mode: a store that just failed is not waited on again for a moment, and
    // would-be refusals are logged at a bounded rate.
    store_failing: Arc<Breaker>,
    observe_log: Arc<RateLimit>,
    // Claims never forwarded whose release has not landed yet; one set per instance.
    releases: Arc<Releases>,
    // Record writes that failed and are being tried again; one set per instance.
    late: Arc<LateWrites>,
    // Off once this instance's scope secret disagrees with the store's: its record ids
    // would be another fleet's, so protected requests are refused.
    secret: Arc<SecretHealth>,
}

/// A serving thread's links to the upstream: pass-through's and protected requests'.
fn links(settings: &Settings, tls: Option<&UpstreamTls>) -> (Link, Link) {
    let c = &settings.config;
    Link::pair(
        &settings.upstream,
        tls,
        c.upstream_http2 == UpstreamHttp2::PriorKnowledge,
        c.upstream_idle_timeout,
        idle_per_thread(c),
    )
}

/// How long the upstream took, carried on a response from where it is measured to the
/// request's log line.
#[derive(Clone, Copy)]
struct UpstreamLatency(Duration);

/// A request as it arrived, with what its handling carries beside it.
struct Arrived {
    req: Request<Incoming>,
    peer: SocketAddr,
    request_id: HeaderValue,
    started: Instant,
}

impl Proxy {
    /// Builds the service over a store, counting into `metrics`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        live: Arc<Live>,
        upstream_tls: Option<UpstreamTls>,
        store: Arc<dyn Store>,
        scoper: Scoper,
        tasks: TaskTracker,
        metrics: Arc<Metrics>,
        (releases, late): (Arc<Releases>, Arc<LateWrites>),
        secret: Arc<SecretHealth>,
    ) -> Proxy {
        let settings = live.get();
        metrics.routes(&settings.modes());
        let c = &settings.config;
        let protected = Arc::new(Slots::new(
            c.max_in_flight,
            c.max_queued,
            c.queue_timeout,
            metrics.slot_gauges("protected"),
        ));
        let passing = Arc::new(Slots::new(
            c.pass_through_share(),
            c.max_queued,
            c.queue_timeout,
            metrics.slot_gauges("pass_through"),
        ));
        let buffers = Arc::new(Buffers::new(
            c.max_buffered_bytes,
            metrics.refused("protected", NotAdmitted::BuffersFull),
            metrics.buffered_bytes(),
        ));
        let (client, fresh) = links(&settings, upstream_tls.as_ref());
        Proxy {
            shared: Arc::new(Shared {
                protected,
                passing,
                buffers,
                tenants: Arc::default(),
                store_outage: Arc::default(),
                store_failing: Arc::default(),
                observe_log: Arc::default(),
                settings,
                live,
                upstream_tls,
                store,
                scoper,
                fresh,
                client,
                tasks,
                metrics,
                releases,
                late,
                secret,
            }),
        }
    }

    /// The proxy of another serving thread: its own store handle and its own upstream
    /// connection pool, so that none of its calls crosses threads; the settings, record
    /// ids, tracked exchanges, metrics, slots and buffer budget are this one's.
    pub fn sibling(&self, store: Arc<dyn Store>) -> Proxy {
        let s = &self.shared;
        let (client, fresh) = links(&s.settings, s.upstream_tls.as_ref());
        Proxy {
            shared: Arc::new(Shared {
                protected: s.protected.clone(),
                passing: s.passing.clone(),
                buffers: s.buffers.clone(),
                tenants: s.tenants.clone(),
                store_outage: s.store_outage.clone(),
                store_failing: s.store_failing.clone(),
                observe_log: s.observe_log.clone(),
                settings: s.settings.clone(),
                live: s.live.clone(),
                upstream_tls: s.upstream_tls.clone(),
                store,
                scoper: s.scoper.clone(),
                client,
                fresh,
                tasks: s.tasks.clone(),
                metrics: s.metrics.clone(),
                releases: s.releases.clone(),
                late: s.late.clone(),
                secret: s.secret.clone(),
            }),
        }
    }

    /// Handles one request. Never fails: every error becomes a response here. The
    /// request's `X-Request-Id` (its own, or a fresh one) goes upstream with it and comes
    /// back on every answer, replays and idemgate's own included.
    ///
    /// A panic while handling it is caught here (hyper would otherwise drop the connection
    /// without an answer): counted (`idemgate_panics_total`), logged with the request id,
    /// and answered 500 `internal-error`. A claim taken by then follows the failure rules
    /// of the step that panicked: one not yet forwarded is taken back by its guard as the
    /// panic unwinds, one whose exchange ran reads as in progress, then unknown.
    pub async fn handle(&self, mut req: Request<Incoming>, peer: SocketAddr) -> Response<Body> {
        use futures_util::FutureExt;
        let request_id = request_id::ensure(req.headers_mut());
        let respond = std::panic::AssertUnwindSafe(self.respond(req, peer, request_id.clone()));
        let mut res = match respond.catch_unwind().await {
            Ok(res) => res,
            Err(panic) => {
                self.panicked(&request_id, &*panic);
                Reason::Panicked.answer()
            }
        };
        res.headers_mut().insert(X_REQUEST_ID, request_id);
        res
    }

    /// Counts and logs a panic of the request `request_id` (its message, never a body).
    fn panicked(&self, request_id: &HeaderValue, panic: &(dyn std::any::Any + Send)) {
        self.shared.metrics.panicked();
        let message = panic
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
            .unwrap_or("(no message)");
        tracing::error!(
            request_id = request_id.to_str().unwrap_or("-"),
            panic = message,
            "handling a request panicked; answered 500 internal-error"
        );
    }

    async fn respond(
        &self,
        req: Request<Incoming>,
        peer: SocketAddr,
        request_id: HeaderValue,
    ) -> Response<Body> {
        let started = Instant::now();
        test_panic("respond", req.headers());
        // This request's settings, to its end: a reload meanwhile applies to the next ones.
        let settings = self.shared.live.get();
        // A tunnel is not a request idemgate can decide on, and its 2xx would leave the
        // client's connection to bytes no one frames: refused, never forwarded.
        if req.method() == hyper::Method::CONNECT {
            tracing::info!(
                request_id = request_id.to_str().unwrap_or("-"),
                "CONNECT refused: idemgate forwards no tunnels"
            );
            let res = Reason::Tunnel.answer();
            return crate::problem::in_dialect(res, &settings.default_policy.error_format);
        }
        let (method, uri, headers) = (req.method(), req.uri(), req.headers());
        let decision = decision::decide(&settings, method, uri, headers, peer_cert(&req));
        // Said in either mode: both see the same request.
        match &decision.action {
            Action::PassThrough(Pass::KeyIgnored) => tracing::warn!(
                method = %decision.method,
                route = decision.policy.route.as_deref().unwrap_or("default"),
                "a request with an Idempotency-Key on a method this route does not protect was forwarded unprotected (methods are case-sensitive)"
            ),
            Action::Refuse(Refusal::InvalidToken(e)) => {
                tracing::info!(error = %e, "bearer token refused")
            }
            _ => {}
        }
        let arrived = Arrived {
            req,
            peer,
            request_id,
            started,
        };
        // idemgate's own answers in the route's dialect (`error_format`): its clients' SDKs
        // read them as the errors they are. The upstream's answers and replays pass as
        // they are. Routes on the default format keep nothing for it.
        let dialect = (decision.policy.error_format != crate::problem::ErrorFormat::Problem)
            .then(|| Arc::clone(decision.policy));
        let res = match decision.mode {
            Mode::Enforce => self.enforce(arrived, decision).await,
            Mode::Observe => self.observe(arrived, decision).await,
        };
        match dialect {
            Some(policy) => crate::problem::in_dialect(res, &policy.error_format),
            None => res,
        }
    }

    /// The 503 of a request not admitted: nothing was buffered beyond what the refusal
    /// needed, nothing claimed.
    fn overloaded(&self, why: NotAdmitted, slots: &Slots) -> Response<Body> {
        if why == NotAdmitted::ClientGone {
            tracing::info!("a queued request's client closed its connection; it left the queue, nothing was done");
        }
        if why != NotAdmitted::BuffersFull {
            let class = if std::ptr::eq(slots, &*self.shared.passing) {
                "pass_through"
            } else {
                "protected"
            };
            self.shared.metrics.refused(class, why).inc();
        }
        let wait = match why {
            NotAdmitted::BuffersFull | NotAdmitted::ShareFull => self.shared.buffers.retry_after(),
            _ => slots.retry_after(),
        };
        Reason::Overloaded { why, wait }.answer()
    }

    /// Forwards a request as is, streaming both bodies, under `policy`'s upstream timeout.
    async fn pass_through(
        &self,
        mut req: Request<Body>,
        peer: SocketAddr,
        policy: &Policy,
    ) -> Response<Body> {
        let timeout = policy.upstream_timeout;
        // One connection, and one tenant over all its connections, holds at most its share
        // of the pass-through slots: answers whose bodies its client never pulls cannot
        // hold every other client's reads. Both waits come out of one `queue_timeout`.
        let config = &self.shared.settings.config;
        let until = tokio::time::Instant::now() + config.queue_timeout;
        let passing = req
            .extensions()
            .get::<crate::connection::OfConnection>()
            .map(|c| &c.passing);
        let on_connection = match passing {
            Some(p) => match p
                .take(config.pass_through_per_connection(), config.queue_timeout)
                .await
            {
                Some(held) => Some(held),
                None => return self.overloaded(NotAdmitted::ShareFull, &self.shared.passing),
            },
            None => None,
        };
        let tenant =
            crate::scope::tenant::unverified(req.headers(), peer_cert(&req), &policy.tenant);
        let of_tenant = match tenant {
            Some(t) => {
                let share = config.pass_through_per_tenant();
                let slots = self.shared.tenants.passing(t.as_bytes(), share);
                let left = until.saturating_duration_since(tokio::time::Instant::now());
                match crate::connection::take_slot(slots, left).await {
                    Some(held) => Some(held),
                    None => return self.overloaded(NotAdmitted::ShareFull, &self.shared.passing),
                }
            }
            None => None,
        };
        // Its own share of the upstream connections, held until the answer's body is done:
        // pass-through traffic cannot take what protected requests need, nor the other way.
        let slot = match admit(&self.shared.passing, req.extensions()).await {
            Ok(slot) => slot,
            Err(why) => return self.overloaded(why, &self.shared.passing),
        };
        upstream::prepare(&mut req, &self.shared.settings.upstream, peer);
        let sent = Instant::now();
        let answer = tokio::time::timeout(timeout, self.shared.client.request(req)).await;
        let latency = UpstreamLatency(sent.elapsed());
        self.shared.metrics.upstream(latency.0);
        match answer {
            Ok(Ok(res)) => {
                let (mut parts, body) = res.into_parts();
                // No upgrade is ever forwarded: an interim status as the final answer would
                // leave the client's connection between two protocols.
                if upstream::framing::not_an_answer(parts.status) {
                    return Reason::Upstream(Unanswered::Interim).answer();
                }
                // The body streams on under hyper's framing: a length that the body does
                // not reach ends in a body error, which closes the client's connection
                // (HTTP/1.1) or resets its stream (h2), never a short answer.
                upstream::framing::reframe(&mut parts.headers);
                upstream::strip_hop_by_hop(&mut parts.headers);
                // Read by the log line only (`info` and `debug`, this module's target): a
                // response's first extension allocates its map.
                if tracing::enabled!(tracing::Level::INFO) {
                    parts.extensions.insert(latency);
                }
                let held = (slot, on_connection, of_tenant);
                Response::from_parts(parts, body::holding(body::boxed(body), held))
            }
            Ok(Err(e)) => {
                let how = match upstream::classify(&e) {
                    Failure::NotSent => {
                        tracing::warn!(error = %upstream::describe(&e), "upstream unreachable");
                        Unanswered::NotSent
                    }
                    Failure::Ambiguous if upstream::framing::broken_head(&e) => {
                        Unanswered::BrokenHead
                    }
                    Failure::Ambiguous => Unanswered::Closed,
                };
                Reason::Upstream(how).answer()
            }
            Err(_) => Reason::Upstream(Unanswered::Timeout).answer(),
        }
    }
}

/// A slot of `slots` for a request whose extensions are `ext`: an HTTP/1.1 request leaves
/// the queue when its client hangs up (see [`Hangup`](crate::connection::Hangup)).
async fn admit(
    slots: &Arc<Slots>,
    ext: &hyper::http::Extensions,
) -> Result<crate::admission::Slot, NotAdmitted> {
    let hangup = ext
        .get::<crate::connection::OfConnection>()
        .and_then(|c| c.hangup.clone());
    match hangup {
        Some(hangup) => slots.admit_unless(async move { hangup.gone().await }).await,
        None => slots.admit().await,
    }
}

/// What a request's log line says about the request itself.
struct Line<'a> {
    method: &'a hyper::Method,
    policy: &'a Policy,
    request_id: &'a HeaderValue,
    span: &'a Span,
    started: Instant,
}

/// Counts a finished request and writes its log line: `info` for protected requests,
/// `debug` for pass-through ones (they are counted all the same). Never a body, a key's raw
/// value or a credential: the record id and the request id name the request.
fn log_request(
    metrics: &Metrics,
    res: &Response<Body>,
    outcome: Outcome,
    id: Option<RecordId>,
    line: &Line<'_>,
) {
    let Line {
        method,
        policy,
        request_id,
        span,
        started,
    } = *line;
    let elapsed = started.elapsed();
    let route = policy.route.as_deref().unwrap_or("default");
    metrics.request(policy.index, route, outcome, elapsed);
    if !span.is_none() {
        let record = id.map(|r| r.to_string());
        let status = res.status().as_u16();
        telemetry::finish(span, outcome.as_str(), record.as_deref(), status);
    }
    let level_enabled = if outcome == Outcome::Passthrough {
        tracing::enabled!(tracing::Level::DEBUG)
    } else {
        tracing::enabled!(tracing::Level::INFO)
    };
    if !level_enabled {
        return;
    }
    let upstream_ms = res
        .extensions()
        .get::<UpstreamLatency>()
        .map(|l| millis(l.0));
    let record = id.map(|r| r.to_string());
    macro_rules! line {
        ($level:ident) => {
            tracing::$level!(
                outcome = outcome.as_str(),
                record = record.as_deref().unwrap_or("-"),
                request_id = request_id::as_str(request_id),
                method = %method,
                route = policy.route.as_deref().unwrap_or("default"),
                status = res.status().as_u16(),
                upstream_ms,
                latency_ms = millis(elapsed),
                "request"
            )
        };
    }
    if outcome == Outcome::Passthrough {
        line!(debug);
    } else {
        line!(info);
    }
}

/// Milliseconds with microsecond precision (`3.824`): what a log line needs, without the
/// binary fraction's noise (`3.8241400000000003`).
fn millis(d: Duration) -> f64 {
    d.as_micros() as f64 / 1000.0
}

/// Idle pass-through connections one serving thread's pool may keep. Each thread has a pool
/// of its own while the pass-through slots are the instance's: with the whole share per
/// pool, four threads kept up to four times `max_upstream_connections - max_in_flight`
/// idle. A thread's part of the share keeps the idle connections of all threads within
/// the share. Connections in use are bounded by the slots; one thread's idle connections
/// may sit beside another thread's in use, which a pool per thread cannot see.
fn idle_per_thread(c: &crate::config::Config) -> usize {
    (c.pass_through_share() / c.worker_threads.max(1)).max(1)
}

/// The verified client certificate of the request's TLS connection, when the listener
/// reads certificates for a `tenant_client_cert` route.
fn peer_cert<B>(req: &Request<B>) -> Option<&ClientCert> {
    req.extensions().get::<Arc<ClientCert>>().map(|c| &**c)
}

/// Builds with debug assertions only (the test builds): with `TEST_IDEMGATE_PANIC` set to
/// `step`, a request that carries an `x-idemgate-test-panic` header panics at that step
/// (`respond`: before its decision; `exchange`: in its upstream exchange's task), so that
/// tests through the binary see what a panic becomes. A release build has no such hook.
#[cfg(debug_assertions)]
fn test_panic(step: &str, headers: &hyper::HeaderMap) {
    if headers.contains_key("x-idemgate-test-panic")
        && std::env::var("TEST_IDEMGATE_PANIC").is_ok_and(|v| v == step)
    {
        panic!("test panic at {step}");
    }
}

#[cfg(not(debug_assertions))]
fn test_panic(_step: &str, _headers: &hyper::HeaderMap) {}
