//! The Redis store: one record = one Redis hash under `idemgate:{<record id>}` (the hash tag
//! keeps a record in one cluster slot), its time to live = the route's retention from the
//! claim; or, with `redis_record_format = "value"`, one string value under the same key
//! (`value.rs`), which every script here reads too. Claim, record, renew, mark-unknown and
//! release are each one Lua script (a value's claim one bare `SET ... NX GET`): one round
//! trip, atomic, and safe to run twice. Times come from Redis's own clock (`TIME`, or a
//! value's `PTTL`), so several idemgate instances agree on leases whatever their clocks say.
//!
//! Every script names exactly one key, the record's: its withdrawal notes and the pieces of
//! a large body are fields of the same hash. While a Redis Cluster slot is being migrated,
//! the importing node answers `TRYAGAIN` (not the script's result) to a script naming
//! several keys unless all of them are already there, which a new key's record and its
//! absent withdrawal note never are: every new key of a migrating slot got 503 for the
//! whole migration. A script of one key follows `ASK` to the importing node and runs
//! there, and a record moves with everything it owns in one `MIGRATE`.
//!
//! Calls go through one shared multiplexed connection ([`Link`]: one server, the primary
//! that Sentinel names, or a Cluster), with explicit connect timeouts; callers add an outer
//! deadline. With `min_replicas_ack` each claim and record is followed by `WAIT` in the
//! same round trip (a pipeline, routed to the record's primary in a cluster), and counts as
//! written only when enough replicas acknowledged it; those two go over connections of
//! their own, one write each at a time ([`AckLinks`]), since a `WAIT` holds up every later
//! call on its connection.

use std::time::Duration;

use bytes::Bytes;
use redis::{Cmd, Script, Value};

use self::link::Link;
use self::setup::{RedisSetup, ReplicaAck, Topology};
use super::{
    Claim, ClaimRequest, Completed, Deleted, Meta, OwnerToken, Page, RecordState, RecordView,
    ReplayRoom, ServerStats, Store, StoreError, StoreFuture, StoredResponse, SCOPE_SECRET,
};
use crate::key::RecordId;

mod ack;
mod calls;
pub mod link;
mod meta;
mod parse;
mod pieces;
mod renewing;
mod scripts;
pub mod settled;
pub mod setup;
#[cfg(test)]
mod tests;
mod value;

use self::ack::*;
use self::meta::*;
pub use self::meta::{meta_key, SECRET_ACK_TRIES, SECRET_KEY};
use self::parse::*;
use self::pieces::*;
use self::scripts::*;
use self::value::*;

/// The Redis store.
#[derive(Clone)]
pub struct RedisStore {
    conn: Link,
    /// New records as one string value each (`redis_record_format = "value"`).
    value_records: bool,
    scripts: std::sync::Arc<Scripts>,
    /// `WAIT` after claims and records, when configured.
    replica_ack: Option<ReplicaAck>,
    /// With `replica_ack`: the connections that carry claims and records with their `WAIT`.
    acked: Option<std::sync::Arc<AckLinks>>,
}

/// What start-up learned about the Redis server.
#[derive(Debug, Clone)]
pub struct ServerInfo {
    /// `maxmemory_policy` from `INFO memory`.
    pub maxmemory_policy: String,
    /// `aof_enabled` from `INFO persistence`.
    pub aof_enabled: bool,
    /// `redis_version` from `INFO server`.
    pub version: String,
}

impl RedisStore {
    /// Connects (one attempt bounded by `connect_timeout`) and loads the scripts, each call
    /// bounded by `response_timeout`.
    ///
    /// On one server and through Sentinel, redis-rs is given no response timeout of its own:
    /// every call made afterwards already runs under its caller's deadline (`store_timeout`,
    /// or the lease renewal's), and a second timer per call costs instructions and, when
    /// idemgate is idle, wakes tokio's driver through its eventfd (a `write` and a spurious
    /// `epoll_wait` more per Redis call; docs/performance.md has the figures).
    /// A timed-out call is dropped; a late answer to it is read and discarded by the
    /// connection, as before, and a call that waited long unanswered gives the connection
    /// up ([`Link`]). A cluster's nodes do get `response_timeout`: redis-rs's own slot-map
    /// reloads must not wait on a silent node for ever.
    pub async fn connect(
        url: &str,
        connect_timeout: Duration,
        response_timeout: Duration,
    ) -> Result<RedisStore, StoreError> {
        let setup = RedisSetup {
            topology: Topology::Single(url.to_string()),
            tls: None,
            username: None,
            password: None,
            replica_ack: None,
            value_records: false,
            publish_settled: true,
        };
        Self::open(&setup, connect_timeout, response_timeout).await
    }

