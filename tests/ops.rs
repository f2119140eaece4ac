//! Running idemgate as a sidecar: the admin listener (health, readiness, `/metrics`,
//! records, the admin token) and the metrics a known sequence of requests leaves behind.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;

const TRANSFER: &str = r#"{"from":"acc-1","to":"acc-2","amount":1250,"currency":"EUR"}"#;
const TOKEN: &str = "0123456789abcdef-admin";

/// `GET /metrics` with the token; the whole text.
async fn scrape(c: &reqwest::Client, admin: SocketAddr) -> String {
    let r = c
        .get(format!("http://{admin}/metrics"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let ct = r.headers()["content-type"].to_str().unwrap().to_string();
    assert!(ct.starts_with("application/openmetrics-text"), "{ct}");
    r.text().await.unwrap()
}

/// The value of one series, e.g. `idemgate_requests_total{route="default",outcome="replayed"}`.
fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no series {series} in:\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

/// Requests with `outcome`, summed over the routes.
fn requests(text: &str, outcome: &str) -> f64 {
    let label = format!("outcome=\"{outcome}\"}}");
    text.lines()
        .filter(|l| l.starts_with("idemgate_requests_total{") && l.contains(&label))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum()
}

async fn a_known_sequence_is_counted_exactly(backend: Backend) {
    let up = Upstream::start().await;
    let mut cfg = config(&up, &backend);
    cfg.admin_token = Some(TOKEN.into());
    cfg.routes = vec![idemgate::config::Route {
        path: "/v1/strict".into(),
        require_key: Some(true),
        ..Default::default()
    }];
    let app = spawn_app(cfg).await;
    let admin = app.admin_addr().unwrap();
    let c = client();

    let first = post(&c, &app, "/v1/transfers", Some("k-1"), TRANSFER, &[]).await;
    assert_eq!(first.status, 201);
    let again = post(&c, &app, "/v1/transfers", Some("k-1"), TRANSFER, &[]).await;
    assert!(again.replayed());
    let other = TRANSFER.replace("1250", "9900");
    let mismatch = post(&c, &app, "/v1/transfers", Some("k-1"), &other, &[]).await;
    assert_eq!(mismatch.status, 422);
    let get = c
        .get(format!("http://{}/v1/accounts/7", app.addr()))
        .send()
        .await
        .unwrap();
    assert_eq!(get.status(), 201);
    let rejected = post(&c, &app, "/v1/strict", None, TRANSFER, &[]).await;
    assert_eq!(rejected.status, 400);
    assert_eq!(up.hits(), 2, "one forwarded, one pass-through");

    let text = scrape(&c, admin).await;
    for (outcome, n) in [
        ("forwarded", 1.0),
        ("replayed", 1.0),
        ("mismatch", 1.0),
        ("passthrough", 1.0),
        ("rejected", 1.0),
        ("in_progress", 0.0),
        ("unprotected", 0.0),
        ("store_error", 0.0),
        ("upstream_error", 0.0),
        ("ambiguous", 0.0),
    ] {
        assert_eq!(requests(&text, outcome), n, "{outcome}");
        assert_eq!(
            value(
                &text,
                &format!("idemgate_request_duration_seconds_count{{outcome=\"{outcome}\"}}")
            ),
            n,
            "{outcome}"
        );
    }
    // Forwarded and pass-through went upstream; nothing else did.
    assert_eq!(
        value(&text, "idemgate_upstream_duration_seconds_count"),
        2.0
    );
    // Three claims (forwarded, replayed, mismatch) and one record; the rejected request
    // never reached the store.
    let ops = |op: &str| {
        value(
            &text,
            &format!("idemgate_store_duration_seconds_count{{op=\"{op}\"}}"),
        )
    };
    assert_eq!(ops("claim"), 3.0);
    assert_eq!(ops("record"), 1.0);
    assert_eq!(ops("release"), 0.0);
    assert_eq!(
        value(&text, "idemgate_store_errors_total{op=\"claim\"}"),
        0.0
    );
    assert_eq!(value(&text, "idemgate_records_unknown_total"), 0.0);
    app.shutdown().await;
}

async fn an_ambiguous_outcome_counts_one_unknown_record(backend: Backend) {
    let timeout = Duration::from_millis(200);
    let (_up, app) = hanging_upstream(&backend, timeout, |_| {}).await;
    let c = client();
    let r = post(&c, &app, "/v1/transfers", Some("k-amb"), TRANSFER, &[]).await;
    assert_eq!(r.status, 504);
    let retry = post(&c, &app, "/v1/transfers", Some("k-amb"), TRANSFER, &[]).await;
    assert_eq!(
        retry.problem_type(),
        "https://idemgate.dev/problems/outcome-unknown"
    );
    let text = app.metrics();
    assert_eq!(
        requests(&text, "ambiguous"),
        2.0,
        "the 504 and the retry's 409"
    );
    assert_eq!(value(&text, "idemgate_records_unknown_total"), 1.0);
    assert_eq!(
        value(
            &text,
            "idemgate_store_duration_seconds_count{op=\"mark_unknown\"}"
        ),
        1.0
    );
    app.shutdown().await;
}

async fn records_show_no_body_unless_asked_and_delete_says_what_it_released(backend: Backend) {
    let up = Upstream::start().await;
    let app = spawn_app(config(&up, &backend)).await;
    let admin = app.admin_addr().unwrap();
    let c = client();
    let r = post(&c, &app, "/v1/transfers", Some("k-rec"), TRANSFER, &[]).await;
    assert_eq!(r.status, 201);
    // The record id of a completed request: ask a mismatching retry for it.
    let other = TRANSFER.replace("1250", "1");
    let id = post(&c, &app, "/v1/transfers", Some("k-rec"), &other, &[])
        .await
        .json()["record_id"]
        .as_str()
        .unwrap()
        .to_string();
    let get = |q: &'static str| {
        let url = format!("http://{admin}/records/{id}{q}");
        let c = c.clone();
        async move {
            c.get(url)
                .send()
                .await
                .unwrap()
                .json::<serde_json::Value>()
                .await
                .unwrap()
        }
    };
    let view = get("").await;
    assert_eq!(view["state"], "completed");
    assert_eq!(view["status"], 201);
    assert!(view["created_ms"].as_u64().unwrap() > 0);
    assert!(view["fingerprint_version"].as_u64().is_some());
    assert!(view.get("body").is_none(), "{view}");
    let with_body = get("?body=1").await;
    assert_eq!(with_body["body"].as_str().unwrap().as_bytes(), &r.body[..]);
    // A completed record is released only on purpose: its next retry executes again.
    let refused = c
        .delete(format!("http://{admin}/records/{id}?reason=test"))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 409);
    let refused: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(refused["state"], "completed", "{refused}");
    assert_eq!(get("").await["state"], "completed", "still there");
    let del: serde_json::Value = c
        .delete(format!(
            "http://{admin}/records/{id}?completed=true&reason=test"
        ))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(del["id"], id.as_str());
    assert_eq!(del["released"]["state"], "completed");
    assert_eq!(del["released"]["status"], 201);
    assert!(del["released"].get("body").is_none());
    let again = c
        .delete(format!("http://{admin}/records/{id}?reason=test"))
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 404);
    app.shutdown().await;
}

