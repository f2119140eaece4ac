//! A record as the SQL stores (SQLite, PostgreSQL) read it for operators: the columns both
//! keep, and the one mapping from them to a [`RecordView`].

use super::{Page, RecordState, RecordView, StoreError};
use crate::fingerprint::Fingerprint;
use crate::key::RecordId;

/// `state` of a record in progress, in both stores' tables.
pub(super) const IN_PROGRESS: i64 = 0;
/// `state` of a completed record (its answer kept or not).
pub(super) const COMPLETED: i64 = 1;
/// `state` of a record whose outcome is unknown.
pub(super) const UNKNOWN: i64 = 2;

/// The columns of a record view. Times are relative to the store's now, in milliseconds;
/// the lease and the owner's busy time may have run out (zero or below).
pub(super) struct ViewRow {
    pub state: i64,
    pub fingerprint: Vec<u8>,
    pub fingerprint_version: u16,
    pub lease_left: i64,
    pub busy_left: i64,
    /// Unix time of the claim.
    pub created: i64,
    pub ttl: i64,
    pub status: Option<u16>,
    /// Read only when the view asks for it.
    pub body: Option<Vec<u8>>,
    pub body_kept: bool,
    /// The namespace that wrote it; `None`: a version that kept none.
    pub namespace: Option<String>,
}

impl ViewRow {
    /// The view of record `id`; `corrupt` names the store in the error of a bad row.
    pub fn view(
        self,
        id: &RecordId,
        corrupt: fn(&str) -> StoreError,
    ) -> Result<RecordView, StoreError> {
        let fp: [u8; 32] = self
            .fingerprint
            .try_into()
            .map_err(|_| corrupt("fingerprint is not 32 bytes"))?;
        let live = self.state == IN_PROGRESS && self.lease_left > 0;
        let completed = self.state == COMPLETED;
        Ok(RecordView {
            id: id.to_string(),
            state: if completed {
                RecordState::Completed
            } else if live {
                RecordState::InProgress
            } else {
                RecordState::Unknown
            },
            created_ms: self.created.max(0) as u64,
            lease_left_ms: live.then_some(self.lease_left as u64),
            ttl_ms: Some(self.ttl.max(0) as u64),
            owner_busy_ms: (self.state == IN_PROGRESS && self.busy_left > 0)
                .then_some(self.busy_left as u64),
            fingerprint: Fingerprint(fp).to_hex(),
            fingerprint_version: self.fingerprint_version,
            status: if completed { self.status } else { None },
            body: if completed {
                self.body.map(|b| String::from_utf8_lossy(&b).into_owned())
            } else {
                None
            },
            body_kept: completed.then_some(self.body_kept),
            namespace: Some(self.namespace),
        })
    }
}

/// A page of [`Store::list`](super::Store::list) being read: the ids examined, in order,
/// and the views among them in the state asked for.
pub(super) struct Walk {
    state: Option<RecordState>,
    records: Vec<RecordView>,
    last: Option<RecordId>,
}

impl Walk {
    /// A walk that keeps the records in `state` (all if `None`).
    pub fn new(state: Option<RecordState>) -> Walk {
        Walk {
            state,
            records: Vec::new(),
            last: None,
        }
    }

    /// The id of the next row examined, from its 32 bytes.
    pub fn id(
        &mut self,
        raw: &[u8],
        corrupt: fn(&str) -> StoreError,
    ) -> Result<RecordId, StoreError> {
        let bytes: [u8; 32] = raw
            .try_into()
            .map_err(|_| corrupt("record id is not 32 bytes"))?;
        let id = RecordId::from_bytes(bytes);
        self.last = Some(id);
        Ok(id)
    }

    /// The view of the row just examined; `None`: gone since (expired between two reads).
    pub fn saw(&mut self, view: Option<RecordView>) {
        if let Some(view) = view.filter(|v| self.state.is_none_or(|s| s == v.state)) {
            self.records.push(view);
        }
    }

    /// The page, when `examined` rows were read for `count`: a full read may have more
    /// after it, so its last id is the cursor.
    pub fn page(self, examined: usize, count: usize) -> Page {
        Page {
            records: self.records,
            cursor: if examined == count {
                self.last.map(|id| id.to_string())
            } else {
                None
            },
        }
    }
}
