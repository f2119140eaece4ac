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
    RecordView, Store, StoreError, StoredResponse,
};
use crate::fingerprint::Fingerprint;
use crate::key::RecordId;

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

/// How many expired records one lock hold removes at most. Removing one costs a B-tree pop
/// and a hash-map removal (well under a microsecond), so a batch keeps the lock for a
/// fraction of a millisecond however many records expire at once.
const EXPIRE_BATCH: usize = 1024;

/// One shard's records and their expiry index, behind one lock so the two cannot disagree.
///
/// Without the index, dropping expired records meant walking the whole map under the lock
/// (`retain`): milliseconds per sweep with a few hundred thousand records, however few had
/// expired, and at the cap every new claim paid that walk, so a flood of new keys at the
/// cap slowed every request down. With it, removing expired records costs
/// O(expired · log n) and finding that none have expired costs one look at the index's
/// first item.
struct Records {
    /// Entries are boxed: an [`Entry`] is 160 bytes, and a map that doubles its table moves
    /// every item and allocates (and faults in) room for twice as many. Moving 8-byte
    /// pointers instead made the worst single insert at ~458k records in one map about 20
    /// times shorter (~20 ms instead of ~470 ms), and took less memory too (empty buckets
    /// cost 40 bytes instead of 192), for one allocation per record.
    map: HashMap<RecordId, Box<Entry>>,
    /// `(expires, id)` of every entry in `map`, soonest first. An ordered set rather than a
    /// binary heap so that releasing or deleting a record removes its item too: the index
    /// never holds more items than the map, and never needs an O(n) rebuild to shed stale
    /// ones. Kept exact by going through [`Records::insert`] and [`Records::remove`].
    by_expiry: BTreeSet<(Instant, RecordId)>,
    /// Claims taken back by owners that found no record of theirs: `(until, id, owner)`.
    /// A claim here runs to completion inside the call that makes it, so it can never
    /// arrive after its owner's release, and this list is kept only so that both stores
    /// honour the same contract; it is short-lived and capped at [`WITHDRAWN_MAX`].
    withdrawn: VecDeque<(Instant, RecordId, OwnerToken)>,
    /// `(expires, id)` of the entries whose answer showed nothing ran ([`Store::shorten`]):
    /// at the record cap the soonest of them make room before any new key is refused.
    disposable: BTreeSet<(Instant, RecordId)>,
}

/// The most withdrawals a shard remembers; beyond that the oldest is forgotten (see
/// [`Records::withdrawn`] for why that costs nothing here).
const WITHDRAWN_MAX: usize = 64;

impl Records {
    fn new() -> Records {
        Records {
            map: HashMap::new(),
            by_expiry: BTreeSet::new(),
            withdrawn: VecDeque::new(),
            disposable: BTreeSet::new(),
        }
    }

    /// Brings `id`'s expiry forward to `until` (never later) and marks it disposable.
    fn shorten(&mut self, id: RecordId, until: Instant) {
        let Some(e) = self.map.get_mut(&id) else {
            return;
        };
        let old = e.expires;
        if e.disposable {
            self.disposable.remove(&(old, id));
        }
        if until < old {
            self.by_expiry.remove(&(old, id));
            self.by_expiry.insert((until, id));
            e.expires = until;
        }
        e.disposable = true;
        self.disposable.insert((e.expires, id));
    }

    /// Removes the disposable entry that expires soonest, if any.
    fn evict_disposable(&mut self) -> Option<Box<Entry>> {
        let (_, id) = self.disposable.pop_first()?;
        self.remove(&id)
    }

    /// Remembers until `until` that `owner` withdrew its claim on `id`.
    fn withdraw(&mut self, id: RecordId, owner: OwnerToken, now: Instant, until: Instant) {
        self.withdrawn.retain(|(t, _, _)| *t > now);
        if self.withdrawn.len() >= WITHDRAWN_MAX {
            self.withdrawn.pop_front();
        }
        self.withdrawn.push_back((until, id, owner));
    }

