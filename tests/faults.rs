//! Faults, on purpose, with real processes: a real `redis-server` that is killed, frozen
//! (SIGSTOP), restarted or filled up; the real `idemgate` binary killed with SIGKILL or
//! stopped with SIGTERM under load; an upstream that refuses, breaks off mid-answer or
//! answers too late. Each test asserts the at-most-once promise of docs/guarantees.md: whatever
//! fails, the upstream never executes a key twice, and every retry gets either the recorded
//! answer or a refusal that says why.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::{Duration, Instant};

use common::*;
use idemgate::config::OnStoreError;

const TRANSFER: &str = r#"{"from":"acc-1","to":"acc-2","amount":1250,"currency":"EUR"}"#;

/// Redis, an upstream and idemgate with `store_timeout`, its Redis connection warmed by one
/// request, so that a freeze hits an established connection.
async fn warmed(
    store_timeout: Duration,
) -> (RedisServer, Upstream, idemgate::Running, reqwest::Client) {
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let mut cfg = redis_config(&up, &redis);
    cfg.store_timeout = store_timeout;
    let app = spawn_app(cfg).await;
    let c = client();
    let warm = post(&c, &app, "/v1/transfers", Some("k-warm"), TRANSFER, &[]).await;
    assert_eq!(warm.status, 201);
    (redis, up, app, c)
}

/// Retries `key` until the answer is no longer 409 `in-progress`; every answer on the way
/// must be a 409. Returns the first other answer.
async fn retry_past_in_progress(c: &reqwest::Client, url: &str, key: &str) -> Answer {
    let in_progress = |r: &Answer| r.status == 409 && r.problem_type().ends_with("/in-progress");
    let r = common::retry_until(
        Duration::from_secs(10),
        async || post_url(c, url, Some(key), TRANSFER, &[]).await,
        |r| !in_progress(r),
    )
    .await;
    assert!(!in_progress(&r), "still in progress after 10 s");
    r
}

fn assert_outcome_unknown(r: &Answer) {
    assert_eq!(r.status, 409, "{:?}", r.body);
    assert!(
        r.problem_type().ends_with("/outcome-unknown"),
        "{:?}",
        r.body
    );
}

// 1. The binary dies (SIGKILL) after the upstream accepted the request, before the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_flight_is_never_executed_again_until_an_operator_releases_it() {
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let gate = || {
        Idemgate::new(&up.url())
            .redis(&redis)
            .set(|c| c.defaults.lease = Duration::from_millis(600))
            .binary()
    };
    let mut first_gate = gate();
    let c = client();
    let first = {
        let (c, url) = (c.clone(), first_gate.url("/v1/transfers"));
        tokio::spawn(async move {
            c.post(url)
                .header("content-type", "application/json")
                .header("idempotency-key", "k-killed")
                .header(DELAY_MS, "60000")
                .body(TRANSFER)
                .send()
                .await
        })
    };
    eventually(Duration::from_secs(5), "upstream reached", || {
        up.hits() == 1
    })
    .await;
    first_gate.kill();
    assert!(first.await.unwrap().is_err(), "the client lost its answer");

    let gate = gate();
    let url = gate.url("/v1/transfers");
    // In progress until the dead process's lease runs out, then unknown: never executed.
    let r = retry_past_in_progress(&c, &url, "k-killed").await;
    assert_outcome_unknown(&r);
    for _ in 0..3 {
        assert_outcome_unknown(&post_url(&c, &url, Some("k-killed"), TRANSFER, &[]).await);
    }
    assert_eq!(up.hits(), 1);
    let id = r.json()["record_id"].as_str().unwrap().to_string();
    let view = inspect(&c, gate.admin, &id).await.expect("record kept");
    assert_eq!(view["state"], "unknown");
    // The record cannot tell a dead owner from one still waiting for the upstream (within
    // its upstream_timeout): an unforced release is refused.
    assert_eq!(admin_delete(&c, gate.admin, &id, false).await, 409);
    // The operator knows that instance is gone, reconciles with the upstream and forces the
    // release: one new execution.
    assert_eq!(admin_delete(&c, gate.admin, &id, true).await, 200);
    let again = post_url(&c, &url, Some("k-killed"), TRANSFER, &[]).await;
    assert_eq!(again.status, 201);
    assert!(!again.replayed());
    let replay = post_url(&c, &url, Some("k-killed"), TRANSFER, &[]).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, again.body);
    assert_eq!(up.hits(), 2);
}

