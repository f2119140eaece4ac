//! Observe mode, through the binary: every request reaches the upstream as it would without
//! idemgate, while what enforcing would have done is counted and records are made as when
//! enforcing, so that switching a route to `enforce` replays what was seen.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::{Duration, Instant};

use common::*;
use idemgate::config::{Anonymous, Mode, Route, Secret};

fn observe_json(gate: &Gate) -> serde_json::Value {
    let raw = http_get(gate.admin, "/observe").unwrap();
    let body = raw.split("\r\n\r\n").nth(1).unwrap_or("");
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {raw}"))
}

const OVERRIDE: &str = "x-http-method-override";

/// An instance in front of `up` that observes every route, where enforcing would require a
/// key.
fn observing(up: &Upstream) -> Idemgate {
    Idemgate::new(&up.url()).set(|c| {
        c.defaults.mode = Mode::Observe;
        c.defaults.require_key = true;
    })
}

async fn everything_is_forwarded_and_counted(redis_url: &str) {
    let up = Upstream::start().await;
    let gate = observing(&up).redis_url(redis_url).binary();
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
    // A duplicate is counted once its record says what the first execution answered: for
    // k2's, after the slow first one's record is written, which follows its answer. Until
    // then `duplicates_settling` counts it.
    let o = common::retry_until(
        Duration::from_secs(5),
        async || observe_json(&gate),
        |o| o["duplicates_settling"] == 0,
    )
    .await;
    assert_eq!(o["duplicates_settling"], 0, "{o}");
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
    // k1 ran three times (its retry and its other body), k2 twice: two duplicates, k1's
    // retry and k2's; the other body is a request of its own (`mismatch`), not a duplicate.
    assert_eq!(route["duplicates_let_through"], 2, "{o}");
    assert!(o["since_ms"].as_u64().unwrap() > 0);
    assert_eq!(
        gate.metric_or_zero("idemgate_requests_total{route=\"default\",outcome=\"observed\"}"),
        7.0
    );
    assert_eq!(
        gate.metric_or_zero("idemgate_observed_total{route=\"default\",would=\"replay\"}"),
        1.0
    );
    assert_eq!(
        gate.metric_or_zero("idemgate_route_mode{route=\"default\",mode=\"observe\"}"),
        1.0
    );
    // Records are real: the same store, enforced, replays what was observed.
    if !redis_url.is_empty() {
        let enforce = Idemgate::new(&up.url()).redis_url(redis_url).binary();
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
    let gate = observing(&up)
        .redis(&redis)
        .set(|c| c.store_timeout = Duration::from_millis(500))
        .binary();
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

/// What enforcing refuses for an unseen method override is forwarded and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observe_forwards_an_unseen_method_override() {
    let up = Upstream::start().await;
    let gate = observing(&up).binary();
    let url = gate.url("/v1/transfers");
    let a = post_url(&client(), &url, Some("ov-1"), "{}", &[(OVERRIDE, "DELETE")]).await;
    assert_eq!(a.status, 201);
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
    let gate = observing(&up).binary();
    for path in [
        "/v1/a%2Fb",
        "/v1/transfers;jsessionid=A",
        "/v1;v=2/transfers",
    ] {
        let a = post_url(&client(), &gate.url(path), Some("p-1"), "{}", &[]).await;
        assert_eq!(a.status, 201, "{path}");
    }
    assert_eq!(up.hits(), 3);
    let seen: Vec<String> = up.seen().into_iter().map(|s| s.uri).collect();
    assert!(seen[0].ends_with("/v1/a%2Fb"), "{seen:?}");
    assert!(seen[1].ends_with("/v1/transfers;jsessionid=A"), "{seen:?}");
    let o = observe_json(&gate);
    assert_eq!(o["routes"][0]["would"]["invalid_path"], 3, "{o}");
    // Enforcing, the same paths are refused and nothing reaches the upstream.
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url()).binary();
    for path in ["/v1/a%2Fb", "/v1/transfers;jsessionid=A"] {
        let auth = [("authorization", "Bearer a")];
        let a = post_url(&client(), &gate.url(path), Some("p-1"), "{}", &auth).await;
        assert_eq!(a.status, 400, "{path}");
        assert_eq!(a.headers["idemgate-error"], "invalid-path", "{path}");
    }
    assert_eq!(up.hits(), 0);
}

