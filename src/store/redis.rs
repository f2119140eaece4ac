//! The Redis store: one record = one Redis hash under `idemgate:{<record id>}` (the hash tag
//! keeps a record in one cluster slot), its time to live = the route's retention from the
//! claim. Claim, record, renew, mark-unknown and release are each one Lua script: one round
//! trip, atomic, and safe to run twice. Times come from Redis's own clock (`TIME`), so
//! several idemgate instances agree on leases whatever their clocks say.
//!
//! All calls go through one shared multiplexed [`ConnectionManager`], which reconnects by
//! itself, with explicit connect and response timeouts; callers add an outer deadline.

use std::time::Duration;

use bytes::Bytes;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Script, Value};

use super::{
    BoxFuture, Claim, ClaimRequest, Completed, Deleted, OwnerToken, Page, RecordState, RecordView,
    ServerStats, Store, StoreError, StoredResponse,
};
use crate::key::RecordId;
use crate::scope::ScopeSecret;

// Fields of a record hash: st = state (p in progress, c completed, u unknown), fp =
// fingerprint hex, fv = fingerprint version, ow = owner token, lu = lease until (ms, Redis
// clock), wu = the owner may be working until (ms, Redis clock), cr = created (ms), sc =
// status, hd = headers (StoredResponse::encode_headers), bd = body.
//
// Beside each record, `idemgate:{<record id>}:w` (same hash slot) is the set of owners that
// withdrew a claim they were not sure had landed (see `RELEASE`); it expires by itself.
const NOW_MS: &str = "local function now_ms() local t = redis.call('TIME') return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) end\n";
const NOW: &str = "local now = now_ms()\n";

// One HMGET reads everything a replay needs, and the clock is read only when a claim is
// made or a lease compared: a replay, the most frequent claim, runs one command instead of
// three (TIME, HMGET, HMGET).
const CLAIM: &str = r#"
local r = redis.call('HMGET', KEYS[1], 'st', 'fp', 'fv', 'lu', 'sc', 'hd', 'bd')
if not r[1] then
  if redis.call('SISMEMBER', KEYS[2], ARGV[3]) == 1 then return {'withdrawn'} end
  local now = now_ms()
  redis.call('HSET', KEYS[1], 'st', 'p', 'fp', ARGV[1], 'fv', ARGV[2], 'ow', ARGV[3],
             'lu', now + tonumber(ARGV[4]), 'wu', now + tonumber(ARGV[6]), 'cr', now)
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
  return {'claimed'}
end
if r[3] ~= ARGV[2] then return {'version', r[3]} end
if r[2] ~= ARGV[1] then return {'mismatch'} end
if r[1] == 'c' then return {'completed', r[5], r[6], r[7]} end
local now = now_ms()
if r[1] == 'p' and tonumber(r[4]) > now then return {'in_progress', tostring(tonumber(r[4]) - now)} end
return {'unknown'}
"#;

// Owner-checked; running it twice records the same response twice, which is harmless.
const RECORD: &str = r#"
if redis.call('HGET', KEYS[1], 'ow') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'st', 'c', 'sc', ARGV[2], 'hd', ARGV[3], 'bd', ARGV[4])
redis.call('HDEL', KEYS[1], 'lu')
return 1
"#;

const RENEW: &str = r#"
local r = redis.call('HMGET', KEYS[1], 'ow', 'st')
if r[1] ~= ARGV[1] or r[2] ~= 'p' then return 0 end
redis.call('HSET', KEYS[1], 'lu', now + tonumber(ARGV[2]))
return 1
"#;

const MARK_UNKNOWN: &str = r#"
local r = redis.call('HMGET', KEYS[1], 'ow', 'st')
if r[1] ~= ARGV[1] or r[2] == 'c' then return 0 end
redis.call('HSET', KEYS[1], 'st', 'u')
redis.call('HDEL', KEYS[1], 'lu')
return 1
"#;

// The claim may not have landed yet: down a connection that was cut, a claim can still be
// delivered after this release (which came down a new one). Remembering the withdrawal
// makes such a late claim create nothing. The set's expiry only ever grows, so one
// owner's short linger never shortens another's.
const RELEASE: &str = r#"
if redis.call('HGET', KEYS[1], 'ow') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
redis.call('SADD', KEYS[2], ARGV[1])
if redis.call('PTTL', KEYS[2]) < tonumber(ARGV[2]) then redis.call('PEXPIRE', KEYS[2], ARGV[2]) end
return 0
"#;

