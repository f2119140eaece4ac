//! What the clients saw: counted as they go, read once at the end of a run.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

/// What the clients saw during one run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ClientTally {
    /// Every request put on the wire, including those hung up on.
    pub requests_sent: u64,
    /// Requests repeated with the same key and body after a timeout, a hang-up, an error or
    /// idemgate's 409 in-progress (the second click and the correction are not retries).
    pub retries: u64,
    /// Requests the impatient clients gave up on.
    pub timeouts: u64,
    /// Requests written to a socket that was closed before the answer.
    pub hang_ups: u64,
    /// 2xx answers carrying `Idempotent-Replayed: true`.
    pub replays: u64,
    /// The bank's own 409/422 (insufficient funds), first-hand or replayed.
    pub bank_409_422: u64,
    /// idemgate's 409 while the first request was still running.
    pub idemgate_409_in_progress: u64,
    /// idemgate's 422: same key, different body.
    pub idemgate_422_mismatch: u64,
    /// Any other idemgate problem (outcome-unknown, store-unavailable, ...).
    pub idemgate_other_errors: u64,
    /// Other unexpected statuses and transport errors.
    pub other_errors: u64,
    /// Teller corrections whose new amount the bank executed (the direct run's failure).
    pub corrections_executed: u64,
    /// Teller corrections answered with a 2xx replay of the old transfer: the silent replay
    /// the correction must never get.
    pub silent_replays: u64,
    /// Intents that never got a final answer within `max_attempts`.
    pub unresolved: u64,
}

#[derive(Default)]
pub(super) struct Counters {
    pub(super) requests_sent: AtomicU64,
    pub(super) retries: AtomicU64,
    pub(super) timeouts: AtomicU64,
    pub(super) hang_ups: AtomicU64,
    pub(super) replays: AtomicU64,
    pub(super) bank_409_422: AtomicU64,
    pub(super) idemgate_409_in_progress: AtomicU64,
    pub(super) idemgate_422_mismatch: AtomicU64,
    pub(super) idemgate_other_errors: AtomicU64,
    pub(super) other_errors: AtomicU64,
    pub(super) corrections_executed: AtomicU64,
    pub(super) silent_replays: AtomicU64,
    pub(super) unresolved: AtomicU64,
}

pub(super) fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

impl Counters {
    pub(super) fn tally(&self) -> ClientTally {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        ClientTally {
            requests_sent: get(&self.requests_sent),
            retries: get(&self.retries),
            timeouts: get(&self.timeouts),
            hang_ups: get(&self.hang_ups),
            replays: get(&self.replays),
            bank_409_422: get(&self.bank_409_422),
            idemgate_409_in_progress: get(&self.idemgate_409_in_progress),
            idemgate_422_mismatch: get(&self.idemgate_422_mismatch),
            idemgate_other_errors: get(&self.idemgate_other_errors),
            other_errors: get(&self.other_errors),
            corrections_executed: get(&self.corrections_executed),
            silent_replays: get(&self.silent_replays),
            unresolved: get(&self.unresolved),
        }
    }
}
