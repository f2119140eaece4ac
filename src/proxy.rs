//! The hyper service and the request flow of DESIGN.md:
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

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::header::{HeaderName, HeaderValue, CONTENT_ENCODING, CONTENT_LENGTH, DATE, SET_COOKIE};
use hyper::{Method, Request, Response, StatusCode};
use tokio_util::task::TaskTracker;
use tracing::Span;

mod decision;

use crate::admission::{Buffered, Buffers, Refusal as Refused, Slot, Slots};
use crate::answer::{self, Answer};
use crate::body::{self, Body};
use crate::config::{Mode, OnAmbiguous, OnStoreError, Policy, RecordMode, Settings};
use crate::fingerprint::{self, FINGERPRINT_VERSION};
use crate::key::RecordId;
use crate::limits::ANSWER_HEAD_ROOM;
use crate::metrics::Metrics;
pub use crate::outcome::Outcome;
use crate::problem::Problem;
use crate::releases::Releases;
use crate::request_id::{self, X_REQUEST_ID};
use crate::retry_after;
use crate::scope::client_cert::ClientCert;
use crate::scope::Scoper;
use crate::secret::SecretHealth;
use crate::store::{deadline, Claim, ClaimRequest, OwnerToken, Store, StoreError, StoredResponse};
use crate::telemetry::{self, Step};
use crate::upstream::{self, Failure, FreshClient, UpstreamClient};
use decision::{Action, Content, Decision, Operation, Pass, Refusal};

/// Header added to every replayed response.
pub const REPLAYED: &str = "idempotent-replayed";

/// The proxy service. Cheap to clone: one per connection.
#[derive(Clone)]
pub struct Proxy {
    shared: Arc<Shared>,
}

struct Shared {
    settings: Settings,
    store: Arc<dyn Store>,
    // Record ids: this store's secret and this instance's namespace.
    scoper: Scoper,
    // Pass-through requests: pooled connections.
    client: UpstreamClient,
    // Protected requests: a fresh connection each, so none is written onto a connection the
    // upstream may be closing (see `upstream::fresh_client`).
    fresh: FreshClient,
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
    // Observe mode: a store that just failed is not waited on again for a moment, and
    // would-be refusals are logged at a bounded rate.
    store_failing: Arc<Breaker>,
    observe_log: Arc<RateLimit>,
    // Claims never forwarded whose release has not landed yet; one set per instance.
    releases: Arc<Releases>,
    // Off once this instance's scope secret disagrees with the store's: its record ids
    // would be another fleet's, so protected requests are refused.
    secret: Arc<SecretHealth>,
}

/// How long the upstream took, carried on a response from where it is measured to the
/// request's log line.
#[derive(Clone, Copy)]
struct UpstreamLatency(Duration);

/// What a request's handling carries besides the request itself.
struct Head {
    peer: SocketAddr,
    request_id: HeaderValue,
    started: Instant,
}

/// A protected request's body step: its record id and fingerprint, and the decoded
/// content a claim under an older fingerprint version is compared over.
struct Identified {
    id: RecordId,
    fingerprint: fingerprint::Fingerprint,
    encoding: Option<String>,
    decoded: Option<Vec<u8>>,
}

impl Identified {
    fn content<'a>(&'a self, body: &'a [u8]) -> Content<'a> {
        Content {
            encoding: self.encoding.as_deref(),
            body,
            decoded: self.decoded.as_deref(),
        }
    }
}

/// A protected request that owns its claim, on its way upstream.
struct Claimed {
    id: RecordId,
    owner: OwnerToken,
    policy: Arc<Policy>,
    request: Request<Body>,
    // Held until the exchange and its record are done.
    slot: Slot,
    // The request's span (none with tracing off): parent of the upstream and record spans.
    span: Span,
}

