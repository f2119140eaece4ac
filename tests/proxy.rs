//! The request flow end to end: a real upstream over TCP, idemgate in-process, and both
//! stores (each scenario runs once on the embedded store and once on a real redis-server).

#![allow(clippy::unwrap_used)]

use crate::common;

use std::io::Write;
use std::time::Duration;

use common::*;
use idemgate::config::{OnAmbiguous, OnStoreError, Route};

const TRANSFER: &str = r#"{"from":"acc-1","to":"acc-2","amount":1250,"currency":"EUR"}"#;

on_both_stores!(
    retry_replays_the_first_answer_byte_for_byte,
    same_meaning_replays_and_a_changed_amount_is_422,
    duplicate_while_in_flight_gets_409_with_retry_after,
    hundred_simultaneous_identical_requests_execute_once,
    tenants_never_share_records,
    invalid_or_missing_keys_are_400_and_never_forwarded,
    oversized_body_is_413_and_claims_nothing,
    client_that_disconnects_still_gets_its_answer_on_retry,
    refused_upstream_is_502_and_released,
    upstream_timeout_is_504_and_held_as_unknown,
    on_ambiguous_release_frees_the_key,
    lease_is_renewed_while_the_upstream_works,
    admin_inspects_and_releases_records,
    request_id_is_passed_on_or_made_up,
    retry_after_follows_the_routes_upstream_time,
);

async fn retry_replays_the_first_answer_byte_for_byte(backend: Backend) {
    let up = Upstream::start().await;
    let app = spawn_app(config(&up, &backend)).await;
    let c = client();
    let first = post(&c, &app, "/v1/transfers", Some("k-1"), TRANSFER, &[]).await;
    assert_eq!(first.status, 201);
    assert!(!first.replayed());
    assert_eq!(first.header("set-cookie"), Some("session=secret"));
    assert_eq!(
        first.header("x-upstream-hop"),
        None,
        "Connection-named header leaked"
    );
    let second = post(&c, &app, "/v1/transfers", Some("k-1"), TRANSFER, &[]).await;
    assert_eq!(second.status, 201);
    assert!(second.replayed());
    assert_eq!(second.body, first.body);
    assert_eq!(second.header("x-execution"), Some("1"));
    assert_eq!(second.header("content-type"), Some("application/json"));
    assert_eq!(
        second.header("set-cookie"),
        None,
        "Set-Cookie must not be replayed"
    );
    assert!(second.header("date").is_some(), "Date is regenerated");
    assert_eq!(up.hits(), 1);
    // The upstream saw the key as sent, and the forwarding headers.
    let seen = &up.seen()[0];
    assert_eq!(seen.headers["idempotency-key"], vec!["k-1"]);
    assert_eq!(seen.headers["x-forwarded-for"], vec!["127.0.0.1"]);
    assert_eq!(seen.headers["x-forwarded-proto"], vec!["http"]);
    assert_eq!(
        seen.headers["x-forwarded-host"],
        vec![app.addr().to_string()]
    );
    assert_eq!(seen.body, TRANSFER.as_bytes());
    app.shutdown().await;
}

async fn retry_after_follows_the_routes_upstream_time(backend: Backend) {
    let up = Upstream::start().await;
    let app = spawn_app(config(&up, &backend)).await;
    let c = client();
    let slow = [(DELAY_MS, "2500")];
    // One measurement: this route's upstream takes 2.5 s.
    let first = post(&c, &app, "/v1/transfers", Some("k-ra-0"), TRANSFER, &slow).await;
    assert_eq!(first.status, 201);
    let url = format!("http://{}/v1/transfers", app.addr());
    let running = post_in_background(&c, url, "k-ra-1", TRANSFER, &slow);
    upstream_reached(&up, 2).await;
    let dup = post(&c, &app, "/v1/transfers", Some("k-ra-1"), TRANSFER, &slow).await;
    assert_eq!(dup.status, 409);
    let wait: u64 = dup.header("retry-after").unwrap().parse().unwrap();
    // 2.5 s typical, a fraction of it passed: 2 or 3 s, rounded up; not the 1 s of a
    // route that answers at once.
    assert!((2..=3).contains(&wait), "Retry-After: {wait}");
    assert_eq!(running.await.unwrap().status, 201);
    assert_eq!(up.hits(), 2);
    app.shutdown().await;
}

