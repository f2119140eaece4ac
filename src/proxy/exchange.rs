//! The upstream exchange of a claimed request and its record: forwarded in a task of its
//! own (so it completes when the client has gone), the lease renewed while the upstream
//! works, and the record settled: completed, released (provably not sent) or unknown.
//!
//! The exchange is told when to record ([`RecordAt`]) and how its client is told of it
//! ([`Voice`]); what each failure answers is `rescue.rs`'s.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::header::{HeaderValue, CONTENT_LENGTH};
use hyper::{Request, Response};
use tracing::Span;

use crate::admission::Slot;
use crate::answer::{self, Answer};
use crate::body::{self, Body};
use crate::config::{OnAmbiguous, Policy, RecordMode};
use crate::key::RecordId;
use crate::outcome::Outcome;
use crate::store::{deadline, ClaimRequest, OwnerToken};
use crate::telemetry::{self, Step};
use crate::upstream::{self, framing, Failure};

use super::allowance::Allowance;
use super::recording::{
    declines_record, record_answer, record_not_kept, release, renewing_lease, settle_record,
    stored, Recording, Writer,
};
use super::rescue::{self, Reason, Unanswered};
use super::{log_request, Line, Proxy, Shared, UpstreamLatency};

/// When a claimed request's record is written, relative to its client's answer.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum RecordAt {
    /// Before the answer (`record_mode = "before_response"`).
    BeforeAnswer,
    /// After the answer, in a task of its own (`record_mode = "after_response"`); a
    /// release or an `unknown` is still written before it.
    AfterAnswer,
    /// After the answer, every store write in a task of its own whose result tells
    /// observe mode's store breaker whether the store answered: the client waits for the
    /// claim and no other store round trip.
    AfterAnswerWithBreaker,
}

impl RecordAt {
    /// Enforcing's timing: the route's `record_mode`.
    pub(super) fn of(policy: &Policy) -> RecordAt {
        match policy.record_mode {
            RecordMode::AfterResponse => RecordAt::AfterAnswer,
            _ => RecordAt::BeforeAnswer,
        }
    }
}

/// How a claimed request's client is told of its exchange.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Voice {
    /// Of its record: a failure names the record and what its retries will get, and the
    /// request is counted by what became of it.
    Record,
    /// As if idemgate were absent: a failure says what happened upstream and nothing of
    /// the record, and the request is counted as observed.
    Upstream,
}

