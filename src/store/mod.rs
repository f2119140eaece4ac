//! Where records live: one [`Store`] trait and four backends, each in its own module: an
//! embedded in-memory one (`memory/`), a persistent embedded one (SQLite on local disk,
//! `sqlite`), and two that instances share, Redis (`redis/`) and PostgreSQL (`postgres/`),
//! held to the same contract by one test suite (`tests/store_contract.rs`).
//!
//! A record goes `in_progress` (claimed, with an owner token and a lease) → `completed`
//! (status, headers, body recorded by its owner; or, for an answer too large to keep, the
//! status alone: "completed, not kept"), or → `unknown` (sent, no complete answer;
//! or the lease ran out with nobody renewing it), or is released (deleted by its owner when
//! the request provably never reached the upstream, or by an operator).
//!
//! A claim whose answer never came back may or may not have landed, and may even land after
//! its owner has given up on it (sent down a connection that was cut, delivered when the
//! network heals). Its owner takes it back with [`Store::release`], which also leaves a
//! short note (a *withdrawal*) that makes such a late claim create nothing: a claim that was
//! never forwarded ends released, never `unknown`.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::Serialize;

use crate::fingerprint::Fingerprint;
use crate::key::RecordId;
use crate::scope::ScopeSecret;

pub mod layer;
pub mod memory;
pub mod open;
pub mod postgres;
pub mod redis;
mod row;
pub mod seal;
pub mod sqlite;

pub use self::layer::{Call, Layer};
pub use self::memory::MemoryStore;
pub use self::open::{open, OpenError, StoreKind};
pub use self::postgres::PostgresStore;
pub use self::redis::setup::RedisSetup;
pub use self::redis::RedisStore;
pub use self::sqlite::SqliteStore;

/// A boxed future, so the trait can be used as `dyn Store`.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a [`Store`] call returns: its answer or why it failed, later. Named once, so that
/// each call's signature says what it answers rather than how the future is boxed.
pub type StoreFuture<'a, T> = BoxFuture<'a, Result<T, StoreError>>;

/// An unguessable token that names the holder of a claim: only it may record or release.
/// Shared, not copied, on clone: a protected request's claim guard holds one too.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct OwnerToken(std::sync::Arc<str>);

impl OwnerToken {
    /// A fresh random token (128 bits).
    pub fn random() -> OwnerToken {
        let mut hex = [0u8; 32];
        // The buffer is exactly twice the 16 random bytes, the only way encoding can fail.
        let _ = hex::encode_to_slice(rand::random::<[u8; 16]>(), &mut hex);
        // Hex digits are ASCII; one allocation, for the shared text itself.
        OwnerToken(std::str::from_utf8(&hex).unwrap_or_default().into())
    }
    /// The token's text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Everything a claim writes when it creates a record.
#[derive(Clone, Debug)]
pub struct ClaimRequest {
    /// The record.
    pub id: RecordId,
    /// Fingerprint of the request.
    pub fingerprint: Fingerprint,
    /// Version of the fingerprint's input format.
    pub fingerprint_version: u16,
    /// The claimant.
    pub owner: OwnerToken,
    /// How long the claim holds without renewal.
    pub lease: Duration,
    /// How long the record lives from now.
    pub retention: Duration,
    /// How long from now the owner may still be working on the request (forwarding it,
    /// waiting for the upstream, recording the answer), lease or no lease: an operator's
    /// release within this time could let a retry execute while the first call completes.
    pub busy_for: Duration,
    /// Bytes the answer may take (the route's `max_response_bytes` and room for its head):
    /// a store with a byte cap (the embedded one's `memory_max_bytes`) reserves them with
    /// the claim, so that the answer of a request it admitted always fits. Others ignore it.
    pub answer_room: usize,
    /// Where a replay's body must find room before it is read. Every store learns a
    /// recorded body's length before reading it and asks here first (a body no longer than
    /// [`ReplayRoom::held`], the room taken before the claim, may come with the claim's own
    /// reply); refused, it answers [`Claim::NoRoom`] without reading the body. A sealed body
    /// is asked for again before it is opened. `None`: read whatever its size.
    pub room: Option<ReplayRoom>,
}

/// Room for replay bodies in the memory of whoever claims: the buffer budget, and the
/// shares of it one connection and one tenant may hold.
pub trait BodyRoom: Send + Sync {
    /// Holds room for a body of `len` bytes in all: asked with more than it holds, takes
    /// the difference (`false`: there is none now, and nothing more is taken); asked with
    /// less, gives the difference back.
    fn reserve(&self, len: usize) -> bool;
    /// The bytes it holds now: a body no longer than this may be read without asking.
    fn held(&self) -> usize;
}

/// A claim's [`BodyRoom`], shared by the claim and whoever answers its replay.
#[derive(Clone)]
pub struct ReplayRoom(pub Arc<dyn BodyRoom>);

impl ReplayRoom {
    /// Room for a body of `len` bytes, taken before it is read (see [`BodyRoom::reserve`]).
    pub fn reserve(&self, len: usize) -> bool {
        self.0.reserve(len)
    }

