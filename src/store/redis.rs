//! The Redis store: one record = one Redis hash under `idemgate:{<record id>}` (the hash tag
//! keeps a record in one cluster slot), its time to live = the route's retention from the
//! claim. Claim, record, renew, mark-unknown and release are each one Lua script: one round
//! trip, atomic, and safe to run twice. Times come from Redis's own clock (`TIME`), so
//! several idemgate instances agree on leases whatever their clocks say.
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

use super::redis_link::Link;
use super::redis_setup::{RedisSetup, ReplicaAck, Topology};
use super::{
    BoxFuture, Claim, ClaimRequest, Completed, Deleted, Meta, OwnerToken, Page, RecordState,
    RecordView, ServerStats, Store, StoreError, StoredResponse, SCOPE_SECRET,
};
use crate::key::RecordId;

// Fields of a record hash: st = state (p in progress, c completed, n completed but the
// answer not kept, u unknown), fp =
// fingerprint hex, fv = fingerprint version, ow = owner token, lu = lease until (ms, Redis
// clock; it counts only while `p`, and a completed record may keep its last one), wu = the
// owner may be working until (ms, Redis clock), cr = created (ms), sc =
// status, hd = headers (StoredResponse::encode_headers), bd = body (up to INLINE_MAX
// bytes), bp = length of a larger body, kept in pieces `b0`, `b1`, ... (each at most CHUNK
// bytes) in the same hash.
//
// A large body stays off the claim path: one Redis reply is read whole before the next one
// on the shared connection, so a multi-MiB body inline in a claim or record held up every
// other key's call behind it. It is written and read a piece per round trip instead, so
// other keys' calls interleave with them; answers up to INLINE_MAX (nearly all of them)
// keep their one round trip.
//
// Withdrawal notes: `w:<owner>` = until when (ms, Redis clock) that owner's claim, should
// it still arrive, must create nothing (see `RELEASE`), and `wx` = the latest of them, which
// the key outlives. A hash without `st` is no record: every reader, this version's and the
// previous one's, already treats it as absent (claim creates, inspect, list, delete and
// complete find nothing), so notes need no state of their own and an instance of the
// previous version claims such a key as a new one. A record created over notes keeps them.
//
// The previous version (rolling upgrades run both on one Redis) kept notes in a set
// `idemgate:{<id>}:w` and large bodies in a string `idemgate:{<id>}:body`, with `bl` = its
// length in the hash. Its large records still replay here: the claim tells `bl` from `bp`,
// and the body is read from the old key with plain GETRANGEs. Its notes are not read here,
// and need not be: a note holds back only a late claim that carries the owner token that
// withdrew it; owner tokens are random per claim, and a claim and its release come from
// the one instance that made the token, so a note in a `:w` set only ever meets claims of
// the previous version's scripts, which read `:w`, and a `w:` field only ever meets claims
// of this version's. (What the previous version cannot do: replay a large record written
// here, which it looks for in `:body`, and keep this version's notes when its release or
// operator delete removes a record with a plain DEL; both last only as long as the
// upgrade.)
//
// What the scripts cost Redis: each `redis.call` costs a few thousand instructions beyond
// the command itself (its arguments copied, the command looked up, the reply turned into
// Lua values), each script argument and each field fetched about a thousand more, and
// turning numbers into strings is dear: a number passed to `redis.call` (which Redis 7.0
// formats with `%.17g`) about 4,000, `string.format('%d')` about 2,000, and so is
// `tonumber` on a string, where Lua's arithmetic reads one for half (callgrind). So the
// claim and the record call no more commands, take no more keys and fetch no more fields
// than their common paths need, and write times with `string.format('%d', ...)`: the same
// digits as before, so every version reads every other version's records.
const NOW_MS: &str = "local function now_ms() local t = redis.call('TIME') return t[1] * 1000 + math.floor(t[2] / 1000) end\n";
const NOW: &str = "local now = now_ms()\n";

