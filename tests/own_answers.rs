//! idemgate's own answers where something went wrong, through the binary: a panic while
//! handling a request is a counted, logged 500 (never a connection dropped without an
//! answer), and an observed route's failures say nothing of enforcing.
//!
//! The panics are made by the test builds' hook (`TEST_IDEMGATE_PANIC`, see
//! `proxy::test_panic`): a request with `x-idemgate-test-panic` panics at the named step.

#![allow(clippy::unwrap_used)]

use crate::common;
use common::Probes;

use std::time::Duration;

use common::{client, http_get, post_url, Gate, Idemgate, Upstream, FAULT};

fn panics(gate: &Gate) -> f64 {
    let text = http_get(gate.admin, "/metrics").unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix("idemgate_panics_total")?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no idemgate_panics_total in\n{text}"))
}

/// A POST of `body` with `key` that makes the instance panic (`x-idemgate-test-panic`):
/// answered 500 `internal-error`, with the request id it was sent with.
async fn panicking_post(
    c: &reqwest::Client,
    gate: &Gate,
    key: &str,
    body: &str,
    request_id: &str,
) -> common::Answer {
    let panic = [("x-idemgate-test-panic", "1"), ("x-request-id", request_id)];
    let a = post_url(c, &gate.url("/pay"), Some(key), body, &panic).await;
    assert_eq!(a.status, 500, "{}", gate.log());
    assert!(
        a.problem_type().ends_with("/internal-error"),
        "{:?}",
        a.json()
    );
    assert_eq!(a.header("x-request-id"), Some(request_id));
    a
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_before_the_claim_is_a_counted_500_and_the_retry_executes() {
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url())
        .env("TEST_IDEMGATE_PANIC", "respond")
        .binary();
    let c = client();
    assert_eq!(panics(&gate), 0.0);
    panicking_post(
        &c,
        &gate,
        "panics-early",
        r#"{"amount":1}"#,
        "req-panic-early",
    )
    .await;
    assert_eq!(panics(&gate), 1.0);
    let log = gate.log();
    assert!(
        log.lines()
            .any(|l| l.contains("panicked") && l.contains("req-panic-early")),
        "{log}"
    );
    assert_eq!(up.hits(), 0, "nothing was forwarded");
    // Nothing was claimed: the retry executes.
    let b = post_url(
        &c,
        &gate.url("/pay"),
        Some("panics-early"),
        r#"{"amount":1}"#,
        &[],
    )
    .await;
    assert_eq!(b.status, 201);
    assert_eq!(up.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_the_exchange_is_a_counted_500_and_the_key_is_never_executed_twice() {
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url())
        .env("TEST_IDEMGATE_PANIC", "exchange")
        .binary();
    let c = client();
    let a = panicking_post(
        &c,
        &gate,
        "panics-late",
        r#"{"amount":2}"#,
        "req-panic-late",
    )
    .await;
    assert!(a.json()["record_id"].is_string(), "{:?}", a.json());
    assert_eq!(panics(&gate), 1.0);
    assert!(
        gate.log()
            .lines()
            .any(|l| l.contains("panicked") && l.contains("req-panic-late")),
        "{}",
        gate.log()
    );
    // The claim follows the rules of a failure after the claim: held, never run again.
    let b = post_url(
        &c,
        &gate.url("/pay"),
        Some("panics-late"),
        r#"{"amount":2}"#,
        &[],
    )
    .await;
    assert_eq!(b.status, 409, "{:?}", b.json());
    assert_eq!(up.hits(), 0);
    // Other requests are served as ever.
    let other = post_url(&c, &gate.url("/pay"), Some("fine"), r#"{"amount":3}"#, &[]).await;
    assert_eq!(other.status, 201);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observed_new_key_whose_upstream_times_out_is_not_told_about_retries() {
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url())
        .set(|c| {
            c.defaults.mode = idemgate::config::Mode::Observe;
            c.defaults.upstream_timeout = Duration::from_millis(300);
        })
        .binary();
    let c = client();
    let a = post_url(
        &c,
        &gate.url("/pay"),
        Some("observed-timeout"),
        r#"{"amount":4}"#,
        &[(FAULT, "hang")],
    )
    .await;
    // What pass-through answers when the upstream does not answer in time.
    assert_eq!(a.status, 504, "{}", gate.log());
    let doc = a.json();
    let detail = doc["detail"].as_str().unwrap();
    assert!(!detail.contains("409"), "{detail}");
    assert!(!detail.contains("retr"), "{detail}");
    assert!(doc.get("record_id").is_none(), "{doc:?}");
    // And indeed the retry is forwarded while the route observes.
    let b = post_url(
        &c,
        &gate.url("/pay"),
        Some("observed-timeout"),
        r#"{"amount":4}"#,
        &[],
    )
    .await;
    assert_eq!(b.status, 201);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observed_new_key_whose_upstream_is_down_gets_what_pass_through_gets() {
    // A port nothing listens on.
    let port = common::free_port();
    let gate = Idemgate::new(&format!("http://127.0.0.1:{port}"))
        .set(|c| c.defaults.mode = idemgate::config::Mode::Observe)
        .binary();
    let c = client();
    let keyed = post_url(&c, &gate.url("/pay"), Some("down"), r#"{"amount":5}"#, &[]).await;
    let plain = post_url(&c, &gate.url("/pay"), None, r#"{"amount":5}"#, &[]).await;
    assert_eq!(keyed.status, 502);
    assert_eq!(keyed.json()["detail"], plain.json()["detail"]);
    assert!(keyed.json().get("record_id").is_none());
    assert_eq!(keyed.header("retry-after"), plain.header("retry-after"));
}
