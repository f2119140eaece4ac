//! The `Retry-After` of idemgate's 503s, through the binary: derived from how long what is
//! full has been draining, never a constant. A buffer budget held by a reader that never
//! reads, and a store that stopped answering, tell their refused clients to wait longer
//! the longer the hold lasts.

#![allow(clippy::unwrap_used)]

use crate::common;
use common::Probes;

use std::io::Write;
use std::time::Duration;

use common::{client, post_url, Idemgate, RedisServer, Upstream, ANSWER_BYTES};

fn retry_after(a: &common::Answer) -> u64 {
    a.header("retry-after").unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_held_by_a_stalled_reader_says_how_long_it_has_been_held() {
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url())
        .set(|c| {
            c.max_buffered_bytes = 20971520;
            c.defaults.max_response_bytes = 16777216;
        })
        .binary();
    let c = client();
    let url = gate.url("/v1/reports");
    let first = post_url(&c, &url, Some("big"), "{}", &[(ANSWER_BYTES, "12000000")]).await;
    assert_eq!(first.status, 201);
    // A replay of it to a client that reads nothing (a small fixed receive buffer): its
    // 12 MB stay held against the 20 MiB budget.
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(64 * 1024).unwrap();
    let mut held = sock.connect(gate.addr).await.unwrap().into_std().unwrap();
    held.set_nonblocking(false).unwrap();
    held.write_all(b"POST /v1/reports HTTP/1.1\r\nHost: x\r\nIdempotency-Key: big\r\nContent-Type: application/json\r\nContent-Length: 2\r\nx-test-answer-bytes: 12000000\r\n\r\n{}").unwrap();
    let mut waits = Vec::new();
    let started = std::time::Instant::now();
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let refused = post_url(&c, &url, Some("big"), "{}", &[(ANSWER_BYTES, "12000000")]).await;
        assert_eq!(refused.status, 503, "{}", gate.log());
        assert!(refused.problem_type().ends_with("/overloaded"));
        waits.push((started.elapsed(), retry_after(&refused)));
    }
    let (_, first_wait) = waits[0];
    let (_, last_wait) = waits[3];
    assert!(
        last_wait >= first_wait + 2 && last_wait >= 3,
        "Retry-After grows with the hold: {waits:?}"
    );
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_stopped_answering_says_how_long_it_has_been_down() {
    let up = Upstream::start().await;
    let redis = RedisServer::start();
    let gate = Idemgate::new(&up.url())
        .redis(&redis)
        .set(|c| c.store_timeout = Duration::from_millis(300))
        .binary();
    let c = client();
    let url = gate.url("/v1/transfers");
    assert_eq!(
        post_url(&c, &url, Some("before"), "{}", &[]).await.status,
        201
    );
    redis.pause();
    let mut waits = Vec::new();
    for i in 0..4 {
        let a = post_url(&c, &url, Some(&format!("during-{i}")), "{}", &[]).await;
        assert_eq!(a.status, 503, "{:?}", a.body);
        assert!(a.problem_type().ends_with("/store-unavailable"));
        waits.push(retry_after(&a));
        tokio::time::sleep(Duration::from_millis(900)).await;
    }
    redis.resume();
    assert!(
        waits[3] >= waits[0] + 2,
        "Retry-After grows with the outage: {waits:?}"
    );
    // Once the store answers again, keys are served again.
    let after = common::retry_until(
        Duration::from_secs(10),
        async || post_url(&c, &url, Some("after"), "{}", &[]).await,
        |after| after.status == 201,
    )
    .await;
    assert_eq!(after.status, 201, "{:?}", after.body);
}