    /// The bytes held now (see [`BodyRoom::held`]).
    pub fn held(&self) -> usize {
        self.0.held()
    }
}

impl std::fmt::Debug for ReplayRoom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReplayRoom(..)")
    }
}

/// Asks `room`, if there is one, for `len` bytes: `true` when the body may be read.
pub fn room_for(room: Option<&ReplayRoom>, len: usize) -> bool {
    room.is_none_or(|r| r.reserve(len))
}

#[cfg(test)]
impl ClaimRequest {
    /// A claim of `id` as the backends' own tests make it: version 1, a fresh owner, a 10 s
    /// lease and busy time, a minute's retention, no reserved room.
    pub(crate) fn for_test(id: RecordId, fingerprint: Fingerprint) -> ClaimRequest {
        let ten_seconds = Duration::from_secs(10);
        ClaimRequest {
            id,
            fingerprint,
            fingerprint_version: 1,
            owner: OwnerToken::random(),
            lease: ten_seconds,
            retention: Duration::from_secs(60),
            busy_for: ten_seconds,
            answer_room: 0,
            room: None,
        }
    }
}

/// A response as recorded, and replayed byte for byte.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredResponse {
    /// HTTP status code.
    pub status: u16,
    /// Replayable headers, in order (hop-by-hop, `Date`, `Set-Cookie` already removed).
    pub headers: Vec<(String, Bytes)>,
    /// The body.
    pub body: Bytes,
}

impl StoredResponse {
    /// Compact encoding of the headers: for each, u32-BE name length, name, u32-BE value
    /// length, value. Binary-safe and cheap, since header values need not be UTF-8.
    pub fn encode_headers(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for (name, value) in &self.headers {
            out.extend_from_slice(&(name.len() as u32).to_be_bytes());
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(&(value.len() as u32).to_be_bytes());
            out.extend_from_slice(value);
        }
        out
    }

    /// Inverse of [`encode_headers`](Self::encode_headers); `None` if corrupt.
    pub fn decode_headers(mut b: &[u8]) -> Option<Vec<(String, Bytes)>> {
        fn take<'a>(b: &mut &'a [u8]) -> Option<&'a [u8]> {
            let len = u32::from_be_bytes(b.get(..4)?.try_into().ok()?) as usize;
            let v = b.get(4..4 + len)?;
            *b = &b[4 + len..];
            Some(v)
        }
        let mut out = Vec::new();
        while !b.is_empty() {
            let name = String::from_utf8(take(&mut b)?.to_vec()).ok()?;
            let value = Bytes::copy_from_slice(take(&mut b)?);
            out.push((name, value));
        }
        Some(out)
    }
}

