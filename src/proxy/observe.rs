//! Observing a decision (`mode = "observe"`): every request is forwarded as sent, and what
//! enforcing would have done is counted (`idemgate_observed_total{route, would}`). A won
//! claim is forwarded and recorded as when enforcing, so switching to `enforce` replays it.

use std::net::SocketAddr;
use std::time::Duration;

use hyper::{Request, Response};
use tracing::Span;

use crate::answer::{self, Answer};
use crate::body::{self, Body};
use crate::key::RecordId;
use crate::outcome::Outcome;
use crate::store::{deadline, Claim, RecordState, StoreError, StoredResponse};

use super::claim::Found;
use super::decision::{Action, Decision};
use super::exchange::{Protected, RecordAt, Voice};
use super::late::{self, Late, Write};
use super::pipeline::{Guard, Stop, Stopped, Verdict};
use super::rescue::{self, Reason};
use super::{log_request, Arrived, Line, Proxy};

impl Proxy {
    /// Acts on a decision on a route in `mode = "observe"`: forwards the request whatever
    /// the decision says, and counts what enforcing would have done
    /// (`idemgate_observed_total{route, would}`), logging a refusal or a replay. A protected
    /// request goes through the body stage as when enforcing; a won claim is forwarded and
    /// recorded as when enforcing, so that switching the route to `enforce` replays what
    /// was seen here; everything else goes out as pass-through, with the path as the
    /// client sent it.
    pub(super) async fn observe(&self, arrived: Arrived, decision: Decision<'_>) -> Response<Body> {
        let (policy, method, action) = (decision.policy, decision.method, decision.action);
        let (req, peer) = (arrived.req, arrived.peer);
        let (request_id, started) = (arrived.request_id, arrived.started);
        let none = Span::none();
        let line = Line {
            method: &method,
            policy,
            request_id: &request_id,
            span: &none,
            started,
        };
        let operation = match action {
            Action::PassThrough(pass) => match pass.would() {
                Some(would) => {
                    return self
                        .forward_as_is(req.map(body::boxed), peer, &line, would, None)
                        .await
                }
                None => {
                    let res = self.pass_through(req.map(body::boxed), peer, policy).await;
                    log_request(&self.shared.metrics, &res, pass.outcome(), None, &line);
                    return res;
                }
            },
            Action::Refuse(refusal) => {
                let would = refusal.would();
                return self
                    .forward_as_is(req.map(body::boxed), peer, &line, would, None)
                    .await;
            }
            Action::Protect(operation) => operation,
        };
        let stopped = match self
            .protect(req, (&method, &operation), policy, &none, Guard::Breaker)
            .await
        {
            Verdict::Forward(won) => {
                let route: &str = policy.route.as_deref().unwrap_or("default");
                self.observed(route, rescue::EXECUTE, Some(won.claim.id), false);
                let protected = Protected {
                    claim: won.claim,
                    request: won.request,
                    policy: policy.clone(),
                    peer,
                    method: won.method,
                    request_id: request_id.clone(),
                    span: Span::none(),
                    started,
                    slot: won.slot,
                    record_at: RecordAt::AfterAnswerWithBreaker,
                    voice: Voice::Upstream,
                    allowance: None,
                };
                return self.forward_claimed(protected).await;
            }
            Verdict::Stop(stopped) => stopped,
        };
        let Stopped {
            why,
            request,
            id,
            slot,
            held,
            ..
        } = stopped;
        let (would, duplicate) = why.would();
        drop(slot);
        match why {
            // A store that failed the claim, or was not asked, may hold a failure of this
            // key that this execution's answer must replace: its answer is kept for that.
            Stop::Found {
                found,
                id,
                fingerprint,
            } if duplicate || unasked(&found) => {
                let known = Known {
                    id,
                    fingerprint,
                    found,
                };
                self.forward_duplicate(request, peer, &line, would, known)
                    .await
            }
            Stop::StoreSkipped { id, fingerprint } => {
                let why = "not asked (observe mode's store breaker)".to_string();
                let known = Known {
                    id,
                    fingerprint,
                    found: Found::Failed(StoreError::Backend(why)),
                };
                self.forward_duplicate(request, peer, &line, would, known)
                    .await
            }
            _ => {
                let res = self.forward_as_is(request, peer, &line, would, id).await;
                // What was read of a body not admitted is held until it went out.
                drop(held);
                res
            }
        }
    }

