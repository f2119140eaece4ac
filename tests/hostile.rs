//! Hostile input: smuggling attempts, slow and oversized clients, malformed keys, tenants
//! probing each other, key floods. Each must be refused with the right status, and leave
//! nothing claimed and nothing forwarded (or, where hyper's parser accepts the framing,
//! exactly one well-framed request at the upstream).

#![allow(clippy::unwrap_used)]

use crate::common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::*;
use idemgate::{Config, Running};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TRANSFER: &str = r#"{"from":"acc-1","to":"acc-2","amount":1250,"currency":"EUR"}"#;

/// The status code of a raw HTTP/1.1 response, or 0 if the connection closed without one.
fn status_of(raw: &str) -> u16 {
    raw.strip_prefix("HTTP/1.1 ")
        .and_then(|r| r.get(..3))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// Checks one request as the upstream received it: one request line, no
/// Transfer-Encoding next to a Content-Length, and exactly as many body bytes as declared.
fn assert_well_framed(raw: &str) {
    let (head, body) = raw.split_once("\r\n\r\n").expect("a complete head");
    let lines: Vec<&str> = head.split("\r\n").collect();
    let header = |name: &str| -> Vec<String> {
        lines[1..]
            .iter()
            .filter_map(|l| l.split_once(':'))
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.trim().to_string())
            .collect()
    };
    let cl = header("content-length");
    let te = header("transfer-encoding");
    assert!(
        cl.len() <= 1,
        "several Content-Length at the upstream:\n{raw}"
    );
    assert!(
        cl.is_empty() || te.is_empty(),
        "Content-Length and Transfer-Encoding at the upstream:\n{raw}"
    );
    if let Some(cl) = cl.first() {
        assert_eq!(
            body.len(),
            cl.parse::<usize>().unwrap(),
            "body length differs from Content-Length at the upstream:\n{raw}"
        );
    }
    if te.is_empty() && cl.is_empty() {
        assert!(body.is_empty(), "body without framing:\n{raw}");
    }
}

async fn app_before(upstream_url: &str, tweak: impl FnOnce(&mut Config)) -> idemgate::Running {
    let mut c = Config::for_upstream(upstream_url);
    c.admin_listen = Some("127.0.0.1:0".parse().unwrap());
    c.defaults.anonymous = idemgate::config::Anonymous::Shared;
    tweak(&mut c);
    spawn_app(c).await
}

async fn raw(addr: SocketAddr, bytes: Vec<u8>) -> String {
    tokio::task::spawn_blocking(move || send_raw(addr, &bytes))
        .await
        .unwrap()
}