impl Proxy {
    /// Forwards a request whose claim this instance holds. From here on the work runs in
    /// its own task: a client that hangs up must never cut a claim off from its exchange
    /// and its record.
    pub(super) async fn forward_claimed(&self, protected: Protected) -> Response<Body> {
        let (policy, peer, voice) = (protected.policy, protected.peer, protected.voice);
        let allowance = protected.allowance;
        let (id, span) = (protected.claim.id, protected.span);
        let claimed = Claimed {
            id,
            owner: protected.claim.owner,
            policy: policy.clone(),
            request: protected.request,
            slot: protected.slot,
            span: span.clone(),
            record_at: protected.record_at,
            voice,
            allowance: allowance.clone(),
        };
        let (method, request_id, started) =
            (protected.method, protected.request_id, protected.started);
        let task_request_id = request_id.clone();
        let this = self.clone();
        // Boxed: the exchange → record state machine is several kilobytes, and tokio
        // moves an unboxed future by value into the task and out again.
        let task = self.shared.tasks.spawn(Box::pin(async move {
            let (res, outcome) = exchange(&this.shared, claimed, peer).await;
            let outcome = match voice {
                Voice::Record => outcome,
                Voice::Upstream => Outcome::Observed,
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
            // It ran: its answer is sent whatever the budget and the shares say, and counted
            // against them while it is (see `allowance.rs`).
            Ok(res) => {
                let buffers = self.shared.buffers.clone();
                res.map(|b| {
                    let n = usize::try_from(hyper::body::Body::size_hint(&b).lower()).unwrap_or(0);
                    match allowance {
                        Some(allowance) => {
                            allowance.answer(n);
                            body::holding(b, allowance)
                        }
                        None => body::holding(b, buffers.take(n)),
                    }
                })
            }
            // Only a panic gets here. Its claim stays in progress and its lease runs out
            // to `unknown`, so nothing is executed twice.
            Err(e) => {
                let panic = e
                    .try_into_panic()
                    .unwrap_or_else(|e| Box::new(e.to_string()));
                self.panicked(&task_request_id, &*panic);
                tracing::error!(record = %id, "the request's exchange panicked; its record reads as in progress, then unknown");
                let record = (voice == Voice::Record).then_some(id);
                Reason::ExchangePanicked { record }.answer()
            }
        }
    }
}

/// A protected request that owns its claim, on its way upstream.
pub(super) struct Claimed {
    pub(super) id: RecordId,
    pub(super) owner: OwnerToken,
    pub(super) policy: Arc<Policy>,
    pub(super) request: Request<Body>,
    // Held until the exchange and its record are done.
    pub(super) slot: Slot,
    // The request's span (none with tracing off): parent of the upstream and record spans.
    pub(super) span: Span,
    pub(super) record_at: RecordAt,
    pub(super) voice: Voice,
    // Enforcing: room for its answer is taken from its connection's and tenant's shares
    // as the answer is read (see `wait_for_share`).
    pub(super) allowance: Option<Arc<Allowance>>,
}

/// A protected request between its claim and its answer, with what its log line needs.
pub(super) struct Protected {
    pub(super) claim: ClaimRequest,
    pub(super) request: Request<Body>,
    pub(super) policy: Arc<Policy>,
    pub(super) peer: SocketAddr,
    pub(super) method: hyper::Method,
    pub(super) request_id: HeaderValue,
    pub(super) span: Span,
    pub(super) started: Instant,
    pub(super) slot: Slot,
    pub(super) record_at: RecordAt,
    pub(super) voice: Voice,
    // Enforcing: what its answer holds of the buffer budget and of its connection's and
    // tenant's shares while it waits for its client.
    pub(super) allowance: Option<Arc<Allowance>>,
}

/// Why an exchange produced no complete answer.
pub(super) enum ExchangeError {
    Request(upstream::SendError),
    Body(hyper::Error),
    Timeout,
    // What came back is not one answer (see [`framing`]).
    Broken(String),
}

/// What an exchange's answer waits on while it is read: its room in its connection's and
/// tenant's shares, for at most `limit`, giving its slot up meanwhile.
struct Waiting<'a> {
    allowance: Option<&'a Allowance>,
    limit: Duration,
    paused: &'a Paused,
    slot: &'a std::sync::Mutex<Option<Slot>>,
}

/// Sends a claimed request and reads its answer, under `policy`'s `upstream_timeout`,
/// which does not count a wait for room: the upstream has answered by then.
async fn call(
    shared: &Shared,
    request: Request<Body>,
    policy: &Policy,
    waiting: Waiting<'_>,
) -> Result<(hyper::http::response::Parts, Answer), ExchangeError> {
    let head = request.method() == hyper::Method::HEAD;
    let paused = waiting.paused;
    let call = async {
        let res = shared
            .fresh
            .request(request)
            .await
            .map_err(ExchangeError::Request)?;
        let (mut parts, body) = res.into_parts();
        if framing::not_an_answer(parts.status) {
            return Err(ExchangeError::Broken(format!(
                "the upstream's final answer was the interim status {}",
                parts.status.as_u16()
            )));
        }
        let declared = framing::reframe(&mut parts.headers);
        let answer = answer::read(&parts.headers, body, policy.max_response_bytes, |n| {
            wait_for_share(&waiting, n)
        })
        .await
        .map_err(ExchangeError::Body)?;
        if let (Answer::Whole(bytes), Some(n)) = (&answer, declared) {
            let sent = bytes.len() as u64;
            if framing::length_is_of_bytes_sent(parts.status, head) && sent != n {
                return Err(ExchangeError::Broken(format!(
                    "the upstream declared a length of {n} bytes and sent {sent}"
                )));
            }
        }
        Ok::<_, ExchangeError>((parts, answer))
    };
    tokio::pin!(call);
    let started = tokio::time::Instant::now();
    loop {
        let due = started + policy.upstream_timeout + paused.waited();
        tokio::select! {
            out = &mut call => break out,
            () = tokio::time::sleep_until(due) => {
                let due = started + policy.upstream_timeout + paused.waited();
                if tokio::time::Instant::now() >= due {
                    break Err(ExchangeError::Timeout);
                }
            }
        }
    }
}

/// Forwards a claimed request, keeps its lease alive while the upstream works, and settles
/// the record: completed, released (provably not sent) or unknown.
pub(super) async fn exchange(
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
        record_at,
        voice,
        allowance,
    } = claimed;
    // Given up while the answer waits for room (see `wait_for_share`).
    let slot = std::sync::Mutex::new(Some(slot));
    let paused = Paused::default();
    let waiting = Waiting {
        allowance: allowance.as_deref(),
        // Twice `send_timeout`: an answer that holds the room and whose client takes
        // nothing is cut by then, since it last made progress before this one began to
        // wait.
        limit: shared.settings.config.send_timeout.saturating_mul(2),
        paused: &paused,
        slot: &slot,
    };
    super::test_panic("exchange", request.headers());
    upstream::prepare(&mut request, &shared.settings.upstream, peer);
    let request_id = request
        .headers()
        .get(crate::request_id::X_REQUEST_ID)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .unwrap_or_default();
    if shared.fresh.fresh() {
        upstream::close_after(&mut request);
    }
    let upstream_span = telemetry::child(&span, Step::Upstream);
    // The upstream continues the trace under idemgate's span (with tracing off, the
    // client's traceparent passes as it came).
    telemetry::inject(&upstream_span, request.headers_mut());
    let sent = Instant::now();
    let timed = call(shared, request, &policy, waiting);
    let result = renewing_lease(shared, &id, &owner, policy.lease, timed).await;
    let slot = slot.into_inner().unwrap_or_else(|e| e.into_inner());
    drop(upstream_span);
    let latency = UpstreamLatency(sent.elapsed());
    shared.metrics.upstream(latency.0);
    let ended = Ended {
        id,
        owner,
        policy,
        request_id,
        span,
        record_at,
        voice,
        slot,
        latency,
    };
    let (mut res, outcome) = ended.record_and_answer(shared, result).await;
    res.extensions_mut().insert(latency);
    (res, outcome)
}

/// A claimed request whose exchange has ended, on its way to its record and its answer.
struct Ended {
    id: RecordId,
    owner: OwnerToken,
    policy: Arc<Policy>,
    // The request's `X-Request-Id`, named if its record is never written.
    request_id: String,
    span: Span,
    record_at: RecordAt,
    voice: Voice,
    // The in-flight slot, if the exchange kept it: held until the record is written.
    slot: Option<Slot>,
    latency: UpstreamLatency,
}

impl Ended {
    /// Settles the record by what the exchange brought back, and makes the answer.
    async fn record_and_answer(
        self,
        shared: &Arc<Shared>,
        result: Result<(hyper::http::response::Parts, Answer), ExchangeError>,
    ) -> (Response<Body>, Outcome) {
        let policy = &self.policy;
        // The upstream's word on keeping its answer (`record_control_header`): taken off
        // the answer whatever it says, so that it never reaches the client nor the record.
        let declined = match (&result, &policy.record_control_header) {
            (Ok((parts, _)), Some(name)) => declines_record(&parts.headers, name),
            _ => false,
        };
        let result = result.map(|(mut parts, answer)| {
            if let Some(name) = &policy.record_control_header {
                parts.headers.remove(name);
            }
            (parts, answer)
        });
        match result {
            // An answer that says the upstream did nothing (`release_on_status`), or that
            // it asks not to keep (`record_control_header`): passed on, and the claim
            // released so that the retry executes.
            Ok((parts, answer))
                if declined || policy.release_on_status.contains(&parts.status.as_u16()) =>
            {
                self.not_recorded(shared, parts, answer, declined).await
            }
            Ok((parts, Answer::TooLarge { read, rest })) => {
                self.too_large(shared, parts, read, rest).await
            }
            Ok((parts, Answer::Whole(bytes))) => self.whole(shared, parts, bytes).await,
            Err(ExchangeError::Request(e)) if upstream::classify(&e) == Failure::NotSent => {
                self.not_sent(shared, &e).await
            }
            Err(e) => self.ambiguous(shared, &e).await,
        }
    }

