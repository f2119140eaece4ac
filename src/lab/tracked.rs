//! The lab's store: the configured one, plus a list of every record the lab's idemgate
//! claimed, so that a lab run on someone's Redis deletes what it wrote when it ends instead
//! of leaving thousands of records behind for a day of retention.
//!
//! It wraps the [`Store`] trait rather than scanning Redis for a key pattern: the lab's
//! records are found by their ids whatever the store makes of an id, and nothing that the
//! lab did not claim itself is ever touched.
//!
//! On a bad day it is also where the embedded store freezes: while frozen, every store call
//! waits (and the proxy's deadline around it runs out), as calls to a stalled Redis do.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::key::RecordId;
use crate::store::{
    deadline, BoxFuture, Call, Claim, ClaimRequest, Layer, Store, StoreError, StoreFuture,
};

/// A store that remembers the ids of the records claimed through it.
pub struct Tracked {
    inner: Arc<dyn Store>,
    // Every id a claim created; a retry's claim finds the record and adds nothing.
    claimed: Mutex<HashSet<RecordId>>,
    // True while the store is frozen.
    frozen: tokio::sync::watch::Sender<bool>,
}

impl Tracked {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Store>) -> Tracked {
        Tracked {
            inner,
            claimed: Mutex::new(HashSet::new()),
            frozen: tokio::sync::watch::Sender::new(false),
        }
    }

    /// Freezes (`true`) or thaws the store: frozen, every call waits until it thaws.
    pub fn freeze(&self, frozen: bool) {
        self.frozen.send_replace(frozen);
    }

    /// How many records the lab has claimed so far.
    pub fn claimed(&self) -> usize {
        self.claimed.lock().map(|c| c.len()).unwrap_or(0)
    }

    /// Deletes every record claimed through this store, each within `timeout`. Returns how
    /// many could not be deleted (the store did not answer).
    pub async fn remove_all(&self, timeout: Duration) -> usize {
        let ids: Vec<RecordId> = match self.claimed.lock() {
            Ok(mut c) => c.drain().collect(),
            Err(_) => return 0,
        };
        let mut failed = 0;
        for id in ids {
            // Forced: the lab's idemgate has stopped, so no owner is still working on them.
            if deadline(timeout, self.inner.delete(&id, true, false))
                .await
                .is_err()
            {
                failed += 1;
            }
        }
        failed
    }
}

impl Layer for Tracked {
    fn inner(&self) -> &dyn Store {
        &*self.inner
    }

    fn around<'a, T: Send + 'a>(
        &'a self,
        call: Call,
        future: BoxFuture<'a, Result<T, StoreError>>,
    ) -> BoxFuture<'a, Result<T, StoreError>> {
        let _ = call;
        let mut frozen = self.frozen.subscribe();
        Box::pin(async move {
            let _ = frozen.wait_for(|f| !*f).await;
            future.await
        })
    }

    fn claim<'a>(&'a self, req: &'a ClaimRequest) -> StoreFuture<'a, Claim> {
        Box::pin(async move {
            let mut frozen = self.frozen.subscribe();
            let _ = frozen.wait_for(|f| !*f).await;
            // Noted before the call: a claim whose answer is lost may still have landed.
            if let Ok(mut c) = self.claimed.lock() {
                c.insert(req.id);
            }
            self.inner.claim(req).await
        })
    }
}
