//! Overload and hostile clients, through the binary with the documented settings: requests
//! beyond `max_in_flight` wait in a bounded queue, slow bodies hold no slot, clients that
//! stop reading are bounded in memory and closed after `send_timeout`, the embedded store
//! reserves room for the answers of what it admitted, and file descriptors stay under
//! `ulimit -n`.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_beyond_max_in_flight_wait_their_turn_and_beyond_the_queue_are_refused_at_once() {
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url())
        .set(|c| {
            c.max_in_flight = 2;
            c.max_queued = 2;
            c.queue_timeout = Duration::from_secs(10);
        })
        .binary();
    let c = client();
    let url = gate.url("/v1/transfers");
    let send = |key: String, delay: &'static str| {
        let (c, url) = (c.clone(), url.clone());
        tokio::spawn(
            async move { post_url(&c, &url, Some(&key), "{}", &[(DELAY_MS, delay)]).await },
        )
    };
    let running: Vec<_> = (0..2).map(|i| send(format!("run-{i}"), "1500")).collect();
    eventually(Duration::from_secs(5), "two at the upstream", || {
        up.hits() == 2
    })
    .await;
    let queued: Vec<_> = (0..2).map(|i| send(format!("queued-{i}"), "0")).collect();
    common::until(Duration::from_secs(5), "two never queued", async || {
        metric_in(&gate.metrics(), "idemgate_queued{class=\"protected\"}") >= 2.0
    })
    .await;
    // Slots busy, queue full: refused at once, before its body is read, nothing claimed.
    let started = Instant::now();
    let refused = post_url(&c, &url, Some("refused"), "{}", &[]).await;
    assert_eq!(refused.status, 503, "{:?}", refused.body);
    assert!(refused.problem_type().ends_with("/overloaded"));
    let wait: u64 = refused.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=60).contains(&wait), "Retry-After {wait}");
    // Refused while the two it would have queued behind are still queued and the slots'
    // holders still at the upstream: it waited for nothing.
    assert!(
        running.iter().all(|r| !r.is_finished()),
        "a slot freed first"
    );
    assert!(started.elapsed() < common::HANG_GUARD);
    for r in running.into_iter().chain(queued) {
        let a = r.await.unwrap();
        assert_eq!(a.status, 201, "{:?}", a.body);
        assert!(!a.replayed());
    }
    assert_eq!(
        up.hits(),
        4,
        "the queued ones ran once each, after the first two"
    );
    let retry = post_url(&c, &url, Some("refused"), "{}", &[]).await;
    assert_eq!(retry.status, 201);
    assert!(!retry.replayed(), "nothing was claimed by the refusal");
    assert_eq!(up.hits(), 5);
    let m = gate.metrics();
    assert_eq!(
        metric_in(
            &m,
            "idemgate_refused_total{class=\"protected\",reason=\"queue_full\"}"
        ),
        1.0
    );
    assert_eq!(metric_in(&m, "idemgate_queued{class=\"protected\"}"), 0.0);
    assert_eq!(
        metric_in(&m, "idemgate_in_flight{class=\"protected\"}"),
        0.0
    );
    assert!(metric_in(&m, "idemgate_queue_wait_seconds_count{class=\"protected\"}") >= 5.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_request_waits_at_most_queue_timeout_and_claims_nothing() {
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url())
        .set(|c| {
            c.max_in_flight = 1;
            c.queue_timeout = Duration::from_millis(300);
        })
        .binary();
    let c = client();
    let url = gate.url("/v1/transfers");
    let slow = {
        let (c, url) = (c.clone(), url.clone());
        tokio::spawn(
            async move { post_url(&c, &url, Some("slow"), "{}", &[(DELAY_MS, "2000")]).await },
        )
    };
    eventually(Duration::from_secs(5), "one at the upstream", || {
        up.hits() == 1
    })
    .await;
    let started = Instant::now();
    let waited = post_url(&c, &url, Some("waited"), "{}", &[]).await;
    let took = started.elapsed();
    assert_eq!(waited.status, 503, "{:?}", waited.body);
    assert!(waited.problem_type().ends_with("/overloaded"));
    // It waited (about queue_timeout), and gave up while the slot's holder was still at the
    // upstream: it did not wait for the slot.
    assert!(took >= Duration::from_millis(280), "{took:?}");
    assert!(!slow.is_finished(), "waited for the slot: {took:?}");
    assert_eq!(slow.await.unwrap().status, 201);
    let retry = post_url(&c, &url, Some("waited"), "{}", &[]).await;
    assert_eq!((retry.status, retry.replayed()), (201, false));
    assert_eq!(up.hits(), 2);
    assert_eq!(
        metric_in(
            &gate.metrics(),
            "idemgate_refused_total{class=\"protected\",reason=\"queue_timeout\"}"
        ),
        1.0
    );
}

