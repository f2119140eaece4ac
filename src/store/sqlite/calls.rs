//! The [`Store`] calls of the SQLite store, each one transaction on the blocking pool.

use std::time::Duration;

use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};

use super::claim::claim_now;
use super::*;

impl Store for SqliteStore {
    fn claim<'a>(&'a self, req: &'a ClaimRequest) -> StoreFuture<'a, Claim> {
        let (req, namespace) = (req.clone(), self.namespace.clone());
        self.run(move |c| claim_now(c, &req, &namespace))
    }

    fn record<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        response: &'a StoredResponse,
    ) -> StoreFuture<'a, bool> {
        let (id, owner) = (*id, owner.clone());
        let status = response.status;
        let headers = response.encode_headers();
        let body = response.body.clone();
        self.run(move |c| {
            let n = c
                .prepare_cached(
                    "UPDATE records SET state = 1, status = ?3, headers = ?4, body = ?5
                     WHERE id = ?1 AND owner = ?2 AND expires > ?6",
                )
                .and_then(|mut s| {
                    s.execute(params![
                        id.as_bytes().as_slice(),
                        owner.as_str(),
                        status,
                        headers,
                        &body[..],
                        now_ms()
                    ])
                })
                .map_err(backend)?;
            Ok(n == 1)
        })
    }

    fn shorten<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        retain: Duration,
    ) -> StoreFuture<'a, bool> {
        let (id, owner) = (*id, owner.clone());
        let ms = i64::try_from(retain.as_millis()).unwrap_or(i64::MAX);
        self.run(move |c| {
            let now = now_ms();
            let n = c
                .prepare_cached(
                    "UPDATE records SET expires = MIN(expires, ?3 + ?4)
                     WHERE id = ?1 AND owner = ?2 AND expires > ?3",
                )
                .and_then(|mut s| {
                    s.execute(params![id.as_bytes().as_slice(), owner.as_str(), now, ms])
                })
                .map_err(backend)?;
            Ok(n == 1)
        })
    }

    fn record_not_kept<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        status: u16,
    ) -> StoreFuture<'a, bool> {
        let (id, owner) = (*id, owner.clone());
        self.run(move |c| {
            // Completed with no headers and no body: what a claim reads as "not kept" (a
            // kept answer always has headers, if only an empty list).
            let n = c
                .prepare_cached(
                    "UPDATE records SET state = 1, status = ?3, headers = NULL, body = NULL
                     WHERE id = ?1 AND owner = ?2 AND expires > ?4",
                )
                .and_then(|mut s| {
                    s.execute(params![
                        id.as_bytes().as_slice(),
                        owner.as_str(),
                        status,
                        now_ms()
                    ])
                })
                .map_err(backend)?;
            Ok(n == 1)
        })
    }

    fn renew<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        lease: Duration,
    ) -> StoreFuture<'a, bool> {
        let (id, owner) = (*id, owner.clone());
        self.run(move |c| {
            let now = now_ms();
            let n = c
                .execute(
                    "UPDATE records SET lease_until = ?3
                     WHERE id = ?1 AND owner = ?2 AND state = 0 AND expires > ?4",
                    params![
                        id.as_bytes().as_slice(),
                        owner.as_str(),
                        now + ms(lease),
                        now
                    ],
                )
                .map_err(backend)?;
            Ok(n == 1)
        })
    }

    fn mark_unknown<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
    ) -> StoreFuture<'a, bool> {
        let (id, owner) = (*id, owner.clone());
        self.run(move |c| {
            let n = c
                .execute(
                    "UPDATE records SET state = ?4
                     WHERE id = ?1 AND owner = ?2 AND state <> ?5 AND expires > ?3",
                    params![
                        id.as_bytes().as_slice(),
                        owner.as_str(),
                        now_ms(),
                        UNKNOWN,
                        COMPLETED
                    ],
                )
                .map_err(backend)?;
            Ok(n == 1)
        })
    }

    fn release<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        linger: Duration,
    ) -> StoreFuture<'a, bool> {
        let (id, owner) = (*id, owner.clone());
        self.run(move |c| {
            let now = now_ms();
            let id = id.as_bytes().as_slice();
            let tx = c
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .map_err(backend)?;
            let n = tx
                .execute(
                    "DELETE FROM records WHERE id = ?1 AND owner = ?2 AND expires > ?3",
                    params![id, owner.as_str(), now],
                )
                .map_err(backend)?;
            if n == 0 {
                tx.execute(
                    "INSERT INTO withdrawn (id, owner, until) VALUES (?1, ?2, ?3)
                     ON CONFLICT (id, owner) DO UPDATE SET until = max(until, excluded.until)",
                    params![id, owner.as_str(), now + ms(linger)],
                )
                .map_err(backend)?;
            }
            tx.commit().map_err(backend)?;
            Ok(n == 1)
        })
    }

    fn inspect<'a>(
        &'a self,
        id: &'a RecordId,
        with_body: bool,
    ) -> StoreFuture<'a, Option<RecordView>> {
        let (id, namespace) = (*id, self.namespace.clone());
        self.run(move |c| inspect_in(c, id, with_body, &namespace))
    }

    fn delete<'a>(
        &'a self,
        id: &'a RecordId,
        force: bool,
        any_namespace: bool,
    ) -> StoreFuture<'a, Deleted> {
        let (id, namespace) = (*id, self.namespace.clone());
        self.run(move |c| {
            operator_step(c, &id, &namespace, |tx, id, row| {
                Ok(match row {
                    None => Deleted::NotFound,
                    Some((_, _, true)) if !any_namespace => Deleted::Unscoped,
                    Some((_, true, _)) if !force => Deleted::OwnerBusy,
                    Some(_) => {
                        tx.execute("DELETE FROM records WHERE id = ?1", params![id])
                            .map_err(backend)?;
                        Deleted::Deleted
                    }
                })
            })
        })
    }

    fn complete<'a>(
        &'a self,
        id: &'a RecordId,
        response: &'a StoredResponse,
        force: bool,
        any_namespace: bool,
    ) -> StoreFuture<'a, Completed> {
        let (id, namespace) = (*id, self.namespace.clone());
        let status = response.status;
        let headers = response.encode_headers();
        let body = response.body.to_vec();
        self.run(move |c| {
            operator_step(c, &id, &namespace, |tx, id, row| {
                Ok(match row {
                    None => Completed::NotFound,
                    Some((_, _, true)) if !any_namespace => Completed::Unscoped,
                    // Kept or not kept, it holds the upstream's (or an operator's) answer.
                    Some((COMPLETED, _, _)) => Completed::AlreadyCompleted,
                    Some((_, true, _)) if !force => Completed::OwnerBusy,
                    Some(_) => {
                        // The owner is cleared, so the former owner's late record is refused.
                        tx.execute(
                            "UPDATE records SET state = ?2, owner = '', status = ?3, headers = ?4,
                               body = ?5
                             WHERE id = ?1",
                            params![id, COMPLETED, status, headers, body],
                        )
                        .map_err(backend)?;
                        Completed::Completed
                    }
                })
            })
        })
    }

    fn supersede<'a>(
        &'a self,
        id: &'a RecordId,
        fingerprint: &'a crate::fingerprint::Fingerprint,
        response: &'a StoredResponse,
    ) -> StoreFuture<'a, bool> {
        let id = *id;
        let fingerprint = fingerprint.0;
        let status = response.status;
        let headers = response.encode_headers();
        let body = response.body.to_vec();
        self.run(move |c| {
            let n = c
                .execute(
                    "UPDATE records SET status = ?3, headers = ?4, body = ?5
                     WHERE id = ?1 AND expires > ?6 AND state = ?7 AND fingerprint = ?2
                       AND (status IS NULL OR status < 200 OR status >= 300)",
                    params![
                        id.as_bytes().as_slice(),
                        fingerprint.as_slice(),
                        status,
                        headers,
                        body,
                        now_ms(),
                        COMPLETED
                    ],
                )
                .map_err(backend)?;
            Ok(n == 1)
        })
    }

    fn list<'a>(
        &'a self,
        state: Option<RecordState>,
        cursor: &'a str,
        count: usize,
    ) -> StoreFuture<'a, Page> {
        // The cursor is the last id examined (hex): a page is the next `count` live ids in
        // primary-key order, so each call reads about `count` rows however many there are.
        let after = if cursor.is_empty() {
            None
        } else {
            match RecordId::from_hex(cursor) {
                Some(id) => Some(id),
                None => return Box::pin(async { Err(corrupt("not a cursor of this store")) }),
            }
        };
        let count = count.max(1);
        let namespace = self.namespace.clone();
        self.run(move |c| {
            let now = now_ms();
            let after: &[u8] = after.as_ref().map_or(&[], |id| id.as_bytes().as_slice());
            let ids: Vec<Vec<u8>> = c
                .prepare_cached(
                    "SELECT id FROM records WHERE id > ?1 AND expires > ?2 ORDER BY id LIMIT ?3",
                )
                .and_then(|mut s| {
                    s.query_map(params![after, now, count as i64], |r| r.get(0))?
                        .collect()
                })
                .map_err(backend)?;
            let mut walk = Walk::new(state);
            for raw in &ids {
                let id = walk.id(raw, corrupt)?;
                walk.saw(inspect_in(c, id, false, &namespace)?);
            }
            Ok(walk.page(ids.len(), count))
        })
    }

    fn ping(&self) -> StoreFuture<'_, ()> {
        self.run(|c| c.query_row("SELECT 1", [], |_| Ok(())).map_err(backend))
    }

    fn kind(&self) -> crate::store::StoreKind {
        crate::store::StoreKind::Sqlite
    }

    fn meta<'a>(&'a self, name: &'a str, offer: Option<&'a str>) -> StoreFuture<'a, Meta> {
        let (name, offer) = (name.to_string(), offer.map(str::to_string));
        self.run(move |c| {
            // Insert if absent, then read: the first start of the database makes the
            // secret, every later one (and every process opening the file) reads it back.
            let created = match &offer {
                Some(v) => {
                    c.execute(
                        "INSERT INTO meta (name, value) VALUES (?1, ?2)
                         ON CONFLICT (name) DO NOTHING",
                        params![name, v],
                    )
                    .map_err(backend)?
                        == 1
                }
                None => false,
            };
            let value: Option<String> = c
                .query_row(
                    "SELECT value FROM meta WHERE name = ?1",
                    params![name],
                    |r| r.get(0),
                )
                .optional()
                .map_err(backend)?;
            Ok(Meta { value, created })
        })
    }
}

