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
//! Every session opens with `synchronous_commit` set (`postgres_synchronous_commit`,
//! whatever the server's or the database's default), and a heartbeat row shows when the
//! database went back in time (see [`durability`]). Each record keeps the namespace that
//! wrote it: operators' calls see their namespace's records and those written without one.
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
use crate::config::PgSynchronousCommit;
use crate::key::RecordId;

mod conninfo;
mod durability;
mod found;
mod sql;
pub mod tls;

use self::found::{found, Found};
use self::sql::*;

/// The schema this build writes, kept in `idemgate_meta`. A database with a higher version
/// was migrated by a newer idemgate and is refused rather than misread.
pub const SCHEMA_VERSION: i64 = 1;

/// How many expired rows one sweep statement deletes at most.
pub const EXPIRE_BATCH: i64 = 1000;

/// Serialises migrations of instances starting at once (`pg_advisory_xact_lock` key).
const MIGRATION_LOCK: i64 = 0x6964_656d_6761_7465;

/// The PostgreSQL store. Cheap to clone; clones share the connection.
#[derive(Clone)]
pub struct PostgresStore {
    inner: Arc<Inner>,
}

struct Inner {
    setup: PostgresSetup,
    /// The namespace every record this store writes is kept under, and the only one,
    /// besides records written without one, that operators' calls see.
    namespace: String,
    /// `synchronous_commit` of every session, set as it opens.
    synchronous_commit: PgSynchronousCommit,
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
    heartbeat: Statement,
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
    /// [`PostgresSetup::url`] writes it; its files are read here, once. Records are
    /// written under `namespace`; every session commits with `synchronous_commit`.
    pub async fn connect(
        url: &str,
        namespace: &str,
        synchronous_commit: PgSynchronousCommit,
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
                namespace: namespace.to_string(),
                synchronous_commit,
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
        // Set as the session starts, these win over the server's, the database's and the
        // role's defaults: a database whose `synchronous_commit` is `off` would otherwise
        // answer a claim before it is on disk, and lose it in a crash.
        config.options(format!(
            "-c statement_timeout={} -c synchronous_commit={}",
            statement_timeout.as_millis().max(1),
            self.inner.synchronous_commit.as_str()
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
            heartbeat: p(HEARTBEAT).await?,
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
                            &self.inner.namespace,
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
                .query_opt(
                    &c.inspect,
                    &[&id.as_bytes().as_slice(), &with_body, &self.inner.namespace],
                )
                .await
                .map_err(pg)?
            else {
                return Ok(None);
            };
            view_of(id, &r).map(Some)
        })
    }

    fn delete<'a>(
        &'a self,
        id: &'a RecordId,
        force: bool,
        any_namespace: bool,
    ) -> StoreFuture<'a, Deleted> {
        Box::pin(async move {
            let c = self.conn().await?;
            let id = id.as_bytes().as_slice();
            let n: i32 = c
                .client
                .query_one(
                    &c.delete,
                    &[&id, &force, &self.inner.namespace, &any_namespace],
                )
                .await
                .map_err(pg)
                .and_then(|r| col(&r, 0))?;
            Ok(match n {
                1 => Deleted::Deleted,
                2 => Deleted::OwnerBusy,
                4 => Deleted::Unscoped,
                _ => Deleted::NotFound,
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
                        &self.inner.namespace,
                        &any_namespace,
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
                let view = view_of(&id, r)?;
                // Another namespace's record is examined (the page's bound) but not shown.
                let seen = view.namespace.as_ref().is_none_or(|written_in| {
                    written_in
                        .as_deref()
                        .is_none_or(|n| n == self.inner.namespace)
                });
                walk.saw(seen.then_some(view));
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

    fn heartbeat(&self) -> StoreFuture<'_, Option<crate::store::Heartbeat>> {
        Box::pin(async move { self.beat().await.map(Some) })
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
        namespace: col(r, 11)?,
    };
    row.view(id, corrupt)
}
