//! Faults on the wire between idemgate and a real `redis-server`, injected by a TCP proxy
//! (`common::faultproxy`): a claim whose reply is lost and whose release is cut, a claim held
//! back on a connection that is cut so that its release overtakes it, and a store stall
//! that lets a lease lapse while its owner still waits for the upstream. What must hold: a
//! claim that was never forwarded ends released (retries execute normally, once), never
//! `unknown`; and an operator cannot release a record whose owner may still be working
//! without saying so.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::{Duration, Instant};

use common::faultproxy::FaultProxy;
use common::*;

const TRANSFER: &str = r#"{"from":"acc-1","to":"acc-2","amount":1250,"currency":"EUR"}"#;

/// Redis behind a fault proxy, an upstream, and idemgate talking to Redis through the
/// proxy, its connection warmed by one request (execution 1).
struct Rig {
    redis: RedisServer,
    proxy: FaultProxy,
    up: Upstream,
    app: idemgate::Running,
    c: reqwest::Client,
}

async fn rig(lease: Duration) -> Rig {
    let redis = RedisServer::start();
    let proxy = FaultProxy::for_redis(&redis).await;
    let up = Upstream::start().await;
    let mut cfg = redis_config(&up, &redis);
    cfg.redis_url = Some(proxy.redis_url());
    cfg.store_timeout = Duration::from_millis(300);
    cfg.defaults.lease = lease;
    cfg.defaults.retention = Duration::from_secs(3600);
    // No INFO polls on the connection: the faults below are cued by the next request.
    cfg.redis_info_interval = Duration::from_secs(3600);
    let app = spawn_app(cfg).await;
    let c = client();
    let warm = post(&c, &app, "/v1/transfers", Some("k-warm"), TRANSFER, &[]).await;
    assert_eq!(warm.status, 201);
    Rig {
        redis,
        proxy,
        up,
        app,
        c,
    }
}

/// POSTs `key` in the background.
fn send(rig: &Rig, key: &'static str) -> tokio::task::JoinHandle<Answer> {
    let (c, url) = (
        rig.c.clone(),
        format!("http://{}/v1/transfers", rig.app.addr()),
    );
    tokio::spawn(async move { post_url(&c, &url, Some(key), TRANSFER, &[]).await })
}

/// Retries `key` until it is answered with something other than 503 or 409 `in-progress`
/// (a claim may still be being taken back); an `outcome-unknown` on the way fails.
async fn retry_until_answered(rig: &Rig, key: &str, limit: Duration) -> Answer {
    let waiting = |r: &Answer| r.status == 503 || r.problem_type().ends_with("/in-progress");
    let r = common::retry_until(
        limit,
        async || {
            let r = post(&rig.c, &rig.app, "/v1/transfers", Some(key), TRANSFER, &[]).await;
            assert!(
                !r.problem_type().ends_with("/outcome-unknown"),
                "a claim that was never forwarded reads as unknown: {:?}",
                r.body
            );
            r
        },
        |r| !waiting(r),
    )
    .await;
    assert!(!waiting(&r), "still {} after {limit:?}", r.status);
    r
}

// The claim lands in Redis but its reply is lost; the release that follows is cut off with
// the connection. Before: the release was tried once, and the record stayed in progress for
// its whole retention, every retry getting 409 `outcome-unknown`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_claim_reply_and_a_cut_release_still_free_the_key() {
    let lease = Duration::from_millis(1500);
    let rig = rig(lease).await;
    rig.proxy.drop_replies(true);
    let first = send(&rig, "k-lost");
    eventually(
        Duration::from_secs(5),
        "the claim's reply swallowed",
        || rig.proxy.replies_dropped() >= 1,
    )
    .await;
    // The claim ran in Redis. The next thing idemgate sends, the release, is cut off.
    rig.proxy.drop_replies(false);
    rig.proxy.cut_next_request();
    let first = first.await.unwrap();
    assert_eq!(first.status, 503, "{:?}", first.body);
    assert!(first.problem_type().ends_with("/store-unavailable"));
    eventually(
        Duration::from_secs(5),
        "the release's connection cut",
        || rig.proxy.cuts() >= 1,
    )
    .await;
    assert_eq!(rig.up.hits(), 1, "not forwarded");
    // The release is tried again on a new connection: the key executes normally, well
    // before the lease, let alone the retention, would have run out.
    let started = Instant::now();
    let again = retry_until_answered(&rig, "k-lost", Duration::from_secs(10)).await;
    assert_eq!(again.status, 201, "{:?}", again.body);
    assert!(!again.replayed());
    assert_eq!(again.header("x-execution"), Some("2"));
    assert!(
        started.elapsed() < lease,
        "freed by the release, not by the lease running out"
    );
    let replay = post(
        &rig.c,
        &rig.app,
        "/v1/transfers",
        Some("k-lost"),
        TRANSFER,
        &[],
    )
    .await;
    assert!(replay.replayed());
    assert_eq!(replay.body, again.body);
    assert_eq!(rig.up.hits(), 2, "exactly one execution of the key");
    rig.app.shutdown().await;
    drop(rig.redis);
}

