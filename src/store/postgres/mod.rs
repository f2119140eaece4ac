//! The PostgreSQL store: records in one table of a database that several idemgate
//! instances share, with the same at-most-once guarantee as Redis.
//!
//! The claim is one statement: an `INSERT ... ON CONFLICT` whose unique key is itself the
//! verdict (never "look up, then insert"), with the existing row read back in the same round
//! trip. Record, renew, mark unknown and release are single owner-checked statements. Every
//! time is the database's clock (`clock_timestamp()`), so instances with skewed clocks agree
//! on leases. Expired rows are deleted by a periodic statement of bounded size.
//!
//! One connection, shared: `tokio-postgres` pipelines the queries of concurrent requests on
//! it. When it breaks, the next call opens a new one (under the caller's deadline). Every
//! statement also runs under the server's `statement_timeout`, set to the store deadline,
//! so a statement abandoned by a timed-out caller does not keep running.
//!
//! TLS by libpq's `sslmode` (see [`tls`]): rustls with the ring provider,
//! the server verified by chain and name (`verify-full`), by chain (`verify-ca`) or not at
//! all (`require`, warned about at start-up), a client certificate when the server asks.
//! A handshake that fails, at start-up or on a later reconnection, is said to be a TLS
//! failure, in rustls' words (an unknown issuer, an expired certificate, a wrong name).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Mutex;
use tokio_postgres::config::SslMode as PgSslMode;
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::{Client, NoTls, Row, Socket, Statement};

use self::tls::PostgresSetup;
use super::row::{ViewRow, Walk};
use super::{
    Claim, ClaimRequest, Completed, Deleted, Meta, OwnerToken, Page, RecordState, RecordView,
    ReplayRoom, Store, StoreError, StoreFuture, StoredResponse,
};
use crate::key::RecordId;

pub mod tls;

/// The schema this build writes, kept in `idemgate_meta`. A database with a higher version
/// was migrated by a newer idemgate and is refused rather than misread.
pub const SCHEMA_VERSION: i64 = 1;

/// How many expired rows one sweep statement deletes at most.
pub const EXPIRE_BATCH: i64 = 1000;

/// Serialises migrations of instances starting at once (`pg_advisory_xact_lock` key).
const MIGRATION_LOCK: i64 = 0x6964_656d_6761_7465;

const MIGRATE: &str = "
CREATE TABLE IF NOT EXISTS idemgate_meta (
  name text PRIMARY KEY,
  value text NOT NULL
);
CREATE TABLE IF NOT EXISTS idemgate_records (
  id bytea PRIMARY KEY,
  state smallint NOT NULL,         -- 0 in progress, 1 completed, 2 unknown
  fingerprint bytea NOT NULL,
  fingerprint_version integer NOT NULL,
  owner text NOT NULL,
  lease_until timestamptz NOT NULL,
  busy_until timestamptz NOT NULL,
  created timestamptz NOT NULL,
  expires timestamptz NOT NULL,
  status integer,
  headers bytea,
  body bytea
);
CREATE INDEX IF NOT EXISTS idemgate_records_expires ON idemgate_records (expires);
CREATE TABLE IF NOT EXISTS idemgate_withdrawn (
  id bytea NOT NULL,
  owner text NOT NULL,
  until timestamptz NOT NULL,
  PRIMARY KEY (id, owner)
);
-- Bodies are kept uncompressed by the server (idemgate compresses them itself when
-- compress_min_bytes says so), so that a replay reads a large one in slices without the
-- server decompressing it from the start for each (see BODY). Only rows written from now
-- on; altered once, and not again (the lock it takes is brief, but not taken for nothing).
DO $$ BEGIN
  IF (SELECT attstorage FROM pg_attribute
      WHERE attrelid = 'idemgate_records'::regclass AND attname = 'body') <> 'e' THEN
    ALTER TABLE idemgate_records ALTER COLUMN body SET STORAGE EXTERNAL;
  END IF;
END $$;
";

