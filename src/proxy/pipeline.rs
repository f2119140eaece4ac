//! The body stage of a protected request, run once for both modes: admission, the body
//! read within its budget, a slot, the body step (content, fingerprint, record id), the
//! scope secret, and the claim. It ends in a [`Verdict`]: forward the claimed request, or
//! stop it for a reason. Enforcing answers the verdict; observing forwards the request as
//! it was sent and counts what the verdict says (see `enforce.rs`, `observe.rs`).
//!
//! Where the modes guard the store and the memory differently, the stage is told which
//! [`Guard`] it runs under; nothing else in it differs by mode.

use std::sync::Arc;

use hyper::body::Incoming;
use hyper::{Method, Request};
use tracing::Span;

use crate::admission::{Buffered, Refusal as NotAdmitted, Slot};
use crate::body::{self, Body};
use crate::config::Policy;
use crate::connection::OfConnection;
use crate::fingerprint::Fingerprint;
use crate::key::RecordId;
use crate::scope::Tenant;
use crate::store::{Claim, ClaimRequest, StoreError};

use super::allowance::Allowance;
use super::body_read::read_up_to;
use super::claim::Found;
use super::decision::{self, Operation, Refusal};
use super::Proxy;

/// What guards the store and the memory around a claim, by mode.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Guard {
    /// Enforcing: a request of a connection or tenant that holds its share of the buffer
    /// budget is stopped before its claim, and a claim's replay finds room in that share
    /// first; a store that answers ends a spell of store failures (the `Retry-After` of
    /// their 503s).
    Shares,
    /// Observing: a store that just failed is not asked again for a moment (the breaker),
    /// and what each claim finds tells the breaker.
    Breaker,
}

/// What the body stage says of a protected request.
pub(super) enum Verdict {
    /// The claim is this request's: forward it and record its answer.
    Forward(Won),
    /// Enforcing would not forward it, for a reason.
    Stop(Stopped),
}

/// A won claim, with what its exchange needs.
pub(super) struct Won {
    pub(super) claim: ClaimRequest,
    pub(super) request: Request<Body>,
    /// The method scoped (a declared body `_method`'s, where there is one).
    pub(super) method: Method,
    pub(super) slot: Slot,
    /// Under [`Guard::Shares`]: what its answer holds of the buffer budget and of its
    /// connection's and tenant's shares.
    pub(super) allowance: Option<Arc<Allowance>>,
}

/// A request the body stage stopped, with what either mode needs to act on it.
pub(super) struct Stopped {
    pub(super) why: Stop,
    /// The request as it came, its body what was read of it (and the rest, when reading
    /// stopped early).
    pub(super) request: Request<Body>,
    /// Its record id, once its body was identified.
    pub(super) id: Option<RecordId>,
    /// The method scoped, once known (else the head's).
    pub(super) method: Method,
    /// Held while the claim's answer is acted on: a request forwarded unprotected when
    /// the store fails (`on_store_error = "forward"`) keeps its slot.
    pub(super) slot: Option<Slot>,
    /// What was read of the body, held of the budget of held bodies.
    pub(super) held: Option<Buffered>,
    /// Under [`Guard::Shares`], once taken: where a replay's body finds room.
    pub(super) allowance: Option<Arc<Allowance>>,
}

/// Why the body stage stopped a request.
pub(super) enum Stop {
    /// Refused from the request itself or for want of room, before any claim.
    Refused(Refusal),
    /// The store breaker is open: the claim of record `id` was not tried (observing
    /// only).
    StoreSkipped {
        id: RecordId,
        /// The fingerprint the claim would have been made under.
        fingerprint: Fingerprint,
    },
    /// The claim of record `id` found something other than a free key.
    Found {
        found: Found,
        id: RecordId,
        /// The fingerprint the claim was made under.
        fingerprint: Fingerprint,
    },
}