// The claim is held back on its connection, the release that follows is cut off with that
// connection and tried again on a new one, where it reaches Redis first; the claim is
// delivered after it. Before: the late claim created a record nobody owned any more, in
// progress until its lease ran out and `unknown` for its retention.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_that_overtakes_its_claim_leaves_the_key_free() {
    let rig = rig(Duration::from_millis(1500)).await;
    rig.proxy.delay_requests(Duration::from_millis(2000));
    let first = send(&rig, "k-late");
    eventually(Duration::from_secs(5), "the claim held back", || {
        rig.proxy.queued_requests() >= 1
    })
    .await;
    rig.proxy.cut_next_request();
    let first = first.await.unwrap();
    assert_eq!(first.status, 503, "{:?}", first.body);
    // The release went through on a new connection while the claim was still held back;
    // then the claim reaches Redis.
    eventually(
        Duration::from_secs(10),
        "the held-back claim delivered",
        || rig.proxy.queued_requests() == 0,
    )
    .await;
    assert!(rig.proxy.cuts() >= 1);
    // The note is a field of the record's own key, which holds no record (no `st`).
    let id = first.json()["record_id"].as_str().unwrap().to_string();
    let withdrawn = rig
        .redis
        .command(&["HGETALL", &format!("idemgate:{{{id}}}")])
        .unwrap_or_default();
    assert!(
        withdrawn.contains("\r\nw:") && !withdrawn.contains("\r\nst\r\n"),
        "the release noted the withdrawal: {withdrawn}"
    );
    // The late claim created nothing: the very first retry executes.
    let again = post(
        &rig.c,
        &rig.app,
        "/v1/transfers",
        Some("k-late"),
        TRANSFER,
        &[],
    )
    .await;
    assert_eq!(again.status, 201, "{:?}", again.body);
    assert!(!again.replayed());
    assert_eq!(again.header("x-execution"), Some("2"));
    assert_eq!(rig.up.hits(), 2, "exactly one execution of the key");
    rig.app.shutdown().await;
}

// A store stall keeps the owner from renewing its lease while the upstream works: the
// record reads as unknown, yet its owner is still waiting for the answer. An operator's
// release is refused (409, saying why) unless forced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_cannot_release_a_record_whose_owner_still_waits() {
    let rig = rig(Duration::from_millis(300)).await;
    // A second instance on the same Redis, without the proxy: the operator's view.
    let mut cfg = redis_config(&rig.up, &rig.redis);
    cfg.defaults.upstream_timeout = Duration::from_secs(30);
    let other = spawn_app(cfg).await;
    let admin = other.admin_addr().unwrap();
    let (c, url) = (
        rig.c.clone(),
        format!("http://{}/v1/transfers", rig.app.addr()),
    );
    let first = tokio::spawn(async move {
        post_url(&c, &url, Some("k-busy"), TRANSFER, &[(DELAY_MS, "3000")]).await
    });
    eventually(Duration::from_secs(5), "upstream reached", || {
        rig.up.hits() == 2
    })
    .await;
    // The stall: nothing from the owner reaches Redis for a while; its renewals time out.
    rig.proxy.delay_requests(Duration::from_secs(5));
    let r = retry_until(
        Duration::from_secs(10),
        async || {
            post(
                &rig.c,
                &other,
                "/v1/transfers",
                Some("k-busy"),
                TRANSFER,
                &[],
            )
            .await
        },
        |r| {
            assert_eq!(r.status, 409, "{:?}", r.body);
            r.problem_type().ends_with("/outcome-unknown")
        },
    )
    .await;
    assert!(
        r.problem_type().ends_with("/outcome-unknown"),
        "the lease never lapsed"
    );
    let id = r.json()["record_id"].as_str().unwrap().to_string();
    let view = inspect(&rig.c, admin, &id).await.unwrap();
    assert_eq!(view["state"], "unknown");
    assert!(
        view["owner_busy_ms"].as_u64().is_some_and(|ms| ms > 0),
        "{view}"
    );
    let refused = rig
        .c
        .delete(format!("http://{admin}/records/{id}?reason=test"))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 409);
    assert_eq!(
        refused.headers()["content-type"],
        "application/problem+json"
    );
    let problem: serde_json::Value = refused.json().await.unwrap();
    assert!(problem["type"].as_str().unwrap().ends_with("/owner-busy"));
    assert_eq!(problem["record_id"], id.as_str());
    let detail = problem["detail"].as_str().unwrap();
    assert!(detail.contains("waiting for the upstream"), "{detail}");
    assert!(detail.contains("force=true"), "{detail}");
    assert!(inspect(&rig.c, admin, &id).await.is_some(), "not released");
    // Forced, it goes.
    assert_eq!(admin_delete(&rig.c, admin, &id, true).await, 200);
    assert!(inspect(&rig.c, admin, &id).await.is_none());
    let first = first.await.unwrap();
    assert_eq!(first.status, 201, "the owner still got its answer");
    other.shutdown().await;
    rig.app.shutdown().await;
}

