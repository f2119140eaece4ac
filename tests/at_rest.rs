//! Recorded answers at rest: sealed with the configured keys (nothing of an answer readable
//! in the store), replayed byte for byte, through key rotation; a record whose key was
//! removed answers 500 `record-unreadable` and is never executed again.

#![allow(clippy::unwrap_used)]

#[macro_use]
mod common;

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