// Removes the pieces of a large body (`b0`, `b1`, ...), however many were written. Only on
// the rare paths that give a body up: the common ones know the record has none.
const DROP_PIECES: &str = r#"
local function drop_pieces(k)
  local f = redis.call('HKEYS', k)
  local pieces = {}
  for i = 1, #f do
    if string.find(f[i], '^b%d+$') then pieces[#pieces + 1] = f[i] end
  end
  if #pieces > 0 then redis.call('HDEL', k, unpack(pieces)) end
end
"#;

// Removes a record and keeps the withdrawal notes beside it (`wx` = when the last runs
// out): another owner's claim may still be on its way. Without notes, one DEL.
const DROP_RECORD: &str = r#"
local function drop_record(k, wx)
  if not wx then redis.call('DEL', k) return end
  local f = redis.call('HKEYS', k)
  local gone = {}
  for i = 1, #f do
    if f[i] ~= 'wx' and string.sub(f[i], 1, 2) ~= 'w:' then gone[#gone + 1] = f[i] end
  end
  if #gone > 0 then redis.call('HDEL', k, unpack(gone)) end
  redis.call('PEXPIREAT', k, wx)
end
"#;

// One HMGET reads everything a replay needs and this owner's withdrawal note (and no more:
// `lu`, needed only while in progress, and `bp`/`bl`, only for a large body, are read when
// needed), and the clock is read only when a claim is made or a lease compared: a replay,
// the most frequent claim, runs one command, and so does a new key before it writes. A
// claim over other owners' notes sets the route's retention as the key's expiry, which
// outlasts them: a note lingers for the retention of the claim it withdrew.
const CLAIM: &str = r#"
local r = redis.call('HMGET', KEYS[1], 'st', 'fp', 'fv', 'sc', 'hd', 'bd', 'w:' .. ARGV[3])
if not r[1] then
  local now = now_ms()
  if r[7] and tonumber(r[7]) > now then return {'withdrawn'} end
  redis.call('HSET', KEYS[1], 'st', 'p', 'fp', ARGV[1], 'fv', ARGV[2], 'ow', ARGV[3],
             'lu', string.format('%d', now + ARGV[4]), 'wu', string.format('%d', now + ARGV[6]),
             'cr', string.format('%d', now))
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
  return {'claimed'}
end
if r[3] ~= ARGV[2] then return {'version', r[3]} end
if r[2] ~= ARGV[1] then return {'mismatch'} end
if r[1] == 'c' and r[6] then return {'completed', r[4], r[5], r[6]} end
if r[1] == 'c' then
  local b = redis.call('HMGET', KEYS[1], 'bp', 'bl')
  if b[1] then return {'completed_pieces', r[4], r[5], b[1]} end
  return {'completed_large', r[4], r[5], b[2]}
end
if r[1] == 'n' then return {'not_kept', r[4]} end
if r[1] == 'p' then
  local lu = tonumber(redis.call('HGET', KEYS[1], 'lu'))
  local now = now_ms()
  if lu > now then return {'in_progress', string.format('%d', lu - now)} end
end
return {'unknown'}
"#;

// Owner-checked; running it twice records the same response twice, which is harmless.
// The lease (`lu`) is left in place: no script and no reader looks at it once `st` is `c`
// (it only counts while `p`), and an HDEL was a whole command more per new key.
const RECORD: &str = r#"
if redis.call('HGET', KEYS[1], 'ow') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'st', 'c', 'sc', ARGV[2], 'hd', ARGV[3], 'bd', ARGV[4])
return 1
"#;

// As RECORD, for an answer too large to keep (or that found Redis out of memory, maybe
// after some pieces of it were written): the status alone. The pieces go first, so that
// the memory they held is free for the rest.
const RECORD_NOT_KEPT: &str = r#"
if redis.call('HGET', KEYS[1], 'ow') ~= ARGV[1] then return 0 end
drop_pieces(KEYS[1])
redis.call('HDEL', KEYS[1], 'lu', 'hd', 'bd', 'bl', 'bp')
redis.call('HSET', KEYS[1], 'st', 'n', 'sc', ARGV[2])
return 1
"#;

// Piece ARGV[2] (0, 1, ...) of a large body, by the owner of a record in progress. In the
// record's hash, so it lives and goes with the record. Running it twice writes the same
// bytes twice.
const WRITE_CHUNK: &str = r#"
local r = redis.call('HMGET', KEYS[1], 'ow', 'st')
if r[1] ~= ARGV[1] or r[2] ~= 'p' then return 0 end
redis.call('HSET', KEYS[1], 'b' .. ARGV[2], ARGV[3])
return 1
"#;

// As RECORD, once the ARGV[5] pieces of a large body are written: its length instead of
// the body. -1 when the pieces do not add up to it (one was lost, say in a failover).
const RECORD_LARGE: &str = r#"
if redis.call('HGET', KEYS[1], 'ow') ~= ARGV[1] then return 0 end
local have = 0
for i = 0, tonumber(ARGV[5]) - 1 do
  have = have + redis.call('HSTRLEN', KEYS[1], 'b' .. i)
end
if have ~= tonumber(ARGV[4]) then return -1 end
redis.call('HSET', KEYS[1], 'st', 'c', 'sc', ARGV[2], 'hd', ARGV[3], 'bp', ARGV[4])
redis.call('HDEL', KEYS[1], 'lu', 'bd')
return 1
"#;

// Owner-checked: the record's expiry brought forward to ARGV[2] ms from now, never later
// (an answer that shows nothing ran, kept only `short_retention`).
const SHORTEN: &str = r#"
if redis.call('HGET', KEYS[1], 'ow') ~= ARGV[1] then return 0 end
local left = redis.call('PTTL', KEYS[1])
if left < 0 or left > tonumber(ARGV[2]) then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 1
"#;

const RENEW: &str = r#"
local r = redis.call('HMGET', KEYS[1], 'ow', 'st')
if r[1] ~= ARGV[1] or r[2] ~= 'p' then return 0 end
redis.call('HSET', KEYS[1], 'lu', string.format('%d', now + ARGV[2]))
return 1
"#;

const MARK_UNKNOWN: &str = r#"
local r = redis.call('HMGET', KEYS[1], 'ow', 'st')
if r[1] ~= ARGV[1] or r[2] == 'c' or r[2] == 'n' then return 0 end
redis.call('HSET', KEYS[1], 'st', 'u')
redis.call('HDEL', KEYS[1], 'lu')
return 1
"#;

// The claim may not have landed yet: down a connection that was cut, a claim can still be
// delivered after this release (which came down a new one). Remembering the withdrawal
// (`w:<owner>`, for ARGV[2] ms) makes such a late claim create nothing. It goes into the
// record's own key, absent or another owner's, so that the claim reads it with the fields
// it reads anyway. The key's expiry only ever grows here, so one owner's short linger
// never shortens another's, nor a live record's retention; a key without one (-1) is left
// without.
const RELEASE: &str = r#"
local r = redis.call('HMGET', KEYS[1], 'ow', 'wx')
if r[1] == ARGV[1] then
  drop_record(KEYS[1], r[2])
  return 1
end
local ttl = redis.call('PTTL', KEYS[1])
local linger = tonumber(ARGV[2])
local till = string.format('%d', now_ms() + linger)
if r[2] and tonumber(r[2]) >= tonumber(till) then
  redis.call('HSET', KEYS[1], 'w:' .. ARGV[1], till)
else
  redis.call('HSET', KEYS[1], 'w:' .. ARGV[1], till, 'wx', till)
end
if ttl == -2 or (ttl >= 0 and ttl < linger) then redis.call('PEXPIRE', KEYS[1], linger) end
return 0
"#;

// An operator's release: unless forced (ARGV[1] = '1'), a record whose owner may still be
// working (lease live, or within its `wu`) is left alone. 1 deleted, 0 none, 2 busy, 4
// deleted, and its large body was the previous version's key (`bl`), for the caller to
// delete. Withdrawal notes stay, as with an owner's release.
const DELETE: &str = r#"
local r = redis.call('HMGET', KEYS[1], 'st', 'lu', 'wu', 'wx', 'bl')
if not r[1] then return 0 end
if ARGV[1] ~= '1' and r[1] == 'p' then
  local now = now_ms()
  if tonumber(r[2] or '0') > now or tonumber(r[3] or '0') > now then return 2 end
end
drop_record(KEYS[1], r[4])
if r[5] then return 4 end
return 1
"#;

// An operator's resolution of a record that never got its answer recorded: unless forced
// (ARGV[1] = '1'), a record whose owner may still be working is left alone, and a completed
// one always is (`c`, or `n`: completed, the answer not kept). The owner is cleared, so the
// former owner's late RECORD and WRITE_CHUNK are refused. The answer goes inline whatever
// its size (at most the admin API's 16 MiB request: a rare reconciliation, so its replays
// may hold up the shared connection a moment), and any piece of a large body that the
// former owner wrote goes. (A previous-version owner's pieces, in `:body`, expire a minute
// after the record; nothing reads them once `bl` is gone.) 1 completed, 0 none, 2 busy, 3
// already completed.
const COMPLETE: &str = r#"
local r = redis.call('HMGET', KEYS[1], 'st', 'lu', 'wu')
if not r[1] then return 0 end
if r[1] == 'c' or r[1] == 'n' then return 3 end
if ARGV[1] ~= '1' and r[1] == 'p' then
  local now = now_ms()
  if tonumber(r[2] or '0') > now or tonumber(r[3] or '0') > now then return 2 end
end
drop_pieces(KEYS[1])
redis.call('HSET', KEYS[1], 'st', 'c', 'ow', '', 'sc', ARGV[2], 'hd', ARGV[3], 'bd', ARGV[4])
redis.call('HDEL', KEYS[1], 'lu', 'bl', 'bp')
return 1
"#;

// The record, with its inline body when ARGV[1] = '1'; a large one's length comes back
// instead (`bp`: pieces in the hash, `bl`: the previous version's key), for the caller to
// read a piece at a time.
const INSPECT: &str = r#"
local r = redis.call('HMGET', KEYS[1], 'st', 'fp', 'fv', 'lu', 'cr', 'sc', 'wu', 'bp', 'bl')
if not r[1] then return false end
local body = false
if ARGV[1] == '1' then body = redis.call('HGET', KEYS[1], 'bd') end
return {r[1], r[2], r[3], r[4] or '', r[5], r[6] or '', tostring(now), tostring(redis.call('PTTL', KEYS[1])), body, r[7] or '', r[8] or '', r[9] or ''}
"#;

/// Where the record-id secret lives: outside any record's hash tag, read at start-up and
/// checked (put back if missing) every `scope_secret_check_interval` (see
/// [`crate::secret`]). It must outlive every record (it has no TTL, and idemgate refuses a
/// Redis that evicts); a Redis that forgets it is what the checks are for.
pub const SECRET_KEY: &str = "idemgate:scope-secret";

/// The Redis key of a [`Store::meta`] value: the scope secret where it always was, the
/// others beside it (`idemgate:scope-verifier:<namespace>`).
fn meta_key(name: &str) -> String {
    if name == SCOPE_SECRET {
        SECRET_KEY.to_string()
    } else {
        format!("idemgate:{}", name.replace('_', "-"))
    }
}

/// `SET key value NX`: whether this call wrote it.
async fn meta_set_if_absent(c: &mut Link, key: &str, value: &str) -> Result<bool, StoreError> {
    let set: Option<String> = redis::cmd("SET")
        .arg(key)
        .arg(value)
        .arg("NX")
        .query_async(c)
        .await
        .map_err(backend)?;
    Ok(set.is_some())
}

/// `GET key` of a meta value.
async fn meta_get(c: &mut Link, key: &str) -> Result<Option<String>, StoreError> {
    redis::cmd("GET")
        .arg(key)
        .query_async(c)
        .await
        .map_err(backend)
}

/// One hash tag per primary in a `CLUSTER SLOTS` reply: the first of `s0`, `s1`, ... whose
/// slot that primary serves. Every instance computes the same tags from the same slot map;
/// after a resharding the tags move with it, and the next check writes the copies anew.
fn copy_tags(slots: &Value) -> Vec<String> {
    use std::collections::BTreeMap;
    // Ranges by primary (the first node of each range).
    let mut primaries: BTreeMap<String, Vec<(i64, i64)>> = BTreeMap::new();
    for range in super::redis_link::slot_ranges(slots) {
        if let Some((host, port)) = range.nodes.first() {
            primaries
                .entry(format!("{host}:{port}"))
                .or_default()
                .push((range.from, range.to));
        }
    }
    primaries
        .values()
        .filter_map(|ranges| {
            (0..65_536).map(|i| format!("s{i}")).find(|tag| {
                let slot = i64::from(key_slot(tag.as_bytes()));
                ranges
                    .iter()
                    .any(|(from, to)| (*from..=*to).contains(&slot))
            })
        })
        .collect()
}

/// The cluster slot of a key without a hash tag (CRC16/XMODEM modulo 16384).
fn key_slot(key: &[u8]) -> u16 {
    crc16::State::<crc16::XMODEM>::calculate(key) % 16_384
}

/// How many times start-up waits for the replicas to acknowledge the scope secret (each
/// wait `replica_ack_timeout`) before it gives up.
pub const SECRET_ACK_TRIES: u32 = 5;

/// The Redis store.
#[derive(Clone)]
pub struct RedisStore {
    conn: Link,
    scripts: std::sync::Arc<Scripts>,
    /// `WAIT` after claims and records, when configured.
    replica_ack: Option<ReplicaAck>,
    /// With `replica_ack`: the connections that carry claims and records with their `WAIT`.
    acked: Option<std::sync::Arc<AckLinks>>,
}

/// Connections of their own for the writes that wait for replicas, each carrying one such
/// write (and its `WAIT`) at a time.
///
/// Redis serves a connection's calls in order and holds all of them while that
/// connection's `WAIT` waits. On the shared connection, a claim waiting out
/// `replica_ack_timeout` for a missing replica held up every call queued behind it
/// (replays, releases, a cluster's slot-map reload) and let through at most one claim per
/// `replica_ack_timeout`; claims arriving faster piled up on the wire beyond
/// `store_timeout`, still waiting there after the replica came back. Here a write waits
/// for a free connection in idemgate, where its caller's deadline can still withdraw it
/// unsent, and nothing else ever waits behind a `WAIT`.
///
/// Connections are opened as needed, up to `replica_ack_connections`. One is closed, not
/// reused, when its caller gave up while a write was on it: a late answer must not reach
/// the next write.
struct AckLinks {
    setup: RedisSetup,
    connect_timeout: Duration,
    response_timeout: Duration,
    idle: std::sync::Mutex<Vec<Link>>,
    free: tokio::sync::Semaphore,
    /// With Sentinel, the shared link's primary epoch (see `Link::primary_epoch`).
    leader: Option<std::sync::Arc<std::sync::atomic::AtomicU64>>,
}

/// One of [`AckLinks`], held for one write.
struct AckLink<'a> {
    links: &'a AckLinks,
    link: Link,
    /// Set once the write's answer has been read: the connection carries nothing then.
    done: bool,
    _free: tokio::sync::SemaphorePermit<'a>,
}