/// What a claim found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Claim {
    /// No record existed; the caller now owns a fresh `in_progress` one.
    Claimed,
    /// A completed record with the same fingerprint: replay it.
    Replay(StoredResponse),
    /// A completed record with the same fingerprint whose answer was too large to keep:
    /// the request was executed and answered with `status`, and cannot be replayed.
    NotKept {
        /// The status the upstream answered.
        status: u16,
    },
    /// Another request with the same fingerprint holds a live lease.
    InFlight {
        /// Time left on that lease.
        lease_left: Duration,
    },
    /// The record was made by a request with a different fingerprint.
    Mismatch,
    /// The record's fingerprint has another input-format version (made before or after an
    /// upgrade): compute the request's fingerprint in that version and claim again.
    OtherVersion(u16),
    /// A completed record with the same fingerprint whose body found no room in the
    /// claim's [`ClaimRequest::room`]: it was not read. Answered as a full buffer budget is
    /// (503, retry later).
    NoRoom {
        /// The status the upstream answered.
        status: u16,
    },
    /// Sent once, outcome unknown (marked so, or its lease ran out unrenewed).
    Unknown,
    /// This very claim (same owner) was taken back by [`Store::release`] before it reached
    /// the store: nothing was created. Only a claim that arrives after its owner gave up on
    /// it can see this.
    Withdrawn,
}

/// The state of a record, as the admin API shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordState {
    /// Claimed, lease live.
    InProgress,
    /// Response recorded.
    Completed,
    /// Sent, outcome unknown.
    Unknown,
}

/// A record as the admin API shows it.
#[derive(Clone, Debug, Serialize)]
pub struct RecordView {
    /// The record id.
    pub id: String,
    /// Current state (an expired lease reads as `unknown`).
    pub state: RecordState,
    /// Milliseconds since the Unix epoch, by the store's clock.
    pub created_ms: u64,
    /// Lease left, in milliseconds, while `in_progress`.
    pub lease_left_ms: Option<u64>,
    /// Time to live left, in milliseconds.
    pub ttl_ms: Option<u64>,
    /// While not settled: how much longer, in milliseconds, its owner may still be working
    /// on it (waiting for the upstream), even if its lease has run out. An operator's
    /// release is refused meanwhile unless forced.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub owner_busy_ms: Option<u64>,
    /// Fingerprint (hex) and its version.
    pub fingerprint: String,
    #[allow(missing_docs)]
    pub fingerprint_version: u16,
    /// Recorded status, once completed.
    pub status: Option<u16>,
    /// Whether the answer's headers and body were kept (once completed; an answer larger
    /// than `max_response_bytes`, or one that did not fit in the store, was not).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub body_kept: Option<bool>,
    /// Recorded body, only when asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub body: Option<String>,
    /// On the SQL stores (SQLite, PostgreSQL), which keep it beside the record: the
    /// namespace that wrote it, or `Some(None)` (shown as `null`) for a record written by a
    /// version that did not keep it, which every namespace sees. `None` (not shown) on
    /// the stores whose records carry no namespace column.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespace: Option<Option<String>>,
}

/// What an operator's [`Store::delete`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Deleted {
    /// The record is gone.
    Deleted,
    /// There was no record.
    NotFound,
    /// Left alone: its owner may still be working on it (not forced).
    OwnerBusy,
    /// Left alone: written by a version that kept no namespace, so it may be another
    /// namespace's; only an operator who says so (`any_namespace`) may change it.
    Unscoped,
}

/// What an operator's [`Store::complete`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Completed {
    /// The record now holds the operator's answer; retries get it replayed.
    Completed,
    /// There was no record.
    NotFound,
    /// Left alone: its owner may still be working on it (not forced).
    OwnerBusy,
    /// Left alone: it already holds an answer (the upstream's, or an operator's).
    AlreadyCompleted,
    /// Left alone: written by a version that kept no namespace (see [`Deleted::Unscoped`]).
    Unscoped,
}

