//! A duplicate that waits for the first request of its key (`in_progress_wait`): when its
//! claim finds the first still running on an enforcing route, it waits, holding its client
//! connection but no slot, and claims again each time it is woken (the record settled on
//! this instance or, by a message, on another), the first's lease runs out, a shared
//! store's poll interval passes, or the wait does. What the last claim finds is answered as
//! if the duplicate had come after the first: the replay, what the record says, or a free
//! key that it now runs itself. A wait that runs out, a full `max_waiting` and a shutdown
//! answer 409 `in-progress` as without a wait.

use std::time::Duration;

use hyper::{Method, Request};
use tokio::time::Instant;
use tracing::Span;

use crate::admission::Slot;
use crate::body::Body;
use crate::config::Policy;
use crate::connection::OfConnection;
use crate::metrics::{WaitEnd, Waits};
use crate::store::{Claim, ClaimRequest, StoreKind};

use super::claim::{Found, Identified};
use super::decision::{Operation, Refusal};
use super::pipeline::Guard;
use super::Proxy;

/// The shortest sleep before a claim again at the end of the first's lease: a store whose
/// clock runs a little behind still reads it as running, and is not asked in a loop.
const LEASE_END_MARGIN: Duration = Duration::from_millis(10);

/// What the first claim of a waiting duplicate found, and what it holds.
pub(super) struct First {
    pub(super) claim: ClaimRequest,
    pub(super) found: Found,
    pub(super) slot: Slot,
}

/// What a wait ends with: the last claim, what it found, and the slot it holds (always
/// one when it won the claim).
pub(super) type Waited = (ClaimRequest, Found, Option<Slot>);

/// Whether a claim that found `found` waits on `policy` under `guard`.
pub(super) fn waits(guard: Guard, policy: &Policy, found: &Found) -> bool {
    guard == Guard::Shares
        && !policy.in_progress_wait.is_zero()
        && matches!(found, Found::Store(Claim::InFlight { .. }))
}

impl Proxy {
    /// Waits for the first request of `identified`'s key (see the module's doc). Refused
    /// only when no slot is free for the claim after a wake.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn wait_for_first(
        &self,
        identified: &Identified,
        first: First,
        request: &Request<Body>,
        body: &[u8],
        method: &Method,
        operation: &Operation,
        policy: &Policy,
        span: &Span,
    ) -> Result<Waited, Refusal> {
        let waiters = &self.shared.waiters;
        let started = Instant::now();
        let mut counted = Counted {
            waits: self.shared.metrics.waits(),
            started,
            waiting: false,
        };
        let Some(waiting) = waiters.enter() else {
            counted.end(WaitEnd::Full);
            return Ok((first.claim, first.found, Some(first.slot)));
        };
        counted.enter();
        let until = started + policy.in_progress_wait;
        let watch = waiting.watch(identified.id);
        let hangup = request
            .extensions()
            .get::<OfConnection>()
            .and_then(|c| c.hangup.clone());
        // A store that instances share may be settled by another: asked again every poll
        // interval, in case its message is lost.
        let poll = matches!(
            self.shared.store.kind(),
            StoreKind::Redis | StoreKind::Postgres
        )
        .then(|| waiters.poll());
        // The first claim's answer is asked again at once, now that a settling record would
        // wake this one.
        drop((first.claim, first.found));
        let mut slot = Some(first.slot);
        let (claim, found, end) = loop {
            // Watched before the claim: a record that settles after it wakes this one.
            let notified = watch.signal.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if slot.is_none() {
                match super::admit(&self.shared.protected, request.extensions()).await {
                    Ok(s) => slot = Some(s),
                    Err(why) => {
                        counted.end(WaitEnd::Overloaded);
                        return Err(Refusal::Overloaded(why));
                    }
                }
            }
            let (claim, found) = self
                .claim_guarded(identified, request, body, method, operation, policy, span)
                .await;
            self.guard_after(Guard::Shares, &found);
            let Found::Store(Claim::InFlight { lease_left }) = found else {
                break (claim, found, WaitEnd::Settled);
            };
            let now = Instant::now();
            if now >= until {
                break (claim, found, WaitEnd::TimedOut);
            }
            // Waiting holds no slot.
            slot = None;
            let mut wake = until.min(now + lease_left.max(LEASE_END_MARGIN));
            if let Some(poll) = poll {
                wake = wake.min(now + poll);
            }
            let gone = async {
                match &hangup {
                    Some(h) => h.gone().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = &mut notified => {}
                () = tokio::time::sleep_until(wake) => {}
                () = waiters.closed() => break (claim, found, WaitEnd::Shutdown),
                () = gone => break (claim, found, WaitEnd::Gone),
            }
        };
        drop(watch);
        counted.end(end);
        Ok((claim, found, slot))
    }
}

/// One duplicate's wait in the metrics. Dropped before its end (its request's future
/// dropped: an HTTP/2 client that reset its stream), it is counted as ended by the client.
struct Counted {
    waits: Waits,
    started: Instant,
    // Shown in `idemgate_in_progress_waiting` now.
    waiting: bool,
}

impl Counted {
    fn enter(&mut self) {
        self.waits.waiting(true);
        self.waiting = true;
    }

    fn end(&mut self, end: WaitEnd) {
        self.waits.ended(end, self.started.elapsed().as_secs_f64());
        if self.waiting {
            self.waits.waiting(false);
            self.waiting = false;
        }
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        if self.waiting {
            self.end(WaitEnd::Gone);
        }
    }
}
