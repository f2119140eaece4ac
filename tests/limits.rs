//! Everything a client, an upstream or a burst can make idemgate hold is bounded: silent and
//! idle connections, open connections, answers too large to keep, the embedded store's
//! bytes, protected requests in flight, and the time shutdown takes.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::*;
use idemgate::Config;

on_both_stores!(
    a_large_answer_reaches_its_client_and_its_retry_never_executes,
    a_burst_beyond_max_in_flight_and_the_queue_is_refused_at_once_and_claims_nothing,
);

/// The tests that load the machine most (hundreds of connections, hundreds of megabytes,
/// multi-MiB Redis traffic) run one at a time: each one's margins assume it has the
/// machine's cores to itself, not that it shares them with another of these.
static HEAVY: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn heavy() -> std::sync::MutexGuard<'static, ()> {
    HEAVY.lock().unwrap_or_else(|p| p.into_inner())
}

/// Reads from `s` until the peer closes; `Err` if it is still open after `limit`.
fn closed_within(s: &mut TcpStream, limit: Duration) -> Result<Vec<u8>, String> {
    s.set_read_timeout(Some(limit)).unwrap();
    let mut out = Vec::new();
    match s.read_to_end(&mut out) {
        Ok(_) => Ok(out),
        // A close with unread data pending is a reset: closed all the same.
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Ok(out),
        Err(e) => Err(format!("still open after {limit:?} ({e})")),
    }
}

fn connect(addr: SocketAddr) -> TcpStream {
    TcpStream::connect_timeout(&addr, Duration::from_secs(2)).expect("connect")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_that_send_no_complete_head_are_closed_counting_from_accept() {
    let up = Upstream::start().await;
    let mut c = config(&up, &Backend::memory());
    c.header_read_timeout = Duration::from_millis(500);
    let app = spawn_app(c).await;
    let addr = app.addr();
    tokio::task::spawn_blocking(move || {
        let started = Instant::now();
        // Not a byte: hyper-util's protocol detection alone had no timer for this one.
        let mut silent = connect(addr);
        // Half a request line, then nothing.
        let mut partial = connect(addr);
        partial.write_all(b"POST /v1/transfers HT").unwrap();
        // Half a head, then nothing.
        let mut half = connect(addr);
        half.write_all(b"POST /v1/transfers HTTP/1.1\r\nhost: x\r\n")
            .unwrap();
        for s in [&mut silent, &mut partial, &mut half] {
            closed_within(s, Duration::from_secs(5)).unwrap();
        }
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(450),
            "closed before the header timeout: {took:?}"
        );
    })
    .await
    .unwrap();
    assert_eq!(up.hits(), 0);
    app.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_keep_alive_connection_is_closed_after_idle_timeout_and_not_before() {
    let up = Upstream::start().await;
    let mut c = config(&up, &Backend::memory());
    c.header_read_timeout = Duration::from_secs(30);
    c.idle_timeout = Duration::from_millis(1500);
    let app = spawn_app(c).await;
    let addr = app.addr();
    tokio::task::spawn_blocking(move || {
        let mut s = connect(addr);
        let get = b"GET /status HTTP/1.1\r\nhost: x\r\n\r\n";
        let answer = |s: &mut TcpStream| {
            s.write_all(get).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut buf = [0u8; 4096];
            let n = s.read(&mut buf).unwrap();
            assert!(buf[..n].starts_with(b"HTTP/1.1 201"), "{:?}", &buf[..n]);
        };
        answer(&mut s);
        // Requests a little apart keep it open: each one restarts the idle clock.
        for _ in 0..3 {
            std::thread::sleep(Duration::from_millis(700));
            answer(&mut s);
        }
        let idle_from = Instant::now();
        closed_within(&mut s, Duration::from_secs(10)).unwrap();
        let idle = idle_from.elapsed();
        assert!(
            idle >= Duration::from_millis(1400),
            "closed early: {idle:?}"
        );
    })
    .await
    .unwrap();
    assert_eq!(up.hits(), 4);
    app.shutdown().await;
}

/// Through the binary with the documented settings: `idle_timeout = "1s"` under a
/// `header_read_timeout` of 30 s closes a keep-alive connection within it after its first
/// answer, a pass-through GET's and a protected POST's alike. Before, the connection's
/// supervisor slept towards the head deadline from accept, and both were still open 8 s
/// later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_timeout_applies_after_the_first_answer_through_the_binary() {
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url())
        .set(|c| {
            c.idle_timeout = Duration::from_secs(1);
            c.header_read_timeout = Duration::from_secs(30);
        })
        .binary();
    let addr = gate.addr;
    tokio::task::spawn_blocking(move || {
        for request in [
            &b"GET /status HTTP/1.1\r\nhost: x\r\n\r\n"[..],
            &b"POST /v1/transfers HTTP/1.1\r\nhost: x\r\nidempotency-key: idle-1\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"[..],
        ] {
            let mut s = connect(addr);
            s.write_all(request).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut buf = [0u8; 4096];
            let n = s.read(&mut buf).unwrap();
            assert!(buf[..n].starts_with(b"HTTP/1.1 201"), "{:?}", String::from_utf8_lossy(&buf[..n]));
            let idle_from = Instant::now();
            closed_within(&mut s, Duration::from_secs(8)).unwrap();
            let idle = idle_from.elapsed();
            assert!(
                idle >= Duration::from_millis(900) && idle < Duration::from_millis(2500),
                "closed {idle:?} after the answer, for a 1 s idle_timeout"
            );
        }
    })
    .await
    .unwrap();
    assert_eq!(up.hits(), 2);
}