/// One statement: claims the id (a fresh row, or in place of an expired one) unless this
/// owner withdrew it, and reads back what is there otherwise. The outer `SELECT` sees the
/// statement's snapshot: a row committed by a concurrent claim after it was taken makes
/// the `INSERT` find a conflict yet stays invisible to the `SELECT`; the caller then runs
/// the statement again (a second round trip only in that race).
const CLAIM: &str = "
WITH w AS (
  SELECT EXISTS (SELECT 1 FROM idemgate_withdrawn
                 WHERE id = $1 AND owner = $4 AND until > clock_timestamp()) AS withdrawn
), ins AS (
  INSERT INTO idemgate_records AS r (id, state, fingerprint, fingerprint_version, owner,
      lease_until, busy_until, created, expires)
  SELECT $1::bytea, 0, $2::bytea, $3::integer, $4::text,
      clock_timestamp() + $5::bigint * interval '1 millisecond',
      clock_timestamp() + $6::bigint * interval '1 millisecond',
      clock_timestamp(),
      clock_timestamp() + $7::bigint * interval '1 millisecond'
  FROM w WHERE NOT w.withdrawn
  ON CONFLICT (id) DO UPDATE SET state = 0, fingerprint = excluded.fingerprint,
      fingerprint_version = excluded.fingerprint_version, owner = excluded.owner,
      lease_until = excluded.lease_until, busy_until = excluded.busy_until,
      created = excluded.created, expires = excluded.expires,
      status = NULL, headers = NULL, body = NULL
    WHERE r.expires <= clock_timestamp()
  RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM ins) AS claimed, (SELECT withdrawn FROM w) AS withdrawn,
  r.state, r.fingerprint, r.fingerprint_version,
  (extract(epoch FROM (r.lease_until - clock_timestamp())) * 1000)::bigint AS lease_left,
  r.status, r.headers, CASE WHEN length(r.body) <= $8::bigint THEN r.body END AS body,
  length(r.body)::bigint AS body_len
FROM (SELECT 1) AS one
LEFT JOIN idemgate_records r ON r.id = $1 AND r.expires > clock_timestamp()
";

/// The body of a completed record that a claim found longer than the room it had taken
/// (`CLAIM` returns its length alone), read once room is taken for it: in pieces of
/// [`BODY_PIECE`] bytes, a row each, from one statement (one snapshot of one record), so
/// that each piece is copied into the room taken and dropped before the next arrives (the
/// column is stored uncompressed, `MIGRATE`, so a slice reads only its own part). Read as
/// one value, each body was in memory twice (the row and its copy): 300 slow readers of a
/// 4 MiB record took a release build's peak from 44 to 140 MiB.
const BODY: &str = "
SELECT substring(r.body FROM g FOR $3::int)
FROM idemgate_records r, LATERAL generate_series(1, length(r.body), $3::int) AS g
WHERE r.id = $1 AND r.fingerprint = $2 AND r.state = 1 AND r.expires > clock_timestamp()
ORDER BY g
";

/// The bytes of a body [`BODY`] brings per row: at 256 KiB the peak of those 300 readers
/// was 120-134 MiB, at 64 KiB 108-110 MiB (as from Redis).
const BODY_PIECE: i32 = 64 * 1024;

const RECORD: &str = "
UPDATE idemgate_records SET state = 1, status = $3, headers = $4, body = $5
WHERE id = $1 AND owner = $2 AND expires > clock_timestamp()
";

const RENEW: &str = "
UPDATE idemgate_records SET lease_until = clock_timestamp() + $3::bigint * interval '1 millisecond'
WHERE id = $1 AND owner = $2 AND state = 0 AND expires > clock_timestamp()
";

/// An answer that shows nothing ran: its expiry brought forward (never later).
const SHORTEN: &str = "
UPDATE idemgate_records
SET expires = LEAST(expires, clock_timestamp() + $3::bigint * interval '1 millisecond')
WHERE id = $1 AND owner = $2 AND expires > clock_timestamp()
";

const MARK_UNKNOWN: &str = "
UPDATE idemgate_records SET state = 2
WHERE id = $1 AND owner = $2 AND state <> 1 AND expires > clock_timestamp()
";

/// Deletes the owner's record, or (none) remembers the withdrawal: one statement.
const RELEASE: &str = "
WITH d AS (
  DELETE FROM idemgate_records
  WHERE id = $1 AND owner = $2 AND expires > clock_timestamp()
  RETURNING 1
), w AS (
  INSERT INTO idemgate_withdrawn AS x (id, owner, until)
  SELECT $1::bytea, $2::text, clock_timestamp() + $3::bigint * interval '1 millisecond'
  WHERE NOT EXISTS (SELECT 1 FROM d)
  ON CONFLICT (id, owner) DO UPDATE SET until = greatest(x.until, excluded.until)
  RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM d)
";

