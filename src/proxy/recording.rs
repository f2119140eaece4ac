//! Writing a claimed request's record: the answer as its record keeps it, the lease
//! renewed while the upstream works, and the record completed, released or left
//! `unknown`.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hyper::header::{CONTENT_LENGTH, DATE, SET_COOKIE};
use tracing::Span;

use crate::key::RecordId;
use crate::limits::{HEADERS_OMITTED, RECORDED_HEADERS_ROOM};
use crate::request_id::X_REQUEST_ID;
use crate::store::{deadline, OwnerToken, StoreError, StoredResponse};
use crate::telemetry::{self, Step};

use super::claim::release_in_background;
use super::exchange::RecordAt;
use super::late::{self, Late, Write};
use super::Shared;

/// An upstream's whole answer on its way into its record.
pub(super) struct Recording {
    pub(super) id: RecordId,
    pub(super) owner: OwnerToken,
    pub(super) stored: StoredResponse,
    // The request's span: parent of the record's.
    pub(super) span: Span,
    // Bounds how long the record may take (see `record_deadline`).
    pub(super) upstream_timeout: Duration,
    // How long the record is kept instead of the route's retention (an answer that shows
    // nothing ran), if it is.
    pub(super) retain: Option<Duration>,
    // The route's retention: how long a write that failed is tried again.
    pub(super) retention: Duration,
    // The request's `X-Request-Id`, named if the record is never written.
    pub(super) request_id: String,
}

/// Whether an answer's `name` header says `no-store` (one of its comma-separated tokens,
/// in any case).
pub(super) fn declines_record(
    headers: &hyper::HeaderMap,
    name: &hyper::header::HeaderName,
) -> bool {
    headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("no-store"))
}

/// An answer as its record keeps it: its status, its replayable headers (the request id
/// names one request, and a replay carries its own) and its body. Headers beyond
/// [`RECORDED_HEADERS_ROOM`] are left out, and the record says how many
/// ([`HEADERS_OMITTED`]), so that the answer fits the room its claim reserved.
pub(super) fn stored(parts: &hyper::http::response::Parts, body: Bytes) -> StoredResponse {
    let mut room = RECORDED_HEADERS_ROOM;
    let mut omitted = 0usize;
    let mut headers = Vec::with_capacity(parts.headers.len());
    for (n, v) in parts
        .headers
        .iter()
        .filter(|(n, _)| ![DATE, SET_COOKIE, CONTENT_LENGTH, X_REQUEST_ID].contains(n))
    {
        let size = crate::limits::recorded_header_size(n.as_str(), v.as_bytes());
        if size > room {
            omitted += 1;
            continue;
        }
        room -= size;
        headers.push((n.as_str().to_string(), Bytes::copy_from_slice(v.as_bytes())));
    }
    if omitted > 0 {
        tracing::info!(
            omitted,
            "the answer's headers need more than the room a record keeps for them; recorded without those, and its replays say how many"
        );
        headers.push((
            HEADERS_OMITTED.to_string(),
            Bytes::from(omitted.to_string()),
        ));
    }
    StoredResponse {
        status: parts.status.as_u16(),
        headers,
        body,
    }
}

/// Runs a store write that settles a record: awaited, or with
/// [`RecordAt::AfterAnswerWithBreaker`] after the client's answer, in a task that shutdown
/// waits for, whose failure counts towards observe mode's store breaker. `work` says
/// whether the store answered.
pub(super) async fn settle_record(
    shared: &Arc<Shared>,
    record_at: RecordAt,
    work: impl std::future::Future<Output = bool> + Send + 'static,
) {
    if record_at == RecordAt::AfterAnswerWithBreaker {
        let s = Arc::clone(shared);
        shared.tasks.spawn(async move {
            let answered = work.await;
            s.store_failing.took(answered);
        });
    } else {
        work.await;
    }
}

/// Releases a claim never processed (owner-checked), and tries again in the background
/// when the store does not answer. Whether it answered.
pub(super) async fn release(
    shared: Arc<Shared>,
    id: RecordId,
    owner: OwnerToken,
    linger: Duration,
) -> bool {
    let store_timeout = shared.settings.config.store_timeout;
    match deadline(store_timeout, shared.store.release(&id, &owner, linger)).await {
        Ok(_) => true,
        Err(e) => {
            tracing::warn!(record = %id, error = %e, "could not release the claim; trying again in the background");
            release_in_background(&shared, id, owner, linger);
            false
        }
    }
}