async fn request_id_is_passed_on_or_made_up(backend: Backend) {
    let up = Upstream::start().await;
    let app = spawn_app(config(&up, &backend)).await;
    let c = client();
    let given = [("x-request-id", "gw-5d1e-0001")];
    let first = post(&c, &app, "/v1/transfers", Some("k-rid"), TRANSFER, &given).await;
    assert_eq!(first.status, 201);
    assert_eq!(first.header("x-request-id"), Some("gw-5d1e-0001"));
    assert_eq!(up.seen()[0].headers["x-request-id"], vec!["gw-5d1e-0001"]);
    // A retry without one gets an id of its own, on the replay too.
    let retry = post(&c, &app, "/v1/transfers", Some("k-rid"), TRANSFER, &[]).await;
    assert!(retry.replayed());
    let made = retry.header("x-request-id").unwrap();
    assert_eq!(made.len(), 32, "{made}");
    assert!(made.bytes().all(|b| b.is_ascii_hexdigit()), "{made}");
    // Forwarded without one: the upstream and the client see the same fresh id.
    let other = post(&c, &app, "/v1/transfers", Some("k-rid-2"), TRANSFER, &[]).await;
    let made2 = other.header("x-request-id").unwrap();
    assert_ne!(made2, made);
    assert_eq!(up.seen()[1].headers["x-request-id"], vec![made2]);
    // Idemgate's own answers carry it, and so does a pass-through.
    let bad = post(&c, &app, "/v1/transfers", Some(""), TRANSFER, &given).await;
    assert_eq!(bad.status, 400);
    assert_eq!(bad.header("x-request-id"), Some("gw-5d1e-0001"));
    let get = c
        .get(format!("http://{}/v1/accounts", app.addr()))
        .header("x-request-id", "bad id with spaces")
        .send()
        .await
        .unwrap();
    let passed = get.headers()["x-request-id"].to_str().unwrap().to_string();
    assert_eq!(passed.len(), 32, "a malformed id is replaced: {passed}");
    assert_eq!(up.seen()[2].headers["x-request-id"], vec![passed]);
    app.shutdown().await;
}

async fn same_meaning_replays_and_a_changed_amount_is_422(backend: Backend) {
    let up = Upstream::start().await;
    let app = spawn_app(config(&up, &backend)).await;
    let c = client();
    let first = post(&c, &app, "/v1/transfers", Some("k-2"), TRANSFER, &[]).await;
    assert_eq!(first.status, 201);
    let reordered =
        "{ \"currency\": \"EUR\",\n \"amount\": 1250, \"to\": \"acc-2\", \"from\": \"acc-1\" }";
    let again = post(&c, &app, "/v1/transfers", Some("k-2"), reordered, &[]).await;
    assert!(
        again.replayed(),
        "reordered keys and whitespace must replay"
    );
    assert_eq!(again.body, first.body);
    let changed = TRANSFER.replace("1250", "1251");
    let mismatch = post(&c, &app, "/v1/transfers", Some("k-2"), &changed, &[]).await;
    assert_eq!(mismatch.status, 422);
    assert_eq!(
        mismatch.header("content-type"),
        Some("application/problem+json")
    );
    assert!(mismatch.problem_type().ends_with("/fingerprint-mismatch"));
    assert!(mismatch.json()["record_id"]
        .as_str()
        .is_some_and(|s| s.len() == 64));
    // The same key on another path is another record; a query string changes the meaning.
    let other_query = post(
        &c,
        &app,
        "/v1/transfers?dry_run=1",
        Some("k-2"),
        TRANSFER,
        &[],
    )
    .await;
    assert_eq!(other_query.status, 422);
    assert_eq!(up.hits(), 1);
    app.shutdown().await;
}

