//! The admin listener through the binary, attacked as a web page would: a write from another
//! origin (a `text/plain` simple request, a `same-site` page on another port), a
//! DNS-rebinding `Host`, a cross-origin reload, each refused with the record unchanged and
//! the client's retry never given a forged answer; the hosts it answers to (HTTP/1.1,
//! absolute form, h2c's `:authority`); the headers on every answer; named operators, their
//! roles, reasons and audit lines.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

const PAYMENT: &str = r#"{"amount":1250,"currency":"EUR"}"#;
const ADMIN_TOKEN: &str = "0123456789abcdef0123456789abcdef";
const READER: &str = "reader-token-0123456789";
const READER_BODIES: &str = "reader-bodies-token-0123456789";
const DECIDER: &str = "decider-token-0123456789";
const BOSS: &str = "boss-token-0123456789";

fn sha256_hex(s: &str) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(s.as_bytes()))
}

/// A protected payment whose upstream never answered in time: its record id (`unknown`).
async fn lost_payment(c: &reqwest::Client, gate: &Gate, key: &str) -> String {
    let lost = post_url(
        c,
        &gate.url("/v1/pay"),
        Some(key),
        PAYMENT,
        &[(FAULT, "hang")],
    )
    .await;
    assert_eq!(lost.status, 504);
    lost.json()["record_id"].as_str().unwrap().to_string()
}

