//! SIGTERM through the binary while claims that were never forwarded are still being taken
//! back: the releases are carried out within `shutdown_grace` when the store lets them,
//! those that cannot be are logged by record id as safe to release, and the whole shutdown
//! ends within the grace.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::{Duration, Instant};

use common::*;

const GRACE: Duration = Duration::from_secs(2);

/// Redis frozen; three new keys each answered 503 (their claims wait in Redis's socket
/// buffer, never forwarded). Returns the gate and the three record ids.
async fn three_claims_stuck_in_a_frozen_redis(
    redis: &RedisServer,
    up: &Upstream,
    more: impl FnOnce(&mut idemgate::Config),
) -> (Gate, Vec<String>) {
    let gate = Idemgate::new(&up.url())
        .redis(redis)
        .set(|c| {
            c.store_timeout = Duration::from_millis(300);
            c.shutdown_grace = Duration::from_secs(2);
            // No INFO polls: nothing but the claims and their releases goes to Redis.
            c.redis_info_interval = Duration::from_secs(3600);
            c.scope_secret_check_interval = Duration::from_secs(3600);
        })
        .set(more)
        .binary();
    let c = client();
    let warm = post_url(&c, &gate.url("/pay"), Some("warm"), "{}", &[]).await;
    assert_eq!(warm.status, 201);
    redis.pause();
    let mut ids = Vec::new();
    for i in 0..3 {
        let r = post_url(
            &c,
            &gate.url("/pay"),
            Some(&format!("stuck-{i}")),
            "{}",
            &[],
        )
        .await;
        assert_eq!(r.status, 503, "{:?}", r.body);
        ids.push(r.json()["record_id"].as_str().unwrap().to_string());
    }
    assert_eq!(up.hits(), 1, "none of them forwarded");
    (gate, ids)
}

// Redis comes back within the grace: the releases land, and the keys execute normally on
// the next instance (before: the releases were dropped at shutdown, the claims landed when
// Redis resumed, and the keys read `unknown` with 0 executions).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_releases_land_within_the_grace() {
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let (mut gate, _ids) = three_claims_stuck_in_a_frozen_redis(&redis, &up, |_| ()).await;
    let thaw = {
        let pid = redis.pid();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(600)).await;
            signal(pid, "CONT");
        })
    };
    let started = Instant::now();
    let status = tokio::task::block_in_place(|| gate.terminate(GRACE * 3));
    let took = started.elapsed();
    eprintln!("shutdown took {took:?}");
    thaw.await.unwrap();
    assert!(status.success(), "{status:?}\n{}", gate.log());
    assert!(took < GRACE * 2, "shutdown took {took:?} for a 2 s grace");
    let next = Idemgate::new(&up.url()).redis(&redis).binary();
    let c = client();
    for i in 0..3 {
        let r = post_url(
            &c,
            &next.url("/pay"),
            Some(&format!("stuck-{i}")),
            "{}",
            &[],
        )
        .await;
        assert_eq!(
            r.status,
            201,
            "stuck-{i} after the restart: {:?}\n{}",
            r.body,
            gate.log()
        );
    }
    assert_eq!(up.hits(), 4, "each executed once");
}

// Redis stays frozen past the grace: the shutdown still ends within it, and names every
// record whose release could not land.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_that_cannot_land_are_named_and_shutdown_ends_within_the_grace() {
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let (mut gate, ids) = three_claims_stuck_in_a_frozen_redis(&redis, &up, |_| ()).await;
    let started = Instant::now();
    let status = tokio::task::block_in_place(|| gate.terminate(GRACE * 3));
    let took = started.elapsed();
    eprintln!("shutdown took {took:?}");
    redis.resume();
    assert!(status.success(), "{status:?}\n{}", gate.log());
    assert!(took < GRACE * 2, "shutdown took {took:?} for a 2 s grace");
    let log = gate.log();
    for id in &ids {
        assert!(
            log.lines()
                .any(|l| l.contains(id.as_str()) && l.contains("safe to release")),
            "record {id} not named as safe to release:\n{log}"
        );
    }
}

// The same with spans to export to a collector that accepts connections and never answers:
// the last export gets what is left of the grace, so the whole shutdown still ends within
// it (before: at least another 100 ms after a drain that had used the whole grace, and
// the exporter's own timeout before that was bounded).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_otlp_collector_does_not_stretch_the_grace() {
    let collector = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", collector.local_addr().unwrap());
    // Accepts and holds every connection, reading nothing and answering nothing.
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in collector.incoming() {
            held.push(conn);
        }
    });
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let (mut gate, _ids) = three_claims_stuck_in_a_frozen_redis(&redis, &up, |c| {
        c.otlp_endpoint = Some(endpoint.clone());
    })
    .await;
    let started = Instant::now();
    let status = tokio::task::block_in_place(|| gate.terminate(GRACE * 4));
    let took = started.elapsed();
    eprintln!("shutdown took {took:?}");
    redis.resume();
    assert!(status.success(), "{status:?}\n{}", gate.log());
    assert!(
        took < GRACE * 2,
        "shutdown took {took:?} for a 2 s grace with a silent collector\n{}",
        gate.log()
    );
}
