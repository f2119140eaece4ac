//! One clock for the store: the wall clock plus the offset the file keeps.
//!
//! A running instance carries its clock on by the monotonic clock ([`now_ms`]), so a step
//! of the wall clock (an NTP step, a VM restored from a snapshot) moves none of its leases
//! or retentions. A later opener would read the stepped wall clock, though: 25 h ahead, it
//! expired every record at once, and a second process on the path swept the first one's.
//! So every store call compares the store's clock with the wall clock, and a difference
//! that moved by more than [`STEP_MS`] is written to `meta` as the store's offset; an
//! opener starts its clock at the wall clock plus that offset. The offset is dropped by an
//! opener that finds no record left (none written under it remains); a running instance
//! never drops it, since its clock may not jump.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use rusqlite::{params, Connection, OptionalExtension};

use super::{backend, now_ms, CLOCK_AHEAD};
use crate::store::StoreError;

/// The `meta` row of the offset: milliseconds the store's clock is ahead of the wall
/// clock (negative: behind).
const OFFSET: &str = "clock_offset";

/// A difference between the store's clock and the wall clock that moves by more than this
/// is a step of the wall clock.
pub(super) const STEP_MS: i64 = 60_000;

fn wall_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 4))
}

/// At open: the store's offset, applied to this process's clock (the wall clock plus it),
/// or dropped when no record remains. Returns the offset in force (0: none).
pub(super) fn open(conn: &Connection) -> Result<i64, StoreError> {
    let held: Option<String> = conn
        .query_row("SELECT value FROM meta WHERE name = ?1", [OFFSET], |r| {
            r.get(0)
        })
        .optional()
        .map_err(backend)?;
    let Some(offset) = held.and_then(|v| v.parse::<i64>().ok()) else {
        return Ok(0);
    };
    let records: i64 = conn
        .query_row("SELECT count(*) FROM records", [], |r| r.get(0))
        .map_err(backend)?;
    if records == 0 {
        conn.execute("DELETE FROM meta WHERE name = ?1", [OFFSET])
            .map_err(backend)?;
        tracing::info!(offset_ms = offset, "dropped the store's clock offset: no record written under it remains; the store follows the wall clock");
        return Ok(0);
    }
    let behind = wall_ms() + offset - now_ms();
    CLOCK_AHEAD.fetch_add(behind, Ordering::Relaxed);
    tracing::info!(offset_ms = offset, "the store keeps a clock offset from a step of the wall clock: its times are the wall clock plus it");
    Ok(offset)
}

/// After a store call: writes the store's offset when the wall clock stepped away from it
/// since `recorded` (the offset the file holds), and logs the step with its size.
pub(super) fn follow(conn: &Connection, recorded: &AtomicI64) {
    let offset = now_ms() - wall_ms();
    let was = recorded.load(Ordering::Relaxed);
    if (offset - was).abs() <= STEP_MS {
        return;
    }
    let wrote = conn.execute(
        "INSERT INTO meta (name, value) VALUES (?1, ?2)
         ON CONFLICT (name) DO UPDATE SET value = excluded.value",
        params![OFFSET, offset.to_string()],
    );
    match wrote {
        Ok(_) => {
            recorded.store(offset, Ordering::Relaxed);
            tracing::warn!(step_ms = was - offset, offset_ms = offset, "the wall clock stepped away from the store's clock: wrote the store's offset, so that every opener of the file keeps its records' times");
        }
        Err(e) => {
            tracing::warn!(error = %e, "could not write the store's clock offset; trying again at the next call");
        }
    }
}
