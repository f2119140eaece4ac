//! The persistent embedded store: the same semantics as the others, in an SQLite database
//! on local disk (`store_path`), so that records survive a restart of idemgate.
//!
//! # Durability
//!
//! The database runs in write-ahead-log mode with `synchronous = FULL`: every call that
//! changes a record (claim, record, renew, mark unknown, release, delete) commits before it
//! answers, and a commit returns only after the log has been fsynced. So:
//! - a crash of idemgate (SIGKILL, OOM kill, panic) loses nothing that was answered;
//! - a crash of the machine (power loss, kernel panic) loses nothing that was answered
//!   either, provided the disk honours fsync (a volume whose cache lies about it can lose
//!   the last commits, and then a claim can be forgotten and a retry pay twice);
//! - a call interrupted by the crash before it answered may or may not have landed, as with
//!   any store: idemgate treats its outcome as unknown.
//!
//! Records are timed by the wall clock (milliseconds since the Unix epoch), since they
//! outlive the process; a clock that jumps moves leases and retention with it.
//!
//! # Concurrency
//!
//! One connection behind a lock; every call runs on tokio's blocking pool, never on an
//! async worker. A claim is one `BEGIN IMMEDIATE` transaction (the database's write lock
//! is taken first, then the record looked up and inserted), so two claims, in this process
//! or in another one opening the same file, cannot both create the record. The file is for
//! one machine: SQLite's locks do not hold on network file systems.
//!
//! # Namespaces
//!
//! Every claim writes the store's namespace beside the record (the `namespace` column,
//! added to an older file as it opens, under the same `user_version`, so that an older
//! version still opens it). Operators' calls see the records of this namespace and those
//! written without one (by an older version), which they change only when asked to reach
//! any namespace; another namespace's records are not there for them.
//!
//! # Expiry
//!
//! A periodic sweep deletes expired records in batches of [`EXPIRE_BATCH`], one short
//! transaction each, letting go of the lock between batches; a claim for an id whose
//! record has expired replaces it in its own transaction.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rusqlite::{params, Connection, TransactionBehavior};

use super::row::{ViewRow, Walk, COMPLETED, IN_PROGRESS, UNKNOWN};
use super::{
    Claim, ClaimRequest, Completed, Deleted, Meta, OwnerToken, Page, RecordState, RecordView,
    Store, StoreError, StoreFuture, StoredResponse,
};
use crate::key::RecordId;

mod calls;
mod claim;

/// The database file inside `store_path`.
pub const FILE_NAME: &str = "idemgate.sqlite3";

/// The schema this build writes (`PRAGMA user_version`). A database with a higher version
/// was made by a newer idemgate and is refused rather than misread. Additive changes (the
/// `namespace` column) leave it as it is, so that older versions still open the file.
const SCHEMA_VERSION: i64 = 1;

/// How many expired records one sweep transaction deletes at most.
pub const EXPIRE_BATCH: usize = 1000;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS meta (
  name TEXT PRIMARY KEY,
  value TEXT NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS records (
  id BLOB PRIMARY KEY,
  state INTEGER NOT NULL,          -- 0 in progress, 1 completed, 2 unknown
  fingerprint BLOB NOT NULL,
  fingerprint_version INTEGER NOT NULL,
  owner TEXT NOT NULL,
  lease_until INTEGER NOT NULL,    -- ms since the epoch; meaningful while in progress
  busy_until INTEGER NOT NULL,
  created INTEGER NOT NULL,
  expires INTEGER NOT NULL,
  status INTEGER,
  headers BLOB,
  body BLOB
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS records_expires ON records (expires);
CREATE TABLE IF NOT EXISTS withdrawn (
  id BLOB NOT NULL,
  owner TEXT NOT NULL,
  until INTEGER NOT NULL,
  PRIMARY KEY (id, owner)
) WITHOUT ROWID;
";

/// The SQLite store. Cheap to clone; clones share the connection.
#[derive(Clone)]
pub struct SqliteStore {
    conn: Arc<Shared>,
    path: Arc<PathBuf>,
    /// The namespace every record this store writes is kept under (the `namespace`
    /// column), and the only one, besides records written without one, that operators'
    /// calls see.
    namespace: Arc<str>,
}

/// The connection, and the one thread that uses it.
///
/// Every call runs on that thread, not on the blocking pool: SQLite allocates a large body
/// it reads with the C allocator, whose arena is per thread and keeps what was freed, so
/// calls spread over the pool's threads left a 4 MiB record's buffer in each of their
/// arenas (300 slow readers of one: the peak grew by 134 MiB, of which the 64 MiB budget
/// served). Calls were one at a time on the connection anyway.
struct Shared {
    conn: Mutex<Connection>,
    jobs: std::sync::mpsc::Sender<Job>,
}

type Job = Box<dyn FnOnce() + Send>;

impl Shared {
    /// The connection, and its thread started; the thread ends when the last
    /// [`SqliteStore`] clone is dropped.
    fn start(conn: Connection) -> Result<Arc<Shared>, StoreError> {
        let (jobs, queue) = std::sync::mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("idemgate-sqlite".into())
            .spawn(move || {
                while let Ok(job) = queue.recv() {
                    job();
                }
            })
            .map_err(|e| backend(format!("cannot start the store's thread: {e}")))?;
        Ok(Arc::new(Shared {
            conn: Mutex::new(conn),
            jobs,
        }))
    }
}

fn backend(e: impl std::fmt::Display) -> StoreError {
    StoreError::Backend(format!("sqlite: {e}"))
}

/// Creates the directory (0700) and the database file (0600) readable by their owner
/// only: they hold the scope secret and every recorded answer. SQLite gives its `-wal` and
/// `-shm` files the database file's permissions. A directory or file that already exists
/// with wider permissions is left as it is, with a warning.
fn owner_only(dir: &Path, file: &Path) -> Result<(), StoreError> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| backend(format!("cannot create {}: {e}", dir.display())))?;
    if let Err(e) = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(file)
    {
        if e.kind() != std::io::ErrorKind::AlreadyExists {
            return Err(backend(format!("cannot create {}: {e}", file.display())));
        }
    }
    for p in [
        dir.to_path_buf(),
        file.to_path_buf(),
        wal_file(file, "-wal"),
        wal_file(file, "-shm"),
    ] {
        if let Ok(meta) = std::fs::metadata(&p) {
            let mode = meta.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                tracing::warn!(path = %p.display(), mode = format!("{mode:o}"), "the store's files hold the scope secret and recorded answers, but others may read this one: chmod go-rwx it");
            }
        }
    }
    Ok(())
}