/// `GET /observe` with a token of `token`, status and body.
async fn observe_with(gate: &Gate, token: Option<&str>) -> (u16, String) {
    let mut req = client().get(gate.admin_url("/observe"));
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let res = req.send().await.unwrap();
    (res.status().as_u16(), res.text().await.unwrap())
}

/// A route of `o`'s `routes` by its label.
fn route<'a>(o: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    o["routes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["route"] == name)
        .unwrap_or_else(|| panic!("no route {name} in {o}"))
}

/// `POST /records/lookup` on the admin listener: the state of a request's record (`null`
/// for none).
async fn record_state(gate: &Gate, path: &str, key: &str) -> serde_json::Value {
    let lookup = serde_json::json!({"method": "POST", "path": path, "key": key, "headers": {}});
    let r = client()
        .post(gate.admin_url("/records/lookup"))
        .json(&lookup)
        .send()
        .await
        .unwrap();
    let v: serde_json::Value = r.json().await.unwrap();
    v["state"].clone()
}

async fn state_becomes(gate: &Gate, path: &str, key: &str, want: &str) {
    let state = common::retry_until(
        Duration::from_secs(10),
        async || record_state(gate, path, key).await,
        |state| state == want,
    )
    .await;
    assert_eq!(state, want, "record {key}");
}

/// One `[[routes]]` entry observed beside an enforcing default: its requests are counted
/// under the route's configured path, and the default still refuses and replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observed_route_beside_an_enforcing_default_is_counted_under_its_path() {
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url())
        .set(|c| {
            c.routes = vec![Route {
                path: "/v1/observed".into(),
                mode: Some(Mode::Observe),
                ..Route::default()
            }];
            c.defaults.require_key = true;
        })
        .binary();
    let c = client();
    let (observed, enforced) = (gate.url("/v1/observed"), gate.url("/v1/transfers"));
    let first = post_url(&c, &observed, Some("r-1"), "{}", &[]).await;
    let again = post_url(&c, &observed, Some("r-1"), "{}", &[]).await;
    assert_eq!((first.status, again.status), (201, 201));
    assert!(!again.replayed(), "the observed route executes the retry");
    let keyless = post_url(&c, &observed, None, "{}", &[]).await;
    assert_eq!(keyless.status, 201, "{:?}", keyless.body);
    assert_eq!(up.hits(), 3);
    // The default route enforces: a replay, and 400 without a key.
    let done = post_url(&c, &enforced, Some("r-1"), "{}", &[]).await;
    let replay = post_url(&c, &enforced, Some("r-1"), "{}", &[]).await;
    assert_eq!(done.status, 201);
    assert!(replay.replayed());
    assert_eq!(replay.body, done.body);
    let refused = post_url(&c, &enforced, None, "{}", &[]).await;
    assert_eq!(refused.status, 400);
    assert_eq!(refused.header("idemgate-error"), Some("missing-key"));
    assert_eq!(up.hits(), 4);

    let o = observe_json(&gate);
    let obs = route(&o, "/v1/observed");
    assert_eq!(obs["mode"], "observe", "{o}");
    assert_eq!(
        obs["would"],
        serde_json::json!({"execute": 1, "replay": 1, "missing_key": 1}),
        "{o}"
    );
    assert_eq!(obs["duplicates_let_through"], 1, "{o}");
    let default = route(&o, "default");
    assert_eq!(default["mode"], "enforce", "{o}");
    assert_eq!(default["would"], serde_json::json!({}), "{o}");
    for (series, want) in [
        (
            "idemgate_observed_total{route=\"/v1/observed\",would=\"replay\"}",
            1.0,
        ),
        (
            "idemgate_observed_total{route=\"/v1/observed\",would=\"missing_key\"}",
            1.0,
        ),
        (
            "idemgate_requests_total{route=\"/v1/observed\",outcome=\"observed\"}",
            3.0,
        ),
        (
            "idemgate_requests_total{route=\"default\",outcome=\"replayed\"}",
            1.0,
        ),
        (
            "idemgate_requests_total{route=\"default\",outcome=\"rejected\"}",
            1.0,
        ),
        (
            "idemgate_route_mode{route=\"/v1/observed\",mode=\"observe\"}",
            1.0,
        ),
        (
            "idemgate_route_mode{route=\"default\",mode=\"enforce\"}",
            1.0,
        ),
    ] {
        assert_eq!(gate.metric_or_zero(series), want, "{series}");
    }
}