/// 0 not found, 1 deleted, 2 owner busy: one statement.
const DELETE: &str = "
WITH cur AS (
  SELECT state, lease_until, busy_until FROM idemgate_records
  WHERE id = $1 AND expires > clock_timestamp() FOR UPDATE
), d AS (
  DELETE FROM idemgate_records
  WHERE id = $1 AND EXISTS (SELECT 1 FROM cur) AND ($2 OR NOT EXISTS (
    SELECT 1 FROM cur WHERE state = 0
      AND (lease_until > clock_timestamp() OR busy_until > clock_timestamp())))
  RETURNING 1
)
SELECT CASE WHEN EXISTS (SELECT 1 FROM d) THEN 1
            WHEN EXISTS (SELECT 1 FROM cur) THEN 2 ELSE 0 END
";

// An operator's resolution: 1 completed, 0 no record, 2 its owner may still be working
// (not forced), 3 already completed (kept or not). The owner is cleared, so the former
// owner's late RECORD is refused.
const COMPLETE: &str = "
WITH cur AS (
  SELECT state, lease_until, busy_until FROM idemgate_records
  WHERE id = $1 AND expires > clock_timestamp() FOR UPDATE
), u AS (
  UPDATE idemgate_records SET state = 1, owner = '', status = $3, headers = $4, body = $5
  WHERE id = $1 AND EXISTS (SELECT 1 FROM cur WHERE state <> 1) AND ($2 OR NOT EXISTS (
    SELECT 1 FROM cur WHERE state = 0
      AND (lease_until > clock_timestamp() OR busy_until > clock_timestamp())))
  RETURNING 1
)
SELECT CASE WHEN EXISTS (SELECT 1 FROM u) THEN 1
            WHEN NOT EXISTS (SELECT 1 FROM cur) THEN 0
            WHEN EXISTS (SELECT 1 FROM cur WHERE state = 1) THEN 3 ELSE 2 END
";

// While observing: a later execution's answer replaces a completed record's answer (kept or
// not) whose status is outside 2xx, when the fingerprint `$2` is the record's.
const SUPERSEDE: &str = "
UPDATE idemgate_records SET status = $3, headers = $4, body = $5
WHERE id = $1 AND expires > clock_timestamp() AND state = 1 AND fingerprint = $2
  AND (status IS NULL OR status < 200 OR status >= 300)
";

// The columns a record view starts with (see `view_of`), as INSPECT and LIST select them.
macro_rules! view_columns {
    () => {
        "
SELECT state, fingerprint, fingerprint_version,
  (extract(epoch FROM (lease_until - clock_timestamp())) * 1000)::bigint,
  (extract(epoch FROM (busy_until - clock_timestamp())) * 1000)::bigint,
  (extract(epoch FROM created) * 1000)::bigint,
  (extract(epoch FROM (expires - clock_timestamp())) * 1000)::bigint,
  status, "
    };
}

// The columns of a record view (see `view_of`), `$2`: with its body.
const INSPECT: &str = concat!(
    view_columns!(),
    "CASE WHEN $2 THEN body END, headers IS NOT NULL
FROM idemgate_records WHERE id = $1 AND expires > clock_timestamp()
"
);

// One page of an operator's walk: the next `$2` live records after the id `$1`, in
// primary-key order (an index range scan: about `$2` rows read per page), with the
// columns of INSPECT and the id last.
const LIST: &str = concat!(
    view_columns!(),
    "NULL::bytea, headers IS NOT NULL, id
FROM idemgate_records WHERE id > $1 AND expires > clock_timestamp()
ORDER BY id LIMIT $2
"
);

const SWEEP: &str = "
WITH d AS (
  DELETE FROM idemgate_records WHERE id IN (
    SELECT id FROM idemgate_records WHERE expires <= clock_timestamp()
    ORDER BY expires LIMIT $1 FOR UPDATE SKIP LOCKED)
  RETURNING 1
), w AS (
  DELETE FROM idemgate_withdrawn WHERE ctid IN (
    SELECT ctid FROM idemgate_withdrawn WHERE until <= clock_timestamp() LIMIT $1)
)
SELECT count(*) FROM d
";

/// The PostgreSQL store. Cheap to clone; clones share the connection.
#[derive(Clone)]
pub struct PostgresStore {
    inner: Arc<Inner>,
}

struct Inner {
    setup: PostgresSetup,
    connect_timeout: Duration,
    statement_timeout: Duration,
    conn: Mutex<Option<Arc<Conn>>>,
}

