//! The SQLite store's upkeep, every [`UPKEEP_EVERY`] on a connection of its own: a tiny
//! write to `meta` that says whether the file takes writes, and a
//! `wal_checkpoint(TRUNCATE)` that gives the write-ahead log back to the file system.
//!
//! - Readiness: the store is local to its instance, so a file that takes no writes (full,
//!   read-only, locked from outside beyond the busy timeout) is this instance's trouble
//!   alone, and `/readyz` says so: after any failed call it answers 503 until one of these
//!   writes lands. The probe reads only that result.
//! - The log: SQLite resets its log only when no reader holds an older snapshot, so a long
//!   reader (an operator's `sqlite3` session, a backup) lets it grow with every write, and
//!   it keeps its size afterwards. The checkpoint here never waits (a checkpoint waiting
//!   for readers holds new writers back): once the reader has gone, the next one truncates
//!   the log to nothing, and `journal_size_limit` bounds what a reset leaves meanwhile.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use rusqlite::{params, Connection};

use super::{backend, now_ms, wal_file, BUSY_TIMEOUT};
use crate::store::{SelfCheck, StoreError};

/// How often the upkeep runs: a log is truncated within this long of its last reader
/// leaving, and readiness returns within this long (plus the write) of the file taking
/// writes again.
pub const UPKEEP_EVERY: Duration = Duration::from_secs(2);

/// `PRAGMA journal_size_limit`: what a reset leaves of the log at most.
pub const JOURNAL_SIZE_LIMIT: u64 = 4 * 1024 * 1024;

/// The `meta` row the upkeep writes (the store's time, in ms since the epoch).
const PROBE: &str = "idemgate_write_probe";

pub(super) struct Upkeep {
    conn: Mutex<Connection>,
    path: PathBuf,
    // The database file as this instance opened it, to compare with what its path names.
    file: std::fs::File,
    wal: PathBuf,
    // Why the store failed, until a write of the upkeep lands.
    failure: Mutex<Option<String>>,
    wal_bytes: AtomicU64,
}

impl Upkeep {
    /// A connection of its own to the database at `path` (in WAL mode already).
    pub(super) fn open(path: &Path) -> Result<Upkeep, StoreError> {
        let conn = Connection::open(path).map_err(backend)?;
        let file = std::fs::File::open(path)
            .map_err(|e| backend(format!("cannot open {}: {e}", path.display())))?;
        Ok(Upkeep {
            conn: Mutex::new(conn),
            path: path.to_path_buf(),
            file,
            wal: wal_file(path, "-wal"),
            failure: Mutex::new(None),
            wal_bytes: AtomicU64::new(0),
        })
    }

    fn failure(&self) -> std::sync::MutexGuard<'_, Option<String>> {
        self.failure.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A call on the store failed with `e`: the store reads as failing until a write of
    /// the upkeep lands. Errors that say nothing of the file (a corrupt or sealed record)
    /// do not count.
    pub(super) fn failed(&self, e: &StoreError) {
        if !matches!(e, StoreError::Backend(_) | StoreError::Full(_)) {
            return;
        }
        if self.failure().replace(e.to_string()).is_none() {
            tracing::warn!(path = %self.path.display(), error = %e, "a call on the SQLite store failed: /readyz answers 503 until a write lands (tried every 2 s)");
        }
    }

    /// What the upkeep last found, and whether the path still names the open file.
    pub(super) fn check(&self) -> SelfCheck {
        SelfCheck {
            write_failure: self.failure().clone(),
            wal_bytes: Some(self.wal_bytes.load(Ordering::Relaxed)),
            file_replaced: self.replaced(),
        }
    }

    /// Why the file at the store's path is not the one this instance opened, compared by
    /// device and inode: deleted (this instance writes to a file no one else will open), or
    /// replaced (another process, or a later start, opens another file than this one).
    fn replaced(&self) -> Option<String> {
        use std::os::unix::fs::MetadataExt;
        let path = self.path.display();
        let open = match self.file.metadata() {
            Ok(m) => m,
            Err(e) => return Some(format!("cannot read the open file of {path}: {e}")),
        };
        match std::fs::metadata(&self.path) {
            Ok(now) if (now.dev(), now.ino()) == (open.dev(), open.ino()) => None,
            Ok(_) => Some(format!("{path} is another file than the one this instance opened (replaced or moved under it)")),
            Err(e) => Some(format!("{path} is gone ({e}): the file this instance opened was deleted under it")),
        }
    }

    /// One round: the write, the checkpoint, the log's size. Blocking.
    pub(super) fn tick(&self) {
        let c = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let _ = c.busy_timeout(BUSY_TIMEOUT);
        let wrote = c.execute(
            "INSERT INTO meta (name, value) VALUES (?1, ?2)
             ON CONFLICT (name) DO UPDATE SET value = excluded.value",
            params![PROBE, now_ms().to_string()],
        );
        match wrote {
            Ok(_) => {
                if let Some(was) = self.failure().take() {
                    tracing::info!(path = %self.path.display(), was = %was, "the SQLite store takes writes again: ready");
                }
            }
            Err(e) => {
                let e = backend(e);
                if self.failure().replace(e.to_string()).is_none() {
                    tracing::warn!(path = %self.path.display(), error = %e, "the SQLite store takes no writes: /readyz answers 503 until one lands (tried every 2 s)");
                }
            }
        }
        let _ = c.busy_timeout(Duration::ZERO);
        if let Err(e) = c.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(())) {
            tracing::debug!(error = %e, "the SQLite log's checkpoint did not run; the next one will");
        }
        let n = std::fs::metadata(&self.wal).map_or(0, |m| m.len());
        self.wal_bytes.store(n, Ordering::Relaxed);
    }
}