/// An operator's delete or complete, as one transaction: reads what [`operator_row`]
/// reports of the record `id`, then lets `act` change it (handed the transaction, the id's
/// bytes and that row), and commits.
fn operator_step<T>(
    c: &mut Connection,
    id: &RecordId,
    namespace: &str,
    act: impl FnOnce(
        &rusqlite::Transaction<'_>,
        &[u8],
        Option<(i64, bool, bool)>,
    ) -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    let now = now_ms();
    let id = id.as_bytes().as_slice();
    let tx = c
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(backend)?;
    let row = operator_row(&tx, id, namespace, now)?;
    let out = act(&tx, id, row)?;
    tx.commit().map_err(backend)?;
    Ok(out)
}

/// What an operator's delete or complete checks, in its transaction: the live record's
/// state, whether its owner may still be working (a live lease, or busy), and whether it
/// was written without a namespace (by an older version). Another namespace's record is
/// not there for it (`None`).
fn operator_row(
    tx: &rusqlite::Transaction<'_>,
    id: &[u8],
    namespace: &str,
    now: i64,
) -> Result<Option<(i64, bool, bool)>, StoreError> {
    let row = tx
        .query_row(
            "SELECT state, lease_until, busy_until, namespace IS NULL FROM records
             WHERE id = ?1 AND expires > ?2 AND (namespace = ?3 OR namespace IS NULL)",
            params![id, now, namespace],
            |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, i64>(1)?,
                    r.get::<_, i64>(2)?,
                    r.get::<_, bool>(3)?,
                ))
            },
        )
        .optional()
        .map_err(backend)?;
    Ok(row.map(|(state, lease_until, busy_until, unscoped)| {
        let busy = state == IN_PROGRESS && (lease_until > now || busy_until > now);
        (state, busy, unscoped)
    }))
}