/// One h2c client connection opens 150 slow pass-through requests at once: no more than
/// `h2_max_concurrent_streams` are open at a time (each may hold an upstream connection);
/// the others wait for a stream and are all answered. With hyper's default of 200, all
/// 150 reached the upstream together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2_connection_has_at_most_h2_max_concurrent_streams_open() {
    let up = Upstream::start().await;
    // Through the binary, set the way a user would.
    let gate = Gate::start(
        &up.url(),
        "",
        &[("IDEMGATE_H2_MAX_CONCURRENT_STREAMS", "20")],
    );
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let url = gate.url("/status");
    let requests: Vec<_> = (0..150)
        .map(|_| {
            let (h2, url) = (h2.clone(), url.clone());
            tokio::spawn(async move {
                h2.get(&url)
                    .header(DELAY_MS, "200")
                    .send()
                    .await
                    .map(|r| r.status().as_u16())
            })
        })
        .collect();
    for r in requests {
        assert_eq!(r.await.unwrap().unwrap(), 201);
    }
    assert_eq!(up.hits(), 150);
    let most = up.most_in_flight();
    assert!(
        most <= 20,
        "{most} streams of one connection at the upstream at once"
    );
    assert!(most >= 10, "the streams did run concurrently: {most}");
}

/// 64 silent connections fill the admin listener's cap; they are closed after 1 s without a
/// head, so the liveness probe gets in again at once (with the proxy's 10 s head deadline
/// it was reset for 10 s). A flood that keeps reopening them cannot keep a probe out either:
/// at the cap the oldest connection serving nothing makes room (tests/overload.rs), and the
/// manifests' NetworkPolicy (deploy/k8s/common/networkpolicy.yaml) admits only the scraper's pods
/// to the admin port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_admin_connections_keep_the_probe_out_for_at_most_a_second() {
    let up = Upstream::start().await;
    let app = spawn_app(config(&up, &Backend::memory())).await;
    let admin = app.admin_addr().unwrap();
    tokio::task::spawn_blocking(move || {
        let silent: Vec<_> = (0..64).map(|_| connect(admin)).collect();
        std::thread::sleep(Duration::from_millis(1500));
        let probe = http_get(admin, "/healthz").unwrap_or_default();
        assert!(
            probe.starts_with("HTTP/1.1 200"),
            "probe after 1.5 s: {probe:?}"
        );
        drop(silent);
    })
    .await
    .unwrap();
    app.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beyond_max_connections_new_ones_are_closed_at_once_and_admin_still_answers() {
    let up = Upstream::start().await;
    let mut c = config(&up, &Backend::memory());
    c.header_read_timeout = Duration::from_secs(60);
    c.max_connections = 20;
    let app = spawn_app(c).await;
    let (addr, admin) = (app.addr(), app.admin_addr().unwrap());
    let held = tokio::task::spawn_blocking(move || {
        let mut held: Vec<TcpStream> = (0..20).map(|_| connect(addr)).collect();
        // The cap is checked on accept: let idemgate take all twenty before the next.
        std::thread::sleep(Duration::from_millis(300));
        for _ in 0..10 {
            let mut extra = connect(addr);
            closed_within(&mut extra, Duration::from_secs(2)).unwrap();
        }
        let health = http_get(admin, "/healthz").unwrap_or_default();
        assert!(health.starts_with("HTTP/1.1 200"), "{health}");
        // One of the twenty closes: a new connection gets in.
        held.pop();
        held
    })
    .await
    .unwrap();
    let client = client();
    let mut ok = false;
    for _ in 0..100 {
        let r = client
            .post(format!("http://{addr}/v1/transfers"))
            .body("{}")
            .send()
            .await;
        if r.is_ok_and(|r| r.status().as_u16() == 201) {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(ok, "a connection freed below the cap was never used again");
    drop(held);
    app.shutdown().await;
}

/// The real binary under `ulimit -n 256`: hundreds of silent connections come and go while
/// a client on its keep-alive connection never sees a failure, the admin listener keeps
/// answering, and once the silent ones are closed new connections are served again.
#[test]
fn hundreds_of_silent_connections_under_a_low_fd_limit_leave_normal_traffic_alone() {
    let _heavy = heavy();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let up = rt.block_on(Upstream::start());
    let redis = RedisServer::start();
    let gate = Idemgate::new(&up.url())
        .redis(&redis)
        .set(|c| {
            c.header_read_timeout = Duration::from_secs(1);
            c.max_connections = 150;
        })
        .binary();
    let status = std::process::Command::new("prlimit")
        .arg(format!("--pid={}", gate.pid()))
        .arg("--nofile=256:256")
        .status()
        .expect("prlimit");
    assert!(status.success());
    let (addr, admin) = (gate.addr, gate.admin);
    // Normal traffic: one keep-alive connection, opened (by a first request that has been
    // answered) before the flood starts. hyper's client on one socket, which never opens
    // another: reqwest's pool opens a second connection whenever the first is not back in
    // it yet (on a starved machine, 20 ms can be too soon), and a connection opened during
    // the flood finds every slot taken and is closed at once, which says nothing of this
    // one.
    let mut normal = rt.block_on(async {
        let io = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(io))
                .await
                .unwrap();
        tokio::spawn(conn);
        sender
    });
    let first = rt.block_on(post_on(&mut normal, addr, "normal-0"));
    assert_eq!(first, Ok(201));
    let traffic = rt.spawn(async move {
        let mut answers = Vec::new();
        let until = Instant::now() + Duration::from_secs(6);
        let mut i = 0;
        while Instant::now() < until {
            i += 1;
            answers.push(post_on(&mut normal, addr, &format!("normal-{i}")).await);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        answers
    });
    let flood = std::thread::spawn(move || {
        let mut silent = Vec::new();
        for wave in 0..3 {
            for _ in 0..200 {
                // Long enough for a SYN retransmission (1 s, then 2 s more) when a loaded
                // machine drops one: the kernel completes the handshake, not idemgate.
                if let Ok(s) = TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
                    silent.push(s);
                }
            }
            let health = http_get(admin, "/healthz").unwrap_or_default();
            assert!(
                health.starts_with("HTTP/1.1 200"),
                "admin during wave {wave}: {health:?}"
            );
            std::thread::sleep(Duration::from_millis(700));
        }
        // Every one of them is closed by now or within the header timeout.
        for s in &mut silent {
            closed_within(s, Duration::from_secs(5)).unwrap();
        }
        silent.len()
    });
    let opened = flood.join().expect("flood");
    assert_eq!(opened, 600, "the listener stopped accepting");
    let answers = rt.block_on(traffic).unwrap();
    assert!(answers.len() > 20, "{}", answers.len());
    let failed: Vec<_> = answers.iter().filter(|a| **a != Ok(201)).collect();
    assert!(failed.is_empty(), "normal traffic failed: {failed:?}");
    // New connections are served again.
    let fresh = http_get(addr, "/status").unwrap_or_default();
    assert!(fresh.starts_with("HTTP/1.1 201"), "{fresh}");
    assert!(
        !gate.log().contains("Too many open files"),
        "{}",
        gate.log()
    );
}

async fn a_large_answer_reaches_its_client_and_its_retry_never_executes(backend: Backend) {
    let up = Upstream::start().await;
    let mut c = config(&up, &backend);
    c.defaults.max_response_bytes = 64 * 1024;
    let app = spawn_app(c).await;
    let client = client();
    let size = 1_000_000u64;
    let big = size.to_string();
    let first = post(
        &client,
        &app,
        "/v1/reports",
        Some("big-1"),
        "{}",
        &[(ANSWER_BYTES, &big)],
    )
    .await;
    assert_eq!(first.status, 201);
    assert_eq!(first.body.len() as u64, size, "the client got all of it");
    assert!(first
        .body
        .iter()
        .enumerate()
        .all(|(i, b)| *b == big_answer_byte(i as u64)));
    let retry = post(
        &client,
        &app,
        "/v1/reports",
        Some("big-1"),
        "{}",
        &[(ANSWER_BYTES, &big)],
    )
    .await;
    assert_eq!(retry.status, 409);
    assert_eq!(
        retry.problem_type(),
        "https://idemgate.dev/problems/response-not-stored"
    );
    let id = retry.json()["record_id"].as_str().unwrap().to_string();
    assert!(retry.json()["detail"].as_str().unwrap().contains("201"));
    assert_eq!(up.hits(), 1, "the retry was executed again");
    let record = inspect(&client, app.admin_addr().unwrap(), &id)
        .await
        .unwrap();
    assert_eq!(record["state"], "completed");
    assert_eq!(record["status"], 201);
    assert_eq!(record["body_kept"], false);
    // An answer within the limit is still kept and replayed.
    let small = "1000";
    let a = post(
        &client,
        &app,
        "/v1/reports",
        Some("small-1"),
        "{}",
        &[(ANSWER_BYTES, small)],
    )
    .await;
    let b = post(
        &client,
        &app,
        "/v1/reports",
        Some("small-1"),
        "{}",
        &[(ANSWER_BYTES, small)],
    )
    .await;
    assert_eq!((a.status, b.status), (201, 201));
    assert!(b.replayed());
    assert_eq!(a.body, b.body);
    assert_eq!(up.hits(), 2);
    app.shutdown().await;
}

async fn a_burst_beyond_max_in_flight_and_the_queue_is_refused_at_once_and_claims_nothing(
    backend: Backend,
) {
    let up = Upstream::start().await;
    let mut c = config(&up, &backend);
    c.max_in_flight = 2;
    // No room to wait: refused at once (tests/overload.rs covers the queue).
    c.max_queued = 0;
    let app = spawn_app(c).await;
    let client = client();
    let slow = |key: &'static str| {
        let (client, url) = (
            client.clone(),
            format!("http://{}/v1/transfers", app.addr()),
        );
        tokio::spawn(async move {
            post_url(&client, &url, Some(key), "{}", &[(DELAY_MS, "1500")]).await
        })
    };
    let (a, b) = (slow("slow-a"), slow("slow-b"));
    eventually(
        Duration::from_secs(5),
        "two requests at the upstream",
        || up.hits() == 2,
    )
    .await;
    let started = Instant::now();
    let third = post(&client, &app, "/v1/transfers", Some("third"), "{}", &[]).await;
    assert_eq!(third.status, 503);
    assert_eq!(
        third.problem_type(),
        "https://idemgate.dev/problems/overloaded"
    );
    assert_eq!(third.header("retry-after"), Some("1"));
    // Refused while both slots' holders are still at the upstream: it waited for neither.
    assert!(!a.is_finished() && !b.is_finished(), "a slot freed first");
    assert!(started.elapsed() < common::HANG_GUARD);
    // Requests without a key are not protected, and not counted.
    let unprotected = post(&client, &app, "/v1/transfers", None, "{}", &[]).await;
    assert_eq!(unprotected.status, 201);
    assert_eq!(up.hits(), 3);
    assert_eq!(a.await.unwrap().status, 201);
    assert_eq!(b.await.unwrap().status, 201);
    // Nothing was claimed: the retry executes normally.
    let retry = post(&client, &app, "/v1/transfers", Some("third"), "{}", &[]).await;
    assert_eq!(retry.status, 201);
    assert!(!retry.replayed());
    assert_eq!(up.hits(), 4);
    let metrics = app.metrics();
    assert!(
        metrics.contains("idemgate_requests_total{route=\"default\",outcome=\"overloaded\"} 1"),
        "{metrics}"
    );
    app.shutdown().await;
}

