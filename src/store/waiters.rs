//! Duplicates waiting for the first request of their key (`in_progress_wait`), and what
//! wakes them: one [`Waiters`] per instance, shared by every serving thread.
//!
//! A waiting duplicate watches its record id here, then claims again; when the claim still
//! finds the first running, it sleeps until it is woken, the first's lease runs out, the
//! poll interval passes (shared stores only) or its wait does, and claims once more. It is
//! woken by [`Waiters::wake`], which this instance calls after each of its own store
//! writes that can settle a record (see [`Waking`]) and, for a store that instances share,
//! on each message that another instance settled one (Redis's channel, PostgreSQL's
//! `NOTIFY`). A wake is only a hint to claim again: the claim decides.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::{BoxFuture, Completed, Deleted, Layer, OwnerToken, Store, StoreError, StoredResponse};
use crate::fingerprint::Fingerprint;
use crate::key::RecordId;

/// The waiting duplicates of one instance.
pub struct Waiters {
    // Each watched record's signal, and how many watch it.
    watched: Mutex<HashMap<RecordId, (Arc<Notify>, usize)>>,
    // `watched.len()`, read without the lock: nearly always 0, so a write that settles a
    // record costs nothing more when nobody waits.
    count: AtomicUsize,
    // Duplicates waiting now, and at most (`max_waiting`).
    waiting: AtomicUsize,
    max: usize,
    // Cancelled at shutdown: the waiting ones are answered 409.
    closing: CancellationToken,
    // Set by the first duplicate that waits: a shared store's listener connects only then,
    // so that an instance whose routes never wait holds no listening connection, and
    // receives no message.
    wanted: AtomicBool,
    first: Notify,
    poll: Duration,
}

impl Waiters {
    /// At most `max` waiting at once; a shared store is asked again every `poll` when no
    /// message comes.
    pub fn new(max: usize, poll: Duration) -> Waiters {
        Waiters {
            watched: Mutex::default(),
            count: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            max,
            closing: CancellationToken::new(),
            wanted: AtomicBool::new(false),
            first: Notify::new(),
            poll,
        }
    }

    /// A place among the waiting, or `None` when `max_waiting` are waiting already.
    pub fn enter(self: &Arc<Self>) -> Option<Waiting> {
        let entered = self
            .waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max).then_some(n + 1)
            });
        entered.ok()?;
        if !self.wanted.swap(true, Ordering::AcqRel) {
            self.first.notify_one();
        }
        Some(Waiting {
            waiters: self.clone(),
        })
    }

    /// Wakes whoever watches record `id`: its record may have settled.
    pub fn wake(&self, id: &RecordId) {
        if self.count.load(Ordering::Acquire) == 0 {
            return;
        }
        let watched = self.watched.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((notify, _)) = watched.get(id) {
            notify.notify_waiters();
        }
    }

    /// Resolves once a duplicate has waited on this instance.
    pub async fn wanted(&self) {
        while !self.wanted.load(Ordering::Acquire) {
            self.first.notified().await;
        }
    }

    /// Wakes every waiting duplicate: messages of records settled may have been lost.
    pub fn wake_all(&self) {
        if self.count.load(Ordering::Acquire) == 0 {
            return;
        }
        let watched = self.watched.lock().unwrap_or_else(|e| e.into_inner());
        for (notify, _) in watched.values() {
            notify.notify_waiters();
        }
    }

    /// Answers every waiting duplicate (409): the instance is shutting down.
    pub fn close(&self) {
        self.closing.cancel();
    }

    /// Resolves once the instance is shutting down.
    pub async fn closed(&self) {
        self.closing.cancelled().await;
    }

    /// How often a shared store is asked again when no message comes.
    pub fn poll(&self) -> Duration {
        self.poll
    }

    /// The waiting ones now.
    pub fn len(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    /// Whether none is waiting.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A duplicate's place among the waiting: given back when dropped.
pub struct Waiting {
    waiters: Arc<Waiters>,
}

impl Waiting {
    /// Watches record `id`: [`Watch::signal`]'s `notified()` resolves on its next wake.
    pub fn watch(&self, id: RecordId) -> Watch {
        let w = &self.waiters;
        let mut watched = w.watched.lock().unwrap_or_else(|e| e.into_inner());
        let entry = watched
            .entry(id)
            .or_insert_with(|| (Arc::new(Notify::new()), 0));
        entry.1 += 1;
        let signal = entry.0.clone();
        w.count.store(watched.len(), Ordering::Release);
        Watch {
            waiters: w.clone(),
            id,
            signal,
        }
    }

    /// The instance's waiters.
    pub fn waiters(&self) -> &Waiters {
        &self.waiters
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.waiters.waiting.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One duplicate's watch of one record: no longer watched when dropped.
pub struct Watch {
    waiters: Arc<Waiters>,
    id: RecordId,
    /// Notified on each wake of the record.
    pub signal: Arc<Notify>,
}

impl Drop for Watch {
    fn drop(&mut self) {
        let mut watched = self
            .waiters
            .watched
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(entry) = watched.get_mut(&self.id) {
            entry.1 -= 1;
            if entry.1 == 0 {
                watched.remove(&self.id);
            }
        }
        self.waiters.count.store(watched.len(), Ordering::Release);
    }
}

/// A store that wakes this instance's waiting duplicates after each of its writes that
/// can settle a record: an answer recorded, a claim released or marked unknown, an
/// operator's release or completion. Woken whatever the write answered: the duplicate's
/// claim decides.
pub struct Waking {
    inner: Arc<dyn Store>,
    waiters: Arc<Waiters>,
}

impl Waking {
    /// `inner`, waking `waiters`.
    pub fn new(inner: Arc<dyn Store>, waiters: Arc<Waiters>) -> Waking {
        Waking { inner, waiters }
    }

    fn waking<'a, T: Send + 'a>(
        &'a self,
        id: &'a RecordId,
        write: BoxFuture<'a, Result<T, StoreError>>,
    ) -> BoxFuture<'a, Result<T, StoreError>> {
        Box::pin(async move {
            let done = write.await;
            self.waiters.wake(id);
            done
        })
    }
}

impl Layer for Waking {
    fn inner(&self) -> &dyn Store {
        &*self.inner
    }

    fn record<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        response: &'a StoredResponse,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.waking(id, self.inner.record(id, owner, response))
    }

    fn record_not_kept<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        status: u16,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.waking(id, self.inner.record_not_kept(id, owner, status))
    }

    fn mark_unknown<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.waking(id, self.inner.mark_unknown(id, owner))
    }

    fn release<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        linger: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.waking(id, self.inner.release(id, owner, linger))
    }

    fn delete<'a>(
        &'a self,
        id: &'a RecordId,
        force: bool,
    ) -> BoxFuture<'a, Result<Deleted, StoreError>> {
        self.waking(id, self.inner.delete(id, force))
    }

    fn complete<'a>(
        &'a self,
        id: &'a RecordId,
        response: &'a StoredResponse,
        force: bool,
    ) -> BoxFuture<'a, Result<Completed, StoreError>> {
        self.waking(id, self.inner.complete(id, response, force))
    }

    fn supersede<'a>(
        &'a self,
        id: &'a RecordId,
        fingerprint: &'a Fingerprint,
        response: &'a StoredResponse,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.waking(id, self.inner.supersede(id, fingerprint, response))
    }
}
