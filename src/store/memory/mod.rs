//! The embedded store: the same semantics as Redis, in this process's memory. For one
//! instance and for trying idemgate out: records do not survive a restart and are not shared.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::ops::Deref;

use bytes::Bytes;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::{
    BoxFuture, Claim, ClaimRequest, Completed, Deleted, Meta, OwnerToken, Page, RecordState,
    RecordView, Store, StoreError, StoreFuture, StoredResponse,
};
use crate::fingerprint::Fingerprint;
use crate::key::RecordId;

mod calls;
mod records;
mod shard;
#[cfg(test)]
mod tests;

use self::calls::*;
use self::records::*;
use self::shard::*;

/// The in-memory store. Cheap to clone; clones share the records.
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

struct Inner {
    /// The records, split by id over independent locks: see [`SHARDS`].
    shards: [Mutex<Records>; SHARDS],
    /// Records held in all shards together, expired or not: what the cap is checked
    /// against. Kept by [`Shard`], the only way to change a map, under that map's lock:
    /// raised before a record goes in (checking the cap and taking the slot in one atomic
    /// step, so that claims on different shards cannot both take the last one) and lowered
    /// after one comes out. So it never counts fewer records than the maps hold, and counts
    /// exactly as many whenever no change is halfway.
    held: AtomicUsize,
    // A cap, so a client that floods distinct keys gets 503s instead of exhausting memory.
    max_records: usize,
    // The scope secret and its verifiers (`Store::meta`): made by the first start-up, and
    // gone with the records they key.
    meta: Mutex<std::collections::HashMap<String, String>>,
    /// Bytes held by all records ([`Entry::size`]), kept like `held`: raised (checked against
    /// `max_bytes` in the same atomic step) before a record or an answer goes in, lowered
    /// after one comes out.
    bytes: AtomicUsize,
    // The other cap: records are not all the same size, and a few large answers would hold
    // more memory than a million small ones.
    max_bytes: usize,
    // Records holding reserved room for an answer (in progress).
    rooms: AtomicUsize,
    // What an operator's walk ([`Store::list`]) measures expiry instants from, so that its
    // cursor can name a place in a shard's expiry index.
    epoch: Instant,
}

/// What a record costs beyond its answer's headers and body, as an estimate of what it
/// holds: the boxed entry, its owner token, its slot in a map (with the room a map keeps
/// free) and its item in the expiry index (with a B-tree node's slack).
const RECORD_UPKEEP: usize = std::mem::size_of::<Entry>()
    + 64
    + 2 * (std::mem::size_of::<RecordId>() + std::mem::size_of::<usize>() + 1)
    + 2 * std::mem::size_of::<(Instant, RecordId)>();

/// Which cap a new record or answer would pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cap {
    Records,
    Bytes,
}

/// How many shards the records are split over, each with its own lock, map and expiry index.
///
/// With one lock, a hash map that doubled its table held it for the whole move: 240–290 ms
/// at ~229k records, twice that at ~458k, and every request waited. Split, a doubling moves
/// a shard's records only and stalls only the requests for that shard's ids, and two
/// requests rarely want the same lock in the first place. 64 is far more than there are
/// worker threads, yet few enough that the shards' fixed cost stays small (a lock, an
/// empty map and index: about 80 bytes each) and that a claim at the cap can afford to
/// look at every shard for an expired record. A power of two, so that the shard is a mask
/// of the id's bits.
const SHARDS: usize = 64;

/// The shard that holds `id`'s record. The id is a SHA-256 output, so any of its bits are
/// uniformly distributed; the map inside a shard hashes the whole id with its own random
/// keys, so taking bits of it here does not crowd that map's buckets. (Clients choose keys,
/// so one could grind keys whose ids share a shard: that brings back, for those ids, the one
/// lock there used to be for all of them, and no more.)
fn shard_of(id: &RecordId) -> usize {
    let b = id.as_bytes();
    u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize & (SHARDS - 1)
}

