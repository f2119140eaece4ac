//! Framework presets set the rules their framework uses: Koa's literal segments any case
//! (and, where its router reads it so, `plus_is_space`: `+` a space), Django and Flask upper-case the method, Rails reads `_method`
//! from a form body and folds `.json`, Jetty cuts `;` parameters; without a preset the
//! generic rules refuse each of those spellings. Through the binary.

#![allow(clippy::unwrap_used)]

use crate::common;

use common::*;

const CONFIG: &str = r#"
[[routes]]
path = "/koa/accounts/{id}/transfers"
framework = "koa"
plus_is_space = true

[[routes]]
path = "/django"
framework = "django"

[[routes]]
path = "/rails/transfers"
framework = "rails"
methods = ["POST", "PATCH"]

[[routes]]
path = "/jetty"
framework = "jetty"
"#;

async fn send(
    c: &reqwest::Client,
    g: &Gate,
    method: &str,
    path: &str,
    key: &str,
    form: Option<&str>,
) -> Answer {
    let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
    let (ct, body) = match form {
        Some(f) => ("application/x-www-form-urlencoded", f.to_string()),
        None => ("application/json", "{\"amount\":1}".to_string()),
    };
    let res = c
        .request(method, g.url(path))
        .header("content-type", ct)
        .header("idempotency-key", key)
        .header("authorization", "Bearer a")
        .body(body)
        .send()
        .await
        .unwrap();
    Answer {
        status: res.status().as_u16(),
        headers: res.headers().clone(),
        body: res.bytes().await.unwrap(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_preset_folds_what_its_framework_folds() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("idemgate.toml");
    std::fs::write(&file, CONFIG).unwrap();
    let g = Gate::start(
        &up.url(),
        "",
        &[("IDEMGATE_CONFIG", file.to_str().unwrap())],
    );
    let c = client();
    // Koa: `+` is the space, `%2B` a plus (another account); literals in any case.
    let a = send(&c, &g, "POST", "/koa/accounts/al+b/transfers", "k1", None).await;
    let b = send(&c, &g, "POST", "/KOA/Accounts/al%20b/transfers", "k1", None).await;
    assert!(!a.replayed() && b.replayed(), "{:?}", b.body);
    let p = send(&c, &g, "POST", "/koa/accounts/al%2Bb/transfers", "k1", None).await;
    assert!(!p.replayed());
    assert_ne!(p.body, a.body);
    // Django: `post` is the POST.
    let a = send(&c, &g, "POST", "/django/t", "k2", None).await;
    let b = send(&c, &g, "post", "/django/t", "k2", None).await;
    assert!(b.replayed(), "{} {:?}", b.status, b.body);
    assert_eq!(a.body, b.body);
    // Without a preset, refused.
    let r = send(&c, &g, "post", "/other", "k2", None).await;
    assert_eq!(r.status, 400);
    // Rails: a form's `_method` is the method, `.json` the same action.
    let a = send(
        &c,
        &g,
        "POST",
        "/rails/transfers",
        "k3",
        Some("a=1&_method=patch"),
    )
    .await;
    let b = send(
        &c,
        &g,
        "POST",
        "/rails/transfers.json",
        "k3",
        Some("a=1&_method=patch"),
    )
    .await;
    assert_eq!(a.status, 201, "{:?}", a.body);
    assert!(b.replayed(), "{} {:?}", b.status, b.body);
    let r = send(&c, &g, "POST", "/rails/transfers.xml", "k3", None).await;
    assert_eq!(r.status, 400);
    // Jetty: `;jsessionid` is cut off.
    let a = send(&c, &g, "POST", "/jetty/t", "k4", None).await;
    let b = send(&c, &g, "POST", "/jetty/t;jsessionid=A", "k4", None).await;
    assert!(b.replayed(), "{} {:?}", b.status, b.body);
    assert_eq!(a.body, b.body);
    let r = send(&c, &g, "POST", "/other;jsessionid=A", "k4", None).await;
    assert_eq!(r.status, 400);
}