/// A connection and its prepared statements: each call is then one round trip (bind and
/// execute), never a parse first.
struct Conn {
    client: Client,
    claim: Statement,
    body: Statement,
    record: Statement,
    renew: Statement,
    mark_unknown: Statement,
    shorten: Statement,
    release: Statement,
    delete: Statement,
    inspect: Statement,
    complete: Statement,
    supersede: Statement,
    list: Statement,
    sweep: Statement,
}

fn backend(e: impl std::fmt::Display) -> StoreError {
    StoreError::Backend(format!("postgres: {e}"))
}

fn pg(e: tokio_postgres::Error) -> StoreError {
    // A certificate refused (an expired one after a server restart, a name it is not
    // for): said as such, in rustls' words.
    if let Some(why) = self::tls::tls_failure(&e) {
        return StoreError::Backend(format!("postgres: TLS failed: {why}"));
    }
    // The server's own message (a statement timeout, a constraint) says more than the
    // error's summary.
    match e.as_db_error() {
        Some(db) => {
            StoreError::Backend(format!("postgres: {}: {}", db.code().code(), db.message()))
        }
        None => backend(e),
    }
}

fn corrupt(what: &str) -> StoreError {
    StoreError::Corrupt(format!("postgres record: {what}"))
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 4)
}

impl PostgresStore {
    /// Connects, and creates or migrates the schema. `url` is a connection string with its
    /// TLS parameters (`sslmode`, `sslrootcert`, `sslcert`, `sslkey`), as
    /// [`PostgresSetup::url`] writes it; its files are read here, once.
    pub async fn connect(
        url: &str,
        connect_timeout: Duration,
        statement_timeout: Duration,
    ) -> Result<PostgresStore, StoreError> {
        let setup = PostgresSetup::from_url(url).map_err(backend)?;
        if let Some(warning) = setup.warning() {
            tracing::warn!("{warning}");
        }
        // The mode in force: `require` with a root certificate is `verify-ca`.
        tracing::info!(sslmode = %setup.mode, hosts = %setup.hosts(), "connecting to PostgreSQL");
        let store = PostgresStore {
            inner: Arc::new(Inner {
                setup,
                connect_timeout,
                statement_timeout,
                conn: Mutex::new(None),
            }),
        };
        super::deadline(connect_timeout + statement_timeout * 4, store.migrate()).await?;
        Ok(store)
    }

    async fn open(&self) -> Result<Client, StoreError> {
        self.open_with(self.inner.statement_timeout).await
    }

    /// A connection whose statements may run for `statement_timeout`.
    async fn open_with(&self, statement_timeout: Duration) -> Result<Client, StoreError> {
        let setup = &self.inner.setup;
        let mut config = setup.config.clone();
        config.connect_timeout(self.inner.connect_timeout);
        config.application_name("idemgate");
        config.options(format!(
            "-c statement_timeout={}",
            statement_timeout.as_millis().max(1)
        ));
        let connected = super::deadline(self.inner.connect_timeout, async {
            match &setup.tls {
                // tokio-postgres' `require` is TLS or no connection (never `prefer`'s
                // fallback to plain text); what is verified is the verifier's part.
                Some(tls) => {
                    config.ssl_mode(PgSslMode::Require);
                    let tls = tokio_postgres_rustls::MakeRustlsConnect::new((**tls).clone());
                    start(&config, tls).await
                }
                None => {
                    config.ssl_mode(PgSslMode::Disable);
                    start(&config, NoTls).await
                }
            }
        })
        .await;
        // Which server refused: the hosts, never the credentials.
        connected.map_err(|e| match e {
            StoreError::Backend(why) => StoreError::Backend(why.replacen(
                "postgres:",
                &format!("postgres at {}:", setup.hosts()),
                1,
            )),
            other => other,
        })
    }