impl Proxy {
    /// Builds the service over a store, counting into `metrics`.
    pub fn new(
        settings: Settings,
        store: Arc<dyn Store>,
        scoper: Scoper,
        tasks: TaskTracker,
        metrics: Arc<Metrics>,
        releases: Arc<Releases>,
        secret: Arc<SecretHealth>,
    ) -> Proxy {
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
            metrics.refused("protected", Refused::BuffersFull),
            metrics.buffered_bytes(),
        ));
        let client = upstream::client(
            &settings.upstream,
            upstream::CONNECT_TIMEOUT,
            c.upstream_idle_timeout,
            idle_per_thread(c),
        );
        let fresh = upstream::fresh_client(&settings.upstream, upstream::CONNECT_TIMEOUT);
        Proxy {
            shared: Arc::new(Shared {
                protected,
                passing,
                buffers,
                store_failing: Arc::default(),
                observe_log: Arc::default(),
                settings,
                store,
                scoper,
                fresh,
                client,
                tasks,
                metrics,
                releases,
                secret,
            }),
        }
    }

    /// The proxy of another serving thread: its own store handle and its own upstream
    /// connection pool, so that none of its calls crosses threads; the settings, record
    /// ids, tracked exchanges, metrics, slots and buffer budget are this one's.
    pub fn sibling(&self, store: Arc<dyn Store>) -> Proxy {
        let s = &self.shared;
        let client = upstream::client(
            &s.settings.upstream,
            upstream::CONNECT_TIMEOUT,
            s.settings.config.upstream_idle_timeout,
            idle_per_thread(&s.settings.config),
        );
        Proxy {
            shared: Arc::new(Shared {
                protected: s.protected.clone(),
                passing: s.passing.clone(),
                buffers: s.buffers.clone(),
                store_failing: s.store_failing.clone(),
                observe_log: s.observe_log.clone(),
                settings: s.settings.clone(),
                store,
                scoper: s.scoper.clone(),
                client,
                fresh: upstream::fresh_client(&s.settings.upstream, upstream::CONNECT_TIMEOUT),
                tasks: s.tasks.clone(),
                metrics: s.metrics.clone(),
                releases: s.releases.clone(),
                secret: s.secret.clone(),
            }),
        }
    }

    /// Handles one request. Never fails: every error becomes a response here. The
    /// request's `X-Request-Id` (its own, or a fresh one) goes upstream with it and comes
    /// back on every answer, replays and idemgate's own included.
    pub async fn handle(&self, mut req: Request<Incoming>, peer: SocketAddr) -> Response<Body> {
        let request_id = request_id::ensure(req.headers_mut());
        let mut res = self.respond(req, peer, request_id.clone()).await;
        res.headers_mut().insert(X_REQUEST_ID, request_id);
        res
    }

    async fn respond(
        &self,
        req: Request<Incoming>,
        peer: SocketAddr,
        request_id: HeaderValue,
    ) -> Response<Body> {
        let started = Instant::now();
        let settings = &self.shared.settings;
        let (method, uri, headers) = (req.method(), req.uri(), req.headers());
        let decision = decision::decide(settings, method, uri, headers, peer_cert(&req));
        // Said in either mode: both see the same request.
        match &decision.action {
            Action::PassThrough(Pass::KeyIgnored) => tracing::warn!(
                method = %decision.method,
                route = decision.policy.route.as_deref().unwrap_or("-"),
                "a request with an Idempotency-Key on a method this route does not protect was forwarded unprotected (methods are case-sensitive)"
            ),
            Action::Refuse(Refusal::InvalidToken(e)) => {
                tracing::info!(error = %e, "bearer token refused")
            }
            _ => {}
        }
        let head = Head {
            peer,
            request_id,
            started,
        };
        match decision.mode {
            Mode::Enforce => self.enforce(req, decision, head).await,
            Mode::Observe => self.observe(req, decision, head).await,
        }
    }

    /// Acts on a decision: forwards what passes through, answers a refusal, and takes a
    /// protected request through body, fingerprint, claim, forward and record (or replay).
    async fn enforce(
        &self,
        req: Request<Incoming>,
        decision: Decision<'_>,
        head: Head,
    ) -> Response<Body> {
        let Decision {
            policy,
            method,
            traced,
            action,
            ..
        } = decision;
        let Head {
            peer,
            request_id,
            started,
        } = head;
        let span = if traced {
            let id = request_id::as_str(&request_id);
            telemetry::request_span(req.headers(), &method, policy.route.as_deref(), id)
        } else {
            Span::none()
        };
        let line = Line {
            method: &method,
            policy,
            request_id: &request_id,
            span: &span,
            started,
        };
        let operation = match action {
            Action::PassThrough(pass) => {
                let timeout = policy.upstream_timeout;
                let res = self.pass_through(req.map(body::boxed), peer, timeout).await;
                log_request(&self.shared.metrics, &res, pass.outcome(), None, &line);
                return res;
            }
            Action::Refuse(refusal) => return self.refuse(&refusal, &line),
            Action::Protect(operation) => operation,
        };
        let (mut parts, incoming) = req.into_parts();
        if let Some(p) = &operation.forward_path {
            set_path(&mut parts.uri, p);
        }
        // Beyond the slots and a full queue, refused before the body is read: a refusal must
        // cost little, or the clients it sends away (and straight back) take the CPU the
        // admitted ones need.
        if self.shared.protected.would_refuse() {
            return self.refuse(&Refusal::Overloaded(Refused::QueueFull), &line);
        }
        // The body is read before a slot is taken, so that slow clients hold no slot: bodies
        // still arriving are bounded by `max_buffered_bytes` (counting what has arrived)
        // and `body_read_timeout`.
        let (body, buffered) = match self
            .read_body(&parts.headers, incoming, policy.max_body_bytes)
            .await
        {
            Ok(b) => b,
            Err(refusal) => return self.refuse(&refusal, &line),
        };
        // The slot is taken before the claim: once a key is claimed, nothing waits for a
        // slot or is refused for want of one.
        let slot = match self.shared.protected.admit().await {
            Ok(slot) => slot,
            Err(why) => return self.refuse(&Refusal::Overloaded(why), &line),
        };
        // Admitted: the body now counts against `max_in_flight`, not the arrival budget.
        drop(buffered);
        // The fingerprint is taken over a coded body's content; the upstream still gets the
        // body as sent.
        let identified = match self
            .identify(policy, &method, &operation, &parts, &body)
            .await
        {
            Ok(identified) => identified,
            Err(refusal) => return self.refuse(&refusal, &line),
        };
        // Checked at the last moment before the claim: a disagreement found while the body
        // was arriving still refuses this request.
        if !self.shared.secret.agreed() {
            return self.refuse(&Refusal::SecretDisagrees, &line);
        }
        let request = Request::from_parts(parts, body::full(body.clone()));
        let store_timeout = self.shared.settings.config.store_timeout;
        let mut claim = new_claim(identified.id, identified.fingerprint, policy, store_timeout);
        let content = identified.content(&body);
        let found = self
            .claim_guarded(
                &mut claim, &request, &method, &operation, content, policy, &span,
            )
            .await;
        drop(identified);
        let protected = Protected {
            claim,
            request,
            policy: policy.clone(),
            peer,
            method,
            request_id,
            span,
            started,
            slot,
            observed: false,
        };
        self.settle(found, protected).await
    }

    /// Enforcing's answer to a refusal, counted and logged.
    fn refuse(&self, refusal: &Refusal, line: &Line<'_>) -> Response<Body> {
        let res = refusal.response(|why| self.overloaded(why, &self.shared.protected));
        log_request(&self.shared.metrics, &res, refusal.outcome(), None, line);
        res
    }

    /// The body step both modes share once a body is read: its content decoded (under
    /// `max_body_bytes`), its fingerprint and its record id.
    async fn identify(
        &self,
        policy: &Policy,
        method: &Method,
        operation: &Operation,
        parts: &hyper::http::request::Parts,
        body: &Bytes,
    ) -> Result<Identified, Refusal> {
        let encoding = joined(&parts.headers, CONTENT_ENCODING);
        let decoded = decode_body(encoding.as_deref(), body, policy.max_body_bytes).await?;
        let content = Content {
            encoding: encoding.as_deref(),
            body,
            decoded: decoded.as_deref(),
        };
        let fingerprint = decision::fingerprint(
            policy,
            method,
            operation,
            &parts.uri,
            &parts.headers,
            content,
        );
        let id = self.shared.scoper.record_id(
            &operation.tenant,
            method.as_str(),
            &operation.scope_path,
            &operation.key,
        );
        Ok(Identified {
            id,
            fingerprint,
            encoding,
            decoded,
        })
    }

    /// Claims the key on the connection's own task: a replay, a 409 or a 422 costs no task
    /// of its own. A client that hangs up while the claim is in flight drops this future;
    /// the guard then takes the claim back (owner-checked, so nothing else is touched), and
    /// a retry is not left behind a record that was never forwarded.
    #[allow(clippy::too_many_arguments)]
    async fn claim_guarded(
        &self,
        claim: &mut ClaimRequest,
        request: &Request<Body>,
        method: &Method,
        operation: &Operation,
        content: Content<'_>,
        policy: &Policy,
        span: &Span,
    ) -> Result<Claim, StoreError> {
        let pending = PendingClaim {
            shared: &self.shared,
            id: claim.id,
            owner: claim.owner.clone(),
            linger: claim.retention,
            armed: true,
        };
        let claim_span = telemetry::child(span, Step::Claim);
        let scope_path = &operation.scope_path;
        let found = self
            .claim(claim, request, method, scope_path, content, policy)
            .await;
        drop(claim_span);
        pending.disarm();
        found
    }

    /// Claims the key; a record made under another fingerprint version is compared in
    /// that version (one more round trip, only in the upgrade window).
    async fn claim(
        &self,
        claim: &mut ClaimRequest,
        request: &Request<Body>,
        method: &hyper::Method,
        scope_path: &str,
        content: Content<'_>,
        policy: &Policy,
    ) -> Result<Claim, StoreError> {
        let store_timeout = self.shared.settings.config.store_timeout;
        let found = deadline(store_timeout, self.shared.store.claim(claim)).await;
        let Ok(Claim::OtherVersion(version)) = found else {
            return found;
        };
        let parts = decision::request_parts(
            method,
            scope_path,
            request.uri(),
            request.headers(),
            content,
        );
        match fingerprint::fingerprint_as(version, &parts, &policy.fingerprint_rules()) {
            Some(fp) => {
                claim.fingerprint = fp;
                claim.fingerprint_version = version;
                deadline(store_timeout, self.shared.store.claim(claim)).await
            }
            None => found,
        }
    }

    /// Forwards a request whose claim this instance holds. From here on the work runs in
    /// its own task: a client that hangs up must never cut a claim off from its exchange
    /// and its record.
    async fn forward_claimed(&self, protected: Protected) -> Response<Body> {
        let Protected {
            claim,
            request,
            policy,
            peer,
            method,
            request_id,
            span,
            started,
            slot,
            observed,
        } = protected;
        let id = claim.id;
        let claimed = Claimed {
            id,
            owner: claim.owner,
            policy: policy.clone(),
            request,
            slot,
            span: span.clone(),
        };
        let this = self.clone();
        // Boxed: the exchange → record state machine is several kilobytes, and tokio
        // moves an unboxed future by value into the task and out again.
        let task = self.shared.tasks.spawn(Box::pin(async move {
            let (res, outcome) = exchange(&this.shared, claimed, peer).await;
            let outcome = if observed {
                // Counted here, where the exchange ends whether or not its client waited:
                // the record's first 2xx, against which later ones are duplicates.
                let route = policy.route.as_deref().unwrap_or("default");
                this.shared
                    .metrics
                    .observed_answer(route, id, res.status().as_u16());
                Outcome::Observed
            } else {
                outcome
            };
            let metrics = &this.shared.metrics;
            let line = Line {
                method: &method,
                policy: &policy,
                request_id: &request_id,
                span: &span,
                started,
            };
            log_request(metrics, &res, outcome, Some(id), &line);
            res
        }));
        match task.await {
            // It ran: its answer is sent whatever the budget says, and counted while it is.
            Ok(res) => {
                let buffers = self.shared.buffers.clone();
                res.map(|b| {
                    let n = usize::try_from(hyper::body::Body::size_hint(&b).lower()).unwrap_or(0);
                    body::holding(b, buffers.take(n))
                })
            }
            // Only a panic gets here. Its claim stays in progress and its lease runs out
            // to `unknown`, so nothing is executed twice.
            Err(e) => {
                tracing::error!(record = %id, error = %e, "request task failed");
                Problem::UpstreamTimeout.response(
                    "internal error; the outcome is unknown",
                    Some(&id),
                    None,
                )
            }
        }
    }

    /// Acts on the claim's answer: forwards a won claim, answers the others.
    async fn settle(
        &self,
        found: Result<Claim, StoreError>,
        protected: Protected,
    ) -> Response<Body> {
        let id = protected.claim.id;
        let (res, outcome) = match found {
            Ok(Claim::OtherVersion(version)) => (
                Problem::InProgress.response(
                    format!("this key's record was made by an idemgate with fingerprint version {version}, which this instance does not know; retry (an up-to-date instance will answer)"),
                    Some(&id),
                    Some(1),
                ),
                Outcome::InProgress,
            ),
            Ok(Claim::Claimed) => return self.forward_claimed(protected).await,
            // A replay's body counts against the buffer budget until it is written: clients
            // that stop reading a large answer must not hold memory without bound.
            Ok(Claim::Replay(stored)) => {
                let mut held = self.shared.buffers.hold();
                if held.grow(stored.body.len()).is_err() {
                    let res = self.overloaded(Refused::BuffersFull, &self.shared.protected);
                    (res, Outcome::Overloaded)
                } else {
                    (replay(stored).map(|b| body::holding(b, held)), Outcome::Replayed)
                }
            }
            Ok(Claim::NotKept { status }) => (
                Problem::ResponseNotStored.response(
                    format!("this request was executed once and answered with status {status}, but the answer was larger than max_response_bytes (or did not fit in the store) and was not kept, so it cannot be replayed; it will not be sent again"),
                    Some(&id),
                    None,
                ),
                Outcome::NotStored,
            ),
            Ok(Claim::InFlight { lease_left }) => {
                let policy = &protected.policy;
                let typical = policy.upstream_time.get();
                let wait = retry_after::in_progress(policy.lease, lease_left, typical);
                let res = Problem::InProgress.response(
                    "a request with this key is being executed; retry after it finishes",
                    Some(&id),
                    Some(wait),
                );
                (res, Outcome::InProgress)
            }
            Ok(Claim::Mismatch) => (
                Problem::FingerprintMismatch.response(
                    "this key was used with a different request (method, path, query, content type or body); use a new key for a new operation",
                    Some(&id),
                    None,
                ),
                Outcome::Mismatch,
            ),
            // Only a claim that reached the store after its own release can find this, and
            // nobody waits for that one; it was not forwarded either way.
            Ok(Claim::Withdrawn) => (
                Problem::StoreUnavailable.response(
                    "the idempotency store answered too late; the request was not forwarded",
                    Some(&id),
                    Some(1),
                ),
                Outcome::StoreError,
            ),
            // This instance's own claim, never forwarded, not yet taken back: its lease ran
            // out while the store was away. Not unknown: it is about to be free.
            Ok(Claim::Unknown) if self.shared.releases.is_pending(&id) => (
                Problem::StoreUnavailable.response(
                    "a claim of this key that was never forwarded is still being taken back; retry",
                    Some(&id),
                    Some(1),
                ),
                Outcome::StoreError,
            ),
            Ok(Claim::Unknown) => (
                Problem::OutcomeUnknown.response(
                    "this request was sent to the upstream once and its outcome is unknown; it will not be sent again until an operator releases the record",
                    Some(&id),
                    None,
                ),
                Outcome::Ambiguous,
            ),
            // The request was executed once and its answer was kept, sealed under a key
            // that is gone: a second execution is the one thing this must not become, so
            // not even `on_store_error = "forward"` forwards it.
            Err(StoreError::Unreadable(why)) => {
                tracing::error!(record = %id, error = %why, "recorded answer cannot be read");
                let res = Problem::RecordUnreadable.response(
                    "this request was executed once and its recorded answer cannot be read (its encryption key is no longer configured); it will not be executed again",
                    Some(&id),
                    None,
                );
                (res, Outcome::StoreError)
            }
            Err(e) => {
                tracing::warn!(record = %id, error = %e, "claim failed");
                // The claim may have landed even though its answer did not, or may still
                // land: take it back (owner-checked, so nothing else is touched) so that a
                // retry is not stuck behind a record that was never forwarded. A full store
                // refused it outright: nothing landed, and nothing is left to take back.
                if !matches!(e, StoreError::Full(_)) {
                    let claim = &protected.claim;
                    release_in_background(&self.shared, id, claim.owner.clone(), claim.retention);
                }
                if let StoreError::Full(why) = &e {
                    self.shared.metrics.refused_store_full().inc();
                    let wait = self.room_after(&protected.policy);
                    let res = Problem::StoreUnavailable.response(
                        format!("the idempotency store is full ({why}); the request was not forwarded, retry after the Retry-After"),
                        Some(&id),
                        Some(wait),
                    );
                    (res, Outcome::StoreError)
                } else if protected.policy.on_store_error == OnStoreError::Reject {
                    let res = Problem::StoreUnavailable.response(
                        "the idempotency store did not answer; the request was not forwarded",
                        Some(&id),
                        Some(1),
                    );
                    (res, Outcome::StoreError)
                } else {
                    let timeout = protected.policy.upstream_timeout;
                    let res = self.pass_through(protected.request, protected.peer, timeout).await;
                    (res, Outcome::StoreError)
                }
            }
        };
        let line = Line {
            method: &protected.method,
            policy: &protected.policy,
            request_id: &protected.request_id,
            span: &protected.span,
            started: protected.started,
        };
        log_request(&self.shared.metrics, &res, outcome, Some(id), &line);
        res
    }

    /// Acts on a decision on a route in `mode = "observe"`: forwards the request whatever
    /// the decision says, and counts what enforcing would have done
    /// (`idemgate_observed_total{route, would}`), logging a refusal or a replay. A protected
    /// request is read, fingerprinted and claimed as when enforcing; a won claim is
    /// forwarded and recorded as when enforcing, so that switching the route to `enforce`
    /// replays what was seen here; everything else goes out as pass-through, with the path
    /// as the client sent it.
    async fn observe(
        &self,
        req: Request<Incoming>,
        decision: Decision<'_>,
        head: Head,
    ) -> Response<Body> {
        let Decision {
            policy,
            method,
            action,
            ..
        } = decision;
        let none = Span::none();
        let line = Line {
            method: &method,
            policy,
            request_id: &head.request_id,
            span: &none,
            started: head.started,
        };
        let peer = head.peer;
        let operation = match action {
            Action::PassThrough(pass) => match pass.would() {
                Some(would) => {
                    return self
                        .forward_as_is(req.map(body::boxed), peer, &line, would, None, false)
                        .await
                }
                None => {
                    let timeout = policy.upstream_timeout;
                    let res = self.pass_through(req.map(body::boxed), peer, timeout).await;
                    log_request(&self.shared.metrics, &res, pass.outcome(), None, &line);
                    return res;
                }
            },
            Action::Refuse(refusal) => {
                let would = refusal.would();
                return self
                    .forward_as_is(req.map(body::boxed), peer, &line, would, None, false)
                    .await;
            }
            Action::Protect(operation) => operation,
        };
        macro_rules! forward_as_is {
            ($req:expr, $would:expr, $id:expr, $duplicate:expr) => {
                return self
                    .forward_as_is($req, peer, &line, $would, $id, $duplicate)
                    .await
            };
        }
        let route: &str = policy.route.as_deref().unwrap_or("default");
        if self.shared.protected.would_refuse() {
            let would = Refusal::Overloaded(Refused::QueueFull).would();
            forward_as_is!(req.map(body::boxed), would, None, false)
        }
        if let Some(refusal) = decision::declared_too_large(req.headers(), policy.max_body_bytes) {
            forward_as_is!(req.map(body::boxed), refusal.would(), None, false)
        }
        // The body is read up to `max_body_bytes` within `body_read_timeout`; one that
        // grows beyond, breaks or stalls goes on, what was read first, as it came.
        let (parts, mut incoming) = req.into_parts();
        let mut held = self.shared.buffers.hold();
        let limit = usize::try_from(policy.max_body_bytes).unwrap_or(usize::MAX);
        let timeout_read = self.shared.settings.config.body_read_timeout;
        let (read, ended) = read_up_to(&mut incoming, limit, &mut held, 0, timeout_read).await;
        if let Err(end) = ended {
            let req = Request::from_parts(parts, body::prefixed(read.chunks, incoming));
            let would = end.refusal(policy.max_body_bytes).would();
            forward_as_is!(req, would, None, false)
        }
        drop(incoming);
        let body_bytes = read.into_bytes();
        let slot = match self.shared.protected.admit().await {
            Ok(slot) => slot,
            Err(why) => {
                let req = Request::from_parts(parts, body::full(body_bytes));
                forward_as_is!(req, Refusal::Overloaded(why).would(), None, false)
            }
        };
        drop(held);
        let identified = match self
            .identify(policy, &method, &operation, &parts, &body_bytes)
            .await
        {
            Ok(identified) => identified,
            Err(refusal) => {
                drop(slot);
                let req = Request::from_parts(parts, body::full(body_bytes));
                forward_as_is!(req, refusal.would(), None, false)
            }
        };
        let id = identified.id;
        let request = Request::from_parts(parts, body::full(body_bytes.clone()));
        if !self.shared.secret.agreed() {
            drop(slot);
            forward_as_is!(request, Refusal::SecretDisagrees.would(), Some(id), false)
        }
        // A store that just failed is not asked again for a second, then by one request at
        // a time until it answers: during an outage about one observed request a second
        // waits on it (at most `store_timeout`), not each.
        let store_timeout = self.shared.settings.config.store_timeout;
        if self.shared.store_failing.skip(store_timeout) {
            drop(slot);
            forward_as_is!(request, "store_unavailable", Some(id), false)
        }
        let mut claim = new_claim(id, identified.fingerprint, policy, store_timeout);
        let content = identified.content(&body_bytes);
        let found = self
            .claim_guarded(
                &mut claim, &request, &method, &operation, content, policy, &none,
            )
            .await;
        drop(identified);
        match &found {
            Err(StoreError::Full(_) | StoreError::Unreadable(_)) | Ok(_) => {
                self.shared.store_failing.answered()
            }
            Err(_) => self.shared.store_failing.failed(),
        }
        let (would, duplicate) = match &found {
            Ok(Claim::Claimed) => {
                self.observed(route, "execute", Some(id), false);
                let protected = Protected {
                    claim,
                    request,
                    policy: policy.clone(),
                    peer,
                    method: method.clone(),
                    request_id: head.request_id.clone(),
                    span: Span::none(),
                    started: head.started,
                    slot,
                    observed: true,
                };
                return self.forward_claimed(protected).await;
            }
            Ok(Claim::Replay(_)) => ("replay", true),
            Ok(Claim::InFlight { .. }) | Ok(Claim::OtherVersion(_)) => ("in_progress", true),
            // The same record (same key, tenant, method and path) with another request: if it
            // runs, it is that record's second execution too.
            Ok(Claim::Mismatch) => ("mismatch", true),
            // This instance's own claim, never forwarded, still being taken back: enforcing
            // answers 503 `store-unavailable` (retry), not `outcome-unknown`.
            Ok(Claim::Unknown) if self.shared.releases.is_pending(&id) => {
                ("store_unavailable", true)
            }
            Ok(Claim::Unknown) => ("unknown", true),
            Ok(Claim::NotKept { .. }) => ("response_not_stored", true),
            // Nothing was created (a claim of this very owner was taken back): as a store
            // failure would be, nothing is known of the key.
            Ok(Claim::Withdrawn) => ("store_unavailable", false),
            Err(StoreError::Unreadable(_)) => ("record_unreadable", true),
            Err(e) => {
                if !matches!(e, StoreError::Full(_)) {
                    release_in_background(&self.shared, id, claim.owner.clone(), claim.retention);
                }
                ("store_unavailable", false)
            }
        };
        drop(slot);
        forward_as_is!(request, would, Some(id), duplicate)
    }

    /// Observe mode's forwarding of what enforcing would not have forwarded as it is:
    /// pass-through (streamed, unclaimed), counted as `would`; a 2xx answer for a record
    /// that had one is a duplicate let through.
    async fn forward_as_is(
        &self,
        req: Request<Body>,
        peer: SocketAddr,
        line: &Line<'_>,
        would: &'static str,
        id: Option<RecordId>,
        duplicate: bool,
    ) -> Response<Body> {
        let route = line.policy.route.as_deref().unwrap_or("default");
        let timeout = line.policy.upstream_timeout;
        let res = match id.filter(|_| duplicate) {
            // A request that may run a record a second time runs in a task of its own, as
            // a claimed one does: its answer is counted even when its client hangs up
            // first (the upstream still runs it).
            Some(id) => {
                let this = self.clone();
                let in_task = route.to_string();
                let task = self.shared.tasks.spawn(async move {
                    let res = this.pass_through(req, peer, timeout).await;
                    let status = res.status().as_u16();
                    let dup = this.shared.metrics.observed_answer(&in_task, id, status);
                    (res, dup)
                });
                match task.await {
                    Ok((res, dup)) => {
                        self.observed(route, would, Some(id), dup);
                        res
                    }
                    Err(_) => Problem::UpstreamTimeout.response(
                        "internal error; the outcome is unknown",
                        Some(&id),
                        None,
                    ),
                }
            }
            None => {
                let res = self.pass_through(req, peer, timeout).await;
                self.observed(route, would, id, false);
                res
            }
        };
        log_request(&self.shared.metrics, &res, Outcome::Observed, None, line);
        res
    }

    /// Counts (and, for what would have been refused or replayed, logs at most a few
    /// lines a second) what enforcing would have done on an observed route.
    fn observed(&self, route: &str, would: &'static str, id: Option<RecordId>, duplicate: bool) {
        self.shared.metrics.observed(route, would);
        if !matches!(would, "execute" | "unprotected") && self.shared.observe_log.allow() {
            tracing::info!(
                route,
                would,
                record = id.map(|i| i.to_string()).as_deref().unwrap_or("-"),
                duplicate_let_through = duplicate,
                "observe mode: forwarded a request that enforcing would not have"
            );
        }
    }

    /// Seconds until a full store should have room: the route's typical upstream time when
    /// requests in flight hold reserved room, else the soonest expiry (at most a day), else 1.
    fn room_after(&self, policy: &Policy) -> u64 {
        match self.shared.store.room_after() {
            Some(d) if d.is_zero() => policy
                .upstream_time
                .get()
                .map_or(1, |t| t.as_secs_f64().ceil() as u64)
                .max(1),
            Some(d) => (d.as_secs_f64().ceil() as u64).clamp(1, 86_400),
            None => 1,
        }
    }

    /// The 503 of a request not admitted: nothing was buffered beyond what the refusal
    /// needed, nothing claimed.
    fn overloaded(&self, why: Refused, slots: &Slots) -> Response<Body> {
        let detail = match why {
            Refused::QueueFull => "too many requests are in progress and waiting; nothing was done, retry later",
            Refused::QueueTimeout => "too many requests are in progress; this one waited queue_timeout for its turn; nothing was done, retry later",
            Refused::BuffersFull => "too many request and answer bodies are held in memory (max_buffered_bytes); nothing was done, retry later",
        };
        if why != Refused::BuffersFull {
            let class = if std::ptr::eq(slots, &*self.shared.passing) {
                "pass_through"
            } else {
                "protected"
            };
            self.shared.metrics.refused(class, why).inc();
        }
        Problem::Overloaded.response(detail, None, Some(slots.retry_after()))
    }

    /// Buffers a protected body up to `max` bytes within the body read timeout, its bytes
    /// taken from the budget of bodies being buffered (503 `overloaded` when it is spent).
    async fn read_body(
        &self,
        headers: &hyper::HeaderMap,
        incoming: Incoming,
        max: u64,
    ) -> Result<(Bytes, Buffered), Refusal> {
        if let Some(refusal) = decision::declared_too_large(headers, max) {
            return Err(refusal);
        }
        let mut held = self.shared.buffers.hold();
        // Bytes are taken from the budget as they arrive, never a declared length up front:
        // a client that declares 1 MiB and sends a byte a second holds one byte a second,
        // not 1 MiB for `body_read_timeout` (64 such clients spent the default budget, and
        // every other protected request got 503 until their timeouts).
        let limit = usize::try_from(max).unwrap_or(usize::MAX);
        let mut incoming = incoming;
        let timeout = self.shared.settings.config.body_read_timeout;
        let (read, ended) = read_up_to(&mut incoming, limit, &mut held, 0, timeout).await;
        match ended {
            Ok(()) => Ok((read.into_bytes(), held)),
            Err(end) => Err(end.refusal(max)),
        }
    }

    /// Forwards a request as is, streaming both bodies.
    async fn pass_through(
        &self,
        mut req: Request<Body>,
        peer: SocketAddr,
        timeout: Duration,
    ) -> Response<Body> {
        // Its own share of the upstream connections, held until the answer's body is done:
        // pass-through traffic cannot take what protected requests need, nor the other way.
        let slot = match self.shared.passing.admit().await {
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
                upstream::strip_hop_by_hop(&mut parts.headers);
                parts.extensions.insert(latency);
                Response::from_parts(parts, body::holding(body::boxed(body), slot))
            }
            Ok(Err(e)) => match upstream::classify(&e) {
                Failure::NotSent => {
                    tracing::warn!(error = %upstream::describe(&e), "upstream unreachable");
                    Problem::UpstreamUnreachable.response(
                        "could not connect to the upstream",
                        None,
                        None,
                    )
                }
                Failure::Ambiguous => Problem::UpstreamTimeout.response(
                    "the upstream closed the connection without a complete answer",
                    None,
                    None,
                ),
            },
            Err(_) => Problem::UpstreamTimeout.response(
                "the upstream did not answer within upstream_timeout",
                None,
                None,
            ),
        }
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
    metrics.request(policy.index, outcome, elapsed);
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
                route = policy.route.as_deref().unwrap_or("-"),
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