async fn duplicate_while_in_flight_gets_409_with_retry_after(backend: Backend) {
    let up = Upstream::start().await;
    up.set_delay(Duration::from_millis(600));
    let app = spawn_app(config(&up, &backend)).await;
    let c = client();
    let url = format!("http://{}/v1/transfers", app.addr());
    let first = post_in_background(&c, url, "k-3", TRANSFER, &[]);
    upstream_reached(&up, 1).await;
    let dup = post(&c, &app, "/v1/transfers", Some("k-3"), TRANSFER, &[]).await;
    assert_eq!(dup.status, 409);
    assert!(dup.problem_type().ends_with("/in-progress"));
    assert_eq!(dup.header("retry-after"), Some("1"));
    assert_eq!(dup.header("idemgate-error"), Some("in-progress"));
    assert_eq!(first.await.unwrap().status, 201);
    let after = post(&c, &app, "/v1/transfers", Some("k-3"), TRANSFER, &[]).await;
    assert!(after.replayed());
    assert_eq!(up.hits(), 1);
    app.shutdown().await;
}

async fn hundred_simultaneous_identical_requests_execute_once(backend: Backend) {
    let up = Upstream::start().await;
    up.set_delay(Duration::from_millis(50));
    let app = spawn_app(config(&up, &backend)).await;
    let c = reqwest::Client::new();
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..100 {
        let (c, addr) = (c.clone(), app.addr());
        set.spawn(async move {
            let r = c
                .post(format!("http://{addr}/v1/transfers"))
                .header("content-type", "application/json")
                .header("idempotency-key", "k-hundred")
                .body(TRANSFER)
                .send()
                .await
                .expect("request");
            let status = r.status().as_u16();
            let replayed = r.headers().contains_key("idempotent-replayed");
            (status, replayed, r.bytes().await.expect("body"))
        });
    }
    let mut executed = Vec::new();
    let mut replays = Vec::new();
    while let Some(r) = set.join_next().await {
        let (status, replayed, body) = r.unwrap();
        match (status, replayed) {
            (201, false) => executed.push(body),
            (201, true) => replays.push(body),
            (409, _) => {}
            other => panic!("unexpected answer {other:?}"),
        }
    }
    assert_eq!(executed.len(), 1, "exactly one execution");
    assert!(
        replays.iter().all(|b| *b == executed[0]),
        "replays are byte-identical"
    );
    assert_eq!(up.hits(), 1);
    app.shutdown().await;
}

async fn tenants_never_share_records(backend: Backend) {
    let up = Upstream::start().await;
    let app = spawn_app(config(&up, &backend)).await;
    let c = client();
    let alice = [("authorization", "Bearer alice")];
    let bob = [("authorization", "Bearer bob")];
    let a1 = post(&c, &app, "/v1/transfers", Some("same"), TRANSFER, &alice).await;
    let b1 = post(&c, &app, "/v1/transfers", Some("same"), TRANSFER, &bob).await;
    assert!(!a1.replayed() && !b1.replayed());
    assert_ne!(a1.body, b1.body, "bob got his own execution");
    let a2 = post(&c, &app, "/v1/transfers", Some("same"), TRANSFER, &alice).await;
    let b2 = post(&c, &app, "/v1/transfers", Some("same"), TRANSFER, &bob).await;
    assert_eq!((a2.body.clone(), b2.body.clone()), (a1.body, b1.body));
    assert!(a2.replayed() && b2.replayed());
    assert_eq!(up.hits(), 2);
    app.shutdown().await;
}