const JWT_SECRET: &str = "observe-test-hs256-secret-0123456789";

/// What enforcing refuses before the claim, on observed routes: a missing tenant, a bearer
/// token that does not verify, a body over `max_body_bytes` (declared, or streamed without
/// a length), no slot and no queue, and a key on a method the route does not protect. Each
/// reaches the upstream as sent, and is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observed_routes_forward_what_enforcing_refuses_before_the_claim() {
    let up = Upstream::start().await;
    let refusing = |path: &str| Route {
        path: path.into(),
        anonymous: Some(Anonymous::Refuse),
        ..Route::default()
    };
    let gate = Idemgate::new(&up.url())
        .set(|c| {
            c.defaults.mode = Mode::Observe;
            c.routes = vec![
                Route {
                    tenant_headers: Some(vec!["x-tenant".into()]),
                    ..refusing("/v1/tenanted")
                },
                Route {
                    tenant_jwt_claim: Some("sub".into()),
                    ..refusing("/v1/jwt")
                },
                Route {
                    path: "/v1/small".into(),
                    max_body_bytes: Some(1024),
                    ..Route::default()
                },
            ];
            c.jwt_hs256_secret = Some(Secret::from(JWT_SECRET));
            c.max_in_flight = 1;
            c.max_queued = 0;
        })
        .binary();
    let c = client();
    let would = |route_name: &str| {
        let o = observe_json(&gate);
        route(&o, route_name)["would"].clone()
    };

    // No tenant where the route requires one (400 `missing-tenant` when enforcing).
    let a = post_url(&c, &gate.url("/v1/tenanted"), Some("t-1"), "{}", &[]).await;
    assert_eq!(a.status, 201, "{:?}", a.body);
    let b = post_url(
        &c,
        &gate.url("/v1/tenanted"),
        Some("t-1"),
        "{}",
        &[("x-tenant", "acme")],
    )
    .await;
    assert_eq!(b.status, 201);
    assert_eq!(
        would("/v1/tenanted"),
        serde_json::json!({"missing_tenant": 1, "execute": 1})
    );

    // A token signed with another secret (401 `invalid-token`): forwarded with its
    // Authorization as sent.
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 600;
    let claims = serde_json::json!({"sub": "acct-1", "exp": exp});
    let forged = common::idp::hs256_bearer("another-secret-0123456789abcdefghij", &claims);
    let a = post_url(
        &c,
        &gate.url("/v1/jwt"),
        Some("j-1"),
        "{}",
        &[("authorization", &forged)],
    )
    .await;
    assert_eq!(a.status, 201, "{:?}", a.body);
    assert_eq!(a.header("www-authenticate"), None);
    let seen = up.seen();
    assert_eq!(seen.last().unwrap().headers["authorization"], vec![forged]);
    let good = common::idp::hs256_bearer(JWT_SECRET, &claims);
    let b = post_url(
        &c,
        &gate.url("/v1/jwt"),
        Some("j-1"),
        "{}",
        &[("authorization", &good)],
    )
    .await;
    assert_eq!(b.status, 201);
    assert_eq!(
        would("/v1/jwt"),
        serde_json::json!({"invalid_token": 1, "execute": 1})
    );

    // A body over max_body_bytes (413 when enforcing), declared by its Content-Length:
    // forwarded whole.
    let big = format!("{{\"memo\":\"{}\"}}", "m".repeat(4000));
    let a = post_url(&c, &gate.url("/v1/small"), Some("s-1"), &big, &[]).await;
    assert_eq!(a.status, 201, "{:?}", a.body);
    assert_eq!(up.seen().last().unwrap().body, big.as_bytes());
    // And one without a length, chunked: read up to the limit, then forwarded, what was
    // read first and the rest as it comes, byte for byte.
    let mut raw = b"POST /v1/small HTTP/1.1\r\nhost: x\r\nidempotency-key: s-2\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n".to_vec();
    for part in big.as_bytes().chunks(700) {
        raw.extend_from_slice(format!("{:x}\r\n", part.len()).as_bytes());
        raw.extend_from_slice(part);
        raw.extend_from_slice(b"\r\n");
    }
    raw.extend_from_slice(b"0\r\n\r\n");
    let addr = gate.addr;
    let answer = tokio::task::spawn_blocking(move || send_raw(addr, &raw))
        .await
        .unwrap();
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
    let last = up.seen().last().unwrap().clone();
    assert_eq!(last.body, big.as_bytes());
    assert!(!last.headers.contains_key("content-length"), "streamed");
    assert_eq!(would("/v1/small"), serde_json::json!({"body_too_large": 2}));

    // No slot (max_in_flight = 1, taken) and no queue (max_queued = 0): 503 when
    // enforcing; forwarded without waiting for the slot.
    let hits = up.hits();
    let slow = {
        let (c, url) = (c.clone(), gate.url("/v1/transfers"));
        tokio::spawn(
            async move { post_url(&c, &url, Some("o-1"), "{}", &[(DELAY_MS, "2000")]).await },
        )
    };
    eventually(Duration::from_secs(5), "the slow request upstream", || {
        up.hits() == hits + 1
    })
    .await;
    let started = Instant::now();
    let a = post_url(&c, &gate.url("/v1/transfers"), Some("o-2"), "{}", &[]).await;
    assert_eq!(a.status, 201, "{:?}", a.body);
    // Answered while the slot's holder is still at the upstream: it did not wait for it.
    assert!(!slow.is_finished(), "waited for the slot");
    assert!(started.elapsed() < common::HANG_GUARD);
    assert_eq!(slow.await.unwrap().status, 201);
    // A key on PUT, which the route does not protect (forwarded unprotected when
    // enforcing too).
    let put = c
        .put(gate.url("/v1/transfers"))
        .header("idempotency-key", "u-1")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(put.status().as_u16(), 201);
    assert_eq!(up.seen().last().unwrap().method, "PUT");
    assert_eq!(
        would("default"),
        serde_json::json!({"execute": 1, "overloaded": 1, "unprotected": 1})
    );
    assert_eq!(
        gate.metric_or_zero("idemgate_requests_total{route=\"default\",outcome=\"observed\"}"),
        3.0
    );
    assert_eq!(up.hits(), 9);
}