    /// Connects to the topology of `setup` (see [`connect`](Self::connect)). A failure
    /// names the address, and says TLS when the TLS layer refused.
    pub async fn open(
        setup: &RedisSetup,
        connect_timeout: Duration,
        response_timeout: Duration,
    ) -> Result<RedisStore, StoreError> {
        let at = |e: redis::RedisError| StoreError::Backend(describe_failure(setup, &e));
        // A sentinel, then the primary; or the seed nodes, then every node of the cluster.
        let budget = match setup.topology {
            Topology::Single(_) => connect_timeout,
            _ => connect_timeout * 3,
        };
        let conn = match tokio::time::timeout(
            budget + response_timeout,
            Link::open(setup, connect_timeout, response_timeout),
        )
        .await
        {
            Ok(conn) => conn.map_err(at)?,
            Err(_) => {
                return Err(StoreError::Backend(format!(
                    "Redis at {}: timed out: no connection within {:?}",
                    setup.addresses(),
                    budget + response_timeout
                )))
            }
        };
        // Every script reads both forms of a record (see `value.rs`); those that write what
        // a value cannot hold turn one into its hash first (HASH_FIRST).
        let to_hash = format!("{NOW_MS}{V_NUM}{AS_HASH}");
        // The scripts that settle a record say so on a channel, where another instance
        // listens (see `settled.rs`).
        let publishes = settled::publishes(setup);
        let settling = |script: String| {
            let script = if publishes {
                settled::publishing(&script)
            } else {
                script
            };
            Script::new(&script)
        };
        let scripts = Scripts {
            claim: Script::new(&format!("{NOW_MS}{V_NUM}{CLAIM_VALUE}{CLAIM}")),
            record: settling(RECORD.to_string()),
            record_value: settling(RECORD_VALUE.to_string()),
            record_hash: settling(format!("{to_hash}{HASH_FIRST}{RECORD}")),
            record_not_kept: settling(format!("{DROP_PIECES}{RECORD_NOT_KEPT}")),
            shorten: Script::new(&format!("{V_NUM}{SHORTEN}")),
            write_chunk: Script::new(&format!("{to_hash}{HASH_FIRST}{WRITE_CHUNK}")),
            record_large: settling(format!("{to_hash}{HASH_FIRST}{RECORD_LARGE}")),
            renew: Script::new(&format!("{NOW_MS}{NOW}{RENEW}")),
            mark_unknown: settling(MARK_UNKNOWN.to_string()),
            release: settling(format!("{to_hash}{DROP_RECORD}{HASH_FIRST}{RELEASE}")),
            delete: settling(format!("{to_hash}{DROP_RECORD}{HASH_FIRST}{DELETE}")),
            inspect: Script::new(&format!("{NOW_MS}{NOW}{V_NUM}{INSPECT}")),
            complete: settling(format!("{to_hash}{DROP_PIECES}{HASH_FIRST}{COMPLETE}")),
            supersede: Script::new(&format!("{to_hash}{DROP_PIECES}{HASH_FIRST}{SUPERSEDE}")),
        };
        let leader = conn.primary_epoch();
        let store = RedisStore {
            conn,
            value_records: setup.value_records,
            scripts: std::sync::Arc::new(scripts),
            replica_ack: setup.replica_ack,
            acked: setup.replica_ack.map(|ack| {
                let mut links = AckLinks::new(setup, ack, connect_timeout, response_timeout);
                // With Sentinel they follow the shared link's view of the primary: a
                // claim must never go to a new primary and its record to the old one.
                links.leader = leader.clone();
                std::sync::Arc::new(links)
            }),
        };
        // Loading now keeps the first requests at one round trip (EVALSHA hits). After a
        // Redis restart the scripts are gone; redis-rs then falls back to EVAL once.
        let mut c = store.conn.clone();
        for s in [
            &store.scripts.claim,
            &store.scripts.record,
            &store.scripts.record_value,
            &store.scripts.record_hash,
            &store.scripts.shorten,
            &store.scripts.supersede,
            &store.scripts.record_not_kept,
            &store.scripts.write_chunk,
            &store.scripts.record_large,
            &store.scripts.renew,
            &store.scripts.mark_unknown,
            &store.scripts.release,
            &store.scripts.delete,
            &store.scripts.inspect,
            &store.scripts.complete,
        ] {
            let load = async { s.prepare_invoke().load_async(&mut c).await.map_err(at) };
            let _: String = super::deadline(response_timeout, load).await?;
        }
        if store.value_records {
            // `SET ... NX GET` is refused before Redis 7.0.
            let info = super::deadline(response_timeout, store.info_all("server")).await?;
            for i in &info {
                let version = info_field(i, "redis_version").unwrap_or_default();
                if !claims_with_set_nx_get(&version) {
                    return Err(StoreError::Backend(format!(
                        "Redis at {}: redis_record_format = \"value\" needs Redis 7.0 or later \
                         (SET with NX and GET), and this server is {version}; use \"hash\"",
                        setup.addresses()
                    )));
                }
            }
        }
        Ok(store)
    }