async fn invalid_or_missing_keys_are_400_and_never_forwarded(backend: Backend) {
    let up = Upstream::start().await;
    let mut cfg = config(&up, &backend);
    cfg.routes.push(Route {
        path: "/v1/transfers".into(),
        require_key: Some(true),
        ..Route::default()
    });
    let app = spawn_app(cfg).await;
    let c = client();
    let missing = post(&c, &app, "/v1/transfers", None, TRANSFER, &[]).await;
    assert_eq!(missing.status, 400);
    assert!(missing.problem_type().ends_with("/missing-key"));
    let long = "k".repeat(256);
    for bad in ["", "\"\"", "a b", "a,b", "\"unterminated", long.as_str()] {
        let r = post(&c, &app, "/v1/transfers", Some(bad), TRANSFER, &[]).await;
        assert_eq!(r.status, 400, "key {bad:?}");
        assert!(r.problem_type().ends_with("/invalid-key"), "key {bad:?}");
    }
    // Two header lines.
    let r = c
        .post(format!("http://{}/v1/transfers", app.addr()))
        .header("idempotency-key", "a")
        .header("idempotency-key", "b")
        .body(TRANSFER)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    // Non-ASCII bytes, which reqwest will not send: a raw request.
    let raw = send_raw(
        app.addr(),
        b"POST /v1/transfers HTTP/1.1\r\nhost: x\r\nidempotency-key: caf\xc3\xa9\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}",
    );
    assert!(raw.starts_with("HTTP/1.1 400"), "{raw}");
    assert_eq!(up.hits(), 0);
    // Outside the route, a protected method without a key passes through unprotected.
    let free = post(&c, &app, "/v1/other", None, TRANSFER, &[]).await;
    assert_eq!(free.status, 201);
    let free2 = post(&c, &app, "/v1/other", None, TRANSFER, &[]).await;
    assert!(!free2.replayed());
    assert_eq!(up.hits(), 2);
    app.shutdown().await;
}

async fn oversized_body_is_413_and_claims_nothing(backend: Backend) {
    let up = Upstream::start().await;
    let mut cfg = config(&up, &backend);
    cfg.defaults.max_body_bytes = 64;
    let app = spawn_app(cfg).await;
    let c = client();
    let big = format!("{{\"memo\":\"{}\"}}", "x".repeat(100));
    let r = post(&c, &app, "/v1/transfers", Some("k-big"), &big, &[]).await;
    assert_eq!(r.status, 413);
    assert!(r.problem_type().ends_with("/body-too-large"));
    // Chunked, so no Content-Length to reject early: the limit applies while reading.
    let chunked = send_raw(
        app.addr(),
        format!(
            "POST /v1/transfers HTTP/1.1\r\nhost: x\r\nidempotency-key: k-big\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n{:x}\r\n{big}\r\n0\r\n\r\n",
            big.len()
        )
        .as_bytes(),
    );
    assert!(chunked.starts_with("HTTP/1.1 413"), "{chunked}");
    assert_eq!(up.hits(), 0);
    // Nothing was claimed: the key is free for a request that fits.
    let ok = post(&c, &app, "/v1/transfers", Some("k-big"), "{\"a\":1}", &[]).await;
    assert_eq!(ok.status, 201);
    assert!(!ok.replayed());
    app.shutdown().await;
}

async fn client_that_disconnects_still_gets_its_answer_on_retry(backend: Backend) {
    let up = Upstream::start().await;
    up.set_delay(Duration::from_millis(300));
    let app = spawn_app(config(&up, &backend)).await;
    {
        let mut s = std::net::TcpStream::connect(app.addr()).unwrap();
        let req = format!(
            "POST /v1/transfers HTTP/1.1\r\nhost: x\r\nidempotency-key: k-lost\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{TRANSFER}",
            TRANSFER.len()
        );
        s.write_all(req.as_bytes()).unwrap();
        // Closed right after sending: the client never sees an answer.
    }
    // Once the lost request has reached the upstream, a retry is answered 409 until its
    // exchange is recorded, then replays.
    upstream_reached(&up, 1).await;
    let c = client();
    let retry = retry_until(
        HANG_GUARD,
        async || post(&c, &app, "/v1/transfers", Some("k-lost"), TRANSFER, &[]).await,
        |r| !(r.status == 409 && r.problem_type().ends_with("/in-progress")),
    )
    .await;
    assert_eq!(retry.status, 201);
    assert!(
        retry.replayed(),
        "the exchange finished and was recorded without its client (hits {}, {:?})",
        up.hits(),
        retry.headers
    );
    assert_eq!(up.hits(), 1);
    app.shutdown().await;
}