// 10. Request smuggling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smuggling_attempts_are_refused_or_reach_the_upstream_well_framed() {
    let up = RawUpstream::start().await;
    let app = app_before(&up.url(), |_| {}).await;
    let smuggled = "POST /smuggled HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n";
    let chunked_body = format!("{:x}\r\n{TRANSFER}\r\n0\r\n\r\n", TRANSFER.len());
    let cases: Vec<(&str, String)> = vec![
        (
            "Content-Length with Transfer-Encoding",
            format!("content-length: 4\r\ntransfer-encoding: chunked\r\n\r\n{chunked_body}{smuggled}"),
        ),
        (
            "Transfer-Encoding with Content-Length",
            format!("transfer-encoding: chunked\r\ncontent-length: {}\r\n\r\n{chunked_body}", chunked_body.len()),
        ),
        (
            "duplicate equal Content-Length",
            format!("content-length: {0}\r\ncontent-length: {0}\r\n\r\n{TRANSFER}", TRANSFER.len()),
        ),
        (
            "conflicting Content-Length",
            format!("content-length: 4\r\ncontent-length: {}\r\n\r\n{TRANSFER}", TRANSFER.len()),
        ),
        (
            "Content-Length list",
            format!("content-length: 4, {}\r\n\r\n{TRANSFER}", TRANSFER.len()),
        ),
        (
            "Transfer-Encoding gzip",
            format!("transfer-encoding: gzip\r\n\r\n{TRANSFER}"),
        ),
        (
            "Transfer-Encoding chunked, gzip",
            format!("transfer-encoding: chunked, gzip\r\n\r\n{chunked_body}"),
        ),
        (
            "Transfer-Encoding chunked twice",
            format!("transfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n{chunked_body}"),
        ),
        (
            "Transfer-Encoding with a space before the colon",
            format!("transfer-encoding : chunked\r\ncontent-length: 4\r\n\r\n{chunked_body}"),
        ),
        (
            "obs-fold",
            format!("x-folded: a\r\n  b\r\ncontent-length: {}\r\n\r\n{TRANSFER}", TRANSFER.len()),
        ),
        (
            "obs-fold hiding Transfer-Encoding",
            format!("x-folded: a\r\n transfer-encoding: chunked\r\ncontent-length: {}\r\n\r\n{TRANSFER}", TRANSFER.len()),
        ),
        (
            "bare LF line endings",
            format!("content-length: {}\n\n{TRANSFER}", TRANSFER.len()).replace("\r\n", "\n"),
        ),
    ];
    let mut tried = 0;
    for (keyed, path) in [
        (true, "/v1/transfers"),
        (false, "/v1/transfers"),
        (false, "/v1/accounts"),
    ] {
        for (what, rest) in &cases {
            let key = if keyed {
                format!("idempotency-key: k-smuggle-{tried}\r\n")
            } else {
                String::new()
            };
            let method = if path == "/v1/accounts" {
                "PUT"
            } else {
                "POST"
            };
            let before = up.received().len();
            let req = format!(
                "{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nconnection: close\r\n{key}{rest}"
            );
            let res = raw(app.addr(), req.into_bytes()).await;
            tried += 1;
            let status = status_of(&res);
            eprintln!("{what} ({method} {path}, key: {keyed}): {status}");
            let after = up.received();
            let new = &after[before..];
            match status {
                400 | 501 => assert!(new.is_empty(), "{what}: refused, yet forwarded: {new:?}"),
                201 => {
                    assert_eq!(new.len(), 1, "{what}: {new:?}");
                    assert_well_framed(&new[0]);
                    assert!(
                        !new[0].contains("/smuggled"),
                        "{what}: smuggled:\n{}",
                        new[0]
                    );
                }
                other => panic!("{what} ({method} {path}, key: {keyed}): status {other}\n{res}"),
            }
        }
    }
    assert!(!up.received().iter().any(|r| r.contains("/smuggled")));
    assert!(tried >= 30);
    app.shutdown().await;
}

// 11a. Headers trickled in: the connection is closed after header_read_timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trickled_headers_are_cut_off_after_the_header_timeout() {
    let up = Upstream::start().await;
    let app = app_before(&up.url(), |c| {
        c.header_read_timeout = Duration::from_millis(500);
    })
    .await;
    let mut s = tokio::net::TcpStream::connect(app.addr()).await.unwrap();
    let started = Instant::now();
    let head = format!(
        "POST /v1/transfers HTTP/1.1\r\nhost: x\r\nidempotency-key: k-slow-head\r\ncontent-length: {}\r\n",
        TRANSFER.len()
    );
    let mut closed_after = None;
    for b in head.bytes().chain(std::iter::repeat(b'x')) {
        if s.write_all(&[b]).await.is_err() {
            closed_after = Some(started.elapsed());
            break;
        }
        let mut buf = [0u8; 512];
        match tokio::time::timeout(Duration::from_millis(50), s.read(&mut buf)).await {
            Ok(Ok(_)) | Ok(Err(_)) => {
                closed_after = Some(started.elapsed());
                break;
            }
            Err(_) => {}
        }
        assert!(started.elapsed() < common::HANG_GUARD, "never cut off");
    }
    let after = closed_after.unwrap();
    assert!(
        after >= Duration::from_millis(450),
        "cut off early: {after:?}"
    );
    assert_eq!(up.hits(), 0);
    // Nothing claimed: the key works.
    executes_as_new(&app, "k-slow-head").await;
    app.shutdown().await;
}