on_both_stores!(
    a_known_sequence_is_counted_exactly,
    an_ambiguous_outcome_counts_one_unknown_record,
    records_show_no_body_unless_asked_and_delete_says_what_it_released,
);

#[tokio::test]
async fn admin_token_guards_everything_but_the_probes() {
    let up = Upstream::start().await;
    let mut cfg = config(&up, &Backend::memory());
    cfg.admin_token = Some(TOKEN.into());
    let app = spawn_app(cfg).await;
    let admin = app.admin_addr().unwrap();
    let c = client();
    let id = "0".repeat(64);
    let health = c
        .get(format!("http://{admin}/healthz"))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200, "probes need no token");
    let ready = c
        .get(format!("http://{admin}/readyz"))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 200, "probes need no token");
    assert_eq!(ready.text().await.unwrap(), "ready\n");
    for (method, path) in [
        ("GET", "/metrics".to_string()),
        ("GET", format!("/records/{id}")),
        ("DELETE", format!("/records/{id}")),
        ("GET", "/nope".to_string()),
    ] {
        let m: reqwest::Method = method.parse().unwrap();
        let url = format!("http://{admin}{path}");
        for auth in [
            None,
            Some("Bearer wrong-token-0123456789".to_string()),
            Some(format!("Bearer {TOKEN}x")),
            Some(format!("Basic {TOKEN}")),
            Some(TOKEN.to_string()),
        ] {
            let mut req = c.request(m.clone(), &url);
            if let Some(a) = &auth {
                req = req.header("authorization", a);
            }
            let r = req.send().await.unwrap();
            assert_eq!(r.status(), 401, "{method} {path} with {auth:?}");
            assert_eq!(r.headers()["www-authenticate"], "Bearer");
            let body = r.text().await.unwrap();
            assert!(!body.contains(TOKEN), "{body}");
        }
        let ok = c.request(m, &url).bearer_auth(TOKEN).send().await.unwrap();
        assert_ne!(ok.status(), 401, "{method} {path} with the token");
    }
    app.shutdown().await;
}

/// `/readyz` is open, so it says "not ready" to anyone, and why only to the token holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_readyz_keeps_the_stores_error_for_the_token_holder() {
    let mut redis = RedisServer::start();
    let up = Upstream::start().await;
    let mut cfg = redis_config(&up, &redis);
    cfg.admin_token = Some(TOKEN.into());
    cfg.store_timeout = Duration::from_millis(300);
    let app = spawn_app(cfg).await;
    let url = format!("http://{}/readyz", app.admin_addr().unwrap());
    let c = client();
    redis.stop();
    let open = c.get(&url).send().await.unwrap();
    assert_eq!(open.status(), 503);
    let open = open.text().await.unwrap();
    assert_eq!(open, "not ready: the redis store does not answer\n");
    let told = c.get(&url).bearer_auth(TOKEN).send().await.unwrap();
    assert_eq!(told.status(), 503);
    let told = told.text().await.unwrap();
    assert!(told.starts_with("not ready: redis store: "), "{told}");
    assert_ne!(told, open);
    app.shutdown().await;
}

