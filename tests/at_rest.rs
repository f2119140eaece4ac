//! Recorded answers at rest: sealed with the configured keys (nothing of an answer readable
//! in the store), replayed byte for byte, through key rotation; a record whose key was
//! removed answers 500 `record-unreadable` and is never executed again.

#![allow(clippy::unwrap_used)]

use crate::common;

use base64::Engine as _;
use common::*;
use idemgate::config::{Config, OnStoreError};

const PAYMENT: &str = r#"{"card":"4000056655665556","amount":1250}"#;

on_both_stores!(
    sealed_answers_replay_byte_for_byte,
    compressed_answers_replay_byte_for_byte,
);

fn key(id: &str, byte: u8) -> idemgate::config::Secret {
    let b64 = base64::engine::general_purpose::STANDARD.encode([byte; 32]);
    format!("{id}:{b64}").as_str().into()
}

fn sealed(mut c: Config, keys: &[(&str, u8)]) -> Config {
    c.encryption_keys = keys.iter().map(|(id, b)| key(id, *b)).collect();
    c
}

async fn sealed_answers_replay_byte_for_byte(backend: Backend) {
    let up = Upstream::start().await;
    let app = spawn_app(sealed(config(&up, &backend), &[("k1", 1)])).await;
    let c = client();
    let first = post(&c, &app, "/v1/pay", Some("p-1"), PAYMENT, &[]).await;
    assert_eq!(first.status, 201);
    let again = post(&c, &app, "/v1/pay", Some("p-1"), PAYMENT, &[]).await;
    assert!(again.replayed());
    assert_eq!(again.status, 201);
    assert_eq!(again.body, first.body);
    assert_eq!(again.header("x-execution"), Some("1"));
    assert_eq!(again.header("content-type"), Some("application/json"));
    assert_eq!(up.hits(), 1);
    app.shutdown().await;
}

async fn compressed_answers_replay_byte_for_byte(backend: Backend) {
    let up = Upstream::start().await;
    let mut c = sealed(config(&up, &backend), &[("k1", 1)]);
    // The fake upstream's answer is about 50 bytes: compress everything from 8 on.
    c.compress_min_bytes = Some(8);
    let app = spawn_app(c).await;
    let c = client();
    let big = format!("{{\"items\":\"{}\"}}", "ab".repeat(4000));
    let first = post(&c, &app, "/v1/pay", Some("p-2"), &big, &[]).await;
    let again = post(&c, &app, "/v1/pay", Some("p-2"), &big, &[]).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(again.header("x-execution"), Some("1"));
    assert_eq!(up.hits(), 1);
    app.shutdown().await;
}

/// Every value of every key in Redis, as bytes (hashes: fields and values).
fn everything_in(redis: &RedisServer) -> Vec<Vec<u8>> {
    let client = ::redis::Client::open(redis.url()).unwrap();
    let mut con = client
        .get_connection_with_timeout(std::time::Duration::from_secs(5))
        .unwrap();
    let keys: Vec<Vec<u8>> = ::redis::cmd("KEYS").arg("*").query(&mut con).unwrap();
    assert!(!keys.is_empty());
    let mut out = Vec::new();
    for k in keys {
        let kind: String = ::redis::cmd("TYPE").arg(&k).query(&mut con).unwrap();
        match kind.as_str() {
            "hash" => {
                let fields: Vec<Vec<u8>> = ::redis::cmd("HGETALL").arg(&k).query(&mut con).unwrap();
                out.extend(fields);
            }
            "string" => out.push(::redis::cmd("GET").arg(&k).query(&mut con).unwrap()),
            "set" => {
                let members: Vec<Vec<u8>> =
                    ::redis::cmd("SMEMBERS").arg(&k).query(&mut con).unwrap();
                out.extend(members);
            }
            other => panic!("unexpected key type {other}"),
        }
        out.push(k);
    }
    out
}

