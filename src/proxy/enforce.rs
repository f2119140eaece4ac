//! Enforcing a decision: pass through, refuse, or take a protected request through body,
//! fingerprint and claim, then act on what the claim found (forward, replay, 409, 422).

use std::sync::Arc;

use hyper::{Request, Response};
use tracing::Span;

use crate::admission::Refusal as Refused;
use crate::body::{self, Body};
use crate::config::{OnStoreError, Policy};
use crate::connection::OfConnection;
use crate::outcome::Outcome;
use crate::problem::Problem;
use crate::request_id;
use crate::retry_after;
use crate::scope::Tenant;
use crate::store::BodyRoom;
use crate::store::{Claim, StoreError};
use crate::telemetry;

use super::claim::Found;
use super::decision::{Action, Decision, Refusal};
use super::exchange::Protected;
use super::replay::replay;
use super::room::Room;
use super::{log_request, Arrived, Line, Proxy};

impl Proxy {
    /// Acts on a decision: forwards what passes through, answers a refusal, and takes a
    /// protected request through body, fingerprint, claim, forward and record (or replay).
    pub(super) async fn enforce(&self, arrived: Arrived, decision: Decision<'_>) -> Response<Body> {
        let (policy, method, action) = (decision.policy, decision.method, decision.action);
        let Arrived {
            req,
            peer,
            request_id,
            started,
        } = arrived;
        let traced = decision.traced;
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
                let res = self.pass_through(req.map(body::boxed), peer, policy).await;
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
        let slot = match super::admit(&self.shared.protected, &parts.extensions).await {
            Ok(slot) => slot,
            Err(why) => return self.refuse(&Refusal::Overloaded(why), &line),
        };
        // Admitted: the body now counts against `max_in_flight`, not the arrival budget.
        drop(buffered);
        // The fingerprint is taken over a coded body's content; the upstream still gets the
        // body as sent.
        let mut identified = match self
            .identify(policy, &method, &operation, &parts, &body)
            .await
        {
            Ok(identified) => identified,
            Err(refusal) => return self.refuse(&refusal, &line),
        };
        // While answers wait for their clients, the budget, this connection's share or this
        // tenant's is taken: new work of theirs waits for it (503, retry later) rather than
        // memory growing. Other connections and tenants keep being served.
        let room = self.room(&parts.extensions, &operation.tenant);
        if let Some(why) = room.refusal() {
            return self.refuse(&Refusal::Overloaded(why), &line);
        }
        let most = usize::try_from(policy.max_response_bytes).unwrap_or(usize::MAX);
        let inline = crate::limits::REPLAY_INLINE.min(most);
        identified.room = Some(room.for_claim(inline));
        // The method scoped (a declared body `_method`'s, where there is one).
        let method = identified.method.clone();
        // Checked at the last moment before the claim: a disagreement found while the body
        // was arriving still refuses this request.
        if !self.shared.secret.agreed() {
            return self.refuse(&Refusal::SecretDisagrees, &line);
        }
        let request = Request::from_parts(parts, body::full(body.clone()));
        let (claim, found) = self
            .claim_guarded(
                identified, &request, &body, &method, &operation, policy, &span,
            )
            .await;
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
            room: Some(room),
        };
        self.settle(found, protected).await
    }

    /// The room of a protected request of the connection whose request extensions are
    /// `extensions`, for `tenant`.
    fn room(&self, extensions: &hyper::http::Extensions, tenant: &Tenant) -> Arc<Room> {
        let config = &self.shared.settings.config;
        let connection = extensions
            .get::<OfConnection>()
            .map(|c| (c.holdings.clone(), config.buffered_share_per_connection()));
        let tenant = (
            self.shared.tenants.holdings(tenant.as_bytes()),
            config.buffered_share_per_tenant(),
        );
        Room::new(&self.shared.buffers, connection, tenant)
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

    /// Enforcing's answer to a refusal, counted and logged.
    pub(super) fn refuse(&self, refusal: &Refusal, line: &Line<'_>) -> Response<Body> {
        let res = refusal.response(|why| self.overloaded(why, &self.shared.protected));
        log_request(&self.shared.metrics, &res, refusal.outcome(), None, line);
        res
    }

    /// Acts on the claim's answer: forwards a won claim, answers the others.
    pub(super) async fn settle(&self, found: Found, protected: Protected) -> Response<Body> {
        let id = protected.claim.id;
        // A store that answers ends a spell of store failures; one that fails tells its
        // refused clients to wait as long as the spell has lasted.
        let outage = &self.shared.store_outage;
        match &found {
            Found::Store(Claim::Withdrawn) | Found::ReleasePending | Found::Failed(_) => {}
            Found::Store(_) => outage.ended(),
        }
        let (res, outcome) = match found {
            Found::Store(Claim::OtherVersion(version)) => (
                Problem::InProgress.response(
                    format!("this key's record was made by an idemgate with fingerprint version {version}, which this instance does not know; retry (an up-to-date instance will answer)"),
                    Some(&id),
                    Some(1),
                ),
                Outcome::InProgress,
            ),
            Found::Store(Claim::Claimed) => {
                // The room taken for a replay's body goes back: the answer is counted as
                // it comes.
                if let Some(room) = &protected.room {
                    room.reserve(0);
                }
                return self.forward_claimed(protected).await;
            }
            // A replay's body counts against the buffer budget, its connection's share
            // and its tenant's until it is written (taken by its size before the store read
            // it; what the room taken before the claim held beyond it goes back here):
            // clients that stop reading large answers hold at most their share, and beyond
            // it their further replays get 503 while other connections and tenants keep
            // being served.
            Found::Store(Claim::Replay(stored)) => match protected.room {
                Some(room) if room.reserve(stored.body.len()) => (
                    replay(stored).map(|b| body::holding(b, room)),
                    Outcome::Replayed,
                ),
                room => {
                    let why = room.map_or(Refused::BuffersFull, |r| r.refused());
                    (self.overloaded(why, &self.shared.protected), Outcome::Overloaded)
                }
            },
            Found::Store(Claim::NoRoom { .. }) => {
                let why = protected.room.map_or(Refused::BuffersFull, |r| r.refused());
                (self.overloaded(why, &self.shared.protected), Outcome::Overloaded)
            }
            Found::Store(Claim::NotKept { status }) => (
                Problem::ResponseNotStored.response(
                    format!("this request was executed once and answered with status {status}, but the answer was larger than max_response_bytes (or did not fit in the store) and was not kept, so it cannot be replayed; it will not be sent again"),
                    Some(&id),
                    None,
                ),
                Outcome::NotStored,
            ),
            Found::Store(Claim::InFlight { lease_left }) => {
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
            Found::Store(Claim::Mismatch) => (
                Problem::FingerprintMismatch.response(
                    "this key was used with a different request (method, path, query, content type or body); use a new key for a new operation",
                    Some(&id),
                    None,
                ),
                Outcome::Mismatch,
            ),
            // Only a claim that reached the store after its own release can find this, and
            // nobody waits for that one; it was not forwarded either way.
            Found::Store(Claim::Withdrawn) => (
                Problem::StoreUnavailable.response(
                    "the idempotency store answered too late; the request was not forwarded",
                    Some(&id),
                    Some(outage.refused()),
                ),
                Outcome::StoreError,
            ),
            Found::ReleasePending => (
                Problem::StoreUnavailable.response(
                    "a claim of this key that was never forwarded is still being taken back; retry",
                    Some(&id),
                    Some(outage.refused()),
                ),
                Outcome::StoreError,
            ),
            Found::Store(Claim::Unknown) => (
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
            Found::Failed(StoreError::Unreadable(why)) => {
                tracing::error!(record = %id, error = %why, "recorded answer cannot be read");
                let res = Problem::RecordUnreadable.response(
                    "this request was executed once and its recorded answer cannot be read (its encryption key is no longer configured); it will not be executed again",
                    Some(&id),
                    None,
                );
                (res, Outcome::StoreError)
            }
            // Taken back already, where it may have landed (see `claim_guarded`).
            Found::Failed(e) => {
                tracing::warn!(record = %id, error = %e, "claim failed");
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
                        Some(outage.refused()),
                    );
                    (res, Outcome::StoreError)
                } else {
                    let res = self.pass_through(protected.request, protected.peer, &protected.policy).await;
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
}

/// Replaces a URI's path, keeping its query.
pub(super) fn set_path(uri: &mut hyper::Uri, path: &str) {
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