    /// Reads `INFO` for the start-up checks.
    pub async fn server_info(&self) -> Result<ServerInfo, StoreError> {
        // Every primary of a cluster must keep its records: the worst one is reported.
        let infos = self.info_all("all").await?;
        let policies: Vec<String> = infos
            .iter()
            .map(|i| info_field(i, "maxmemory_policy").unwrap_or_default())
            .collect();
        Ok(ServerInfo {
            maxmemory_policy: policies
                .iter()
                .find(|p| *p != "noeviction")
                .or(policies.first())
                .cloned()
                .unwrap_or_default(),
            aof_enabled: infos
                .iter()
                .all(|i| info_field(i, "aof_enabled").as_deref() == Some("1")),
            version: info_field(&infos[0], "redis_version").unwrap_or_default(),
        })
    }

    /// `INFO` of every primary: one text, or one per primary of a cluster.
    async fn info_all(&self, section: &str) -> Result<Vec<String>, StoreError> {
        let mut c = self.conn.clone();
        let v: Value = redis::cmd("INFO")
            .arg(section)
            .query_async(&mut c)
            .await
            .map_err(backend)?;
        let texts: Vec<String> = match v {
            // A cluster answers one INFO per primary, by node address.
            Value::Map(nodes) => nodes.iter().filter_map(|(_, v)| text_of(v)).collect(),
            other => text_of(&other).into_iter().collect(),
        };
        if texts.is_empty() {
            return Err(corrupt("INFO reply"));
        }
        Ok(texts)
    }

    /// Runs `script` as prepared in `cmd` (from [`evalsha`]) and, when `wait` and replica
    /// acknowledgement is on, `WAIT` in the same round trip. Returns the script's reply and
    /// how many replicas acknowledged (`None` without `WAIT`). A script missing on the
    /// server (restart, failover to a node that never saw it) is loaded and run once more.
    async fn eval(
        &self,
        script: &Script,
        cmd: Cmd,
        wait: bool,
    ) -> Result<(Value, Option<i64>), StoreError> {
        self.call(Some(script), cmd, wait).await?.map_err(backend)
    }

    /// [`eval`](Self::eval) of a script or (`script` = `None`) of a bare command, with
    /// Redis's own error kept as such (the inner result), for the caller to tell
    /// `WRONGTYPE` from the rest.
    async fn call(
        &self,
        script: Option<&Script>,
        cmd: Cmd,
        wait: bool,
    ) -> Result<redis::RedisResult<(Value, Option<i64>)>, StoreError> {
        Ok(match (self.replica_ack.filter(|_| wait), &self.acked) {
            (Some(ack), Some(links)) => {
                let mut held = links.take().await?;
                let out = Self::run(script, cmd, Some(ack), &mut held.link).await;
                held.done = true;
                out
            }
            _ => Self::run(script, cmd, None, &mut self.conn.clone()).await,
        })
    }