/// A new claim on record `id` under `policy`, with a fresh owner.
fn new_claim(
    id: RecordId,
    fingerprint: fingerprint::Fingerprint,
    policy: &Policy,
    store_timeout: Duration,
) -> ClaimRequest {
    ClaimRequest {
        id,
        fingerprint,
        fingerprint_version: FINGERPRINT_VERSION,
        owner: OwnerToken::random(),
        lease: policy.lease,
        retention: policy.retention,
        busy_for: busy_for(policy, store_timeout),
        answer_room: answer_room(policy),
    }
}

/// The values of every `name` header line as one list (`None` without any).
fn joined(headers: &hyper::HeaderMap, name: HeaderName) -> Option<String> {
    let mut values = headers.get_all(name).iter().peekable();
    values.peek()?;
    let all: Vec<_> = values
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .collect();
    Some(all.join(","))
}

/// A coded body's content for its fingerprint (`None` when it has no codings, or is
/// fingerprinted raw), decoded under `max` bytes: beyond it, 413, having held at most `max`.
/// Decoding that may take long runs off the serving thread; it runs with a slot held, so at
/// most `max_in_flight` bodies are being decoded at once.
async fn decode_body(
    encoding: Option<&str>,
    body: &Bytes,
    max: u64,
) -> Result<Option<Vec<u8>>, Refusal> {
    let limit = usize::try_from(max).unwrap_or(usize::MAX);
    let decoded = if fingerprint::decoding_is_heavy(encoding, body, limit) {
        let (owned, body) = (encoding.map(str::to_owned), body.clone());
        tokio::task::spawn_blocking(move || {
            fingerprint::decode_content(owned.as_deref(), &body, limit)
        })
        .await
        // A decoder that panicked: the body is fingerprinted as sent.
        .unwrap_or(Ok(fingerprint::Decoded::Raw))
    } else {
        fingerprint::decode_content(encoding, body, limit)
    };
    match decoded {
        Ok(fingerprint::Decoded::Content(content)) => Ok(Some(content)),
        Ok(fingerprint::Decoded::Identity | fingerprint::Decoded::Raw) => Ok(None),
        Err(fingerprint::TooLarge) => Err(Refusal::BodyTooLarge { max, decoded: true }),
    }
}