/// The embedded store's byte cap counts the room each claim reserves for its answer (the
/// route's `max_response_bytes` plus 64 KiB for its head and upkeep) until the answer
/// lands, and then only the record as kept. With room for three reservations, three slow
/// requests run at once and a fourth new key gets 503 `store-unavailable`, not forwarded;
/// once the three have landed, their unused room is back and forty more keys fit one after
/// another; every executed key replays byte for byte, and none executes twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_store_is_bounded_in_bytes() {
    let up = Upstream::start().await;
    // A reservation is 30,000 + 65,536 bytes and the record's upkeep: three fit, four not.
    let gate = Idemgate::new(&up.url())
        .set(|c| {
            c.memory_max_bytes = 307200;
            c.defaults.max_response_bytes = 30000;
        })
        .binary();
    let c = client();
    let url = gate.url("/v1/reports");
    let slow: Vec<_> = (0..3)
        .map(|i| {
            let (c, url) = (c.clone(), url.clone());
            tokio::spawn(async move {
                let key = format!("slow-{i}");
                post_url(
                    &c,
                    &url,
                    Some(&key),
                    "{}",
                    &[(DELAY_MS, "1500"), (ANSWER_BYTES, "20000")],
                )
                .await
            })
        })
        .collect();
    eventually(Duration::from_secs(5), "three at the upstream", || {
        up.hits() == 3
    })
    .await;
    let full = post_url(&c, &url, Some("fourth"), "{}", &[]).await;
    assert_eq!(full.status, 503, "{:?}", full.body);
    assert_eq!(
        full.problem_type(),
        "https://idemgate.dev/problems/store-unavailable"
    );
    let wait: u64 = full.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=60).contains(&wait), "Retry-After {wait}");
    assert_eq!(up.hits(), 3, "refused before it was forwarded");
    let metrics = http_get(gate.admin, "/metrics").unwrap_or_default();
    assert!(
        metrics.contains("idemgate_refused_total{class=\"protected\",reason=\"store_full\"} 1"),
        "{metrics}"
    );
    for s in slow {
        let a = s.await.unwrap();
        assert_eq!(a.status, 201, "{:?}", a.body);
        assert_eq!(a.body.len(), 20000);
    }
    for i in 0..40 {
        let a = post_url(&c, &url, Some(&format!("small-{i}")), "{}", &[]).await;
        assert_eq!((a.status, a.replayed()), (201, false), "small-{i}");
    }
    let fourth = post_url(&c, &url, Some("fourth"), "{}", &[]).await;
    assert_eq!((fourth.status, fourth.replayed()), (201, false));
    assert_eq!(up.hits(), 44);
    for i in 0..3 {
        let key = format!("slow-{i}");
        let r = post_url(&c, &url, Some(&key), "{}", &[(ANSWER_BYTES, "20000")]).await;
        assert!(r.replayed(), "{key}: {}", r.status);
        assert_eq!(r.body.len(), 20000);
        assert!(r
            .body
            .iter()
            .enumerate()
            .all(|(i, b)| *b == big_answer_byte(i as u64)));
    }
    for key in (0..40)
        .map(|i| format!("small-{i}"))
        .chain(["fourth".into()])
    {
        let r = post_url(&c, &url, Some(&key), "{}", &[]).await;
        assert!(r.replayed(), "{key}: {}", r.status);
    }
    assert_eq!(up.hits(), 44, "nothing executed twice");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_takes_one_grace_period_in_all() {
    let up = Upstream::start().await;
    let mut c = config(&up, &Backend::memory());
    c.shutdown_grace = Duration::from_secs(2);
    c.defaults.upstream_timeout = Duration::from_secs(60);
    c.defaults.retention = Duration::from_secs(120);
    let app = spawn_app(c).await;
    // One exchange whose client is still connected, one whose client has left: both hang.
    let url = format!("http://{}/v1/transfers", app.addr());
    let waiting = {
        let (client, url) = (client(), url.clone());
        tokio::spawn(async move {
            let _ = client
                .post(&url)
                .header("idempotency-key", "stays")
                .header(FAULT, "hang")
                .body("{}")
                .send()
                .await;
        })
    };
    let left = {
        let (client, url) = (client(), url.clone());
        tokio::spawn(async move {
            let _ = client
                .post(&url)
                .header("idempotency-key", "leaves")
                .header(FAULT, "hang")
                .body("{}")
                .send()
                .await;
        })
    };
    eventually(Duration::from_secs(5), "both at the upstream", || {
        up.hits() == 2
    })
    .await;
    left.abort();
    let started = Instant::now();
    app.shutdown().await;
    let took = started.elapsed();
    // Both exchanges hang for ever: without the grace the shutdown would not end.
    assert!(
        took < common::HANG_GUARD,
        "shutdown took {took:?} for a 2 s grace"
    );
    assert!(
        took >= Duration::from_millis(1900),
        "did not drain: {took:?}"
    );
    waiting.abort();
}