    /// Passes on an answer the record does not keep, releasing the claim.
    async fn not_recorded(
        self,
        shared: &Arc<Shared>,
        mut parts: hyper::http::response::Parts,
        answer: Answer,
        declined: bool,
    ) -> (Response<Body>, Outcome) {
        let Ended {
            id, owner, policy, ..
        } = &self;
        upstream::strip_hop_by_hop(&mut parts.headers);
        let status = parts.status.as_u16();
        let why = if declined {
            "the upstream declined it (record_control_header)"
        } else {
            "release_on_status"
        };
        tracing::info!(record = %id, status, why, "answer not recorded; releasing the claim");
        let release = release(Arc::clone(shared), *id, owner.clone(), policy.retention);
        settle_record(shared, self.record_at, release).await;
        let body = match answer {
            Answer::Whole(bytes) => body::full(bytes),
            Answer::TooLarge { read, rest } => body::prefixed(read, rest),
        };
        (Response::from_parts(parts, body), Outcome::Released)
    }

    /// Streams an answer larger than `max_response_bytes` on, recording its status alone.
    async fn too_large(
        self,
        shared: &Arc<Shared>,
        mut parts: hyper::http::response::Parts,
        read: Vec<Bytes>,
        rest: hyper::body::Incoming,
    ) -> (Response<Body>, Outcome) {
        let Ended {
            id, owner, policy, ..
        } = &self;
        policy.upstream_time.observe(self.latency.0);
        upstream::strip_hop_by_hop(&mut parts.headers);
        let status = parts.status.as_u16();
        tracing::info!(record = %id, status, max_response_bytes = policy.max_response_bytes, "answer larger than max_response_bytes: streamed to the client, recorded without its body");
        let s = Arc::clone(shared);
        let writer = Writer {
            id: *id,
            owner: owner.clone(),
            request_id: self.request_id.clone(),
            retention: policy.retention,
        };
        settle_record(shared, self.record_at, async move {
            record_not_kept(&s, &writer, status).await;
            // Failures are logged there; the breaker reads the claims.
            true
        })
        .await;
        (
            Response::from_parts(parts, body::prefixed(read, rest)),
            Outcome::Forwarded,
        )
    }