/// Replaces a URI's path, keeping its query.
fn set_path(uri: &mut hyper::Uri, path: &str) {
    let pq = match uri.query() {
        Some(q) => format!("{path}?{q}"),
        None => path.to_string(),
    };
    let mut parts = std::mem::take(uri).into_parts();
    // A normalized path is made of the characters of a valid one, so it parses.
    if let Ok(pq) = pq.parse() {
        parts.path_and_query = Some(pq);
    }
    if let Ok(new) = hyper::Uri::from_parts(parts) {
        *uri = new;
    }
}

/// A protected request between its claim and its answer, with what its log line needs.
struct Protected {
    claim: ClaimRequest,
    request: Request<Body>,
    policy: Arc<Policy>,
    peer: SocketAddr,
    method: hyper::Method,
    request_id: HeaderValue,
    span: Span,
    started: Instant,
    slot: Slot,
    // On an observed route: logged and counted as `observed`.
    observed: bool,
}

/// A claim on its way to the store. Dropped armed (its request's future was dropped: the
/// client hung up), it takes the claim back in the background.
struct PendingClaim<'a> {
    shared: &'a Shared,
    id: RecordId,
    owner: OwnerToken,
    // The claim's retention: how long a claim still on its way could arrive and matter.
    linger: Duration,
    armed: bool,
}