/// `GET /observe` is behind `admin_token` when one is set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_observe_endpoint_needs_the_admin_token() {
    let up = Upstream::start().await;
    let token = "observe-admin-token-kq7";
    let gate = observing(&up)
        .set(|c| c.admin_token = Some(Secret::from(token)))
        .binary();
    let (status, body) = observe_with(&gate, None).await;
    assert_eq!(status, 401, "{body}");
    assert!(!body.contains("routes"), "{body}");
    let (status, _) = observe_with(&gate, Some("observe-admin-token-kq8")).await;
    assert_eq!(status, 401);
    let (status, body) = observe_with(&gate, Some(token)).await;
    assert_eq!(status, 200, "{body}");
    let o: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(o["routes"][0]["mode"], "observe", "{o}");
}

const KEY_MARKER: &str = "obs-key-marker-8812";
const AUTH_MARKER: &str = "sk_live_observe_c4f1";

/// During a store outage every observed request would be a `store_unavailable`: the log
/// gets at most about 10 such lines a second, none with a key or an Authorization value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observe_log_lines_are_rate_limited_during_a_store_outage_and_hold_no_secrets() {
    let mut redis = RedisServer::start();
    let up = Upstream::start().await;
    let gate = observing(&up)
        .redis(&redis)
        .set(|c| c.store_timeout = Duration::from_millis(200))
        .binary();
    redis.stop();
    let auth = format!("Bearer {AUTH_MARKER}");
    let started = Instant::now();
    let workers: Vec<_> = (0..8)
        .map(|w| {
            let (c, url, auth) = (client(), gate.url("/v1/transfers"), auth.clone());
            tokio::spawn(async move {
                for i in 0..40 {
                    let key = format!("{KEY_MARKER}-{w}-{i}");
                    let a = post_url(&c, &url, Some(&key), "{}", &[("authorization", &auth)]).await;
                    assert_eq!(a.status, 201, "{:?}", a.body);
                }
            })
        })
        .collect();
    for w in workers {
        w.await.unwrap();
    }
    let took = started.elapsed();
    assert_eq!(up.hits(), 320);
    let o = observe_json(&gate);
    assert_eq!(o["routes"][0]["would"]["store_unavailable"], 320, "{o}");
    let log = gate.log();
    let lines = log
        .lines()
        .filter(|l| l.contains("observe mode: forwarded"))
        .count();
    // The limit is per second of the process's clock: the requests span at most
    // `took` rounded up, plus one second they may straddle.
    let bound = 10 * (took.as_secs() as usize + 2);
    assert!(lines >= 1, "the would-be refusals are logged:\n{log}");
    assert!(
        lines <= bound,
        "{lines} observe lines in {took:?} (at most {bound}):\n{log}"
    );
    assert!(
        log.contains("would=\"store_unavailable\"") || log.contains("would=store_unavailable"),
        "{log}"
    );
    assert!(!log.contains(KEY_MARKER), "a key reached the log:\n{log}");
    assert!(
        !log.contains(AUTH_MARKER),
        "an Authorization value reached the log:\n{log}"
    );
}

