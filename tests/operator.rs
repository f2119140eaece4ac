//! Operator resolution on the admin listener: listing records by state (paginated),
//! finding a request's record from its parts, and completing an `unknown` record with the
//! outcome an operator found, which its retries then get replayed.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::*;
use serde_json::{json, Value};

const PAYMENT: &str = r#"{"amount":1250,"currency":"EUR"}"#;

on_both_stores!(
    an_unknown_record_is_listed_found_and_completed_and_then_replays,
    listing_walks_every_record_in_bounded_pages,
);

async fn admin_json(
    c: &reqwest::Client,
    method: reqwest::Method,
    url: String,
    body: Option<Value>,
) -> (u16, Value) {
    let mut r = c.request(method, url);
    if let Some(b) = body {
        r = r.json(&b);
    }
    let res = r.send().await.unwrap();
    let status = res.status().as_u16();
    (status, res.json().await.unwrap_or(Value::Null))
}

/// Every record of `state` found by walking `GET /records` with pages of `count`.
async fn walk(
    c: &reqwest::Client,
    admin: std::net::SocketAddr,
    state: &str,
    count: usize,
) -> Vec<String> {
    let mut ids = Vec::new();
    let mut cursor = String::new();
    for _ in 0..10_000 {
        let url = format!("http://{admin}/records?state={state}&count={count}&cursor={cursor}");
        let (status, page) = admin_json(c, reqwest::Method::GET, url, None).await;
        assert_eq!(status, 200, "{page}");
        for r in page["records"].as_array().unwrap() {
            assert_eq!(r["state"], state);
            ids.push(r["id"].as_str().unwrap().to_string());
        }
        match page["cursor"].as_str() {
            Some(next) => cursor = next.to_string(),
            None => return ids,
        }
    }
    panic!("the walk did not end");
}

async fn an_unknown_record_is_listed_found_and_completed_and_then_replays(backend: Backend) {
    let up = Upstream::start().await;
    let mut cfg = config(&up, &backend);
    cfg.defaults.upstream_timeout = Duration::from_millis(300);
    let app = spawn_app(cfg).await;
    let admin = app.admin_addr().unwrap();
    let c = client();
    let lost = post(
        &c,
        &app,
        "/v1/pay",
        Some("u-1"),
        PAYMENT,
        &[(FAULT, "hang")],
    )
    .await;
    assert_eq!(lost.status, 504);
    let id = lost.json()["record_id"].as_str().unwrap().to_string();
    let done = post(&c, &app, "/v1/pay", Some("u-2"), PAYMENT, &[]).await;
    assert_eq!(done.status, 201);

    let unknown = walk(&c, admin, "unknown", 1).await;
    assert_eq!(unknown, vec![id.clone()]);
    assert_eq!(walk(&c, admin, "completed", 7).await.len(), 1);

    // Found from the request's parts, the path spelled otherwise, as the proxy scopes it.
    let lookup = json!({"method": "POST", "path": "/v1//pay/", "key": "u-1", "headers": {}});
    let url = format!("http://{admin}/records/lookup");
    let (status, found) = admin_json(&c, reqwest::Method::POST, url.clone(), Some(lookup)).await;
    assert_eq!(status, 200, "{found}");
    assert_eq!(found["id"], id);
    assert_eq!(found["state"], "unknown");
    let other = json!({"method": "POST", "path": "/v1/pay", "key": "nope", "headers": {}});
    let (_, missing) = admin_json(&c, reqwest::Method::POST, url, Some(other)).await;
    assert_eq!(missing["state"], Value::Null);

    // Resolved with the outcome the operator found: retries get it, nothing executes.
    let outcome = json!({
        "status": 201,
        "headers": {"content-type": "application/json"},
        "body": "{\"id\":\"pay-77\"}"
    });
    let url = format!("http://{admin}/records/{id}/complete?reason=upstream+shows+pay-77");
    let (status, r) = admin_json(
        &c,
        reqwest::Method::POST,
        url.clone(),
        Some(outcome.clone()),
    )
    .await;
    assert_eq!(status, 200, "{r}");
    let retry = post(&c, &app, "/v1/pay", Some("u-1"), PAYMENT, &[]).await;
    assert!(retry.replayed());
    assert_eq!(retry.status, 201);
    assert_eq!(retry.header("content-type"), Some("application/json"));
    assert_eq!(&retry.body[..], b"{\"id\":\"pay-77\"}");
    assert_eq!(up.hits(), 2, "the hung request and u-2");
    // An answered record is never overwritten.
    let (status, _) = admin_json(&c, reqwest::Method::POST, url, Some(outcome)).await;
    assert_eq!(status, 409);
    let done_id = done_id(&c, admin).await;
    let url = format!("http://{admin}/records/{done_id}/complete?reason=test");
    let (status, _) =
        admin_json(&c, reqwest::Method::POST, url, Some(json!({"status": 500}))).await;
    assert_eq!(status, 409);
    assert!(walk(&c, admin, "unknown", 100).await.is_empty());
    app.shutdown().await;
}

