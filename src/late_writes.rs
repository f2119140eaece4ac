//! Records whose write this instance is still trying: an answer the upstream gave (or, on
//! an observed route, a later execution's answer superseding a recorded failure) that the
//! store did not take when it was first written.
//!
//! The request ran and its client has its answer; only the record is missing. Until the
//! write lands the claim stays in progress under its lease, then reads `unknown` to other
//! instances; a retry reaching this instance is told to wait (409 `in-progress`), never that
//! its outcome is unknown. Each write is tried again in the background with growing pauses
//! until it lands, the claim is no longer the writer's, or the record's retention ends.
//! The answers wait in memory, counted in `max_buffered_bytes` (see the proxy's
//! `late` module); at most [`MAX_PENDING`] at once, and on shutdown those left are logged
//! with what completes them by hand. Shared by every serving thread of the instance.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;

use crate::key::RecordId;

/// Writes pending at most. One beyond is logged as given up: its record reads `unknown`
/// once its lease runs out (never executed twice). Their answers count in the buffer
/// budget; this bounds the bookkeeping of those kept as their status alone (about 200 bytes
/// each: 20 MB at most).
pub const MAX_PENDING: usize = 100_000;

/// What a pending write puts in its record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// The answer, whole.
    Answer,
    /// The answer's status alone (no room in the budget, or in the store, for its body).
    StatusAlone,
    /// An observed route's later answer, replacing a recorded failure.
    Supersede,
}

/// One pending write, as the shutdown log names it.
#[derive(Clone, Debug)]
pub struct Pending {
    pub id: RecordId,
    pub status: u16,
    pub request_id: String,
    pub kind: Kind,
}

/// The series of pending writes.
#[derive(Clone, Default)]
pub struct LateMetrics {
    /// `idemgate_record_writes_pending`.
    pub pending: Gauge,
    /// `process_ms` (+1) at which the oldest pending write was queued; 0 for none. The
    /// metrics read it into `idemgate_record_writes_oldest_pending_seconds` when scraped.
    pub oldest_ms: Arc<AtomicU64>,
    /// `idemgate_record_writes_landed_total`: writes that landed on a later try.
    pub landed: Counter,
    /// `idemgate_record_writes_given_up_total`: writes given up (too many pending, the
    /// retention ended, or shut down first).
    pub given_up: Counter,
}

struct Entry {
    pending: Pending,
    since_ms: u64,
}

#[derive(Default)]
struct Inner {
    next: u64,
    // By place: in the order they were queued, so the first is the oldest.
    entries: BTreeMap<u64, Entry>,
    // Pending writes per record id (several requests of one key count apart).
    ids: HashMap<RecordId, usize>,
}

/// The pending writes of one instance.
pub struct LateWrites {
    inner: Mutex<Inner>,
    // `entries.len()`, read without the lock: nearly always 0.
    count: AtomicUsize,
    metrics: LateMetrics,
}

/// A pending write's place in [`LateWrites`], given back by [`LateWrites::done`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place(u64);

/// How a pending write ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// It landed.
    Landed,
    /// The claim was no longer the writer's: nothing to write.
    NotOurs,
    /// Given up (the retention ended).
    GivenUp,
}