/// Opens `n` connections that each send a protected request's head declaring a body of
/// `len` bytes, and its first byte.
fn slow_bodies_of(addr: SocketAddr, n: usize, len: usize) -> Vec<TcpStream> {
    (0..n)
        .map(|i| {
            let mut s = TcpStream::connect(addr).unwrap();
            write!(
                s,
                "POST /v1/transfers HTTP/1.1\r\nHost: x\r\nIdempotency-Key: slow-{i}\r\nContent-Type: application/json\r\nContent-Length: {len}\r\n\r\n{{"
            )
            .unwrap();
            s
        })
        .collect()
}

/// Opens `n` connections that each send a protected request's head and then one body byte
/// a second.
fn slow_bodies(addr: SocketAddr, n: usize) -> Vec<TcpStream> {
    slow_bodies_of(addr, n, 100)
}

/// Sends one more body byte on each of `slow`, once a second, `seconds` times.
fn trickle(mut slow: Vec<TcpStream>, seconds: usize) -> std::thread::JoinHandle<Vec<TcpStream>> {
    std::thread::spawn(move || {
        for _ in 0..seconds {
            std::thread::sleep(Duration::from_secs(1));
            for s in &mut slow {
                let _ = s.write_all(b" ");
            }
        }
        slow
    })
}

/// A victim's keyed POST, answered within 1 s, five times over 2.5 s.
async fn victim_is_answered(c: &reqwest::Client, url: &str, tag: &str) {
    for i in 0..5 {
        let started = Instant::now();
        let a = tokio::time::timeout(
            Duration::from_secs(1),
            post_url(c, url, Some(&format!("victim-{tag}-{i}")), "{}", &[]),
        )
        .await
        .unwrap_or_else(|_| panic!("victim {i} not answered within 1 s"));
        assert_eq!(a.status, 201, "{:?}", a.body);
        assert!(started.elapsed() < Duration::from_secs(1));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_bodies_hold_no_slot() {
    let up = Upstream::start().await;
    // The Kubernetes ConfigMap's value.
    let gate = Idemgate::new(&up.url())
        .set(|c| c.max_in_flight = 32)
        .binary();
    let addr = gate.addr;
    let slow = tokio::task::spawn_blocking(move || slow_bodies(addr, 40))
        .await
        .unwrap();
    let trickle = trickle(slow, 4);
    victim_is_answered(&client(), &gate.url("/v1/transfers"), "h1").await;
    drop(trickle.join().unwrap());
}

/// 80 clients each declare a 1 MiB body (`max_body_bytes`) and send a byte a second, under
/// the default `max_buffered_bytes` (64 MiB). A body's bytes count against the budget as
/// they arrive: when the declared length was taken up front, these held 80 MiB of a budget
/// they had sent 80 bytes of, and every other protected request got 503 `buffers_full`
/// until their `body_read_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_bodies_declaring_large_lengths_hold_only_what_arrived() {
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url()).binary();
    let addr = gate.addr;
    let slow = tokio::task::spawn_blocking(move || slow_bodies_of(addr, 80, 1024 * 1024))
        .await
        .unwrap();
    let trickle = trickle(slow, 4);
    tokio::time::sleep(Duration::from_millis(200)).await;
    victim_is_answered(&client(), &gate.url("/v1/transfers"), "declared").await;
    let m = gate.metrics();
    assert_eq!(
        metric_in(
            &m,
            "idemgate_refused_total{class=\"protected\",reason=\"buffers_full\"}"
        ),
        0.0
    );
    assert!(metric_in(&m, "idemgate_buffered_bytes") < 1024.0 * 1024.0);
    drop(trickle.join().unwrap());
}

