//! Enforcing a decision: pass through, refuse, or take a protected request through its
//! body stage (`pipeline.rs`) and act on the verdict: forward a won claim, replay a recorded
//! answer, or answer why not (`rescue.rs`).

use std::net::SocketAddr;

use hyper::{Request, Response};
use tracing::Span;

use crate::admission::Refusal as NotAdmitted;
use crate::body::{self, Body};
use crate::outcome::Outcome;
use crate::request_id;
use crate::store::{BodyRoom, StoreError};
use crate::telemetry;

use super::claim::Found;
use super::decision::{Action, Decision, Operation, Refusal};
use super::exchange::{Protected, RecordAt, Voice};
use super::pipeline::{Guard, Stop, Stopped, Verdict, Won};
use super::replay::replay;
use super::rescue::{Reply, Wait};
use super::{log_request, Arrived, Line, Proxy};

impl Proxy {
    /// Acts on a decision: forwards what passes through, answers a refusal, and takes a
    /// protected request through its body stage, then forwards and records it, replays
    /// its record, or answers why not.
    pub(super) async fn enforce(&self, arrived: Arrived, decision: Decision<'_>) -> Response<Body> {
        let (policy, method, action) = (decision.policy, decision.method, decision.action);
        let Arrived {
            req,
            peer,
            request_id,
            started,
        } = arrived;
        let span = if decision.traced {
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
        match self
            .protect(req, (&method, &operation), policy, &span, Guard::Shares)
            .await
        {
            Verdict::Forward(won) => {
                let Won {
                    claim,
                    mut request,
                    method,
                    slot,
                    allowance,
                } = won;
                set_forward_path(&mut request, &operation);
                // The room taken for a replay's body goes back: the answer is counted as
                // it comes.
                if let Some(allowance) = &allowance {
                    allowance.reserve(0);
                }
                let protected = Protected {
                    claim,
                    request,
                    policy: policy.clone(),
                    peer,
                    method,
                    request_id: request_id.clone(),
                    span: span.clone(),
                    started,
                    slot,
                    record_at: RecordAt::of(policy),
                    voice: Voice::Record,
                    allowance,
                };
                self.forward_claimed(protected).await
            }
            Verdict::Stop(stopped) => self.answer_stop(stopped, &operation, peer, &line).await,
        }
    }

    /// Enforcing's answer to a request its body stage stopped: a refusal, a replay, or what
    /// the claim found, counted and logged.
    async fn answer_stop(
        &self,
        stopped: Stopped,
        operation: &Operation,
        peer: SocketAddr,
        line: &Line<'_>,
    ) -> Response<Body> {
        let Stopped {
            why,
            mut request,
            method,
            slot,
            held,
            allowance,
            ..
        } = stopped;
        // What was read of a body not admitted goes back before the answer says how long
        // to wait for room.
        drop(held);
        let (found, id) = match why {
            Stop::Refused(refusal) => return self.refuse(&refusal, line),
            Stop::Found { found, id, .. } => (found, id),
            // Not a guard of enforcing: as a store that did not answer.
            Stop::StoreSkipped { id, .. } => {
                (Found::Failed(StoreError::Backend(String::new())), id)
            }
        };
        let policy = line.policy;
        let (reply, outcome) = found.reply(id, policy, |wait| match wait {
            Wait::Outage => self.shared.store_outage.refused(),
            Wait::StoreRoom => {
                self.shared.metrics.refused_store_full().inc();
                self.store_free_in(policy)
            }
        });
        let overloaded = |why| self.overloaded(why, &self.shared.protected);
        let (res, outcome) = match reply {
            Reply::Answer(reason) => (reason.answer(), outcome),
            // A replay's body counts against the buffer budget, its connection's share
            // and its tenant's until it is written (taken by its size before the store
            // read it; what was taken before the claim beyond it goes back here): clients
            // that stop reading large answers hold at most their share, and beyond it
            // their further replays get 503 while other connections and tenants keep
            // being served.
            Reply::Replay(stored) => match allowance {
                Some(a) if a.reserve(stored.body.len()) => {
                    (replay(stored).map(|b| body::holding(b, a)), outcome)
                }
                a => {
                    let why = a.map_or(NotAdmitted::BuffersFull, |a| a.refused());
                    (overloaded(why), Outcome::Overloaded)
                }
            },
            Reply::NoRoom => {
                let why = allowance.map_or(NotAdmitted::BuffersFull, |a| a.refused());
                (overloaded(why), outcome)
            }
            Reply::Unprotected => {
                set_forward_path(&mut request, operation);
                (self.pass_through(request, peer, policy).await, outcome)
            }
            // Never: the body stage forwards a won claim itself.
            Reply::Forward => (super::rescue::Reason::Panicked.answer(), outcome),
        };
        drop(slot);
        let line = Line {
            method: &method,
            ..*line
        };
        log_request(&self.shared.metrics, &res, outcome, Some(id), &line);
        res
    }

    /// Seconds until a full store should have room: the route's typical upstream time when
    /// requests in flight hold reserved room, else the soonest expiry (at most a day), else 1.
    fn store_free_in(&self, policy: &crate::config::Policy) -> u64 {
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
}

/// The path enforcing forwards `request` with: the one its route folds it to, if any.
fn set_forward_path<B>(request: &mut Request<B>, operation: &Operation) {
    if let Some(p) = &operation.forward_path {
        set_path(request.uri_mut(), p);
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
