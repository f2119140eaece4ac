//! `record_mode = "after_response"`: the client's answer leaves as soon as the upstream's
//! answer is complete, and the record is written meanwhile. The store is made slow on cue by
//! a TCP proxy (`common::faultproxy`) between idemgate and a real `redis-server`: the claim
//! goes through, then everything idemgate sends to Redis is held back, the record included.
//! What must hold: the answer arrives before the record lands; a retry in that window gets
//! 409 `in-progress`, then the replay; shutdown waits for the record; and a crash in the
//! window leaves the key `unknown` (409 `outcome-unknown`), never executed twice.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::{Duration, Instant};

use common::faultproxy::FaultProxy;
use common::*;
use idemgate::config::RecordMode;

const TRANSFER: &str = r#"{"from":"acc-1","to":"acc-2","amount":1250,"currency":"EUR"}"#;
/// How long the record is held back on the wire to Redis.
const HOLD: Duration = Duration::from_secs(2);
/// How long the upstream takes: the time the test has to hold the wire back once the
/// upstream has the request (and the claim has landed).
const UPSTREAM_MS: &str = "300";

/// Redis behind a fault proxy; the instance under test talks to Redis through the proxy
/// (its connection warmed by one request, execution 1), a second instance talks to Redis
/// directly and sees the records as they are.
struct Rig {
    redis: RedisServer,
    proxy: FaultProxy,
    up: Upstream,
    app: idemgate::Running,
    other: idemgate::Running,
    c: reqwest::Client,
}

async fn rig(mode: RecordMode) -> Rig {
    let redis = RedisServer::start();
    let proxy = FaultProxy::for_redis(&redis).await;
    let up = Upstream::start().await;
    let mut cfg = redis_config(&up, &redis);
    cfg.redis_url = Some(proxy.redis_url());
    // Long enough that a held-back record is waited for, not given up on.
    cfg.store_timeout = Duration::from_secs(5);
    // No INFO polls on the connection: what is held back is the request's own traffic.
    cfg.redis_info_interval = Duration::from_secs(3600);
    // One protected request at a time: shows whether a record still being written holds
    // its in-flight permit.
    cfg.max_in_flight = 1;
    // No queue: a request beyond the one slot is refused at once, which shows the slot held.
    cfg.max_queued = 0;
    cfg.defaults.record_mode = mode;
    let app = spawn_app(cfg).await;
    let other = spawn_app(redis_config(&up, &redis)).await;
    let c = client();
    let warm = post(&c, &app, "/v1/transfers", Some("k-warm"), TRANSFER, &[]).await;
    assert_eq!(warm.status, 201);
    // Until its record lands, the warm-up holds the one permit (503 `overloaded`); a replay
    // shows it landed and the permit is free again.
    until(HANG_GUARD, "the warm-up to replay", async || {
        post(&c, &app, "/v1/transfers", Some("k-warm"), TRANSFER, &[])
            .await
            .replayed()
    })
    .await;
    Rig {
        redis,
        proxy,
        up,
        app,
        other,
        c,
    }
}

/// Sends `key` to the instance under test, waits until the upstream has it (the claim has
/// landed), then holds back everything the instance sends to Redis for [`HOLD`]. Returns
/// the client's answer and how long it took from the moment the wire was held.
async fn answer_with_the_record_held_back(rig: &Rig, key: &'static str) -> (Answer, Duration) {
    let hits = rig.up.hits();
    let (c, url) = (
        rig.c.clone(),
        format!("http://{}/v1/transfers", rig.app.addr()),
    );
    let first = tokio::spawn(async move {
        post_url(&c, &url, Some(key), TRANSFER, &[(DELAY_MS, UPSTREAM_MS)]).await
    });
    eventually(Duration::from_secs(5), "upstream reached", || {
        rig.up.hits() == hits + 1
    })
    .await;
    rig.proxy.delay_requests(HOLD);
    let held = Instant::now();
    let first = first.await.unwrap();
    (first, held.elapsed())
}

/// Waits until the record (written just after the client's answer) is held back on the
/// wire, not yet in Redis.
async fn held_back(proxy: &FaultProxy) {
    eventually(Duration::from_secs(1), "the record held back", || {
        proxy.queued_requests() >= 1
    })
    .await;
}

