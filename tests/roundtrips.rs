//! The cost of idempotency in Redis round trips, counted by Redis itself: two per new key
//! (claim, record), one per replay (claim). This is the floor the design promises; a third
//! round trip on the hot path would show up here before it shows up in a benchmark.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::collections::HashMap;

use common::*;

const TRANSFER: &str = r#"{"from":"acc-1","to":"acc-2","amount":1250,"currency":"EUR"}"#;
const N: usize = 50;

/// Calls per command name, from `INFO commandstats`.
fn commandstats(redis: &RedisServer) -> HashMap<String, u64> {
    let info = redis.command(&["INFO", "commandstats"]).unwrap();
    info.lines()
        .filter_map(|l| {
            let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest
                .split(',')
                .find_map(|f| f.strip_prefix("calls="))?
                .parse()
                .ok()?;
            Some((name.to_string(), calls))
        })
        .collect()
}

/// Round trips that idemgate made: every command a client sent, leaving out the commands
/// Lua scripts ran inside Redis (counted too since Redis 7) and this test's own
/// `CONFIG RESETSTAT` / `INFO`.
fn round_trips(redis: &RedisServer) -> (u64, HashMap<String, u64>) {
    const INSIDE_SCRIPTS: [&str; 10] = [
        "time",
        "hmget",
        "hget",
        "hset",
        "hdel",
        "pexpire",
        "pttl",
        "del",
        "sismember",
        "sadd",
    ];
    let stats = commandstats(redis);
    let total = stats
        .iter()
        .filter(|(name, _)| {
            // Subcommands are listed as `config|resetstat`.
            let command = name.split('|').next().unwrap_or_default();
            !INSIDE_SCRIPTS.contains(&command) && !["config", "info"].contains(&command)
        })
        .map(|(_, calls)| calls)
        .sum();
    (total, stats)
}

fn reset(redis: &RedisServer) {
    let reply = redis.command(&["CONFIG", "RESETSTAT"]).unwrap();
    assert!(reply.starts_with("+OK"), "{reply}");
}

/// Sends keys `k-0` .. `k-{N-1}` once each; every answer is 201, replayed or not as said.
async fn send_keys(c: &reqwest::Client, app: &idemgate::Running, replayed: bool) {
    for i in 0..N {
        let key = format!("k-{i}");
        let a = post(c, app, "/v1/transfers", Some(&key), TRANSFER, &[]).await;
        assert_eq!(a.status, 201);
        assert_eq!(a.replayed(), replayed);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_round_trips_per_new_key_and_one_per_replay() {
    let backend = Backend::redis();
    let up = Upstream::start().await;
    let app = spawn_app(config(&up, &backend)).await;
    let Backend::Redis(redis) = &backend else {
        unreachable!()
    };
    let c = client();
    // Start-up (INFO, SCRIPT LOAD) is not per request.
    reset(redis);

    send_keys(&c, &app, false).await;
    let (new_keys, stats) = round_trips(redis);
    assert_eq!(up.hits(), N);
    assert_eq!(
        new_keys,
        2 * N as u64,
        "expected 2 round trips per new key: {stats:?}"
    );
    assert_eq!(stats.get("evalsha"), Some(&(2 * N as u64)), "{stats:?}");

    reset(redis);
    send_keys(&c, &app, true).await;
    let (replays, stats) = round_trips(redis);
    assert_eq!(up.hits(), N, "a replay reached the upstream");
    assert_eq!(
        replays, N as u64,
        "expected 1 round trip per replay: {stats:?}"
    );
    assert_eq!(stats.get("evalsha"), Some(&(N as u64)), "{stats:?}");
    app.shutdown().await;
}

/// Store calls per operation on the admin listener's `/metrics`, every operation summed.
async fn store_calls(c: &reqwest::Client, app: &idemgate::Running) -> (f64, HashMap<String, f64>) {
    const TOKEN: &str = "roundtrips-admin-token";
    let text = c
        .get(format!("http://{}/metrics", app.admin_addr().unwrap()))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let per_op: HashMap<String, f64> = text
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("idemgate_store_duration_seconds_count{op=\"")?;
            let (op, value) = rest.split_once("\"} ")?;
            Some((op.to_string(), value.trim().parse().ok()?))
        })
        .collect();
    assert!(per_op.contains_key("claim"), "no store metrics in:\n{text}");
    (per_op.values().sum(), per_op)
}

/// The persistent embedded store has no server to count commands, so the calls are
/// counted by idemgate's own store metrics: each is one SQLite transaction (one commit,
/// one fsync when it writes). Two per new key (claim, record), one per replay (claim).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_two_store_calls_per_new_key_and_one_per_replay() {
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    let mut cfg = config(&up, &Backend::Memory);
    cfg.store_path = Some(dir.path().to_path_buf());
    cfg.admin_token = Some("roundtrips-admin-token".into());
    let app = spawn_app(cfg).await;
    let c = client();
    let (start, _) = store_calls(&c, &app).await;

    send_keys(&c, &app, false).await;
    let (after_new, per_op) = store_calls(&c, &app).await;
    assert_eq!(up.hits(), N);
    assert_eq!(
        after_new - start,
        2.0 * N as f64,
        "expected 2 store calls per new key: {per_op:?}"
    );
    assert_eq!(per_op["claim"], N as f64, "{per_op:?}");
    assert_eq!(per_op["record"], N as f64, "{per_op:?}");

    send_keys(&c, &app, true).await;
    let (after_replays, per_op) = store_calls(&c, &app).await;
    assert_eq!(up.hits(), N, "a replay reached the upstream");
    assert_eq!(
        after_replays - after_new,
        N as f64,
        "expected 1 store call per replay: {per_op:?}"
    );
    assert_eq!(per_op["claim"], 2.0 * N as f64, "{per_op:?}");
    app.shutdown().await;
}

/// Listing the records in one state (what `idemgate_records_held_unknown` walks the store
/// with, every `unknown_count_interval` on every instance) reads each record's state with a
/// bare `HGET`, a page in one pipeline, and inspects (a script each) only the records that
/// can be in that state: 50 completed records and one held unknown cost one inspection,
/// not 51.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listing_unknown_records_inspects_only_those_that_can_be() {
    let backend = Backend::redis();
    let up = Upstream::start().await;
    let mut cfg = config(&up, &backend);
    cfg.defaults.upstream_timeout = std::time::Duration::from_millis(300);
    let app = spawn_app(cfg).await;
    let Backend::Redis(redis) = &backend else {
        unreachable!()
    };
    let c = client();
    send_keys(&c, &app, false).await;
    let hung = post(
        &c,
        &app,
        "/v1/transfers",
        Some("hung"),
        TRANSFER,
        &[(FAULT, "hang")],
    )
    .await;
    assert_eq!(hung.status, 504);
    reset(redis);
    let admin = app.admin_addr().unwrap();
    let page: serde_json::Value = c
        .get(format!("http://{admin}/records?state=unknown&count=1000"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(page["records"].as_array().map(Vec::len), Some(1), "{page}");
    assert_eq!(page["records"][0]["state"], "unknown", "{page}");
    let stats = commandstats(redis);
    assert_eq!(stats.get("scan"), Some(&1), "{stats:?}");
    assert_eq!(stats.get("evalsha"), Some(&1), "one inspection: {stats:?}");
    app.shutdown().await;
}