    /// The shared connection, opened anew (statements prepared) if the last one broke.
    async fn conn(&self) -> Result<Arc<Conn>, StoreError> {
        let mut slot = self.inner.conn.lock().await;
        if let Some(c) = slot.as_ref().filter(|c| !c.client.is_closed()) {
            return Ok(c.clone());
        }
        *slot = None;
        let client = self.open().await?;
        let p = |sql: &'static str| {
            let client = &client;
            async move { client.prepare(sql).await.map_err(pg) }
        };
        let conn = Arc::new(Conn {
            claim: p(CLAIM).await?,
            body: p(BODY).await?,
            record: p(RECORD).await?,
            renew: p(RENEW).await?,
            mark_unknown: p(MARK_UNKNOWN).await?,
            shorten: p(SHORTEN).await?,
            release: p(RELEASE).await?,
            delete: p(DELETE).await?,
            inspect: p(INSPECT).await?,
            complete: p(COMPLETE).await?,
            supersede: p(SUPERSEDE).await?,
            list: p(LIST).await?,
            sweep: p(SWEEP).await?,
            client,
        });
        *slot = Some(conn.clone());
        Ok(conn)
    }

    async fn migrate(&self) -> Result<(), StoreError> {
        let mut slot = self.inner.conn.lock().await;
        let c = self.open().await?;
        c.batch_execute(&format!(
            "BEGIN; SELECT pg_advisory_xact_lock({MIGRATION_LOCK}); {MIGRATE} COMMIT;"
        ))
        .await
        .map_err(pg)?;
        let found: Option<String> = c
            .query_opt(
                "SELECT value FROM idemgate_meta WHERE name = 'schema_version'",
                &[],
            )
            .await
            .map_err(pg)?
            .map(|r| col(&r, 0))
            .transpose()?;
        let found: i64 = match found {
            None => 0,
            Some(v) => v
                .parse()
                .map_err(|_| corrupt("schema_version is not a number"))?,
        };
        if found > SCHEMA_VERSION {
            return Err(StoreError::Corrupt(format!(
                "the database has idemgate schema version {found}, newer than this idemgate's {SCHEMA_VERSION}"
            )));
        }
        c.execute(
            "INSERT INTO idemgate_meta (name, value) VALUES ('schema_version', $1)
             ON CONFLICT (name) DO UPDATE SET value = excluded.value",
            &[&SCHEMA_VERSION.to_string()],
        )
        .await
        .map_err(pg)?;
        // The statements are prepared on the next connection, against the tables just made.
        *slot = None;
        Ok(())
    }

    /// Deletes expired rows, at most [`EXPIRE_BATCH`] per statement, until none are left;
    /// returns how many it deleted.
    pub async fn sweep(&self) -> Result<u64, StoreError> {
        let mut total = 0u64;
        loop {
            let c = self.conn().await?;
            let n: i64 = c
                .client
                .query_one(&c.sweep, &[&EXPIRE_BATCH])
                .await
                .map_err(pg)
                .and_then(|r| col(&r, 0))?;
            total += n as u64;
            if n < EXPIRE_BATCH {
                return Ok(total);
            }
        }
    }

    /// Sweeps expired rows every `period` in a background task, which ends when the last
    /// clone of the store is dropped.
    pub fn spawn_sweeper(&self, period: Duration) -> tokio::task::JoinHandle<()> {
        super::spawn_sweeper(&self.inner, period, |inner| async move {
            if let Err(e) = (PostgresStore { inner }).sweep().await {
                tracing::warn!(error = %e, "sweeping expired records failed");
            }
        })
    }

    async fn execute(
        &self,
        which: fn(&Conn) -> &Statement,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<u64, StoreError> {
        let c = self.conn().await?;
        c.client.execute(which(&c), params).await.map_err(pg)
    }

    /// Runs an owner-checked statement, whose first two parameters are the record's id and
    /// its owner, then `rest`: `Ok(true)` when it changed the record, which only the owner's
    /// call can.
    async fn owned(
        &self,
        which: fn(&Conn) -> &Statement,
        id: &RecordId,
        owner: &OwnerToken,
        rest: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<bool, StoreError> {
        let (id, owner) = (id.as_bytes().as_slice(), owner.as_str());
        let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = vec![&id, &owner];
        params.extend_from_slice(rest);
        Ok(self.execute(which, &params).await? == 1)
    }
}

/// Opens a connection with `tls` and drives it in a task of its own.
async fn start<T>(config: &tokio_postgres::Config, tls: T) -> Result<Client, StoreError>
where
    T: MakeTlsConnect<Socket>,
    T::Stream: Send + 'static,
    T::TlsConnect: Send,
    <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
{
    let (client, connection) = config.connect(tls).await.map_err(pg)?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::warn!(error = %pg(e), "connection to PostgreSQL lost");
        }
    });
    Ok(client)
}

