use super::*;
use crate::fingerprint::Fingerprint;
use crate::scope::{ScopeSecret, Scoper, Tenant};
use hyper::header::HeaderValue;

#[test]
fn keys_and_fingerprints_are_written_as_before() {
    // Records already in Redis are found under this exact form after an upgrade.
    let id = id_of("k-1", "payments", "/v1/transfers");
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

/// The record id of an anonymous `POST path` sent with this idempotency key, in
/// `namespace`.
fn id_of(key: &str, namespace: &str, path: &str) -> RecordId {
    let mut headers = hyper::HeaderMap::new();
    headers.insert(
        "idempotency-key",
        HeaderValue::from_str(key).expect("a header value"),
    );
    let key = crate::key::parse(&headers, 255)
        .ok()
        .flatten()
        .expect("a valid key");
    let scoper = Scoper::new(&ScopeSecret::random(), namespace);
    scoper.record_id(&Tenant::anonymous(), "POST", path, &key)
}

fn request(key: &str) -> ClaimRequest {
    ClaimRequest::for_test(id_of(key, "upgrade", "/t"), Fingerprint([7; 32]))
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
        store.delete(&old.id, true, false).await.expect("delete"),
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