impl AckLinks {
    fn new(
        setup: &RedisSetup,
        ack: ReplicaAck,
        connect_timeout: Duration,
        response_timeout: Duration,
    ) -> AckLinks {
        AckLinks {
            setup: setup.clone(),
            connect_timeout,
            response_timeout,
            idle: std::sync::Mutex::new(Vec::new()),
            free: tokio::sync::Semaphore::new(ack.connections),
            leader: None,
        }
    }

    /// A connection for one write: an idle one, or a new one once one is free.
    async fn take(&self) -> Result<AckLink<'_>, StoreError> {
        let free = self
            .free
            .acquire()
            .await
            .map_err(|_| StoreError::Backend("the store is closing".into()))?;
        let idle = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let link = match idle {
            Some(link) => link,
            None => Link::open_following(
                &self.setup,
                self.connect_timeout,
                self.response_timeout,
                self.leader.clone(),
            )
            .await
            .map_err(|e| StoreError::Backend(describe_failure(&self.setup, &e)))?,
        };
        Ok(AckLink {
            links: self,
            link,
            done: false,
            _free: free,
        })
    }
}

impl Drop for AckLink<'_> {
    fn drop(&mut self) {
        if self.done {
            self.links
                .idle
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(self.link.clone());
        }
    }
}

struct Scripts {
    claim: Script,
    record: Script,
    record_not_kept: Script,
    shorten: Script,
    write_chunk: Script,
    record_large: Script,
    renew: Script,
    mark_unknown: Script,
    release: Script,
    delete: Script,
    inspect: Script,
    complete: Script,
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
        let scripts = Scripts {
            claim: Script::new(&format!("{NOW_MS}{CLAIM}")),
            record: Script::new(RECORD),
            record_not_kept: Script::new(&format!("{DROP_PIECES}{RECORD_NOT_KEPT}")),
            shorten: Script::new(SHORTEN),
            write_chunk: Script::new(WRITE_CHUNK),
            record_large: Script::new(RECORD_LARGE),
            renew: Script::new(&format!("{NOW_MS}{NOW}{RENEW}")),
            mark_unknown: Script::new(MARK_UNKNOWN),
            release: Script::new(&format!("{NOW_MS}{DROP_RECORD}{RELEASE}")),
            delete: Script::new(&format!("{NOW_MS}{DROP_RECORD}{DELETE}")),
            inspect: Script::new(&format!("{NOW_MS}{NOW}{INSPECT}")),
            complete: Script::new(&format!("{NOW_MS}{DROP_PIECES}{COMPLETE}")),
        };
        let leader = conn.primary_epoch();
        let store = RedisStore {
            conn,
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

    /// [`Store::meta`] on a Cluster: the value under its usual key and under one copy per
    /// primary (`<key>:{<tag>}`, a hash tag in a slot that primary serves, see
    /// [`copy_tags`]), so that losing any one shard (a primary restarted empty, a
    /// `FLUSHALL` of one node) loses no meta value: every instance, a starting one
    /// included, reads it from the copies that are left and puts the missing ones back.
    ///
    /// Reads every copy; if they hold two different values, nothing is decided (an error:
    /// the store is inconsistent and an operator must say which secret is the one). If
    /// one value is found, it is written, set-if-absent, wherever it is missing. If none
    /// is, `offer` is set-if-absent under the usual key (whoever came first wins, as on
    /// one server), and what won is copied to every primary.
    async fn cluster_meta(&self, name: &str, offer: Option<&str>) -> Result<Meta, StoreError> {
        let key = meta_key(name);
        let mut c = self.conn.clone();
        let slots: Value = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async(&mut c)
            .await
            .map_err(backend)?;
        let mut keys = vec![key.clone()];
        keys.extend(copy_tags(&slots).iter().map(|t| format!("{key}:{{{t}}}")));
        let mut found: Vec<Option<String>> = Vec::with_capacity(keys.len());
        for k in &keys {
            found.push(meta_get(&mut c, k).await?);
        }
        let mut values: Vec<&String> = found.iter().flatten().collect();
        values.sort();
        values.dedup();
        let (value, mut created) = match values.as_slice() {
            [] => match offer {
                None => {
                    return Ok(Meta {
                        value: None,
                        created: false,
                    })
                }
                Some(v) => {
                    let set = meta_set_if_absent(&mut c, &key, v).await?;
                    let won = meta_get(&mut c, &key).await?;
                    found[0] = won.clone();
                    match won {
                        Some(w) => (w, set),
                        None => return Err(corrupt(&format!("{key} vanished as it was set"))),
                    }
                }
            },
            [one] => ((*one).clone(), false),
            _ => {
                return Err(StoreError::Backend(format!(
                    "the copies of {key} on the cluster's primaries hold {} different values; \
                     delete the wrong ones (or pin the scope secret) to go on",
                    values.len()
                )))
            }
        };
        for (k, v) in keys.iter().zip(&found) {
            if v.is_none() {
                let set = meta_set_if_absent(&mut c, k, &value).await?;
                // Putting back what another copy held is restoring; `created` says that
                // this instance's offer went in somewhere.
                created |= set && offer == Some(value.as_str());
            }
        }
        if offer.is_some() {
            self.meta_acknowledged(&mut c).await?;
        }
        Ok(Meta {
            value: Some(value),
            created,
        })
    }

    /// With replica acknowledgement on, waits until the replicas have what this
    /// connection wrote, `SECRET_ACK_TRIES` times at most.
    async fn meta_acknowledged(&self, c: &mut Link) -> Result<(), StoreError> {
        let Some(ack) = self.replica_ack else {
            return Ok(());
        };
        let mut acked = 0;
        for _ in 0..SECRET_ACK_TRIES {
            acked = redis::cmd("WAIT")
                .arg(ack.replicas)
                .arg(ack.timeout.as_millis() as u64)
                .query_async(c)
                .await
                .map_err(backend)?;
            if acked >= i64::from(ack.replicas) {
                break;
            }
        }
        self.acknowledged("the scope secret", Some(acked))
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
        match (self.replica_ack.filter(|_| wait), &self.acked) {
            (Some(ack), Some(links)) => {
                let mut held = links.take().await?;
                let out = Self::run(script, cmd, Some(ack), &mut held.link).await;
                held.done = true;
                out
            }
            _ => Self::run(script, cmd, None, &mut self.conn.clone()).await,
        }
    }

    /// [`eval`](Self::eval) on the connection `c`, with `WAIT` when `ack` is given, and
    /// behind `ASKING` in a cluster (see [`query_keyed`]).
    async fn run(
        script: &Script,
        cmd: Cmd,
        ack: Option<ReplicaAck>,
        c: &mut Link,
    ) -> Result<(Value, Option<i64>), StoreError> {
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
            match result {
                Err(e) if !loaded && e.code() == Some("NOSCRIPT") => {
                    loaded = true;
                    script
                        .prepare_invoke()
                        .load_async(&mut *c)
                        .await
                        .map_err(backend)?;
                }
                other => return other.map_err(backend),
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

    /// Reads a large body of `len` bytes, a piece per round trip: from the record's hash
    /// (`Body::Pieces`) or from the previous version's key (`Body::OldKey`). Plain HGET and
    /// GETRANGE, each of one key, so that they follow a slot migration too.
    async fn read_large(&self, id: &RecordId, at: Body, len: usize) -> Result<Bytes, StoreError> {
        let mut body = bytes::BytesMut::with_capacity(len);
        let mut c = self.conn.clone();
        let mut piece = 0usize;
        while body.len() < len {
            let chunk: Vec<u8> = match at {
                Body::Pieces => {
                    let mut hget = redis::cmd("HGET");
                    hget.arg(&Self::key(id)[..]).arg(format!("b{piece}"));
                    let got: Option<Vec<u8>> = query_keyed(&mut c, &hget).await.map_err(backend)?;
                    piece += 1;
                    // An empty piece would never get the body any longer.
                    match got {
                        Some(chunk) if !chunk.is_empty() && chunk.len() <= len - body.len() => {
                            chunk
                        }
                        _ => return Err(corrupt("a large body's pieces do not add up to it")),
                    }
                }
                Body::OldKey => {
                    let end = (body.len() + CHUNK).min(len);
                    let mut getrange = redis::cmd("GETRANGE");
                    getrange
                        .arg(&Self::old_body_key(id)[..])
                        .arg(body.len())
                        .arg(end - 1);
                    let chunk: Vec<u8> = query_keyed(&mut c, &getrange).await.map_err(backend)?;
                    if chunk.len() != end - body.len() {
                        return Err(corrupt("a large body is shorter than its record says"));
                    }
                    chunk
                }
            };
            body.extend_from_slice(&chunk);
        }
        Ok(body.freeze())
    }

    /// Records a response whose body is larger than [`INLINE_MAX`]: the body a piece per
    /// round trip, then the record.
    async fn record_large(
        &self,
        id: &RecordId,
        owner: &OwnerToken,
        response: &StoredResponse,
    ) -> Result<bool, StoreError> {
        let mut pieces = 0usize;
        for (i, chunk) in response.body.chunks(CHUNK).enumerate() {
            let piece = i.to_string();
            let args: [&[u8]; 2] = [piece.as_bytes(), chunk];
            if !self
                .owner_checked(&self.scripts.write_chunk, id, owner, &args, None)
                .await?
            {
                return Ok(false);
            }
            pieces = i + 1;
        }
        let status = response.status.to_string();
        let headers = response.encode_headers();
        let len = response.body.len().to_string();
        let pieces = pieces.to_string();
        let script = &self.scripts.record_large;
        let mut cmd = evalsha(script, &Self::key(id));
        cmd.arg(owner.as_str())
            .arg(status)
            .arg(&headers[..])
            .arg(len)
            .arg(pieces);
        // The record counts as written only once the replicas have it, like any record.
        let (v, acked) = self.eval(script, cmd, true).await?;
        match v {
            Value::Int(1) => {
                self.acknowledged("record", acked)?;
                Ok(true)
            }
            Value::Int(0) => Ok(false),
            _ => Err(corrupt("a large body was not all written")),
        }
    }
}

/// Where a large body is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Body {
    /// In the record's hash, as `b0`, `b1`, ...
    Pieces,
    /// In the previous version's string `idemgate:{<id>}:body`.
    OldKey,
}

/// Bodies up to this size are kept inline in the record, and come back with the claim.
const INLINE_MAX: usize = 256 * 1024;
/// Larger ones are written and read in pieces of this size, one round trip each.
const CHUNK: usize = super::RECORD_PIECE;
const OLD_BODY_SUFFIX: &[u8] = b":body";

/// Lowercase hex of 32 bytes (a record id, a fingerprint), without allocating.
fn hex64(bytes: &[u8; 32]) -> [u8; 64] {
    let mut out = [0u8; 64];
    // The buffer is exactly twice the input's length, the only way encoding can fail.
    let _ = hex::encode_to_slice(bytes, &mut out);
    out
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
    let tls = super::redis_link::tls_failure(e)
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

const KEY_PREFIX: &[u8] = b"idemgate:{";
const KEY_LEN: usize = KEY_PREFIX.len() + 64 + 1;

/// One `name:value` line of an `INFO` reply.
fn info_field(info: &str, name: &str) -> Option<String> {
    info.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .map(|v| v.trim().to_string())
}

fn backend(e: redis::RedisError) -> StoreError {
    if e.code() == Some("OOM") {
        return StoreError::Full(e.to_string());
    }
    // A certificate refused at run time (a server restarted with an expired one): said
    // as such, in rustls' words, as at start-up.
    if super::redis_link::tls_failure(&e) {
        return StoreError::Backend(format!("Redis TLS failed: {e}"));
    }
    StoreError::Backend(e.to_string())
}

fn corrupt(what: &str) -> StoreError {
    StoreError::Corrupt(what.to_string())
}

fn bytes_of(v: &Value) -> Option<Bytes> {
    match v {
        Value::BulkString(b) => Some(Bytes::copy_from_slice(b)),
        Value::SimpleString(s) => Some(Bytes::copy_from_slice(s.as_bytes())),
        Value::Int(i) => Some(Bytes::from(i.to_string())),
        _ => None,
    }
}

fn text_of(v: &Value) -> Option<String> {
    bytes_of(v).and_then(|b| String::from_utf8(b.to_vec()).ok())
}

/// A claim's reply: what it found, or a completed record whose large body is still to read.
enum Parsed {
    Claim(Claim),
    Large {
        status: u16,
        headers: Vec<(String, Bytes)>,
        at: Body,
        len: usize,
    },
}

fn parse_claim(v: Value) -> Result<Parsed, StoreError> {
    let Value::Array(items) = v else {
        return Err(corrupt("claim reply is not an array"));
    };
    let tag = items.first().and_then(text_of).unwrap_or_default();
    let at = match tag.as_str() {
        "completed_pieces" => Some(Body::Pieces),
        "completed_large" => Some(Body::OldKey),
        _ => None,
    };
    if let Some(at) = at {
        let status: u16 = items
            .get(1)
            .and_then(text_of)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| corrupt("status"))?;
        let headers = items
            .get(2)
            .and_then(bytes_of)
            .and_then(|b| StoredResponse::decode_headers(&b))
            .ok_or_else(|| corrupt("headers"))?;
        let len = items
            .get(3)
            .and_then(text_of)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| corrupt("body length"))?;
        return Ok(Parsed::Large {
            status,
            headers,
            at,
            len,
        });
    }
    parse_claim_tag(&tag, items).map(Parsed::Claim)
}

fn parse_claim_tag(tag: &str, items: Vec<Value>) -> Result<Claim, StoreError> {
    match tag {
        "claimed" => Ok(Claim::Claimed),
        "mismatch" => Ok(Claim::Mismatch),
        "not_kept" => items
            .get(1)
            .and_then(text_of)
            .and_then(|s| s.parse().ok())
            .map(|status| Claim::NotKept { status })
            .ok_or_else(|| corrupt("status")),
        "unknown" => Ok(Claim::Unknown),
        "withdrawn" => Ok(Claim::Withdrawn),
        "version" => items
            .get(1)
            .and_then(text_of)
            .and_then(|s| s.parse().ok())
            .map(Claim::OtherVersion)
            .ok_or_else(|| corrupt("fingerprint version")),
        "in_progress" => {
            let ms: u64 = items
                .get(1)
                .and_then(text_of)
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| corrupt("lease left"))?;
            Ok(Claim::InFlight {
                lease_left: Duration::from_millis(ms),
            })
        }
        "completed" => {
            let status: u16 = items
                .get(1)
                .and_then(text_of)
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| corrupt("status"))?;
            let headers = items
                .get(2)
                .and_then(bytes_of)
                .and_then(|b| StoredResponse::decode_headers(&b))
                .ok_or_else(|| corrupt("headers"))?;
            let body = items
                .get(3)
                .and_then(bytes_of)
                .ok_or_else(|| corrupt("body"))?;
            Ok(Claim::Replay(StoredResponse {
                status,
                headers,
                body,
            }))
        }
        other => Err(corrupt(&format!("claim reply tag {other:?}"))),
    }
}