/// The body of `len` bytes of completed record `id` ([`BODY`]), piece by piece into one
/// buffer of its length; `None` if the record is gone or its body is not that long now.
async fn read_body(
    c: &Conn,
    id: &[u8],
    fp: &[u8],
    len: usize,
) -> Result<Option<Bytes>, StoreError> {
    use futures_util::StreamExt;
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] = [&id, &fp, &BODY_PIECE];
    let rows = c.client.query_raw(&c.body, params).await.map_err(pg)?;
    let mut rows = std::pin::pin!(rows);
    let mut body = bytes::BytesMut::with_capacity(len);
    while let Some(row) = rows.next().await {
        let row = row.map_err(pg)?;
        let part: &[u8] = col(&row, 0)?;
        if body.len() + part.len() > len {
            return Ok(None);
        }
        body.extend_from_slice(part);
    }
    Ok((body.len() == len).then(|| body.freeze()))
}

/// Column `i` of `row`: a column of another type (a table changed by hand) is an error,
/// not a panic.
fn col<'a, T: tokio_postgres::types::FromSql<'a>>(row: &'a Row, i: usize) -> Result<T, StoreError> {
    row.try_get(i)
        .map_err(|e| corrupt(&format!("column {i}: {e}")))
}

fn lease_left(ms: i64) -> Duration {
    Duration::from_millis(ms.max(1) as u64)
}

/// What a claim's row says.
enum Found {
    Claim(Claim),
    /// A completed record whose body was longer than the claim's room: not read yet.
    Unread {
        status: u16,
        headers: Vec<(String, Bytes)>,
        len: usize,
    },
}

fn found(row: &Row, req: &ClaimRequest) -> Result<Option<Found>, StoreError> {
    if col::<bool>(row, 0)? {
        return Ok(Some(Found::Claim(Claim::Claimed)));
    }
    let Some(state) = col::<Option<i16>>(row, 2)? else {
        // No live row visible: withdrawn, or made by a claim that committed after this
        // statement's snapshot (run it again).
        return Ok(col::<bool>(row, 1)?.then_some(Found::Claim(Claim::Withdrawn)));
    };
    let fp: Vec<u8> = col(row, 3)?;
    let fv: i32 = col(row, 4)?;
    let fv = u16::try_from(fv).map_err(|_| corrupt("fingerprint version out of range"))?;
    Ok(Some(Found::Claim(if fv != req.fingerprint_version {
        Claim::OtherVersion(fv)
    } else if fp.as_slice() != req.fingerprint.0.as_slice() {
        Claim::Mismatch
    } else if state == 1 {
        let status: Option<i32> = col(row, 6)?;
        let status = status
            .and_then(|s| u16::try_from(s).ok())
            .ok_or_else(|| corrupt("completed without a status"))?;
        let headers: Option<Vec<u8>> = col(row, 7)?;
        let body: Option<Vec<u8>> = col(row, 8)?;
        let len: Option<i64> = col(row, 9)?;
        let len = usize::try_from(len.unwrap_or(0)).unwrap_or(usize::MAX);
        let Some(headers) = headers else {
            // Completed without headers: the answer was too large to keep.
            return Ok(Some(Found::Claim(Claim::NotKept { status })));
        };
        let headers = StoredResponse::decode_headers(&headers)
            .ok_or_else(|| corrupt("undecodable headers"))?;
        match body {
            None if len > 0 => {
                return Ok(Some(Found::Unread {
                    status,
                    headers,
                    len,
                }))
            }
            body => Claim::Replay(StoredResponse {
                status,
                headers,
                body: Bytes::from(body.unwrap_or_default()),
            }),
        }
    } else {
        let left: i64 = col(row, 5)?;
        if state == 0 && left > 0 {
            Claim::InFlight {
                lease_left: lease_left(left),
            }
        } else {
            Claim::Unknown
        }
    })))
}