/// A frozen store (SIGSTOP: connections open, nothing answered): observed requests are
/// forwarded, and after the first failure about one request a second waits on it (for at
/// most `store_timeout`), not every request, however many arrive at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_store_delays_about_one_observed_request_a_second() {
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let gate = observing(&up)
        .redis(&redis)
        .set(|c| c.store_timeout = Duration::from_millis(400))
        .binary();
    let c = client();
    let url = gate.url("/v1/transfers");
    assert_eq!(
        post_url(&c, &url, Some("warm"), "{}", &[]).await.status,
        201
    );
    redis.pause();
    // The first request after the freeze waits out its store_timeout, and opens the breaker.
    let started = Instant::now();
    let first = post_url(&c, &url, Some("frozen-first"), "{}", &[]).await;
    assert_eq!(first.status, 201);
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(350), "{waited:?}");
    // Then eight clients at once for four seconds. What the store was asked is counted by
    // idemgate itself: each claim or record that Redis, frozen, never answered is one store
    // error. How long each request took is not the measure: on a loaded machine a request
    // can be slow without having waited on the store.
    let store_errors = |gate: &Gate| -> f64 {
        ["claim", "record"]
            .iter()
            .map(|op| gate.metric_or_zero(&format!("idemgate_store_errors_total{{op=\"{op}\"}}")))
            .sum()
    };
    let errors_before = store_errors(&gate);
    let started = Instant::now();
    let workers: Vec<_> = (0..8)
        .map(|w| {
            let (c, url) = (c.clone(), url.clone());
            tokio::spawn(async move {
                let mut sent = 0;
                while started.elapsed() < Duration::from_secs(4) {
                    let a =
                        post_url(&c, &url, Some(&format!("frozen-{w}-{sent}")), "{}", &[]).await;
                    assert_eq!(a.status, 201, "{:?}", a.body);
                    sent += 1;
                }
                sent
            })
        })
        .collect();
    let mut sent = 0;
    for w in workers {
        sent += w.await.unwrap();
    }
    let elapsed = started.elapsed();
    let tried = store_errors(&gate) - errors_before;
    redis.resume();
    assert_eq!(up.hits(), 2 + sent, "every request was forwarded");
    // One trial a second after the breaker opened (a trial whose claim outlives twice the
    // store_timeout lets one more try): without the breaker every request would ask the
    // frozen store.
    let trials = 2 * (elapsed.as_secs() as usize + 1);
    eprintln!("{sent} requests in {elapsed:?}, {tried} asked the frozen store");
    assert!(
        tried as usize <= trials,
        "{tried} of {sent} requests asked the frozen store in {elapsed:?}"
    );
    assert!(
        (sent as f64) > tried,
        "{sent} requests, {tried} asked the store: the breaker let none go on without it"
    );
}

