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

// One HMGET reads everything a replay needs and this owner's withdrawal note (and no more:
// `lu`, needed only while in progress, and `bp`/`bl`, only for a large body, are read when
// needed), and the clock is read only when a claim is made or a lease compared: a replay,
// the most frequent claim, runs one command, and so does a new key before it writes. A
// claim over other owners' notes sets the route's retention as the key's expiry, which
// outlasts them: a note lingers for the retention of the claim it withdrew. An inline
// body longer than ARGV[7] (the room its claimant took for it before asking) comes back
// as its length alone: the claimant takes room for it, then reads it (`bd`) on its own.
pub(super) const CLAIM: &str = r#"
local r = redis.call('HMGET', KEYS[1], 'st', 'fp', 'fv', 'sc', 'hd', 'bd', 'w:' .. ARGV[3])
if not r[1] then
  local now = now_ms()
  if r[7] and tonumber(r[7]) > now then return {'withdrawn'} end
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

// As RECORD, for an answer too large to keep (or that found Redis out of memory, maybe
// after some pieces of it were written): the status alone. The pieces go first, so that
// the memory they held is free for the rest.
pub(super) const RECORD_NOT_KEPT: &str = r#"
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
pub(super) const SHORTEN: &str = r#"
if redis.call('HGET', KEYS[1], 'ow') ~= ARGV[1] then return 0 end
local left = redis.call('PTTL', KEYS[1])
if left < 0 or left > tonumber(ARGV[2]) then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 1
"#;

pub(super) const RENEW: &str = r#"
local r = redis.call('HMGET', KEYS[1], 'ow', 'st')
if r[1] ~= ARGV[1] or r[2] ~= 'p' then return 0 end
redis.call('HSET', KEYS[1], 'lu', string.format('%d', now + ARGV[2]))
return 1
"#;

pub(super) const MARK_UNKNOWN: &str = r#"
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
local r = redis.call('HMGET', KEYS[1], 'st', 'fp', 'fv', 'lu', 'cr', 'sc', 'wu', 'bp', 'bl')
if not r[1] then return false end
local body = false
if ARGV[1] == '1' then body = redis.call('HGET', KEYS[1], 'bd') end
return {r[1], r[2], r[3], r[4] or '', r[5], r[6] or '', tostring(now), tostring(redis.call('PTTL', KEYS[1])), body, r[7] or '', r[8] or '', r[9] or ''}
"#;

pub(super) struct Scripts {
    pub(super) claim: Script,
    pub(super) record: Script,
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