/// A request body that yields one byte a second, `len` in all.
struct Trickle {
    left: usize,
    tick: Pin<Box<tokio::time::Sleep>>,
}

impl hyper::body::Body for Trickle {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        match self.tick.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.left -= 1;
                let next = tokio::time::Instant::now() + Duration::from_secs(1);
                self.tick.as_mut().reset(next);
                Poll::Ready(Some(Ok(hyper::body::Frame::data(Bytes::from_static(b" ")))))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

use std::future::Future;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_h2_streams_hold_no_slot() {
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url())
        .set(|c| c.max_in_flight = 32)
        .binary();
    let mut conns = Vec::new();
    let mut senders = Vec::new();
    for c in 0..6 {
        let tcp = tokio::net::TcpStream::connect(gate.addr).await.unwrap();
        let (mut send, conn) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(tcp),
        )
        .await
        .unwrap();
        tokio::spawn(conn);
        // As many streams as the connection allows (h2_max_concurrent_streams, 100).
        for i in 0..100 {
            send.ready().await.unwrap();
            let req = hyper::Request::post(format!("http://{}/v1/transfers", gate.addr))
                .header("idempotency-key", format!("h2-slow-{c}-{i}"))
                .header("content-type", "application/json")
                .header("content-length", "60")
                .body(Trickle {
                    left: 60,
                    tick: Box::pin(tokio::time::sleep(Duration::from_millis(10))),
                })
                .unwrap();
            conns.push(tokio::spawn(send.send_request(req)));
        }
        senders.push(send);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    victim_is_answered(&client(), &gate.url("/v1/transfers"), "h2").await;
    for c in conns {
        c.abort();
    }
    drop(senders);
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// 300 clients replay a 12 MB answer and never read it. What idemgate holds of their
/// answers counts against `max_buffered_bytes` (beyond it, 503 `overloaded`: most of them
/// here, as the budget holds five such answers), RSS stays under 128 MiB, and the stalled connections are closed after
/// `send_timeout`: without it they stayed open, each holding its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_readers_of_a_large_replay_are_bounded_and_closed_after_send_timeout() {
    let up = Upstream::start().await;
    // The answer is larger than a socket's send buffer can grow to (tcp_wmem's maximum is
    // 4 MiB on Debian), so each write stalls once the kernel's buffers are full.
    let gate = Idemgate::new(&up.url())
        .set(|c| {
            c.send_timeout = Duration::from_secs(3);
            c.defaults.max_response_bytes = 16777216;
        })
        .binary();
    let c = client();
    let size = 12_000_000u64;
    let first = post_url(
        &c,
        &gate.url("/v1/reports"),
        Some("big"),
        "{}",
        &[(ANSWER_BYTES, "12000000")],
    )
    .await;
    assert_eq!(first.status, 201);
    assert_eq!(first.body.len() as u64, size);
    let before = rss_kib(gate.pid());
    let addr = gate.addr;
    // Each client's receive buffer is small and fixed (no autotuning): with the kernel's
    // default a machine whose tcp_rmem allows 32 MB takes whole answers into the socket,
    // no write ever stalls, and nothing here would be tested.
    let mut sockets = Vec::new();
    for _ in 0..300 {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.set_recv_buffer_size(64 * 1024).unwrap();
        let s = sock.connect(addr).await.unwrap().into_std().unwrap();
        s.set_nonblocking(false).unwrap();
        sockets.push(s);
    }
    let stalled = tokio::task::spawn_blocking(move || {
        sockets
            .into_iter()
            .map(|mut s: TcpStream| {
                s.write_all(b"POST /v1/reports HTTP/1.1\r\nHost: x\r\nIdempotency-Key: big\r\nContent-Type: application/json\r\nContent-Length: 2\r\nx-test-answer-bytes: 12000000\r\n\r\n{}").unwrap();
                s
            })
            .collect::<Vec<_>>()
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let during = rss_kib(gate.pid());
    eprintln!("RSS before {before} KiB, with 300 stalled readers {during} KiB");
    assert!(during < 128 * 1024, "RSS {during} KiB");
    assert_eq!(up.hits(), 1, "replays only");
    let m = gate.metrics();
    assert!(metric_in(&m, "idemgate_buffered_bytes") <= 64.0 * 1024.0 * 1024.0 + size as f64);
    // After send_timeout, every stalled connection was closed: reading drains what the
    // kernel holds and then ends.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let m = gate.metrics();
    let closed = metric_in(&m, "idemgate_send_timeouts_total");
    assert!(closed >= 1.0, "{m}");
    assert_eq!(
        metric_in(&m, "idemgate_buffered_bytes"),
        0.0,
        "all given back"
    );
    let ends = tokio::task::spawn_blocking(move || {
        stalled
            .into_iter()
            .map(|mut s| {
                // A connection idemgate still writes to answers within this; one that
                // stays silent longer is open with nothing being written.
                s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
                let mut buf = vec![0u8; 1 << 16];
                let mut total = 0usize;
                let mut head = Vec::new();
                loop {
                    match s.read(&mut buf) {
                        Ok(0) => return Ok((total, head)),
                        Ok(n) => {
                            if head.len() < 12 {
                                head.extend_from_slice(&buf[..n.min(12)]);
                            }
                            total += n
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                            return Ok((total, head))
                        }
                        // A refusal was answered whole; its connection may stay open for
                        // the client's next request (keep-alive), which is no stalled write.
                        Err(_) if head.starts_with(b"HTTP/1.1 503") => return Ok((total, head)),
                        Err(e) => return Err(e.kind()),
                    }
                }
            })
            .collect::<Vec<_>>()
    })
    .await
    .unwrap();
    let open = ends.iter().filter(|e| e.is_err()).count();
    let replays = ends
        .iter()
        .filter(|e| matches!(e, Ok((_, h)) if h.starts_with(b"HTTP/1.1 201")))
        .count();
    let short = ends
        .iter()
        .filter(|e| matches!(e, Ok((n, h)) if h.starts_with(b"HTTP/1.1 201") && (*n as u64) < size))
        .count();
    let refused = ends
        .iter()
        .filter(|e| matches!(e, Ok((_, h)) if h.starts_with(b"HTTP/1.1 503")))
        .count();
    eprintln!("{closed} closed by send_timeout; {replays} replays begun, {short} of them cut short; {refused} refused; {open} still open");
    assert!(short >= 1, "some replays were cut off by send_timeout");
    assert_eq!(open, 0, "a stalled connection outlived send_timeout");
}

/// Beyond `memory_max_bytes`, new keys get 503 `store-unavailable` with a Retry-After, and
/// every key that was admitted and executed keeps its answer: room for it was reserved
/// with the claim (the route's `max_response_bytes`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beyond_memory_max_bytes_new_keys_are_refused_and_admitted_answers_are_kept() {
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url())
        .set(|c| {
            c.memory_max_bytes = 4194304;
            c.defaults.max_response_bytes = 262144;
        })
        .binary();
    let c = client();
    let url = gate.url("/v1/reports");
    let mut executed = Vec::new();
    let mut refused = 0;
    for i in 0..30 {
        let key = format!("r-{i}");
        let a = post_url(&c, &url, Some(&key), "{}", &[(ANSWER_BYTES, "250000")]).await;
        match a.status {
            201 => executed.push(key),
            503 => {
                assert!(
                    a.problem_type().ends_with("/store-unavailable"),
                    "{:?}",
                    a.body
                );
                let wait: u64 = a.header("retry-after").unwrap().parse().unwrap();
                assert!(wait >= 1);
                refused += 1;
            }
            s => panic!("status {s}: {:?}", a.body),
        }
    }
    eprintln!("{} executed, {refused} refused", executed.len());
    assert!(executed.len() >= 10, "{}", executed.len());
    assert!(refused >= 1, "the cap was reached");
    assert_eq!(up.hits(), executed.len());
    for key in &executed {
        let again = post_url(&c, &url, Some(key), "{}", &[(ANSWER_BYTES, "250000")]).await;
        assert_eq!(
            again.status,
            201,
            "{key}: {:?}",
            String::from_utf8_lossy(&again.body[..200.min(again.body.len())])
        );
        assert!(again.replayed(), "{key} was executed and must replay");
    }
    assert_eq!(up.hits(), executed.len());
}

