//! The Lua scripts, one per call, and the record hash they work on.

use super::*;

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
pub(super) const NOW_MS: &str = "local function now_ms() local t = redis.call('TIME') return t[1] * 1000 + math.floor(t[2] / 1000) end\n";
pub(super) const NOW: &str = "local now = now_ms()\n";

// Removes the pieces of a large body (`b0`, `b1`, ...), however many were written. Only on
// the rare paths that give a body up: the common ones know the record has none.
pub(super) const DROP_PIECES: &str = r#"
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
pub(super) const DROP_RECORD: &str = r#"
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

// Reading a value record (layout in `value.rs`): a number in columns a..b.
pub(super) const V_NUM: &str =
    "local function v_num(v, a, b) return tonumber(string.sub(v, a, b)) end\n";

// A claim that found a value record: what it holds for this claim, as CLAIM answers for
// a hash. A lease is live while the key's PTTL is above the lease mark.
pub(super) const CLAIM_VALUE: &str = r#"
local function claim_value(k)
  local v = redis.call('GET', k)
  if v_num(v, 99, 103) ~= tonumber(ARGV[2]) then return {'version', tostring(v_num(v, 99, 103))} end
  if string.sub(v, 35, 98) ~= ARGV[1] then return {'mismatch'} end
  local st = string.sub(v, 1, 1)
  if st == 'c' then
    local hl = v_num(v, 146, 153)
    local sc = tostring(v_num(v, 143, 145))
    local n = #v - 153 - hl
    if n > tonumber(ARGV[7]) then return {'completed_value', sc, string.sub(v, 154, 153 + hl), n} end
    return {'completed', sc, string.sub(v, 154, 153 + hl), string.sub(v, 154 + hl)}
  end
  if st == 'n' then return {'not_kept', tostring(v_num(v, 143, 145))} end
  if st == 'p' then
    local left = redis.call('PTTL', k) - v_num(v, 117, 129)
    if left > 0 then return {'in_progress', string.format('%d', left)} end
  end
  return {'unknown'}
end
"#;