impl PendingClaim<'_> {
    /// The claim's answer arrived: from here on its owner settles it.
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for PendingClaim<'_> {
    fn drop(&mut self) {
        if self.armed {
            release_in_background(self.shared, self.id, self.owner.clone(), self.linger);
        }
    }
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

/// What a claim reserves in a store with a byte cap: the largest answer the route records.
fn answer_room(policy: &Policy) -> usize {
    usize::try_from(policy.max_response_bytes)
        .unwrap_or(usize::MAX)
        .saturating_add(ANSWER_HEAD_ROOM)
}

/// How long after a claim its owner may still be working on it: the claim's answer (at
/// most `store_timeout`), the whole upstream exchange (`upstream_timeout`), then the record
/// (`store_timeout`). An operator's release is refused within this time unless forced.
fn busy_for(policy: &Policy, store_timeout: Duration) -> Duration {
    policy.upstream_timeout + store_timeout * 2
}

/// The first pause between two tries of a release; it doubles up to
/// [`RELEASE_RETRY_PAUSE_MAX`].
const RELEASE_RETRY_PAUSE: Duration = Duration::from_millis(50);
/// The longest pause between two tries: once the store is back, a pending release lands
/// within this (plus one `store_timeout`), well within a lease.
const RELEASE_RETRY_PAUSE_MAX: Duration = Duration::from_millis(500);