/// A `POST /v1/transfers` of `{}` under `key` on one client connection, its answer read
/// to the end: the status, or the error (the whole chain) that ended the connection.
async fn post_on(
    sender: &mut hyper::client::conn::http1::SendRequest<http_body_util::Full<bytes::Bytes>>,
    addr: SocketAddr,
    key: &str,
) -> Result<u16, String> {
    use http_body_util::BodyExt;
    sender.ready().await.map_err(|e| format!("{e:?}"))?;
    let req = hyper::Request::post("/v1/transfers")
        .header("host", addr.to_string())
        .header("idempotency-key", key)
        .body(http_body_util::Full::new(bytes::Bytes::from_static(b"{}")))
        .unwrap();
    let answer = sender
        .send_request(req)
        .await
        .map_err(|e| format!("{e:?}"))?;
    let status = answer.status().as_u16();
    answer
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("{e:?}"))?;
    Ok(status)
}

/// Peak resident memory (VmHWM) of a process, in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb * 1024
}

/// The real binary on the embedded store: three concurrent 100 MB answers reach their
/// clients in full while idemgate's peak memory stays within a few times
/// `max_body_bytes + max_response_bytes` (it held every answer, and a copy, before).
#[test]
fn concurrent_huge_answers_cost_bounded_memory() {
    let _heavy = heavy();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let up = rt.block_on(Upstream::start());
    let gate = Idemgate::new(&up.url())
        .set(|c| c.defaults.max_response_bytes = 4194304)
        .binary();
    let before = peak_rss(gate.pid());
    let size: u64 = 100_000_000;
    let url = gate.url("/v1/exports");
    let received = rt.block_on(async move {
        let client = reqwest::Client::new();
        let downloads = (0..3).map(|i| {
            let (client, url) = (client.clone(), url.clone());
            tokio::spawn(async move {
                let mut res = client
                    .post(&url)
                    .header("idempotency-key", format!("export-{i}"))
                    .header(ANSWER_BYTES, size.to_string())
                    .body("{}")
                    .send()
                    .await
                    .unwrap();
                assert_eq!(res.status().as_u16(), 201);
                let mut n = 0u64;
                while let Some(chunk) = res.chunk().await.unwrap() {
                    assert_eq!(chunk[0], big_answer_byte(n), "at byte {n}");
                    n += chunk.len() as u64;
                }
                n
            })
        });
        let mut total = Vec::new();
        for d in downloads.collect::<Vec<_>>() {
            total.push(d.await.unwrap());
        }
        total
    });
    assert_eq!(received, vec![size; 3]);
    let peak = peak_rss(gate.pid());
    eprintln!(
        "idemgate peak RSS: {:.1} MiB at start, {:.1} MiB after 3 concurrent 100 MB answers",
        before as f64 / 1048576.0,
        peak as f64 / 1048576.0
    );
    // 3 x (1 MiB body + 4 MiB answer) is 15 MiB; before the limit it was over 300 MiB.
    assert!(
        peak < before + 64 * 1024 * 1024,
        "peak RSS {peak} bytes (started at {before})"
    );
    assert_eq!(up.hits(), 3);
}

