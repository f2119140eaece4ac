//! `worker_threads` above one: the binary serves from several threads, each with an event
//! loop, a Redis connection and an upstream pool of its own, all accepting from one
//! listener. What must hold: connections are spread over the threads (each serves), every
//! key still executes at most once when its requests land on different threads, and a
//! SIGTERM drains every thread's requests before the process exits.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::*;

const TRANSFER: &str = r#"{"from":"acc-1","to":"acc-2","amount":1250,"currency":"EUR"}"#;

/// CPU time (clock ticks) of each of the process's threads, by thread name.
fn thread_ticks(pid: u32) -> HashMap<String, u64> {
    let mut out = HashMap::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let dir = task.unwrap().path();
        let name = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        let stat = std::fs::read_to_string(dir.join("stat")).unwrap_or_default();
        // Fields after the command name, which is in parentheses: utime is the 12th, stime
        // the 13th.
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .map(|(_, rest)| rest.split_whitespace().collect())
            .unwrap_or_default();
        let ticks = fields
            .get(11)
            .and_then(|u| u.parse::<u64>().ok())
            .unwrap_or(0)
            + fields
                .get(12)
                .and_then(|s| s.parse::<u64>().ok())
                .unwrap_or(0);
        *out.entry(name.trim().to_string()).or_default() += ticks;
    }
    out
}

/// One request on an open connection, HTTP/1.1 by hand: its status and body.
async fn send(conn: &mut tokio::net::TcpStream, key: &str) -> (u16, Vec<u8>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let req = format!(
        "POST /v1/transfers HTTP/1.1\r\nHost: idemgate\r\nContent-Type: application/json\r\nIdempotency-Key: {key}\r\nContent-Length: {}\r\n\r\n{TRANSFER}",
        TRANSFER.len()
    );
    conn.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let status: u16 = head[9..12].parse().unwrap();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map(|v| v.trim().parse().unwrap())
                .unwrap_or(0);
            while buf.len() < end + 4 + len {
                let n = conn.read(&mut chunk).await.unwrap();
                assert!(n > 0, "connection closed mid-answer");
                buf.extend_from_slice(&chunk[..n]);
            }
            return (status, buf[end + 4..end + 4 + len].to_vec());
        }
        let n = conn.read(&mut chunk).await.unwrap();
        assert!(n > 0, "connection closed before an answer");
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// `n` connections opened all at once before any request (so that they wait in the
/// listener's backlog together, as a load balancer's pool arrives), then `per` requests on
/// each: the statuses and bodies.
async fn burst(
    gate: &Gate,
    n: usize,
    per: usize,
    key: impl Fn(usize, usize) -> String,
) -> Vec<(u16, Vec<u8>)> {
    let conns: Vec<_> = (0..n)
        .map(|_| tokio::net::TcpStream::connect(gate.addr))
        .collect();
    let mut open = Vec::new();
    for c in conns {
        open.push(c.await.unwrap());
    }
    let mut calls = Vec::new();
    for (i, mut conn) in open.into_iter().enumerate() {
        let keys: Vec<String> = (0..per).map(|j| key(i, j)).collect();
        calls.push(tokio::spawn(async move {
            let mut answers = Vec::new();
            for k in keys {
                answers.push(send(&mut conn, &k).await);
            }
            answers
        }));
    }
    let mut all = Vec::new();
    for c in calls {
        all.extend(c.await.unwrap());
    }
    all
}

