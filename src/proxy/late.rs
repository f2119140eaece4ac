//! Record writes tried again in the background: an answer's owner-checked write (or its
//! status alone), and observe mode's supersede of a recorded failure, when the store did
//! not take them on their first try. Each is tried with the pauses of a release until it
//! lands, the claim is no longer the writer's, or the record's retention ends; meanwhile
//! the record id is in [`LateWrites`](crate::late_writes::LateWrites), and a retry reaching
//! this instance is told to wait (409 `in-progress`), not that its outcome is unknown.
//!
//! The answer waits in memory, taken from `max_buffered_bytes` before it is queued; with no
//! room there it is queued as its status alone (a retry then gets `response-not-stored`,
//! which says it ran). A supersede with no room is given up and logged: it is an observed
//! route's, whose failure would then be replayed once it enforces.

use std::time::Duration;

use crate::fingerprint::Fingerprint;
use crate::key::RecordId;
use crate::late_writes::{Ended, Kind, Pending};
use crate::metrics::Metrics;
use crate::store::{deadline, OwnerToken, RecordState, Store, StoreError, StoredResponse};

use super::claim::{RELEASE_RETRY_PAUSE, RELEASE_RETRY_PAUSE_MAX};
use super::Shared;

/// What a late write puts in its record.
pub(super) enum Write {
    /// The whole answer (owner-checked); `retain`: the shorter retention of an answer that
    /// shows nothing ran; `limit`: how long one try may take.
    Answer {
        owner: OwnerToken,
        stored: StoredResponse,
        retain: Option<Duration>,
        limit: Duration,
    },
    /// The answer's status alone (owner-checked).
    NotKept { owner: OwnerToken, status: u16 },
    /// An observed route's later answer replacing a recorded failure.
    Supersede {
        fingerprint: Fingerprint,
        stored: StoredResponse,
        route: String,
    },
}

impl Write {
    fn status(&self) -> u16 {
        match self {
            Write::Answer { stored, .. } | Write::Supersede { stored, .. } => stored.status,
            Write::NotKept { status, .. } => *status,
        }
    }

    fn kind(&self) -> Kind {
        match self {
            Write::Answer { .. } => Kind::Answer,
            Write::NotKept { .. } => Kind::StatusAlone,
            Write::Supersede { .. } => Kind::Supersede,
        }
    }
}

/// A record write whose first try failed.
pub(super) struct Late {
    pub(super) id: RecordId,
    /// The request's `X-Request-Id`, for the shutdown log.
    pub(super) request_id: String,
    /// How long the record is kept: no try is made after.
    pub(super) retention: Duration,
    pub(super) write: Write,
}

/// The bytes a kept answer holds: its body and its headers.
pub(super) fn answer_size(answer: &StoredResponse) -> usize {
    let headers: usize = answer.headers.iter().map(|(n, v)| n.len() + v.len()).sum();
    answer.body.len() + headers
}

/// Queues `late`, tried again in the background, in work that shutdown waits for (within
/// `shutdown_grace`).
pub(super) fn write_in_background(shared: &Shared, late: Late) {
    let Late {
        id,
        request_id,
        retention,
        write,
    } = late;
    let status = write.status();
    // Outside a runtime (the process is going away) nothing can be spawned.
    if tokio::runtime::Handle::try_current().is_err() {
        shared.late.given_up();
        tracing::error!(record = %id, status, request_id, "could not write the record (shutting down): executed and answered {status}; complete it from the upstream's ledger");
        return;
    }
    let mut held = shared.buffers.hold();
    let write = match write {
        Write::Answer { owner, stored, .. } if !held.grow_if_room(answer_size(&stored)) => {
            tracing::warn!(record = %id, status, "no room in max_buffered_bytes to keep the answer while its record is written again; writing its status alone (retries get response-not-stored)");
            Write::NotKept {
                owner,
                status: stored.status,
            }
        }
        Write::Supersede { stored, .. } if !held.grow_if_room(answer_size(&stored)) => {
            // At a bounded rate: during an outage every observed 2xx may come here.
            if shared.observe_log.allow() {
                tracing::warn!(record = %id, status, "observe mode: no room in max_buffered_bytes to keep a later answer until it replaces the recorded failure; that failure would be replayed once the route enforces");
            }
            return;
        }
        w => w,
    };
    let pending = Pending {
        id,
        status,
        request_id: request_id.clone(),
        kind: write.kind(),
    };
    let Some(place) = shared.late.add(pending) else {
        if !matches!(write, Write::Supersede { .. }) {
            tracing::error!(record = %id, status, request_id, pending = shared.late.len(), "too many record writes pending; given up: executed and answered {status}, the record reads unknown once its lease runs out; complete it from the upstream's ledger");
        } else if shared.observe_log.allow() {
            tracing::warn!(record = %id, "observe mode: too many record writes pending to keep a later answer until it replaces a recorded failure");
        }
        return;
    };
    if let Write::Supersede { route, .. } = &write {
        shared.metrics.supersede_pending(route, true);
    }
    let (store, late, metrics) = (
        shared.store.clone(),
        shared.late.clone(),
        shared.metrics.clone(),
    );
    let store_timeout = shared.settings.config.store_timeout;
    shared.tasks.spawn(async move {
        let until = tokio::time::Instant::now() + retention;
        let mut write = write;
        let how = retry(&*store, &metrics, store_timeout, id, &mut write, until, &mut held).await;
        drop(held);
        late.done(place, how);
        if let Write::Supersede { route, .. } = &write {
            metrics.supersede_pending(route, false);
        }
        if how == Ended::GivenUp && !matches!(write, Write::Supersede { .. }) {
            tracing::error!(record = %id, status, request_id, "the record's retention ended before it could be written; given up: executed and answered {status}");
        }
    });
}

