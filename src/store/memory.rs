//! The embedded store: the same semantics as Redis, in this process's memory. For one
//! instance and for trying idemgate out: records do not survive a restart and are not shared.

use std::collections::HashMap;

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
    records: Mutex<HashMap<RecordId, Entry>>,
    // A cap, so a client that floods distinct keys gets 503s instead of exhausting memory.
    max_records: usize,
}

struct Entry {
    state: State,
    fingerprint: Fingerprint,
    fingerprint_version: u16,
    owner: OwnerToken,
    created: SystemTime,
    // Retention: the record is gone (as if never made) from this instant.
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
                records: Mutex::new(HashMap::new()),
                max_records,
            }),
        }
    }

    /// Drops expired records; returns how many are left. Called periodically by the server
    /// and whenever the cap is reached.
    pub fn sweep(&self) -> usize {
        let now = Instant::now();
        let mut records = self.lock();
        records.retain(|_, e| e.expires > now);
        records.len()
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
                MemoryStore { inner }.sweep();
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

    fn lock(&self) -> MutexGuard<'_, HashMap<RecordId, Entry>> {
        // A panic while holding the lock cannot leave a record half-written (every update
        // is a single assignment), so a poisoned lock is still consistent.
        self.inner.records.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn claim_now(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        let now = Instant::now();
        let mut records = self.lock();
        if let Some(e) = records.get(&req.id).filter(|e| e.expires > now) {
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
            records.retain(|_, e| e.expires > now);
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
        match records.get_mut(id) {
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
        let owned = matches!(records.get(id), Some(e) if e.expires > now && e.owner == *owner);
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
        let view = records.get(id).filter(|e| e.expires > now).map(|e| {
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
}
