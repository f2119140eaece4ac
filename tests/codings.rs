//! Stacked `Content-Encoding`s, through the binary: a protected request names at most
//! `max_content_codings` codings (415 `too-many-codings` before anything is decoded, or
//! forwarded as sent and counted on an observed route), and a decode's work across its
//! layers is bounded (413 `body-too-large`).

#![allow(clippy::unwrap_used)]

use crate::common;

use std::io::Write;

use common::*;
use idemgate::config::{Mode, Route};

const JSON: &str = r#"{"amount":100,"currency":"eur"}"#;

/// `data` gzipped `layers` times, at `level`.
fn gzipped(data: &[u8], layers: usize, level: flate2::Compression) -> Vec<u8> {
    let mut out = data.to_vec();
    for _ in 0..layers {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), level);
        e.write_all(&out).unwrap();
        out = e.finish().unwrap();
    }
    out
}

/// A keyed JSON POST of `body` with `Content-Encoding: encoding` (none when `None`).
async fn send(url: &str, key: &str, encoding: Option<&str>, body: Vec<u8>) -> Answer {
    let mut req = client()
        .post(url)
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(body);
    if let Some(encoding) = encoding {
        req = req.header("content-encoding", encoding);
    }
    let res = req.send().await.unwrap();
    Answer {
        status: res.status().as_u16(),
        headers: res.headers().clone(),
        body: res.bytes().await.unwrap(),
    }
}

fn route(path: &str, edit: impl FnOnce(&mut Route)) -> Route {
    let mut r = Route {
        path: path.into(),
        ..Route::default()
    };
    edit(&mut r);
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_codings_are_refused_before_decoding_and_nothing_is_forwarded() {
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url()).binary();
    let url = gate.url("/v1/transfers");
    let body = gzipped(JSON.as_bytes(), 3, flate2::Compression::default());
    for (key, encoding) in [("k1", "gzip, gzip, gzip"), ("k2", "br, br, br")] {
        let a = send(&url, key, Some(encoding), body.clone()).await;
        assert_eq!(a.status, 415, "{encoding}: {:?}", a.body);
        assert!(
            a.problem_type().ends_with("/too-many-codings"),
            "{:?}",
            a.body
        );
        assert!(a.json()["detail"].as_str().unwrap().contains("at most 2"));
        assert_eq!(a.header("accept-encoding"), Some("gzip, deflate, br"));
    }
    // Codings on separate lines count together.
    let req = client()
        .post(&url)
        .header("content-type", "application/json")
        .header("idempotency-key", "k3")
        .header("content-encoding", "gzip, gzip")
        .header("content-encoding", "gzip")
        .body(body);
    assert_eq!(req.send().await.unwrap().status().as_u16(), 415);
    assert_eq!(up.hits(), 0, "nothing was forwarded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identity_does_not_count_and_two_codings_are_fingerprinted_as_their_content() {
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url()).binary();
    let url = gate.url("/v1/transfers");
    let body = gzipped(JSON.as_bytes(), 2, flate2::Compression::default());
    let first = send(&url, "k1", Some("gzip, identity, gzip"), body).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    assert!(!first.replayed());
    // The same content sent unencoded is the same request: a replay.
    let again = send(&url, "k1", None, JSON.as_bytes().to_vec()).await;
    assert_eq!(again.status, 201, "{:?}", again.body);
    assert!(again.replayed(), "the decoded content was fingerprinted");
    assert_eq!(up.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_may_allow_three_codings() {
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url())
        .set(|c| {
            c.routes
                .push(route("/v1/three", |r| r.max_content_codings = Some(3)))
        })
        .binary();
    let body = gzipped(JSON.as_bytes(), 3, flate2::Compression::default());
    let coded = Some("gzip, gzip, gzip");
    let three = send(&gate.url("/v1/three"), "k1", coded, body.clone()).await;
    assert_eq!(three.status, 201, "{:?}", three.body);
    let again = send(&gate.url("/v1/three"), "k1", None, JSON.as_bytes().to_vec()).await;
    assert!(again.replayed(), "three layers decoded to the content");
    let elsewhere = send(&gate.url("/v1/transfers"), "k2", coded, body).await;
    assert_eq!(elsewhere.status, 415, "the default still allows two");
    assert_eq!(up.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observed_route_forwards_too_many_codings_as_sent_and_counts_them() {
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url())
        .set(|c| c.defaults.mode = Mode::Observe)
        .binary();
    let body = gzipped(JSON.as_bytes(), 3, flate2::Compression::default());
    let a = send(
        &gate.url("/v1/transfers"),
        "k1",
        Some("gzip, gzip, gzip"),
        body.clone(),
    )
    .await;
    assert_eq!(a.status, 201, "{:?}", a.body);
    let seen = up.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].body, body, "the body as sent");
    assert_eq!(
        seen[0].headers.get("content-encoding").map(Vec::as_slice),
        Some(&["gzip, gzip, gzip".to_string()][..])
    );
    let series = "idemgate_observed_total{route=\"default\",would=\"too_many_codings\"}";
    assert_eq!(gate.metric_or_zero(series), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layers_that_each_fit_but_add_up_past_the_work_budget_are_413() {
    const MAX: u64 = 64 * 1024;
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url())
        .set(|c| {
            c.routes.push(route("/v1/three", |r| {
                r.max_content_codings = Some(3);
                r.max_body_bytes = Some(MAX);
            }))
        })
        .binary();
    let url = gate.url("/v1/three");
    // Stored (uncompressed) layers: each decodes to about 60 KB, under the limit, and the
    // three read plus write about 360 KB, over 4 x 64 KiB.
    let content: Vec<u8> = (0..60_000u32).map(|i| b'a' + (i % 26) as u8).collect();
    let bomb = gzipped(&content, 3, flate2::Compression::none());
    assert!(bomb.len() < MAX as usize, "the body itself fits");
    let a = send(&url, "k1", Some("gzip, gzip, gzip"), bomb).await;
    assert_eq!(a.status, 413, "{:?}", a.body);
    assert!(
        a.problem_type().ends_with("/body-too-large"),
        "{:?}",
        a.body
    );
    // The same content in two such layers is within the budget.
    let two = gzipped(&content, 2, flate2::Compression::none());
    let b = send(&url, "k2", Some("gzip, gzip"), two).await;
    assert_eq!(b.status, 201, "{:?}", b.body);
    assert_eq!(
        up.hits(),
        1,
        "only the request within the budget was forwarded"
    );
}
