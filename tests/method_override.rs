//! Method overrides never pass unseen: by default a protected request whose override header
//! or `_method` names another method is refused before anything is claimed or forwarded; a
//! route that declares its override headers is scoped as the method they name. Through the
//! binary, configured as an operator would.

#![allow(clippy::unwrap_used)]

mod common;

use common::*;

const BODY: &str = r#"{"account":"acc-1"}"#;
const OVERRIDE: &str = "X-HTTP-Method-Override";

async fn send(
    c: &reqwest::Client,
    method: &str,
    url: &str,
    key: &str,
    extra: &[(&str, &str)],
) -> Answer {
    let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
    let mut req = c
        .request(method, url)
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(BODY);
    for (k, v) in extra {
        req = req.header(*k, *v);
    }
    let res = req.send().await.unwrap();
    Answer {
        status: res.status().as_u16(),
        headers: res.headers().clone(),
        body: res.bytes().await.unwrap(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undeclared_override_is_refused_and_never_replays_another_method() {
    let up = Upstream::start().await;
    let gate = Gate::start(&up.url(), "", &[]);
    let c = client();
    let url = gate.url("/v1/accounts/7");
    let first = send(&c, "POST", &url, "k1", &[]).await;
    assert_eq!(first.status, 201);
    assert_eq!(up.hits(), 1);
    for header in [
        "X-HTTP-Method-Override",
        "X-HTTP-Method",
        "X-Method-Override",
    ] {
        let r = send(&c, "POST", &url, "k1", &[(header, "DELETE")]).await;
        assert_eq!(r.status, 400, "{header}: {:?}", r.body);
        assert!(!r.replayed());
        assert!(r.problem_type().ends_with("/invalid-method-override"));
        assert_eq!(r.header("idemgate-error"), Some("invalid-method-override"));
    }
    // `_method` in the query, and in any case.
    let r = send(&c, "POST", &format!("{url}?_method=delete"), "k1", &[]).await;
    assert_eq!(r.status, 400);
    assert!(r.problem_type().ends_with("/invalid-method-override"));
    // A GET (not protected) that would run as a POST (protected) does not pass through.
    let r = send(&c, "GET", &url, "k2", &[(OVERRIDE, "POST")]).await;
    assert_eq!(r.status, 400);
    // Nothing of those was forwarded, and k1 is still the POST's.
    assert_eq!(up.hits(), 1);
    // Naming the request's own method is no override; a GET overridden to another
    // unprotected method passes through as any GET does.
    let r = send(&c, "POST", &url, "k1", &[(OVERRIDE, "post")]).await;
    assert!(r.replayed());
    assert_eq!(r.body, first.body);
    let r = send(&c, "GET", &url, "k3", &[(OVERRIDE, "HEAD")]).await;
    assert!(!r.replayed());
    assert_eq!(up.hits(), 2);
    drop(gate);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declared_override_header_is_the_method_of_scope_and_fingerprint() {
    let up = Upstream::start().await;
    let gate = Gate::start(
        &up.url(),
        "",
        &[
            ("IDEMGATE_DEFAULTS__METHODS", r#"["POST","DELETE"]"#),
            (
                "IDEMGATE_DEFAULTS__METHOD_OVERRIDE_HEADERS",
                r#"["X-HTTP-Method-Override"]"#,
            ),
        ],
    );
    let c = client();
    let url = gate.url("/v1/accounts/7");
    let post = send(&c, "POST", &url, "k1", &[]).await;
    assert_eq!((post.status, up.hits()), (201, 1));
    let del = send(&c, "POST", &url, "k1", &[(OVERRIDE, "DELETE")]).await;
    // Its own operation: neither the POST's answer nor a 422 against it.
    assert_eq!(del.status, 201, "{:?}", del.body);
    assert!(!del.replayed());
    assert_ne!(del.body, post.body);
    assert_eq!(up.hits(), 2);
    // Scoped as DELETE: a plain DELETE with that key is its retry.
    let again = send(&c, "DELETE", &url, "k1", &[]).await;
    assert!(again.replayed(), "{:?}", again.body);
    assert_eq!(again.body, del.body);
    assert_eq!(up.hits(), 2);
    // An undeclared header naming a third method is still refused.
    let r = send(
        &c,
        "POST",
        &url,
        "k4",
        &[(OVERRIDE, "DELETE"), ("X-HTTP-Method", "PUT")],
    )
    .await;
    assert_eq!(r.status, 400);
    assert!(r.problem_type().ends_with("/invalid-method-override"));
    // A GET overridden to POST is a protected POST.
    let g = send(&c, "GET", &url, "k5", &[(OVERRIDE, "POST")]).await;
    let g2 = send(&c, "GET", &url, "k5", &[(OVERRIDE, "POST")]).await;
    assert!(!g.replayed() && g2.replayed());
    assert_eq!(up.hits(), 3);
    drop(gate);
}

#[test]
fn a_bad_override_header_name_stops_start_up() {
    let (code, err) = start_up_failure(&[
        ("IDEMGATE_UPSTREAM", "http://127.0.0.1:9"),
        (
            "IDEMGATE_DEFAULTS__METHOD_OVERRIDE_HEADERS",
            r#"["bad header"]"#,
        ),
    ]);
    assert_eq!(code, Some(64), "{err}");
    assert!(
        err.contains("invalid configuration value for `defaults.method_override_headers`"),
        "{err}"
    );
}
