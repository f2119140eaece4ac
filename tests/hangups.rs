//! Requests whose HTTP/1.1 clients hang up while they wait in the admission queue, through
//! the binary: they leave the queue (nothing claimed, never executed), so that dead
//! requests cannot keep a live client out.

#![allow(clippy::unwrap_used)]

use crate::common;
use common::Probes;

use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use common::{client, eventually, post_url, Gate, Idemgate, Upstream, DELAY_MS};

const QUEUED: &str = "idemgate_queued{class=\"protected\"}";

/// A complete keyed POST over a raw socket, left open.
async fn send_and_wait(gate: &Gate, key: &str) -> TcpStream {
    let mut s = TcpStream::connect(gate.addr).await.unwrap();
    let body = format!("{{\"key\":\"{key}\"}}");
    let head = format!(
        "POST /v1/transfers HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         idempotency-key: {key}\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_requests_whose_clients_hang_up_leave_the_queue_and_never_execute() {
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url())
        .set(|c| {
            c.max_in_flight = 1;
            c.max_queued = 4;
            c.queue_timeout = Duration::from_secs(10);
        })
        .binary();
    let c = client();
    let url = gate.url("/v1/transfers");
    let running = {
        let (c, url) = (c.clone(), url.clone());
        tokio::spawn(async move {
            post_url(&c, &url, Some("running"), "{}", &[(DELAY_MS, "2500")]).await
        })
    };
    eventually(Duration::from_secs(5), "one at the upstream", || {
        up.hits() == 1
    })
    .await;
    let mut dead = Vec::new();
    for i in 0..4 {
        dead.push(send_and_wait(&gate, &format!("dead-{i}")).await);
    }
    eventually(Duration::from_secs(5), "four queued", || {
        gate.metric(QUEUED) == 4.0
    })
    .await;
    // Closed, closed, half-closed (kept open for reading), reset.
    let mut dead = dead.into_iter();
    drop(dead.next());
    drop(dead.next());
    let mut half = dead.next().unwrap();
    half.shutdown().await.unwrap();
    let reset = dead.next().unwrap();
    reset.set_zero_linger().unwrap();
    drop(reset);
    eventually(Duration::from_secs(2), "the dead left the queue", || {
        gate.metric(QUEUED) == 0.0
    })
    .await;
    // A live client is queued, not refused, and served once the slot frees.
    let live = post_url(&c, &url, Some("live"), "{}", &[]).await;
    assert_eq!(live.status, 201, "{:?}", live.body);
    assert_eq!(running.await.unwrap().status, 201);
    // Long enough for any of the dead to have run after the running one.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let keys: Vec<String> = up
        .seen()
        .iter()
        .filter_map(|s| s.headers.get("idempotency-key")?.first().cloned())
        .collect();
    assert_eq!(keys, ["running", "live"], "the dead never executed");
    assert_eq!(
        gate.metric("idemgate_refused_total{class=\"protected\",reason=\"client_gone\"}"),
        4.0
    );
    // Nothing was claimed: a retry of a dead one executes.
    let retry = post_url(&c, &url, Some("dead-0"), r#"{"key":"dead-0"}"#, &[]).await;
    assert_eq!(retry.status, 201);
    assert!(!retry.replayed());
    drop(half);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_sent_whole_by_a_client_that_left_still_runs_when_a_slot_is_free() {
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url()).binary();
    let mut s = send_and_wait(&gate, "left-early").await;
    s.shutdown().await.unwrap();
    drop(s);
    eventually(Duration::from_secs(5), "executed", || up.hits() == 1).await;
    let c = client();
    let retry = post_url(
        &c,
        &gate.url("/v1/transfers"),
        Some("left-early"),
        r#"{"key":"left-early"}"#,
        &[],
    )
    .await;
    assert!(retry.replayed(), "{:?}", retry.body);
}