    /// Observe mode's forwarding of what enforcing would not have forwarded as it is:
    /// pass-through (streamed, unclaimed), counted as `would`.
    pub(super) async fn forward_as_is(
        &self,
        req: Request<Body>,
        peer: SocketAddr,
        line: &Line<'_>,
        would: &'static str,
        id: Option<RecordId>,
    ) -> Response<Body> {
        let route = line.policy.route.as_deref().unwrap_or("default");
        let res = self.pass_through(req, peer, line.policy).await;
        self.observed(route, would, id, false);
        log_request(&self.shared.metrics, &res, Outcome::Observed, None, line);
        res
    }

    /// Forwards a request whose record shows an execution already (completed, running or
    /// unknown, whichever instance or process made it) and tells from the record what that
    /// second execution was:
    /// - a duplicate let through when its answer is a 2xx and the record (read again once
    ///   the answer is in, when the claim did not say) holds a 2xx answer or is still
    ///   running or unknown: what enforcing would have kept from executing again;
    /// - where the record holds a failure (a status outside 2xx), this execution's answer
    ///   replaces it ([`Store::supersede`](crate::store::Store::supersede)), so that once
    ///   the route enforces a retry gets the answer of the latest execution, never the
    ///   earlier failure; it is not a duplicate.
    ///
    /// The exchange runs in a task of its own, as a claimed one does: its answer is counted
    /// even when its client hangs up first. The store is asked after the client has its
    /// answer, and what it answers counts towards the breaker.
    async fn forward_duplicate(
        &self,
        req: Request<Body>,
        peer: SocketAddr,
        line: &Line<'_>,
        would: &'static str,
        known: Known,
    ) -> Response<Body> {
        let policy = line.policy.clone();
        let route = policy.route.clone().unwrap_or_else(|| "default".into());
        let this = self.clone();
        let id = known.id;
        let superseding = Superseding {
            route: route.clone(),
            request_id: req
                .headers()
                .get(crate::request_id::X_REQUEST_ID)
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                .unwrap_or_default(),
            retention: policy.retention,
        };
        // Counted as it arrives, as every other observed request is.
        self.shared.metrics.observed(&route, would);
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.shared.tasks.spawn(async move {
            let res = this.pass_through(req, peer, &policy).await;
            let ours = res.headers().contains_key(crate::problem::IDEMGATE_ERROR);
            let (res, answer) = if ours {
                (res, None)
            } else {
                let (mut parts, body) = res.into_parts();
                match answer::read(&parts.headers, body, policy.max_response_bytes, |_| {
                    std::future::ready(())
                })
                .await {
                    Ok(Answer::Whole(bytes)) => {
                        parts.headers.remove(hyper::header::CONTENT_LENGTH);
                        let stored = super::recording::stored(&parts, bytes.clone());
                        (
                            Response::from_parts(parts, body::chunked(bytes)),
                            Some(stored),
                        )
                    }
                    Ok(Answer::TooLarge { read, rest }) => (
                        Response::from_parts(parts, body::prefixed(read, rest)),
                        None,
                    ),
                    Err(e) => {
                        tracing::warn!(record = %known.id, error = %e, "observe mode: the upstream's answer broke off");
                        let res = Reason::DuplicateBrokeOff { id: known.id }.answer();
                        (res, None)
                    }
                }
            };
            let success = !ours && res.status().is_success();
            // What the claim said of a completed record decides at once; otherwise the record
            // is read again after the client has its answer.
            let early = known
                .completed_status()
                .is_some_and(|s| (200..300).contains(&s))
                && success;
            if early {
                this.shared.metrics.observed_duplicate(&route, known.id);
            }
            // The client gets its answer now; the store is asked after.
            this.shared.metrics.duplicate_settling(true);
            let _ = tx.send(res);
            let duplicate = if early {
                true
            } else {
                let duplicate = this
                    .settle_duplicate(known, success, answer, policy.upstream_timeout, superseding)
                    .await;
                if duplicate {
                    this.shared.metrics.observed_duplicate(&route, id);
                }
                duplicate
            };
            this.log_observed(&route, would, Some(id), duplicate);
            this.shared.metrics.duplicate_settling(false);
        });
        let res = match rx.await {
            Ok(res) => res,
            Err(_) => Reason::DuplicateLost { id }.answer(),
        };
        log_request(&self.shared.metrics, &res, Outcome::Observed, None, line);
        res
    }