// 11b. Body trickled in: 408 after body_read_timeout, nothing claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trickled_body_is_408_and_claims_nothing() {
    let up = Upstream::start().await;
    let app = app_before(&up.url(), |c| {
        c.body_read_timeout = Duration::from_millis(500);
    })
    .await;
    let mut s = tokio::net::TcpStream::connect(app.addr()).await.unwrap();
    let started = Instant::now();
    let head = format!(
        "POST /v1/transfers HTTP/1.1\r\nhost: x\r\nidempotency-key: k-slow-body\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        TRANSFER.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    for b in TRANSFER.bytes() {
        let _ = s.write_all(&[b]).await;
        let mut buf = [0u8; 4096];
        if let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(100), s.read(&mut buf)).await
        {
            got.extend_from_slice(&buf[..n]);
            break;
        }
    }
    let res = String::from_utf8_lossy(&got).into_owned();
    assert_eq!(status_of(&res), 408, "{res}");
    assert!(res.contains("body-timeout"), "{res}");
    let took = started.elapsed();
    assert!(took < Duration::from_secs(3), "{took:?}");
    assert_eq!(up.hits(), 0);
    executes_as_new(&app, "k-slow-body").await;
    app.shutdown().await;
}

// 11c. Too many or too large headers: 431, nothing forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_or_too_large_headers_are_431() {
    let up = Upstream::start().await;
    let app = app_before(&up.url(), |_| {}).await;
    let many: String = (0..200).map(|i| format!("x-h-{i}: v\r\n")).collect();
    let large = format!("x-large: {}\r\n", "v".repeat(1024 * 1024));
    for (what, extra) in [("200 headers", many), ("a 1 MiB header", large)] {
        let req = format!(
            "POST /v1/transfers HTTP/1.1\r\nhost: x\r\nidempotency-key: k-headers\r\ncontent-type: application/json\r\nconnection: close\r\n{extra}content-length: {}\r\n\r\n{TRANSFER}",
            TRANSFER.len()
        );
        let res = raw(app.addr(), req.into_bytes()).await;
        assert_eq!(status_of(&res), 431, "{what}: {res}");
    }
    assert_eq!(up.hits(), 0);
    executes_as_new(&app, "k-headers").await;
    app.shutdown().await;
}

// 12. Keys beyond what tests/proxy.rs covers: control characters, whitespace only, the
// exact length limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_with_control_characters_are_400_and_the_limit_is_exact() {
    let up = Upstream::start().await;
    let app = app_before(&up.url(), |_| {}).await;
    let bad: [&[u8]; 7] = [
        b"a\tb",
        b"a\x01b",
        b"a\x7fb",
        b"a\x00b",
        b"   ",
        b"\"a\tb\"",
        b"\xff\xfe",
    ];
    for key in bad {
        let mut req = b"POST /v1/transfers HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\nidempotency-key: ".to_vec();
        req.extend_from_slice(key);
        req.extend_from_slice(
            format!("\r\ncontent-length: {}\r\n\r\n{TRANSFER}", TRANSFER.len()).as_bytes(),
        );
        let res = raw(app.addr(), req).await;
        assert_eq!(status_of(&res), 400, "key {key:?}: {res}");
    }
    assert_eq!(up.hits(), 0);
    let c = client();
    let longest = "k".repeat(255);
    let r = post(&c, &app, "/v1/transfers", Some(&longest), TRANSFER, &[]).await;
    assert_eq!(r.status, 201, "255 characters is allowed");
    let quoted = format!("\"{}\"", "q".repeat(255));
    let r = post(&c, &app, "/v1/transfers", Some(&quoted), TRANSFER, &[]).await;
    assert_eq!(r.status, 201, "the quotes of an sf-string do not count");
    assert_eq!(up.hits(), 2);
    app.shutdown().await;
}

// 13. Tenants and replayed headers, beyond tests/proxy.rs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anonymous_and_authenticated_callers_never_share_and_replays_carry_no_hop_headers() {
    let up = Upstream::start().await;
    let app = app_before(&up.url(), |_| {}).await;
    let c = client();
    let anon = post(&c, &app, "/v1/transfers", Some("shared"), TRANSFER, &[]).await;
    let auth = [("authorization", "Bearer mallory")];
    let mallory = post(&c, &app, "/v1/transfers", Some("shared"), TRANSFER, &auth).await;
    assert!(!anon.replayed() && !mallory.replayed());
    assert_ne!(anon.body, mallory.body);
    // A credential in other letter case is another tenant, never a replay of someone else's
    // record; the same credential replays, whatever the case of its scheme.
    let other = [("authorization", "Bearer MALLORY")];
    let r = post(&c, &app, "/v1/transfers", Some("shared"), TRANSFER, &other).await;
    assert!(!r.replayed());
    let scheme = [("authorization", "bearer mallory")];
    let r = post(&c, &app, "/v1/transfers", Some("shared"), TRANSFER, &scheme).await;
    assert!(r.replayed());
    assert_eq!(r.body, mallory.body);
    let again = post(&c, &app, "/v1/transfers", Some("shared"), TRANSFER, &auth).await;
    assert!(again.replayed());
    assert_eq!(again.body, mallory.body);
    for h in [
        "set-cookie",
        "connection",
        "keep-alive",
        "x-upstream-hop",
        "transfer-encoding",
    ] {
        assert!(again.header(h).is_none(), "{h} replayed");
    }
    assert_eq!(up.hits(), 3);
    app.shutdown().await;
}