/// Switching a route from observe to enforce on the same Redis (a rolling update, both
/// instances live): a retry of a request still running on the observing instance gets 409
/// from the enforcing one, and once it completed, its recorded answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_running_while_observed_gets_409_from_an_enforcing_instance() {
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let observing = observing(&up).redis(&redis).binary();
    let enforcing = Idemgate::new(&up.url()).redis(&redis).binary();
    let c = client();
    let url = observing.url("/v1/transfers");
    let slow = post_in_background(&c, url, "live-1", "{\"amount\":5}", &[(DELAY_MS, "1500")]);
    eventually(
        Duration::from_secs(5),
        "the observed request upstream",
        || up.hits() == 1,
    )
    .await;
    let during = post_url(
        &c,
        &enforcing.url("/v1/transfers"),
        Some("live-1"),
        "{\"amount\":5}",
        &[],
    )
    .await;
    assert_eq!(during.status, 409, "{:?}", during.body);
    assert_eq!(during.header("idemgate-error"), Some("in-progress"));
    let first = slow.await.unwrap();
    assert_eq!(first.status, 201);
    // Observing, the record of the answer is written after the client has it (as
    // `record_mode = "after_response"`): a retry sent the moment the answer arrived can
    // still find it running (seen: 409 two milliseconds after the answer), and retries as a
    // client would until the record is there.
    let url = enforcing.url("/v1/transfers");
    let after = retry_until(
        Duration::from_secs(5),
        async || post_url(&c, &url, Some("live-1"), "{\"amount\":5}", &[]).await,
        |after| {
            if after.status == 409 {
                assert_eq!(after.header("idemgate-error"), Some("in-progress"));
            }
            after.status != 409
        },
    )
    .await;
    assert!(after.replayed(), "{}", after.status);
    assert_eq!(after.body, first.body);
    assert_eq!(up.hits(), 1, "executed once");
}