/// Under `ulimit -n 256`: two h2c clients with 200 pass-through streams each never make
/// accept fail with "Too many open files", and a victim keeps being answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_descriptors_stay_under_the_limit_with_h2_clients() {
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url())
        .nofile(256)
        .set(|c| {
            c.max_connections = 150;
            c.max_in_flight = 32;
            c.max_upstream_connections = 64;
        })
        .binary();
    let mut work = Vec::new();
    for _ in 0..2 {
        let h2 = reqwest::Client::builder()
            .http2_prior_knowledge()
            .build()
            .unwrap();
        for _ in 0..200 {
            let (h2, url) = (h2.clone(), gate.url("/status"));
            work.push(tokio::spawn(async move {
                h2.get(&url)
                    .header(DELAY_MS, "1000")
                    .send()
                    .await
                    .map(|r| r.status().as_u16())
            }));
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    victim_is_answered(&client(), &gate.url("/v1/transfers"), "fd").await;
    for w in work {
        let status = w.await.unwrap().unwrap();
        assert!(status == 201 || status == 503, "{status}");
    }
    let log = gate.log();
    assert!(!log.contains("Too many open files"), "{log}");
    // 150 + 64 + 64 (admin) + 128 do not fit under 256: said at start-up.
    assert!(
        log.contains("the open-file limit (ulimit -n) is below what the connection limits can use"),
        "{log}"
    );
    assert!(up.most_in_flight() <= 64, "{}", up.most_in_flight());
}

/// Made-up credentials are each a tenant of their own, and the upstream answers them 401:
/// with `memory_max_records = 200`, 400 such keyed POSTs, then a real tenant's 40 new
/// keys all get 201. Answers that show nothing ran (401, 403, 407) are kept only
/// `short_retention`, and at the record cap they make room first. (With
/// `short_retention_statuses = []`, key 0 of the real tenant got 503.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn made_up_credentials_answered_401_cannot_fill_the_store_for_real_tenants() {
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url())
        .set(|c| c.memory_max_records = 200)
        .binary();
    let c = client();
    let url = gate.url("/v1/transfers");
    for i in 0..400 {
        let a = c
            .post(&url)
            .header("idempotency-key", format!("flood-{i}"))
            .header("authorization", format!("Bearer made-up-{i}"))
            .header("content-type", "application/json")
            .header(STATUS, "401")
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(a.status().as_u16(), 401, "flood {i}");
    }
    for i in 0..40 {
        let a = c
            .post(&url)
            .header("idempotency-key", format!("real-{i}"))
            .header("authorization", "Bearer the-real-tenant")
            .header("content-type", "application/json")
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(
            a.status().as_u16(),
            201,
            "real tenant key {i}: {:?}",
            a.text().await
        );
    }
    // The real tenant's answers are kept (their retention is the route's).
    let again = c
        .post(&url)
        .header("idempotency-key", "real-0")
        .header("authorization", "Bearer the-real-tenant")
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(
        again
            .headers()
            .get("idempotent-replayed")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..])
    );
}