/// Releases a claim that was never forwarded, whether or not it landed, in a task of its
/// own: owner-checked (a record this owner does not hold is left alone), and noted by the
/// store for `linger` so that the claim, if it is still on its way, creates nothing when it
/// arrives. That matters because the release need not follow the claim down the same
/// connection: when the connection that carried the claim is cut, the release goes down a
/// new one and can overtake a claim still in flight on the old. A release that fails is
/// tried again with growing pauses for as long as the instance lives, so a store that comes
/// back after any outage frees the key, rather than leaving it to read as `unknown` once
/// its lease runs out; meanwhile the key is in [`Releases`], and a retry of it is told to
/// wait. Shutdown logs those still pending by record id.
fn release_in_background(shared: &Shared, id: RecordId, owner: OwnerToken, linger: Duration) {
    // Outside a runtime (the process is going away) there is nothing to spawn on: the
    // claim, if it landed, reads as unknown once its lease runs out, never twice executed.
    if tokio::runtime::Handle::try_current().is_err() {
        tracing::error!(record = %id, "could not take back a claim that was never forwarded (shutting down); it is safe to release");
        return;
    }
    if !shared.releases.add(id) {
        tracing::error!(record = %id, pending = shared.releases.len(), "too many releases pending; this claim was never forwarded and is safe to release (if it landed, it reads as unknown once its lease runs out)");
        return;
    }
    let store = shared.store.clone();
    let releases = shared.releases.clone();
    let store_timeout = shared.settings.config.store_timeout;
    shared.tasks.spawn(async move {
        let mut pause = RELEASE_RETRY_PAUSE;
        let mut tries = 0u32;
        loop {
            match deadline(store_timeout, store.release(&id, &owner, linger)).await {
                Ok(_) => {
                    releases.remove(&id);
                    if tries > 0 {
                        tracing::info!(record = %id, tries = tries + 1, "claim that was never forwarded taken back");
                    }
                    return;
                }
                Err(e) => {
                    tries += 1;
                    // Once, and then every so often, so that a long outage shows without
                    // flooding the log.
                    if tries == 1 || tries.is_multiple_of(100) {
                        tracing::warn!(record = %id, tries, error = %e, "release of a claim that was never forwarded failed; trying again until it lands");
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(RELEASE_RETRY_PAUSE_MAX);
                }
            }
        }
    });
}

/// Why an exchange produced no complete answer.
enum ExchangeError {
    Request(hyper_util::client::legacy::Error),
    Body(hyper::Error),
    Timeout,
}

/// Forwards a claimed request, keeps its lease alive while the upstream works, and settles
/// the record: completed, released (provably not sent) or unknown.
async fn exchange(
    shared: &Arc<Shared>,
    claimed: Claimed,
    peer: SocketAddr,
) -> (Response<Body>, Outcome) {
    let Claimed {
        id,
        owner,
        policy,
        mut request,
        slot,
        span,
    } = claimed;
    upstream::prepare(&mut request, &shared.settings.upstream, peer);
    upstream::close_after(&mut request);
    let upstream_span = telemetry::child(&span, Step::Upstream);
    // The upstream continues the trace under idemgate's span (with tracing off, the
    // client's traceparent passes as it came).
    telemetry::inject(&upstream_span, request.headers_mut());
    let call = async {
        let res = shared
            .fresh
            .request(request)
            .await
            .map_err(ExchangeError::Request)?;
        let (parts, body) = res.into_parts();
        let answer = answer::read(&parts.headers, body, policy.max_response_bytes)
            .await
            .map_err(ExchangeError::Body)?;
        Ok::<_, ExchangeError>((parts, answer))
    };
    let timed = async {
        tokio::time::timeout(policy.upstream_timeout, call)
            .await
            .unwrap_or(Err(ExchangeError::Timeout))
    };
    let sent = Instant::now();
    let result = renewing_lease(shared, &id, &owner, policy.lease, timed).await;
    drop(upstream_span);
    let latency = UpstreamLatency(sent.elapsed());
    shared.metrics.upstream(latency.0);
    let store_timeout = shared.settings.config.store_timeout;
    let store = &shared.store;
    let (mut res, outcome) = match result {
        // An answer that says the upstream did nothing (`release_on_status`): passed on, and
        // the claim released so that the retry executes.
        Ok((mut parts, answer)) if policy.release_on_status.contains(&parts.status.as_u16()) => {
            upstream::strip_hop_by_hop(&mut parts.headers);
            let status = parts.status.as_u16();
            tracing::info!(record = %id, status, "answer not recorded (release_on_status); releasing the claim");
            let linger = policy.retention;
            if let Err(e) = deadline(store_timeout, store.release(&id, &owner, linger)).await {
                tracing::warn!(record = %id, error = %e, "could not release the claim; trying again in the background");
                release_in_background(shared, id, owner, linger);
            }
            (
                Response::from_parts(
                    parts,
                    match answer {
                        Answer::Whole(bytes) => body::full(bytes),
                        Answer::TooLarge { read, rest } => body::prefixed(read, rest),
                    },
                ),
                Outcome::Released,
            )
        }
        Ok((mut parts, Answer::TooLarge { read, rest })) => {
            policy.upstream_time.observe(latency.0);
            upstream::strip_hop_by_hop(&mut parts.headers);
            let status = parts.status.as_u16();
            tracing::info!(record = %id, status, max_response_bytes = policy.max_response_bytes, "answer larger than max_response_bytes: streamed to the client, recorded without its body");
            record_not_kept(shared, &id, &owner, status).await;
            (
                Response::from_parts(parts, body::prefixed(read, rest)),
                Outcome::Forwarded,
            )
        }
        Ok((mut parts, Answer::Whole(bytes))) => {
            policy.upstream_time.observe(latency.0);
            upstream::strip_hop_by_hop(&mut parts.headers);
            let upstream_timeout = policy.upstream_timeout;
            let stored = StoredResponse {
                status: parts.status.as_u16(),
                headers: parts
                    .headers
                    .iter()
                    // The request id names one request; a replay carries its own.
                    .filter(|(n, _)| ![DATE, SET_COOKIE, CONTENT_LENGTH, X_REQUEST_ID].contains(n))
                    .map(|(n, v)| (n.as_str().to_string(), Bytes::copy_from_slice(v.as_bytes())))
                    .collect(),
                body: bytes.clone(),
            };
            // An answer that shows nothing ran (401, 403, 407 by default) is kept only
            // briefly: a flood of made-up credentials, each a tenant of its own, must not
            // hold the store for a day.
            let retain = policy
                .short_retention_statuses
                .contains(&stored.status)
                .then_some(policy.short_retention);
            match policy.record_mode {
                RecordMode::BeforeResponse => {
                    record_answer(
                        shared,
                        &id,
                        &owner,
                        &stored,
                        &span,
                        upstream_timeout,
                        retain,
                    )
                    .await;
                }
                // The client's answer goes out now; the record is written meanwhile, in a
                // task that shutdown waits for and that keeps the in-flight slot until it
                // is done. Until it lands, the claim stays in progress under its lease: a
                // retry gets 409, and should this process die first, the lease runs out to
                // `unknown`. Never a second execution.
                RecordMode::AfterResponse => {
                    let (shared, span) = (Arc::clone(shared), span.clone());
                    shared.tasks.clone().spawn(async move {
                        record_answer(
                            &shared,
                            &id,
                            &owner,
                            &stored,
                            &span,
                            upstream_timeout,
                            retain,
                        )
                        .await;
                        drop(slot);
                    });
                }
            }
            (
                Response::from_parts(parts, body::chunked(bytes)),
                Outcome::Forwarded,
            )
        }
        Err(ExchangeError::Request(e)) if upstream::classify(&e) == Failure::NotSent => {
            tracing::warn!(record = %id, error = %upstream::describe(&e), "upstream unreachable; releasing the claim");
            let linger = policy.retention;
            if let Err(e) = deadline(store_timeout, store.release(&id, &owner, linger)).await {
                tracing::warn!(record = %id, error = %e, "could not release the claim; trying again in the background");
                release_in_background(shared, id, owner, linger);
            }
            let res = Problem::UpstreamUnreachable.response(
                "the upstream could not be reached, or refused the request before processing it; nothing was executed and the request may be retried",
                Some(&id),
                Some(1),
            );
            (res, Outcome::UpstreamError)
        }
        Err(e) => {
            let why = match &e {
                ExchangeError::Timeout => {
                    "the upstream did not answer within upstream_timeout".to_string()
                }
                ExchangeError::Request(e) => {
                    format!(
                        "the upstream connection failed after sending: {}",
                        upstream::describe(e)
                    )
                }
                ExchangeError::Body(e) => format!("the upstream's answer broke off: {e}"),
            };
            tracing::warn!(record = %id, reason = %why, "upstream outcome unknown");
            let settled = match policy.on_ambiguous {
                OnAmbiguous::Hold => deadline(store_timeout, store.mark_unknown(&id, &owner)).await,
                OnAmbiguous::Release => {
                    deadline(store_timeout, store.release(&id, &owner, policy.retention)).await
                }
            };
            if let Err(e) = settled {
                tracing::error!(record = %id, error = %e, "could not settle the record; it will read as unknown once its lease runs out");
            }
            let detail = match policy.on_ambiguous {
                OnAmbiguous::Hold => format!("{why}; the request may have been executed, and retries with this key get 409 until an operator releases the record"),
                OnAmbiguous::Release => format!("{why}; the request may have been executed, and the key was released"),
            };
            (
                Problem::UpstreamTimeout.response(detail, Some(&id), None),
                Outcome::Ambiguous,
            )
        }
    };
    res.extensions_mut().insert(latency);
    (res, outcome)
}

/// Writes an upstream's whole answer into its record (owner-checked), logging what went
/// wrong; an answer the store has no room for is recorded without its body.
async fn record_answer(
    shared: &Shared,
    id: &RecordId,
    owner: &OwnerToken,
    stored: &StoredResponse,
    span: &Span,
    upstream_timeout: Duration,
    retain: Option<Duration>,
) {
    let store_timeout = shared.settings.config.store_timeout;
    let limit = record_deadline(store_timeout, upstream_timeout, stored.body.len());
    let record_span = telemetry::child(span, Step::Record);
    let recorded = deadline(limit, shared.store.record(id, owner, stored)).await;
    drop(record_span);
    match recorded {
        Ok(true) => {
            shared.metrics.answer_recorded(stored.status);
            let Some(retain) = retain else { return };
            // Failing, the record keeps the route's retention: it holds room longer, and
            // nothing runs twice.
            match deadline(store_timeout, shared.store.shorten(id, owner, retain)).await {
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(record = %id, error = %e, "could not shorten the retention of an answer that shows nothing ran; it is kept for the route's retention")
                }
            }
        }
        // No room for this answer (the embedded store's byte cap, Redis out of memory): the
        // status alone still keeps retries from executing again.
        Err(StoreError::Full(e)) => {
            tracing::warn!(record = %id, error = %e, "no room in the store for the answer; recording it without its body");
            record_not_kept(shared, id, owner, stored.status).await;
        }
        Ok(false) => {
            tracing::warn!(record = %id, "record no longer owned (released by an operator?); response not stored")
        }
        // The record stays in progress, its lease runs out and retries see `unknown`: never
        // a second execution.
        Err(e) => {
            tracing::error!(record = %id, error = %e, "could not record the upstream's answer")
        }
    }
}