/// Writes an upstream's whole answer into its record (owner-checked), logging what went
/// wrong; an answer the store has no room for is recorded without its body, and one the
/// store did not take is written again in the background until it lands (see
/// [`late`](super::late)). Whether the store answered the first try (`false`: it failed or
/// did not answer in time).
pub(super) async fn record_answer(shared: &Shared, recording: Recording) -> bool {
    let Recording {
        id,
        owner,
        stored,
        span,
        upstream_timeout,
        retain,
        retention,
        request_id,
    } = &recording;
    let (upstream_timeout, retain) = (*upstream_timeout, *retain);
    let store_timeout = shared.settings.config.store_timeout;
    let limit = record_deadline(store_timeout, upstream_timeout, stored.body.len());
    let record_span = telemetry::child(span, Step::Record);
    let recorded = deadline(limit, shared.store.record(id, owner, stored)).await;
    drop(record_span);
    match recorded {
        Ok(true) => {
            shared.metrics.answer_recorded(stored.status);
            let Some(retain) = retain else { return true };
            // Failing, the record keeps the route's retention: it holds room longer, and
            // nothing runs twice.
            match deadline(store_timeout, shared.store.shorten(id, owner, retain)).await {
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(record = %id, error = %e, "could not shorten the retention of an answer that shows nothing ran; it is kept for the route's retention")
                }
            }
            true
        }
        // No room for this answer (the embedded store's byte cap, Redis out of memory): the
        // status alone still keeps retries from executing again.
        Err(StoreError::Full(e)) => {
            tracing::warn!(record = %id, error = %e, "no room in the store for the answer; recording it without its body");
            let writer = Writer {
                id: *id,
                owner: owner.clone(),
                request_id: request_id.clone(),
                retention: *retention,
            };
            record_not_kept(shared, &writer, stored.status).await;
            true
        }
        Ok(false) => {
            late::not_ours(&*shared.store, store_timeout, id).await;
            true
        }
        // The record stays in progress while it is written again: a retry reaching this
        // instance is told to wait; elsewhere it reads `unknown` once its lease runs out,
        // until the write lands. Never a second execution.
        Err(e) => {
            tracing::warn!(record = %id, error = %e, "could not record the upstream's answer; trying again in the background until it lands");
            let Recording {
                id,
                owner,
                stored,
                retain,
                retention,
                request_id,
                ..
            } = recording;
            let write = Write::Answer {
                owner,
                stored,
                retain,
                limit,
            };
            late::write_in_background(
                shared,
                Late {
                    id,
                    request_id,
                    retention,
                    write,
                },
            );
            false
        }
    }
}

/// How long recording an answer of `len` bytes may take: the store's
/// [`record_budget`](crate::store::record_budget), the whole at most `upstream_timeout`
/// (and never less than `store_timeout`). One `store_timeout` for the whole had an 80 MiB answer (320
/// pieces) time out half way: the client got its answer, its record never landed, and
/// the retry got 409 instead of the replay.
pub(super) fn record_deadline(
    store_timeout: Duration,
    upstream_timeout: Duration,
    len: usize,
) -> Duration {
    crate::store::record_budget(store_timeout, len).min(upstream_timeout.max(store_timeout))
}

/// Who writes a record, and for how long it may.
pub(super) struct Writer {
    pub(super) id: RecordId,
    pub(super) owner: OwnerToken,
    pub(super) request_id: String,
    pub(super) retention: Duration,
}

/// Completes a record without its body, logging what went wrong; a write the store did
/// not take is tried again in the background, as an answer's is.
pub(super) async fn record_not_kept(shared: &Shared, writer: &Writer, status: u16) {
    let Writer {
        id,
        owner,
        request_id,
        retention,
    } = writer;
    let store_timeout = shared.settings.config.store_timeout;
    let call = shared.store.record_not_kept(id, owner, status);
    match deadline(store_timeout, call).await {
        Ok(true) => shared.metrics.answer_recorded(status),
        Ok(false) => late::not_ours(&*shared.store, store_timeout, id).await,
        Err(e) => {
            tracing::warn!(record = %id, error = %e, "could not record the upstream's status; trying again in the background until it lands");
            let write = Write::NotKept {
                owner: owner.clone(),
                status,
            };
            let late = Late {
                id: *id,
                request_id: request_id.clone(),
                retention: *retention,
                write,
            };
            late::write_in_background(shared, late);
        }
    }
}

/// Awaits `work` while renewing the lease every third of its length. The fast path (an
/// upstream that answers within a third of the lease) costs no store call at all.
pub(super) async fn renewing_lease<T>(
    shared: &Shared,
    id: &RecordId,
    owner: &OwnerToken,
    lease: Duration,
    work: impl std::future::Future<Output = T>,
) -> T {
    let period = lease / 3;
    let store_timeout = crate::store::renew_deadline(shared.settings.config.store_timeout, lease);
    tokio::pin!(work);
    let mut next = tokio::time::Instant::now() + period;
    loop {
        tokio::select! {
            out = &mut work => return out,
            _ = tokio::time::sleep_until(next) => {
                next += period;
                let renew = shared.store.renew(id, owner, lease);
                // The renewal races the work, so a slow store never delays the answer.
                tokio::select! {
                    out = &mut work => return out,
                    r = deadline(store_timeout, renew) => match r {
                        Ok(true) => {}
                        Ok(false) => tracing::warn!(record = %id, "lease renewal refused: the claim is no longer ours"),
                        Err(e) => tracing::warn!(record = %id, error = %e, "lease renewal failed"),
                    },
                }
            }
        }
    }
}
