//! Claims this instance is taking back: claims that were never forwarded (their answer
//! lost, the store unreachable, the client gone before the claim's answer came) and whose
//! owner-checked release has not landed yet.
//!
//! While its instance lives, such a release is tried again until it lands, however long
//! the store stays away: a claim that was never forwarded must end released, never read
//! as `unknown` once its lease runs out. The set is what the instance knows meanwhile: a
//! retry of a key in it is told to wait (503), not that its outcome is unknown, and on
//! shutdown those that could not be taken back are logged by record id, as safe to release.
//! Bounded ([`MAX_PENDING`]), shared by every serving thread of the instance.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use prometheus_client::metrics::gauge::Gauge;

use crate::key::RecordId;

/// Releases pending at most. A claim beyond them is logged as safe to release and left to
/// read as `unknown` once its lease runs out (never executed twice): at about 100 bytes
/// each, this many cost about 10 MB, and a store away long enough to pile them up has every
/// new key refused at its claim meanwhile.
pub const MAX_PENDING: usize = 100_000;

/// The pending releases of one instance.
pub struct Releases {
    // Claims of one key by several requests (each its own owner) count apart.
    ids: Mutex<HashMap<RecordId, usize>>,
    // `ids.len()`, read without the lock: nearly always 0.
    count: AtomicUsize,
    // `idemgate_pending_releases`.
    gauge: Gauge,
}

impl Releases {
    /// Pending releases, shown in `gauge`.
    pub fn new(gauge: Gauge) -> Releases {
        Releases {
            ids: Mutex::default(),
            count: AtomicUsize::new(0),
            gauge,
        }
    }

    fn counted(&self, len: usize) {
        self.count.store(len, Ordering::Relaxed);
        self.gauge.set(i64::try_from(len).unwrap_or(i64::MAX));
    }

    /// Notes a release as pending; false when [`MAX_PENDING`] are already.
    pub fn add(&self, id: RecordId) -> bool {
        let Ok(mut ids) = self.ids.lock() else {
            return false;
        };
        if ids.len() >= MAX_PENDING {
            return false;
        }
        *ids.entry(id).or_default() += 1;
        self.counted(ids.len());
        true
    }

    /// The release landed.
    pub fn remove(&self, id: &RecordId) {
        if let Ok(mut ids) = self.ids.lock() {
            if let Some(n) = ids.get_mut(id) {
                *n -= 1;
                if *n == 0 {
                    ids.remove(id);
                }
            }
            self.counted(ids.len());
        }
    }

    /// Whether this instance is still taking back a claim of `id`.
    pub fn is_pending(&self, id: &RecordId) -> bool {
        self.count.load(Ordering::Relaxed) > 0
            && self.ids.lock().is_ok_and(|ids| ids.contains_key(id))
    }

    /// How many keys have one pending.
    pub fn len(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The pending ones, for the shutdown log.
    pub fn ids(&self) -> Vec<RecordId> {
        self.ids
            .lock()
            .map(|ids| ids.keys().copied().collect())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u8) -> RecordId {
        RecordId::from_bytes([n; 32])
    }

    #[test]
    fn tracks_what_is_pending() {
        let r = Releases::new(Gauge::default());
        assert!(!r.is_pending(&id(1)));
        assert!(r.add(id(1)));
        assert!(r.add(id(2)));
        assert!(r.add(id(1)), "a second claim of the same key");
        assert!(r.is_pending(&id(1)) && r.len() == 2 && r.gauge.get() == 2);
        r.remove(&id(1));
        assert!(
            r.is_pending(&id(1)),
            "the other claim's release is still pending"
        );
        r.remove(&id(1));
        assert!(!r.is_pending(&id(1)) && r.is_pending(&id(2)));
        assert_eq!(r.ids(), vec![id(2)]);
    }
}