// The connection to Redis goes silent without closing (as one that a NAT, or a managed
// service's failover, left dangling), while a new connection would be answered at once.
// Before: each call on it waited out `store_timeout` and the connection was kept for as long
// as TCP kept it (minutes), every new key answered 503 meanwhile. Now a call that waited at
// least half of `store_timeout` unanswered gives the connection up, and the next one opens a
// new connection: the retried key executes once, and its replay comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_connection_is_given_up_for_a_new_one() {
    let rig = rig(Duration::from_secs(5)).await;
    rig.proxy.delay_requests(Duration::from_secs(120));
    let started = Instant::now();
    let a = retry_until_answered(&rig, "k-silent", Duration::from_secs(10)).await;
    assert_eq!(a.status, 201, "{:?}", a.body);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "answered only after {:?}",
        started.elapsed()
    );
    let again = post(
        &rig.c,
        &rig.app,
        "/v1/transfers",
        Some("k-silent"),
        TRANSFER,
        &[],
    )
    .await;
    assert!(again.replayed(), "{} {:?}", again.status, again.body);
    assert_eq!(rig.up.hits(), 2, "k-warm and k-silent, once each");
    assert!(
        rig.proxy.queued_requests() > 0,
        "the old connection held a call"
    );
}

/// The claim lands but its reply is lost, then Redis is unreachable for `outage`: every
/// connection cut, new ones refused. The release must land once Redis is back, however
/// long the outage, and the key must execute once within one lease of that; meanwhile a
/// retry is told to wait (503 or 409 `in-progress`), never `outcome-unknown`: this instance
/// knows it never forwarded the claim.
async fn a_release_outlives_an_outage_of(outage: Duration) {
    let lease = Duration::from_secs(2);
    let rig = rig(lease).await;
    rig.proxy.drop_replies(true);
    let first = send(&rig, "k-outage");
    eventually(
        Duration::from_secs(5),
        "the claim's reply swallowed",
        || rig.proxy.replies_dropped() >= 1,
    )
    .await;
    rig.proxy.refuse(true);
    rig.proxy.cut_all();
    rig.proxy.drop_replies(false);
    let first = first.await.unwrap();
    assert_eq!(first.status, 503, "{:?}", first.body);
    // Retries during the outage wait; none reads the never-forwarded claim as unknown, also
    // once its lease has run out.
    let down = Instant::now();
    while down.elapsed() < outage {
        let r = post(
            &rig.c,
            &rig.app,
            "/v1/transfers",
            Some("k-outage"),
            TRANSFER,
            &[],
        )
        .await;
        assert_eq!(r.status, 503, "during the outage: {:?}", r.body);
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    rig.proxy.refuse(false);
    let back = Instant::now();
    let again = retry_until_answered(&rig, "k-outage", lease * 3).await;
    assert_eq!(again.status, 201, "{:?}", again.body);
    assert_eq!(again.header("x-execution"), Some("2"));
    assert!(
        back.elapsed() < lease + Duration::from_secs(1),
        "free {:?} after Redis came back",
        back.elapsed()
    );
    assert_eq!(rig.up.hits(), 2, "exactly one execution of the key");
    rig.app.shutdown().await;
    drop(rig.redis);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_outlives_an_outage_of_1500ms() {
    a_release_outlives_an_outage_of(Duration::from_millis(1500)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_outlives_an_outage_of_5s() {
    a_release_outlives_an_outage_of(Duration::from_secs(5)).await;
}

// Past the 60 s that releases were once given up after, with a lease long gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_outlives_an_outage_of_65s() {
    a_release_outlives_an_outage_of(Duration::from_secs(65)).await;
}