// 2. Redis down before the claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_down_at_claim_is_503_within_the_deadline_and_resumes_by_itself() {
    let mut redis = RedisServer::start();
    let up = Upstream::start().await;
    let mut cfg = redis_config(&up, &redis);
    cfg.store_timeout = Duration::from_millis(300);
    let app = spawn_app(cfg).await;
    let admin = app.admin_addr().unwrap();
    let c = client();
    redis.stop();
    for key in ["k-down-1", "k-down-2"] {
        let started = Instant::now();
        let r = post(&c, &app, "/v1/transfers", Some(key), TRANSFER, &[]).await;
        assert_eq!(r.status, 503);
        assert!(r.problem_type().ends_with("/store-unavailable"));
        assert_eq!(r.header("retry-after"), Some("1"));
        // A refused connection fails fast, whatever the deadline; a hang guard only.
        assert!(started.elapsed() < common::HANG_GUARD);
    }
    let ready = c
        .get(format!("http://{admin}/readyz"))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 503);
    assert_eq!(up.hits(), 0);
    // Redis back: service resumes without restarting idemgate.
    redis.restart();
    let r = common::retry_until(
        Duration::from_secs(10),
        async || post(&c, &app, "/v1/transfers", Some("k-down-1"), TRANSFER, &[]).await,
        |r| r.status != 503,
    )
    .await;
    assert_eq!(r.status, 201);
    assert!(!r.replayed());
    assert!(app.ready(), "ready once Redis is back");
    assert_eq!(up.hits(), 1);
    app.shutdown().await;
}

// 3. Redis dies between claim and record (with fsynced append-only persistence).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_down_at_record_answers_the_client_and_never_executes_again() {
    let mut redis = RedisServer::start_persistent();
    let up = Upstream::start().await;
    let mut cfg = redis_config(&up, &redis);
    cfg.store_timeout = Duration::from_millis(300);
    cfg.defaults.lease = Duration::from_millis(600);
    let app = spawn_app(cfg).await;
    let c = client();
    let url = format!("http://{}/v1/transfers", app.addr());
    let first = post_in_background(&c, url, "k-rec", TRANSFER, &[(DELAY_MS, "700")]);
    upstream_reached(&up, 1).await;
    redis.stop();
    let first = first.await.unwrap();
    assert_eq!(
        first.status, 201,
        "the client still gets the upstream's answer"
    );
    assert_eq!(first.header("x-execution"), Some("1"));
    redis.restart();
    // The claim survived the restart, and the answer's write, tried again until the store
    // is back, lands: the retry replays it (409 in-progress meanwhile, never unknown).
    let url = format!("http://{}/v1/transfers", app.addr());
    let r = common::retry_until(
        Duration::from_secs(10),
        async || retry_past_in_progress(&c, &url, "k-rec").await,
        |r| r.status != 503,
    )
    .await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    assert!(r.replayed());
    assert_eq!(r.header("x-execution"), Some("1"));
    assert_eq!(up.hits(), 1, "never a second execution");
    app.shutdown().await;
}