impl Proxy {
    /// Runs a protected request's body stage (see the module's doc) under `guard`: the
    /// head is `req`'s, `method` and the operation what its decision protects it as.
    pub(super) async fn protect(
        &self,
        req: Request<Incoming>,
        (method, operation): (&Method, &Operation),
        policy: &Policy,
        span: &Span,
        guard: Guard,
    ) -> Verdict {
        let method = method.clone();
        let (parts, body, slot) = match self.admit_body(req, &method, policy).await {
            Ok(admitted) => admitted,
            Err(verdict) => return verdict,
        };
        // The fingerprint is taken over a coded body's content; the upstream still gets
        // the body as sent.
        let identified = self
            .identify(policy, &method, operation, &parts, &body)
            .await;
        let mut identified = match identified {
            Ok(identified) => identified,
            Err(why) => {
                drop(slot);
                let request = Request::from_parts(parts, body::full(body));
                return stop_refused(why, request, method, None, None, None);
            }
        };
        let claim_id = identified.id;
        let id = Some(claim_id);
        // While answers wait for their clients, the budget, this connection's share or
        // this tenant's is taken: new work of theirs waits for it (503, retry later) rather
        // than memory growing. Other connections and tenants keep being served.
        let allowance = if guard == Guard::Shares {
            let allowance = self.allowance(&parts.extensions, &operation.tenant);
            if let Some(why) = allowance.refusal() {
                drop(slot);
                let request = Request::from_parts(parts, body::full(body));
                let why = Refusal::Overloaded(why);
                return stop_refused(why, request, method, id, None, None);
            }
            let most = usize::try_from(policy.max_response_bytes).unwrap_or(usize::MAX);
            let inline = crate::limits::REPLAY_INLINE.min(most);
            identified.replay_room = Some(allowance.for_claim(inline));
            Some(allowance)
        } else {
            None
        };
        let method = identified.method.clone();
        let request = Request::from_parts(parts, body::full(body.clone()));
        // Checked at the last moment before the claim: a disagreement found while the body
        // was arriving still stops this request.
        if !self.shared.secret.agreed() {
            drop(slot);
            return stop_refused(Refusal::SecretDisagrees, request, method, id, None, None);
        }
        // Observing, a store that just failed is not asked again for a second, then by one
        // request at a time until it answers: during an outage about one observed request
        // a second waits on it (at most `store_timeout`), not each.
        let store_timeout = self.shared.settings.config.store_timeout;
        if guard == Guard::Breaker && self.shared.store_failing.skip(store_timeout) {
            drop(slot);
            return Verdict::Stop(Stopped {
                why: Stop::StoreSkipped {
                    id: claim_id,
                    fingerprint: identified.fingerprint,
                },
                request,
                id,
                method,
                slot: None,
                held: None,
                allowance,
            });
        }
        let (claim, found) = self
            .claim_guarded(
                identified, &request, &body, &method, operation, policy, span,
            )
            .await;
        self.guard_after(guard, &found);
        if let Found::Store(Claim::Claimed) = found {
            return Verdict::Forward(Won {
                claim,
                request,
                method,
                slot,
                allowance,
            });
        }
        let why = Stop::Found {
            found,
            id: claim_id,
            fingerprint: claim.fingerprint,
        };
        Verdict::Stop(Stopped {
            why,
            request,
            id,
            method,
            slot: Some(slot),
            held: None,
            allowance,
        })
    }