#[test]
fn admin_token_is_validated_and_never_printed() {
    let mut cfg = idemgate::Config::for_upstream("http://127.0.0.1:9");
    cfg.admin_token = Some("short".into());
    let err = idemgate::config::Settings::new(cfg.clone())
        .unwrap_err()
        .to_string();
    assert!(err.contains("admin_token"), "{err}");
    assert!(!err.contains("short"), "{err}");
    cfg.admin_token = Some(TOKEN.into());
    let settings = idemgate::config::Settings::new(cfg).unwrap();
    assert!(!format!("{settings:?}").contains(TOKEN));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_is_503_with_the_reason_while_redis_is_down() {
    let mut redis = RedisServer::start();
    let up = Upstream::start().await;
    let mut cfg = redis_config(&up, &redis);
    cfg.store_timeout = Duration::from_millis(300);
    let app = spawn_app(cfg).await;
    let admin = app.admin_addr().unwrap();
    let c = client();
    assert!(app.ready(), "ready while Redis is up");
    redis.stop();
    let ready = c
        .get(format!("http://{admin}/readyz"))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 503);
    let why = ready.text().await.unwrap();
    assert!(why.contains("redis"), "{why}");
    let health = c
        .get(format!("http://{admin}/healthz"))
        .send()
        .await
        .unwrap();
    assert_eq!(
        health.status(),
        200,
        "the process is up; only the store is not"
    );
    let text = app.metrics();
    assert!(
        value(&text, "idemgate_store_errors_total{op=\"ping\"}") >= 1.0,
        "{text}"
    );
    redis.restart();
    eventually(HANG_GUARD, "ready again once Redis is back", || app.ready()).await;
    app.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restarts_and_evictions_are_read_from_info() {
    let mut redis = RedisServer::start();
    let up = Upstream::start().await;
    let mut cfg = redis_config(&up, &redis);
    cfg.redis_info_interval = Duration::from_millis(50);
    let app = spawn_app(cfg).await;
    // Let the watcher take its baseline, then restart Redis under it.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(value(&app.metrics(), "idemgate_redis_restarts_total"), 0.0);
    redis.restart();
    let restarts = "idemgate_redis_restarts_total";
    eventually(HANG_GUARD, "the restart counted", || {
        app.metric(restarts) > 0.0
    })
    .await;
    assert_eq!(app.metric(restarts), 1.0);

    // Someone switches eviction on behind idemgate's back and memory runs out.
    assert_eq!(value(&app.metrics(), "idemgate_redis_evicted_keys"), 0.0);
    for cmd in [
        &["CONFIG", "SET", "maxmemory-policy", "allkeys-random"][..],
        &["CONFIG", "SET", "maxmemory", "2mb"][..],
    ] {
        assert!(redis.command(cmd).unwrap().starts_with("+OK"), "{cmd:?}");
    }
    let fill =
        "for i = 1, 200 do redis.call('SET', ARGV[1] .. i, string.rep('x', 1024)) end return 1";
    let mut evicted = 0.0;
    for round in 0..100 {
        let prefix = format!("fill-{round}-");
        redis.command(&["EVAL", fill, "0", &prefix]).unwrap();
        evicted = value(&app.metrics(), "idemgate_redis_evicted_keys");
        if evicted > 0.0 {
            break;
        }
    }
    if evicted == 0.0 {
        let series = "idemgate_redis_evicted_keys";
        eventually(HANG_GUARD, "evictions read", || app.metric(series) > 0.0).await;
    }
    app.shutdown().await;
}

/// A store whose port is closed is named as refusing, not as slow: through the binary, with
/// Redis stopped under it, the token holder's `/readyz` says the connection is refused
/// once the first reconnection attempt has been refused (within two seconds; the probes
/// before that end at `store_timeout`), and goes on saying so rather than "timed out".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_names_a_refused_connection_as_refused() {
    let mut redis = RedisServer::start();
    let gate = Idemgate::new("http://127.0.0.1:9")
        .redis(&redis)
        .set(|c| {
            c.admin_token = Some(TOKEN.into());
            c.store_timeout = Duration::from_millis(300);
        })
        .binary();
    let c = client();
    let readyz = || async {
        let r = c
            .get(gate.admin_url("/readyz"))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap();
        (r.status(), r.text().await.unwrap())
    };
    assert_eq!(readyz().await.0, 200);
    redis.stop();
    let stopped = std::time::Instant::now();
    let mut seen = Vec::new();
    while stopped.elapsed() < Duration::from_secs(3) {
        let (status, text) = readyz().await;
        assert_eq!(status, 503, "{text}");
        seen.push((stopped.elapsed(), text));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let first = seen
        .iter()
        .position(|(_, t)| t.contains("refused"))
        .unwrap_or_else(|| panic!("never named as refused: {seen:#?}"));
    assert!(seen[first].0 < Duration::from_secs(2), "{seen:#?}");
    assert!(
        seen[first..].iter().all(|(_, t)| t.contains("refused")),
        "{seen:#?}"
    );
}