fn wal_file(file: &Path, suffix: &str) -> PathBuf {
    let mut name = file.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

/// The store's clock, in ms since the epoch: the wall clock read once, the first time it is
/// needed, then carried on by the monotonic clock, so that retention, leases and busy times
/// are immune to the wall clock jumping while idemgate runs (an NTP step, a VM restored
/// from a snapshot: a jump of 25 h ahead had every answered key execute again). The times
/// are stored in the file and read again after a restart, so each open also keeps the
/// clock from running behind the newest time the file holds ([`clock_not_before`]); a jump
/// ahead while no process had the file open cannot be told from the time it spent closed.
fn now_ms() -> i64 {
    let (wall, at) = CLOCK.get_or_init(|| {
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or(0);
        (wall, std::time::Instant::now())
    });
    let elapsed = i64::try_from(at.elapsed().as_millis()).unwrap_or(i64::MAX / 4);
    wall + elapsed + CLOCK_AHEAD.load(std::sync::atomic::Ordering::Relaxed)
}

static CLOCK: std::sync::OnceLock<(i64, std::time::Instant)> = std::sync::OnceLock::new();
// How far the clock was moved ahead so as not to run behind a file's newest time.
static CLOCK_AHEAD: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);

/// Moves the store's clock ahead to `newest` if it is behind it (the wall clock went back
/// while the file was closed): a record's times never go backwards.
fn clock_not_before(newest: i64) {
    let behind = newest - now_ms();
    if behind > 0 {
        CLOCK_AHEAD.fetch_add(behind, std::sync::atomic::Ordering::Relaxed);
    }
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 4)
}

