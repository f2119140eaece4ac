//! The [`Store`] calls, each one lock hold of the record's shard.

use super::*;

pub(super) fn ready<'a, T: Send + 'a>(v: T) -> BoxFuture<'a, T> {
    Box::pin(std::future::ready(v))
}

impl Store for MemoryStore {
    fn claim<'a>(&'a self, req: &'a ClaimRequest) -> StoreFuture<'a, Claim> {
        ready(self.claim_now(req))
    }

    fn record<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        response: &'a StoredResponse,
    ) -> StoreFuture<'a, bool> {
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
    ) -> StoreFuture<'a, bool> {
        let now = Instant::now();
        let mut records = self.lock_for(id);
        let owned = records.owned_by(id, owner, now);
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
    ) -> StoreFuture<'a, bool> {
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
    ) -> StoreFuture<'a, bool> {
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
    ) -> StoreFuture<'a, bool> {
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
    ) -> StoreFuture<'a, bool> {
        let now = Instant::now();
        let mut records = self.lock_for(id);
        let owned = records.owned_by(id, owner, now);
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
    ) -> StoreFuture<'a, Option<RecordView>> {
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
        _any_namespace: bool,
    ) -> StoreFuture<'a, Completed> {
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
                // Counted against `memory_max_bytes` like the upstream's answer, in the room
                // its claim reserved if it is still there.
                if let Err(cap) = inner.replace_state(e, kept(response)) {
                    return ready(Err(self.full(cap)));
                }
                // The former owner's late record must not overwrite the operator's answer.
                e.owner = OwnerToken::random();
                Completed::Completed
            }
        };
        ready(Ok(done))
    }

    fn supersede<'a>(
        &'a self,
        id: &'a RecordId,
        fingerprint: &'a Fingerprint,
        response: &'a StoredResponse,
    ) -> StoreFuture<'a, bool> {
        let now = Instant::now();
        let inner = &*self.inner;
        let mut records = self.lock_for(id);
        let Some(e) = records.entry_mut(id).filter(|e| e.expires > now) else {
            return ready(Ok(false));
        };
        let failed = match &e.state {
            State::Completed(r) => !(200..300).contains(&r.status),
            State::NotKept { status } => !(200..300).contains(status),
            State::InProgress { .. } | State::Unknown => false,
        };
        if !failed || e.fingerprint != *fingerprint {
            return ready(Ok(false));
        }
        // A completed record holds no reserved room (given back when it completed).
        ready(match inner.replace_state(e, kept(response)) {
            Ok(()) => Ok(true),
            Err(cap) => Err(self.full(cap)),
        })
    }

    fn list<'a>(
        &'a self,
        state: Option<RecordState>,
        cursor: &'a str,
        count: usize,
    ) -> StoreFuture<'a, Page> {
        ready(self.list_now(state, cursor, count))
    }

    fn delete<'a>(
        &'a self,
        id: &'a RecordId,
        force: bool,
        _any_namespace: bool,
    ) -> StoreFuture<'a, Deleted> {
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

    fn ping(&self) -> StoreFuture<'_, ()> {
        ready(Ok(()))
    }

    fn kind(&self) -> crate::store::StoreKind {
        crate::store::StoreKind::Memory
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

    fn meta<'a>(&'a self, name: &'a str, offer: Option<&'a str>) -> StoreFuture<'a, Meta> {
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

/// An operator's or a later execution's answer as the record keeps it, its body copied out
/// of whatever buffer it came in.
fn kept(response: &StoredResponse) -> State {
    State::Completed(StoredResponse {
        status: response.status,
        headers: response.headers.clone(),
        body: Bytes::copy_from_slice(&response.body),
    })
}

/// The admin view of one live entry.
pub(super) fn view_of(id: &RecordId, e: &Entry, now: Instant, with_body: bool) -> RecordView {
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
                namespace: None,
            }
        }
    }
}