// 14. Key flooding on the embedded store: the cap answers 503, expired records make room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_floods_hit_the_cap_with_503_and_expired_records_make_room() {
    let up = Upstream::start().await;
    let retention = Duration::from_millis(500);
    let app = app_before(&up.url(), |c| {
        c.memory_max_records = 20;
        c.defaults.retention = retention;
        c.defaults.lease = Duration::from_millis(200);
        c.defaults.upstream_timeout = Duration::from_millis(300);
        // The keys sent once the flood's records have expired are kept for a minute, so
        // that none of them expires while they arrive, however slowly: the cap alone
        // decides how many fit.
        c.routes.push(idemgate::config::Route {
            path: "/v1/late".into(),
            retention: Some(Duration::from_secs(60)),
            ..idemgate::config::Route::default()
        });
    })
    .await;
    let c = client();
    for i in 0..20 {
        let r = transfer(&c, &app, &format!("flood-{i}")).await;
        assert_eq!(r.status, 201);
    }
    // Each record is written before its answer: the last expires within `retention` of now.
    let all_expired = Instant::now() + retention;
    for i in 20..60 {
        let r = transfer(&c, &app, &format!("flood-{i}")).await;
        assert_eq!(r.status, 503, "record {i} beyond the cap");
        assert!(r.problem_type().ends_with("/store-unavailable"));
    }
    assert_eq!(up.hits(), 20);
    // Once the flood's records have expired, new keys fit again, and only up to the cap.
    tokio::time::sleep_until(all_expired.into()).await;
    let mut accepted = 0;
    for i in 0..40 {
        let key = format!("flood-late-{i}");
        let r = post(&c, &app, "/v1/late", Some(&key), TRANSFER, &[]).await;
        assert!(r.status == 201 || r.status == 503, "{i}: {}", r.status);
        accepted += usize::from(r.status == 201);
    }
    assert_eq!(
        accepted, 20,
        "expired records made room for the cap's worth"
    );
    assert_eq!(up.hits(), 40);
    app.shutdown().await;
}

#[tokio::test]
async fn the_sweeper_drops_expired_records() {
    use idemgate::fingerprint::Fingerprint;
    use idemgate::key::RecordId;
    use idemgate::store::{ClaimRequest, MemoryStore, OwnerToken, Store};
    let store = MemoryStore::new(10_000);
    let _sweeper = store.spawn_sweeper(Duration::from_millis(50));
    for i in 0..5_000u32 {
        let id = RecordId::from_hex(&format!("{i:064x}")).unwrap();
        let req = ClaimRequest {
            id,
            fingerprint: Fingerprint([0; 32]),
            fingerprint_version: 1,
            owner: OwnerToken::random(),
            lease: Duration::from_millis(100),
            retention: Duration::from_millis(200),
            busy_for: Duration::from_millis(100),
            answer_room: 0,
            room: None,
        };
        store.claim(&req).await.unwrap();
    }
    assert_eq!(store.len(), 5_000);
    eventually(Duration::from_secs(3), "expired records swept", || {
        store.is_empty()
    })
    .await;
}

/// A transfer under `key`, without extra headers.
async fn transfer(c: &reqwest::Client, app: &Running, key: &str) -> Answer {
    post(c, app, "/v1/transfers", Some(key), TRANSFER, &[]).await
}

/// Nothing was claimed for `key`: a transfer under it executes as a new one.
async fn executes_as_new(app: &Running, key: &str) {
    let r = transfer(&client(), app, key).await;
    assert_eq!(r.status, 201);
    assert!(!r.replayed());
}