impl Completed {
    /// What a store's completion code says (the Redis script's and PostgreSQL's reply: 1
    /// completed, 0 not found, 2 owner busy, 3 already completed, 4 written without a
    /// namespace and not asked to reach it); `None`: no such code.
    pub fn from_code(code: i64) -> Option<Completed> {
        match code {
            1 => Some(Completed::Completed),
            0 => Some(Completed::NotFound),
            2 => Some(Completed::OwnerBusy),
            3 => Some(Completed::AlreadyCompleted),
            4 => Some(Completed::Unscoped),
            _ => None,
        }
    }
}

/// One page of an operator's walk over the records ([`Store::list`]).
#[derive(Clone, Debug, Serialize)]
pub struct Page {
    /// The records of this page that matched.
    pub records: Vec<RecordView>,
    /// Where the next page starts; `None` when the walk is done. Opaque.
    pub cursor: Option<String>,
}

/// Why a store call failed. Every failure is treated as "the store may or may not have
/// applied it", so callers stay on the safe side.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The call did not finish within its deadline.
    #[error("store call timed out after {0:?}")]
    Timeout(Duration),
    /// Connection or protocol error talking to the store.
    #[error("store error: {0}")]
    Backend(String),
    /// The store answered something it should not have (corrupt or foreign record).
    #[error("store returned an unexpected reply: {0}")]
    Corrupt(String),
    /// The store refuses new records, or an answer's body (embedded caps reached, Redis
    /// out of memory).
    #[error("store is full: {0}")]
    Full(String),
    /// A recorded answer exists and cannot be opened (sealed under a key no longer
    /// configured, or altered). The request must not be executed again: it was once.
    #[error("recorded answer cannot be read: {0}")]
    Unreadable(String),
}