/// One admin request: status, headers, body as JSON (or `Null`).
async fn admin(
    c: &reqwest::Client,
    method: &str,
    url: String,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> (u16, reqwest::header::HeaderMap, Value) {
    let mut req = c.request(method.parse().unwrap(), url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    if let Some(b) = body {
        req = req.body(b.to_string());
    }
    let res = req.send().await.unwrap();
    let status = res.status().as_u16();
    let h = res.headers().clone();
    let text = res.text().await.unwrap();
    (
        status,
        h,
        serde_json::from_str(&text).unwrap_or(Value::Null),
    )
}

fn problem(doc: &Value) -> &str {
    doc["type"]
        .as_str()
        .unwrap_or("")
        .rsplit('/')
        .next()
        .unwrap()
}

async fn state(c: &reqwest::Client, gate: &Gate, id: &str, token: Option<&str>) -> Value {
    let mut h = Vec::new();
    let auth = token.map(|t| format!("Bearer {t}"));
    if let Some(a) = &auth {
        h.push(("authorization", a.as_str()));
    }
    let (status, _, view) = admin(
        c,
        "GET",
        gate.admin_url(&format!("/records/{id}")),
        &h,
        None,
    )
    .await;
    assert_eq!(status, 200, "{view}");
    view["state"].clone()
}

fn assert_secure(h: &reqwest::header::HeaderMap, what: &str) {
    for (name, value) in [
        (
            "content-security-policy",
            "default-src 'none'; frame-ancestors 'none'",
        ),
        ("x-frame-options", "DENY"),
        ("x-content-type-options", "nosniff"),
        ("cache-control", "no-store"),
        ("referrer-policy", "no-referrer"),
    ] {
        assert_eq!(
            h.get(name).and_then(|v| v.to_str().ok()),
            Some(value),
            "{what}: {name}"
        );
    }
}

/// On the documented defaults (loopback, no token): a page on another origin cannot
/// complete, release or reload, nor read the records under a rebinding name; the record
/// stays `unknown` and the client's retry gets `outcome-unknown`, never a forged 201.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_web_page_cannot_decide_a_payment_and_the_retry_never_sees_a_forged_answer() {
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url())
        .set(|c| c.defaults.upstream_timeout = Duration::from_millis(300))
        .binary();
    let c = client();
    let id = lost_payment(&c, &gate, "p-1").await;
    let admin_addr = gate.admin;
    let complete = gate.admin_url(&format!("/records/{id}/complete?reason=page"));
    let forged = json!({"status": 201, "headers": {"content-type": "application/json"}, "body": "{\"id\":\"forged\"}"}).to_string();
    let other_port = format!("http://127.0.0.1:{}", admin_addr.port() + 1);
    let own = format!("http://{admin_addr}");
    let evil_host = format!("evil.example:{}", admin_addr.port());
    // Method, URL, headers, body, and the status and problem it gets.
    type Attack<'a> = (
        &'a str,
        String,
        Vec<(&'a str, &'a str)>,
        Option<&'a str>,
        u16,
        &'a str,
    );
    let attacks: Vec<Attack> = vec![
        // The simple request a page sends without asking.
        (
            "POST",
            complete.clone(),
            vec![
                ("content-type", "text/plain"),
                ("origin", "https://evil.example"),
                ("sec-fetch-site", "cross-site"),
            ],
            Some(&forged),
            403,
            "cross-origin-refused",
        ),
        // Another port of the same host: same-site, another origin; JSON does not help.
        (
            "POST",
            complete.clone(),
            vec![
                ("content-type", "application/json"),
                ("origin", other_port.as_str()),
                ("sec-fetch-site", "same-site"),
            ],
            Some(&forged),
            403,
            "cross-origin-refused",
        ),
        // An Origin alone, or a Sec-Fetch-Site alone.
        (
            "POST",
            complete.clone(),
            vec![("content-type", "application/json"), ("origin", "null")],
            Some(&forged),
            403,
            "cross-origin-refused",
        ),
        (
            "DELETE",
            gate.admin_url(&format!("/records/{id}?reason=page&force=true")),
            vec![("sec-fetch-site", "same-site")],
            None,
            403,
            "cross-origin-refused",
        ),
        // No browser headers, but not JSON: the type a simple request may carry.
        (
            "POST",
            complete.clone(),
            vec![("content-type", "text/plain")],
            Some(&forged),
            415,
            "unsupported-media-type",
        ),
        // DNS rebinding: the page's own name in Host.
        (
            "POST",
            complete.clone(),
            vec![
                ("content-type", "application/json"),
                ("host", evil_host.as_str()),
            ],
            Some(&forged),
            421,
            "admin-host-refused",
        ),
        (
            "DELETE",
            gate.admin_url(&format!("/records/{id}?reason=page&force=true")),
            vec![("host", evil_host.as_str())],
            None,
            421,
            "admin-host-refused",
        ),
        (
            "POST",
            gate.admin_url("/config/reload"),
            vec![
                ("origin", "https://evil.example"),
                ("sec-fetch-site", "cross-site"),
            ],
            None,
            403,
            "cross-origin-refused",
        ),
    ];
    for (method, url, headers, body, want, name) in &attacks {
        let (status, h, doc) = admin(&c, method, url.clone(), headers, *body).await;
        assert_eq!(
            (status, problem(&doc)),
            (*want, *name),
            "{method} {url} {headers:?}: {doc}"
        );
        assert_eq!(h["content-type"], "application/problem+json");
        assert_eq!(h["idemgate-error"], *name);
        assert_eq!(h["x-should-retry"], "false", "{name}");
        assert_secure(&h, name);
        assert_eq!(state(&c, &gate, &id, None).await, "unknown", "{headers:?}");
    }
    // The 415 names the header to add.
    let (_, _, doc) = admin(
        &c,
        "POST",
        complete.clone(),
        &[("content-type", "text/plain")],
        Some(&forged),
    )
    .await;
    assert!(
        doc["detail"]
            .as_str()
            .unwrap()
            .contains("Content-Type: application/json"),
        "{doc}"
    );
    // A rebinding page reads nothing either.
    let (status, _, doc) = admin(
        &c,
        "GET",
        gate.admin_url("/records?state=unknown"),
        &[("host", &evil_host)],
        None,
    )
    .await;
    assert_eq!(status, 421);
    assert!(!doc.to_string().contains(&id));
    let retry = post_url(&c, &gate.url("/v1/pay"), Some("p-1"), PAYMENT, &[]).await;
    assert_eq!(retry.status, 409);
    assert!(
        retry.problem_type().ends_with("outcome-unknown"),
        "{:?}",
        retry.body
    );
    assert!(!retry.replayed());

    // The operator's own tools: no reason, 400; with one (and a page of this very origin
    // may), the record is completed and the retry replays the operator's answer.
    let bare = gate.admin_url(&format!("/records/{id}/complete"));
    let real = json!({"status": 201, "headers": {"content-type": "application/json"}, "body": "{\"id\":\"pay-1\"}"}).to_string();
    let (status, _, doc) = admin(
        &c,
        "POST",
        bare.clone(),
        &[("content-type", "application/json")],
        Some(&real),
    )
    .await;
    assert_eq!((status, problem(&doc)), (400, "reason-required"), "{doc}");
    let too_long = format!("{bare}?reason={}", "x".repeat(501));
    let (status, _, _) = admin(
        &c,
        "POST",
        too_long,
        &[("content-type", "application/json")],
        Some(&real),
    )
    .await;
    assert_eq!(status, 400);
    let (status, h, doc) = admin(
        &c,
        "POST",
        format!("{bare}?reason=ledger+shows+pay-1"),
        &[
            ("content-type", "application/json; charset=utf-8"),
            ("origin", own.as_str()),
            ("sec-fetch-site", "same-origin"),
        ],
        Some(&real),
    )
    .await;
    assert_eq!(status, 200, "{doc}");
    assert_secure(&h, "complete");
    let retry = post_url(&c, &gate.url("/v1/pay"), Some("p-1"), PAYMENT, &[]).await;
    assert!(retry.replayed());
    assert_eq!(&retry.body[..], b"{\"id\":\"pay-1\"}");
    // An empty body is never refused for its type (`curl -X POST -d ''`).
    let (status, _, _) = admin(
        &c,
        "POST",
        gate.admin_url("/config/reload"),
        &[("content-type", "application/x-www-form-urlencoded")],
        Some(""),
    )
    .await;
    assert_ne!(status, 415);
    // The anonymous caller's decision is audited with its peer address.
    let log = gate.log();
    let line = log
        .lines()
        .find(|l| {
            l.contains("idemgate::audit")
                && l.contains("action=\"complete\"")
                && l.contains("result=\"done\"")
        })
        .unwrap_or_else(|| panic!("no audit line: {log}"));
    assert!(
        line.contains("actor=anonymous") && line.contains("peer=127.0.0.1"),
        "{line}"
    );
    assert!(line.contains("reason=\"ledger shows pay-1\""), "{line}");
}

