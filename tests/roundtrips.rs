//! The cost of idempotency in Redis round trips, counted by Redis itself: two per new key
//! (claim, record), one per replay (claim). This is the floor the design promises; a third
//! round trip on the hot path would show up here before it shows up in a benchmark.

#![allow(clippy::unwrap_used)]

mod common;

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