    /// Whether a second execution, answered `success` or not, was a duplicate, by what its
    /// record says; a recorded failure is superseded by `answer`. `owner_bound`: how long
    /// the route's upstream may take to answer (`upstream_timeout`), the longest a first
    /// execution still under way can take before its record is written.
    ///
    /// A replacement the store does not take (or a claim the store failed or was not asked,
    /// whose record may hold a failure) is written again in the background until it lands
    /// (see [`late`](super::late)): `GET /observe` counts those still pending per route.
    async fn settle_duplicate(
        &self,
        known: Known,
        success: bool,
        answer: Option<StoredResponse>,
        owner_bound: Duration,
        superseding: Superseding,
    ) -> bool {
        let store = &self.shared.store;
        let store_timeout = self.shared.settings.config.store_timeout;
        let supersede_later = |answer: StoredResponse| {
            let write = Write::Supersede {
                fingerprint: known.fingerprint,
                stored: answer,
                route: superseding.route.clone(),
            };
            let late = Late {
                id: known.id,
                request_id: superseding.request_id.clone(),
                retention: superseding.retention,
                write,
            };
            late::write_in_background(&self.shared, late);
        };
        if unasked(&known.found) {
            if let Some(answer) = answer.filter(|_| success) {
                supersede_later(answer);
            }
            return false;
        }
        let known = &known;
        let recorded = match known.completed_status() {
            Some(status) => Recorded::Completed(status),
            // Running, unknown, another request's or unreadable when claimed: as it is now
            // that this execution has its answer.
            None => {
                // Only an answer that could replace a failure waits for the record.
                let keep = answer.as_ref().filter(|_| success);
                match self.record_once_written(known, keep, owner_bound).await {
                    Some(recorded) => recorded,
                    // Unread, it may hold a failure this answer replaces.
                    None => {
                        if let Some(answer) = answer.filter(|_| success) {
                            supersede_later(answer);
                        }
                        return false;
                    }
                }
            }
        };
        match recorded {
            Recorded::Completed(status) if !(200..300).contains(&status) => {
                if let Some(answer) = answer {
                    let call = store.supersede(&known.id, &known.fingerprint, &answer);
                    match deadline(store_timeout, call).await {
                        Ok(_) => self.shared.store_failing.took(true),
                        Err(e) => {
                            tracing::warn!(record = %known.id, error = %e, "observe mode: could not replace a recorded failure with a later execution's answer; trying again in the background until it lands");
                            self.shared.store_failing.took(false);
                            supersede_later(answer);
                        }
                    }
                }
                false
            }
            Recorded::Completed(_) | Recorded::Running => success,
            Recorded::Nothing => false,
        }
    }

    /// What a duplicate's record says once the execution that holds it has written it.
    ///
    /// An execution still under way when this one has its answer (the first of a retried
    /// key, whose client may already have its answer: an observed route writes the record
    /// after it) is waited for while `keep`, this execution's answer, could replace a
    /// failure it records: for as long as its upstream may take to answer (`owner_bound`)
    /// and its record to be written, re-read at growing intervals. Read once, that failure
    /// would be written after this read and replayed once the route enforces, although a
    /// later execution succeeded. The answer kept meanwhile is taken from the buffer
    /// budget; with no room there, or still in progress when the wait ends, the record
    /// counts as running and a warning says why. `None`: the store could not be read.
    async fn record_once_written(
        &self,
        known: &Known,
        keep: Option<&StoredResponse>,
        owner_bound: Duration,
    ) -> Option<Recorded> {
        let store_timeout = self.shared.settings.config.store_timeout;
        let until = tokio::time::Instant::now() + owner_bound + store_timeout * 2;
        let mut pause = Duration::from_millis(10);
        let mut kept = self.shared.buffers.hold();
        let mut budgeted = false;
        loop {
            let read = deadline(store_timeout, self.shared.store.inspect(&known.id, false)).await;
            let view = match read {
                Ok(Some(view)) => view,
                Ok(None) => return Some(Recorded::Nothing),
                Err(e) => {
                    tracing::warn!(record = %known.id, error = %e, "observe mode: could not read the record of a duplicate");
                    self.shared.store_failing.took(false);
                    return None;
                }
            };
            let answer = match (view.state, view.status, keep) {
                (RecordState::Completed, Some(status), _) => {
                    return Some(Recorded::Completed(status))
                }
                (RecordState::InProgress, _, Some(answer)) => answer,
                _ => return Some(Recorded::Running),
            };
            budgeted = budgeted || kept.grow_if_room(answer_size(answer));
            if budgeted && tokio::time::Instant::now() + pause < until {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(250));
                continue;
            }
            let why = if budgeted {
                "the wait for it ended"
            } else {
                "the buffer budget had no room to keep this answer"
            };
            tracing::warn!(record = %known.id, why, "observe mode: the first execution of a duplicate was still recording; a failure it records later would be replayed once the route enforces");
            return Some(Recorded::Running);
        }
    }

    /// Counts (and, for what would have been refused or replayed, logs at most a few
    /// lines a second) what enforcing would have done on an observed route.
    pub(super) fn observed(
        &self,
        route: &str,
        would: &'static str,
        id: Option<RecordId>,
        duplicate: bool,
    ) {
        self.shared.metrics.observed(route, would);
        self.log_observed(route, would, id, duplicate);
    }

    /// Logs (at most a few lines a second) a would-be refusal or replay.
    fn log_observed(
        &self,
        route: &str,
        would: &'static str,
        id: Option<RecordId>,
        duplicate: bool,
    ) {
        let forwarded_anyway = would == rescue::EXECUTE || would == rescue::UNPROTECTED;
        if !forwarded_anyway && self.shared.observe_log.allow() {
            tracing::info!(
                route,
                would,
                record = id.map(|i| i.to_string()).as_deref().unwrap_or("-"),
                duplicate_let_through = duplicate,
                "observe mode: forwarded a request that enforcing would not have"
            );
        }
    }
}