    /// [`eval`](Self::eval) on the connection `c`, with `WAIT` when `ack` is given, and
    /// behind `ASKING` in a cluster (see [`query_keyed`]).
    async fn run(
        script: Option<&Script>,
        cmd: Cmd,
        ack: Option<ReplicaAck>,
        c: &mut Link,
    ) -> redis::RedisResult<(Value, Option<i64>)> {
        let asking = c.is_cluster();
        let pipe = (asking || ack.is_some()).then(|| {
            let mut pipe = redis::pipe();
            // Errors come back as values, so that a missing script is told from the rest.
            pipe.ignore_errors();
            if asking {
                pipe.cmd("ASKING").ignore();
            }
            pipe.add_command(cmd.clone());
            if let Some(ack) = ack {
                pipe.cmd("WAIT")
                    .arg(ack.replicas)
                    .arg(ack.timeout.as_millis() as u64);
            }
            pipe
        });
        let mut loaded = false;
        loop {
            let result = match &pipe {
                None => cmd.query_async::<Value>(&mut *c).await.map(|v| (v, None)),
                Some(pipe) => {
                    pipe.query_async::<Vec<Value>>(&mut *c)
                        .await
                        .and_then(|mut replies| {
                            let acked = match ack.map(|_| replies.pop()) {
                                None => None,
                                Some(Some(Value::Int(n))) => Some(n),
                                Some(Some(Value::ServerError(e))) => return Err(e.into()),
                                Some(_) => Some(0),
                            };
                            match replies.pop() {
                                Some(Value::ServerError(e)) => Err(e.into()),
                                Some(v) => Ok((v, acked)),
                                None => Err(redis::RedisError::from((
                                    redis::ErrorKind::Parse,
                                    "pipeline without the script's reply",
                                ))),
                            }
                        })
                }
            };
            match (result, script) {
                (Err(e), Some(script)) if !loaded && e.code() == Some("NOSCRIPT") => {
                    loaded = true;
                    let _: String = script.prepare_invoke().load_async(&mut *c).await?;
                }
                (other, _) => return other,
            }
        }
    }

    /// Whether `WAIT`'s count meets `min_replicas_ack`; the error says what was missing.
    fn acknowledged(&self, what: &str, acked: Option<i64>) -> Result<(), StoreError> {
        match (self.replica_ack, acked) {
            (Some(ack), Some(n)) if n < i64::from(ack.replicas) => {
                Err(StoreError::Backend(format!(
                    "{what} acknowledged by {n} of {} replicas within {:?}",
                    ack.replicas, ack.timeout
                )))
            }
            _ => Ok(()),
        }
    }

    /// Runs a script that writes an answer and waits for replicas: it answers 1 when it
    /// wrote (then `what` must be acknowledged), 0 when it left the record alone; any other
    /// reply is corrupt (`bad` says which).
    async fn answer_written(
        &self,
        script: &Script,
        cmd: Cmd,
        what: &str,
        bad: &str,
    ) -> Result<bool, StoreError> {
        let (v, acked) = self.eval(script, cmd, true).await?;
        match v {
            Value::Int(1) => {
                self.acknowledged(what, acked)?;
                Ok(true)
            }
            Value::Int(0) => Ok(false),
            _ => Err(corrupt(bad)),
        }
    }

    /// A record script's reply: `Some(true)` written (and acknowledged by the replicas when
    /// they must be), `Some(false)` left alone (not, or no longer, the owner's record),
    /// `None` when the key holds the other form of record (`WRONGTYPE`: nothing written).
    fn record_reply(
        &self,
        reply: redis::RedisResult<(Value, Option<i64>)>,
    ) -> Result<Option<bool>, StoreError> {
        match reply {
            Err(e) if wrong_type(&e) => Ok(None),
            Err(e) => Err(backend(e)),
            Ok((Value::Int(1), acked)) => {
                self.acknowledged("record", acked)?;
                Ok(Some(true))
            }
            Ok((Value::Int(0), _)) => Ok(Some(false)),
            Ok(_) => Err(corrupt("owner-checked script reply")),
        }
    }

    /// Runs one of the owner-checked scripts: KEYS[1] = the record, ARGV[1] = the owner,
    /// then `args`. It answers 1 when it applied, 0 when the record is not (or no longer)
    /// the owner's. `acknowledged`: what to call the write when it must wait for replicas.
    async fn owner_checked(
        &self,
        script: &Script,
        id: &RecordId,
        owner: &OwnerToken,
        args: &[&[u8]],
        acknowledged: Option<&str>,
    ) -> Result<bool, StoreError> {
        let mut cmd = evalsha(script, &Self::key(id));
        cmd.arg(owner.as_str());
        for arg in args {
            cmd.arg(*arg);
        }
        // Only a record waits for replicas: renewals, releases and marks that are lost in
        // a failover leave a claim whose lease runs out, which reads as `unknown`.
        let (v, acked) = self.eval(script, cmd, acknowledged.is_some()).await?;
        let n = match v {
            Value::Int(n) => n,
            _ => return Err(corrupt("owner-checked script reply")),
        };
        if let (1, Some(what)) = (n, acknowledged) {
            self.acknowledged(what, acked)?;
        }
        Ok(n == 1)
    }