// 4. Redis frozen (SIGSTOP) at the claim, and at the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_store_fails_within_the_deadline_and_never_executes_twice() {
    let (redis, up, app, c) = warmed(Duration::from_millis(300)).await;
    let admin = app.admin_addr().unwrap();

    redis.pause();
    let started = Instant::now();
    let r = post(&c, &app, "/v1/transfers", Some("k-frozen"), TRANSFER, &[]).await;
    let took = started.elapsed();
    assert_eq!(r.status, 503);
    assert!(r.problem_type().ends_with("/store-unavailable"));
    // Without the deadline the claim would wait on the frozen Redis until it is resumed,
    // which happens only after this answer: the 503 itself shows the deadline held.
    assert!(took < common::HANG_GUARD, "took {took:?}");
    let started = Instant::now();
    let ready = c
        .get(format!("http://{admin}/readyz"))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 503);
    assert!(started.elapsed() < common::HANG_GUARD);
    // Frozen a while longer than the deadline of the claim's clean-up.
    tokio::time::sleep(Duration::from_millis(800)).await;
    redis.resume();
    assert_eq!(up.hits(), 1, "a claim that timed out is never forwarded");
    // The claim may have landed once Redis woke up; it was never forwarded, so the key
    // must execute normally (once), not be stuck as unknown.
    let url = format!("http://{}/v1/transfers", app.addr());
    let r = common::retry_until(
        Duration::from_secs(10),
        async || retry_past_in_progress(&c, &url, "k-frozen").await,
        |r| r.status != 503,
    )
    .await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    assert!(!r.replayed());
    assert_eq!(up.hits(), 2);

    // Frozen while the upstream works: the client gets its answer, the record times out.
    let first = {
        let (c, url) = (c.clone(), url.clone());
        tokio::spawn(async move {
            post_url(&c, &url, Some("k-frozen-2"), TRANSFER, &[(DELAY_MS, "300")]).await
        })
    };
    eventually(Duration::from_secs(5), "upstream reached", || {
        up.hits() == 3
    })
    .await;
    redis.pause();
    let started = Instant::now();
    let first = first.await.unwrap();
    // Answered while Redis is still frozen (it is resumed only after this): the record's
    // write did not hold the answer.
    assert_eq!(first.status, 201);
    assert!(started.elapsed() < common::HANG_GUARD);
    redis.resume();
    // The record either landed after the thaw (replay) or not (in progress, then unknown);
    // either way no second execution.
    let r = retry_past_in_progress(&c, &url, "k-frozen-2").await;
    assert!(
        (r.status == 201 && r.replayed() && r.body == first.body)
            || r.problem_type().ends_with("/outcome-unknown"),
        "{} {:?}",
        r.status,
        r.body
    );
    assert_eq!(up.hits(), 3);
    app.shutdown().await;
}

