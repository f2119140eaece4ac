//! The embedded store: the same semantics as Redis, in this process's memory. For one
//! instance and for trying idemgate out: records do not survive a restart and are not shared.

use std::collections::{BTreeSet, HashMap};

use bytes::Bytes;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::{
    BoxFuture, Claim, ClaimRequest, OwnerToken, RecordState, RecordView, Store, StoreError,
    StoredResponse,
};
use crate::fingerprint::Fingerprint;
use crate::key::RecordId;

/// The in-memory store. Cheap to clone; clones share the records.
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

struct Inner {
    records: Mutex<Records>,
    // A cap, so a client that floods distinct keys gets 503s instead of exhausting memory.
    max_records: usize,
}

/// How many expired records one lock hold removes at most. Removing one costs a B-tree pop
/// and a hash-map removal (well under a microsecond), so a batch keeps the lock for a
/// fraction of a millisecond however many records expire at once.
const EXPIRE_BATCH: usize = 1024;

/// The records and their expiry index, behind the one lock so the two cannot disagree.
///
/// Without the index, dropping expired records meant walking the whole map under the lock
/// (`retain`): milliseconds per sweep with a few hundred thousand records, however few had
/// expired, and at the cap every new claim paid that walk, so a flood of new keys at the
/// cap slowed every request down. With it, removing expired records costs
/// O(expired · log n) and finding that none have expired costs one look at the index's
/// first item.
struct Records {
    map: HashMap<RecordId, Entry>,
    /// `(expires, id)` of every entry in `map`, soonest first. An ordered set rather than a
    /// binary heap so that releasing or deleting a record removes its item too: the index
    /// never holds more items than the map, and never needs an O(n) rebuild to shed stale
    /// ones. Kept exact by going through [`Records::insert`] and [`Records::remove`].
    by_expiry: BTreeSet<(Instant, RecordId)>,
}

impl Records {
    fn insert(&mut self, id: RecordId, entry: Entry) {
        let expires = entry.expires;
        // The old item goes before the new one is added: both may carry the same instant.
        if let Some(old) = self.map.insert(id, entry) {
            self.by_expiry.remove(&(old.expires, id));
        }
        self.by_expiry.insert((expires, id));
    }

    fn remove(&mut self, id: &RecordId) -> Option<Entry> {
        let e = self.map.remove(id)?;
        self.by_expiry.remove(&(e.expires, *id));
        Some(e)
    }

    /// Removes up to `limit` records expired at `now`, soonest first; returns how many index
    /// items it took. Fewer than `limit` means none expired at `now` are left.
    fn remove_expired(&mut self, now: Instant, limit: usize) -> usize {
        let mut taken = 0;
        while taken < limit {
            let Some(&(expires, id)) = self.by_expiry.first() else {
                break;
            };
            if expires > now {
                break;
            }
            self.by_expiry.pop_first();
            taken += 1;
            // The index is exact, so the entry is the one this item was made for; checking
            // its own expiry anyway means an item that somehow outlived its entry can never
            // take a live record with it.
            if self.map.get(&id).is_some_and(|e| e.expires <= now) {
                self.map.remove(&id);
            }
        }
        taken
    }

    fn len(&self) -> usize {
        self.map.len()
    }
}

struct Entry {
    state: State,
    fingerprint: Fingerprint,
    fingerprint_version: u16,
    owner: OwnerToken,
    created: SystemTime,
    // Retention: the record is gone (as if never made) from this instant. Set only when the
    // entry is made: the expiry index holds a copy, so changing it in place would leave the
    // index pointing at the wrong instant.
    expires: Instant,
}

enum State {
    InProgress { lease_until: Instant },
    Completed(StoredResponse),
    Unknown,
}

impl MemoryStore {
    /// An empty store that holds at most `max_records` live records.
    pub fn new(max_records: usize) -> MemoryStore {
        MemoryStore {
            inner: Arc::new(Inner {
                records: Mutex::new(Records {
                    map: HashMap::new(),
                    by_expiry: BTreeSet::new(),
                }),
                max_records,
            }),
        }
    }

    /// Drops expired records; returns how many are left. Called periodically by the server.
    /// (At the cap, a claim drops expired records itself.) Works in batches of
    /// [`EXPIRE_BATCH`], letting go of the lock between them, so requests wait for at most
    /// one batch however many records expire at once.
    pub fn sweep(&self) -> usize {
        let now = Instant::now();
        loop {
            if let Some(left) = self.sweep_batch(now) {
                return left;
            }
            // A plain unlock-relock could take the lock straight back from threads waiting
            // for it.
            std::thread::yield_now();
        }
    }

