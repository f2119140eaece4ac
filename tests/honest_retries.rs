//! Honest retries are one operation, through the real binary: a reordered query, a new
//! multipart boundary, a gzip body with another mtime or sent unencoded are replays; what a
//! client changed is a 422; a compression bomb is a 413. The upstream still gets every
//! request's bytes exactly as the client sent them.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::io::Write;

use common::*;

/// POSTs `body` to `path` under `key` with `headers`; (status, replayed).
async fn send(
    gate: &Gate,
    path: &str,
    key: &str,
    headers: &[(&str, &str)],
    body: Vec<u8>,
) -> (u16, bool) {
    let mut req = client()
        .post(gate.url(path))
        .header("idempotency-key", key)
        .body(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let r = req.send().await.unwrap();
    (
        r.status().as_u16(),
        r.headers().get("idempotent-replayed").is_some(),
    )
}

const JSON: (&str, &str) = ("content-type", "application/json");
const NEW: (u16, bool) = (201, false);
const REPLAY: (u16, bool) = (201, true);

fn gzip(data: &[u8], mtime: u32) -> Vec<u8> {
    let mut e = flate2::GzBuilder::new()
        .mtime(mtime)
        .write(Vec::new(), flate2::Compression::default());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

fn raw_deflate(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

fn zlib(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reordered_or_empty_query_is_a_replay() {
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url()).binary();
    let body = || b"{\"amount\":5}".to_vec();
    assert_eq!(
        send(&gate, "/v1/t?a=1&b=2", "q1", &[JSON], body()).await,
        NEW
    );
    assert_eq!(
        send(&gate, "/v1/t?b=2&a=1", "q1", &[JSON], body()).await,
        REPLAY
    );
    assert_eq!(
        send(&gate, "/v1/t?b=2&a=%31", "q1", &[JSON], body()).await,
        REPLAY
    );
    assert_eq!(
        send(&gate, "/v1/t?a=1&b=3", "q1", &[JSON], body()).await.0,
        422
    );
    // Repeated names keep their order: a list, as most frameworks read it.
    assert_eq!(
        send(&gate, "/v1/t?a=1&a=2", "q2", &[JSON], body()).await,
        NEW
    );
    assert_eq!(
        send(&gate, "/v1/t?a=2&a=1", "q2", &[JSON], body()).await.0,
        422
    );
    // An empty `?` is no query.
    assert_eq!(send(&gate, "/v1/t?", "q3", &[JSON], body()).await, NEW);
    assert_eq!(send(&gate, "/v1/t", "q3", &[JSON], body()).await, REPLAY);
    assert_eq!(up.hits(), 3);
    // The upstream got the queries as sent.
    let uris: Vec<String> = up.seen().iter().map(|s| s.uri.clone()).collect();
    assert_eq!(uris, ["/v1/t?a=1&b=2", "/v1/t?a=1&a=2", "/v1/t?"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn query_order_significant_keeps_the_order() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("idemgate.toml");
    std::fs::write(
        &file,
        "[[routes]]\npath = \"/v1/ordered\"\nquery_order = \"significant\"\n",
    )
    .unwrap();
    let gate = Gate::start(
        &up.url(),
        "",
        &[("IDEMGATE_CONFIG", file.to_str().unwrap())],
    );
    let body = || b"{}".to_vec();
    assert_eq!(
        send(&gate, "/v1/ordered?a=1&b=2", "s1", &[JSON], body()).await,
        NEW
    );
    assert_eq!(
        send(&gate, "/v1/ordered?a=%31&b=2", "s1", &[JSON], body()).await,
        REPLAY
    );
    assert_eq!(
        send(&gate, "/v1/ordered?b=2&a=1", "s1", &[JSON], body())
            .await
            .0,
        422
    );
    // Other routes still sort.
    assert_eq!(
        send(&gate, "/v1/other?a=1&b=2", "s2", &[JSON], body()).await,
        NEW
    );
    assert_eq!(
        send(&gate, "/v1/other?b=2&a=1", "s2", &[JSON], body()).await,
        REPLAY
    );
    assert_eq!(up.hits(), 2);
}

fn multipart(boundary: &str, amount: &str) -> (String, Vec<u8>) {
    let body = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"amount\"\r\n\r\n{amount}\r\n\
         --{boundary}\r\nContent-Disposition: form-data; name=\"receipt\"; filename=\"r.pdf\"\r\n\
         Content-Type: application/pdf\r\n\r\n%PDF-1.4 \x01\x02\r\n--{boundary}--\r\n"
    );
    (
        format!("multipart/form-data; boundary={boundary}"),
        body.into_bytes(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multipart_with_a_new_boundary_is_a_replay() {
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url()).binary();
    let (ct1, b1) = multipart("----WebKitFormBoundary7MA4YWxk", "100");
    let (ct2, b2) = multipart("--------------------------9051914041544843", "100");
    let (ct3, b3) = multipart("----WebKitFormBoundaryQ", "101");
    let sent = b1.clone();
    assert_eq!(
        send(&gate, "/v1/upload", "m1", &[("content-type", &ct1)], b1).await,
        NEW
    );
    assert_eq!(
        send(&gate, "/v1/upload", "m1", &[("content-type", &ct2)], b2).await,
        REPLAY
    );
    assert_eq!(
        send(&gate, "/v1/upload", "m1", &[("content-type", &ct3)], b3)
            .await
            .0,
        422
    );
    // A malformed body is compared raw: the same bytes replay, others are 422.
    let bad = || b"--x\r\nno blank line\r\n--x--".to_vec();
    let ct = [("content-type", "multipart/form-data; boundary=x")];
    assert_eq!(send(&gate, "/v1/upload", "m2", &ct, bad()).await, NEW);
    assert_eq!(send(&gate, "/v1/upload", "m2", &ct, bad()).await, REPLAY);
    let other = b"--x\r\nno blank line!\r\n--x--".to_vec();
    assert_eq!(send(&gate, "/v1/upload", "m2", &ct, other).await.0, 422);
    assert_eq!(up.hits(), 2);
    assert_eq!(
        up.seen()[0].body,
        sent,
        "the upstream gets the body as sent"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encoded_bodies_compare_by_content() {
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url()).binary();
    let json = br#"{"amount":100,"to":"acct_1"}"#;
    let gz = [JSON, ("content-encoding", "gzip")];
    let first = gzip(json, 1_700_000_000);
    assert_eq!(send(&gate, "/v1/t", "e1", &gz, first.clone()).await, NEW);
    // Another mtime in the gzip header.
    assert_eq!(
        send(&gate, "/v1/t", "e1", &gz, gzip(json, 1_700_000_042)).await,
        REPLAY
    );
    // The same JSON unencoded, and respelled.
    assert_eq!(
        send(&gate, "/v1/t", "e1", &[JSON], json.to_vec()).await,
        REPLAY
    );
    let respelled = br#"{ "to": "acct_1", "amount": 1e2 }"#;
    assert_eq!(
        send(&gate, "/v1/t", "e1", &gz, gzip(respelled, 7)).await,
        REPLAY
    );
    // Deflate, as zlib or as the raw stream many clients send.
    let df = [JSON, ("content-encoding", "deflate")];
    assert_eq!(send(&gate, "/v1/t", "e1", &df, zlib(json)).await, REPLAY);
    assert_eq!(
        send(&gate, "/v1/t", "e1", &df, raw_deflate(json)).await,
        REPLAY
    );
    // Another amount.
    let other = gzip(br#"{"amount":101,"to":"acct_1"}"#, 1);
    assert_eq!(send(&gate, "/v1/t", "e1", &gz, other).await.0, 422);
    // An unknown coding is compared raw, and never as the same bytes unencoded.
    let zs = [JSON, ("content-encoding", "zstd")];
    assert_eq!(
        send(&gate, "/v1/t", "e2", &zs, b"\x28\xb5opaque".to_vec()).await,
        NEW
    );
    assert_eq!(
        send(&gate, "/v1/t", "e2", &zs, b"\x28\xb5opaque".to_vec()).await,
        REPLAY
    );
    assert_eq!(
        send(&gate, "/v1/t", "e2", &zs, b"\x28\xb5other".to_vec())
            .await
            .0,
        422
    );
    assert_eq!(up.hits(), 2);
    let seen = &up.seen()[0];
    assert_eq!(seen.body, first, "the upstream gets the body as sent");
    assert_eq!(seen.headers["content-encoding"], ["gzip"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compression_bomb_is_413() {
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url()).binary();
    // 10 MB of zeros, about 10 KB compressed, against the default 1 MiB max_body_bytes.
    let bomb = gzip(&vec![0u8; 10_000_000], 0);
    assert!(bomb.len() < 20_000, "{}", bomb.len());
    let gz = [JSON, ("content-encoding", "gzip")];
    let (status, _) = send(&gate, "/v1/t", "b1", &gz, bomb.clone()).await;
    assert_eq!(status, 413);
    let r = client()
        .post(gate.url("/v1/t"))
        .header("idempotency-key", "b2")
        .header("content-type", "application/json")
        .header("content-encoding", "gzip")
        .body(bomb)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 413);
    let problem: serde_json::Value = r.json().await.unwrap();
    assert!(
        problem["type"]
            .as_str()
            .unwrap()
            .ends_with("/body-too-large"),
        "{problem}"
    );
    assert_eq!(up.hits(), 0);
    // Within the limit once decoded: served.
    let fits = gzip(&vec![b' '; 900_000], 0);
    assert_eq!(send(&gate, "/v1/t", "b3", &gz, fits).await, NEW);
    assert_eq!(up.hits(), 1);
}
