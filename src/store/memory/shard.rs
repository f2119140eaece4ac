//! A locked shard: every record that goes in or out goes through it, so the store-wide
//! counts of records and bytes stay right; room is reserved and records evicted here.

use super::*;

/// A locked shard, and the store-wide count its changes keep up to date: every record that
/// goes in or out goes through here, so [`Inner::held`] stays right. Reading goes through
/// `Deref`; an entry is changed in place only through [`Shard::entry_mut`], which cannot add
/// or remove one.
pub(super) struct Shard<'a> {
    pub(super) records: MutexGuard<'a, Records>,
    pub(super) inner: &'a Inner,
}

impl Deref for Shard<'_> {
    type Target = Records;

    fn deref(&self) -> &Records {
        &self.records
    }
}

impl Shard<'_> {
    pub(super) fn entry_mut(&mut self, id: &RecordId) -> Option<&mut Entry> {
        self.records.map.get_mut(id).map(|e| &mut **e)
    }

    /// Takes a slot and [`RECORD_UPKEEP`] bytes, and `room` bytes for its answer, for a
    /// record about to be inserted, if both caps leave room. Relaxed is enough: the counts order nothing else (the maps have
    /// their locks), and the read-modify-writes of one atomic are totally ordered whatever
    /// the ordering, so two claims can never both take the last slot or the last bytes.
    pub(super) fn reserve(&self, room: usize) -> Result<(), Cap> {
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
    pub(super) fn insert_reserved(&mut self, id: RecordId, entry: Box<Entry>) {
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

    pub(super) fn remove(&mut self, id: &RecordId) -> Option<Box<Entry>> {
        let e = self.records.remove(id)?;
        self.inner.held.fetch_sub(1, Ordering::Relaxed);
        self.inner.bytes.fetch_sub(e.size(), Ordering::Relaxed);
        self.inner
            .rooms
            .fetch_sub(usize::from(e.room > 0), Ordering::Relaxed);
        Some(e)
    }

    /// Removes the disposable record that expires soonest; whether there was one.
    pub(super) fn evict_disposable(&mut self) -> bool {
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
    pub(super) fn remove_expired(&mut self, now: Instant, limit: usize) -> usize {
        let before = self.records.len();
        let (taken, freed, rooms) = self.records.remove_expired(now, limit);
        self.inner
            .held
            .fetch_sub(before - self.records.len(), Ordering::Relaxed);
        self.inner.bytes.fetch_sub(freed, Ordering::Relaxed);
        self.inner.rooms.fetch_sub(rooms, Ordering::Relaxed);
        taken
    }

    /// Whether `owner` holds the live record `id`.
    pub(super) fn owned_by(&self, id: &RecordId, owner: &OwnerToken, now: Instant) -> bool {
        matches!(self.map.get(id), Some(e) if e.expires > now && e.owner == *owner)
    }

    /// Puts a new state on the record, if `owner` owns it and it is live, keeping the byte
    /// count: `Err` (and the record unchanged) if the new state would pass the byte cap.
    pub(super) fn set_owned_state(
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
        inner.replace_state(e, state)?;
        Ok(true)
    }

    /// What a claim finds in this shard's record for `req.id`: `None` if there is no live
    /// one. An expired one is removed here, as good as absent already, so that it does not
    /// count against the cap for the claim about to replace it.
    pub(super) fn look_up(&mut self, req: &ClaimRequest, now: Instant) -> Option<Claim> {
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
            // The body is shared, not copied, but its replay holds it for as long as its
            // client takes to read it: room for it is taken first, as a remote store's.
            State::Completed(r) if !crate::store::room_for(req.room.as_ref(), r.body.len()) => {
                Claim::NoRoom { status: r.status }
            }
            State::Completed(r) => Claim::Replay(r.clone()),
            State::NotKept { status } => Claim::NotKept { status: *status },
            State::InProgress { lease_until } if *lease_until > now => Claim::InFlight {
                lease_left: *lease_until - now,
            },
            State::InProgress { .. } | State::Unknown => Claim::Unknown,
        })
    }
}