async fn refused_upstream_is_502_and_released(backend: Backend) {
    let port = free_port();
    let up = Upstream::start().await;
    let mut cfg = config(&up, &backend);
    cfg.upstream = format!("http://127.0.0.1:{port}");
    let app = spawn_app(cfg).await;
    let c = client();
    let r = post(&c, &app, "/v1/transfers", Some("k-refused"), TRANSFER, &[]).await;
    assert_eq!(r.status, 502);
    assert!(r.problem_type().ends_with("/upstream-unreachable"));
    drop(up);
    let up = Upstream::start_on(port).await;
    let retry = post(&c, &app, "/v1/transfers", Some("k-refused"), TRANSFER, &[]).await;
    assert_eq!(retry.status, 201);
    assert!(!retry.replayed(), "the released key executes normally");
    assert_eq!(up.hits(), 1);
    app.shutdown().await;
}

async fn upstream_timeout_is_504_and_held_as_unknown(backend: Backend) {
    let timeout = Duration::from_millis(300);
    let (up, app) = hanging_upstream(&backend, timeout, |_| {}).await;
    let c = client();
    let r = post(&c, &app, "/v1/transfers", Some("k-hang"), TRANSFER, &[]).await;
    assert_eq!(r.status, 504);
    assert!(r.problem_type().ends_with("/upstream-timeout"));
    up.set_mode(Mode::Answer);
    for _ in 0..3 {
        let retry = post(&c, &app, "/v1/transfers", Some("k-hang"), TRANSFER, &[]).await;
        assert_eq!(retry.status, 409);
        assert!(retry.problem_type().ends_with("/outcome-unknown"));
    }
    assert_eq!(up.hits(), 1, "an ambiguous outcome is never executed again");
    app.shutdown().await;
}

async fn on_ambiguous_release_frees_the_key(backend: Backend) {
    let timeout = Duration::from_millis(300);
    let (up, app) = hanging_upstream(&backend, timeout, |c| {
        c.defaults.on_ambiguous = OnAmbiguous::Release
    })
    .await;
    let c = client();
    let r = post(&c, &app, "/v1/transfers", Some("k-rel"), TRANSFER, &[]).await;
    assert_eq!(r.status, 504);
    up.set_mode(Mode::Answer);
    let retry = post(&c, &app, "/v1/transfers", Some("k-rel"), TRANSFER, &[]).await;
    assert_eq!(retry.status, 201);
    assert!(!retry.replayed());
    assert_eq!(up.hits(), 2);
    app.shutdown().await;
}

async fn lease_is_renewed_while_the_upstream_works(backend: Backend) {
    let up = Upstream::start().await;
    up.set_delay(Duration::from_millis(1500));
    let mut cfg = config(&up, &backend);
    cfg.defaults.lease = Duration::from_millis(300);
    let app = spawn_app(cfg).await;
    let c = client();
    let url = format!("http://{}/v1/transfers", app.addr());
    let first = post_in_background(&c, url, "k-lease", TRANSFER, &[]);
    upstream_reached(&up, 1).await;
    // Well past the unrenewed lease, the record must still read as in progress.
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let dup = post(&c, &app, "/v1/transfers", Some("k-lease"), TRANSFER, &[]).await;
        if dup.status == 201 {
            break; // finished meanwhile
        }
        assert!(
            dup.problem_type().ends_with("/in-progress"),
            "{:?}",
            dup.body
        );
    }
    assert_eq!(first.await.unwrap().status, 201);
    let after = post(&c, &app, "/v1/transfers", Some("k-lease"), TRANSFER, &[]).await;
    assert!(after.replayed());
    assert_eq!(up.hits(), 1);
    app.shutdown().await;
}