/// How long recording an answer of `len` bytes may take: the store's
/// [`record_budget`](crate::store::record_budget), the whole at most `upstream_timeout`
/// (and never less than `store_timeout`). One `store_timeout` for the whole had an 80 MiB answer (320
/// pieces) time out half way: the client got its answer, its record never landed, and
/// the retry got 409 instead of the replay.
fn record_deadline(store_timeout: Duration, upstream_timeout: Duration, len: usize) -> Duration {
    crate::store::record_budget(store_timeout, len).min(upstream_timeout.max(store_timeout))
}

/// Completes a record without its body, logging what went wrong.
async fn record_not_kept(shared: &Shared, id: &RecordId, owner: &OwnerToken, status: u16) {
    let store_timeout = shared.settings.config.store_timeout;
    let call = shared.store.record_not_kept(id, owner, status);
    match deadline(store_timeout, call).await {
        Ok(true) => shared.metrics.answer_recorded(status),
        Ok(false) => {
            tracing::warn!(record = %id, "record no longer owned (released by an operator?); outcome not stored")
        }
        // As for a full answer: the lease runs out and retries see `unknown`.
        Err(e) => {
            tracing::error!(record = %id, error = %e, "could not record the upstream's answer")
        }
    }
}

/// Awaits `work` while renewing the lease every third of its length. The fast path (an
/// upstream that answers within a third of the lease) costs no store call at all.
async fn renewing_lease<T>(
    shared: &Shared,
    id: &RecordId,
    owner: &OwnerToken,
    lease: Duration,
    work: impl std::future::Future<Output = T>,
) -> T {
    let period = lease / 3;
    let store_timeout = crate::store::renew_deadline(shared.settings.config.store_timeout, lease);
    tokio::pin!(work);
    let mut next = tokio::time::Instant::now() + period;
    loop {
        tokio::select! {
            out = &mut work => return out,
            _ = tokio::time::sleep_until(next) => {
                next += period;
                let renew = shared.store.renew(id, owner, lease);
                // The renewal races the work, so a slow store never delays the answer.
                tokio::select! {
                    out = &mut work => return out,
                    r = deadline(store_timeout, renew) => match r {
                        Ok(true) => {}
                        Ok(false) => tracing::warn!(record = %id, "lease renewal refused: the claim is no longer ours"),
                        Err(e) => tracing::warn!(record = %id, error = %e, "lease renewal failed"),
                    },
                }
            }
        }
    }
}