/// Raw HTTP/1.1 to the admin listener: the status line.
fn raw_status(admin: SocketAddr, head: &str) -> String {
    send_raw(admin, head.as_bytes())
        .lines()
        .next()
        .unwrap_or("")
        .to_string()
}

/// An h2c request to the admin listener under `authority`: the status.
async fn h2c_status(admin: SocketAddr, authority: &str, path: &str) -> u16 {
    let io = hyper_util::rt::TokioIo::new(tokio::net::TcpStream::connect(admin).await.unwrap());
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), io)
            .await
            .unwrap();
    tokio::spawn(conn);
    let req = hyper::Request::get(format!("http://{authority}{path}"))
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .unwrap();
    send.send_request(req).await.unwrap().status().as_u16()
}

/// The listener answers under IP literals, `localhost` and `admin_hosts` names, whatever
/// the port unless the entry gives one, over HTTP/1.1 (Host, absolute form) and h2c
/// (`:authority`); any other name, or none, gets 421, probes included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_ip_literals_localhost_and_admin_hosts_are_answered() {
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url())
        .set(|c| c.admin_hosts = vec!["Gate.Internal".into(), "prom:9090".into()])
        .binary();
    let a = gate.admin;
    let get = |path: &str, host: &str| {
        format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n")
    };
    for host in [
        a.to_string(),
        "127.0.0.1".into(),
        "10.0.0.7:9901".into(),
        "[::1]:9901".into(),
        "localhost:1234".into(),
        "gate.internal:80".into(),
        "GATE.INTERNAL".into(),
        "prom:9090".into(),
    ] {
        for path in ["/healthz", "/metrics"] {
            assert!(
                raw_status(a, &get(path, &host)).contains(" 200 "),
                "{host} {path}"
            );
        }
    }
    for host in [
        "evil.example",
        "evil.example:9901",
        "prom:9091",
        "127.0.0.1.nip.io",
        "localhost.evil.example",
    ] {
        for path in ["/healthz", "/readyz", "/metrics", "/records"] {
            let line = raw_status(a, &get(path, host));
            assert!(line.contains(" 421 "), "{host} {path}: {line}");
        }
    }
    // No Host at all (HTTP/1.0), and an absolute-form target naming another host.
    let line = raw_status(a, "GET /healthz HTTP/1.0\r\n\r\n");
    assert!(line.contains(" 421 "), "{line}");
    let line = raw_status(
        a,
        &format!(
            "GET http://evil.example/records HTTP/1.1\r\nHost: {a}\r\nConnection: close\r\n\r\n"
        ),
    );
    assert!(line.contains(" 421 "), "{line}");
    let line = raw_status(
        a,
        &format!("GET http://{a}/records HTTP/1.1\r\nHost: {a}\r\nConnection: close\r\n\r\n"),
    );
    assert!(line.contains(" 200 "), "{line}");
    // h2c: the :authority.
    assert_eq!(h2c_status(a, &a.to_string(), "/records").await, 200);
    assert_eq!(
        h2c_status(a, &format!("evil.example:{}", a.port()), "/records").await,
        421
    );
    assert_eq!(h2c_status(a, "gate.internal", "/healthz").await, 200);
}

