//! Flow control as a stall, through the binary: an h2 client that sets
//! `SETTINGS_INITIAL_WINDOW_SIZE = 0` and never opens a window is never written to, so the
//! socket's own send deadline never saw it, and its replays held the whole buffer budget
//! (every other tenant's POST 503 `overloaded`) for as long as it stayed open. An answer
//! that waits `send_timeout` for its client to take a frame now closes its connection as a
//! stalled write does, and what it held is given back.

#![allow(clippy::unwrap_used)]

use crate::common;
use common::Probes;

use std::time::{Duration, Instant};

use bytes::Bytes;

use common::{client, post_url, Gate, Idemgate, Upstream, ANSWER_BYTES};

fn rss_mib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kib / 1024
}

/// One h2c connection with a zero initial stream window, sending `n` keyed POSTs (`key`
/// with `-i` appended unless `same`); the answers' statuses (0: the connection closed
/// first), and the connection's task.
async fn zero_window_posts(
    gate: &Gate,
    n: usize,
    key: &str,
    same: bool,
) -> (
    Vec<u16>,
    tokio::task::JoinHandle<()>,
    h2::client::SendRequest<Bytes>,
) {
    let tcp = tokio::net::TcpStream::connect(gate.addr).await.unwrap();
    let (mut h2, conn) = h2::client::Builder::new()
        .initial_window_size(0)
        .handshake::<_, Bytes>(tcp)
        .await
        .unwrap();
    let task = tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut pending = Vec::new();
    for i in 0..n {
        let key = if same {
            key.to_string()
        } else {
            format!("{key}-{i}")
        };
        let req = hyper::Request::post(format!("http://{}/v1/reports", gate.addr))
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .header(ANSWER_BYTES, "4194304")
            .body(())
            .unwrap();
        h2 = h2.ready().await.unwrap();
        let (res, mut body) = h2.send_request(req, false).unwrap();
        body.send_data(Bytes::from_static(b"{}"), true).unwrap();
        pending.push(res);
    }
    let mut statuses = Vec::new();
    for res in pending {
        // The heads are not flow-controlled: they arrive, the bodies never do.
        // A connection closed as stalled ends the streams still waiting for theirs.
        let Ok(res) = tokio::time::timeout(Duration::from_secs(20), res)
            .await
            .unwrap()
        else {
            statuses.push(0);
            continue;
        };
        statuses.push(res.status().as_u16());
        // Kept unread (dropping it would reset the stream).
        std::mem::forget(res);
    }
    (statuses, task, h2)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_to_a_zero_window_are_a_stall_and_give_the_budget_back() {
    let up = Upstream::start().await;
    // The whole budget for one connection and its tenant: the stall alone gives it back.
    let gate = Idemgate::new(&up.url())
        .set(|c| {
            c.send_timeout = Duration::from_secs(2);
            c.max_buffered_bytes_per_connection = Some(67108864);
            c.max_buffered_bytes_per_tenant = Some(67108864);
        })
        .binary();
    let c = client();
    let url = gate.url("/v1/reports");
    let first = post_url(&c, &url, Some("big"), "{}", &[(ANSWER_BYTES, "4194304")]).await;
    assert_eq!(first.status, 201);
    let before = rss_mib(gate.pid());
    let held_from = Instant::now();
    let (statuses, conn, _h2) = zero_window_posts(&gate, 17, "big", true).await;
    let replays = statuses.iter().filter(|s| **s == 201).count();
    let buffered = gate.metric("idemgate_buffered_bytes");
    let during = rss_mib(gate.pid());
    eprintln!(
        "17 zero-window replays of 4 MiB on one h2 connection: {replays} answered 201, buffered {buffered} bytes, RSS {before} -> {during} MiB"
    );
    assert!(replays >= 15, "{statuses:?}");
    // Within send_timeout (2 s) and the supervisor's wake, the stalled connection is closed
    // and everything it held is back.
    common::eventually(Duration::from_secs(8), "the budget given back", || {
        gate.metric("idemgate_buffered_bytes") == 0.0
    })
    .await;
    let held_for = held_from.elapsed();
    eprintln!(
        "held for {held_for:?}, RSS after {} MiB",
        rss_mib(gate.pid())
    );
    assert!(gate.metric("idemgate_send_timeouts_total") >= 1.0);
    // Another tenant's payment is served.
    let other = post_url(
        &c,
        &url,
        Some("another-tenant"),
        "{}",
        &[("authorization", "Bearer another")],
    )
    .await;
    assert_eq!(other.status, 201, "{:?}", other.body);
    conn.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_keys_answered_to_a_zero_window_are_given_back_after_send_timeout() {
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url())
        .set(|c| c.send_timeout = Duration::from_secs(2))
        .binary();
    let before = rss_mib(gate.pid());
    let pid = gate.pid();
    let peak = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let sampler = {
        let peak = peak.clone();
        tokio::spawn(async move {
            loop {
                peak.fetch_max(rss_mib(pid), std::sync::atomic::Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    let (statuses, conn, _h2) = zero_window_posts(&gate, 40, "fresh", false).await;
    let answered = statuses.iter().filter(|s| **s == 201).count();
    eprintln!(
        "40 new keys of 4 MiB to a zero window: {answered} answered 201 before the connection was closed as stalled, RSS {before} MiB, peak {} MiB",
        peak.load(std::sync::atomic::Ordering::Relaxed)
    );
    assert!(answered >= 1, "{statuses:?}");
    common::eventually(Duration::from_secs(8), "the budget given back", || {
        gate.metric("idemgate_buffered_bytes") == 0.0
    })
    .await;
    sampler.abort();
    eprintln!("RSS after {} MiB", rss_mib(gate.pid()));
    assert!(gate.metric("idemgate_send_timeouts_total") >= 1.0);
    // Their records were kept: each replays to a client that reads. The answers that
    // waited upstream are read and recorded once the stalled connection is gone, and
    // while one is, it holds the (shared anonymous) tenant's share: a replay meanwhile
    // is refused 503, or 409 while its own answer is still being read, both with a
    // Retry-After, and retried as a client would.
    let c = client();
    let again = common::retry_until(
        Duration::from_secs(10),
        async || {
            post_url(
                &c,
                &gate.url("/v1/reports"),
                Some("fresh-0"),
                "{}",
                &[(ANSWER_BYTES, "4194304")],
            )
            .await
        },
        |again| !matches!(again.status, 409 | 503),
    )
    .await;
    assert!(
        again.replayed(),
        "{} {}",
        again.status,
        String::from_utf8_lossy(&again.body[..again.body.len().min(400)])
    );
    assert_eq!(again.body.len(), 4_194_304);
    conn.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_connection_holds_at_most_its_share_of_the_budget() {
    let up = Upstream::start().await;
    // The defaults: 64 MiB, a quarter per connection; a send_timeout that does not end the
    // hold during the test. The tenant's share is the whole budget: the connection's is
    // what binds (`tests/memory_budget.rs` has the tenant's).
    let gate = Idemgate::new(&up.url())
        .set(|c| c.max_buffered_bytes_per_tenant = Some(67108864))
        .binary();
    let c = client();
    let url = gate.url("/v1/reports");
    let first = post_url(&c, &url, Some("big"), "{}", &[(ANSWER_BYTES, "4194304")]).await;
    assert_eq!(first.status, 201);
    let (statuses, conn, _h2) = zero_window_posts(&gate, 17, "big", true).await;
    let replays = statuses.iter().filter(|s| **s == 201).count();
    let refused = statuses.iter().filter(|s| **s == 503).count();
    let buffered = gate.metric("idemgate_buffered_bytes");
    eprintln!("one zero-window connection, 17 replays of 4 MiB: {replays} served, {refused} refused, {buffered} bytes held");
    assert_eq!(replays, 4, "16 MiB of 4 MiB answers: {statuses:?}");
    assert_eq!(refused, 13);
    assert!(buffered <= 16.0 * 1024.0 * 1024.0, "{buffered}");
    // Other connections, and other tenants, are served meanwhile: a replay and a new key.
    let again = post_url(&c, &url, Some("big"), "{}", &[(ANSWER_BYTES, "4194304")]).await;
    assert!(again.replayed(), "{:?}", again.status);
    let other = post_url(
        &c,
        &url,
        Some("another-tenant"),
        "{}",
        &[("authorization", "Bearer another")],
    )
    .await;
    assert_eq!(other.status, 201);
    conn.abort();
}