/// Tries `write` until it lands, is no longer ours, or `until` passes.
async fn retry(
    store: &dyn Store,
    metrics: &Metrics,
    store_timeout: Duration,
    id: RecordId,
    write: &mut Write,
    until: tokio::time::Instant,
    held: &mut crate::admission::Buffered,
) -> Ended {
    let mut pause = RELEASE_RETRY_PAUSE;
    let mut tries = 1u32;
    loop {
        tokio::time::sleep(pause).await;
        tries += 1;
        let result = match &*write {
            Write::Answer {
                owner,
                stored,
                limit,
                ..
            } => deadline(*limit, store.record(&id, owner, stored)).await,
            Write::NotKept { owner, status } => {
                deadline(store_timeout, store.record_not_kept(&id, owner, *status)).await
            }
            Write::Supersede {
                fingerprint,
                stored,
                ..
            } => deadline(store_timeout, store.supersede(&id, fingerprint, stored)).await,
        };
        match result {
            Ok(true) => {
                tracing::info!(record = %id, tries, "record written on a later try");
                landed(store, metrics, store_timeout, id, write).await;
                return Ended::Landed;
            }
            Ok(false) => {
                if !matches!(write, Write::Supersede { .. }) {
                    not_ours(store, store_timeout, &id).await;
                }
                return Ended::NotOurs;
            }
            // No room in the store for the answer: its status alone still keeps retries
            // from executing again.
            Err(StoreError::Full(e)) if matches!(write, Write::Answer { .. }) => {
                tracing::warn!(record = %id, error = %e, "no room in the store for the answer; writing its status alone");
                if let Write::Answer { owner, stored, .. } = &*write {
                    *write = Write::NotKept {
                        owner: owner.clone(),
                        status: stored.status,
                    };
                }
                held.shrink(usize::MAX);
                pause = RELEASE_RETRY_PAUSE;
                continue;
            }
            // No room for the later answer: the failure stays (logged as given up).
            Err(StoreError::Full(e)) if matches!(write, Write::Supersede { .. }) => {
                tracing::warn!(record = %id, error = %e, "observe mode: no room in the store for the later answer that replaces a recorded failure; that failure would be replayed once the route enforces");
                return Ended::GivenUp;
            }
            Err(e) => {
                // Once, and then every so often, so that a long outage shows without
                // flooding the log.
                if tries == 2 || tries.is_multiple_of(100) {
                    tracing::warn!(record = %id, tries, error = %e, "record write failed again; trying until it lands");
                }
            }
        }
        pause = (pause * 2).min(RELEASE_RETRY_PAUSE_MAX);
        if tokio::time::Instant::now() + pause >= until {
            if matches!(write, Write::Supersede { .. }) {
                tracing::warn!(record = %id, "observe mode: the record's retention ended before a later answer could replace its failure");
            }
            return Ended::GivenUp;
        }
    }
}

/// What follows a late write that landed: the answer counted, and the retention of one
/// that shows nothing ran shortened.
async fn landed(
    store: &dyn Store,
    metrics: &Metrics,
    store_timeout: Duration,
    id: RecordId,
    write: &Write,
) {
    match write {
        Write::Answer {
            owner,
            stored,
            retain,
            ..
        } => {
            metrics.answer_recorded(stored.status);
            if let Some(retain) = retain {
                if let Err(e) = deadline(store_timeout, store.shorten(&id, owner, *retain)).await {
                    tracing::warn!(record = %id, error = %e, "could not shorten the retention of an answer that shows nothing ran; it is kept for the route's retention");
                }
            }
        }
        Write::NotKept { status, .. } => metrics.answer_recorded(*status),
        Write::Supersede { .. } => {}
    }
}

/// Logs an owner-checked write of record `id` that found no row of its own.
pub(super) async fn not_ours(store: &dyn Store, store_timeout: Duration, id: &RecordId) {
    let found = deadline(store_timeout, store.inspect(id, false)).await;
    match found {
        Ok(Some(view)) if view.state == RecordState::Completed => {
            tracing::warn!(record = %id, status = ?view.status, "the record was completed without this answer (an operator completed it, or released it and a retry executed again); its retries replay that record");
        }
        _ => {
            tracing::error!(record = %id, "the claim of record {id} is gone from the store: an operator released it, or the store lost it (a failover to a copy that lacked it, a restore); if no operator did, its retries will execute again");
        }
    }
}