impl LateWrites {
    /// None pending, counted into `metrics`.
    pub fn new(metrics: LateMetrics) -> LateWrites {
        LateWrites {
            inner: Mutex::default(),
            count: AtomicUsize::new(0),
            metrics,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn counted(&self, inner: &Inner) {
        let len = inner.entries.len();
        self.count.store(len, Ordering::Relaxed);
        self.metrics
            .pending
            .set(i64::try_from(len).unwrap_or(i64::MAX));
        let oldest = inner.entries.values().next().map_or(0, |e| e.since_ms + 1);
        self.metrics.oldest_ms.store(oldest, Ordering::Relaxed);
    }

    /// Notes a write as pending; `None` (and counted as given up) when [`MAX_PENDING`] are
    /// already.
    pub fn add(&self, pending: Pending) -> Option<Place> {
        let mut inner = self.lock();
        if inner.entries.len() >= MAX_PENDING {
            drop(inner);
            self.metrics.given_up.inc();
            return None;
        }
        let place = inner.next;
        inner.next += 1;
        *inner.ids.entry(pending.id).or_default() += 1;
        let since_ms = crate::admission::process_ms();
        inner.entries.insert(place, Entry { pending, since_ms });
        self.counted(&inner);
        Some(Place(place))
    }

    /// The write of `place` ended as `how`.
    pub fn done(&self, place: Place, how: Ended) {
        let mut inner = self.lock();
        // Gone already when shutdown gave it up (and counted it).
        let Some(e) = inner.entries.remove(&place.0) else {
            return;
        };
        let id = e.pending.id;
        if let Some(n) = inner.ids.get_mut(&id) {
            *n -= 1;
            if *n == 0 {
                inner.ids.remove(&id);
            }
        }
        self.counted(&inner);
        drop(inner);
        match how {
            Ended::Landed => {
                self.metrics.landed.inc();
            }
            Ended::GivenUp => self.given_up(),
            Ended::NotOurs => {}
        }
    }

    /// Counts a write given up before it was queued.
    pub fn given_up(&self) {
        self.metrics.given_up.inc();
    }

    /// Whether this instance still has a write pending for record `id`.
    pub fn is_pending(&self, id: &RecordId) -> bool {
        self.count.load(Ordering::Relaxed) > 0 && self.lock().ids.contains_key(id)
    }

    /// How many writes are pending.
    pub fn len(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The pending writes, oldest first, for the shutdown log; each is counted as given up.
    pub fn give_up_all(&self) -> Vec<Pending> {
        let mut inner = self.lock();
        let left: Vec<Pending> = std::mem::take(&mut inner.entries)
            .into_values()
            .map(|e| e.pending)
            .collect();
        inner.ids.clear();
        self.counted(&inner);
        drop(inner);
        self.metrics.given_up.inc_by(left.len() as u64);
        left
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pending(n: u8) -> Pending {
        Pending {
            id: RecordId::from_bytes([n; 32]),
            status: 201,
            request_id: format!("r{n}"),
            kind: Kind::Answer,
        }
    }

    #[test]
    fn tracks_what_is_pending_and_how_it_ended() {
        let m = LateMetrics::default();
        let w = LateWrites::new(m.clone());
        let one = RecordId::from_bytes([1; 32]);
        assert!(!w.is_pending(&one));
        let a = w.add(pending(1)).unwrap();
        let b = w.add(pending(1)).unwrap();
        let c = w.add(pending(2)).unwrap();
        assert!(w.is_pending(&one) && w.len() == 3 && m.pending.get() == 3);
        assert_ne!(m.oldest_ms.load(Ordering::Relaxed), 0);
        w.done(a, Ended::Landed);
        assert!(w.is_pending(&one), "the other write of the key is pending");
        w.done(b, Ended::NotOurs);
        assert!(!w.is_pending(&one));
        w.done(c, Ended::GivenUp);
        assert!(w.is_empty() && m.pending.get() == 0);
        assert_eq!(m.oldest_ms.load(Ordering::Relaxed), 0);
        assert_eq!((m.landed.get(), m.given_up.get()), (1, 1));
    }

    #[test]
    fn shutdown_takes_what_is_left_as_given_up() {
        let m = LateMetrics::default();
        let w = LateWrites::new(m.clone());
        w.add(pending(1)).unwrap();
        w.add(pending(2)).unwrap();
        let left = w.give_up_all();
        assert_eq!(
            left.iter()
                .map(|p| p.request_id.as_str())
                .collect::<Vec<_>>(),
            ["r1", "r2"]
        );
        assert!(w.is_empty() && m.given_up.get() == 2);
    }
}