/// Builds the replay of a stored response.
fn replay(stored: StoredResponse) -> Response<Body> {
    let mut res = Response::new(body::chunked(stored.body));
    *res.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::BAD_GATEWAY);
    let h = res.headers_mut();
    for (name, value) in stored.headers {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_maybe_shared(value),
        ) {
            // Framing is the replay's own: a stored `Content-Length` (from any version or
            // any way in) could contradict the body.
            if !upstream::is_hop_by_hop(&n) && n != SET_COOKIE && n != DATE && n != CONTENT_LENGTH {
                h.append(n, v);
            }
        }
    }
    h.insert(REPLAYED, HeaderValue::from_static("true"));
    res
}

/// Observe mode's view of the store after a failure: not asked at all for a second, then
/// asked by one request at a time (the others go on without it) until one gets an answer.
/// During an outage, observed requests that wait on the store are about one a second.
#[derive(Default)]
struct Breaker {
    // `process_ms` of the last failure; 0 once the store answered again.
    failed_at: std::sync::atomic::AtomicU64,
    // `process_ms` at which the request now trying the store began; 0 for none.
    trying: std::sync::atomic::AtomicU64,
}

impl Breaker {
    /// Whether this request should go on without asking the store. While the store is
    /// healthy, one atomic load.
    fn skip(&self, store_timeout: Duration) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        let at = self.failed_at.load(Relaxed);
        if at == 0 {
            return false;
        }
        let now = crate::admission::process_ms().max(1);
        if now.saturating_sub(at) < 1000 {
            return true;
        }
        // A trial still within its claim's deadline (two round trips at most) is waited
        // for; one whose request was dropped is not.
        let trying = self.trying.load(Relaxed);
        let budget = u64::try_from(store_timeout.as_millis()).unwrap_or(u64::MAX);
        if trying != 0 && now.saturating_sub(trying) <= budget.saturating_mul(2) {
            return true;
        }
        self.trying
            .compare_exchange(trying, now, Relaxed, Relaxed)
            .is_err()
    }

    fn failed(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        self.failed_at
            .store(crate::admission::process_ms().max(1), Relaxed);
        self.trying.store(0, Relaxed);
    }

    /// The store answered: asked by every request again.
    fn answered(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        if self.failed_at.load(Relaxed) != 0 {
            self.failed_at.store(0, Relaxed);
            self.trying.store(0, Relaxed);
        }
    }
}

/// At most [`RateLimit::PER_SECOND`] events a second.
#[derive(Default)]
struct RateLimit(std::sync::atomic::AtomicU64);

impl RateLimit {
    const PER_SECOND: u64 = 10;

    fn allow(&self) -> bool {
        let sec = crate::admission::process_ms() / 1000;
        let r = self.0.fetch_update(
            std::sync::atomic::Ordering::Relaxed,
            std::sync::atomic::Ordering::Relaxed,
            |v| {
                let (s, n) = (v >> 16, v & 0xffff);
                if s != sec {
                    Some((sec << 16) | 1)
                } else if n < Self::PER_SECOND {
                    Some(v + 1)
                } else {
                    None
                }
            },
        );
        r.is_ok()
    }
}

/// Why a protected body was not read whole.
#[derive(Clone, Copy, Debug)]
enum BodyEnd {
    /// Bodies held for clients reached `max_buffered_bytes`.
    BuffersFull,
    /// It carries trailer fields. A trailer (a checksum, a signature) is part of what the
    /// upstream acts on but not of the fingerprint: forwarded, a retry with another would
    /// replay the first; dropped, the upstream would act on a request the client did not
    /// send.
    Trailers,
    /// Longer than the limit.
    TooLarge,
    /// It ended early or was malformed.
    Broken,
    /// Not complete within `body_read_timeout`.
    Timeout,
}

impl BodyEnd {
    /// What enforcing answers a body that ended so (`max`: `max_body_bytes`).
    fn refusal(self, max: u64) -> Refusal {
        match self {
            BodyEnd::BuffersFull => Refusal::Overloaded(Refused::BuffersFull),
            BodyEnd::Trailers => Refusal::TrailersNotSupported,
            BodyEnd::TooLarge => Refusal::BodyTooLarge {
                max,
                decoded: false,
            },
            BodyEnd::Broken => Refusal::BodyUnreadable,
            BodyEnd::Timeout => Refusal::BodyTimeout,
        }
    }
}

/// What was read of a body: all of it, or its chunks up to where reading stopped (every
/// chunk that arrived, so that observe mode can forward them with the rest).
struct ReadBody {
    chunks: Vec<Bytes>,
    received: usize,
}

impl ReadBody {
    fn into_bytes(mut self) -> Bytes {
        match self.chunks.len() {
            0 => Bytes::new(),
            1 => self.chunks.pop().unwrap_or_default(),
            _ => {
                let mut all = bytes::BytesMut::with_capacity(self.received);
                for c in &self.chunks {
                    all.extend_from_slice(c);
                }
                all.freeze()
            }
        }
    }
}

/// Reads `incoming` up to `max` bytes within `timeout`, taking what arrives beyond
/// `reserved` bytes from `held` (the budget of bodies held for clients).
async fn read_up_to(
    incoming: &mut Incoming,
    max: usize,
    held: &mut Buffered,
    mut reserved: usize,
    timeout: Duration,
) -> (ReadBody, Result<(), BodyEnd>) {
    let mut read = ReadBody {
        chunks: Vec::new(),
        received: 0,
    };
    let frames = async {
        while let Some(frame) = incoming.frame().await {
            let Ok(frame) = frame else {
                return Err(BodyEnd::Broken);
            };
            match frame.into_data() {
                Ok(data) => {
                    read.received += data.len();
                    read.chunks.push(data);
                    if read.received > reserved {
                        if held.grow(read.received - reserved).is_err() {
                            return Err(BodyEnd::BuffersFull);
                        }
                        reserved = read.received;
                    }
                    if read.received > max {
                        return Err(BodyEnd::TooLarge);
                    }
                }
                Err(frame) => {
                    if frame.trailers_ref().is_some_and(|t| !t.is_empty()) {
                        return Err(BodyEnd::Trailers);
                    }
                }
            }
        }
        Ok(())
    };
    let ended = tokio::time::timeout(timeout, frames)
        .await
        .unwrap_or(Err(BodyEnd::Timeout));
    (read, ended)
}

/// The verified client certificate of the request's TLS connection, when the listener
/// reads certificates for a `tenant_client_cert` route.
fn peer_cert<B>(req: &Request<B>) -> Option<&ClientCert> {
    req.extensions().get::<Arc<ClientCert>>().map(|c| &**c)
}