// An operator's release: unless forced (ARGV[1] = '1'), a record whose owner may still be
// working (lease live, or within its `wu`) is left alone. 1 deleted, 0 none, 2 busy.
const DELETE: &str = r#"
local r = redis.call('HMGET', KEYS[1], 'st', 'lu', 'wu')
if not r[1] then return 0 end
if ARGV[1] ~= '1' and r[1] == 'p' then
  local now = now_ms()
  if tonumber(r[2] or '0') > now or tonumber(r[3] or '0') > now then return 2 end
end
redis.call('DEL', KEYS[1])
return 1
"#;

// An operator's resolution of a record that never got its answer recorded: unless forced
// (ARGV[1] = '1'), a record whose owner may still be working is left alone, and a completed
// one always is. The owner is cleared, so the former owner's late RECORD is refused.
// 1 completed, 0 none, 2 busy, 3 already completed.
const COMPLETE: &str = r#"
local r = redis.call('HMGET', KEYS[1], 'st', 'lu', 'wu')
if not r[1] then return 0 end
if r[1] == 'c' then return 3 end
if ARGV[1] ~= '1' and r[1] == 'p' then
  local now = now_ms()
  if tonumber(r[2] or '0') > now or tonumber(r[3] or '0') > now then return 2 end
end
redis.call('HSET', KEYS[1], 'st', 'c', 'ow', '', 'sc', ARGV[2], 'hd', ARGV[3], 'bd', ARGV[4])
redis.call('HDEL', KEYS[1], 'lu')
return 1
"#;

const INSPECT: &str = r#"
local r = redis.call('HMGET', KEYS[1], 'st', 'fp', 'fv', 'lu', 'cr', 'sc', 'wu')
if not r[1] then return false end
local body = false
if ARGV[1] == '1' then body = redis.call('HGET', KEYS[1], 'bd') end
return {r[1], r[2], r[3], r[4] or '', r[5], r[6] or '', tostring(now), tostring(redis.call('PTTL', KEYS[1])), body, r[7] or ''}
"#;

/// Where the record-id secret lives: outside any record's hash tag, read once at start-up.
/// It must outlive every record (it does: it has no TTL, and idemgate refuses a Redis that
/// evicts); losing it orphans every record, exactly like losing the records themselves.
pub const SECRET_KEY: &str = "idemgate:scope-secret";

/// The Redis store.
#[derive(Clone)]
pub struct RedisStore {
    conn: ConnectionManager,
    scripts: std::sync::Arc<Scripts>,
}