    /// One batch of [`sweep`](Self::sweep): `Some(records left)` once none expired at `now`
    /// remain, `None` if there may be more.
    fn sweep_batch(&self, now: Instant) -> Option<usize> {
        let mut records = self.lock();
        let taken = records.remove_expired(now, EXPIRE_BATCH);
        (taken < EXPIRE_BATCH).then(|| records.len())
    }

    /// Sweeps expired records every `period` in a background task, which ends when the last
    /// clone of the store is dropped.
    pub fn spawn_sweeper(&self, period: Duration) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(&self.inner);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.tick().await;
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else { return };
                let store = MemoryStore { inner };
                // As `sweep`, but yielding to the runtime between batches, so the sweep
                // does not hold a worker thread either.
                let now = Instant::now();
                while store.sweep_batch(now).is_none() {
                    tokio::task::yield_now().await;
                }
            }
        })
    }

    /// Number of records held, expired or not.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no records are held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> MutexGuard<'_, Records> {
        // A panic while holding the lock cannot leave a record half-written (every update
        // is a single assignment, or map and index updates that run no code of ours that
        // could panic), so a poisoned lock is still consistent.
        self.inner.records.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Number of items in the expiry index.
    #[cfg(test)]
    fn index_len(&self) -> usize {
        self.lock().by_expiry.len()
    }

    fn claim_now(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        let now = Instant::now();
        let mut records = self.lock();
        if let Some(e) = records.map.get(&req.id).filter(|e| e.expires > now) {
            if e.fingerprint_version != req.fingerprint_version {
                return Ok(Claim::OtherVersion(e.fingerprint_version));
            }
            if e.fingerprint != req.fingerprint {
                return Ok(Claim::Mismatch);
            }
            return Ok(match &e.state {
                State::Completed(r) => Claim::Replay(r.clone()),
                State::InProgress { lease_until } if *lease_until > now => Claim::InFlight {
                    lease_left: *lease_until - now,
                },
                State::InProgress { .. } | State::Unknown => Claim::Unknown,
            });
        }
        if records.len() >= self.inner.max_records {
            // Soonest expiry first: if any record has expired, this frees at least one slot.
            // Bounded, so a flood at the cap costs each claim at most one batch.
            records.remove_expired(now, EXPIRE_BATCH);
            if records.len() >= self.inner.max_records {
                return Err(StoreError::Full(format!(
                    "the embedded store holds its maximum of {} records (memory_max_records)",
                    self.inner.max_records
                )));
            }
        }
        records.insert(
            req.id,
            Entry {
                state: State::InProgress {
                    lease_until: now + req.lease,
                },
                fingerprint: req.fingerprint,
                fingerprint_version: req.fingerprint_version,
                owner: req.owner.clone(),
                created: SystemTime::now(),
                expires: now + req.retention,
            },
        );
        Ok(Claim::Claimed)
    }

    /// Runs `f` on the live record if `owner` owns it.
    fn with_owned(
        &self,
        id: &RecordId,
        owner: &OwnerToken,
        f: impl FnOnce(&mut Entry, Instant) -> bool,
    ) -> bool {
        let now = Instant::now();
        let mut records = self.lock();
        match records.map.get_mut(id) {
            Some(e) if e.expires > now && e.owner == *owner => f(e, now),
            _ => false,
        }
    }
}

fn ready<'a, T: Send + 'a>(v: T) -> BoxFuture<'a, T> {
    Box::pin(std::future::ready(v))
}

impl Store for MemoryStore {
    fn claim<'a>(&'a self, req: &'a ClaimRequest) -> BoxFuture<'a, Result<Claim, StoreError>> {
        ready(self.claim_now(req))
    }