struct Entry {
    state: State,
    fingerprint: Fingerprint,
    fingerprint_version: u16,
    owner: OwnerToken,
    created: SystemTime,
    // Retention: the record is gone (as if never made) from this instant. Set when the
    // entry is made, and brought forward only through `Records::shorten`: the expiry index
    // holds a copy, so changing it in place would leave the index pointing at the wrong
    // instant.
    expires: Instant,
    // Its answer showed nothing ran (`Store::shorten`): at the record cap it makes room.
    disposable: bool,
    // Until when the owner may still be working on it (see `ClaimRequest::busy_for`).
    busy_until: Instant,
    // Bytes reserved for the answer (`ClaimRequest::answer_room`) while the record is in
    // progress, counted against `memory_max_bytes`; given back when its state changes.
    room: usize,
}

enum State {
    InProgress {
        lease_until: Instant,
    },
    Completed(StoredResponse),
    /// Completed; the answer was too large to keep.
    NotKept {
        status: u16,
    },
    Unknown,
}

impl State {
    /// Bytes the state holds beyond the entry itself: a kept answer's headers and body.
    fn size(&self) -> usize {
        match self {
            State::Completed(r) => {
                r.body.len()
                    + r.headers
                        .iter()
                        .map(|(n, v)| crate::limits::recorded_header_size(n, v))
                        .sum::<usize>()
            }
            State::InProgress { .. } | State::NotKept { .. } | State::Unknown => 0,
        }
    }
}

impl Entry {
    /// What the record counts against `memory_max_bytes`.
    fn size(&self) -> usize {
        RECORD_UPKEEP + self.state.size() + self.room
    }
}

impl Inner {
    /// Puts `state` on `e` in place of what it held, its reserved room included (given
    /// back), keeping the byte count: `Err` (and `e` unchanged) if the new state would pass
    /// the byte cap.
    fn replace_state(&self, e: &mut Entry, state: State) -> Result<(), Cap> {
        let (old, new) = (e.state.size() + e.room, state.size());
        if new > old && !self.reserve_bytes(new - old) {
            return Err(Cap::Bytes);
        }
        e.state = state;
        self.give_back_room(e);
        if old > new {
            self.bytes.fetch_sub(old - new, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Forgets an entry's reserved room (its bytes are the caller's to account for).
    fn give_back_room(&self, e: &mut Entry) {
        if e.room > 0 {
            e.room = 0;
            self.rooms.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Takes `n` bytes if the byte cap leaves room.
    fn reserve_bytes(&self, n: usize) -> bool {
        let max = self.max_bytes;
        self.bytes
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                b.checked_add(n).filter(|t| *t <= max)
            })
            .is_ok()
    }
}

impl MemoryStore {
    /// An empty store that holds at most `max_records` live records, of any size.
    pub fn new(max_records: usize) -> MemoryStore {
        MemoryStore::with_limits(max_records, usize::MAX)
    }

    /// An empty store that holds at most `max_records` records and `max_bytes` bytes of
    /// records (answers and upkeep; see `memory_max_bytes`).
    pub fn with_limits(max_records: usize, max_bytes: usize) -> MemoryStore {
        MemoryStore {
            inner: Arc::new(Inner {
                shards: std::array::from_fn(|_| Mutex::new(Records::new())),
                held: AtomicUsize::new(0),
                max_records,
                bytes: AtomicUsize::new(0),
                max_bytes,
                rooms: AtomicUsize::new(0),
                meta: Mutex::default(),
                epoch: Instant::now(),
            }),
        }
    }

    /// Bytes held by the records, as counted against the byte cap.
    pub fn bytes(&self) -> usize {
        self.inner.bytes.load(Ordering::Relaxed)
    }

    /// Drops expired records; returns how many are left. Called periodically by the server.
    /// (At the cap, a claim drops expired records itself.) Works one shard at a time, in
    /// batches of [`EXPIRE_BATCH`], letting go of the lock between them, so requests wait
    /// for at most one batch however many records expire at once.
    pub fn sweep(&self) -> usize {
        let now = Instant::now();
        for shard in 0..SHARDS {
            while self.sweep_batch(shard, now) == EXPIRE_BATCH {
                // A plain unlock-relock could take the lock straight back from threads
                // waiting for it.
                std::thread::yield_now();
            }
        }
        self.len()
    }

    /// One batch of [`sweep`](Self::sweep) in one shard: how many records it took. Fewer
    /// than [`EXPIRE_BATCH`] means none expired at `now` are left there.
    fn sweep_batch(&self, shard: usize, now: Instant) -> usize {
        self.lock(shard).remove_expired(now, EXPIRE_BATCH)
    }

    /// Sweeps expired records every `period` in a background task, which ends when the last
    /// clone of the store is dropped.
    pub fn spawn_sweeper(&self, period: Duration) -> tokio::task::JoinHandle<()> {
        super::spawn_sweeper(&self.inner, period, |inner| async move {
            let store = MemoryStore { inner };
            // As `sweep`, but yielding to the runtime after every batch that removed
            // anything, so the sweep does not hold a worker thread either.
            let now = Instant::now();
            for shard in 0..SHARDS {
                loop {
                    let taken = store.sweep_batch(shard, now);
                    if taken > 0 {
                        tokio::task::yield_now().await;
                    }
                    if taken < EXPIRE_BATCH {
                        break;
                    }
                }
            }
        })
    }

    /// Number of records held, expired or not. (A claim that is inserting a record at this
    /// very moment may already be counted.)
    pub fn len(&self) -> usize {
        self.inner.held.load(Ordering::Relaxed)
    }

    /// Whether no records are held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self, shard: usize) -> Shard<'_> {
        // A panic while holding the lock cannot leave a record half-written (every update
        // is a single assignment, or map, index and count updates that run no code of ours
        // that could panic), so a poisoned lock is still consistent.
        let records = self.inner.shards[shard]
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        Shard {
            records,
            inner: &self.inner,
        }
    }

    fn lock_for(&self, id: &RecordId) -> Shard<'_> {
        self.lock(shard_of(id))
    }

