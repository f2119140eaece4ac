//! The claim: one `BEGIN IMMEDIATE` transaction that replaces an expired record, respects
//! a withdrawal, inserts, or reads back what it found.

use std::time::Duration;

use bytes::Bytes;
use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};

use super::{backend, corrupt, ms, now_ms};
use crate::store::row::{COMPLETED, IN_PROGRESS};
use crate::store::{room_for, Claim, ClaimRequest, ReplayRoom, StoreError, StoredResponse};

pub(super) fn claim_now(
    c: &mut Connection,
    req: &ClaimRequest,
    namespace: &str,
) -> Result<Claim, StoreError> {
    let now = now_ms();
    let id = req.id.as_bytes().as_slice();
    let tx = c
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(backend)?;
    // An expired record is as good as absent: the claim replaces it.
    tx.execute(
        "DELETE FROM records WHERE id = ?1 AND expires <= ?2",
        params![id, now],
    )
    .map_err(backend)?;
    let withdrawn = tx
        .query_row(
            "SELECT 1 FROM withdrawn WHERE id = ?1 AND owner = ?2 AND until > ?3",
            params![id, req.owner.as_str(), now],
            |_| Ok(()),
        )
        .optional()
        .map_err(backend)?
        .is_some();
    let inserted = if withdrawn {
        0
    } else {
        tx.prepare_cached(
            "INSERT INTO records (id, state, fingerprint, fingerprint_version, owner,
               lease_until, busy_until, created, expires, namespace)
             VALUES (?1, 0, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)
             ON CONFLICT (id) DO NOTHING",
        )
        .and_then(|mut s| {
            s.execute(params![
                id,
                req.fingerprint.0.as_slice(),
                req.fingerprint_version,
                req.owner.as_str(),
                now + ms(req.lease),
                now + ms(req.busy_for),
                now,
                now + ms(req.retention),
                namespace,
            ])
        })
        .map_err(backend)?
    };
    let found = if inserted == 1 {
        Claim::Claimed
    } else {
        found(&tx, req, now)?
    };
    tx.commit().map_err(backend)?;
    Ok(found)
}

/// What a claim that inserted nothing found under `req.id`, in its transaction.
fn found(
    tx: &rusqlite::Transaction<'_>,
    req: &ClaimRequest,
    now: i64,
) -> Result<Claim, StoreError> {
    let id = req.id.as_bytes().as_slice();
    // A body longer than the room taken for it before the claim is not read with the
    // row: its length is, room is taken for it, and only then is it read.
    let inline = req.room.as_ref().map_or(usize::MAX, ReplayRoom::held);
    let inline = i64::try_from(inline).unwrap_or(i64::MAX);
    let row = tx
        .prepare_cached(
            "SELECT state, fingerprint, fingerprint_version, lease_until, status, headers,
               CASE WHEN length(body) <= ?2 THEN body END, length(body)
             FROM records WHERE id = ?1",
        )
        .and_then(|mut s| {
            s.query_row(params![id, inline], |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, Vec<u8>>(1)?,
                    r.get::<_, u16>(2)?,
                    r.get::<_, i64>(3)?,
                    r.get::<_, Option<u16>>(4)?,
                    r.get::<_, Option<Vec<u8>>>(5)?,
                    r.get::<_, Option<Vec<u8>>>(6)?,
                    r.get::<_, Option<i64>>(7)?,
                ))
            })
            .optional()
        })
        .map_err(backend)?;
    Ok(match row {
        // Only a withdrawal keeps a claim from inserting into an empty place.
        None => Claim::Withdrawn,
        Some((state, fp, fv, lease_until, status, headers, body, len)) => {
            if fv != req.fingerprint_version {
                Claim::OtherVersion(fv)
            } else if fp.as_slice() != req.fingerprint.0.as_slice() {
                Claim::Mismatch
            } else if state == COMPLETED {
                let status = status.ok_or_else(|| corrupt("completed without a status"))?;
                let len = usize::try_from(len.unwrap_or(0)).unwrap_or(usize::MAX);
                match headers {
                    // Completed without headers: the answer was too large to keep.
                    None => Claim::NotKept { status },
                    // Not read, and no room for it now: it stays on disk.
                    Some(_) if body.is_none() && !room_for(req.room.as_ref(), len) => {
                        Claim::NoRoom { status }
                    }
                    Some(headers) => {
                        let body = match body {
                            Some(body) => body,
                            None => read_body(tx, id)?,
                        };
                        Claim::Replay(StoredResponse {
                            status,
                            headers: StoredResponse::decode_headers(&headers)
                                .ok_or_else(|| corrupt("undecodable headers"))?,
                            body: Bytes::from(body),
                        })
                    }
                }
            } else if state == IN_PROGRESS && lease_until > now {
                Claim::InFlight {
                    lease_left: Duration::from_millis((lease_until - now) as u64),
                }
            } else {
                Claim::Unknown
            }
        }
    })
}

/// The body of record `id` (empty if it has none), in the claim's transaction: once room
/// was taken for it by its length.
fn read_body(tx: &rusqlite::Transaction<'_>, id: &[u8]) -> Result<Vec<u8>, StoreError> {
    tx.prepare_cached("SELECT body FROM records WHERE id = ?1")
        .and_then(|mut s| s.query_row(params![id], |r| r.get::<_, Option<Vec<u8>>>(0)))
        .map(Option::unwrap_or_default)
        .map_err(backend)
}