// 4b. An HTTP/2 client cancels its stream while the claim is still on its way to Redis
// (frozen): hyper drops the request. The claim lands once Redis wakes up, was never
// forwarded, and must not be left behind as in progress (then unknown): the retry executes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_client_cancels_is_taken_back_not_left_in_progress() {
    // Long enough that the claim is still waiting for Redis when the client goes.
    let (redis, up, app, _) = warmed(Duration::from_secs(5)).await;
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let url = format!("http://{}/v1/transfers", app.addr());

    redis.pause();
    let cancelled = {
        let (h2, url) = (h2.clone(), url.clone());
        tokio::spawn(async move { post_url(&h2, &url, Some("k-cancel"), TRANSFER, &[]).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Dropping the response future resets the stream (RST_STREAM CANCEL).
    cancelled.abort();
    let _ = cancelled.await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    redis.resume();

    let r = common::retry_until(
        Duration::from_secs(3),
        async || post_url(&h2, &url, Some("k-cancel"), TRANSFER, &[]).await,
        |r| r.status != 409,
    )
    .await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    assert!(!r.replayed(), "the cancelled request was never forwarded");
    assert_eq!(up.hits(), 2);
    app.shutdown().await;
}

// 5. Redis restarted with append-only persistence: completed records replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_survive_a_persistent_redis_restart() {
    let mut redis = RedisServer::start_persistent();
    let up = Upstream::start().await;
    let app = spawn_app(redis_config(&up, &redis)).await;
    let c = client();
    let mut firsts = Vec::new();
    for i in 0..5 {
        let key = format!("k-aof-{i}");
        let r = post(&c, &app, "/v1/transfers", Some(&key), TRANSFER, &[]).await;
        assert_eq!(r.status, 201);
        firsts.push((key, r.body));
    }
    redis.restart();
    let url = format!("http://{}/v1/transfers", app.addr());
    for (key, body) in firsts {
        let r = common::retry_until(
            Duration::from_secs(10),
            async || post_url(&c, &url, Some(&key), TRANSFER, &[]).await,
            |r| r.status != 503,
        )
        .await;
        assert_eq!(r.status, 201);
        assert!(r.replayed(), "{key} replays after the restart");
        assert_eq!(r.body, body);
    }
    assert_eq!(up.hits(), 5);
    app.shutdown().await;
}

// 6a. An evicting Redis: the binary refuses to start and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_refuses_an_evicting_redis() {
    let redis = RedisServer::start_with(&["--maxmemory-policy", "volatile-lru"]);
    let up = Upstream::start().await;
    let (mut cmd, _, _, dir) = Gate::command(&up.url(), &redis.url(), &[]);
    let mut child = cmd.spawn().unwrap();
    let status =
        tokio::task::block_in_place(|| common::exit_within(&mut child, Duration::from_secs(15)));
    let Some(status) = status else {
        let _ = child.kill();
        panic!("idemgate started on an evicting Redis");
    };
    let log = std::fs::read_to_string(dir.path().join("idemgate.log")).unwrap();
    assert_eq!(status.code(), Some(64), "{log}");
    assert!(log.contains("maxmemory-policy"), "{log}");
    assert!(log.contains("volatile-lru"), "{log}");
    assert_eq!(up.hits(), 0);
}

/// Waits for the binary to exit on its own, at most `limit`; kills it and fails otherwise.
async fn exit_code_within(child: &mut std::process::Child, limit: Duration, what: &str) -> i32 {
    match tokio::task::block_in_place(|| common::exit_within(child, limit)) {
        Some(s) => s.code().unwrap_or(-1),
        None => {
            let _ = child.kill();
            panic!("idemgate still running after {limit:?}: {what}");
        }
    }
}

// 6c. A Redis that stops answering while idemgate starts: it exits (69) within its
// deadlines instead of hanging. A real Redis frozen before the start, and a stand-in that
// answers the connection's handshake (CLIENT SETINFO) and then nothing: a real server
// cannot be frozen on cue between the two, and the calls after the handshake (loading the
// scripts, INFO) are bounded only by idemgate's own deadlines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_stops_answering_at_start_up_is_an_exit_not_a_hang() {
    let up = Upstream::start().await;
    let redis = RedisServer::start();
    redis.pause();
    let (mut cmd, _, _, dir) = Gate::command(&up.url(), &redis.url(), &[]);
    let mut child = cmd.spawn().unwrap();
    let code = exit_code_within(&mut child, Duration::from_secs(15), "frozen Redis").await;
    let log = std::fs::read_to_string(dir.path().join("idemgate.log")).unwrap();
    assert_eq!(code, 69, "{log}");
    assert!(log.contains("timed out"), "{log}");
    redis.resume();

    let mute = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("redis://{}/0", mute.local_addr().unwrap());
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        while let Ok((mut s, _)) = mute.accept().await {
            tokio::spawn(async move {
                let mut seen = Vec::new();
                let mut buf = [0u8; 4096];
                while let Ok(n) = s.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    seen.extend_from_slice(&buf[..n]);
                    // Every CLIENT command of the handshake gets its +OK; anything else
                    // (SCRIPT LOAD, INFO) gets no answer at all.
                    let text = String::from_utf8_lossy(&seen).into_owned();
                    let clients = text.matches("CLIENT").count();
                    seen.clear();
                    for _ in 0..clients {
                        let _ = s.write_all(b"+OK\r\n").await;
                    }
                }
            });
        }
    });
    let (mut cmd, _, _, dir) = Gate::command(&up.url(), &url, &[]);
    let mut child = cmd.spawn().unwrap();
    let code = exit_code_within(&mut child, Duration::from_secs(15), "mute Redis").await;
    let log = std::fs::read_to_string(dir.path().join("idemgate.log")).unwrap();
    assert_eq!(code, 69, "{log}");
    assert!(log.contains("timed out"), "{log}");
    assert_eq!(up.hits(), 0);
}