    /// Number of items in the expiry indexes.
    #[cfg(test)]
    fn index_len(&self) -> usize {
        (0..SHARDS).map(|s| self.lock(s).by_expiry.len()).sum()
    }

    /// Number of records in the maps (what [`len`](Self::len) counts without looking).
    #[cfg(test)]
    fn map_len(&self) -> usize {
        (0..SHARDS).map(|s| self.lock(s).len()).sum()
    }

    fn claim_now(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        let now = Instant::now();
        let shard = shard_of(&req.id);
        let mut records = self.lock(shard);
        if let Some(found) = records.look_up(req, now) {
            return Ok(found);
        }
        let room = req.answer_room;
        let mut reserved = records.reserve(room).is_ok();
        if !reserved {
            // Soonest expiry first: if any record in this shard has expired, this frees at
            // least one slot. Bounded, so a flood at the cap costs each claim at most one
            // batch here.
            records.remove_expired(now, EXPIRE_BATCH);
            reserved = records.reserve(room).is_ok();
        }
        // Then records whose answer showed nothing ran (the 401s of made-up credentials):
        // a flood of them must not refuse real tenants' new keys.
        while !reserved && records.evict_disposable() {
            reserved = records.reserve(room).is_ok();
        }
        if !reserved {
            // The expired and disposable records may all be in other shards. Their locks
            // are taken only with this one let go: two claims doing this from two shards
            // would otherwise each hold the lock the other waits for.
            drop(records);
            self.remove_expired_elsewhere(shard, now, room);
            records = self.lock(shard);
            // While the lock was let go, another claim may have made this record.
            if let Some(found) = records.look_up(req, now) {
                return Ok(found);
            }
            if let Err(cap) = records.reserve(room) {
                return Err(self.full(cap));
            }
        }
        records.insert_reserved(
            req.id,
            Box::new(Entry {
                state: State::InProgress {
                    lease_until: now + req.lease,
                },
                fingerprint: req.fingerprint,
                fingerprint_version: req.fingerprint_version,
                owner: req.owner.clone(),
                created: SystemTime::now(),
                expires: now + req.retention,
                busy_until: now + req.busy_for,
                room: req.answer_room,
                disposable: false,
            }),
        );
        Ok(Claim::Claimed)
    }