/// On the persistent embedded store: records made while observing replay after a restart
/// into enforce mode, and a duplicate let through while observing did not replace the
/// first execution's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observed_records_on_disk_replay_after_a_restart_into_enforce() {
    let up = Upstream::start().await;
    let store = tempfile::tempdir().unwrap();
    let c = client();
    let mut observing = observing(&up).on_disk(store.path()).binary();
    let url = observing.url("/v1/transfers");
    let first = post_url(&c, &url, Some("disk-1"), "{\"amount\":7}", &[]).await;
    let again = post_url(&c, &url, Some("disk-1"), "{\"amount\":7}", &[]).await;
    assert_eq!((first.status, again.status), (201, 201));
    assert_ne!(first.body, again.body, "two executions");
    assert!(observing.terminate(Duration::from_secs(10)).success());
    let enforcing = Idemgate::new(&up.url()).on_disk(store.path()).binary();
    let url = enforcing.url("/v1/transfers");
    let replay = post_url(&c, &url, Some("disk-1"), "{\"amount\":7}", &[]).await;
    assert!(replay.replayed(), "{}", replay.status);
    assert_eq!(replay.body, first.body, "the first execution's answer");
    let other = post_url(&c, &url, Some("disk-1"), "{\"amount\":8}", &[]).await;
    assert_eq!(other.status, 422);
    assert_eq!(up.hits(), 2);
}

/// A record held `in_progress` by an enforcing instance that died (its lease still
/// running), then the route back in observe mode: the retry is forwarded, counted
/// `in_progress`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn back_in_observe_mode_a_record_held_in_progress_refuses_nothing() {
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let mut enforcing = enforcing_with(&up, &redis, 60, 60);
    let hung = {
        let (c, url) = (client(), enforcing.url("/v1/transfers"));
        tokio::spawn(async move {
            c.post(url)
                .header("idempotency-key", "held-ip")
                .header("content-type", "application/json")
                .header(FAULT, "hang")
                .body("{}")
                .send()
                .await
        })
    };
    upstream_reached(&up, 1).await;
    state_becomes(&enforcing, "/v1/transfers", "held-ip", "in_progress").await;
    enforcing.kill();
    assert!(hung.await.unwrap().is_err());
    let observing = observing(&up).redis(&redis).binary();
    assert_eq!(
        record_state(&observing, "/v1/transfers", "held-ip").await,
        "in_progress"
    );
    forwarded_and_counted(&observing, &up, "held-ip", "in_progress").await;
}

/// An enforcing instance on `redis` with this lease and upstream timeout.
fn enforcing_with(up: &Upstream, redis: &RedisServer, lease: u64, upstream_timeout: u64) -> Gate {
    Idemgate::new(&up.url())
        .redis(redis)
        .set(|c| {
            c.defaults.lease = Duration::from_secs(lease);
            c.defaults.upstream_timeout = Duration::from_secs(upstream_timeout);
        })
        .binary()
}

/// A retry of `key` through an observing instance: forwarded (the upstream's second
/// execution), not replayed, and counted as `would` alone.
async fn forwarded_and_counted(observing: &Gate, up: &Upstream, key: &str, would: &str) {
    let url = observing.url("/v1/transfers");
    let a = post_url(&client(), &url, Some(key), "{}", &[]).await;
    assert_eq!(a.status, 201, "{:?}", a.body);
    assert!(!a.replayed());
    assert_eq!(up.hits(), 2);
    let o = observe_json(observing);
    assert_eq!(
        o["routes"][0]["would"],
        serde_json::json!({ (would): 1 }),
        "{o}"
    );
}

/// A record held `unknown` (its exchange timed out, its lease ran out), then the route back
/// in observe mode: the retry is forwarded, counted `unknown`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn back_in_observe_mode_a_record_held_unknown_refuses_nothing() {
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let mut enforcing = enforcing_with(&up, &redis, 1, 1);
    let c = client();
    let url = enforcing.url("/v1/transfers");
    let hung = post_url(&c, &url, Some("held-unknown"), "{}", &[(FAULT, "hang")]).await;
    assert_eq!(hung.status, 504);
    state_becomes(&enforcing, "/v1/transfers", "held-unknown", "unknown").await;
    let refused = post_url(&c, &url, Some("held-unknown"), "{}", &[]).await;
    assert_eq!(refused.status, 409);
    assert_eq!(refused.header("idemgate-error"), Some("outcome-unknown"));
    enforcing.kill();
    let observing = observing(&up).redis(&redis).binary();
    forwarded_and_counted(&observing, &up, "held-unknown", "unknown").await;
}