/// The operations idemgate needs from a record store. Every mutating call is atomic and
/// owner-checked where it says so, and each is one round trip for a remote store.
pub trait Store: Send + Sync + 'static {
    /// Creates the record as `in_progress` owned by `req.owner`, or reports what exists.
    fn claim<'a>(&'a self, req: &'a ClaimRequest) -> StoreFuture<'a, Claim>;
    /// Records the response if `owner` still owns the record. `Ok(false)`: it does not.
    fn record<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        response: &'a StoredResponse,
    ) -> StoreFuture<'a, bool>;
    /// Completes the record without its headers and body (the answer was too large to
    /// keep) if `owner` still owns it. `Ok(false)`: it does not.
    /// Brings the record's expiry forward to `retain` from now (never later), if `owner`
    /// owns it: for an answer that shows nothing ran (`short_retention_statuses`), kept
    /// only `short_retention`. The embedded store also lets such records make room at its
    /// record cap before it refuses a new key.
    fn shorten<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        retain: Duration,
    ) -> StoreFuture<'a, bool>;
    /// Records that the request was executed and answered with `status`, without the answer.
    fn record_not_kept<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        status: u16,
    ) -> StoreFuture<'a, bool>;
    /// Extends the lease if `owner` still owns an `in_progress` record.
    fn renew<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        lease: Duration,
    ) -> StoreFuture<'a, bool>;
    /// Marks the record `unknown` if `owner` still owns it.
    fn mark_unknown<'a>(&'a self, id: &'a RecordId, owner: &'a OwnerToken)
        -> StoreFuture<'a, bool>;
    /// Deletes the record if `owner` still owns it (the request never left idemgate).
    ///
    /// Safe whether or not `owner`'s claim landed, and whenever it lands: when the store
    /// holds no record of `owner`'s, it remembers for `linger` that `owner` withdrew, and a
    /// claim by `owner` arriving within that time creates nothing ([`Claim::Withdrawn`]).
    /// `Ok(true)`: a record of `owner`'s was deleted.
    fn release<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        linger: Duration,
    ) -> StoreFuture<'a, bool>;
    /// Reads a record for operators. On the SQL stores, which keep each record's namespace,
    /// only a record of this store's namespace, or one written without a namespace (by an
    /// older version), is seen: another namespace's is `None`, as are [`Store::list`],
    /// [`Store::delete`] and [`Store::complete`] for it.
    fn inspect<'a>(
        &'a self,
        id: &'a RecordId,
        with_body: bool,
    ) -> StoreFuture<'a, Option<RecordView>>;
    /// Deletes a record for an operator (a reconciliation). Unless `force`, a record whose
    /// owner may still be working (a live lease, or within its [`ClaimRequest::busy_for`])
    /// is left alone: checked and deleted in one atomic step. A record written without a
    /// namespace (SQL stores) is left alone ([`Deleted::Unscoped`]) unless `any_namespace`.
    fn delete<'a>(
        &'a self,
        id: &'a RecordId,
        force: bool,
        any_namespace: bool,
    ) -> StoreFuture<'a, Deleted>;
    /// Resolves a record as executed with the answer an operator found (a reconciliation of
    /// an `unknown` record): it becomes `completed`, its retries get `response` replayed,
    /// and its former owner can no longer record over it. Unless `force`, a record whose
    /// owner may still be working is left alone, as for [`Store::delete`]; a completed one
    /// always is. Checked and written in one atomic step. A record written without a
    /// namespace is left alone as for [`Store::delete`] unless `any_namespace`.
    fn complete<'a>(
        &'a self,
        id: &'a RecordId,
        response: &'a StoredResponse,
        force: bool,
        any_namespace: bool,
    ) -> StoreFuture<'a, Completed>;
    /// While a route observes: the answer of a later execution of the same request (same
    /// `fingerprint`) replaces a recorded answer that was not a success (a `completed`
    /// record, kept or not, whose status is outside 2xx), so that once the route enforces a
    /// retry is never answered with a failure that a later execution superseded. A record
    /// with a 2xx answer, another fingerprint, in another state or none is left alone.
    /// `Ok(true)`: replaced. One atomic step.
    fn supersede<'a>(
        &'a self,
        id: &'a RecordId,
        fingerprint: &'a Fingerprint,
        response: &'a StoredResponse,
    ) -> StoreFuture<'a, bool>;
    /// One page of a walk over every record, for operators: those in `state` (all if
    /// `None`) among the next `count` or so examined, starting at `cursor` (`""`: the
    /// beginning). The work per call is bounded by `count`, whatever the store holds; a
    /// record that exists for the whole walk is seen at least once.
    fn list<'a>(
        &'a self,
        state: Option<RecordState>,
        cursor: &'a str,
        count: usize,
    ) -> StoreFuture<'a, Page>;
    /// Whether [`Store::list`] can walk this store (not on Redis Cluster, whose keys are
    /// spread over primaries that each scan their own).
    fn can_list(&self) -> bool {
        true
    }
    /// Checks the store answers.
    fn ping(&self) -> StoreFuture<'_, ()>;
    /// Which backend this is, at the bottom of any layers.
    fn kind(&self) -> StoreKind;
    /// A small named value the store keeps for ever (no TTL), beside the records: the
    /// scope secret, and each namespace's verifier of it (see [`crate::secret`]). With an
    /// `offer`, the value is set to it if absent; either way what the store holds then is
    /// returned, and whether this call created it. With replica acknowledgement on, an
    /// offered value is acknowledged before the call returns. An embedded store keeps them
    /// in its memory, and they die with it like its records.
    fn meta<'a>(&'a self, name: &'a str, offer: Option<&'a str>) -> StoreFuture<'a, Meta>;
    /// The secret that record ids are keyed with: the same for every instance that shares
    /// this store, created by the first one and kept by the store (set if absent, then
    /// read). Start-up goes through [`crate::secret::establish`] instead, which waits for
    /// running instances to restore a lost one before creating it.
    fn scope_secret(&self) -> StoreFuture<'_, ScopeSecret> {
        Box::pin(async move {
            let offer = ScopeSecret::random().to_hex();
            let meta = self.meta(SCOPE_SECRET, Some(&offer)).await?;
            meta.value
                .as_deref()
                .and_then(ScopeSecret::from_hex)
                .ok_or_else(|| StoreError::Corrupt("the scope secret is not 64 hex digits".into()))
        })
    }
    /// After [`StoreError::Full`], when room is expected: `Some(ZERO)` when requests in
    /// flight hold reserved room (it comes back as their answers land), otherwise when the
    /// soonest record expires; `None` when the store cannot tell.
    fn room_after(&self) -> Option<Duration> {
        None
    }

    /// Moves the store's heartbeat (a value it keeps by its own clock, in milliseconds,
    /// which never goes backwards) to its now, and says what it held before: an instance
    /// that finds it older than the last it saw knows the store went back in time (a
    /// failover to a copy that lacked the last writes, a restore from a backup), and lost
    /// the claims made in between. `None`: a store that keeps no heartbeat.
    fn heartbeat(&self) -> StoreFuture<'_, Option<Heartbeat>> {
        Box::pin(async { Ok(None) })
    }

    /// What the server says about itself, for metrics; `None` for a store without a
    /// server (the embedded one).
    fn server_stats(&self) -> StoreFuture<'_, Option<ServerStats>> {
        Box::pin(async { Ok(None) })
    }
}