    /// Whether `owner` withdrew its claim on `id` (and that is still remembered).
    fn was_withdrawn(&self, id: &RecordId, owner: &OwnerToken, now: Instant) -> bool {
        self.withdrawn
            .iter()
            .any(|(t, i, o)| *t > now && i == id && o == owner)
    }

    fn insert(&mut self, id: RecordId, entry: Box<Entry>) -> Option<Box<Entry>> {
        let expires = entry.expires;
        // The old item goes before the new one is added: both may carry the same instant.
        let old = self.map.insert(id, entry);
        if let Some(old) = &old {
            self.by_expiry.remove(&(old.expires, id));
            if old.disposable {
                self.disposable.remove(&(old.expires, id));
            }
        }
        self.by_expiry.insert((expires, id));
        old
    }

    fn remove(&mut self, id: &RecordId) -> Option<Box<Entry>> {
        let e = self.map.remove(id)?;
        self.by_expiry.remove(&(e.expires, *id));
        if e.disposable {
            self.disposable.remove(&(e.expires, *id));
        }
        Some(e)
    }

    /// Removes up to `limit` records expired at `now`, soonest first; returns how many index
    /// items it took (fewer than `limit` means none expired at `now` are left) and the bytes
    /// the removed records held.
    fn remove_expired(&mut self, now: Instant, limit: usize) -> (usize, usize, usize) {
        let mut taken = 0;
        let mut freed = 0;
        let mut rooms = 0;
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
                if let Some(e) = self.map.remove(&id) {
                    if e.disposable {
                        self.disposable.remove(&(expires, id));
                    }
                    freed += e.size();
                    rooms += usize::from(e.room > 0);
                }
            }
        }
        (taken, freed, rooms)
    }

    fn len(&self) -> usize {
        self.map.len()
    }
}

/// A locked shard, and the store-wide count its changes keep up to date: every record that
/// goes in or out goes through here, so [`Inner::held`] stays right. Reading goes through
/// `Deref`; an entry is changed in place only through [`Shard::entry_mut`], which cannot add
/// or remove one.
struct Shard<'a> {
    records: MutexGuard<'a, Records>,
    inner: &'a Inner,
}

impl Deref for Shard<'_> {
    type Target = Records;

    fn deref(&self) -> &Records {
        &self.records
    }
}