fn operators_toml(with_decider: bool) -> String {
    let mut t = format!("admin_token = \"{ADMIN_TOKEN}\"\n");
    let mut ops = vec![
        ("reader", READER, "read", false),
        ("reader-bodies", READER_BODIES, "read", true),
        ("boss", BOSS, "admin", false),
    ];
    if with_decider {
        ops.push(("decider", DECIDER, "decide", false));
    }
    for (name, token, role, bodies) in ops {
        t.push_str(&format!(
            "[[admin_operators]]\nname = \"{name}\"\ntoken_sha256 = \"{}\"\nrole = \"{role}\"\nread_bodies = {bodies}\n",
            sha256_hex(token)
        ));
    }
    t
}

/// `idemgate_operator_decisions_total{action, result}`, read with the admin token.
async fn decisions(c: &reqwest::Client, gate: &Gate, action: &str, result: &str) -> u64 {
    let text = c
        .get(gate.admin_url("/metrics"))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let series =
        format!("idemgate_operator_decisions_total{{action=\"{action}\",result=\"{result}\"}}");
    text.lines()
        .find_map(|l| l.strip_prefix(&series)?.trim().parse().ok())
        .unwrap_or(0)
}

/// Named operators: no token is 401 (the probes stay open), each role is enforced by the
/// server (403 `role-forbidden` naming it), `read_bodies`, `/scope-secret` by role, a
/// reason on every decision, an audit line per decision and refused attempt under
/// `idemgate::audit` (kept by a filter that silences the rest), counted; operators change
/// on reload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_act_within_their_role_with_a_reason_and_an_audit_line() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("idemgate.toml");
    std::fs::write(&file, operators_toml(true)).unwrap();
    let gate = Gate::start(
        &up.url(),
        "",
        &[
            ("IDEMGATE_CONFIG", file.to_str().unwrap()),
            ("IDEMGATE_DEFAULTS__UPSTREAM_TIMEOUT", "300ms"),
            ("RUST_LOG", "error"),
        ],
    );
    let c = client();
    let id = lost_payment(&c, &gate, "p-2").await;
    let as_ = |t: &str| format!("Bearer {t}");
    let (reader, bodies, decider, boss, admin_tok) = (
        as_(READER),
        as_(READER_BODIES),
        as_(DECIDER),
        as_(BOSS),
        as_(ADMIN_TOKEN),
    );
    let json_ct = ("content-type", "application/json");
    let outcome =
        json!({"status": 201, "body": "{\"id\":\"pay-2\"}", "reason": "ledger shows pay-2"})
            .to_string();
    let complete = gate.admin_url(&format!("/records/{id}/complete"));
    let release = gate.admin_url(&format!("/records/{id}?reason=not+run"));

    // No token: 401 (a problem), the probes open; the bearer does not beat a rebinding Host.
    let (status, h, doc) = admin(&c, "GET", gate.admin_url("/records"), &[], None).await;
    assert_eq!(
        (status, problem(&doc)),
        (401, "operator-token-required"),
        "{doc}"
    );
    assert_eq!(h["www-authenticate"], "Bearer");
    let (status, _, _) = admin(&c, "GET", gate.admin_url("/healthz"), &[], None).await;
    assert_eq!(status, 200);
    let evil = format!("evil.example:{}", gate.admin.port());
    let (status, _, _) = admin(
        &c,
        "GET",
        gate.admin_url("/records"),
        &[("authorization", &admin_tok), ("host", &evil)],
        None,
    )
    .await;
    assert_eq!(status, 421);

    // read: lists, shows, looks up, scrapes; never decides, reloads or reads the secret.
    for path in ["/records", "/metrics", "/observe"] {
        let (status, _, _) = admin(
            &c,
            "GET",
            gate.admin_url(path),
            &[("authorization", &reader)],
            None,
        )
        .await;
        assert_eq!(status, 200, "{path}");
    }
    assert_eq!(state(&c, &gate, &id, Some(READER)).await, "unknown");
    for (method, url, body) in [
        ("POST", complete.clone(), Some(outcome.as_str())),
        ("DELETE", release.clone(), None),
        ("POST", gate.admin_url("/config/reload"), None),
        ("GET", gate.admin_url("/scope-secret"), None),
    ] {
        let (status, _, doc) = admin(
            &c,
            method,
            url.clone(),
            &[("authorization", &reader), json_ct],
            body,
        )
        .await;
        assert_eq!(
            (status, problem(&doc)),
            (403, "role-forbidden"),
            "{method} {url}: {doc}"
        );
        assert!(doc["detail"].as_str().unwrap().contains("`read`"), "{doc}");
    }
    // Bodies: only with read_bodies.
    let with_body = gate.admin_url(&format!("/records/{id}?body=1"));
    let (status, _, doc) = admin(
        &c,
        "GET",
        with_body.clone(),
        &[("authorization", &reader)],
        None,
    )
    .await;
    assert_eq!(status, 403);
    assert!(
        doc["detail"].as_str().unwrap().contains("read_bodies"),
        "{doc}"
    );
    let (status, _, _) = admin(&c, "GET", with_body, &[("authorization", &bodies)], None).await;
    assert_eq!(status, 200);

    // decide: completes with a reason (the JSON field), not without; no secret, no reload.
    let no_reason = json!({"status": 201, "body": "{}"}).to_string();
    let (status, _, doc) = admin(
        &c,
        "POST",
        complete.clone(),
        &[("authorization", &decider), json_ct],
        Some(&no_reason),
    )
    .await;
    assert_eq!((status, problem(&doc)), (400, "reason-required"), "{doc}");
    let (status, _, doc) = admin(
        &c,
        "POST",
        gate.admin_url("/scope-secret"),
        &[("authorization", &decider)],
        None,
    )
    .await;
    assert_ne!(status, 200, "{doc}");
    let (status, _, doc) = admin(
        &c,
        "GET",
        gate.admin_url("/scope-secret"),
        &[("authorization", &decider)],
        None,
    )
    .await;
    assert_eq!((status, problem(&doc)), (403, "role-forbidden"), "{doc}");
    assert_eq!(state(&c, &gate, &id, Some(READER)).await, "unknown");
    let (status, _, doc) = admin(
        &c,
        "POST",
        complete.clone(),
        &[("authorization", &decider), json_ct],
        Some(&outcome),
    )
    .await;
    assert_eq!(status, 200, "{doc}");
    let retry = post_url(&c, &gate.url("/v1/pay"), Some("p-2"), PAYMENT, &[]).await;
    assert!(retry.replayed());
    assert_eq!(&retry.body[..], b"{\"id\":\"pay-2\"}");

    // admin: the secret (and admin_token acts as operator `admin`).
    for token in [&boss, &admin_tok] {
        let (status, _, doc) = admin(
            &c,
            "GET",
            gate.admin_url("/scope-secret?reason=key+rotation"),
            &[("authorization", token)],
            None,
        )
        .await;
        assert_eq!(status, 200, "{doc}");
        assert!(doc["scope_secret"].is_string());
    }

    // The audit: who, why, what, from where, even with RUST_LOG=error.
    let log = gate.log();
    let audit: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("idemgate::audit"))
        .collect();
    let done = audit
        .iter()
        .find(|l| l.contains("action=\"complete\"") && l.contains("result=\"done\""))
        .unwrap_or_else(|| panic!("no audit line of the completion: {log}"));
    for part in [
        "actor=decider",
        "role=\"decide\"",
        "reason=\"ledger shows pay-2\"",
        &format!("record=\"{id}\""),
        "before=\"unknown\"",
        "forced=false",
        "status_written=Some(201)",
        "peer=127.0.0.1",
        "at=",
    ] {
        assert!(done.contains(part), "{part}: {done}");
    }
    assert!(
        audit.iter().any(|l| l.contains("actor=reader")
            && l.contains("action=\"release\"")
            && l.contains("result=\"refused\"")),
        "the reader's refused release: {audit:?}"
    );
    assert!(
        audit.iter().any(|l| l.contains("actor=boss")
            && l.contains("scope_secret")
            && l.contains("key rotation")),
        "{audit:?}"
    );
    assert!(
        !log.contains(DECIDER) && !log.contains(READER),
        "tokens never logged"
    );
    assert_eq!(decisions(&c, &gate, "complete", "done").await, 1);
    assert!(decisions(&c, &gate, "complete", "refused").await >= 2);
    assert_eq!(decisions(&c, &gate, "scope_secret", "done").await, 2);

    // Operators change on reload: the decider is gone.
    std::fs::write(&file, operators_toml(false)).unwrap();
    let (status, _, doc) = admin(
        &c,
        "POST",
        gate.admin_url("/config/reload?reason=decider+left"),
        &[("authorization", &boss)],
        None,
    )
    .await;
    assert_eq!(status, 200, "{doc}");
    let (status, _, _) = admin(
        &c,
        "GET",
        gate.admin_url("/records"),
        &[("authorization", &decider)],
        None,
    )
    .await;
    assert_eq!(status, 401);
    assert!(gate.log().lines().any(|l| l.contains("idemgate::audit")
        && l.contains("action=\"reload\"")
        && l.contains("actor=boss")));
}