    fn record<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        response: &'a StoredResponse,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        // Copied, not cloned: the body is usually a slice of the upstream connection's read
        // buffer, and holding that slice would keep the whole buffer (kilobytes) alive for
        // the record's retention, and make hyper allocate a fresh buffer for the next read.
        let stored = StoredResponse {
            status: response.status,
            headers: response
                .headers
                .iter()
                .map(|(n, v)| (n.clone(), Bytes::copy_from_slice(v)))
                .collect(),
            body: Bytes::copy_from_slice(&response.body),
        };
        ready(Ok(self.with_owned(id, owner, move |e, _| {
            e.state = State::Completed(stored);
            true
        })))
    }

    fn renew<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        lease: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        ready(Ok(self.with_owned(id, owner, |e, now| match e.state {
            State::InProgress { .. } => {
                e.state = State::InProgress {
                    lease_until: now + lease,
                };
                true
            }
            _ => false,
        })))
    }

    fn mark_unknown<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        ready(Ok(self.with_owned(id, owner, |e, _| match e.state {
            State::Completed(_) => false,
            _ => {
                e.state = State::Unknown;
                true
            }
        })))
    }

    fn release<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        let now = Instant::now();
        let mut records = self.lock();
        let owned = matches!(records.map.get(id), Some(e) if e.expires > now && e.owner == *owner);
        if owned {
            records.remove(id);
        }
        ready(Ok(owned))
    }

    fn inspect<'a>(
        &'a self,
        id: &'a RecordId,
        with_body: bool,
    ) -> BoxFuture<'a, Result<Option<RecordView>, StoreError>> {
        let now = Instant::now();
        let records = self.lock();
        let view = records.map.get(id).filter(|e| e.expires > now).map(|e| {
            let (state, lease_left, status, body) = match &e.state {
                State::InProgress { lease_until } if *lease_until > now => (
                    RecordState::InProgress,
                    Some((*lease_until - now).as_millis() as u64),
                    None,
                    None,
                ),
                State::InProgress { .. } | State::Unknown => {
                    (RecordState::Unknown, None, None, None)
                }
                State::Completed(r) => (
                    RecordState::Completed,
                    None,
                    Some(r.status),
                    with_body.then(|| String::from_utf8_lossy(&r.body).into_owned()),
                ),
            };
            RecordView {
                id: id.to_string(),
                state,
                created_ms: e
                    .created
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_millis() as u64)
                    .unwrap_or(0),
                lease_left_ms: lease_left,
                ttl_ms: Some((e.expires - now).as_millis() as u64),
                fingerprint: e.fingerprint.to_hex(),
                fingerprint_version: e.fingerprint_version,
                status,
                body,
            }
        });
        ready(Ok(view))
    }

    fn delete<'a>(&'a self, id: &'a RecordId) -> BoxFuture<'a, Result<bool, StoreError>> {
        let now = Instant::now();
        let removed = self.lock().remove(id).is_some_and(|e| e.expires > now);
        ready(Ok(removed))
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        ready(Ok(()))
    }

    fn kind(&self) -> &'static str {
        "memory"
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn a_record_does_not_keep_the_buffer_its_body_came_from() {
        let store = MemoryStore::new(10);
        let req = ClaimRequest {
            id: RecordId::from_hex(&"07".repeat(32)).expect("hex"),
            fingerprint: Fingerprint([1; 32]),
            fingerprint_version: 1,
            owner: OwnerToken::random(),
            lease: Duration::from_secs(10),
            retention: Duration::from_secs(60),
        };
        assert_eq!(store.claim(&req).await.ok(), Some(Claim::Claimed));
        let buffer = Bytes::from(vec![b'x'; 8192]);
        let response = StoredResponse {
            status: 201,
            headers: vec![("content-type".into(), buffer.slice(0..16))],
            body: buffer.slice(16..80),
        };
        assert_eq!(
            store.record(&req.id, &req.owner, &response).await.ok(),
            Some(true)
        );
        let Ok(Claim::Replay(stored)) = store.claim(&req).await else {
            panic!("expected a replay");
        };
        assert_eq!(stored, response);
        let range = buffer.as_ptr_range();
        assert!(!range.contains(&stored.body.as_ptr()));
        assert!(!range.contains(&stored.headers[0].1.as_ptr()));
    }

    fn claim_req(n: u32, retention: Duration) -> ClaimRequest {
        let mut id = [0u8; 32];
        id[..4].copy_from_slice(&n.to_be_bytes());
        ClaimRequest {
            id: RecordId::from_hex(&hex::encode(id)).expect("hex"),
            fingerprint: Fingerprint([1; 32]),
            fingerprint_version: 1,
            owner: OwnerToken::random(),
            lease: Duration::from_secs(10),
            retention,
        }
    }

    const SHORT: Duration = Duration::from_millis(30);
    const LONG: Duration = Duration::from_secs(600);
    /// Comfortably past `SHORT`, even on a loaded machine.
    const PAST_SHORT: Duration = Duration::from_millis(80);

    #[tokio::test]
    async fn sweep_removes_exactly_the_expired_records() {
        let store = MemoryStore::new(100_000);
        // More expiring records than one batch, so the sweep has to come back for more.
        let expiring = EXPIRE_BATCH as u32 * 2 + 10;
        for n in 0..expiring {
            assert_eq!(
                store.claim(&claim_req(n, SHORT)).await.ok(),
                Some(Claim::Claimed)
            );
        }
        let live: Vec<_> = (1_000_000..1_000_020).map(|n| claim_req(n, LONG)).collect();
        for req in &live {
            assert_eq!(store.claim(req).await.ok(), Some(Claim::Claimed));
        }
        // Released with a long retention, then made again with a short one: the released
        // incarnation's expiry must not keep the new one alive, nor be left in the index.
        let again = claim_req(2_000_000, LONG);
        assert_eq!(store.claim(&again).await.ok(), Some(Claim::Claimed));
        assert_eq!(
            store.release(&again.id, &again.owner).await.ok(),
            Some(true)
        );
        let again = claim_req(2_000_000, SHORT);
        assert_eq!(store.claim(&again).await.ok(), Some(Claim::Claimed));

        tokio::time::sleep(PAST_SHORT).await;
        // Made again under the ids of records that have expired (not yet swept), now with a
        // long retention: the first incarnations' expiry must not take the new ones along.
        let reborn: Vec<_> = (0..5).map(|n| claim_req(n, LONG)).collect();
        for req in &reborn {
            assert_eq!(store.claim(req).await.ok(), Some(Claim::Claimed));
        }
        assert_eq!(store.len(), expiring as usize + live.len() + 1);

        let left = store.sweep();
        assert_eq!(left, live.len() + reborn.len());
        assert_eq!(store.len(), left);
        assert_eq!(store.index_len(), left);
        for req in live.iter().chain(&reborn) {
            let view = store.inspect(&req.id, false).await.ok().flatten();
            assert!(view.is_some_and(|v| v.state == RecordState::InProgress));
        }
        for n in [5, expiring - 1, 2_000_000] {
            let req = claim_req(n, LONG);
            assert!(store.inspect(&req.id, false).await.ok().flatten().is_none());
        }
        // Nothing more to do; the reborn records stay.
        assert_eq!(store.sweep(), left);
    }

    #[tokio::test]
    async fn at_the_cap_a_claim_makes_room_from_expired_records_only() {
        let store = MemoryStore::new(3);
        for (n, retention) in [(1, SHORT), (2, SHORT), (3, LONG)] {
            assert_eq!(
                store.claim(&claim_req(n, retention)).await.ok(),
                Some(Claim::Claimed)
            );
        }
        // Full, and none expired yet.
        assert!(matches!(
            store.claim(&claim_req(4, LONG)).await,
            Err(StoreError::Full(_))
        ));
        tokio::time::sleep(PAST_SHORT).await;
        // Two have expired; no sweep has run: the claims take their places.
        assert_eq!(
            store.claim(&claim_req(4, LONG)).await.ok(),
            Some(Claim::Claimed)
        );
        assert_eq!(
            store.claim(&claim_req(5, LONG)).await.ok(),
            Some(Claim::Claimed)
        );
        assert_eq!(store.len(), 3);
        assert_eq!(store.index_len(), 3);
        // Full of live records again.
        assert!(matches!(
            store.claim(&claim_req(6, LONG)).await,
            Err(StoreError::Full(_))
        ));
        for n in [3, 4, 5] {
            let req = claim_req(n, LONG);
            assert!(store.inspect(&req.id, false).await.ok().flatten().is_some());
        }
    }

    #[tokio::test]
    async fn the_expiry_index_does_not_outgrow_the_records() {
        let store = MemoryStore::new(100);
        for n in 0..20_000 {
            let req = claim_req(n, LONG);
            assert_eq!(store.claim(&req).await.ok(), Some(Claim::Claimed));
            assert_eq!(store.release(&req.id, &req.owner).await.ok(), Some(true));
            let req = claim_req(n + 1_000_000, LONG);
            assert_eq!(store.claim(&req).await.ok(), Some(Claim::Claimed));
            assert_eq!(store.delete(&req.id).await.ok(), Some(true));
            assert!(store.index_len() <= 1);
        }
        assert_eq!(store.len(), 0);
        assert_eq!(store.index_len(), 0);
        // The same id made again and again after each incarnation expired.
        for _ in 0..5 {
            assert_eq!(
                store.claim(&claim_req(7, SHORT)).await.ok(),
                Some(Claim::Claimed)
            );
            tokio::time::sleep(PAST_SHORT).await;
        }
        assert_eq!(store.len(), 1);
        assert_eq!(store.index_len(), 1);
        assert_eq!(store.sweep(), 0);
        assert_eq!(store.index_len(), 0);
    }
}