impl Shard<'_> {
    fn entry_mut(&mut self, id: &RecordId) -> Option<&mut Entry> {
        self.records.map.get_mut(id).map(|e| &mut **e)
    }

    /// Takes a slot and [`RECORD_UPKEEP`] bytes, and `room` bytes for its answer, for a
    /// record about to be inserted, if both caps leave room. Relaxed is enough: the counts order nothing else (the maps have
    /// their locks), and the read-modify-writes of one atomic are totally ordered whatever
    /// the ordering, so two claims can never both take the last slot or the last bytes.
    fn reserve(&self, room: usize) -> Result<(), Cap> {
        let max = self.inner.max_records;
        let taken = self
            .inner
            .held
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < max).then_some(n + 1)
            });
        if taken.is_err() {
            return Err(Cap::Records);
        }
        if !self.inner.reserve_bytes(RECORD_UPKEEP.saturating_add(room)) {
            self.inner.held.fetch_sub(1, Ordering::Relaxed);
            return Err(Cap::Bytes);
        }
        self.inner
            .rooms
            .fetch_add(usize::from(room > 0), Ordering::Relaxed);
        Ok(())
    }

    /// Inserts a record whose slot and bytes [`reserve`](Self::reserve) took.
    fn insert_reserved(&mut self, id: RecordId, entry: Box<Entry>) {
        // It replaced a record (callers remove an expired one first, but an insert must not
        // leak a slot either way): the slot was not needed, and the old record's bytes are
        // freed.
        if let Some(old) = self.records.insert(id, entry) {
            self.inner.held.fetch_sub(1, Ordering::Relaxed);
            self.inner.bytes.fetch_sub(old.size(), Ordering::Relaxed);
            self.inner
                .rooms
                .fetch_sub(usize::from(old.room > 0), Ordering::Relaxed);
        }
    }

    fn remove(&mut self, id: &RecordId) -> Option<Box<Entry>> {
        let e = self.records.remove(id)?;
        self.inner.held.fetch_sub(1, Ordering::Relaxed);
        self.inner.bytes.fetch_sub(e.size(), Ordering::Relaxed);
        self.inner
            .rooms
            .fetch_sub(usize::from(e.room > 0), Ordering::Relaxed);
        Some(e)
    }

    /// Removes the disposable record that expires soonest; whether there was one.
    fn evict_disposable(&mut self) -> bool {
        let Some(e) = self.records.evict_disposable() else {
            return false;
        };
        self.inner.held.fetch_sub(1, Ordering::Relaxed);
        self.inner.bytes.fetch_sub(e.size(), Ordering::Relaxed);
        self.inner
            .rooms
            .fetch_sub(usize::from(e.room > 0), Ordering::Relaxed);
        true
    }

    /// As [`Records::remove_expired`]; returns how many index items it took.
    fn remove_expired(&mut self, now: Instant, limit: usize) -> usize {
        let before = self.records.len();
        let (taken, freed, rooms) = self.records.remove_expired(now, limit);
        self.inner
            .held
            .fetch_sub(before - self.records.len(), Ordering::Relaxed);
        self.inner.bytes.fetch_sub(freed, Ordering::Relaxed);
        self.inner.rooms.fetch_sub(rooms, Ordering::Relaxed);
        taken
    }

    /// Puts a new state on the record, if `owner` owns it and it is live, keeping the byte
    /// count: `Err` (and the record unchanged) if the new state would pass the byte cap.
    fn set_owned_state(
        &mut self,
        id: &RecordId,
        owner: &OwnerToken,
        now: Instant,
        state: State,
    ) -> Result<bool, Cap> {
        let inner = self.inner;
        let Some(e) = self.entry_mut(id) else {
            return Ok(false);
        };
        if e.expires <= now || e.owner != *owner {
            return Ok(false);
        }
        // The answer's reserved room is part of what the old state holds.
        let (old, new) = (e.state.size() + e.room, state.size());
        if new > old && !inner.reserve_bytes(new - old) {
            return Err(Cap::Bytes);
        }
        e.state = state;
        inner.give_back_room(e);
        if old > new {
            inner.bytes.fetch_sub(old - new, Ordering::Relaxed);
        }
        Ok(true)
    }

    /// What a claim finds in this shard's record for `req.id`: `None` if there is no live
    /// one. An expired one is removed here, as good as absent already, so that it does not
    /// count against the cap for the claim about to replace it.
    fn look_up(&mut self, req: &ClaimRequest, now: Instant) -> Option<Claim> {
        let Some(e) = self.records.map.get(&req.id) else {
            return self
                .was_withdrawn(&req.id, &req.owner, now)
                .then_some(Claim::Withdrawn);
        };
        if e.expires <= now {
            self.remove(&req.id);
            return self
                .was_withdrawn(&req.id, &req.owner, now)
                .then_some(Claim::Withdrawn);
        }
        if e.fingerprint_version != req.fingerprint_version {
            return Some(Claim::OtherVersion(e.fingerprint_version));
        }
        if e.fingerprint != req.fingerprint {
            return Some(Claim::Mismatch);
        }
        Some(match &e.state {
            State::Completed(r) => Claim::Replay(r.clone()),
            State::NotKept { status } => Claim::NotKept { status: *status },
            State::InProgress { lease_until } if *lease_until > now => Claim::InFlight {
                lease_left: *lease_until - now,
            },
            State::InProgress { .. } | State::Unknown => Claim::Unknown,
        })
    }
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
                        .map(|(n, v)| std::mem::size_of::<(String, Bytes)>() + n.len() + v.len())
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
        let weak = Arc::downgrade(&self.inner);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.tick().await;
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else { return };
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
        let now = Instant::now();
        let set = self
            .lock_for(id)
            .set_owned_state(id, owner, now, State::Completed(stored));
        ready(set.map_err(|cap| self.full(cap)))
    }

    fn shorten<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        retain: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        let now = Instant::now();
        let mut records = self.lock_for(id);
        let owned = matches!(records.map.get(id), Some(e) if e.expires > now && e.owner == *owner);
        if owned {
            records.records.shorten(*id, now + retain);
        }
        ready(Ok(owned))
    }

    fn record_not_kept<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        status: u16,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        let now = Instant::now();
        let set = self
            .lock_for(id)
            .set_owned_state(id, owner, now, State::NotKept { status });
        ready(set.map_err(|cap| self.full(cap)))
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
        let inner = &*self.inner;
        ready(Ok(self.with_owned(id, owner, |e, _| match e.state {
            State::Completed(_) | State::NotKept { .. } => false,
            _ => {
                e.state = State::Unknown;
                // No answer will come: its room goes back.
                inner.bytes.fetch_sub(e.room, Ordering::Relaxed);
                inner.give_back_room(e);
                true
            }
        })))
    }

    fn release<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        linger: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        let now = Instant::now();
        let mut records = self.lock_for(id);
        let owned = matches!(records.map.get(id), Some(e) if e.expires > now && e.owner == *owner);
        if owned {
            records.remove(id);
        } else {
            records
                .records
                .withdraw(*id, owner.clone(), now, now + linger);
        }
        ready(Ok(owned))
    }

    fn inspect<'a>(
        &'a self,
        id: &'a RecordId,
        with_body: bool,
    ) -> BoxFuture<'a, Result<Option<RecordView>, StoreError>> {
        let now = Instant::now();
        let records = self.lock_for(id);
        let view = records
            .map
            .get(id)
            .filter(|e| e.expires > now)
            .map(|e| view_of(id, e, now, with_body));
        ready(Ok(view))
    }

    fn complete<'a>(
        &'a self,
        id: &'a RecordId,
        response: &'a StoredResponse,
        force: bool,
    ) -> BoxFuture<'a, Result<Completed, StoreError>> {
        let now = Instant::now();
        let inner = &*self.inner;
        let mut records = self.lock_for(id);
        let Some(e) = records.entry_mut(id).filter(|e| e.expires > now) else {
            return ready(Ok(Completed::NotFound));
        };
        let done = match e.state {
            State::Completed(_) | State::NotKept { .. } => Completed::AlreadyCompleted,
            State::InProgress { lease_until }
                if !force && (lease_until > now || e.busy_until > now) =>
            {
                Completed::OwnerBusy
            }
            _ => {
                let state = State::Completed(StoredResponse {
                    status: response.status,
                    headers: response.headers.clone(),
                    body: Bytes::copy_from_slice(&response.body),
                });
                // Counted against `memory_max_bytes` like the upstream's answer, in the room
                // its claim reserved if it is still there.
                let (old, new) = (e.state.size() + e.room, state.size());
                if new > old && !inner.reserve_bytes(new - old) {
                    return ready(Err(self.full(Cap::Bytes)));
                }
                e.state = state;
                inner.give_back_room(e);
                if old > new {
                    inner.bytes.fetch_sub(old - new, Ordering::Relaxed);
                }
                // The former owner's late record must not overwrite the operator's answer.
                e.owner = OwnerToken::random();
                Completed::Completed
            }
        };
        ready(Ok(done))
    }

    fn list<'a>(
        &'a self,
        state: Option<RecordState>,
        cursor: &'a str,
        count: usize,
    ) -> BoxFuture<'a, Result<Page, StoreError>> {
        ready(self.list_now(state, cursor, count))
    }

    fn delete<'a>(
        &'a self,
        id: &'a RecordId,
        force: bool,
    ) -> BoxFuture<'a, Result<Deleted, StoreError>> {
        let now = Instant::now();
        let mut records = self.lock_for(id);
        let busy = records.map.get(id).is_some_and(|e| {
            e.expires > now
                && matches!(e.state, State::InProgress { lease_until } if lease_until > now || e.busy_until > now)
        });
        if busy && !force {
            return ready(Ok(Deleted::OwnerBusy));
        }
        let removed = records.remove(id).is_some_and(|e| e.expires > now);
        ready(Ok(if removed {
            Deleted::Deleted
        } else {
            Deleted::NotFound
        }))
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        ready(Ok(()))
    }

    fn kind(&self) -> &'static str {
        "memory"
    }

    fn room_after(&self) -> Option<Duration> {
        if self.inner.rooms.load(Ordering::Relaxed) > 0 {
            return Some(Duration::ZERO);
        }
        let now = Instant::now();
        (0..SHARDS)
            .filter_map(|s| self.lock(s).by_expiry.first().map(|(t, _)| *t))
            .min()
            .map(|t| t.saturating_duration_since(now))
    }

    fn meta<'a>(
        &'a self,
        name: &'a str,
        offer: Option<&'a str>,
    ) -> BoxFuture<'a, Result<Meta, StoreError>> {
        let found = match self.inner.meta.lock() {
            Ok(mut meta) => {
                let created = match offer {
                    Some(v) if !meta.contains_key(name) => {
                        meta.insert(name.to_string(), v.to_string());
                        true
                    }
                    _ => false,
                };
                Ok(Meta {
                    value: meta.get(name).cloned(),
                    created,
                })
            }
            Err(_) => Err(StoreError::Backend("the store's lock is poisoned".into())),
        };
        ready(found)
    }
}