/// Retries `key` on `app` until the answer is no longer 409 `in-progress` (every answer on
/// the way must be one); the first other answer, and how many 409s came before it.
async fn retry_past_in_progress(rig: &Rig, app: &idemgate::Running, key: &str) -> (Answer, usize) {
    let busy = |r: &Answer| r.status == 409 && r.problem_type().ends_with("/in-progress");
    let mut in_progress = 0;
    let r = retry_until(
        Duration::from_secs(15),
        async || post(&rig.c, app, "/v1/transfers", Some(key), TRANSFER, &[]).await,
        |r| {
            in_progress += usize::from(busy(r));
            !busy(r)
        },
    )
    .await;
    assert!(!busy(&r), "still in progress after 15 s");
    (r, in_progress)
}

// The point of the mode: the client's answer does not wait for the record; a retry before
// the record lands gets 409 `in-progress` (never a second execution), then the replay; and
// the record keeps its in-flight permit until it lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_answer_leaves_before_the_record_and_a_retry_meanwhile_gets_in_progress() {
    let rig = rig(RecordMode::AfterResponse).await;
    let (first, took) = answer_with_the_record_held_back(&rig, "k-early").await;
    let answered = Instant::now();
    assert_eq!(first.status, 201, "{:?}", first.body);
    assert!(!first.replayed());
    eprintln!("after_response: the client's answer {took:?} after the wire was held for {HOLD:?}");
    assert!(
        took < HOLD,
        "the client's answer waited for the held-back record: {took:?}"
    );
    held_back(&rig.proxy).await;
    // A retry now, through another instance: the claim is still in progress, its lease live.
    let retry = post(
        &rig.c,
        &rig.other,
        "/v1/transfers",
        Some("k-early"),
        TRANSFER,
        &[],
    )
    .await;
    assert_eq!(retry.status, 409, "{:?}", retry.body);
    assert!(
        retry.problem_type().ends_with("/in-progress"),
        "{:?}",
        retry.body
    );
    assert!(retry.header("retry-after").is_some());
    // The record holds the instance's only in-flight permit until it lands.
    let other_key = post(
        &rig.c,
        &rig.app,
        "/v1/transfers",
        Some("k-next"),
        TRANSFER,
        &[],
    )
    .await;
    assert_eq!(other_key.status, 503, "{:?}", other_key.body);
    assert!(other_key.problem_type().ends_with("/overloaded"));
    // Once the record lands, retries get the replay of the client's answer.
    let (replay, in_progress) = retry_past_in_progress(&rig, &rig.other, "k-early").await;
    let landed = answered.elapsed();
    eprintln!(
        "after_response: the record landed {landed:?} after the client's answer ({in_progress} more 409 in-progress on the way)"
    );
    assert_eq!(replay.status, 201, "{:?}", replay.body);
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.header("x-execution"), first.header("x-execution"));
    assert_eq!(rig.up.hits(), 2, "the key executed once");
    // The permit is back: the instance takes the next key.
    let next = common::retry_until(
        Duration::from_secs(5),
        async || {
            post(
                &rig.c,
                &rig.app,
                "/v1/transfers",
                Some("k-next"),
                TRANSFER,
                &[],
            )
            .await
        },
        |r| r.status != 503,
    )
    .await;
    assert_eq!(next.status, 201, "{:?}", next.body);
    rig.other.shutdown().await;
    rig.app.shutdown().await;
    drop(rig.redis);
}

// The same cue with the default: the client's answer waits for the record, so a retry
// right after it gets the replay. (Shows that the measurement above can fail.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_the_answer_waits_for_the_record() {
    let rig = rig(RecordMode::BeforeResponse).await;
    let (first, took) = answer_with_the_record_held_back(&rig, "k-default").await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    eprintln!("before_response: the client's answer {took:?} after the wire was held for {HOLD:?}");
    assert!(took >= HOLD, "answered before the record: {took:?}");
    let retry = post(
        &rig.c,
        &rig.other,
        "/v1/transfers",
        Some("k-default"),
        TRANSFER,
        &[],
    )
    .await;
    assert!(retry.replayed(), "{:?}", retry.body);
    assert_eq!(retry.body, first.body);
    assert_eq!(rig.up.hits(), 2);
    rig.other.shutdown().await;
    rig.app.shutdown().await;
}