/// Through the binary: a 401 is replayed while its short retention lasts and executes
/// again after it, while a 201 keeps replaying.
async fn short_retention_on(gate: &Gate, up: &Upstream) {
    let c = client();
    let url = gate.url("/v1/transfers");
    let send = |key: &'static str, status: Option<&'static str>| {
        let mut r = c
            .post(&url)
            .header("idempotency-key", key)
            .header("authorization", "Bearer t")
            .header("content-type", "application/json")
            .body("{}");
        if let Some(s) = status {
            r = r.header(STATUS, s);
        }
        r.send()
    };
    assert_eq!(send("denied", Some("401")).await.unwrap().status(), 401);
    assert_eq!(send("paid", None).await.unwrap().status(), 201);
    let replayed = send("denied", Some("401")).await.unwrap();
    assert_eq!(replayed.status(), 401);
    assert!(replayed.headers().contains_key("idempotent-replayed"));
    assert_eq!(up.hits(), 2);
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let again = send("denied", Some("401")).await.unwrap();
    assert_eq!(again.status(), 401);
    assert!(
        !again.headers().contains_key("idempotent-replayed"),
        "executed again"
    );
    let paid = send("paid", None).await.unwrap();
    assert!(
        paid.headers().contains_key("idempotent-replayed"),
        "kept for retention"
    );
    assert_eq!(up.hits(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_retention_on_redis_and_sqlite() {
    let up = Upstream::start().await;
    let redis = RedisServer::start();
    let one_second = |c: &mut idemgate::Config| c.defaults.short_retention = Duration::from_secs(1);
    let gate = Idemgate::new(&up.url())
        .redis(&redis)
        .set(one_second)
        .binary();
    short_retention_on(&gate, &up).await;
    drop(gate);
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let gate = Idemgate::new(&up.url())
        .on_disk(dir.path())
        .set(one_second)
        .binary();
    short_retention_on(&gate, &up).await;
}

/// An HTTP/2 client that pings every 0.9 s: its connection is closed `idle_timeout` after
/// its last stream (and, with no stream at all, after its preface), not kept for
/// `header_read_timeout` as if each PING began a request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_pings_do_not_keep_an_idle_connection_open() {
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url())
        .set(|c| {
            c.idle_timeout = Duration::from_secs(1);
            c.header_read_timeout = Duration::from_secs(30);
        })
        .binary();
    let tcp = tokio::net::TcpStream::connect(gate.addr).await.unwrap();
    let (mut send, conn) =
        hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .timer(hyper_util::rt::TokioTimer::new())
            .keep_alive_interval(Duration::from_millis(900))
            .keep_alive_timeout(Duration::from_secs(20))
            .keep_alive_while_idle(true)
            .handshake(hyper_util::rt::TokioIo::new(tcp))
            .await
            .unwrap();
    let conn = tokio::spawn(conn);
    let req = hyper::Request::post(format!("http://{}/v1/transfers", gate.addr))
        .header("idempotency-key", "h2-ping")
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    let res = send.send_request(req).await.unwrap();
    assert_eq!(res.status(), 201);
    drop(
        http_body_util::BodyExt::collect(res.into_body())
            .await
            .unwrap(),
    );
    let idle = Instant::now();
    tokio::time::timeout(Duration::from_secs(5), conn)
        .await
        .expect("closed within 5 s of its last stream")
        .unwrap()
        .ok();
    let took = idle.elapsed();
    assert!(took >= Duration::from_millis(900), "{took:?}");
    assert!(send.is_closed());

    // A connection that never opens a stream: its preface, then only PINGs.
    let tcp = tokio::net::TcpStream::connect(gate.addr).await.unwrap();
    let started = Instant::now();
    let (_send, conn) =
        hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .timer(hyper_util::rt::TokioTimer::new())
            .keep_alive_interval(Duration::from_millis(900))
            .keep_alive_timeout(Duration::from_secs(20))
            .keep_alive_while_idle(true)
            .handshake::<_, http_body_util::Full<Bytes>>(hyper_util::rt::TokioIo::new(tcp))
            .await
            .unwrap();
    tokio::time::timeout(Duration::from_secs(5), conn)
        .await
        .expect("closed within 5 s of its preface")
        .ok();
    assert!(started.elapsed() >= Duration::from_millis(900));
}