struct Scripts {
    claim: Script,
    record: Script,
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
    /// redis-rs is given no response timeout of its own: every call made afterwards already
    /// runs under its caller's deadline (`store_timeout`, or the lease renewal's), and a
    /// second timer per call costs instructions and, when idemgate is idle, wakes tokio's
    /// driver through its eventfd (a `write` and a spurious `epoll_wait` more per Redis
    /// call; the README's Performance section has the figures). A timed-out call is dropped;
    /// a late answer to it is read and discarded by the connection, as before.
    pub async fn connect(
        url: &str,
        connect_timeout: Duration,
        response_timeout: Duration,
    ) -> Result<RedisStore, StoreError> {
        let client = redis::Client::open(url).map_err(backend)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(connect_timeout))
            .set_response_timeout(None)
            // Reconnection happens in the background; a request that finds the connection
            // down fails at once (503) rather than waiting through a retry ladder.
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_secs(1));
        let conn = super::deadline(connect_timeout + response_timeout, async {
            ConnectionManager::new_with_config(client, config)
                .await
                .map_err(backend)
        })
        .await?;
        let scripts = Scripts {
            claim: Script::new(&format!("{NOW_MS}{CLAIM}")),
            record: Script::new(RECORD),
            renew: Script::new(&format!("{NOW_MS}{NOW}{RENEW}")),
            mark_unknown: Script::new(MARK_UNKNOWN),
            release: Script::new(RELEASE),
            delete: Script::new(&format!("{NOW_MS}{DELETE}")),
            inspect: Script::new(&format!("{NOW_MS}{NOW}{INSPECT}")),
            complete: Script::new(&format!("{NOW_MS}{COMPLETE}")),
        };
        let store = RedisStore {
            conn,
            scripts: std::sync::Arc::new(scripts),
        };
        // Loading now keeps the first requests at one round trip (EVALSHA hits). After a
        // Redis restart the scripts are gone; redis-rs then falls back to EVAL once.
        let mut c = store.conn.clone();
        for s in [
            &store.scripts.claim,
            &store.scripts.record,
            &store.scripts.renew,
            &store.scripts.mark_unknown,
            &store.scripts.release,
            &store.scripts.delete,
            &store.scripts.inspect,
            &store.scripts.complete,
        ] {
            let load = async { s.prepare_invoke().load_async(&mut c).await.map_err(backend) };
            let _: String = super::deadline(response_timeout, load).await?;
        }
        Ok(store)
    }

    /// Reads `INFO` for the start-up checks.
    pub async fn server_info(&self) -> Result<ServerInfo, StoreError> {
        let info = self.info("all").await?;
        let field = |name: &str| info_field(&info, name);
        Ok(ServerInfo {
            maxmemory_policy: field("maxmemory_policy").unwrap_or_default(),
            aof_enabled: field("aof_enabled").as_deref() == Some("1"),
            version: field("redis_version").unwrap_or_default(),
        })
    }

    async fn info(&self, section: &str) -> Result<String, StoreError> {
        let mut c = self.conn.clone();
        redis::cmd("INFO")
            .arg(section)
            .query_async(&mut c)
            .await
            .map_err(backend)
    }

    /// Runs one of the owner-checked scripts: KEYS[1] = the record, ARGV[1] = the owner,
    /// then `args`. It answers 1 when it applied, 0 when the record is not (or no longer)
    /// the owner's.
    async fn owner_checked(
        &self,
        script: &Script,
        id: &RecordId,
        owner: &OwnerToken,
        args: &[&[u8]],
    ) -> Result<bool, StoreError> {
        let mut invocation = script.key(&Self::key(id)[..]);
        invocation.arg(owner.as_str());
        for arg in args {
            invocation.arg(*arg);
        }
        let mut c = self.conn.clone();
        let n: i64 = invocation.invoke_async(&mut c).await.map_err(backend)?;
        Ok(n == 1)
    }

    /// `idemgate:{<id>}:w`: the owners that withdrew a claim on `id` (see `RELEASE`).
    fn withdrawn_key(id: &RecordId) -> [u8; KEY_LEN + 2] {
        let mut key = [0u8; KEY_LEN + 2];
        key[..KEY_LEN].copy_from_slice(&Self::key(id));
        key[KEY_LEN..].copy_from_slice(b":w");
        key
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
}