/// On Redis, one shared connection carries every key: multi-MiB answers being recorded and
/// replayed back to back must not hold other keys' claims beyond `store_timeout`. Prints
/// the unrelated keys' claim latencies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
// The guard only keeps the other heavy tests out; nothing else waits for it.
#[allow(clippy::await_holding_lock)]
async fn large_answers_on_redis_do_not_hold_up_other_keys() {
    let _heavy = heavy();
    use idemgate::fingerprint::Fingerprint;
    use idemgate::key::RecordId;
    use idemgate::store::{Claim, ClaimRequest, OwnerToken, RedisStore, Store, StoredResponse};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    let redis = RedisServer::start();
    let store_timeout = Config::default().store_timeout;
    let store = Arc::new(
        RedisStore::connect(&redis.url(), Duration::from_secs(1), store_timeout)
            .await
            .unwrap(),
    );
    let claim = |n: u64| ClaimRequest {
        id: RecordId::from_hex(&format!("{n:064x}")).unwrap(),
        fingerprint: Fingerprint([1; 32]),
        fingerprint_version: 1,
        owner: OwnerToken::random(),
        lease: Duration::from_secs(10),
        retention: Duration::from_secs(60),
        busy_for: Duration::from_secs(10),
        answer_room: 0,
        room: None,
    };
    let big = StoredResponse {
        status: 201,
        headers: vec![(
            "content-type".into(),
            bytes::Bytes::from_static(b"application/octet-stream"),
        )],
        body: bytes::Bytes::from(vec![7u8; 4 * 1024 * 1024]),
    };
    let stop = Arc::new(AtomicBool::new(false));
    // Six loops: each records a new 4 MiB answer, then replays it twice.
    let heavy: Vec<_> = (0..6u64)
        .map(|i| {
            let (store, stop, big) = (store.clone(), stop.clone(), big.clone());
            tokio::spawn(async move {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    let c = claim(1_000_000 * (i + 1) + n);
                    assert_eq!(store.claim(&c).await.unwrap(), Claim::Claimed);
                    assert!(store.record(&c.id, &c.owner, &big).await.unwrap());
                    for _ in 0..2 {
                        let Claim::Replay(r) = store.claim(&c).await.unwrap() else {
                            panic!("not a replay");
                        };
                        assert_eq!(r.body.len(), big.body.len());
                    }
                }
                n
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut latencies = Vec::new();
    for n in 0..300 {
        let c = claim(n);
        let started = Instant::now();
        let found = idemgate::store::deadline(store_timeout, store.claim(&c)).await;
        latencies.push(started.elapsed());
        assert_eq!(found.unwrap(), Claim::Claimed, "claim {n}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let mut big_ones = 0;
    for h in heavy {
        big_ones += h.await.unwrap();
    }
    latencies.sort();
    let pct = |p: f64| latencies[((latencies.len() - 1) as f64 * p) as usize];
    eprintln!(
        "unrelated claims while {big_ones} 4 MiB answers were recorded and replayed twice: p50 {:?} p99 {:?} max {:?}",
        pct(0.5),
        pct(0.99),
        latencies.last().unwrap()
    );
}

/// Below one answer's reservation (the largest `max_response_bytes` of any route plus 64
/// KiB), every new key on the embedded store would get 503 forever: start-up refuses it
/// with exit 64, naming both settings.
#[test]
fn memory_max_bytes_below_one_reservation_stops_start_up() {
    for (env, names) in [
        (
            vec![("IDEMGATE_MEMORY_MAX_BYTES", "102400")],
            "defaults.max_response_bytes",
        ),
        (
            vec![
                ("IDEMGATE_MEMORY_MAX_BYTES", "102400"),
                ("IDEMGATE_DEFAULTS__MAX_RESPONSE_BYTES", "20000"),
                (
                    "IDEMGATE_ROUTES",
                    r#"[{path = "/a"}, {path = "/b", max_response_bytes = 50000}]"#,
                ),
            ],
            "routes[1].max_response_bytes",
        ),
    ] {
        let mut env = env;
        env.push(("IDEMGATE_UPSTREAM", "http://127.0.0.1:9"));
        let (code, err) = start_up_failure(&env);
        assert_eq!(code, Some(64), "{err}");
        assert!(err.contains("memory_max_bytes"), "{err}");
        assert!(err.contains(names), "{err}");
    }
    // One reservation fits: it starts (and is stopped here).
    let up = "http://127.0.0.1:9";
    let gate = Idemgate::new(up)
        .set(|c| {
            c.memory_max_bytes = 102400;
            c.defaults.max_response_bytes = 30000;
        })
        .binary();
    drop(gate);
}