    /// Records a whole answer, before or after its client gets it, and passes it on.
    async fn whole(
        self,
        shared: &Arc<Shared>,
        mut parts: hyper::http::response::Parts,
        bytes: Bytes,
    ) -> (Response<Body>, Outcome) {
        let Ended {
            id,
            owner,
            policy,
            span,
            record_at,
            ..
        } = &self;
        policy.upstream_time.observe(self.latency.0);
        upstream::strip_hop_by_hop(&mut parts.headers);
        // hyper writes the length of the bytes in hand, as it does for the replay: one
        // canonical form, never the upstream's.
        parts.headers.remove(CONTENT_LENGTH);
        let stored = stored(&parts, bytes.clone());
        // An answer that shows nothing ran (401, 403, 407 by default) is kept only
        // briefly: a flood of made-up credentials, each a tenant of its own, must not
        // hold the store for a day.
        let retain = policy
            .short_retention_statuses
            .contains(&stored.status)
            .then_some(policy.short_retention);
        let recording = Recording {
            id: *id,
            owner: owner.clone(),
            stored,
            span: span.clone(),
            upstream_timeout: policy.upstream_timeout,
            retain,
            retention: policy.retention,
            request_id: self.request_id.clone(),
        };
        if *record_at == RecordAt::BeforeAnswer {
            record_answer(shared, recording).await;
        } else {
            // The client's answer goes out now; the record is written meanwhile, in a
            // task that shutdown waits for and that keeps the in-flight slot until it
            // is done. Until it lands, the claim stays in progress under its lease: a
            // retry gets 409, and should this process die first, the lease runs out to
            // `unknown`. Never a second execution.
            let (shared, record_at, slot) = (Arc::clone(shared), *record_at, self.slot);
            shared.tasks.clone().spawn(async move {
                let answered = record_answer(&shared, recording).await;
                if record_at == RecordAt::AfterAnswerWithBreaker {
                    shared.store_failing.took(answered);
                }
                drop(slot);
            });
        }
        (
            Response::from_parts(parts, body::chunked(bytes)),
            Outcome::Forwarded,
        )
    }

    /// Releases the claim of a request that never reached the upstream.
    async fn not_sent(
        self,
        shared: &Arc<Shared>,
        e: &upstream::SendError,
    ) -> (Response<Body>, Outcome) {
        let Ended {
            id,
            owner,
            policy,
            voice,
            ..
        } = &self;
        tracing::warn!(record = %id, error = %upstream::describe(e), "upstream unreachable; releasing the claim");
        let release = release(Arc::clone(shared), *id, owner.clone(), policy.retention);
        settle_record(shared, self.record_at, release).await;
        let reason = match voice {
            Voice::Record => Reason::NotExecuted { id: *id },
            Voice::Upstream => Reason::Upstream(Unanswered::NotSent),
        };
        (reason.answer(), Outcome::UpstreamError)
    }