async fn admin_inspects_and_releases_records(backend: Backend) {
    let timeout = Duration::from_millis(200);
    let (up, app) = hanging_upstream(&backend, timeout, |_| {}).await;
    let admin = app.admin_addr().expect("admin listener");
    let c = client();
    let r = post(&c, &app, "/v1/transfers", Some("k-admin"), TRANSFER, &[]).await;
    assert_eq!(r.status, 504);
    let id = r.json()["record_id"].as_str().unwrap().to_string();
    let view: serde_json::Value = c
        .get(format!("http://{admin}/records/{id}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(view["state"], "unknown");
    assert!(view.get("body").is_none());
    let status = |req: reqwest::RequestBuilder| async move { req.send().await.unwrap().status() };
    let health = status(c.get(format!("http://{admin}/healthz"))).await;
    assert_eq!(health, 200);
    let ready = status(c.get(format!("http://{admin}/readyz"))).await;
    assert_eq!(ready, 200);
    // After reconciling with the upstream, an operator releases the record.
    let del = status(c.delete(format!("http://{admin}/records/{id}?reason=reconciled"))).await;
    assert_eq!(del, 200);
    let gone = status(c.get(format!("http://{admin}/records/{id}"))).await;
    assert_eq!(gone, 404);
    up.set_mode(Mode::Answer);
    let retry = post(&c, &app, "/v1/transfers", Some("k-admin"), TRANSFER, &[]).await;
    assert_eq!(retry.status, 201);
    assert_eq!(up.hits(), 2);
    app.shutdown().await;
}

// ---- Redis only ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_store_error_forward_forwards_unprotected() {
    let mut redis = RedisServer::start();
    let up = Upstream::start().await;
    let mut cfg = redis_config(&up, &redis);
    cfg.store_timeout = Duration::from_millis(300);
    cfg.defaults.on_store_error = OnStoreError::Forward;
    let app = spawn_app(cfg).await;
    redis.stop();
    let r = post(
        &client(),
        &app,
        "/v1/transfers",
        Some("k-fwd"),
        TRANSFER,
        &[],
    )
    .await;
    assert_eq!(r.status, 201);
    assert_eq!(up.hits(), 1);
    assert_eq!(up.seen()[0].body, TRANSFER.as_bytes());
    app.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_sharing_one_redis_execute_once() {
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    up.set_delay(Duration::from_millis(50));
    let cfg = redis_config(&up, &redis);
    let a = spawn_app(cfg.clone()).await;
    let b = spawn_app(cfg).await;
    let c = reqwest::Client::new();
    let mut set = tokio::task::JoinSet::new();
    for i in 0..100 {
        let addr = if i % 2 == 0 { a.addr() } else { b.addr() };
        let c = c.clone();
        set.spawn(async move {
            let r = c
                .post(format!("http://{addr}/v1/transfers"))
                .header("content-type", "application/json")
                .header("idempotency-key", "k-shared")
                .body(TRANSFER)
                .send()
                .await
                .expect("request");
            (
                r.status().as_u16(),
                r.headers().contains_key("idempotent-replayed"),
                r.bytes().await.expect("body"),
            )
        });
    }
    let mut executed = Vec::new();
    let mut replays = Vec::new();
    while let Some(r) = set.join_next().await {
        match r.unwrap() {
            (201, false, body) => executed.push(body),
            (201, true, body) => replays.push(body),
            (409, _, _) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(executed.len(), 1);
    assert!(replays.iter().all(|b| *b == executed[0]));
    assert_eq!(up.hits(), 1);
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicting_redis_is_refused_at_start() {
    let redis = RedisServer::start_with(&["--maxmemory-policy", "volatile-lru"]);
    let up = Upstream::start().await;
    let cfg = redis_config(&up, &redis);
    let err = idemgate::start(cfg).await.err().expect("must refuse");
    assert!(err.to_string().contains("volatile-lru"), "{err}");
    assert!(err.to_string().contains("noeviction"), "{err}");
}

#[tokio::test]
async fn pass_through_streams_other_methods_untouched() {
    let up = Upstream::start().await;
    let app = spawn_app(config(&up, &Backend::memory())).await;
    let c = client();
    for _ in 0..2 {
        let r = c
            .get(format!("http://{}/v1/accounts/7?x=1", app.addr()))
            .header("idempotency-key", "k-get")
            .header("connection", "keep-alive, x-hop")
            .header("x-hop", "secret")
            .header("te", "trailers")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201);
        assert!(!r.headers().contains_key("idempotent-replayed"));
        assert!(r.headers().contains_key("set-cookie"));
    }
    assert_eq!(up.hits(), 2, "GET is not protected");
    let seen = &up.seen()[0];
    assert_eq!(seen.uri, "/v1/accounts/7?x=1");
    assert!(!seen.headers.contains_key("x-hop"));
    assert!(!seen.headers.contains_key("te"));
    assert_eq!(seen.headers["idempotency-key"], vec!["k-get"]);
    assert_eq!(seen.headers["host"], vec![up.addr.to_string()]);
    app.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_clients_get_the_same_protection() {
    let up = Upstream::start().await;
    let app = spawn_app(config(&up, &Backend::memory())).await;
    let c = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let send = || async {
        let r = c
            .post(format!("http://{}/v1/transfers", app.addr()))
            .header("content-type", "application/json")
            .header("idempotency-key", "k-h2")
            .body(TRANSFER)
            .send()
            .await
            .unwrap();
        assert_eq!(r.version(), reqwest::Version::HTTP_2);
        let replayed = r.headers().contains_key("idempotent-replayed");
        (r.status().as_u16(), replayed, r.bytes().await.unwrap())
    };
    let (s1, r1, b1) = send().await;
    let (s2, r2, b2) = send().await;
    assert_eq!((s1, r1, s2, r2), (201, false, 201, true));
    assert_eq!(b1, b2);
    assert_eq!(up.hits(), 1);
    // The upstream is spoken to in HTTP/1.1 and learns the original authority.
    assert_eq!(
        up.seen()[0].headers["x-forwarded-host"],
        vec![app.addr().to_string()]
    );
    app.shutdown().await;
}

// A trailer field on a protected request is outside its fingerprint: forwarded, a retry
// with another checksum would replay the first answer; dropped (as before), the upstream
// acts on a request the client did not send. Refused, nothing claimed or forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trailers_on_a_protected_request_are_refused() {
    let up = Upstream::start().await;
    let app = spawn_app(config(&up, &Backend::memory())).await;
    let addr = app.addr();
    let text = tokio::task::spawn_blocking(move || {
        send_raw(
            addr,
            b"POST /v1/transfers HTTP/1.1\r\nhost: x\r\nidempotency-key: with-trailer\r\n\
              content-type: application/json\r\ntransfer-encoding: chunked\r\ntrailer: x-checksum\r\n\
              connection: close\r\n\r\n2\r\n{}\r\n0\r\nx-checksum: abc\r\n\r\n",
        )
    })
    .await
    .unwrap();
    assert!(text.starts_with("HTTP/1.1 400"), "{text}");
    assert!(text.contains("trailers-not-supported"), "{text}");
    assert_eq!(up.hits(), 0, "nothing forwarded");
    // Without the trailer the same key executes normally: nothing was claimed.
    let ok = post(
        &client(),
        &app,
        "/v1/transfers",
        Some("with-trailer"),
        "{}",
        &[],
    )
    .await;
    assert_eq!(ok.status, 201, "{:?}", ok.body);
    app.shutdown().await;
}