fn contains(hay: &[Vec<u8>], needle: &[u8]) -> bool {
    hay.iter()
        .any(|v| v.windows(needle.len()).any(|w| w == needle))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_of_an_answer_is_readable_in_redis() {
    let up = Upstream::start().await;
    let redis = RedisServer::start();
    // In clear first: the scan finds the answer, so it would find it sealed too.
    let app = spawn_app(redis_config(&up, &redis)).await;
    let c = client();
    post(&c, &app, "/v1/pay", Some("clear"), PAYMENT, &[]).await;
    app.shutdown().await;
    let stored = everything_in(&redis);
    assert!(
        contains(&stored, b"\"body_len\""),
        "the scan sees clear answers"
    );
    assert!(contains(&stored, b"application/json"));
    redis.command(&["FLUSHALL"]).unwrap();

    for compress in [None, Some(1)] {
        let mut cfg = sealed(redis_config(&up, &redis), &[("k1", 1)]);
        cfg.compress_min_bytes = compress;
        let app = spawn_app(cfg).await;
        let first = post(&c, &app, "/v1/pay", Some("sealed"), PAYMENT, &[]).await;
        assert_eq!(first.status, 201);
        let stored = everything_in(&redis);
        for marker in [&b"\"body_len\""[..], b"execution", b"application/json"] {
            assert!(
                !contains(&stored, marker),
                "{} readable in Redis ({compress:?})",
                String::from_utf8_lossy(marker)
            );
        }
        let again = post(&c, &app, "/v1/pay", Some("sealed"), PAYMENT, &[]).await;
        assert!(again.replayed());
        assert_eq!(again.body, first.body);
        app.shutdown().await;
        redis.command(&["FLUSHALL"]).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotation_keeps_replaying_and_a_removed_key_is_500_never_a_second_execution() {
    let up = Upstream::start().await;
    let redis = RedisServer::start();
    let c = client();
    let app = spawn_app(sealed(redis_config(&up, &redis), &[("old", 1)])).await;
    let first = post(&c, &app, "/v1/pay", Some("r-1"), PAYMENT, &[]).await;
    assert_eq!(first.status, 201);
    app.shutdown().await;

    // A new first key: the old record still replays, new records are sealed under "new".
    let app = spawn_app(sealed(redis_config(&up, &redis), &[("new", 2), ("old", 1)])).await;
    let again = post(&c, &app, "/v1/pay", Some("r-1"), PAYMENT, &[]).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    let second = post(&c, &app, "/v1/pay", Some("r-2"), PAYMENT, &[]).await;
    assert_eq!(second.status, 201);
    app.shutdown().await;
    assert_eq!(up.hits(), 2);

    // "old" removed, even with on_store_error = "forward": a problem, never an execution.
    let mut cfg = sealed(redis_config(&up, &redis), &[("new", 2)]);
    cfg.defaults.on_store_error = OnStoreError::Forward;
    let app = spawn_app(cfg).await;
    let lost = post(&c, &app, "/v1/pay", Some("r-1"), PAYMENT, &[]).await;
    assert_eq!(lost.status, 500);
    assert!(lost.problem_type().ends_with("/record-unreadable"));
    assert!(lost.json()["record_id"].is_string());
    let kept = post(&c, &app, "/v1/pay", Some("r-2"), PAYMENT, &[]).await;
    assert!(kept.replayed());
    assert_eq!(kept.body, second.body);
    app.shutdown().await;

    // Without any key, a sealed record is unreadable too.
    let app = spawn_app(redis_config(&up, &redis)).await;
    let lost = post(&c, &app, "/v1/pay", Some("r-2"), PAYMENT, &[]).await;
    assert_eq!(lost.status, 500);
    app.shutdown().await;
    assert_eq!(up.hits(), 2, "an unreadable record was executed again");
}

#[test]
fn bad_keys_stop_start_up_naming_the_key_not_its_value() {
    let mut c = Config::for_upstream("http://127.0.0.1:9");
    c.encryption_keys = vec!["k1:c2hvcnQ=".into()];
    let err = idemgate::config::Settings::new(c).unwrap_err().to_string();
    assert!(err.contains("encryption_keys"), "{err}");
    assert!(!err.contains("c2hvcnQ"), "{err}");
}

/// A payment-like JSON answer of about `size` bytes: line items with varying amounts, ids
/// and timestamps, as an upstream would send them.
fn payment_json(size: usize) -> String {
    let mut items = Vec::new();
    let mut n: u64 = 7;
    let mut out = String::new();
    while out.len() < size {
        n = n
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        items.push(format!(
            "{{\"id\":\"li_{:016x}\",\"amount\":{},\"currency\":\"EUR\",\"description\":\"Order {} item\",\"created\":{}}}",
            n,
            n % 100_000,
            n % 9973,
            1_700_000_000 + n % 10_000_000
        ));
        out = format!(
            "{{\"id\":\"pay_3f9a8b7c6d5e4f3a\",\"status\":\"succeeded\",\"amount\":1250,\"card\":{{\"brand\":\"visa\",\"last4\":\"4242\"}},\"items\":[{}]}}",
            items.join(",")
        );
    }
    out
}

/// Redis `MEMORY USAGE` of one completed record with a `size`-byte JSON answer, stored
/// through an envelope of `keys` and `compress_min_bytes`.
async fn memory_usage(
    redis: &RedisServer,
    size: usize,
    keys: bool,
    compress: Option<usize>,
) -> (usize, i64) {
    use idemgate::store::seal::{Envelope, Enveloped, Keyring};
    use idemgate::store::{ClaimRequest, OwnerToken, RedisStore, Store, StoredResponse};
    use std::sync::Arc;
    use std::time::Duration;
    let t = Duration::from_secs(2);
    let inner: Arc<dyn Store> = Arc::new(RedisStore::connect(&redis.url(), t, t).await.unwrap());
    let envelope = Envelope {
        keys: keys.then(|| Keyring::parse(&[key("k1", 1).expose()]).unwrap()),
        compress_min_bytes: compress,
        max_body: None,
    };
    let store = Enveloped::new(inner, envelope);
    let body = payment_json(size);
    let id = idemgate::key::RecordId::from_bytes(rand_id(size, keys, compress));
    let claim = ClaimRequest {
        id,
        fingerprint: idemgate::fingerprint::fingerprint(
            &idemgate::fingerprint::RequestParts {
                method: "POST",
                path: "/v1/pay",
                query: None,
                content_type: Some("application/json"),
                body: b"{}",
                ..Default::default()
            },
            &[],
        ),
        fingerprint_version: idemgate::fingerprint::FINGERPRINT_VERSION,
        owner: OwnerToken::random(),
        lease: Duration::from_secs(10),
        retention: Duration::from_secs(86400),
        busy_for: Duration::from_secs(31),
        answer_room: 0,
        room: None,
    };
    store.claim(&claim).await.unwrap();
    let answer = StoredResponse {
        status: 201,
        headers: vec![(
            "content-type".into(),
            bytes::Bytes::from_static(b"application/json"),
        )],
        body: body.clone().into(),
    };
    assert!(store.record(&id, &claim.owner, &answer).await.unwrap());
    let key = format!("idemgate:{{{id}}}");
    let reply = redis
        .command(&["MEMORY", "USAGE", &key, "SAMPLES", "0"])
        .unwrap();
    let used = reply.trim_start_matches(':').trim().parse().unwrap();
    (body.len(), used)
}

fn rand_id(size: usize, keys: bool, compress: Option<usize>) -> [u8; 32] {
    let mut id = [0u8; 32];
    id[..8].copy_from_slice(&(size as u64).to_be_bytes());
    id[8] = keys as u8;
    id[9] = compress.is_some() as u8;
    id
}

/// The storage cost of a record, printed for docs/operations.md (`--nocapture`), and the target for
/// a 1 KiB answer held: at most 1.3 times its size plus 120 bytes, compressed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_usage_per_record() {
    let redis = RedisServer::start();
    for size in [1024, 64 * 1024] {
        for (keys, compress) in [
            (false, None),
            (false, Some(512)),
            (true, None),
            (true, Some(512)),
        ] {
            let (len, used) = memory_usage(&redis, size, keys, compress).await;
            println!(
                "answer {len} B, sealed {keys}, compress_min_bytes {compress:?}: MEMORY USAGE {used} B ({:.2}x)",
                used as f64 / len as f64
            );
            if size == 1024 && compress.is_some() {
                assert!(
                    used as f64 <= 1.3 * len as f64 + 120.0,
                    "{used} B for a {len} B answer (sealed {keys})"
                );
            }
        }
    }
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// Sets the uncompressed length that the one compressed record in `redis` declares (its
/// envelope in clear: version, flags, headers length, headers, body length, zstd frame),
/// and its frame if `frame` is given.
fn declare_inflated_length(redis: &RedisServer, len: u32, frame: Option<&[u8]>) {
    let client = ::redis::Client::open(redis.url()).unwrap();
    let mut con = client
        .get_connection_with_timeout(std::time::Duration::from_secs(5))
        .unwrap();
    let keys: Vec<Vec<u8>> = ::redis::cmd("KEYS")
        .arg("idemgate:{*")
        .query(&mut con)
        .unwrap();
    let mut tampered = 0;
    for k in keys {
        let kind: String = ::redis::cmd("TYPE").arg(&k).query(&mut con).unwrap();
        if kind != "hash" {
            continue;
        }
        let body: Option<Vec<u8>> = ::redis::cmd("HGET")
            .arg(&k)
            .arg("bd")
            .query(&mut con)
            .unwrap();
        let Some(mut body) = body else { continue };
        assert_eq!(body[1] & 0x01, 0, "in clear");
        let hlen = u32::from_be_bytes(body[2..6].try_into().unwrap()) as usize;
        let at = 6 + hlen;
        body[at..at + 4].copy_from_slice(&len.to_be_bytes());
        if let Some(frame) = frame {
            body.truncate(at + 4);
            body.extend_from_slice(frame);
        }
        let _: () = ::redis::cmd("HSET")
            .arg(&k)
            .arg("bd")
            .arg(body)
            .query(&mut con)
            .unwrap();
        tampered += 1;
    }
    assert_eq!(tampered, 1, "one recorded answer");
}

/// A record in clear altered in Redis: its compressed answer swapped for a frame of 256 MiB
/// of zeros (a few KB) that declares those 256 MiB, more than any route or operator could
/// have recorded. Each replay is 500 `record-unreadable` (never a second execution), the
/// binary's RSS does not grow with it (with the declared length trusted, each replay
/// inflated the 256 MiB and ended in a 503 store timeout), and other requests keep being
/// answered. A frame that inflates beyond
/// the length it declares is unreadable too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compressed_record_declaring_a_huge_inflated_size_is_unreadable_not_inflated() {
    let up = Upstream::start().await;
    let redis = RedisServer::start();
    let gate = Idemgate::new(&up.url())
        .redis(&redis)
        .set(|c| c.compress_min_bytes = Some(1024))
        .binary();
    let c = client();
    let url = gate.url("/v1/reports");
    let first = post_url(&c, &url, Some("t-1"), "{}", &[(ANSWER_BYTES, "33000")]).await;
    assert_eq!(first.status, 201);
    let replay = post_url(&c, &url, Some("t-1"), "{}", &[]).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    let bomb = {
        let mut z = zstd::stream::Encoder::new(Vec::new(), 19).unwrap();
        let zeros = vec![0u8; 1 << 20];
        for _ in 0..256 {
            std::io::Write::write_all(&mut z, &zeros).unwrap();
        }
        z.finish().unwrap()
    };
    assert!(bomb.len() < 64 * 1024, "{} bytes", bomb.len());
    declare_inflated_length(&redis, 256 << 20, Some(&bomb));
    let before = rss_kib(gate.pid());
    for _ in 0..3 {
        let started = std::time::Instant::now();
        let r = post_url(&c, &url, Some("t-1"), "{}", &[]).await;
        assert_eq!(r.status, 500, "{:?}", r.body);
        assert!(
            r.problem_type().ends_with("/record-unreadable"),
            "{:?}",
            r.body
        );
        assert!(started.elapsed() < common::HANG_GUARD);
        let other = post_url(&c, &url, None, "{}", &[]).await;
        assert_eq!(other.status, 201);
    }
    let grew = rss_kib(gate.pid()).saturating_sub(before);
    assert!(grew < 64 * 1024, "RSS grew by {grew} KiB");
    // Declaring less than the frame inflates to: unreadable as well.
    declare_inflated_length(&redis, 1000, None);
    let r = post_url(&c, &url, Some("t-1"), "{}", &[]).await;
    assert_eq!(r.status, 500, "{:?}", r.body);
    assert!(r.problem_type().ends_with("/record-unreadable"));
    assert_eq!(up.hits(), 4, "t-1 once, and the three keyless requests");
}