// The hash a value record stands for, written in its place with the same expiry: `cr`,
// `lu` and `wu` on Redis's clock from the key's PTTL and the value's marks. For the
// scripts that write what a value does not hold (withdrawal notes, pieces of a large
// body, an operator's answer), which then go on as on a hash.
pub(super) const AS_HASH: &str = r#"
local function as_hash(k, v)
  local ttl = redis.call('PTTL', k)
  local now = now_ms()
  local left = ttl
  if left < 0 then left = 0 end
  local st = string.sub(v, 1, 1)
  local f = {'st', st, 'fp', string.sub(v, 35, 98), 'fv', tostring(v_num(v, 99, 103)),
             'ow', string.sub(v, 3, 34),
             'cr', string.format('%d', now - (v_num(v, 104, 116) - left)),
             'wu', string.format('%d', now + left - v_num(v, 130, 142))}
  if st == 'p' then
    f[#f + 1] = 'lu'
    f[#f + 1] = string.format('%d', now + left - v_num(v, 117, 129))
  end
  if st == 'c' or st == 'n' then
    f[#f + 1] = 'sc'
    f[#f + 1] = tostring(v_num(v, 143, 145))
  end
  if st == 'c' then
    local hl = v_num(v, 146, 153)
    f[#f + 1] = 'hd'
    f[#f + 1] = string.sub(v, 154, 153 + hl)
    f[#f + 1] = 'bd'
    f[#f + 1] = string.sub(v, 154 + hl)
  end
  redis.call('DEL', k)
  redis.call('HSET', k, unpack(f))
  if ttl > 0 then redis.call('PEXPIRE', k, ttl) end
end
"#;

// Put before a hash script that must also work on a value record: the value becomes its
// hash first.
pub(super) const HASH_FIRST: &str = "local cv = redis.pcall('GET', KEYS[1])\nif type(cv) == 'string' then as_hash(KEYS[1], cv) end\n";

// One HMGET reads everything a replay needs and this owner's withdrawal note (and no more:
// `lu`, needed only while in progress, and `bp`/`bl`, only for a large body, are read when
// needed), and the clock is read only when a claim is made or a lease compared: a replay,
// the most frequent claim, runs one command, and so does a new key before it writes. A
// claim over other owners' notes sets the route's retention as the key's expiry, which
// outlasts them: a note lingers for the retention of the claim it withdrew. An inline
// body longer than ARGV[7] (the room its claimant took for it before asking) comes back
// as its length alone: the claimant takes room for it, then reads it (`bd`) on its own.
//
// A value record (see `value.rs`) makes HMGET fail (`WRONGTYPE`): it is read as such. With
// ARGV[8] (a value-form instance, whose bare claim could not decide), a key that does not
// exist at all is created as that value; a hash of withdrawal notes stays a hash.
pub(super) const CLAIM: &str = r#"
local r = redis.pcall('HMGET', KEYS[1], 'st', 'fp', 'fv', 'sc', 'hd', 'bd', 'w:' .. ARGV[3])
if r.err then return claim_value(KEYS[1]) end
if not r[1] then
  local now = now_ms()
  if r[7] and tonumber(r[7]) > now then return {'withdrawn'} end
  if ARGV[8] and redis.call('EXISTS', KEYS[1]) == 0 then
    redis.call('SET', KEYS[1], ARGV[8], 'PX', ARGV[5])
    return 'claimed'
  end
  redis.call('HSET', KEYS[1], 'st', 'p', 'fp', ARGV[1], 'fv', ARGV[2], 'ow', ARGV[3],
             'lu', string.format('%d', now + ARGV[4]), 'wu', string.format('%d', now + ARGV[6]),
             'cr', string.format('%d', now))
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
  return 'claimed'
end
if r[3] ~= ARGV[2] then return {'version', r[3]} end
if r[2] ~= ARGV[1] then return {'mismatch'} end
if r[1] == 'c' and r[6] then
  if #r[6] > tonumber(ARGV[7]) then return {'completed_inline', r[4], r[5], #r[6]} end
  return {'completed', r[4], r[5], r[6]}
end
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
pub(super) const RECORD: &str = r#"
if redis.call('HGET', KEYS[1], 'ow') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'st', 'c', 'sc', ARGV[2], 'hd', ARGV[3], 'bd', ARGV[4])
return 1
"#;

// RECORD of a value-form instance, on a value: its fixed part with the state made `c`, then
// the answer (ARGV[2]: status and headers' length as the value keeps them, the headers, the
// body), in one `SET ... KEEPTTL`. A hash at the key fails it (`WRONGTYPE`, nothing
// written): the caller runs RECORD then. The cheapest owner-fenced write found: two
// commands and two arguments (`bench/redis_scripts`).
pub(super) const RECORD_VALUE: &str = r#"
local v = redis.call('GET', KEYS[1])
if not v or string.sub(v, 3, 34) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], 'c' .. string.sub(v, 2, 142) .. ARGV[2], 'KEEPTTL')
return 1
"#;

// As RECORD, for an answer too large to keep (or that found Redis out of memory, maybe
// after some pieces of it were written): the status alone. The pieces go first, so that
// the memory they held is free for the rest.
pub(super) const RECORD_NOT_KEPT: &str = r#"
local v = redis.pcall('GET', KEYS[1])
if type(v) == 'string' then
  if string.sub(v, 3, 34) ~= ARGV[1] then return 0 end
  redis.call('SET', KEYS[1], 'n' .. string.sub(v, 2, 142) .. ARGV[3], 'KEEPTTL')
  return 1
end
if not v then return 0 end
if redis.call('HGET', KEYS[1], 'ow') ~= ARGV[1] then return 0 end
drop_pieces(KEYS[1])
redis.call('HDEL', KEYS[1], 'lu', 'hd', 'bd', 'bl', 'bp')
redis.call('HSET', KEYS[1], 'st', 'n', 'sc', ARGV[2])
return 1
"#;

// Piece ARGV[2] (0, 1, ...) of a large body, by the owner of a record in progress. In the
// record's hash, so it lives and goes with the record. Running it twice writes the same
// bytes twice.
pub(super) const WRITE_CHUNK: &str = r#"
local r = redis.call('HMGET', KEYS[1], 'ow', 'st')
if r[1] ~= ARGV[1] or r[2] ~= 'p' then return 0 end
redis.call('HSET', KEYS[1], 'b' .. ARGV[2], ARGV[3])
return 1
"#;

// As RECORD, once the ARGV[5] pieces of a large body are written: its length instead of
// the body. -1 when the pieces do not add up to it (one was lost, say in a failover).
pub(super) const RECORD_LARGE: &str = r#"
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
// On a value, its marks and retention move with the expiry, so that the creation time and a
// live lease read the same as before.
pub(super) const SHORTEN: &str = r#"
local v = redis.pcall('GET', KEYS[1])
if type(v) == 'string' then
  if string.sub(v, 3, 34) ~= ARGV[1] then return 0 end
  local left = redis.call('PTTL', KEYS[1])
  local want = tonumber(ARGV[2])
  if left >= 0 and left <= want then return 1 end
  local d = 0
  if left > want then d = left - want end
  local function moved(a, b)
    local n = v_num(v, a, b) - d
    if n < 0 then n = 0 end
    return string.format('%013d', n)
  end
  redis.call('SET', KEYS[1], string.sub(v, 1, 103) .. moved(104, 116) .. moved(117, 129) .. moved(130, 142) .. string.sub(v, 143), 'PX', want)
  return 1
end
if not v then return 0 end
if redis.call('HGET', KEYS[1], 'ow') ~= ARGV[1] then return 0 end
local left = redis.call('PTTL', KEYS[1])
if left < 0 or left > tonumber(ARGV[2]) then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 1
"#;

pub(super) const RENEW: &str = r#"
local v = redis.pcall('GET', KEYS[1])
if type(v) == 'string' then
  if string.sub(v, 3, 34) ~= ARGV[1] or string.sub(v, 1, 1) ~= 'p' then return 0 end
  local mark = redis.call('PTTL', KEYS[1]) - tonumber(ARGV[2])
  if mark < 0 then mark = 0 end
  redis.call('SET', KEYS[1], string.sub(v, 1, 116) .. string.format('%013d', mark) .. string.sub(v, 130), 'KEEPTTL')
  return 1
end
if not v then return 0 end
local r = redis.call('HMGET', KEYS[1], 'ow', 'st')
if r[1] ~= ARGV[1] or r[2] ~= 'p' then return 0 end
redis.call('HSET', KEYS[1], 'lu', string.format('%d', now + ARGV[2]))
return 1
"#;

pub(super) const MARK_UNKNOWN: &str = r#"
local v = redis.pcall('GET', KEYS[1])
if type(v) == 'string' then
  local st = string.sub(v, 1, 1)
  if string.sub(v, 3, 34) ~= ARGV[1] or st == 'c' or st == 'n' then return 0 end
  redis.call('SET', KEYS[1], 'u' .. string.sub(v, 2), 'KEEPTTL')
  return 1
end
if not v then return 0 end
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
pub(super) const RELEASE: &str = r#"
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
pub(super) const DELETE: &str = r#"
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
pub(super) const COMPLETE: &str = r#"
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

// While observing: a later execution's answer (ARGV[2..4]) replaces a completed record's
// answer, kept or not, whose status is outside 2xx, when the fingerprint (ARGV[1]) is the
// record's. 1: replaced, 0: left alone.
pub(super) const SUPERSEDE: &str = r#"
local r = redis.call('HMGET', KEYS[1], 'st', 'fp', 'sc')
if not r[1] then return 0 end
if (r[1] ~= 'c' and r[1] ~= 'n') or r[2] ~= ARGV[1] then return 0 end
local sc = tonumber(r[3] or '0') or 0
if sc >= 200 and sc < 300 then return 0 end
drop_pieces(KEYS[1])
redis.call('HSET', KEYS[1], 'st', 'c', 'sc', ARGV[2], 'hd', ARGV[3], 'bd', ARGV[4])
redis.call('HDEL', KEYS[1], 'bl', 'bp')
return 1
"#;

// The record, with its inline body when ARGV[1] = '1'; a large one's length comes back
// instead (`bp`: pieces in the hash, `bl`: the previous version's key), for the caller to
// read a piece at a time.
pub(super) const INSPECT: &str = r#"
local v = redis.pcall('GET', KEYS[1])
if type(v) == 'string' then
  local ttl = redis.call('PTTL', KEYS[1])
  local left = ttl
  if left < 0 then left = 0 end
  local st = string.sub(v, 1, 1)
  local lu, sc, body = '', '', false
  if st == 'p' then lu = string.format('%d', now + left - v_num(v, 117, 129)) end
  if st == 'c' or st == 'n' then sc = tostring(v_num(v, 143, 145)) end
  if ARGV[1] == '1' and st == 'c' then body = string.sub(v, 154 + v_num(v, 146, 153)) end
  return {st, string.sub(v, 35, 98), tostring(v_num(v, 99, 103)), lu,
          string.format('%d', now - (v_num(v, 104, 116) - left)), sc, tostring(now),
          tostring(ttl), body, string.format('%d', now + left - v_num(v, 130, 142)), '', ''}
end
if not v then return false end
local r = redis.call('HMGET', KEYS[1], 'st', 'fp', 'fv', 'lu', 'cr', 'sc', 'wu', 'bp', 'bl')
if not r[1] then return false end
local body = false
if ARGV[1] == '1' then body = redis.call('HGET', KEYS[1], 'bd') end
return {r[1], r[2], r[3], r[4] or '', r[5], r[6] or '', tostring(now), tostring(redis.call('PTTL', KEYS[1])), body, r[7] or '', r[8] or '', r[9] or ''}
"#;

pub(super) struct Scripts {
    pub(super) claim: Script,
    pub(super) record: Script,
    pub(super) record_value: Script,
    pub(super) record_hash: Script,
    pub(super) record_not_kept: Script,
    pub(super) shorten: Script,
    pub(super) write_chunk: Script,
    pub(super) record_large: Script,
    pub(super) renew: Script,
    pub(super) mark_unknown: Script,
    pub(super) release: Script,
    pub(super) delete: Script,
    pub(super) inspect: Script,
    pub(super) complete: Script,
    pub(super) supersede: Script,
}