    fn full(&self, cap: Cap) -> StoreError {
        StoreError::Full(match cap {
            Cap::Records => format!(
                "the embedded store holds its maximum of {} records (memory_max_records)",
                self.inner.max_records
            ),
            Cap::Bytes => format!(
                "the embedded store holds its maximum of {} bytes (memory_max_bytes)",
                self.inner.max_bytes
            ),
        })
    }

    /// For a claim at the cap with nothing expired in its own shard (`skip`): removes
    /// records expired at `now` from the other shards, one lock at a time, until a slot is
    /// free, at most [`EXPIRE_BATCH`] in all. A shard with none expired costs one short lock
    /// hold and one look at its index, so a flood of new keys at a cap full of live records
    /// costs each claim [`SHARDS`] of those: microseconds.
    fn remove_expired_elsewhere(&self, skip: usize, now: Instant, answer_room: usize) {
        let mut budget = EXPIRE_BATCH;
        let room = || {
            self.len() < self.inner.max_records
                && self.bytes() + RECORD_UPKEEP + answer_room <= self.inner.max_bytes
        };
        for shard in (1..SHARDS).map(|k| (skip + k) % SHARDS) {
            if budget == 0 || room() {
                return;
            }
            let mut records = self.lock(shard);
            budget -= records.remove_expired(now, budget);
            // Disposable records too, within the same budget.
            while budget > 0 && !room() && records.evict_disposable() {
                budget -= 1;
            }
        }
    }

    /// Runs `f` on the live record if `owner` owns it.
    fn with_owned(
        &self,
        id: &RecordId,
        owner: &OwnerToken,
        f: impl FnOnce(&mut Entry, Instant) -> bool,
    ) -> bool {
        let now = Instant::now();
        let mut records = self.lock_for(id);
        match records.entry_mut(id) {
            Some(e) if e.expires > now && e.owner == *owner => f(e, now),
            _ => false,
        }
    }

    fn list_now(
        &self,
        state: Option<RecordState>,
        cursor: &str,
        count: usize,
    ) -> Result<Page, StoreError> {
        // The cursor names a place in one shard's expiry index, `<shard>` or
        // `<shard>-<expiry ns since epoch>-<id>`: entries never change their expiry, so a
        // walk resumes exactly where it stopped, and each call looks at `count` entries.
        let bad = || StoreError::Corrupt("not a cursor of this store".into());
        let mut parts = cursor.splitn(3, '-');
        let shard: usize = match parts.next() {
            Some("") | None => 0,
            Some(s) => s.parse().map_err(|_| bad())?,
        };
        let after = match (parts.next(), parts.next()) {
            (Some(ns), Some(id)) => {
                let ns: u64 = ns.parse().map_err(|_| bad())?;
                let id = RecordId::from_hex(id).ok_or_else(bad)?;
                Some((self.inner.epoch + Duration::from_nanos(ns), id))
            }
            _ => None,
        };
        if shard >= SHARDS {
            return Err(bad());
        }
        let now = Instant::now();
        let count = count.max(1);
        let mut records_out = Vec::new();
        let mut shard = shard;
        let mut after = after;
        let mut examined = 0;
        while shard < SHARDS && examined < count {
            let records = self.lock(shard);
            let range = match after {
                Some(a) => records
                    .by_expiry
                    .range((std::ops::Bound::Excluded(a), std::ops::Bound::Unbounded)),
                None => records.by_expiry.range(..),
            };
            let mut last = None;
            for (expires, id) in range.take(count - examined) {
                examined += 1;
                last = Some((*expires, *id));
                let Some(e) = records.map.get(id).filter(|e| e.expires > now) else {
                    continue;
                };
                let view = view_of(id, e, now, false);
                if state.is_none_or(|s| s == view.state) {
                    records_out.push(view);
                }
            }
            if examined < count || last.is_none() {
                // This shard is done.
                shard += 1;
                after = None;
            } else {
                after = last;
            }
        }
        let cursor = if shard >= SHARDS {
            None
        } else {
            Some(match after {
                None => shard.to_string(),
                Some((expires, id)) => format!(
                    "{shard}-{}-{id}",
                    expires
                        .saturating_duration_since(self.inner.epoch)
                        .as_nanos()
                ),
            })
        };
        Ok(Page {
            records: records_out,
            cursor,
        })
    }
}
