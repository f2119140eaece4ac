//! Method overrides never pass unseen: by default a protected request whose override header
//! or `_method` names another method is refused before anything is claimed or forwarded; a
//! route that declares its override headers is scoped as the method they name. Through the
//! binary, configured as an operator would.

#![allow(clippy::unwrap_used)]

use crate::common;

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
    let gate = Idemgate::new(&up.url()).binary();
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
    let gate = Idemgate::new(&up.url())
        .set(|c| {
            c.defaults.methods = vec!["POST".into(), "DELETE".into()];
            c.defaults.method_override_headers = vec!["X-HTTP-Method-Override".into()];
        })
        .binary();
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

/// Sends a `_method` form or multipart body as a POST.
async fn send_form(
    c: &reqwest::Client,
    method: &str,
    url: &str,
    key: &str,
    content_type: &str,
    body: &str,
) -> Answer {
    let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
    let res = c
        .request(method, url)
        .header("content-type", content_type)
        .header("idempotency-key", key)
        .header("authorization", "Bearer alice")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    Answer {
        status: res.status().as_u16(),
        headers: res.headers().clone(),
        body: res.bytes().await.unwrap(),
    }
}

const FORM: &str = "application/x-www-form-urlencoded";
const MULTIPART: &str = "multipart/form-data; boundary=b0undary";

fn multipart(method: &str) -> String {
    format!(
        "--b0undary\r\ncontent-disposition: form-data; name=\"amount\"\r\n\r\n10\r\n--b0undary\r\ncontent-disposition: form-data; name=\"_method\"\r\n\r\n{method}\r\n--b0undary--\r\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_protected_method_in_another_case_is_refused_unless_the_route_folds_it() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("idemgate.toml");
    std::fs::write(
        &file,
        "[[routes]]\npath = \"/django\"\nmethod_case = \"fold\"\n",
    )
    .unwrap();
    let gate = Gate::start(
        &up.url(),
        "",
        &[("IDEMGATE_CONFIG", file.to_str().unwrap())],
    );
    let c = client();
    let url = gate.url("/v1/accounts/7");
    let first = send(&c, "POST", &url, "k1", &[]).await;
    assert_eq!((first.status, up.hits()), (201, 1));
    for spelling in ["post", "Post", "pOST", "patch"] {
        let r = send(&c, spelling, &url, "k1", &[]).await;
        assert_eq!(r.status, 400, "{spelling}: {:?}", r.body);
        assert!(r.problem_type().ends_with("/invalid-method"), "{spelling}");
        assert_eq!(r.header("idemgate-error"), Some("invalid-method"));
    }
    assert_eq!(up.hits(), 1, "none of them reached the upstream");
    // A method no route protects in any case passes through.
    let r = send(&c, "get", &url, "k1", &[]).await;
    assert!(!r.replayed());
    assert_eq!(up.hits(), 2);
    // Where the upstream upper-cases (Django), `post` is the POST: its retry replays.
    let url = gate.url("/django/transfers");
    let first = send(&c, "POST", &url, "k1", &[]).await;
    assert_eq!((first.status, up.hits()), (201, 3));
    let again = send(&c, "post", &url, "k1", &[]).await;
    assert!(again.replayed(), "{:?}", again.body);
    assert_eq!(again.body, first.body);
    assert_eq!(up.hits(), 3);
    drop(gate);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_method_in_a_form_body_is_an_override_declared_or_refused() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("idemgate.toml");
    std::fs::write(
        &file,
        r#"
[[routes]]
path = "/rails"
methods = ["POST", "PATCH", "DELETE"]
method_override_params = ["body"]

[[routes]]
path = "/patch-only"
methods = ["PATCH"]
"#,
    )
    .unwrap();
    let gate = Gate::start(
        &up.url(),
        "",
        &[("IDEMGATE_CONFIG", file.to_str().unwrap())],
    );
    let c = client();
    // Undeclared: a form or multipart POST whose `_method` names another method is
    // refused, on a route that protects the POST, and on one that protects only the
    // method it names.
    let url = gate.url("/v1/accounts/7");
    let plain = send_form(&c, "POST", &url, "k1", FORM, "amount=10").await;
    assert_eq!((plain.status, up.hits()), (201, 1));
    for (ct, body, patch) in [
        (FORM, "amount=10&_method=PATCH".to_string(), true),
        (FORM, "amount=10&_method=delete".to_string(), false),
        (FORM, "amount=10&%5Fmethod=PATCH".to_string(), true),
        (MULTIPART, multipart("PATCH"), true),
    ] {
        let r = send_form(&c, "POST", &url, "k1", ct, &body).await;
        assert_eq!(r.status, 400, "{body}: {:?}", r.body);
        assert!(
            r.problem_type().ends_with("/invalid-method-override"),
            "{body}"
        );
        if patch {
            let r = send_form(&c, "POST", &gate.url("/patch-only/7"), "k2", ct, &body).await;
            assert_eq!(r.status, 400, "{body}: {:?}", r.body);
        }
    }
    assert_eq!(up.hits(), 1);
    // Where neither the POST nor the method named is protected, it runs as without
    // idemgate.
    let r = send_form(
        &c,
        "POST",
        &gate.url("/patch-only/7"),
        "k2",
        FORM,
        "_method=DELETE",
    )
    .await;
    assert_eq!((r.status, up.hits()), (201, 2));
    // Naming the POST itself is no override.
    let r = send_form(&c, "POST", &url, "k3", FORM, "amount=10&_method=post").await;
    assert_eq!((r.status, up.hits()), (201, 3));
    // Declared: the body's method is the operation's; its retry replays, and the POST
    // with the same key is another operation (not its answer, not a 422).
    let url = gate.url("/rails/transfers/7");
    for (ct, body) in [
        (FORM, "amount=10&_method=PATCH".to_string()),
        (MULTIPART, multipart("DELETE")),
    ] {
        let hits = up.hits();
        let a = send_form(&c, "POST", &url, "k4", ct, &body).await;
        let b = send_form(&c, "POST", &url, "k4", ct, &body).await;
        assert_eq!(a.status, 201, "{body}: {:?}", a.body);
        assert!(!a.replayed() && b.replayed(), "{body}");
        assert_eq!(a.body, b.body);
        assert_eq!(up.hits(), hits + 1);
    }
    let post = send_form(&c, "POST", &url, "k4", FORM, "amount=10&_method=PATCH").await;
    assert!(post.replayed(), "the PATCH's retry");
    let post = send_form(&c, "POST", &url, "k4", FORM, "amount=10").await;
    assert_eq!(post.status, 201, "{:?}", post.body);
    assert!(!post.replayed());
    // Two methods, or a value that is not one, in a declared field: refused.
    let r = send_form(&c, "POST", &url, "k5", FORM, "_method=PATCH&_method=DELETE").await;
    assert_eq!(r.status, 400);
    assert!(r.problem_type().ends_with("/invalid-method-override"));
    drop(gate);
}
