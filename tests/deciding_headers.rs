//! What idemgate decides on is what the upstream receives: a `Connection` header that names
//! a header idemgate reads to decide, a declared override on two lines, and a look-alike
//! spelt with `_` (one header to CGI-style servers, another to idemgate) are refused before
//! anything is claimed or forwarded; `CONNECT` is refused, never forwarded. Raw bytes from
//! the client, so that each header arrives exactly as written.

use std::time::Duration;

use idemgate::config::Config;

use crate::common::wire::{post, send_each, Conn};
use crate::common::Upstream;

async fn rig(tweak: impl FnOnce(&mut Config)) -> (Upstream, idemgate::Running) {
    let up = Upstream::start().await;
    let mut cfg = Config::for_upstream(&up.url());
    cfg.admin_listen = Some("127.0.0.1:0".parse().expect("addr"));
    cfg.defaults.anonymous = idemgate::config::Anonymous::Shared;
    cfg.scope_secret_create_delay = Duration::ZERO;
    tweak(&mut cfg);
    let app = idemgate::start(cfg).await.expect("idemgate starts");
    (up, app)
}

fn overriding(cfg: &mut Config) {
    cfg.defaults.methods = vec!["POST".into(), "DELETE".into()];
    cfg.defaults.method_override_headers = vec!["X-HTTP-Method-Override".into()];
    cfg.defaults.require_key = true;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_header_naming_a_deciding_header_is_refused() {
    let (up, app) = rig(overriding).await;
    let named = [
        "X-HTTP-Method-Override",
        "close, X-HTTP-Method-Override",
        "Idempotency-Key",
        "Authorization",
        "Content-Type",
        "keep-alive, content-encoding",
    ];
    let requests = named
        .iter()
        .enumerate()
        .map(|(i, n)| {
            post(
                "/transfers",
                &format!("k-conn-{i}"),
                "{}",
                &format!("x-http-method-override: DELETE\r\nauthorization: Bearer t\r\nconnection: {n}\r\n"),
            )
        })
        .collect();
    for (a, n) in send_each(&app, requests).await.iter().zip(named) {
        assert_eq!(a.status, 400, "{n}: {}", a.text());
        assert!(
            a.problem().ends_with("/invalid-header"),
            "{n}: {}",
            a.text()
        );
    }
    assert_eq!(up.hits(), 0, "nothing forwarded");
    // `close` and names idemgate does not read stay as they were.
    let plain = send_each(
        &app,
        vec![post(
            "/transfers",
            "k-conn-ok",
            "{}",
            "connection: close, x-trace\r\nx-trace: 1\r\n",
        )],
    )
    .await;
    assert_eq!(plain[0].status, 201, "{}", plain[0].text());
    assert_eq!(up.hits(), 1);
    app.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declared_override_on_two_lines_or_as_a_list_is_refused() {
    let (up, app) = rig(overriding).await;
    let answers = send_each(
        &app,
        vec![
            post(
                "/transfers",
                "k-two",
                "{}",
                "x-http-method-override: DELETE\r\nx-http-method-override: DELETE\r\n",
            ),
            post(
                "/transfers",
                "k-list",
                "{}",
                "x-http-method-override: DELETE, DELETE\r\n",
            ),
        ],
    )
    .await;
    for a in &answers {
        assert_eq!(a.status, 400, "{}", a.text());
        assert!(
            a.problem().ends_with("/invalid-method-override"),
            "{}",
            a.text()
        );
    }
    assert_eq!(up.hits(), 0);
    app.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_underscore_look_alike_of_a_deciding_header_is_refused() {
    let (up, app) = rig(overriding).await;
    let spellings = [
        "X_HTTP_METHOD_OVERRIDE: DELETE",
        "x-http_method-override: DELETE",
        "Idempotency_Key: k-2",
        "authorization_: x",
    ];
    let requests = spellings
        .iter()
        .enumerate()
        .map(|(i, h)| {
            post(
                "/transfers",
                &format!("k-us-{i}"),
                "{}",
                &format!("{h}\r\n"),
            )
        })
        .collect();
    let answers = send_each(&app, requests).await;
    // `authorization_` is no look-alike (`authorization-`): it passes.
    for (a, h) in answers.iter().zip(spellings).take(3) {
        assert_eq!(a.status, 400, "{h}: {}", a.text());
        assert!(a.problem().ends_with("/invalid-header"), "{h}");
    }
    assert_eq!(answers[3].status, 201, "{}", answers[3].text());
    assert_eq!(up.hits(), 1);
    app.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn look_alikes_pass_where_nothing_is_protected() {
    let (up, app) = rig(|cfg| cfg.defaults.methods = Vec::new()).await;
    let answers = send_each(
        &app,
        vec![post(
            "/transfers",
            "k",
            "{}",
            "X_HTTP_METHOD_OVERRIDE: DELETE\r\nconnection: authorization\r\n",
        )],
    )
    .await;
    assert_eq!(answers[0].status, 201, "{}", answers[0].text());
    assert_eq!(up.hits(), 1);
    app.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_is_refused_405_and_never_forwarded() {
    let (up, app) = rig(|_| {}).await;
    let addr = app.addr();
    let (refused, next) = tokio::task::spawn_blocking(move || {
        let mut c = Conn::open(addr);
        c.send(b"CONNECT 127.0.0.1:9 HTTP/1.1\r\nhost: 127.0.0.1:9\r\n\r\n");
        let refused = c.read(false);
        c.send(&post("/transfers", "k-after", "{}", ""));
        (refused, c.read(false))
    })
    .await
    .expect("client");
    let refused = refused.expect("an answer to CONNECT");
    assert_eq!(refused.status, 405, "{}", refused.text());
    assert!(refused.problem().ends_with("/method-not-allowed"));
    let allow = refused.header("allow").expect("Allow");
    assert!(
        allow.contains("POST") && !allow.contains("CONNECT"),
        "{allow}"
    );
    // The connection carries on with the next request, the only one forwarded.
    assert_eq!(next.expect("next").status, 201);
    let methods: Vec<String> = up.seen().into_iter().map(|s| s.method).collect();
    assert_eq!(methods, vec!["POST".to_string()], "CONNECT never forwarded");
    app.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observing_counts_a_hidden_deciding_header_as_enforcing_would_refuse_it() {
    let (up, app) = rig(|cfg| cfg.defaults.mode = idemgate::config::Mode::Observe).await;
    let answers = send_each(
        &app,
        vec![post(
            "/transfers",
            "k-obs",
            "{}",
            "connection: authorization\r\nauthorization: Bearer t\r\n",
        )],
    )
    .await;
    // Forwarded as if idemgate were absent.
    assert_eq!(answers[0].status, 201, "{}", answers[0].text());
    assert_eq!(up.hits(), 1);
    let admin = app.admin_addr().expect("admin");
    let metrics = crate::common::http_get(admin, "/metrics").unwrap_or_default();
    assert!(
        metrics.contains("idemgate_observed_total{route=\"default\",would=\"invalid_header\"} 1"),
        "{metrics}"
    );
    app.shutdown().await;
}