// 6b. Redis full under `noeviction`: 503, even where store errors would be forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_redis_is_503_and_never_forwards_unprotected() {
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let mut cfg = redis_config(&up, &redis);
    cfg.defaults.on_store_error = OnStoreError::Forward;
    let app = spawn_app(cfg).await;
    let c = client();
    // 3 MB of junk, then a limit below what is used: full for good under `noeviction`
    // (filling up to a limit exactly leaves it hovering around the edge, as connection
    // buffers come and go).
    let junk = "j".repeat(60_000);
    for i in 0..50 {
        let reply = redis
            .command(&["SET", &format!("junk:{i}"), &junk])
            .unwrap();
        assert!(reply.starts_with("+OK"), "{reply}");
    }
    let info = redis.command(&["INFO", "memory"]).unwrap();
    let used: u64 = info
        .lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let limit = (used - 1_000_000).to_string();
    assert!(redis
        .command(&["CONFIG", "SET", "maxmemory", &limit])
        .unwrap()
        .starts_with("+OK"));
    let full = redis
        .command(&["SET", "probe", "x"])
        .unwrap()
        .starts_with("-OOM");
    assert!(full, "Redis never filled up");
    for _ in 0..3 {
        let r = post(&c, &app, "/v1/transfers", Some("k-oom"), TRANSFER, &[]).await;
        assert_eq!(r.status, 503, "{:?}", r.body);
        assert!(r.problem_type().ends_with("/store-unavailable"));
    }
    assert_eq!(up.hits(), 0, "nothing forwarded unprotected");
    // Room again: the key executes normally.
    assert!(redis.command(&["FLUSHALL"]).unwrap().starts_with("+OK"));
    let r = post(&c, &app, "/v1/transfers", Some("k-oom"), TRANSFER, &[]).await;
    assert_eq!(r.status, 201);
    assert_eq!(up.hits(), 1);
    app.shutdown().await;
}

// 7. The upstream breaks off mid-answer (headers and half the body, then it closes): fewer
// bytes than its declared length, a broken answer that may reflect an execution.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_cut_mid_response_is_502_broken_answer_unknown_and_never_retried() {
    for backend in [Backend::memory(), Backend::redis()] {
        let up = Upstream::start().await;
        let app = spawn_app(config(&up, &backend)).await;
        let c = client();
        let r = post(
            &c,
            &app,
            "/v1/transfers",
            Some("k-reset"),
            TRANSFER,
            &[(FAULT, "reset")],
        )
        .await;
        assert_eq!(r.status, 502, "{:?}", r.body);
        assert!(r.problem_type().ends_with("/upstream-broken-answer"));
        let id = r.json()["record_id"].as_str().unwrap().to_string();
        let view = inspect(&c, app.admin_addr().unwrap(), &id).await.unwrap();
        assert_eq!(view["state"], "unknown");
        for _ in 0..3 {
            let retry = post(&c, &app, "/v1/transfers", Some("k-reset"), TRANSFER, &[]).await;
            assert_outcome_unknown(&retry);
        }
        assert_eq!(up.hits(), 1);
        app.shutdown().await;
    }
}