    /// A protected request's body, read within its budget, and its slot; or the verdict
    /// that stops it first.
    async fn admit_body(
        &self,
        req: Request<Incoming>,
        method: &Method,
        policy: &Policy,
    ) -> Result<(hyper::http::request::Parts, bytes::Bytes, Slot), Verdict> {
        let method = method.clone();
        // Beyond the slots and a full queue, stopped before the body is read: a refusal
        // must cost little, or the clients it sends away (and straight back) take the CPU
        // the admitted ones need.
        if self.shared.protected.would_refuse() {
            let why = Refusal::Overloaded(NotAdmitted::QueueFull);
            return Err(stop_refused(
                why,
                req.map(body::boxed),
                method,
                None,
                None,
                None,
            ));
        }
        // Both read the head alone: a body refused for them is never read, nor decoded.
        let too_large = decision::declared_too_large(req.headers(), policy.max_body_bytes);
        let too_many = || decision::too_many_codings(req.headers(), policy.max_content_codings);
        if let Some(why) = too_large.or_else(too_many) {
            return Err(stop_refused(
                why,
                req.map(body::boxed),
                method,
                None,
                None,
                None,
            ));
        }
        // The body is read before a slot is taken, so that slow clients hold no slot:
        // bodies still arriving are bounded by `max_buffered_bytes` (counting what has
        // arrived, never a declared length up front) and `body_read_timeout`. One that
        // grows beyond, breaks or stalls is stopped with what was read of it.
        let (parts, mut incoming) = req.into_parts();
        let mut held = self.shared.buffers.hold();
        let limit = usize::try_from(policy.max_body_bytes).unwrap_or(usize::MAX);
        let timeout = self.shared.settings.config.body_read_timeout;
        let (read, ended) = read_up_to(&mut incoming, limit, &mut held, 0, timeout).await;
        if let Err(end) = ended {
            let request = Request::from_parts(parts, body::prefixed(read.chunks, incoming));
            let why = end.refusal(policy.max_body_bytes);
            return Err(stop_refused(why, request, method, None, None, Some(held)));
        }
        drop(incoming);
        let body = read.into_bytes();
        // The slot is taken before the claim: once a key is claimed, nothing waits for a
        // slot or is refused for want of one.
        let slot = match super::admit(&self.shared.protected, &parts.extensions).await {
            Ok(slot) => slot,
            Err(why) => {
                let request = Request::from_parts(parts, body::full(body));
                let why = Refusal::Overloaded(why);
                return Err(stop_refused(why, request, method, None, None, Some(held)));
            }
        };
        // Admitted: the body now counts against `max_in_flight`, not the arrival budget.
        drop(held);
        Ok((parts, body, slot))
    }

    /// What a protected request of the connection whose request extensions are
    /// `extensions`, for `tenant`, may hold of the buffer budget.
    fn allowance(&self, extensions: &hyper::http::Extensions, tenant: &Tenant) -> Arc<Allowance> {
        let config = &self.shared.settings.config;
        let connection = extensions
            .get::<OfConnection>()
            .map(|c| (c.holdings.clone(), config.buffered_share_per_connection()));
        let tenant = (
            self.shared.tenants.holdings(tenant.as_bytes()),
            config.buffered_share_per_tenant(),
        );
        Allowance::new(&self.shared.buffers, connection, tenant)
    }

    /// What a claim's result tells the guard: a store that answers ends a spell of store
    /// failures (enforcing), or closes the breaker (observing), which a failure opens.
    fn guard_after(&self, guard: Guard, found: &Found) {
        match guard {
            Guard::Shares => match found {
                Found::Store(Claim::Withdrawn) | Found::ReleasePending | Found::Failed(_) => {}
                Found::Store(_) | Found::WritePending => self.shared.store_outage.ended(),
            },
            Guard::Breaker => match found {
                Found::Failed(e)
                    if !matches!(e, StoreError::Full(_) | StoreError::Unreadable(_)) =>
                {
                    self.shared.store_failing.failed()
                }
                _ => self.shared.store_failing.answered(),
            },
        }
    }
}

/// The verdict on a request refused before its claim.
fn stop_refused(
    why: Refusal,
    request: Request<Body>,
    method: Method,
    id: Option<RecordId>,
    slot: Option<Slot>,
    held: Option<Buffered>,
) -> Verdict {
    Verdict::Stop(Stopped {
        why: Stop::Refused(why),
        request,
        id,
        method,
        slot,
        held,
        allowance: None,
    })
}