/// Lowercase hex of 32 bytes (a record id, a fingerprint), without allocating.
fn hex64(bytes: &[u8; 32]) -> [u8; 64] {
    let mut out = [0u8; 64];
    // The buffer is exactly twice the input's length, the only way encoding can fail.
    let _ = hex::encode_to_slice(bytes, &mut out);
    out
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

fn parse_claim(v: Value) -> Result<Claim, StoreError> {
    let Value::Array(items) = v else {
        return Err(corrupt("claim reply is not an array"));
    };
    let tag = items.first().and_then(text_of).unwrap_or_default();
    match tag.as_str() {
        "claimed" => Ok(Claim::Claimed),
        "mismatch" => Ok(Claim::Mismatch),
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
            let mut c = self.conn.clone();
            let v: Value = self
                .scripts
                .claim
                .key(&Self::key(&req.id)[..])
                .key(&Self::withdrawn_key(&req.id)[..])
                .arg(&hex64(&req.fingerprint.0)[..])
                .arg(req.fingerprint_version)
                .arg(req.owner.as_str())
                .arg(req.lease.as_millis() as u64)
                .arg(req.retention.as_millis() as u64)
                .arg(req.busy_for.as_millis() as u64)
                .invoke_async(&mut c)
                .await
                .map_err(backend)?;
            parse_claim(v)
        })
    }

    fn record<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        response: &'a StoredResponse,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let status = response.status.to_string();
            let headers = response.encode_headers();
            let args: [&[u8]; 3] = [status.as_bytes(), &headers, &response.body];
            self.owner_checked(&self.scripts.record, id, owner, &args)
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
            self.owner_checked(&self.scripts.renew, id, owner, &[lease_ms.as_bytes()])
                .await
        })
    }

    fn mark_unknown<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(self.owner_checked(&self.scripts.mark_unknown, id, owner, &[]))
    }

    fn release<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        linger: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let mut c = self.conn.clone();
            let n: i64 = self
                .scripts
                .release
                .key(&Self::key(id)[..])
                .key(&Self::withdrawn_key(id)[..])
                .arg(owner.as_str())
                // At least a millisecond: PEXPIRE 0 would delete the note at once.
                .arg((linger.as_millis() as u64).max(1))
                .invoke_async(&mut c)
                .await
                .map_err(backend)?;
            Ok(n == 1)
        })
    }

    fn inspect<'a>(
        &'a self,
        id: &'a RecordId,
        with_body: bool,
    ) -> BoxFuture<'a, Result<Option<RecordView>, StoreError>> {
        Box::pin(async move {
            let mut c = self.conn.clone();
            let v: Value = self
                .scripts
                .inspect
                .key(&Self::key(id)[..])
                .arg(if with_body { "1" } else { "0" })
                .invoke_async(&mut c)
                .await
                .map_err(backend)?;
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
            let state = match text(0).as_str() {
                "c" => RecordState::Completed,
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
                body: if with_body {
                    items
                        .get(8)
                        .and_then(bytes_of)
                        .map(|b| String::from_utf8_lossy(&b).into_owned())
                } else {
                    None
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
            let mut c = self.conn.clone();
            let n: i64 = self
                .scripts
                .delete
                .key(&Self::key(id)[..])
                .arg(if force { "1" } else { "0" })
                .invoke_async(&mut c)
                .await
                .map_err(backend)?;
            match n {
                1 => Ok(Deleted::Deleted),
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
            let mut c = self.conn.clone();
            let n: i64 = self
                .scripts
                .complete
                .key(&Self::key(id)[..])
                .arg(if force { "1" } else { "0" })
                .arg(response.status.to_string())
                .arg(response.encode_headers())
                .arg(&response.body[..])
                .invoke_async(&mut c)
                .await
                .map_err(backend)?;
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

    fn scope_secret(&self) -> BoxFuture<'_, Result<ScopeSecret, StoreError>> {
        Box::pin(async move {
            let mut c = self.conn.clone();
            // SET NX, then GET: whichever instance came first, every instance reads the one
            // secret that won. Two commands rather than `SET NX GET`, which Redis before
            // 7.0 refuses; this runs once, at start-up.
            let _: Value = redis::cmd("SET")
                .arg(SECRET_KEY)
                .arg(ScopeSecret::random().to_hex())
                .arg("NX")
                .query_async(&mut c)
                .await
                .map_err(backend)?;
            let stored: Option<String> = redis::cmd("GET")
                .arg(SECRET_KEY)
                .query_async(&mut c)
                .await
                .map_err(backend)?;
            stored
                .as_deref()
                .and_then(ScopeSecret::from_hex)
                .ok_or_else(|| corrupt(&format!("{SECRET_KEY} is not a 64-digit hex secret")))
        })
    }

    fn server_stats(&self) -> BoxFuture<'_, Result<Option<ServerStats>, StoreError>> {
        Box::pin(async move {
            // The default sections hold all four fields; `all` would add per-command ones.
            let info = self.info("default").await?;
            let number = |info: &str, name: &str| {
                info_field(info, name)
                    .and_then(|v| v.parse::<u64>().ok())
                    .ok_or_else(|| corrupt(&format!("INFO without {name}")))
            };
            Ok(Some(ServerStats {
                run_id: info_field(&info, "run_id")
                    .ok_or_else(|| corrupt("INFO without run_id"))?,
                uptime_secs: number(&info, "uptime_in_seconds")?,
                evicted_keys: number(&info, "evicted_keys")?,
                maxmemory_policy: info_field(&info, "maxmemory_policy").unwrap_or_default(),
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
}