async fn spread_and_once(redis_url: &str) {
    let up = Upstream::start().await;
    let (upstream, store) = (up.url(), redis_url.to_string());
    let gate = tokio::task::spawn_blocking(move || {
        Idemgate::new(&upstream)
            .redis_url(&store)
            .set(|c| c.worker_threads = 2)
            .binary()
    })
    .await
    .unwrap();
    let pid = gate.pid();
    let before = thread_ticks(pid);
    assert!(
        before.contains_key("idemgate-worker"),
        "no second serving thread: {before:?}"
    );

    // Distinct keys: each executes once, and both threads serve.
    let answers = burst(&gate, 40, 10, |i, j| format!("k{i}-{j}")).await;
    assert!(
        answers.iter().all(|a| a.0 == 201),
        "{:?}",
        answers.iter().map(|a| a.0).collect::<Vec<_>>()
    );
    assert_eq!(up.hits(), 400);
    // Each thread did its share of the work; the first thread's name is the process's own.
    let after = thread_ticks(pid);
    let main = after["idemgate"] - before["idemgate"];
    let worker = after["idemgate-worker"] - before["idemgate-worker"];
    eprintln!("clock ticks over 400 new keys: first thread {main}, second thread {worker}");
    assert!(
        worker * 4 >= main && main * 4 >= worker,
        "connections not spread: first thread {main} ticks, second {worker}"
    );

    // One key from 40 connections at once, spread over both threads: one execution, and
    // every 201 is that execution's answer.
    let answers = burst(&gate, 40, 1, |_, _| "same-key".to_string()).await;
    assert_eq!(up.hits(), 401, "the shared key executed more than once");
    let created: Vec<_> = answers.iter().filter(|a| a.0 == 201).collect();
    assert!(!created.is_empty());
    assert!(created.iter().all(|a| a.1 == created[0].1));
    assert!(
        answers.iter().all(|a| a.0 == 201 || a.0 == 409),
        "{:?}",
        answers.iter().map(|a| a.0).collect::<Vec<_>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_threads_on_redis_share_the_connections_and_execute_each_key_once() {
    let redis = RedisServer::start();
    spread_and_once(&redis.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_threads_on_the_embedded_store_share_it_and_execute_each_key_once() {
    spread_and_once("").await;
}

// SIGTERM while requests on both threads wait for a slow upstream: each is answered and
// recorded before the process exits, within the grace period.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_drains_the_requests_of_every_thread() {
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let (upstream, store) = (up.url(), redis.url());
    let mut gate = tokio::task::spawn_blocking(move || {
        Idemgate::new(&upstream)
            .redis_url(&store)
            .set(|c| {
                c.worker_threads = 2;
                c.shutdown_grace = Duration::from_secs(5);
            })
            .binary()
    })
    .await
    .unwrap();
    let pid = gate.pid();
    let mut calls = Vec::new();
    for i in 0..12 {
        let url = gate.url("/v1/transfers");
        calls.push(tokio::spawn(async move {
            let c = client();
            post_url(
                &c,
                &url,
                Some(&format!("slow-{i}")),
                TRANSFER,
                &[(DELAY_MS, "800")],
            )
            .await
        }));
    }
    eventually(Duration::from_secs(5), "all 12 at the upstream", || {
        up.hits() == 12
    })
    .await;
    let ticks = thread_ticks(pid);
    assert!(ticks.contains_key("idemgate-worker"), "{ticks:?}");
    let stopping = Instant::now();
    let status = tokio::task::spawn_blocking(move || gate.terminate(Duration::from_secs(10)))
        .await
        .unwrap();
    assert!(status.success(), "{status}");
    assert!(
        stopping.elapsed() < Duration::from_secs(5),
        "{:?}",
        stopping.elapsed()
    );
    for c in calls {
        let a = c.await.unwrap();
        assert_eq!(a.status, 201, "{:?}", a.body);
    }
    // Every answer was recorded before the exit: a fresh instance replays each of them.
    let (upstream, store) = (up.url(), redis.url());
    let gate =
        tokio::task::spawn_blocking(move || Idemgate::new(&upstream).redis_url(&store).binary())
            .await
            .unwrap();
    let c = client();
    for i in 0..12 {
        let a = post_url(
            &c,
            &gate.url("/v1/transfers"),
            Some(&format!("slow-{i}")),
            TRANSFER,
            &[],
        )
        .await;
        assert_eq!(a.status, 201);
        assert!(a.replayed(), "slow-{i} was not recorded before the exit");
    }
    assert_eq!(up.hits(), 12);
}

/// With four serving threads, each with its own upstream pool, the idle pass-through
/// connections of all of them stay within the pass-through share
/// (`max_upstream_connections - max_in_flight`, 8 here): bursts of 8 pass-through
/// requests, each on a client connection of its own that stays open (so the next lands on
/// another thread), left 8 idle connections per thread, 32 in all, when each pool could
/// keep the whole share.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_idle_upstream_connections_of_all_threads_stay_within_the_share() {
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url())
        .set(|c| {
            c.worker_threads = 4;
            c.max_in_flight = 1;
            c.max_upstream_connections = 9;
            c.max_queued = 64;
            c.queue_timeout = Duration::from_secs(10);
        })
        .binary();
    let mut held = Vec::new();
    for round in 0..4 {
        let tcp = tokio::net::TcpStream::connect(gate.addr).await.unwrap();
        let (send, conn) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(tcp),
        )
        .await
        .unwrap();
        let conn = tokio::spawn(conn);
        let requests: Vec<_> = (0..8)
            .map(|i| {
                let mut send = send.clone();
                let req = hyper::Request::get(format!("http://{}/v1/items/{round}-{i}", gate.addr))
                    .header(DELAY_MS, "300")
                    .body(http_body_util::Empty::<bytes::Bytes>::new())
                    .unwrap();
                tokio::spawn(async move {
                    let res = send.send_request(req).await.unwrap();
                    let status = res.status().as_u16();
                    http_body_util::BodyExt::collect(res.into_body())
                        .await
                        .unwrap();
                    status
                })
            })
            .collect();
        for r in requests {
            assert_eq!(r.await.unwrap(), 201);
        }
        held.push((send, conn));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let open = up.open_connections();
    assert!(open <= 8, "{open} upstream connections open, all idle");
    assert!(up.hits() == 32);
    drop(held);
}