/// Runs `sweep` every `period` in a background task (the first a period from now), handed
/// the store's shared state, until the last clone of the store is dropped: the sweeper
/// holds it only while it sweeps.
pub(crate) fn spawn_sweeper<T, Fut>(
    state: &Arc<T>,
    period: Duration,
    mut sweep: impl FnMut(Arc<T>) -> Fut + Send + 'static,
) -> tokio::task::JoinHandle<()>
where
    T: Send + Sync + 'static,
    Fut: Future<Output = ()> + Send,
{
    let weak = Arc::downgrade(state);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(period);
        tick.tick().await;
        loop {
            tick.tick().await;
            let Some(state) = weak.upgrade() else { return };
            sweep(state).await;
        }
    })
}

/// The name under which [`Store::meta`] keeps the scope secret.
pub const SCOPE_SECRET: &str = "scope_secret";

/// What [`Store::meta`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Meta {
    /// What the store holds now; `None` only when nothing was offered and nothing is held.
    pub value: Option<String>,
    /// Whether this call set it (it was absent).
    pub created: bool,
}

/// What one [`Store::heartbeat`] found, in milliseconds since the epoch by the store's
/// clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Heartbeat {
    /// The heartbeat the store held before this one (`None`: none, a store that never had
    /// one, or lost it).
    pub before: Option<i64>,
    /// The heartbeat it holds now.
    pub now: i64,
}

/// A store server's view of itself (Redis `INFO`), polled for metrics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerStats {
    /// Changes whenever the server restarts.
    pub run_id: String,
    /// Seconds since the server started.
    pub uptime_secs: u64,
    /// Keys evicted under memory pressure since the server started.
    pub evicted_keys: u64,
    /// The eviction policy now in force.
    pub maxmemory_policy: String,
}

/// The size of a piece of a large recorded answer: Redis writes one such piece per round
/// trip, and SQLite and PostgreSQL statements take longer with every such piece.
pub const RECORD_PIECE: usize = 256 * 1024;

/// How long recording a body of `len` bytes may take: `store_timeout` for each
/// [`RECORD_PIECE`] or part of one (one for an empty body).
pub fn record_budget(store_timeout: Duration, len: usize) -> Duration {
    let pieces = u32::try_from(len.div_ceil(RECORD_PIECE).max(1)).unwrap_or(u32::MAX);
    store_timeout.saturating_mul(pieces)
}

/// Runs a store call under a deadline: a store that does not answer counts as an error.
pub async fn deadline<T>(
    limit: Duration,
    f: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(limit, f).await {
        Ok(r) => r,
        Err(_) => Err(StoreError::Timeout(limit)),
    }
}

/// The deadline of a lease renewal: a third of the lease, at most `store_timeout`, so a
/// renewal never outlasts the period between two renewals.
pub fn renew_deadline(store_timeout: Duration, lease: Duration) -> Duration {
    store_timeout.min(lease / 3)
}