// Shutdown waits (within shutdown_grace) for a record still being written after its
// client's answer, so a clean stop never leaves the key in progress.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_waits_for_a_record_written_after_the_answer() {
    let rig = rig(RecordMode::AfterResponse).await;
    let (first, took) = answer_with_the_record_held_back(&rig, "k-stop").await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    assert!(took < HOLD, "{took:?}");
    held_back(&rig.proxy).await;
    let stopping = Instant::now();
    rig.app.shutdown().await;
    eprintln!(
        "after_response: shutdown took {:?}, the wire held for {HOLD:?}",
        stopping.elapsed()
    );
    // The very first retry gets the replay: the record landed before shutdown returned.
    let retry = post(
        &rig.c,
        &rig.other,
        "/v1/transfers",
        Some("k-stop"),
        TRANSFER,
        &[],
    )
    .await;
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(rig.up.hits(), 2);
    rig.other.shutdown().await;
}

// The binary is killed (SIGKILL) after its client got a 201 and before the record landed:
// the claim stays in progress, its lease runs out, and retries get 409 `outcome-unknown`,
// never a second execution. Configured through the environment
// (`IDEMGATE_DEFAULTS__RECORD_MODE`), as in a deployment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_answer_before_the_record_reads_unknown_never_twice() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::for_redis(&redis).await;
    let up = Upstream::start().await;
    let store_timeout = Duration::from_secs(5);
    let instance = Idemgate::new(&up.url())
        .redis_url(&proxy.redis_url())
        .set(|c| {
            c.defaults.record_mode = RecordMode::AfterResponse;
            c.defaults.lease = Duration::from_millis(1500);
            c.store_timeout = Duration::from_secs(5);
            c.redis_info_interval = Duration::from_secs(3600);
        });
    let mut gate = tokio::task::spawn_blocking(move || instance.binary())
        .await
        .unwrap();
    let c = client();
    let warm = post_url(
        &c,
        &gate.url("/v1/transfers"),
        Some("k-warm"),
        TRANSFER,
        &[],
    )
    .await;
    assert_eq!(warm.status, 201);
    let first = {
        let (c, url) = (c.clone(), gate.url("/v1/transfers"));
        tokio::spawn(async move {
            post_url(
                &c,
                &url,
                Some("k-crash"),
                TRANSFER,
                &[(DELAY_MS, UPSTREAM_MS)],
            )
            .await
        })
    };
    eventually(Duration::from_secs(5), "upstream reached", || {
        up.hits() == 2
    })
    .await;
    // Held for longer than the test runs: the record never reaches Redis.
    proxy.delay_requests(Duration::from_secs(120));
    let held = Instant::now();
    let first = first.await.unwrap();
    let took = held.elapsed();
    eprintln!("after_response (binary): the client's answer {took:?} after the wire was held");
    assert_eq!(first.status, 201, "{:?}", first.body);
    // By default the answer would wait for the record until store_timeout.
    assert!(took < store_timeout, "{took:?}");
    held_back(&proxy).await;
    gate.kill();

    // A new instance, on Redis directly: in progress until the dead owner's lease runs
    // out, then unknown.
    let (upstream, direct) = (up.url(), redis.url());
    let gate = tokio::task::spawn_blocking(move || {
        Idemgate::new(&upstream)
            .redis_url(&direct)
            .set(|c| c.defaults.record_mode = idemgate::config::RecordMode::AfterResponse)
            .binary()
    })
    .await
    .unwrap();
    let url = gate.url("/v1/transfers");
    let unknown = retry_until(
        Duration::from_secs(15),
        async || post_url(&c, &url, Some("k-crash"), TRANSFER, &[]).await,
        |r| !(r.status == 409 && r.problem_type().ends_with("/in-progress")),
    )
    .await;
    assert_eq!(unknown.status, 409, "{:?}", unknown.body);
    assert!(
        !unknown.problem_type().ends_with("/in-progress"),
        "still in progress after 15 s"
    );
    assert_eq!(
        unknown.problem_type(),
        "https://idemgate.dev/problems/outcome-unknown"
    );
    for _ in 0..3 {
        let r = post_url(&c, &url, Some("k-crash"), TRANSFER, &[]).await;
        assert_eq!(r.status, 409);
        assert!(r.problem_type().ends_with("/outcome-unknown"));
    }
    assert_eq!(up.hits(), 2, "the key executed once");
    let id = unknown.json()["record_id"].as_str().unwrap().to_string();
    let view = inspect(&c, gate.admin, &id).await.expect("record kept");
    assert_eq!(view["state"], "unknown");
    assert!(
        proxy.queued_requests() >= 1,
        "the dead instance's record never reached Redis"
    );
}