impl Store for PostgresStore {
    fn claim<'a>(&'a self, req: &'a ClaimRequest) -> StoreFuture<'a, Claim> {
        Box::pin(async move {
            let id = req.id.as_bytes().as_slice();
            let fv = i32::from(req.fingerprint_version);
            let (lease, busy, retention) = (ms(req.lease), ms(req.busy_for), ms(req.retention));
            // A body longer than the room taken for it before the claim comes back as its
            // length alone: room is taken for it, then it is read.
            let inline = req.room.as_ref().map_or(usize::MAX, ReplayRoom::held);
            let inline = i64::try_from(inline).unwrap_or(i64::MAX);
            // The race that needs a second run ends once the concurrent claim has
            // committed, which it has by the time the conflict is seen.
            for _ in 0..3 {
                let c = self.conn().await?;
                let row = c
                    .client
                    .query_one(
                        &c.claim,
                        &[
                            &id,
                            &req.fingerprint.0.as_slice(),
                            &fv,
                            &req.owner.as_str(),
                            &lease,
                            &busy,
                            &retention,
                            &inline,
                        ],
                    )
                    .await
                    .map_err(pg)?;
                match found(&row, req)? {
                    Some(Found::Claim(claim)) => return Ok(claim),
                    Some(Found::Unread {
                        status,
                        headers,
                        len,
                    }) => {
                        if !super::room_for(req.room.as_ref(), len) {
                            return Ok(Claim::NoRoom { status });
                        }
                        let fp = req.fingerprint.0.as_slice();
                        // None: gone or changed since the claim read it (expired,
                        // deleted by an operator): claim again.
                        if let Some(body) = read_body(&c, id, fp, len).await? {
                            return Ok(Claim::Replay(StoredResponse {
                                status,
                                headers,
                                body,
                            }));
                        }
                    }
                    None => {}
                }
            }
            Err(backend("the claim kept finding a row it could not read"))
        })
    }