    /// `idemgate:{<id>}`: the hash tag keeps a record in one cluster slot. Written into a
    /// stack buffer: through `to_string()` and `format!` the key cost two allocations and
    /// about 2,000 instructions (callgrind), on both Redis calls of every new key.
    fn key(id: &RecordId) -> [u8; KEY_LEN] {
        let mut key = [0u8; KEY_LEN];
        key[..KEY_PREFIX.len()].copy_from_slice(KEY_PREFIX);
        key[KEY_PREFIX.len()..KEY_LEN - 1].copy_from_slice(&hex64(id.as_bytes()));
        key[KEY_LEN - 1] = b'}';
        key
    }

    /// `idemgate:{<id>}:body`: where the previous version kept a large body (`bl` in the
    /// record), in the record's cluster slot. Only read (and deleted with its record) here.
    fn old_body_key(id: &RecordId) -> [u8; KEY_LEN + OLD_BODY_SUFFIX.len()] {
        let mut key = [0u8; KEY_LEN + OLD_BODY_SUFFIX.len()];
        key[..KEY_LEN].copy_from_slice(&Self::key(id));
        key[KEY_LEN..].copy_from_slice(OLD_BODY_SUFFIX);
        key
    }
}

/// `cmd`, a command on one record's key, on `c`; in a cluster, right behind an `ASKING`, in
/// one write.
///
/// redis-rs follows a cluster's `ASK` by sending `ASKING` to the importing node on the
/// shared connection, waiting for its answer, and only then the command: any other call on
/// that connection in between (another redirected call's `ASKING` and command, a call to
/// one of that node's own slots) takes the one-command `ASKING` for itself, the importing
/// node answers this command with `MOVED` back to the source, which answers `ASK` again,
/// and so on until the caller's deadline. Under traffic, every new key of a migrating slot
/// got 503 that way. An `ASKING` of the call's own, in the same write as the command, is
/// the one the command is served under, whoever took redis-rs's. It costs a cluster node
/// about 2,000 instructions per call (callgrind: a new key's claim and record 144k without,
/// 148k with). To a node that serves the slot, `ASKING` changes nothing. To a node importing it, it does for any call, so the one
/// hazard is a call sent there without an `ASK` because this instance's slot map still names
/// that node from before the slot moved away and came back: no node reports an importing
/// node as a slot's owner, and any call to the slot in between, or any `MOVED` at all,
/// reloads the map.
async fn query_keyed<T: redis::FromRedisValue>(c: &mut Link, cmd: &Cmd) -> redis::RedisResult<T> {
    if !c.is_cluster() {
        return cmd.query_async(c).await;
    }
    let (v,): (T,) = redis::pipe()
        .cmd("ASKING")
        .ignore()
        .add_command(cmd.clone())
        .query_async(c)
        .await?;
    Ok(v)
}

/// `EVALSHA <script> 1 <key>`, ready for the script's arguments: every script names one
/// key, the record's (see the module's comment for why).
fn evalsha(script: &Script, key: &[u8]) -> Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(script.get_hash()).arg(1).arg(key);
    cmd
}

/// What start-up says when Redis cannot be used: the address, and TLS when the TLS layer
/// refused (a certificate, a name, a client certificate), so that an operator looks at the
/// right thing first.
fn describe_failure(setup: &RedisSetup, e: &redis::RedisError) -> String {
    let text = e.to_string();
    let lower = text.to_ascii_lowercase();
    let tls = self::link::tls_failure(e)
        || (setup.tls.is_some()
            && ["certificate", "tls", "handshake", "alert"]
                .iter()
                .any(|w| lower.contains(w)));
    let at = setup.addresses();
    if tls {
        format!("Redis at {at}: TLS failed: {text}")
    } else {
        format!("Redis at {at}: {text}")
    }
}