/// The admin view of one live entry.
fn view_of(id: &RecordId, e: &Entry, now: Instant, with_body: bool) -> RecordView {
    {
        {
            let owner_busy_ms = match e.state {
                State::InProgress { .. } if e.busy_until > now => {
                    Some((e.busy_until - now).as_millis() as u64)
                }
                _ => None,
            };
            let (state, lease_left, status, body, body_kept) = match &e.state {
                State::InProgress { lease_until } if *lease_until > now => (
                    RecordState::InProgress,
                    Some((*lease_until - now).as_millis() as u64),
                    None,
                    None,
                    None,
                ),
                State::InProgress { .. } | State::Unknown => {
                    (RecordState::Unknown, None, None, None, None)
                }
                State::Completed(r) => (
                    RecordState::Completed,
                    None,
                    Some(r.status),
                    with_body.then(|| String::from_utf8_lossy(&r.body).into_owned()),
                    Some(true),
                ),
                State::NotKept { status } => (
                    RecordState::Completed,
                    None,
                    Some(*status),
                    None,
                    Some(false),
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
                owner_busy_ms,
                fingerprint: e.fingerprint.to_hex(),
                fingerprint_version: e.fingerprint_version,
                status,
                body_kept,
                body,
            }
        }
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
            busy_for: Duration::from_secs(10),
            answer_room: 0,
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

    /// A claim for an id whose first four bytes are `n`: its record is in shard
    /// `n % SHARDS`.
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
            busy_for: Duration::from_secs(10),
            answer_room: 0,
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
            store.release(&again.id, &again.owner, SHORT).await.ok(),
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
        assert_eq!(store.map_len(), left);
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
        // Each in a shard of its own: the claims at the cap below find nothing expired in
        // their own shards, and have to make room in others.
        assert_eq!(shard_of(&claim_req(1, LONG).id), 1);
        assert_eq!(shard_of(&claim_req(6, LONG).id), 6);
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
        assert_eq!(store.map_len(), 3);
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
            assert_eq!(
                store.release(&req.id, &req.owner, SHORT).await.ok(),
                Some(true)
            );
            let req = claim_req(n + 1_000_000, LONG);
            assert_eq!(store.claim(&req).await.ok(), Some(Claim::Claimed));
            assert_eq!(
                store.delete(&req.id, true).await.ok(),
                Some(Deleted::Deleted)
            );
            assert!(store.index_len() <= 1);
        }
        assert_eq!(store.len(), 0);
        assert_eq!(store.map_len(), 0);
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
        assert_eq!(store.map_len(), 1);
        assert_eq!(store.index_len(), 1);
        assert_eq!(store.sweep(), 0);
        assert_eq!(store.map_len(), 0);
        assert_eq!(store.index_len(), 0);
    }

    #[tokio::test]
    async fn at_the_cap_a_claim_makes_room_in_its_own_shard() {
        let store = MemoryStore::new(2);
        let n = SHARDS as u32;
        // All in shard 5.
        assert_eq!(
            store.claim(&claim_req(5, SHORT)).await.ok(),
            Some(Claim::Claimed)
        );
        assert_eq!(
            store.claim(&claim_req(5 + n, LONG)).await.ok(),
            Some(Claim::Claimed)
        );
        assert!(matches!(
            store.claim(&claim_req(5 + 2 * n, LONG)).await,
            Err(StoreError::Full(_))
        ));
        tokio::time::sleep(PAST_SHORT).await;
        assert_eq!(
            store.claim(&claim_req(5 + 2 * n, LONG)).await.ok(),
            Some(Claim::Claimed)
        );
        assert_eq!(store.len(), 2);
        assert_eq!(store.map_len(), 2);
        assert_eq!(store.index_len(), 2);
        // An expired record is replaced by a claim under its own id, at the cap, without
        // taking any other record's place.
        let store = MemoryStore::new(2);
        for (m, retention) in [(5, SHORT), (6, LONG)] {
            assert_eq!(
                store.claim(&claim_req(m, retention)).await.ok(),
                Some(Claim::Claimed)
            );
        }
        tokio::time::sleep(PAST_SHORT).await;
        assert_eq!(
            store.claim(&claim_req(5, LONG)).await.ok(),
            Some(Claim::Claimed)
        );
        assert_eq!(store.len(), 2);
        assert_eq!(store.map_len(), 2);
        assert_eq!(store.index_len(), 2);
    }

    #[tokio::test]
    async fn the_cap_holds_across_shards() {
        let store = MemoryStore::new(10);
        let reqs: Vec<_> = (0..10).map(|n| claim_req(n, LONG)).collect();
        let shards: std::collections::HashSet<_> = reqs.iter().map(|r| shard_of(&r.id)).collect();
        assert_eq!(shards.len(), 10);
        for req in &reqs {
            assert_eq!(store.claim(req).await.ok(), Some(Claim::Claimed));
        }
        // The eleventh, in a shard that holds nothing yet, and in one that holds a record.
        let fresh = claim_req(10, LONG);
        let crowded = claim_req(SHARDS as u32, LONG);
        assert!(!shards.contains(&shard_of(&fresh.id)));
        assert_eq!(shard_of(&crowded.id), shard_of(&reqs[0].id));
        for req in [&fresh, &crowded] {
            assert!(matches!(store.claim(req).await, Err(StoreError::Full(_))));
        }
        assert_eq!(store.len(), 10);
        assert_eq!(store.map_len(), 10);

        // A release frees a slot for a claim in any shard, and for one claim only.
        assert_eq!(
            store.release(&reqs[3].id, &reqs[3].owner, SHORT).await.ok(),
            Some(true)
        );
        assert_eq!(store.len(), 9);
        assert_eq!(store.claim(&fresh).await.ok(), Some(Claim::Claimed));
        assert!(matches!(
            store.claim(&crowded).await,
            Err(StoreError::Full(_))
        ));
        // So does a delete.
        assert_eq!(
            store.delete(&reqs[7].id, true).await.ok(),
            Some(Deleted::Deleted)
        );
        assert_eq!(store.claim(&crowded).await.ok(), Some(Claim::Claimed));
        assert!(matches!(
            store.claim(&claim_req(11, LONG)).await,
            Err(StoreError::Full(_))
        ));
        assert_eq!(store.len(), 10);
        assert_eq!(store.map_len(), 10);
        assert_eq!(store.index_len(), 10);
    }

    #[test]
    fn concurrent_claims_on_all_shards_never_pass_the_cap() {
        let store = MemoryStore::new(300);
        let claimed = std::thread::scope(|s| {
            let threads: Vec<_> = (0..4u32)
                .map(|t| {
                    let store = store.clone();
                    s.spawn(move || {
                        (0..200u32)
                            .filter(|n| {
                                let req = claim_req(t * 1000 + n, LONG);
                                matches!(store.claim_now(&req), Ok(Claim::Claimed))
                            })
                            .count()
                    })
                })
                .collect();
            threads
                .into_iter()
                .map(|t| t.join().unwrap())
                .sum::<usize>()
        });
        assert_eq!(claimed, 300);
        assert_eq!(store.len(), 300);
        assert_eq!(store.map_len(), 300);
        assert_eq!(store.index_len(), 300);
    }
}