async fn done_id(c: &reqwest::Client, admin: std::net::SocketAddr) -> String {
    let lookup = json!({"method": "POST", "path": "/v1/pay", "key": "u-2", "headers": {}});
    let url = format!("http://{admin}/records/lookup");
    let (_, found) = admin_json(c, reqwest::Method::POST, url, Some(lookup)).await;
    assert_eq!(found["state"], "completed");
    found["id"].as_str().unwrap().to_string()
}

async fn listing_walks_every_record_in_bounded_pages(backend: Backend) {
    let up = Upstream::start().await;
    let app = spawn_app(config(&up, &backend)).await;
    let admin = app.admin_addr().unwrap();
    let c = client();
    for i in 0..30 {
        let r = post(&c, &app, "/v1/pay", Some(&format!("w-{i}")), PAYMENT, &[]).await;
        assert_eq!(r.status, 201);
    }
    for count in [1, 4, 1000] {
        let mut ids = walk(&c, admin, "completed", count).await;
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), 30, "count {count}");
    }
    let (status, _) = admin_json(
        &c,
        reqwest::Method::GET,
        format!("http://{admin}/records?state=bogus"),
        None,
    )
    .await;
    assert_eq!(status, 400);
    app.shutdown().await;
}

/// Through the binary's admin API: `complete` with a framing or hop-by-hop header is
/// refused with 400 naming it, and the record stays `unknown`; completed without them, the
/// replays carry the length of the body they send (a stored `Content-Length: 999` once
/// declared 999 bytes for an 8-byte body).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn complete_refuses_framing_headers_by_name_through_the_binary() {
    let up = Upstream::start().await;
    let gate = Gate::start(
        &up.url(),
        "",
        &[("IDEMGATE_DEFAULTS__UPSTREAM_TIMEOUT", "300ms")],
    );
    let c = client();
    let url = gate.url("/v1/pay");
    let lost = post_url(&c, &url, Some("f-1"), PAYMENT, &[(FAULT, "hang")]).await;
    assert_eq!(lost.status, 504);
    let id = lost.json()["record_id"].as_str().unwrap().to_string();
    let complete = gate.admin_url(&format!("/records/{id}/complete?reason=test"));
    for name in ["content-length", "Transfer-Encoding", "connection"] {
        let outcome = json!({
            "status": 201,
            "headers": {name: "999", "content-type": "application/json"},
            "body": "{\"ok\":1}"
        });
        let res = c.post(&complete).json(&outcome).send().await.unwrap();
        assert_eq!(res.status().as_u16(), 400, "{name}");
        let text = res.text().await.unwrap();
        assert!(text.contains(name), "{name}: {text}");
    }
    let (status, view) = admin_json(
        &c,
        reqwest::Method::GET,
        gate.admin_url(&format!("/records/{id}")),
        None,
    )
    .await;
    assert_eq!(
        (status, view["state"].as_str()),
        (200, Some("unknown")),
        "{view}"
    );
    let outcome = json!({
        "status": 201,
        "headers": {"content-type": "application/json"},
        "body": "{\"ok\":1}"
    });
    let res = c.post(&complete).json(&outcome).send().await.unwrap();
    assert_eq!(res.status().as_u16(), 200);
    let retry = post_url(&c, &url, Some("f-1"), PAYMENT, &[]).await;
    assert!(retry.replayed());
    assert_eq!(&retry.body[..], b"{\"ok\":1}");
    assert_eq!(retry.header("content-length"), Some("8"));
    assert_eq!(up.hits(), 1);
}
