//! The store wrapper that times every call and counts its failures.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Metrics, StoreOp};
use crate::key::RecordId;
use crate::store::{renew_deadline, Call, OwnerToken, Store, StoreError, StoreFuture};

/// A [`Store`] that times every call and counts its failures. Callers put their own deadline
/// around each call and drop the call when it passes, so a call dropped unfinished after its
/// deadline counts as failed; one dropped earlier (a lease renewal that lost the race to the
/// upstream's answer) was merely not needed and counts as nothing.
pub struct Instrumented {
    inner: Arc<dyn Store>,
    metrics: Arc<Metrics>,
    store_timeout: Duration,
}

impl Instrumented {
    /// Wraps `inner`; `store_timeout` is the deadline callers put around its calls.
    pub fn new(inner: Arc<dyn Store>, metrics: Arc<Metrics>, store_timeout: Duration) -> Self {
        Instrumented {
            inner,
            metrics,
            store_timeout,
        }
    }

    fn timed<'a, T: Send + 'a>(
        &'a self,
        op: StoreOp,
        deadline: Duration,
        call: StoreFuture<'a, T>,
    ) -> StoreFuture<'a, T> {
        let guard = CallGuard {
            metrics: &self.metrics,
            op,
            started: Instant::now(),
            deadline,
            done: false,
        };
        Box::pin(async move {
            // Moves the whole guard in (a field-wise capture would leave it, and its Drop,
            // behind in this function).
            let mut guard = guard;
            let r = call.await;
            guard.done = true;
            guard
                .metrics
                .store_call(op, guard.started.elapsed(), r.is_err());
            if writes(op) {
                match &r {
                    Ok(_) => guard.metrics.signals().wrote(None),
                    Err(
                        e @ (StoreError::Backend(_) | StoreError::Full(_) | StoreError::Timeout(_)),
                    ) => {
                        guard.metrics.signals().wrote(Some(e.to_string()));
                    }
                    // A record's contents, not the store's.
                    Err(_) => {}
                }
            }
            r
        })
    }
}

/// Whether `op` writes to the store: its result says whether the store takes writes
/// (`idemgate_store_writable`, `/readyz`'s body).
fn writes(op: StoreOp) -> bool {
    matches!(
        op,
        StoreOp::Claim
            | StoreOp::Record
            | StoreOp::Renew
            | StoreOp::Release
            | StoreOp::MarkUnknown
            | StoreOp::Delete
    )
}

/// Settles the metrics of a store call that was dropped before it finished.
struct CallGuard<'a> {
    metrics: &'a Metrics,
    op: StoreOp,
    started: Instant,
    deadline: Duration,
    done: bool,
}

impl Drop for CallGuard<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let elapsed = self.started.elapsed();
        if elapsed >= self.deadline {
            self.metrics.store_call(self.op, elapsed, true);
            if writes(self.op) {
                let e = StoreError::Timeout(self.deadline);
                self.metrics.signals().wrote(Some(e.to_string()));
            }
        }
    }
}

impl crate::store::Layer for Instrumented {
    fn inner(&self) -> &dyn Store {
        &*self.inner
    }

    fn around<'a, T: Send + 'a>(
        &'a self,
        call: Call,
        future: StoreFuture<'a, T>,
    ) -> StoreFuture<'a, T> {
        let op = match call {
            Call::Claim => StoreOp::Claim,
            Call::Record | Call::Shorten | Call::RecordNotKept => StoreOp::Record,
            Call::Release => StoreOp::Release,
            Call::Inspect => StoreOp::Inspect,
            Call::Delete => StoreOp::Delete,
            Call::Ping => StoreOp::Ping,
            // Operators' and start-up's calls, and the ones stated below.
            _ => return future,
        };
        self.timed(op, self.store_timeout, future)
    }

    fn renew<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        lease: Duration,
    ) -> StoreFuture<'a, bool> {
        let deadline = renew_deadline(self.store_timeout, lease);
        self.timed(StoreOp::Renew, deadline, self.inner.renew(id, owner, lease))
    }

    fn mark_unknown<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
    ) -> StoreFuture<'a, bool> {
        let call = self.timed(
            StoreOp::MarkUnknown,
            self.store_timeout,
            self.inner.mark_unknown(id, owner),
        );
        Box::pin(async move {
            let r = call.await;
            if matches!(r, Ok(true)) {
                self.metrics.records_unknown.inc();
            }
            r
        })
    }
}