    /// Holds or releases the record of a request whose outcome is unknown.
    async fn ambiguous(self, shared: &Arc<Shared>, e: &ExchangeError) -> (Response<Body>, Outcome) {
        let Ended {
            id,
            owner,
            policy,
            voice,
            ..
        } = &self;
        let (problem, why) = rescue::exchange_failure(e);
        tracing::warn!(record = %id, reason = %why, "upstream outcome unknown");
        let (s, p, id, owner) = (Arc::clone(shared), policy.clone(), *id, owner.clone());
        settle_record(shared, self.record_at, async move {
            let store = &s.store;
            let store_timeout = s.settings.config.store_timeout;
            let settled = match p.on_ambiguous {
                OnAmbiguous::Hold => deadline(store_timeout, store.mark_unknown(&id, &owner)).await,
                OnAmbiguous::Release => {
                    deadline(store_timeout, store.release(&id, &owner, p.retention)).await
                }
            };
            if let Err(e) = &settled {
                tracing::error!(record = %id, error = %e, "could not settle the record; it will read as unknown once its lease runs out");
            }
            settled.is_ok()
        })
        .await;
        // Told as upstream, retries are forwarded whatever the record says: the answer
        // says what happened upstream and nothing of what enforcing would do.
        let record = (*voice == Voice::Record).then_some((id, policy.on_ambiguous));
        let reason = Reason::Ambiguous {
            problem,
            why,
            record,
        };
        (reason.answer(), Outcome::Ambiguous)
    }
}

/// How long an exchange has waited for room for its answer, which `upstream_timeout` does
/// not count.
#[derive(Default)]
struct Paused {
    // Milliseconds of the waits that ended, and since when the current one runs (process
    // milliseconds; 0: none runs).
    total: AtomicU64,
    since: AtomicU64,
    // Room was asked for once already: later asks take it at once.
    asked: std::sync::atomic::AtomicBool,
}

impl Paused {
    fn waited(&self) -> Duration {
        let since = self.since.load(Ordering::Relaxed);
        let now = match since {
            0 => 0,
            since => crate::admission::process_ms().saturating_sub(since),
        };
        Duration::from_millis(self.total.load(Ordering::Relaxed) + now)
    }
}

/// Room for an answer of `total` bytes, taken before they are read from the upstream
/// (enforcing only; `total` is its `Content-Length`, or without one `max_response_bytes`,
/// the rest given back once it has ended): from its connection's and its tenant's shares
/// while they have it; otherwise, before anything of it is read, it waits for them
/// (answers of the same connection or tenant that its clients have not read yet, each
/// given back once written or `send_timeout` after its client last took a byte), at most
/// `waiting.limit` (twice `send_timeout`), and then takes the room beyond them: the
/// request ran, so its answer is recorded and sent whatever the shares say. While it
/// waits, its in-flight slot goes to other work.
async fn wait_for_share(waiting: &Waiting<'_>, total: usize) {
    let Some(allowance) = waiting.allowance else {
        return;
    };
    let paused = waiting.paused;
    if allowance.for_answer(total) {
        paused.asked.store(true, Ordering::Relaxed);
        return;
    }
    // Only the first ask waits, before anything is read: an answer partly read never
    // waits for others partly read.
    if paused.asked.swap(true, Ordering::Relaxed) {
        allowance.answer(total);
        return;
    }
    drop(
        waiting
            .slot
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take(),
    );
    paused
        .since
        .store(crate::admission::process_ms(), Ordering::Relaxed);
    let until = tokio::time::Instant::now() + waiting.limit;
    let mut nap = Duration::from_millis(5);
    loop {
        tokio::time::sleep(nap).await;
        nap = (nap * 2).min(Duration::from_millis(100));
        if allowance.for_answer(total) {
            break;
        }
        if tokio::time::Instant::now() >= until {
            allowance.answer(total);
            break;
        }
    }
    let since = paused.since.swap(0, Ordering::Relaxed);
    let waited = crate::admission::process_ms().saturating_sub(since);
    paused.total.fetch_add(waited, Ordering::Relaxed);
}