impl SqliteStore {
    /// Opens (creating if needed) the database in directory `dir`, and migrates its schema;
    /// its records are written under `namespace`. Blocking: call it from start-up code or
    /// a blocking task.
    pub fn open(dir: &Path, namespace: &str) -> Result<SqliteStore, StoreError> {
        let path = dir.join(FILE_NAME);
        owner_only(dir, &path)?;
        let conn = Connection::open(&path).map_err(backend)?;
        // Another process holding the write lock makes a call wait, not fail, for this long;
        // every call also runs under the store deadline of its caller.
        conn.busy_timeout(Duration::from_secs(5)).map_err(backend)?;
        let mode: String = conn
            .query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))
            .map_err(backend)?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(backend(format!(
                "{} cannot use the write-ahead log (journal mode {mode})",
                path.display()
            )));
        }
        conn.execute_batch("PRAGMA synchronous = FULL;")
            .map_err(backend)?;
        let version: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .map_err(backend)?;
        if version > SCHEMA_VERSION {
            return Err(StoreError::Corrupt(format!(
                "{} has schema version {version}, newer than this idemgate's {SCHEMA_VERSION}",
                path.display()
            )));
        }
        conn.execute_batch(&format!("BEGIN IMMEDIATE; {SCHEMA}"))
            .map_err(backend)?;
        let migrated = add_namespace_column(&conn).and_then(|()| {
            conn.execute_batch(&format!("PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;"))
                .map_err(backend)
        });
        if migrated.is_err() {
            let _ = conn.execute_batch("ROLLBACK;");
        }
        migrated?;
        // Created and claimed times only ever move forward on a sane clock.
        let newest: Option<i64> = conn
            .query_row("SELECT max(created) FROM records", [], |r| r.get(0))
            .map_err(backend)?;
        if let Some(newest) = newest {
            clock_not_before(newest);
        }
        Ok(SqliteStore {
            conn: Shared::start(conn)?,
            path: Arc::new(path),
            namespace: namespace.into(),
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` on the connection, on the store's thread.
    fn run<'a, T: Send + 'static>(
        &'a self,
        f: impl FnOnce(&mut Connection) -> Result<T, StoreError> + Send + 'static,
    ) -> StoreFuture<'a, T> {
        let shared = self.conn.clone();
        Box::pin(async move {
            let (done, result) = tokio::sync::oneshot::channel();
            let job = Box::new(move || {
                // A panic while holding the lock leaves no half-written record: every
                // change is a transaction, rolled back when it is dropped unfinished. It
                // fails this call (its answer is dropped), and the thread goes on.
                let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let mut c = shared.conn.lock().unwrap_or_else(|p| p.into_inner());
                    f(&mut c)
                }));
                if let Ok(r) = ran {
                    let _ = done.send(r);
                }
            });
            self.conn
                .jobs
                .send(job)
                .map_err(|_| backend("the store's thread has stopped"))?;
            result.await.map_err(|_| backend("a store call panicked"))?
        })
    }

    /// Deletes up to [`EXPIRE_BATCH`] expired records (and forgotten withdrawals) in one
    /// transaction; returns how many records it deleted.
    pub fn sweep_batch(conn: &mut Connection) -> Result<usize, StoreError> {
        let now = now_ms();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(backend)?;
        let n = tx
            .execute(
                "DELETE FROM records WHERE id IN
                   (SELECT id FROM records WHERE expires <= ?1 ORDER BY expires LIMIT ?2)",
                params![now, EXPIRE_BATCH as i64],
            )
            .map_err(backend)?;
        tx.execute("DELETE FROM withdrawn WHERE until <= ?1", params![now])
            .map_err(backend)?;
        tx.commit().map_err(backend)?;
        Ok(n)
    }

    /// Deletes every expired record, batch after batch; returns how many records are left.
    pub async fn sweep(&self) -> Result<usize, StoreError> {
        loop {
            let n = self.run(Self::sweep_batch).await?;
            if n < EXPIRE_BATCH {
                break;
            }
            tokio::task::yield_now().await;
        }
        self.run(|c| {
            c.query_row("SELECT count(*) FROM records", [], |r| r.get::<_, i64>(0))
                .map(|n| n as usize)
                .map_err(backend)
        })
        .await
    }

    /// Sweeps expired records every `period` in a background task, which ends when the last
    /// clone of the store is dropped.
    pub fn spawn_sweeper(&self, period: Duration) -> tokio::task::JoinHandle<()> {
        let (path, namespace) = (self.path.clone(), self.namespace.clone());
        super::spawn_sweeper(&self.conn, period, move |conn| {
            let store = SqliteStore {
                conn,
                path: path.clone(),
                namespace: namespace.clone(),
            };
            async move {
                if let Err(e) = store.sweep().await {
                    tracing::warn!(error = %e, "sweeping expired records failed");
                }
            }
        })
    }
}

/// Adds the `namespace` column to a table made by a version without it, in the open
/// migration's transaction. Additive, under the same `user_version`: a version before it
/// still opens the file, and writes rows without a namespace (`NULL`), which every
/// namespace sees (see [`Store::inspect`]).
fn add_namespace_column(conn: &Connection) -> Result<(), StoreError> {
    let has: bool = conn
        .query_row(
            "SELECT count(*) > 0 FROM pragma_table_info('records') WHERE name = 'namespace'",
            [],
            |r| r.get(0),
        )
        .map_err(backend)?;
    if !has {
        conn.execute_batch("ALTER TABLE records ADD COLUMN namespace TEXT;")
            .map_err(backend)?;
    }
    Ok(())
}

fn corrupt(what: &str) -> StoreError {
    StoreError::Corrupt(format!("sqlite record: {what}"))
}

#[cfg(test)]
mod permission_tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn the_store_is_readable_by_its_owner_only() {
        let base = tempfile::tempdir().expect("tempdir");
        let dir = base.path().join("records");
        let store = SqliteStore::open(&dir, "default").expect("opens");
        let mode = |p: &Path| std::fs::metadata(p).expect("exists").permissions().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(store.path()), 0o600);
        for suffix in ["-wal", "-shm"] {
            let p = wal_file(store.path(), suffix);
            if p.exists() {
                assert_eq!(mode(&p), 0o600, "{}", p.display());
            }
        }
    }
}