/// Observe mode's view of the store after a failure: not asked at all for a second, then
/// asked by one request at a time (the others go on without it) until one gets an answer.
/// During an outage, observed requests that wait on the store are about one a second.
#[derive(Default)]
pub(super) struct Breaker {
    // `process_ms` of the last failure; 0 once the store answered again.
    failed_at: std::sync::atomic::AtomicU64,
    // `process_ms` at which the request now trying the store began; 0 for none.
    trying: std::sync::atomic::AtomicU64,
}

impl Breaker {
    /// Whether this request should go on without asking the store. While the store is
    /// healthy, one atomic load.
    pub(super) fn skip(&self, store_timeout: Duration) -> bool {
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

    /// What a store call after the client's answer found: `answered`, or it failed.
    pub(super) fn took(&self, answered: bool) {
        if answered {
            self.answered()
        } else {
            self.failed()
        }
    }

    pub(super) fn failed(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        self.failed_at
            .store(crate::admission::process_ms().max(1), Relaxed);
        self.trying.store(0, Relaxed);
    }

    /// The store answered: asked by every request again.
    pub(super) fn answered(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        if self.failed_at.load(Relaxed) != 0 {
            self.failed_at.store(0, Relaxed);
            self.trying.store(0, Relaxed);
        }
    }
}

/// The bytes an answer kept in memory takes: its body and its headers.
fn answer_size(answer: &StoredResponse) -> usize {
    let headers: usize = answer.headers.iter().map(|(n, v)| n.len() + v.len()).sum();
    answer.body.len() + headers
}

/// Whether a claim's store failed it or was not asked (its record unread): an unreadable
/// record aside, which is read as a duplicate's.
fn unasked(found: &Found) -> bool {
    matches!(found, Found::Failed(e) if !matches!(e, StoreError::Unreadable(_)))
}

/// Where an observed answer that replaces a recorded failure is counted and named, and for
/// how long it may be written.
struct Superseding {
    route: String,
    request_id: String,
    retention: Duration,
}

/// What an observed duplicate's claim found, kept for after its answer.
struct Known {
    id: RecordId,
    fingerprint: crate::fingerprint::Fingerprint,
    found: Found,
}

impl Known {
    /// The status of the completed record the claim found (its answer kept or not), if it
    /// found one.
    fn completed_status(&self) -> Option<u16> {
        match &self.found {
            Found::Store(Claim::Replay(r)) => Some(r.status),
            Found::Store(Claim::NotKept { status } | Claim::NoRoom { status }) => Some(*status),
            _ => None,
        }
    }
}

/// What a record holds once a duplicate has its answer.
enum Recorded {
    /// Completed, with this status (its answer kept or not).
    Completed(u16),
    /// In progress or unknown: an execution that may have happened.
    Running,
    /// No record (expired, released, or the store lost it).
    Nothing,
}

/// At most [`RateLimit::PER_SECOND`] events a second.
#[derive(Default)]
pub(super) struct RateLimit(std::sync::atomic::AtomicU64);

impl RateLimit {
    const PER_SECOND: u64 = 10;

    pub(super) fn allow(&self) -> bool {
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