// 8. A stale owner: its claim was released by an operator while its call was in flight; a
// second instance claims anew. The first one's late answer must not overwrite the second's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_owner_never_overwrites_the_new_owners_record() {
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let mut cfg = redis_config(&up, &redis);
    cfg.defaults.lease = Duration::from_millis(300);
    let a = spawn_app(cfg.clone()).await;
    let b = spawn_app(cfg).await;
    let c = client();
    let url = format!("http://{}/v1/transfers", a.addr());
    let first = post_in_background(&c, url, "k-stale", TRANSFER, &[(DELAY_MS, "1500")]);
    upstream_reached(&up, 1).await;
    let dup = post(&c, &b, "/v1/transfers", Some("k-stale"), TRANSFER, &[]).await;
    assert!(
        dup.problem_type().ends_with("/in-progress"),
        "{:?}",
        dup.body
    );
    let id = dup.json()["record_id"].as_str().unwrap().to_string();
    // Refused while the owner works, unless forced.
    assert_eq!(
        admin_delete(&c, b.admin_addr().unwrap(), &id, false).await,
        409
    );
    assert_eq!(
        admin_delete(&c, b.admin_addr().unwrap(), &id, true).await,
        200
    );
    let second = post(&c, &b, "/v1/transfers", Some("k-stale"), TRANSFER, &[]).await;
    assert_eq!(second.status, 201);
    assert_eq!(second.header("x-execution"), Some("2"));
    let first = first.await.unwrap();
    assert_eq!(
        first.status, 201,
        "the first client still gets its own answer"
    );
    assert_eq!(first.header("x-execution"), Some("1"));
    for app in [&a, &b] {
        let r = post(&c, app, "/v1/transfers", Some("k-stale"), TRANSFER, &[]).await;
        assert!(r.replayed());
        assert_eq!(r.body, second.body, "the current owner's answer replays");
    }
    let view = inspect(&c, a.admin_addr().unwrap(), &id).await.unwrap();
    assert_eq!(view["body"].as_str().unwrap().as_bytes(), &second.body[..]);
    assert_eq!(up.hits(), 2);
    a.shutdown().await;
    b.shutdown().await;
}

// 9. SIGTERM under load: in-flight requests finish and are recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_requests_and_records_them() {
    const N: usize = 16;
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    up.set_delay(Duration::from_millis(700));
    // Two worker threads: the binary's other tests run the default single-threaded
    // runtime, this one the multi-threaded scheduler.
    let mut gate = Idemgate::new(&up.url())
        .redis(&redis)
        .set(|c| {
            c.shutdown_grace = Duration::from_secs(10);
            c.worker_threads = 2;
        })
        .binary();
    let c = client();
    let mut set = tokio::task::JoinSet::new();
    for i in 0..N {
        let (c, url) = (c.clone(), gate.url("/v1/transfers"));
        set.spawn(async move {
            let key = format!("k-term-{i}");
            let r = post_url(&c, &url, Some(&key), TRANSFER, &[]).await;
            (key, r)
        });
    }
    eventually(Duration::from_secs(10), "all requests in flight", || {
        up.hits() == N
    })
    .await;
    let status = tokio::task::spawn_blocking(move || {
        let s = gate.terminate(Duration::from_secs(15));
        (s, gate)
    })
    .await
    .unwrap();
    let (status, gate) = status;
    assert!(status.success(), "exit status {status}:\n{}", gate.log());
    let mut answers = Vec::new();
    while let Some(r) = set.join_next().await {
        let (key, r) = r.unwrap();
        assert_eq!(r.status, 201, "{key}: {:?}", r.body);
        answers.push((key, r.body));
    }
    // Every record is completed: another idemgate on the same Redis replays each.
    up.set_delay(Duration::ZERO);
    let app = spawn_app(redis_config(&up, &redis)).await;
    for (key, body) in answers {
        let r = post(&c, &app, "/v1/transfers", Some(&key), TRANSFER, &[]).await;
        assert_eq!(r.status, 201, "{key} left in progress: {:?}", r.body);
        assert!(r.replayed());
        assert_eq!(r.body, body);
    }
    assert_eq!(up.hits(), N);
    app.shutdown().await;
}