/// A record as operators see it, read on `c`; `None` if there is none live that
/// `namespace` sees (its own, or one written without a namespace).
fn inspect_in(
    c: &Connection,
    id: RecordId,
    with_body: bool,
    namespace: &str,
) -> Result<Option<RecordView>, StoreError> {
    let now = now_ms();
    let row = c
        .query_row(
            "SELECT state, fingerprint, fingerprint_version, lease_until, busy_until,
                   created, expires, status, body, headers IS NOT NULL, namespace FROM records
                 WHERE id = ?1 AND expires > ?2 AND (namespace = ?3 OR namespace IS NULL)",
            params![id.as_bytes().as_slice(), now, namespace],
            |r| {
                Ok((
                    (
                        r.get::<_, i64>(0)?,
                        r.get::<_, Vec<u8>>(1)?,
                        r.get::<_, u16>(2)?,
                        r.get::<_, i64>(3)?,
                        r.get::<_, i64>(4)?,
                        r.get::<_, i64>(5)?,
                        r.get::<_, i64>(6)?,
                    ),
                    r.get::<_, Option<u16>>(7)?,
                    if with_body {
                        r.get::<_, Option<Vec<u8>>>(8)?
                    } else {
                        None
                    },
                    r.get::<_, bool>(9)?,
                    r.get::<_, Option<String>>(10)?,
                ))
            },
        )
        .optional()
        .map_err(backend)?;
    let Some((times, status, body, kept, written_in)) = row else {
        return Ok(None);
    };
    let (state, fp, fv, lease_until, busy_until, created, expires) = times;
    let row = ViewRow {
        state,
        fingerprint: fp,
        fingerprint_version: fv,
        lease_left: lease_until - now,
        busy_left: busy_until - now,
        created,
        ttl: expires - now,
        status,
        body,
        body_kept: kept,
        namespace: written_in,
    };
    row.view(&id, corrupt).map(Some)
}
