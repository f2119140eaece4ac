//! Probes never wait on the store. From the moment the admin listener is bound, `/healthz`
//! answers within 100 ms whatever the store does (a Redis that answers nothing, a start
//! waiting `scope_secret_create_delay` to make the scope secret); meanwhile `/readyz` says
//! what start-up waits for, and requests get `503 store-unavailable` with a `Retry-After`
//! of the time left instead of a connection held open. `idemgate lab` never waits.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use common::*;

/// The spawned binary, killed when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Spawns the binary and returns once its admin listener accepts connections.
fn spawn_until_bound(cmd: &mut Command, admin: SocketAddr) -> (Proc, Instant) {
    let child = Proc(cmd.spawn().unwrap());
    wait_until(
        Duration::from_secs(10),
        "the admin listener to be bound",
        || TcpStream::connect_timeout(&admin, Duration::from_millis(50)).is_ok(),
    );
    (child, Instant::now())
}

/// `GET path` on the admin listener, and how long the answer took.
fn timed_get(admin: SocketAddr, path: &str) -> (String, Duration) {
    let t = Instant::now();
    let answer = http_get(admin, path).unwrap_or_default();
    (answer, t.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_waiting_to_make_the_scope_secret_probes_answer_and_requests_get_503() {
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let (mut cmd, addr, admin, dir) = Gate::command(
        &up.url(),
        &redis.url(),
        &[
            ("IDEMGATE_SCOPE_SECRET_CREATE_DELAY", "3s"),
            ("IDEMGATE_SCOPE_SECRET_CHECK_INTERVAL", "1s"),
        ],
    );
    let (child, bound) = spawn_until_bound(&mut cmd, admin);

    let (health, took) = timed_get(admin, "/healthz");
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    assert!(took < common::HANG_GUARD, "/healthz took {took:?}");
    // "Opening the store" until it has read that there is no secret, then the wait.
    let waits = |ready: &str| {
        ready.contains("scope_secret_create_delay") && ready.contains("no scope secret")
    };
    let (ready, _) = retry_until_blocking(
        Duration::from_secs(2),
        || timed_get(admin, "/readyz"),
        |(ready, took)| {
            assert!(ready.starts_with("HTTP/1.1 503"), "{ready}");
            assert!(*took < common::HANG_GUARD, "/readyz took {took:?}");
            waits(ready) || {
                assert!(ready.contains("opening the store"), "{ready}");
                false
            }
        },
    );
    assert!(waits(&ready), "never said it waits: {ready}");

    // A protected request: answered at once, 503 store-unavailable, Retry-After the time
    // left of the 3 s wait.
    let c = client();
    let t = Instant::now();
    let r = post_url(
        &c,
        &format!("http://{addr}/pay"),
        Some("k1"),
        r#"{"amount":1}"#,
        &[],
    )
    .await;
    // Answered while still waiting (a request that waited for the secret would get 201).
    assert!(t.elapsed() < common::HANG_GUARD, "{:?}", t.elapsed());
    assert_eq!(r.status, 503);
    assert_eq!(r.header("idemgate-error"), Some("store-unavailable"));
    let retry_after: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=3).contains(&retry_after), "{retry_after}");
    assert_eq!(up.hits(), 0, "nothing forwarded while starting");
    let log = std::fs::read_to_string(dir.path().join("idemgate.log")).unwrap();
    assert!(
        log.contains("the store holds no scope secret: waiting scope_secret_create_delay"),
        "{log}"
    );

    // Once the wait is over, ready and serving.
    common::until(Duration::from_secs(10), "never ready", async || {
        http_get(admin, "/readyz").is_some_and(|r| r.starts_with("HTTP/1.1 200"))
    })
    .await;
    assert!(
        bound.elapsed() >= Duration::from_millis(2500),
        "it did wait: {:?}",
        bound.elapsed()
    );
    let r = post_url(
        &c,
        &format!("http://{addr}/pay"),
        Some("k1"),
        r#"{"amount":1}"#,
        &[],
    )
    .await;
    assert_eq!(r.status, 201);
    drop(child);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_answers_nothing_keeps_no_probe_waiting() {
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    redis.pause();
    let (mut cmd, addr, admin, _dir) = Gate::command(
        &up.url(),
        &redis.url(),
        // Far beyond the hang guard: an answer that waited for the connection would not
        // come within it.
        &[("IDEMGATE_REDIS_CONNECT_TIMEOUT", "60s")],
    );
    let (child, _) = spawn_until_bound(&mut cmd, admin);
    for _ in 0..3 {
        let (health, took) = timed_get(admin, "/healthz");
        assert!(health.starts_with("HTTP/1.1 200"), "{health}");
        assert!(took < common::HANG_GUARD, "/healthz took {took:?}");
        let (ready, _) = timed_get(admin, "/readyz");
        assert!(ready.starts_with("HTTP/1.1 503"), "{ready}");
        assert!(ready.contains("opening the store"), "{ready}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let t = Instant::now();
    let r = client()
        .get(format!("http://{addr}/anything"))
        .send()
        .await
        .unwrap();
    assert!(t.elapsed() < common::HANG_GUARD);
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "1");
    redis.resume();
    drop(child);
}

#[test]
fn the_lab_does_not_wait_on_a_fresh_redis() {
    let redis = RedisServer::start();
    let t = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(["lab", "--redis-url", &redis.url(), "--intents", "20"])
        .output()
        .unwrap();
    let took = t.elapsed();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The wait alone would be scope_secret_create_delay's 12 s.
    assert!(took < Duration::from_secs(8), "the lab took {took:?}");
    assert!(
        redis
            .command(&["EXISTS", "idemgate:scope-secret"])
            .unwrap()
            .contains(":1"),
        "it made the store's secret"
    );
}
