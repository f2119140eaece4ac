//! One shard's records, their expiry index and its withdrawal notes.

use super::*;

/// How many expired records one lock hold removes at most. Removing one costs a B-tree pop
/// and a hash-map removal (well under a microsecond), so a batch keeps the lock for a
/// fraction of a millisecond however many records expire at once.
pub(super) const EXPIRE_BATCH: usize = 1024;

/// One shard's records and their expiry index, behind one lock so the two cannot disagree.
///
/// Without the index, dropping expired records meant walking the whole map under the lock
/// (`retain`): milliseconds per sweep with a few hundred thousand records, however few had
/// expired, and at the cap every new claim paid that walk, so a flood of new keys at the
/// cap slowed every request down. With it, removing expired records costs
/// O(expired · log n) and finding that none have expired costs one look at the index's
/// first item.
pub(super) struct Records {
    /// Entries are boxed: an [`Entry`] is 160 bytes, and a map that doubles its table moves
    /// every item and allocates (and faults in) room for twice as many. Moving 8-byte
    /// pointers instead made the worst single insert at ~458k records in one map about 20
    /// times shorter (~20 ms instead of ~470 ms), and took less memory too (empty buckets
    /// cost 40 bytes instead of 192), for one allocation per record.
    pub(super) map: HashMap<RecordId, Box<Entry>>,
    /// `(expires, id)` of every entry in `map`, soonest first. An ordered set rather than a
    /// binary heap so that releasing or deleting a record removes its item too: the index
    /// never holds more items than the map, and never needs an O(n) rebuild to shed stale
    /// ones. Kept exact by going through [`Records::insert`] and [`Records::remove`].
    pub(super) by_expiry: BTreeSet<(Instant, RecordId)>,
    /// Claims taken back by owners that found no record of theirs: `(until, id, owner)`.
    /// A claim here runs to completion inside the call that makes it, so it can never
    /// arrive after its owner's release, and this list is kept only so that both stores
    /// honour the same contract; it is short-lived and capped at [`WITHDRAWN_MAX`].
    pub(super) withdrawn: VecDeque<(Instant, RecordId, OwnerToken)>,
    /// `(expires, id)` of the entries whose answer showed nothing ran ([`Store::shorten`]):
    /// at the record cap the soonest of them make room before any new key is refused.
    pub(super) disposable: BTreeSet<(Instant, RecordId)>,
}

/// The most withdrawals a shard remembers; beyond that the oldest is forgotten (see
/// [`Records::withdrawn`] for why that costs nothing here).
pub(super) const WITHDRAWN_MAX: usize = 64;

impl Records {
    pub(super) fn new() -> Records {
        Records {
            map: HashMap::new(),
            by_expiry: BTreeSet::new(),
            withdrawn: VecDeque::new(),
            disposable: BTreeSet::new(),
        }
    }

    /// Brings `id`'s expiry forward to `until` (never later) and marks it disposable.
    pub(super) fn shorten(&mut self, id: RecordId, until: Instant) {
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
    pub(super) fn evict_disposable(&mut self) -> Option<Box<Entry>> {
        let (_, id) = self.disposable.pop_first()?;
        self.remove(&id)
    }

    /// Remembers until `until` that `owner` withdrew its claim on `id`.
    pub(super) fn withdraw(
        &mut self,
        id: RecordId,
        owner: OwnerToken,
        now: Instant,
        until: Instant,
    ) {
        self.withdrawn.retain(|(t, _, _)| *t > now);
        if self.withdrawn.len() >= WITHDRAWN_MAX {
            self.withdrawn.pop_front();
        }
        self.withdrawn.push_back((until, id, owner));
    }

    /// Whether `owner` withdrew its claim on `id` (and that is still remembered).
    pub(super) fn was_withdrawn(&self, id: &RecordId, owner: &OwnerToken, now: Instant) -> bool {
        self.withdrawn
            .iter()
            .any(|(t, i, o)| *t > now && i == id && o == owner)
    }

    pub(super) fn insert(&mut self, id: RecordId, entry: Box<Entry>) -> Option<Box<Entry>> {
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

    pub(super) fn remove(&mut self, id: &RecordId) -> Option<Box<Entry>> {
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
    pub(super) fn remove_expired(&mut self, now: Instant, limit: usize) -> (usize, usize, usize) {
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

    pub(super) fn len(&self) -> usize {
        self.map.len()
    }
}