impl Store for RedisStore {
    fn claim<'a>(&'a self, req: &'a ClaimRequest) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(async move {
            let mut cmd = evalsha(&self.scripts.claim, &Self::key(&req.id));
            cmd.arg(&hex64(&req.fingerprint.0)[..])
                .arg(req.fingerprint_version)
                .arg(req.owner.as_str())
                .arg(req.lease.as_millis() as u64)
                .arg(req.retention.as_millis() as u64)
                .arg(req.busy_for.as_millis() as u64);
            let (v, acked) = self.eval(&self.scripts.claim, cmd, true).await?;
            let claim = match parse_claim(v)? {
                Parsed::Claim(c) => c,
                Parsed::Large {
                    status,
                    headers,
                    at,
                    len,
                } => {
                    let body = self.read_large(&req.id, at, len).await?;
                    Claim::Replay(StoredResponse {
                        status,
                        headers,
                        body,
                    })
                }
            };
            if claim == Claim::Claimed {
                if let Err(e) = self.acknowledged("claim", acked) {
                    // Not forwarded, so not kept: a retry must be able to execute. Should
                    // this release be lost too, the claim reads as unknown once its lease
                    // runs out (409, never a second execution).
                    let _ = self.release(&req.id, &req.owner, req.lease).await;
                    return Err(e);
                }
            }
            Ok(claim)
        })
    }

    fn record<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        response: &'a StoredResponse,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            if response.body.len() > INLINE_MAX {
                return self.record_large(id, owner, response).await;
            }
            let status = response.status.to_string();
            let headers = response.encode_headers();
            let args: [&[u8]; 3] = [status.as_bytes(), &headers, &response.body];
            self.owner_checked(&self.scripts.record, id, owner, &args, Some("record"))
                .await
        })
    }

    fn shorten<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        retain: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let ms = retain.as_millis().max(1).to_string();
            let args: [&[u8]; 1] = [ms.as_bytes()];
            self.owner_checked(&self.scripts.shorten, id, owner, &args, None)
                .await
        })
    }

    fn record_not_kept<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        status: u16,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let status = status.to_string();
            let args: [&[u8]; 1] = [status.as_bytes()];
            self.owner_checked(
                &self.scripts.record_not_kept,
                id,
                owner,
                &args,
                Some("record"),
            )
            .await
        })
    }

    fn renew<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        lease: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let lease_ms = lease.as_millis().to_string();
            self.owner_checked(&self.scripts.renew, id, owner, &[lease_ms.as_bytes()], None)
                .await
        })
    }

    fn mark_unknown<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(self.owner_checked(&self.scripts.mark_unknown, id, owner, &[], None))
    }

    fn release<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        linger: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let script = &self.scripts.release;
            let mut cmd = evalsha(script, &Self::key(id));
            cmd.arg(owner.as_str())
                // At least a millisecond: PEXPIRE 0 would delete the note at once.
                .arg((linger.as_millis() as u64).max(1));
            match self.eval(script, cmd, false).await? {
                (Value::Int(n), _) => Ok(n == 1),
                _ => Err(corrupt("release reply")),
            }
        })
    }

    fn inspect<'a>(
        &'a self,
        id: &'a RecordId,
        with_body: bool,
    ) -> BoxFuture<'a, Result<Option<RecordView>, StoreError>> {
        Box::pin(async move {
            let script = &self.scripts.inspect;
            let mut cmd = evalsha(script, &Self::key(id));
            cmd.arg(if with_body { "1" } else { "0" });
            let (v, _) = self.eval(script, cmd, false).await?;
            let items = match v {
                Value::Nil => return Ok(None),
                Value::Array(items) => items,
                _ => return Err(corrupt("inspect reply")),
            };
            let text = |i: usize| items.get(i).and_then(text_of).unwrap_or_default();
            let num = |i: usize| text(i).parse::<i64>().ok();
            let now = num(6).unwrap_or(0);
            let lease_until = num(3);
            let busy_until = num(9);
            let st = text(0);
            let state = match st.as_str() {
                "c" | "n" => RecordState::Completed,
                "p" if lease_until.is_some_and(|l| l > now) => RecordState::InProgress,
                _ => RecordState::Unknown,
            };
            Ok(Some(RecordView {
                id: id.to_string(),
                state,
                created_ms: num(4).unwrap_or(0).max(0) as u64,
                lease_left_ms: match state {
                    RecordState::InProgress => lease_until.map(|l| (l - now).max(0) as u64),
                    _ => None,
                },
                ttl_ms: num(7).filter(|t| *t >= 0).map(|t| t as u64),
                owner_busy_ms: match text(0).as_str() {
                    "p" => busy_until.filter(|b| *b > now).map(|b| (b - now) as u64),
                    _ => None,
                },
                fingerprint: text(1),
                fingerprint_version: text(2).parse().unwrap_or(0),
                status: text(5).parse().ok(),
                body_kept: (state == RecordState::Completed).then_some(st == "c"),
                body: match (with_body, items.get(8).and_then(bytes_of)) {
                    (false, _) => None,
                    (true, Some(b)) => Some(String::from_utf8_lossy(&b).into_owned()),
                    // A large body: read a piece at a time, as a replay reads it.
                    (true, None) => {
                        let large = match (num(10), num(11)) {
                            (Some(len), _) => Some((Body::Pieces, len)),
                            (None, Some(len)) => Some((Body::OldKey, len)),
                            _ => None,
                        };
                        match large {
                            Some((at, len)) => {
                                let len = usize::try_from(len)
                                    .map_err(|_| corrupt("a large body's length"))?;
                                let b = self.read_large(id, at, len).await?;
                                Some(String::from_utf8_lossy(&b).into_owned())
                            }
                            None => None,
                        }
                    }
                },
            }))
        })
    }

    fn delete<'a>(
        &'a self,
        id: &'a RecordId,
        force: bool,
    ) -> BoxFuture<'a, Result<Deleted, StoreError>> {
        Box::pin(async move {
            let script = &self.scripts.delete;
            let mut cmd = evalsha(script, &Self::key(id));
            cmd.arg(if force { "1" } else { "0" });
            let n = match self.eval(script, cmd, false).await? {
                (Value::Int(n), _) => n,
                _ => return Err(corrupt("delete reply")),
            };
            if n == 4 {
                // Written by the previous version, whose large bodies had a key of their
                // own. Not in the script, which names the record alone (see the module's
                // comment); should this fail, the body expires a minute after the record
                // would have, and nothing reads it in the meantime.
                let mut del = redis::cmd("DEL");
                del.arg(&Self::old_body_key(id)[..]);
                let _: Result<i64, _> = query_keyed(&mut self.conn.clone(), &del).await;
            }
            match n {
                1 | 4 => Ok(Deleted::Deleted),
                0 => Ok(Deleted::NotFound),
                2 => Ok(Deleted::OwnerBusy),
                _ => Err(corrupt("delete reply")),
            }
        })
    }

    fn complete<'a>(
        &'a self,
        id: &'a RecordId,
        response: &'a StoredResponse,
        force: bool,
    ) -> BoxFuture<'a, Result<Completed, StoreError>> {
        Box::pin(async move {
            let script = &self.scripts.complete;
            let mut cmd = evalsha(script, &Self::key(id));
            cmd.arg(if force { "1" } else { "0" })
                .arg(response.status.to_string())
                .arg(response.encode_headers())
                .arg(&response.body[..]);
            // Waits for replicas like a record: a completion lost in a failover would leave
            // the record `unknown` again.
            let (v, acked) = self.eval(script, cmd, true).await?;
            let n = match v {
                Value::Int(n) => n,
                _ => return Err(corrupt("complete reply")),
            };
            if n == 1 {
                self.acknowledged("completion", acked)?;
            }
            match n {
                1 => Ok(Completed::Completed),
                0 => Ok(Completed::NotFound),
                2 => Ok(Completed::OwnerBusy),
                3 => Ok(Completed::AlreadyCompleted),
                _ => Err(corrupt("complete reply")),
            }
        })
    }

    fn list<'a>(
        &'a self,
        state: Option<RecordState>,
        cursor: &'a str,
        count: usize,
    ) -> BoxFuture<'a, Result<Page, StoreError>> {
        Box::pin(async move {
            // SCAN, never KEYS: each call costs Redis about `count` keys' work, and a
            // record that exists for the whole walk is returned at least once.
            // A cluster's keys are spread over its primaries, each with its own SCAN
            // cursor; a walk over one of them would look complete and miss the others.
            if self.conn.is_cluster() {
                return Err(StoreError::Backend(
                    "listing records is not available on Redis Cluster: look records up one \
                     by one (POST /records/lookup, GET /records/{id})"
                        .into(),
                ));
            }
            let start = if cursor.is_empty() { "0" } else { cursor };
            if !start.bytes().all(|b| b.is_ascii_digit()) {
                return Err(corrupt("not a cursor of this store"));
            }
            let mut c = self.conn.clone();
            let (next, keys): (String, Vec<Vec<u8>>) = redis::cmd("SCAN")
                .arg(start)
                .arg("MATCH")
                .arg("idemgate:{*}")
                .arg("COUNT")
                .arg(count.max(1))
                .arg("TYPE")
                .arg("hash")
                .query_async(&mut c)
                .await
                .map_err(backend)?;
            let mut records = Vec::new();
            for key in keys {
                let Some(id) = key
                    .strip_prefix(KEY_PREFIX)
                    .and_then(|k| k.strip_suffix(b"}"))
                    .and_then(|hex| std::str::from_utf8(hex).ok())
                    .and_then(RecordId::from_hex)
                else {
                    continue;
                };
                // Gone since the scan saw it: nothing to show.
                let Some(view) = self.inspect(&id, false).await? else {
                    continue;
                };
                if state.is_none_or(|s| s == view.state) {
                    records.push(view);
                }
            }
            Ok(Page {
                records,
                cursor: (next != "0").then_some(next),
            })
        })
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let mut c = self.conn.clone();
            let _: String = redis::cmd("PING")
                .query_async(&mut c)
                .await
                .map_err(backend)?;
            Ok(())
        })
    }

    fn kind(&self) -> &'static str {
        "redis"
    }

    fn can_list(&self) -> bool {
        !self.conn.is_cluster()
    }

    fn meta<'a>(
        &'a self,
        name: &'a str,
        offer: Option<&'a str>,
    ) -> BoxFuture<'a, Result<Meta, StoreError>> {
        Box::pin(async move {
            if self.conn.is_cluster() {
                return self.cluster_meta(name, offer).await;
            }
            let key = meta_key(name);
            let mut c = self.conn.clone();
            // SET NX, then GET: whichever instance came first, every instance reads the one
            // value that won. Two commands rather than `SET NX GET`, which Redis before
            // 7.0 refuses; this runs at start-up and every `scope_secret_check_interval`.
            let created = match offer {
                Some(v) => meta_set_if_absent(&mut c, &key, v).await?,
                None => false,
            };
            let value = meta_get(&mut c, &key).await?;
            // Every record id hangs on the secret: one lost in a failover would orphan every
            // record. With replica acknowledgement on, it must be on the replicas too.
            // A replica that has only just finished its first sync can let a WAIT run out
            // although it is online (seen with Redis 7.0: 0 of 1 within 200 ms, three times
            // in ten, right after the primary listed it as online). Start-up is in no hurry:
            // the acknowledgement gets `SECRET_ACK_TRIES` tries before idemgate gives up.
            if offer.is_some() {
                self.meta_acknowledged(&mut c).await?;
            }
            Ok(Meta { value, created })
        })
    }

    fn server_stats(&self) -> BoxFuture<'_, Result<Option<ServerStats>, StoreError>> {
        Box::pin(async move {
            // The default sections hold all four fields; `all` would add per-command ones.
            // A cluster's primaries are read as one server: a restart of any changes the
            // run id, evictions add up, the youngest uptime and any evicting policy show.
            let infos = self.info_all("default").await?;
            let number = |info: &str, name: &str| {
                info_field(info, name)
                    .and_then(|v| v.parse::<u64>().ok())
                    .ok_or_else(|| corrupt(&format!("INFO without {name}")))
            };
            let mut run_ids = Vec::new();
            let (mut uptime, mut evicted) = (u64::MAX, 0u64);
            let mut policy = String::new();
            for info in &infos {
                run_ids.push(
                    info_field(info, "run_id").ok_or_else(|| corrupt("INFO without run_id"))?,
                );
                uptime = uptime.min(number(info, "uptime_in_seconds")?);
                evicted += number(info, "evicted_keys")?;
                let p = info_field(info, "maxmemory_policy").unwrap_or_default();
                if policy.is_empty() || p != "noeviction" {
                    policy = p;
                }
            }
            run_ids.sort();
            Ok(Some(ServerStats {
                run_id: run_ids.join(","),
                uptime_secs: uptime,
                evicted_keys: evicted,
                maxmemory_policy: policy,
            }))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fingerprint::Fingerprint;
    use crate::scope::{ScopeSecret, Scoper, Tenant};
    use hyper::header::HeaderValue;

    #[test]
    fn keys_and_fingerprints_are_written_as_before() {
        // Records already in Redis are found under this exact form after an upgrade.
        let mut headers = hyper::HeaderMap::new();
        headers.insert("idempotency-key", HeaderValue::from_static("k-1"));
        let key = crate::key::parse(&headers, 255)
            .ok()
            .flatten()
            .expect("a valid key");
        let scoper = Scoper::new(&ScopeSecret::random(), "payments");
        let id = scoper.record_id(&Tenant::anonymous(), "POST", "/v1/transfers", &key);
        let written = RedisStore::key(&id);
        let expected = format!("idemgate:{{{id}}}");
        assert_eq!(std::str::from_utf8(&written).ok(), Some(expected.as_str()));
        let fp = Fingerprint([0xa5; 32]);
        let hex = fp.to_hex();
        assert_eq!(std::str::from_utf8(&hex64(&fp.0)).ok(), Some(hex.as_str()));
    }

    /// A redis-server of this test's own on a free port, killed on drop.
    struct Server(std::process::Child, u16);

    impl Server {
        fn start() -> Option<Server> {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .ok()?
                .local_addr()
                .ok()?
                .port();
            let child = std::process::Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no"])
                .stdout(std::process::Stdio::null())
                .spawn()
                .ok()?;
            let server = Server(child, port);
            for _ in 0..300 {
                if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                    return Some(server);
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            None
        }
    }

    impl Drop for Server {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    // The previous version's scripts for a large body and a withdrawal (notes and bodies
    // in keys beside the record), as it runs them during a rolling upgrade.
    const PREVIOUS_CLAIM: &str = r#"
local function now_ms() local t = redis.call('TIME') return t[1] * 1000 + math.floor(t[2] / 1000) end
local r = redis.call('HMGET', KEYS[1], 'st', 'fp', 'fv', 'sc', 'hd', 'bd')
if not r[1] then
  if redis.call('SISMEMBER', KEYS[2], ARGV[3]) == 1 then return {'withdrawn'} end
  local now = now_ms()
  redis.call('HSET', KEYS[1], 'st', 'p', 'fp', ARGV[1], 'fv', ARGV[2], 'ow', ARGV[3],
             'lu', string.format('%d', now + ARGV[4]), 'wu', string.format('%d', now + ARGV[6]),
             'cr', string.format('%d', now))
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
  return {'claimed'}
end
return {'other'}
"#;
    const PREVIOUS_WRITE_CHUNK: &str = r#"
local r = redis.call('HMGET', KEYS[1], 'ow', 'st')
if r[1] ~= ARGV[1] or r[2] ~= 'p' then return 0 end
redis.call('SETRANGE', KEYS[2], tonumber(ARGV[2]), ARGV[3])
local ttl = redis.call('PTTL', KEYS[1])
if ttl > 0 then redis.call('PEXPIRE', KEYS[2], ttl + 60000) end
return 1
"#;
    const PREVIOUS_RECORD_LARGE: &str = r#"
if redis.call('HGET', KEYS[1], 'ow') ~= ARGV[1] then return 0 end
if redis.call('STRLEN', KEYS[2]) < tonumber(ARGV[4]) then return -1 end
redis.call('HSET', KEYS[1], 'st', 'c', 'sc', ARGV[2], 'hd', ARGV[3], 'bl', ARGV[4])
redis.call('HDEL', KEYS[1], 'lu', 'bd')
return 1
"#;

    fn request(key: &str) -> ClaimRequest {
        let mut headers = hyper::HeaderMap::new();
        headers.insert(
            "idempotency-key",
            HeaderValue::from_str(key).expect("a header value"),
        );
        let key = crate::key::parse(&headers, 255)
            .ok()
            .flatten()
            .expect("a valid key");
        let scoper = Scoper::new(&ScopeSecret::random(), "upgrade");
        ClaimRequest {
            id: scoper.record_id(&Tenant::anonymous(), "POST", "/t", &key),
            fingerprint: Fingerprint([7; 32]),
            fingerprint_version: 1,
            owner: OwnerToken::random(),
            lease: Duration::from_secs(10),
            retention: Duration::from_secs(60),
            busy_for: Duration::from_secs(10),
            answer_room: 0,
        }
    }

    fn previous_claim(con: &mut redis::Connection, req: &ClaimRequest) -> String {
        let record = RedisStore::key(&req.id);
        let mut note = record.to_vec();
        note.extend_from_slice(b":w");
        let reply: Vec<String> = redis::cmd("EVAL")
            .arg(PREVIOUS_CLAIM)
            .arg(2)
            .arg(&record[..])
            .arg(note)
            .arg(req.fingerprint.to_hex())
            .arg(req.fingerprint_version)
            .arg(req.owner.as_str())
            .arg(req.lease.as_millis() as u64)
            .arg(req.retention.as_millis() as u64)
            .arg(req.busy_for.as_millis() as u64)
            .query(con)
            .expect("the previous claim");
        reply.concat()
    }

    #[tokio::test]
    async fn records_of_the_previous_version_replay_and_its_claims_see_no_notes() {
        let server = Server::start().expect("redis-server on PATH");
        let url = format!("redis://127.0.0.1:{}", server.1);
        let store = RedisStore::connect(&url, Duration::from_secs(2), Duration::from_secs(2))
            .await
            .expect("the store");
        let mut con = redis::Client::open(url.as_str())
            .and_then(|c| c.get_connection())
            .expect("a connection");

        // A large answer recorded by the previous version: its body in `:body`.
        let old = request("old-large");
        assert_eq!(previous_claim(&mut con, &old), "claimed");
        let body: Vec<u8> = (0..(2 * CHUNK + 12_345) as u32)
            .map(|i| (i % 251) as u8)
            .collect();
        let record = RedisStore::key(&old.id);
        let old_body = RedisStore::old_body_key(&old.id);
        for (i, chunk) in body.chunks(CHUNK).enumerate() {
            let n: i64 = redis::cmd("EVAL")
                .arg(PREVIOUS_WRITE_CHUNK)
                .arg(2)
                .arg(&record[..])
                .arg(&old_body[..])
                .arg(old.owner.as_str())
                .arg(i * CHUNK)
                .arg(chunk)
                .query(&mut con)
                .expect("a previous chunk");
            assert_eq!(n, 1);
        }
        let answer = StoredResponse {
            status: 201,
            headers: vec![("x-a".into(), Bytes::from_static(b"1"))],
            body: Bytes::from(body),
        };
        let n: i64 = redis::cmd("EVAL")
            .arg(PREVIOUS_RECORD_LARGE)
            .arg(2)
            .arg(&record[..])
            .arg(&old_body[..])
            .arg(old.owner.as_str())
            .arg(answer.status)
            .arg(answer.encode_headers())
            .arg(answer.body.len())
            .query(&mut con)
            .expect("the previous record");
        assert_eq!(n, 1);
        let mut retry = old.clone();
        retry.owner = OwnerToken::random();
        assert_eq!(
            store.claim(&retry).await.expect("a claim"),
            Claim::Replay(answer.clone())
        );
        let view = store.inspect(&old.id, true).await.expect("inspect");
        let shown = view.and_then(|v| v.body).map(|b| b.len());
        assert_eq!(
            shown,
            Some(String::from_utf8_lossy(&answer.body).len()),
            "the old body shown"
        );
        // Deleted with its record.
        assert_eq!(
            store.delete(&old.id, true).await.expect("delete"),
            Deleted::Deleted
        );
        let left: i64 = redis::cmd("EXISTS")
            .arg(&record[..])
            .arg(&old_body[..])
            .query(&mut con)
            .expect("exists");
        assert_eq!(left, 0);

        // A large answer recorded here goes into the record's own hash, in pieces.
        let new = request("new-large");
        assert_eq!(store.claim(&new).await.expect("a claim"), Claim::Claimed);
        assert!(store
            .record(&new.id, &new.owner, &answer)
            .await
            .expect("record"));
        let keys: Vec<Vec<u8>> = redis::cmd("KEYS")
            .arg("idemgate:*")
            .query(&mut con)
            .expect("keys");
        assert_eq!(keys, vec![RedisStore::key(&new.id).to_vec()]);
        let mut retry = new.clone();
        retry.owner = OwnerToken::random();
        assert_eq!(
            store.claim(&retry).await.expect("a claim"),
            Claim::Replay(answer.clone())
        );

        // A withdrawal noted here is no record to the previous version's claim: it claims
        // the key as a new one, and the note stays for the owner that withdrew.
        let late = request("withdrawn");
        assert!(!store
            .release(&late.id, &late.owner, Duration::from_secs(30))
            .await
            .expect("release"));
        assert!(store
            .inspect(&late.id, false)
            .await
            .expect("inspect")
            .is_none());
        let mut other = late.clone();
        other.owner = OwnerToken::random();
        assert_eq!(previous_claim(&mut con, &other), "claimed");
        assert!(matches!(
            store.claim(&late).await.expect("a claim"),
            Claim::InFlight { .. }
        ));
        // Its owner's release keeps the note; the late claim still creates nothing.
        assert!(store
            .release(&other.id, &other.owner, Duration::from_secs(30))
            .await
            .expect("release"));
        assert_eq!(store.claim(&late).await.expect("a claim"), Claim::Withdrawn);
        assert!(store
            .inspect(&late.id, false)
            .await
            .expect("inspect")
            .is_none());
        let ttl: i64 = redis::cmd("PTTL")
            .arg(&RedisStore::key(&late.id)[..])
            .query(&mut con)
            .expect("pttl");
        assert!(ttl > 0 && ttl <= 30_000, "{ttl}");
    }
}
