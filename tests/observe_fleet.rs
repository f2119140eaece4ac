//! Observe mode across a fleet: two instances (the real binary) on one Redis and one
//! namespace, as the documented rollout runs them.
//!
//! - No record contradicts what the client got: a first attempt answered 500 while
//!   observing, its retry forwarded by the other observer and answered 201, and then the
//!   route enforcing: the retry after the switch gets the 201 replayed, never the 500,
//!   also when the 500 is recorded after the 201 was answered.
//! - Duplicates are counted from what the record says, whichever instance made it: summed
//!   over the instances, `duplicates_let_through` equals the executions the upstream ran
//!   beyond each key's first, sequential and concurrent, on either instance, in a mixed
//!   fleet and after switching back; after Redis forgets its records a retry is a new
//!   `execute`, never also a duplicate.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use common::faultproxy::FaultProxy;
use common::*;
use idemgate::config::{Config, Mode, Secret};

fn observe_json(gate: &Gate) -> serde_json::Value {
    let raw = http_get(gate.admin, "/observe").unwrap();
    let body = raw.split("\r\n\r\n").nth(1).unwrap_or("");
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {raw}"))
}

fn duplicates(gate: &Gate) -> u64 {
    observe_json(gate)["routes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["duplicates_let_through"].as_u64())
        .sum()
}

fn would(gate: &Gate, what: &str) -> u64 {
    observe_json(gate)["routes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["would"][what].as_u64())
        .sum()
}

const SECRET: &str = "5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed";

fn instance(up: &Upstream, redis: &RedisServer, mode: Mode) -> Gate {
    instance_on(up, &redis.url(), mode, |_| ())
}

/// An instance in `mode` on the Redis at `redis_url`, sharing the fleet's scope secret;
/// `set` changes the rest of its settings.
fn instance_on(up: &Upstream, redis_url: &str, mode: Mode, set: impl FnOnce(&mut Config)) -> Gate {
    Idemgate::new(&up.url())
        .redis_url(redis_url)
        .set(|c| {
            c.defaults.mode = mode;
            c.scope_secret = Some(Secret::from(SECRET));
        })
        .set(set)
        .binary()
}

/// An observer whose link to Redis holds every command back 300 ms (through the proxy
/// returned with it): it records each answer well after its client has it.
async fn slow_observer(up: &Upstream, redis: &RedisServer) -> (FaultProxy, Gate) {
    let slow = FaultProxy::for_redis(redis).await;
    let gate = instance_on(up, &slow.redis_url(), Mode::Observe, |_| ());
    slow.delay_requests(Duration::from_millis(300));
    (slow, gate)
}

async fn send(gate: &Gate, key: &str, extra: &[(&str, &str)]) -> Answer {
    post_url(
        &client(),
        &gate.url("/pay"),
        Some(key),
        "{\"amount\":7}",
        extra,
    )
    .await
}

/// Executions the upstream ran beyond each key's first.
fn true_duplicates(up: &Upstream) -> u64 {
    let mut per_key: HashMap<String, u64> = HashMap::new();
    for s in up.seen() {
        if let Some(k) = s.headers.get("idempotency-key").and_then(|v| v.first()) {
            *per_key.entry(k.clone()).or_default() += 1;
        }
    }
    per_key.values().map(|n| n - 1).sum()
}

/// Waits until the instances' counts settle (a duplicate read again after its answer is
/// counted just after its client has it), then returns their sum.
async fn settled_sum(gates: &[&Gate], want: u64) -> u64 {
    common::retry_until(
        Duration::from_secs(5),
        async || gates.iter().map(|g| duplicates(g)).sum::<u64>(),
        |sum| *sum == want,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_recorded_while_observing_is_superseded_by_the_later_success() {
    let up = Upstream::start().await;
    let redis = RedisServer::start();
    let (a, b) = (
        instance(&up, &redis, Mode::Observe),
        instance(&up, &redis, Mode::Observe),
    );
    fail_retry_and_switch(&up, &redis, [a, b], "stale", 20).await;
}

/// The wait keeps the later answer in memory: it is taken from the buffer budget
/// (`max_buffered_bytes`), and with no room there the retry reads the record once, as it
/// did before the wait, with a warning naming what it could not do; it waits for nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_budget_to_keep_its_answer_a_retry_does_not_wait_and_says_so() {
    let up = Upstream::start().await;
    let redis = RedisServer::start();
    let (_slow, a) = slow_observer(&up, &redis).await;
    let b = instance_on(&up, &redis.url(), Mode::Observe, |c| {
        c.max_buffered_bytes = 16;
    });
    let first = send(&a, "tight", &[(STATUS, "500")]).await;
    assert_eq!(first.status, 500);
    let retry = send(&b, "tight", &[]).await;
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    assert!(
        retry.body.len() > 16,
        "the answer must not fit the budget: {:?}",
        retry.body
    );
    // The warning is written where the wait would begin: it did not.
    let settling = common::retry_until(
        Duration::from_secs(5),
        async || observe_json(&b)["duplicates_settling"].clone(),
        |n| *n == 0,
    )
    .await;
    assert_eq!(settling, 0);
    assert!(
        b.log()
            .contains("the buffer budget had no room to keep this answer"),
        "{}",
        b.log()
    );
}

/// Each of `keys` keys is answered 500 by the first observer, then its retry 201 by the
/// second (both executed: observe mode forwards). The observers then stop as a rolling
/// switch stops them (SIGTERM: what they write after their clients' answers lands first);
/// an enforcing instance replays each key's later success, never the failure before it,
/// and executes nothing again.
async fn fail_retry_and_switch(
    up: &Upstream,
    redis: &RedisServer,
    observers: [Gate; 2],
    prefix: &str,
    keys: usize,
) {
    let [a, b] = &observers;
    for i in 0..keys {
        let key = format!("{prefix}-{i}");
        let first = send(a, &key, &[(STATUS, "500")]).await;
        assert_eq!(first.status, 500);
        let retry = send(b, &key, &[]).await;
        assert_eq!(retry.status, 201, "{:?}", retry.body);
        assert!(!retry.replayed());
    }
    assert_eq!(up.hits(), 2 * keys);
    for mut g in observers {
        assert!(g.terminate(Duration::from_secs(40)).success());
    }
    let enforcing = instance(up, redis, Mode::Enforce);
    let hits = up.hits();
    let mut stale = 0;
    for i in 0..keys {
        let later = send(&enforcing, &format!("{prefix}-{i}"), &[]).await;
        assert!(later.replayed(), "{} {:?}", later.status, later.body);
        if later.status != 201 {
            stale += 1;
        }
    }
    assert_eq!(
        stale, 0,
        "replays of a failure a later execution superseded"
    );
    assert_eq!(up.hits(), hits, "the switch executed nothing again");
}

/// The same when the first execution's record is written after the retry's execution has
/// its answer: an observer answers its client before it records, and here its link to
/// Redis holds every command back 300 ms, so that the retry on the other instance claims,
/// executes and answers while the failure is still being recorded. The retry waits for
/// that record and replaces the failure; read once, the failure would land after it and be
/// replayed once the route enforces.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_recorded_after_the_later_success_is_superseded_too() {
    let up = Upstream::start().await;
    let redis = RedisServer::start();
    let (_slow, a) = slow_observer(&up, &redis).await;
    let b = instance(&up, &redis, Mode::Observe);
    fail_retry_and_switch(&up, &redis, [a, b], "late", 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_let_through_add_up_over_the_fleet_to_the_upstream_s() {
    let up = Upstream::start().await;
    let redis = RedisServer::start();
    let (a, b) = (
        instance(&up, &redis, Mode::Observe),
        instance(&up, &redis, Mode::Observe),
    );
    // Sequential retries, each on the other instance.
    for i in 0..10 {
        let key = format!("seq-{i}");
        for g in [&a, &b, &a] {
            assert_eq!(send(g, &key, &[]).await.status, 201);
        }
    }
    assert_eq!(true_duplicates(&up), 20);
    assert_eq!(settled_sum(&[&a, &b], 20).await, 20);
    // Concurrent: a retry arrives at the other instance while the first still runs.
    for i in 0..5 {
        let key = format!("conc-{i}");
        let before = up.hits();
        let slow = send(&a, &key, &[(FAULT, "hold")]);
        let retry = async {
            eventually(HANG_GUARD, "the first at the upstream", || {
                up.hits() > before
            })
            .await;
            let retry = send(&b, &key, &[]).await;
            up.release();
            retry
        };
        let (x, y) = tokio::join!(slow, retry);
        assert_eq!((x.status, y.status), (201, 201));
    }
    assert_eq!(true_duplicates(&up), 25);
    assert_eq!(settled_sum(&[&a, &b], 25).await, 25);
    // What an instance counted goes with it: the sum over the fleet keeps its figure.
    let mut gone = duplicates(&b);
    drop(b);

    // A mixed fleet: b enforces now. Its replays execute nothing; a's forwards of keys b
    // completed are duplicates.
    let b = instance(&up, &redis, Mode::Enforce);
    for i in 0..5 {
        let key = format!("mixed-{i}");
        assert_eq!(send(&b, &key, &[]).await.status, 201);
        assert!(send(&b, &key, &[]).await.replayed());
        assert_eq!(send(&a, &key, &[]).await.status, 201);
    }
    assert_eq!(true_duplicates(&up), 30);
    assert_eq!(settled_sum(&[&a, &b], 30 - gone).await + gone, 30);

    // Switching back: keys the enforcing instance completed are duplicates when observed.
    gone += duplicates(&b);
    drop(b);
    let c = instance(&up, &redis, Mode::Observe);
    for i in 0..5 {
        assert_eq!(send(&c, &format!("mixed-{i}"), &[]).await.status, 201);
    }
    assert_eq!(true_duplicates(&up), 35);
    assert_eq!(settled_sum(&[&a, &c], 35 - gone).await + gone, 35);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_redis_forgets_a_retry_is_an_execute_and_never_also_a_duplicate() {
    let up = Upstream::start().await;
    let mut redis = RedisServer::start();
    let (a, b) = (
        instance(&up, &redis, Mode::Observe),
        instance(&up, &redis, Mode::Observe),
    );
    for i in 0..5 {
        assert_eq!(send(&a, &format!("lost-{i}"), &[]).await.status, 201);
    }
    let executes = would(&a, "execute") + would(&b, "execute");
    assert_eq!(executes, 5);
    // No persistence: the restart forgets every record.
    redis.restart();
    for i in 0..5 {
        let key = format!("lost-{i}");
        // The first call after the restart may find the connection broken; observing, the
        // client gets the upstream's answer all the same.
        assert_eq!(send(&b, &key, &[]).await.status, 201);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let dups = duplicates(&a) + duplicates(&b);
    assert_eq!(
        dups, 0,
        "records the store lost cannot be counted as duplicates"
    );
    let after: u64 = would(&a, "execute") + would(&b, "execute");
    let unavailable = would(&a, "store_unavailable") + would(&b, "store_unavailable");
    assert_eq!(
        after + unavailable,
        10,
        "each retry counted once, as execute (or store_unavailable while reconnecting)"
    );
}

/// Observing costs the client one store round trip: with every Redis reply held back
/// 2 s, an observed new key answers in about 2 s (the claim), not 4 (the claim and then
/// the record before the answer, as it was). The record still lands, after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observed_new_key_waits_for_one_store_round_trip() {
    const DELAYED: Duration = Duration::from_secs(2);
    let up = Upstream::start().await;
    let redis = RedisServer::start();
    let proxy = faultproxy::FaultProxy::for_redis(&redis).await;
    let g = instance_on(&up, &proxy.redis_url(), Mode::Observe, |c| {
        c.store_timeout = Duration::from_secs(10);
    });
    // Warm: the connection and the scripts are loaded before the replies slow down.
    assert_eq!(send(&g, "warm", &[]).await.status, 201);
    proxy.delay_replies(DELAYED);
    let mut worst = Duration::ZERO;
    for i in 0..3 {
        let started = std::time::Instant::now();
        let a = send(&g, &format!("slow-store-{i}"), &[]).await;
        assert_eq!(a.status, 201);
        worst = worst.max(started.elapsed());
    }
    // One delayed round trip is 2 s, two are 4 s: the margin is a whole round trip.
    assert!(
        worst < DELAYED * 2,
        "an observed new key took {worst:?} with {DELAYED:?} store replies: more than one round trip"
    );
    // The records landed after the answers: enforcing replays them.
    proxy.delay_replies(Duration::ZERO);
    tokio::time::sleep(Duration::from_millis(800)).await;
    drop(g);
    let enforcing = instance(&up, &redis, Mode::Enforce);
    let hits = up.hits();
    assert!(send(&enforcing, "slow-store-0", &[]).await.replayed());
    assert_eq!(up.hits(), hits);
}