    fn record<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        response: &'a StoredResponse,
    ) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            let status = i32::from(response.status);
            let headers = response.encode_headers();
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] = [
                &id.as_bytes().as_slice(),
                &owner.as_str(),
                &status,
                &headers,
                &&response.body[..],
            ];
            if response.body.len() <= super::RECORD_PIECE {
                return Ok(self.execute(|c| &c.record, &params).await? == 1);
            }
            // A large answer's statement takes longer than `store_timeout` (an 80 MiB one
            // was cut off by it), and on the shared connection it would hold up every other
            // request's statement behind it: it goes on a connection of its own, allowed
            // the record's budget (the caller's deadline bounds the whole).
            let budget = super::record_budget(self.inner.statement_timeout, response.body.len());
            let client = self.open_with(budget).await?;
            Ok(client.execute(RECORD, &params).await.map_err(pg)? == 1)
        })
    }

    fn shorten<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        retain: Duration,
    ) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            let ms = i64::try_from(retain.as_millis()).unwrap_or(i64::MAX);
            self.owned(|c| &c.shorten, id, owner, &[&ms]).await
        })
    }

    fn record_not_kept<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        status: u16,
    ) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            // Completed with no headers and no body: what a claim reads as "not kept" (a
            // kept answer always has headers, if only an empty list).
            let status = i32::from(status);
            let none: Option<Vec<u8>> = None;
            self.owned(|c| &c.record, id, owner, &[&status, &none, &none])
                .await
        })
    }

    fn renew<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        lease: Duration,
    ) -> StoreFuture<'a, bool> {
        Box::pin(async move { self.owned(|c| &c.renew, id, owner, &[&ms(lease)]).await })
    }

    fn mark_unknown<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
    ) -> StoreFuture<'a, bool> {
        Box::pin(self.owned(|c| &c.mark_unknown, id, owner, &[]))
    }

    fn release<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        linger: Duration,
    ) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            let c = self.conn().await?;
            let row = c
                .client
                .query_one(
                    &c.release,
                    &[&id.as_bytes().as_slice(), &owner.as_str(), &ms(linger)],
                )
                .await
                .map_err(pg)?;
            col::<bool>(&row, 0)
        })
    }

    fn inspect<'a>(
        &'a self,
        id: &'a RecordId,
        with_body: bool,
    ) -> StoreFuture<'a, Option<RecordView>> {
        Box::pin(async move {
            let c = self.conn().await?;
            let Some(r) = c
                .client
                .query_opt(&c.inspect, &[&id.as_bytes().as_slice(), &with_body])
                .await
                .map_err(pg)?
            else {
                return Ok(None);
            };
            view_of(id, &r).map(Some)
        })
    }

    fn delete<'a>(&'a self, id: &'a RecordId, force: bool) -> StoreFuture<'a, Deleted> {
        Box::pin(async move {
            let c = self.conn().await?;
            let n: i32 = c
                .client
                .query_one(&c.delete, &[&id.as_bytes().as_slice(), &force])
                .await
                .map_err(pg)
                .and_then(|r| col(&r, 0))?;
            Ok(match n {
                1 => Deleted::Deleted,
                2 => Deleted::OwnerBusy,
                _ => Deleted::NotFound,
            })
        })
    }

    fn complete<'a>(
        &'a self,
        id: &'a RecordId,
        response: &'a StoredResponse,
        force: bool,
    ) -> StoreFuture<'a, Completed> {
        Box::pin(async move {
            let c = self.conn().await?;
            let status = i32::from(response.status);
            let headers = response.encode_headers();
            let n: i32 = c
                .client
                .query_one(
                    &c.complete,
                    &[
                        &id.as_bytes().as_slice(),
                        &force,
                        &status,
                        &headers.as_slice(),
                        &&response.body[..],
                    ],
                )
                .await
                .map_err(pg)
                .and_then(|r| col(&r, 0))?;
            Completed::from_code(n.into()).ok_or_else(|| corrupt("complete reply"))
        })
    }

    fn supersede<'a>(
        &'a self,
        id: &'a RecordId,
        fingerprint: &'a crate::fingerprint::Fingerprint,
        response: &'a StoredResponse,
    ) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            let c = self.conn().await?;
            let status = i32::from(response.status);
            let headers = response.encode_headers();
            let n = c
                .client
                .execute(
                    &c.supersede,
                    &[
                        &id.as_bytes().as_slice(),
                        &&fingerprint.0[..],
                        &status,
                        &headers.as_slice(),
                        &&response.body[..],
                    ],
                )
                .await
                .map_err(pg)?;
            Ok(n == 1)
        })
    }

    fn list<'a>(
        &'a self,
        state: Option<RecordState>,
        cursor: &'a str,
        count: usize,
    ) -> StoreFuture<'a, Page> {
        Box::pin(async move {
            // The cursor is the last id examined (hex).
            let after = if cursor.is_empty() {
                Vec::new()
            } else {
                RecordId::from_hex(cursor)
                    .ok_or_else(|| corrupt("not a cursor of this store"))?
                    .as_bytes()
                    .to_vec()
            };
            let count = count.max(1);
            let c = self.conn().await?;
            let rows = c
                .client
                .query(&c.list, &[&after.as_slice(), &(count as i64)])
                .await
                .map_err(pg)?;
            let mut walk = Walk::new(state);
            for r in &rows {
                let raw: Vec<u8> = col(r, 10)?;
                let id = walk.id(&raw, corrupt)?;
                walk.saw(Some(view_of(&id, r)?));
            }
            Ok(walk.page(rows.len(), count))
        })
    }

    fn ping(&self) -> StoreFuture<'_, ()> {
        Box::pin(async move {
            let c = self.conn().await?;
            c.client.simple_query("SELECT 1").await.map_err(pg)?;
            Ok(())
        })
    }

    fn kind(&self) -> crate::store::StoreKind {
        crate::store::StoreKind::Postgres
    }

    fn meta<'a>(&'a self, name: &'a str, offer: Option<&'a str>) -> StoreFuture<'a, Meta> {
        Box::pin(async move {
            let c = self.conn().await?;
            let c = &c.client;
            // Insert if absent, then read: whichever instance came first, every instance
            // reads the one value that won.
            let created = match offer {
                Some(v) => {
                    c.execute(
                        "INSERT INTO idemgate_meta (name, value) VALUES ($1, $2)
                         ON CONFLICT (name) DO NOTHING",
                        &[&name, &v],
                    )
                    .await
                    .map_err(pg)?
                        == 1
                }
                None => false,
            };
            let row = c
                .query_opt("SELECT value FROM idemgate_meta WHERE name = $1", &[&name])
                .await
                .map_err(pg)?;
            let value = match row {
                Some(r) => Some(col::<String>(&r, 0)?),
                None => None,
            };
            Ok(Meta { value, created })
        })
    }
}

/// A record as operators see it, from a row with INSPECT's columns.
fn view_of(id: &RecordId, r: &Row) -> Result<RecordView, StoreError> {
    let state: i16 = col(r, 0)?;
    let fv: i32 = col(r, 2)?;
    let status: Option<i32> = col(r, 7)?;
    let row = ViewRow {
        state: state.into(),
        fingerprint: col(r, 1)?,
        fingerprint_version: u16::try_from(fv)
            .map_err(|_| corrupt("fingerprint version out of range"))?,
        lease_left: col(r, 3)?,
        busy_left: col(r, 4)?,
        created: col(r, 5)?,
        ttl: col(r, 6)?,
        status: status.and_then(|s| u16::try_from(s).ok()),
        body: col(r, 8)?,
        body_kept: col(r, 9)?,
    };
    row.view(id, corrupt)
}
