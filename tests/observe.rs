//! Observe mode, through the binary: every request reaches the upstream as it would without
//! idemgate, while what enforcing would have done is counted and records are made as when
//! enforcing, so that switching a route to `enforce` replays what was seen.

#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::*;

fn observe_json(gate: &Gate) -> serde_json::Value {
    let raw = http_get(gate.admin, "/observe").unwrap();
    let body = raw.split("\r\n\r\n").nth(1).unwrap_or("");
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {raw}"))
}

fn metric(gate: &Gate, series: &str) -> f64 {
    let text = http_get(gate.admin, "/metrics").unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

const OBSERVE: [(&str, &str); 2] = [
    ("IDEMGATE_DEFAULTS__MODE", "observe"),
    ("IDEMGATE_DEFAULTS__REQUIRE_KEY", "true"),
];

async fn everything_is_forwarded_and_counted(redis_url: &str) {
    let up = Upstream::start().await;
    let gate = Gate::start(&up.url(), redis_url, &OBSERVE);
    let c = client();
    let url = gate.url("/v1/transfers");
    // No key on a require_key route: forwarded, not 400.
    let a = post_url(&c, &url, None, "{\"amount\":1}", &[]).await;
    assert_eq!(a.status, 201, "{:?}", a.body);
    // A key, then its retry: both executed (the second is a duplicate let through).
    let first = post_url(&c, &url, Some("k1"), "{\"amount\":1}", &[]).await;
    let again = post_url(&c, &url, Some("k1"), "{\"amount\":1}", &[]).await;
    assert_eq!((first.status, again.status), (201, 201));
    assert!(!again.replayed(), "observe never replays");
    // The same key with another body: forwarded.
    let other = post_url(&c, &url, Some("k1"), "{\"amount\":2}", &[]).await;
    assert_eq!(other.status, 201);
    // A key too long to be one: forwarded.
    let long = "x".repeat(300);
    let bad = post_url(&c, &url, Some(&long), "{}", &[]).await;
    assert_eq!(bad.status, 201);
    // A retry while the first is still running: forwarded too.
    let (c2, url2) = (c.clone(), url.clone());
    let slow =
        tokio::spawn(
            async move { post_url(&c2, &url2, Some("k2"), "{}", &[(DELAY_MS, "800")]).await },
        );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let during = post_url(&c, &url, Some("k2"), "{}", &[]).await;
    assert_eq!(during.status, 201);
    assert_eq!(slow.await.unwrap().status, 201);
    assert_eq!(up.hits(), 7, "every request reached the upstream");
    let o = observe_json(&gate);
    let route = &o["routes"][0];
    assert_eq!(route["route"], "default", "{o}");
    assert_eq!(route["mode"], "observe", "{o}");
    let would = &route["would"];
    assert_eq!(would["missing_key"], 1, "{o}");
    assert_eq!(would["execute"], 2, "{o}");
    assert_eq!(would["replay"], 1, "{o}");
    assert_eq!(would["mismatch"], 1, "{o}");
    assert_eq!(would["invalid_key"], 1, "{o}");
    assert_eq!(would["in_progress"], 1, "{o}");
    // k1 ran three times (its retry and its other body), k2 twice: three duplicates.
    assert_eq!(route["duplicates_let_through"], 3, "{o}");
    assert!(o["since_ms"].as_u64().unwrap() > 0);
    assert_eq!(
        metric(
            &gate,
            "idemgate_requests_total{route=\"default\",outcome=\"observed\"}"
        ),
        7.0
    );
    assert_eq!(
        metric(
            &gate,
            "idemgate_observed_total{route=\"default\",would=\"replay\"}"
        ),
        1.0
    );
    assert_eq!(
        metric(
            &gate,
            "idemgate_route_mode{route=\"default\",mode=\"observe\"}"
        ),
        1.0
    );
    // Records are real: the same store, enforced, replays what was observed.
    if !redis_url.is_empty() {
        let enforce = Gate::start(&up.url(), redis_url, &[]);
        let replay = post_url(
            &c,
            &enforce.url("/v1/transfers"),
            Some("k1"),
            "{\"amount\":1}",
            &[],
        )
        .await;
        assert_eq!(replay.status, 201);
        assert!(replay.replayed(), "the record made while observing replays");
        assert_eq!(replay.body, first.body, "the first execution's answer");
        assert_eq!(up.hits(), 7);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observe_forwards_everything_and_counts_what_enforcing_would_do_on_the_embedded_store() {
    everything_is_forwarded_and_counted("").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observe_on_redis_makes_records_that_enforcing_replays() {
    let redis = RedisServer::start();
    everything_is_forwarded_and_counted(&redis.url()).await;
}

/// With the store gone, observed requests are still forwarded, and waiting for it costs at
/// most one `store_timeout` a second, not one per request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observe_forwards_when_the_store_is_down_without_waiting_on_it_each_time() {
    let mut redis = RedisServer::start();
    let up = Upstream::start().await;
    let mut env = OBSERVE.to_vec();
    env.push(("IDEMGATE_STORE_TIMEOUT", "500ms"));
    let gate = Gate::start(&up.url(), &redis.url(), &env);
    let c = client();
    let url = gate.url("/v1/transfers");
    redis.stop();
    let started = Instant::now();
    for i in 0..20 {
        let a = post_url(&c, &url, Some(&format!("down-{i}")), "{}", &[]).await;
        assert_eq!(a.status, 201, "{:?}", a.body);
    }
    let took = started.elapsed();
    assert_eq!(up.hits(), 20);
    assert!(took < Duration::from_secs(3), "20 requests took {took:?}");
    let o = observe_json(&gate);
    assert_eq!(o["routes"][0]["would"]["store_unavailable"], 20, "{o}");
}

/// Back to observe after enforcing: a record held in progress or unknown refuses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn back_in_observe_mode_held_records_refuse_nothing() {
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let enforce = Gate::start(
        &up.url(),
        &redis.url(),
        &[
            ("IDEMGATE_DEFAULTS__UPSTREAM_TIMEOUT", "1s"),
            ("IDEMGATE_DEFAULTS__LEASE", "1s"),
        ],
    );
    let c = client();
    // A hung upstream: the key is held (504, then unknown once the lease runs out).
    let hung = post_url(
        &c,
        &enforce.url("/v1/transfers"),
        Some("held"),
        "{}",
        &[(FAULT, "hang")],
    )
    .await;
    assert_eq!(hung.status, 504);
    let refused = post_url(&c, &enforce.url("/v1/transfers"), Some("held"), "{}", &[]).await;
    assert_eq!(refused.status, 409);
    let observe = Gate::start(&up.url(), &redis.url(), &OBSERVE);
    let a = post_url(&c, &observe.url("/v1/transfers"), Some("held"), "{}", &[]).await;
    assert_eq!(a.status, 201, "{:?}", a.body);
    let o = observe_json(&observe);
    let would = &o["routes"][0]["would"];
    assert!(would["unknown"] == 1 || would["in_progress"] == 1, "{o}");
}

/// What enforcing refuses for an unseen method override is forwarded and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observe_forwards_an_unseen_method_override() {
    let up = Upstream::start().await;
    let gate = Gate::start(&up.url(), "", &OBSERVE);
    let a = client()
        .post(gate.url("/v1/transfers"))
        .header("idempotency-key", "ov-1")
        .header("x-http-method-override", "DELETE")
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(a.status().as_u16(), 201);
    assert_eq!(up.hits(), 1);
    let o = observe_json(&gate);
    assert_eq!(o["routes"][0]["would"]["invalid_method_override"], 1, "{o}");
}

/// Paths that enforcing would refuse with 400 `invalid-path`: one that cannot be
/// normalized (an encoded `/`, matched to no route), `;` parameters and a format suffix
/// (refused by the route they belong to). Observed, each is forwarded as sent and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observe_forwards_paths_that_enforcing_refuses() {
    let up = Upstream::start().await;
    let gate = Gate::start(&up.url(), "", &OBSERVE);
    for path in [
        "/v1/a%2Fb",
        "/v1/transfers;jsessionid=A",
        "/v1;v=2/transfers",
    ] {
        let a = client()
            .post(gate.url(path))
            .header("idempotency-key", "p-1")
            .header("content-type", "application/json")
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(a.status().as_u16(), 201, "{path}");
    }
    assert_eq!(up.hits(), 3);
    let seen: Vec<String> = up.seen().into_iter().map(|s| s.uri).collect();
    assert!(seen[0].ends_with("/v1/a%2Fb"), "{seen:?}");
    assert!(seen[1].ends_with("/v1/transfers;jsessionid=A"), "{seen:?}");
    let o = observe_json(&gate);
    assert_eq!(o["routes"][0]["would"]["invalid_path"], 3, "{o}");
    // Enforcing, the same paths are refused and nothing reaches the upstream.
    let up = Upstream::start().await;
    let gate = Gate::start(&up.url(), "", &[]);
    for path in ["/v1/a%2Fb", "/v1/transfers;jsessionid=A"] {
        let a = client()
            .post(gate.url(path))
            .header("idempotency-key", "p-1")
            .header("authorization", "Bearer a")
            .header("content-type", "application/json")
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(a.status().as_u16(), 400, "{path}");
        assert_eq!(a.headers()["idemgate-error"], "invalid-path", "{path}");
    }
    assert_eq!(up.hits(), 0);
}
