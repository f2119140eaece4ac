//! Scope: one operation is one record whatever the client respells (the path, the case of
//! its auth scheme, a refreshed token under one principal), and two principals, two
//! namespaces or two stores never share one.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use idemgate::config::{Anonymous, PathMatch, Route};
use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// [`post`] with `Authorization: <authorization>`, the tenant of most requests here.
async fn post_as(
    c: &reqwest::Client,
    app: &idemgate::Running,
    path: &str,
    key: Option<&str>,
    body: &str,
    authorization: &str,
) -> Answer {
    post(c, app, path, key, body, &[("authorization", authorization)]).await
}

const TRANSFER: &str = r#"{"from":"acc-1","to":"acc-2","amount":1000}"#;

/// One request written by hand (reqwest would normalize the path before sending it), on
/// its own connection; the status and the whole response text.
async fn raw(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String) {
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    head.push_str(body);
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(head.as_bytes()).await.unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.unwrap();
        String::from_utf8_lossy(&out).into_owned()
    };
    let text = tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .expect("an answer within 10 s");
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, text)
}

fn with_routes(up: &Upstream, backend: &Backend, routes: Vec<Route>) -> idemgate::Config {
    let mut c = config(up, backend);
    c.defaults.anonymous = Anonymous::Refuse;
    c.routes = routes;
    c
}

fn transfers_route() -> Route {
    Route {
        path: "/v1/transfers".into(),
        require_key: Some(true),
        ..Default::default()
    }
}

async fn path_spellings_of_one_operation_execute_once(backend: Backend) {
    let up = Upstream::start().await;
    // The upstream reads raw bytes beyond ASCII as UTF-8, as the route says (unset, they
    // are refused: tests/path_strictness.rs).
    let route = Route {
        raw_utf8_paths: Some(true),
        ..transfers_route()
    };
    let app = spawn_app(with_routes(&up, &backend, vec![route])).await;
    let auth = ("authorization", "Bearer alice");
    let key = ("idempotency-key", "pay-7");
    let mut replays = 0;
    for path in [
        "/v1/transfers",
        "/v1/transfers/",
        "/v1//transfers",
        "/v1/%74ransfers",
        "/v1/./transfers",
        "/v1/x/../transfers",
    ] {
        let (status, text) = raw(app.addr(), "POST", path, &[auth, key], TRANSFER).await;
        assert_eq!(status, 201, "{path}: {text}");
        if text.contains("idempotent-replayed: true") {
            replays += 1;
        }
    }
    assert_eq!(up.hits(), 1, "one operation, one execution");
    assert_eq!(replays, 5);
    // The upstream got the normal form: what was scoped as one is sent as one.
    assert_eq!(up.seen()[0].uri, "/v1/transfers");
    // Keyless spellings of a route that requires a key are refused, not let through.
    for path in ["/v1//transfers", "/v1/%74ransfers", "/v1/transfers/"] {
        let (status, text) = raw(app.addr(), "POST", path, &[auth], TRANSFER).await;
        assert_eq!(status, 400, "{path}: {text}");
        assert!(text.contains("missing-key"), "{text}");
    }
    assert_eq!(up.hits(), 1);
    // Raw UTF-8 (as curl or a decoding gateway sends it) and its escapes: one payee, sent
    // on as its escapes, never as another character. Before: 3 executions, the second
    // to `/v1/transfers/jos\xc3\x83\xc2\xa9` ("josÃ©").
    let key = ("idempotency-key", "payee-jose");
    for path in [
        "/v1/transfers/jos\u{e9}",
        "/v1/transfers//jos\u{e9}",
        "/v1/transfers/jos%C3%A9",
    ] {
        let (status, text) = raw(app.addr(), "POST", path, &[auth, key], TRANSFER).await;
        assert_eq!(status, 201, "{path}: {text}");
    }
    assert_eq!(up.hits(), 2, "one payee, one execution");
    assert_eq!(up.seen()[1].uri, "/v1/transfers/jos%C3%A9");
    app.shutdown().await;
}

async fn paths_that_cannot_be_normalized_are_refused_when_protected(backend: Backend) {
    let up = Upstream::start().await;
    let app = spawn_app(with_routes(&up, &backend, vec![transfers_route()])).await;
    let headers = [("authorization", "Bearer alice"), ("idempotency-key", "k")];
    for path in [
        "/v1/transfers/a%2Fb",
        "/v1/transfers/a%5cb",
        "/../v1/transfers",
        "/v1/../../v1/transfers",
        "/v1/transfers/%zz",
        "/v1/transfers/%4",
        // A raw backslash, a separator to IIS and ASP.NET, refused like its escape.
        "/v1\\transfers",
        "/v1/transfers\\a",
    ] {
        let (status, text) = raw(app.addr(), "POST", path, &headers, TRANSFER).await;
        assert_eq!(status, 400, "{path}: {text}");
        assert!(text.contains("invalid-path"), "{path}: {text}");
    }
    assert_eq!(up.hits(), 0);
    // A method that nothing protects passes through as it came.
    let (status, _) = raw(app.addr(), "GET", "/v1/transfers/a%2Fb", &[], "").await;
    assert_eq!(status, 201);
    assert_eq!(up.seen()[0].uri, "/v1/transfers/a%2Fb");
    app.shutdown().await;
}

async fn strict_and_case_insensitive_routes(backend: Backend) {
    let up = Upstream::start().await;
    let routes = vec![
        Route {
            path: "/strict".into(),
            path_match: Some(PathMatch::Strict),
            ..Default::default()
        },
        Route {
            path: "/IIS/Pay".into(),
            case_insensitive_paths: Some(true),
            ..Default::default()
        },
    ];
    let app = spawn_app(with_routes(&up, &backend, routes)).await;
    let h = [
        ("authorization", "Bearer alice"),
        ("idempotency-key", "s-1"),
    ];
    let (a, _) = raw(app.addr(), "POST", "/strict/x", &h, TRANSFER).await;
    let (b, text) = raw(app.addr(), "POST", "/strict/x/", &h, TRANSFER).await;
    assert_eq!((a, b), (201, 201));
    assert!(
        !text.contains("idempotent-replayed"),
        "strict: another path"
    );
    assert_eq!(up.hits(), 2);
    let (_, text) = raw(app.addr(), "POST", "/strict/./x", &h, TRANSFER).await;
    assert!(
        text.contains("idempotent-replayed: true"),
        "dot segments still go"
    );
    let h = [
        ("authorization", "Bearer alice"),
        ("idempotency-key", "c-1"),
    ];
    let (a, _) = raw(app.addr(), "POST", "/IIS/Pay/Now", &h, TRANSFER).await;
    let (b, text) = raw(app.addr(), "POST", "/iis/pay/now/", &h, TRANSFER).await;
    assert_eq!((a, b), (201, 201));
    assert!(text.contains("idempotent-replayed: true"), "{text}");
    assert_eq!(up.hits(), 3);
    // The upstream gets the letters as the client wrote them.
    assert_eq!(up.seen()[2].uri, "/IIS/Pay/Now");
    app.shutdown().await;
}

async fn the_auth_scheme_is_case_insensitive_and_a_new_credential_is_a_new_tenant(
    backend: Backend,
) {
    let up = Upstream::start().await;
    let app = spawn_app(with_routes(&up, &backend, vec![])).await;
    let c = client();
    let new = post_as(&c, &app, "/pay", Some("k"), TRANSFER, "Bearer NEW").await;
    let lower = post_as(&c, &app, "/pay", Some("k"), TRANSFER, "bearer NEW").await;
    assert_eq!((new.status, lower.status), (201, 201));
    assert!(lower.replayed());
    assert_eq!(new.body, lower.body);
    // Without a principal source, a refreshed token is another tenant (docs/requests.md says so).
    let old = post_as(&c, &app, "/pay", Some("k"), TRANSFER, "Bearer OLD").await;
    assert!(!old.replayed());
    assert_eq!(up.hits(), 2);
    app.shutdown().await;
}

async fn tenants_from_an_api_key_header_never_share_a_key(backend: Backend) {
    let up = Upstream::start().await;
    let routes = vec![Route {
        path: "/orders".into(),
        tenant_headers: Some(vec!["X-Api-Key".into()]),
        ..Default::default()
    }];
    let app = spawn_app(with_routes(&up, &backend, routes)).await;
    let c = client();
    let m1 = [("x-api-key", "merchant-1")];
    let m2 = [("x-api-key", "merchant-2")];
    let a = post(&c, &app, "/orders", Some("order-1"), TRANSFER, &m1).await;
    let b = post(&c, &app, "/orders", Some("order-1"), TRANSFER, &m2).await;
    assert_eq!((a.status, b.status), (201, 201));
    assert!(!b.replayed(), "merchant 2's payment runs");
    assert_ne!(a.body, b.body);
    let a2 = post(&c, &app, "/orders", Some("order-1"), TRANSFER, &m1).await;
    let b2 = post(&c, &app, "/orders", Some("order-1"), TRANSFER, &m2).await;
    assert!(a2.replayed() && b2.replayed());
    assert_eq!((a2.body, b2.body), (a.body, b.body));
    // Merchant 2 changing its order under its own key is its own 422, not merchant 1's.
    let other = post(&c, &app, "/orders", Some("order-2"), "{\"amount\":5}", &m2).await;
    assert_eq!(other.status, 201);
    assert_eq!(up.hits(), 3);
    // No tenant: refused before anything is claimed or forwarded.
    let none = post(&c, &app, "/orders", Some("order-1"), TRANSFER, &[]).await;
    assert_eq!(none.status, 400);
    assert!(none.problem_type().ends_with("/missing-tenant"));
    let empty = post(
        &c,
        &app,
        "/orders",
        Some("order-1"),
        TRANSFER,
        &[("x-api-key", "")],
    )
    .await;
    assert_eq!(empty.status, 400);
    // The default tenant header is Authorization; anonymous requests are refused there too.
    let anon = post(&c, &app, "/elsewhere", Some("order-1"), TRANSFER, &[]).await;
    assert_eq!(anon.status, 400);
    assert!(anon.problem_type().ends_with("/missing-tenant"));
    assert_eq!(up.hits(), 3);
    app.shutdown().await;
}

async fn a_shared_anonymous_scope_is_an_explicit_choice(backend: Backend) {
    let up = Upstream::start().await;
    let routes = vec![Route {
        path: "/public".into(),
        anonymous: Some(Anonymous::Shared),
        ..Default::default()
    }];
    let app = spawn_app(with_routes(&up, &backend, routes)).await;
    let c = client();
    let a = post(&c, &app, "/public", Some("k"), TRANSFER, &[]).await;
    let b = post(&c, &app, "/public", Some("k"), TRANSFER, &[]).await;
    assert_eq!((a.status, b.status), (201, 201));
    assert!(b.replayed(), "one shared anonymous scope");
    // A tenant that is present is still its own scope.
    let t = post_as(&c, &app, "/public", Some("k"), TRANSFER, "Bearer x").await;
    assert!(!t.replayed());
    assert_eq!(up.hits(), 2);
    app.shutdown().await;
}

/// A key on a method that the route does not protect is counted, not silently dropped.
async fn a_key_on_an_unprotected_method_is_counted_as_unprotected(backend: Backend) {
    let up = Upstream::start().await;
    let app = spawn_app(with_routes(&up, &backend, vec![])).await;
    let h = [("authorization", "Bearer a"), ("idempotency-key", "k")];
    let (s1, _) = raw(app.addr(), "DELETE", "/pay", &h, TRANSFER).await;
    let (s2, _) = raw(app.addr(), "PUT", "/pay", &h, TRANSFER).await;
    let (s3, _) = raw(app.addr(), "GET", "/pay", &[], "").await;
    assert_eq!((s1, s2, s3), (201, 201, 201));
    assert_eq!(up.hits(), 3);
    // A protected method in another case is no unprotected method: refused, not run.
    let (s4, _) = raw(app.addr(), "post", "/pay", &h, TRANSFER).await;
    assert_eq!(s4, 400);
    assert_eq!(up.hits(), 3);
    let admin = app.admin_addr().unwrap();
    let metrics = http_get(admin, "/metrics").unwrap();
    let count = |outcome: &str| {
        metrics
            .lines()
            .find(|l| {
                l.starts_with("idemgate_requests_total")
                    && l.contains(&format!("outcome=\"{outcome}\""))
            })
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    assert_eq!(count("unprotected"), 2.0, "{metrics}");
    assert_eq!(count("passthrough"), 1.0, "{metrics}");
    app.shutdown().await;
}

on_both_stores!(
    path_spellings_of_one_operation_execute_once,
    paths_that_cannot_be_normalized_are_refused_when_protected,
    strict_and_case_insensitive_routes,
    the_auth_scheme_is_case_insensitive_and_a_new_credential_is_a_new_tenant,
    tenants_from_an_api_key_header_never_share_a_key,
    a_shared_anonymous_scope_is_an_explicit_choice,
    a_key_on_an_unprotected_method_is_counted_as_unprotected,
);

// JWT principals.

const HS_SECRET: &str = "jwt-secret-for-tests-0123456789abcdef";

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

fn hs_token(sub: &str, issued: u64) -> String {
    let claims = serde_json::json!({"sub": sub, "iat": issued, "exp": now() + 600});
    encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(HS_SECRET.as_bytes()),
    )
    .unwrap()
}

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refreshed_token_under_one_principal_is_one_operation() {
    let up = Upstream::start().await;
    let mut cfg = with_routes(&up, &Backend::memory(), vec![transfers_route()]);
    cfg.jwt_hs256_secret = Some(HS_SECRET.into());
    cfg.defaults.tenant_jwt_claim = Some("sub".into());
    let app = spawn_app(cfg).await;
    let c = client();
    let (old, new) = (bearer(&hs_token("alice", 1)), bearer(&hs_token("alice", 2)));
    assert_ne!(old, new);
    let a = post_as(&c, &app, "/v1/transfers", Some("pay-1"), TRANSFER, &old).await;
    let b = post_as(&c, &app, "/v1/transfers", Some("pay-1"), TRANSFER, &new).await;
    assert_eq!((a.status, b.status), (201, 201));
    assert!(b.replayed(), "the same principal with a refreshed token");
    assert_eq!(a.body, b.body);
    // Another principal with the same key is its own operation.
    let bob = bearer(&hs_token("bob", 1));
    let r = post_as(&c, &app, "/v1/transfers", Some("pay-1"), TRANSFER, &bob).await;
    assert!(!r.replayed());
    assert_eq!(up.hits(), 2);
    // A token that fails verification never reaches a record.
    let forged = encode(
        &Header::new(Algorithm::HS256),
        &serde_json::json!({"sub": "alice", "exp": now() + 600}),
        &EncodingKey::from_secret(b"not-the-secret-not-the-secret-00"),
    )
    .unwrap();
    let f = post_as(
        &c,
        &app,
        "/v1/transfers",
        Some("pay-2"),
        TRANSFER,
        &bearer(&forged),
    )
    .await;
    assert_eq!(f.status, 401);
    assert!(f.problem_type().ends_with("/invalid-token"));
    assert!(f.header("www-authenticate").unwrap().starts_with("Bearer"));
    let expired = encode(
        &Header::new(Algorithm::HS256),
        &serde_json::json!({"sub": "alice", "exp": now() - 3600}),
        &EncodingKey::from_secret(HS_SECRET.as_bytes()),
    )
    .unwrap();
    let e = post_as(
        &c,
        &app,
        "/v1/transfers",
        Some("pay-2"),
        TRANSFER,
        &bearer(&expired),
    )
    .await;
    assert_eq!(e.status, 401);
    let none = post(&c, &app, "/v1/transfers", Some("pay-2"), TRANSFER, &[]).await;
    assert_eq!(none.status, 400);
    assert!(none.problem_type().ends_with("/missing-tenant"));
    assert_eq!(up.hits(), 2);
    // pay-2 was never claimed: the first valid request executes it.
    let ok = post_as(&c, &app, "/v1/transfers", Some("pay-2"), TRANSFER, &old).await;
    assert!(!ok.replayed());
    assert_eq!(up.hits(), 3);
    app.shutdown().await;
}

fn openssl(args: &[&str]) {
    let st = std::process::Command::new("openssl")
        .args(args)
        .stderr(std::process::Stdio::null())
        .status()
        .expect("openssl");
    assert!(st.success(), "openssl {args:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jwks_keys_verify_rs256_and_es256_tokens() {
    use jsonwebtoken::jwk::{Jwk, JwkSet};
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    openssl(&[
        "genpkey",
        "-algorithm",
        "RSA",
        "-pkeyopt",
        "rsa_keygen_bits:2048",
        "-out",
        &p("rsa.pem"),
    ]);
    openssl(&[
        "genpkey",
        "-algorithm",
        "EC",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-out",
        &p("ec.pem"),
    ]);
    let rsa = EncodingKey::from_rsa_pem(&std::fs::read(p("rsa.pem")).unwrap()).unwrap();
    let ec = EncodingKey::from_ec_pem(&std::fs::read(p("ec.pem")).unwrap()).unwrap();
    let mut rsa_jwk = Jwk::from_encoding_key(&rsa, Algorithm::RS256).unwrap();
    rsa_jwk.common.key_id = Some("rsa-1".into());
    let mut ec_jwk = Jwk::from_encoding_key(&ec, Algorithm::ES256).unwrap();
    ec_jwk.common.key_id = Some("ec-1".into());
    let jwks = JwkSet {
        keys: vec![rsa_jwk, ec_jwk],
    };
    std::fs::write(p("jwks.json"), serde_json::to_string(&jwks).unwrap()).unwrap();

    let up = Upstream::start().await;
    let mut cfg = with_routes(&up, &Backend::memory(), vec![]);
    cfg.jwks_file = Some(p("jwks.json").into());
    cfg.defaults.tenant_jwt_claim = Some("sub".into());
    let app = spawn_app(cfg).await;
    let c = client();
    // Two keys: `iss` is required.
    let claims =
        serde_json::json!({"iss": "https://idp.example", "sub": "carol", "exp": now() + 600});
    let mut rs = Header::new(Algorithm::RS256);
    rs.kid = Some("rsa-1".into());
    let mut es = Header::new(Algorithm::ES256);
    es.kid = Some("ec-1".into());
    let rs_token = bearer(&encode(&rs, &claims, &rsa).unwrap());
    let es_token = bearer(&encode(&es, &claims, &ec).unwrap());
    let a = post_as(&c, &app, "/pay", Some("k"), TRANSFER, &rs_token).await;
    let b = post_as(&c, &app, "/pay", Some("k"), TRANSFER, &es_token).await;
    assert_eq!((a.status, b.status), (201, 201), "{:?}", b.body);
    // The key that verified a token is part of its principal: whoever holds one key can
    // sign any `iss` and `sub`.
    assert!(!b.replayed(), "two keys, two principals");
    let again = post_as(&c, &app, "/pay", Some("k"), TRANSFER, &rs_token).await;
    assert!(again.replayed());
    // An RS256 header naming the EC key's id finds no key; an HS256 token signed with
    // anything is refused: no HS256 secret is configured.
    rs.kid = Some("ec-1".into());
    let wrong_kid = bearer(&encode(&rs, &claims, &rsa).unwrap());
    let r = post_as(&c, &app, "/pay", Some("k2"), TRANSFER, &wrong_kid).await;
    assert_eq!(r.status, 401);
    let hs = bearer(&hs_token("carol", 1));
    let r = post_as(&c, &app, "/pay", Some("k2"), TRANSFER, &hs).await;
    assert_eq!(r.status, 401);
    assert_eq!(up.hits(), 2);
    app.shutdown().await;
}

// Namespaces and record ids.

/// The record id in a 422: the same key with another body.
async fn record_id_of(app: &idemgate::Running, key: &str) -> String {
    let c = client();
    let auth = [("authorization", "Bearer alice")];
    let first = post(&c, app, "/pay", Some(key), TRANSFER, &auth).await;
    assert!(first.status == 201, "{:?}", first.body);
    let other = post(&c, app, "/pay", Some(key), "{\"amount\":2}", &auth).await;
    assert_eq!(other.status, 422);
    other.json()["record_id"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_namespaces_on_one_redis_never_see_each_other() {
    let redis = RedisServer::start();
    let (up_a, up_b) = (Upstream::start().await, Upstream::start().await);
    let mut ca = redis_config(&up_a, &redis);
    ca.namespace = Some("payments".into());
    let mut cb = redis_config(&up_b, &redis);
    cb.namespace = Some("ledger".into());
    let (a, b) = (spawn_app(ca.clone()).await, spawn_app(cb).await);
    let c = client();
    let auth = [("authorization", "Bearer alice")];
    let ra = post(&c, &a, "/pay", Some("k-1"), TRANSFER, &auth).await;
    let rb = post(&c, &b, "/pay", Some("k-1"), TRANSFER, &auth).await;
    assert_eq!((ra.status, rb.status), (201, 201));
    assert!(!rb.replayed(), "the second service runs its own operation");
    assert_eq!((up_a.hits(), up_b.hits()), (1, 1));
    // Each instance of a namespace shares its records: a second payments instance replays.
    let a2 = spawn_app(ca).await;
    let again = post(&c, &a2, "/pay", Some("k-1"), TRANSFER, &auth).await;
    assert!(again.replayed());
    assert_eq!(again.body, ra.body);
    assert_eq!((up_a.hits(), up_b.hits()), (1, 1));
    for app in [a, b, a2] {
        app.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn record_ids_are_keyed_by_a_secret_each_store_keeps() {
    let (r1, r2) = (RedisServer::start(), RedisServer::start());
    let up = Upstream::start().await;
    let (a, b) = (
        spawn_app(redis_config(&up, &r1)).await,
        spawn_app(redis_config(&up, &r2)).await,
    );
    let (ida, idb) = (record_id_of(&a, "k").await, record_id_of(&b, "k").await);
    assert_ne!(ida, idb, "the same request on two stores: unrelated ids");
    // A restarted instance on the same store reads the same secret back: same id, and the
    // retry is a replay, not a second execution.
    a.shutdown().await;
    let a2 = spawn_app(redis_config(&up, &r1)).await;
    let c = client();
    let auth = [("authorization", "Bearer alice")];
    let retry = post(&c, &a2, "/pay", Some("k"), TRANSFER, &auth).await;
    assert!(retry.replayed());
    let other = post(&c, &a2, "/pay", Some("k"), "{\"amount\":2}", &auth).await;
    assert_eq!(other.json()["record_id"].as_str(), Some(ida.as_str()));
    assert_eq!(up.hits(), 2);
    // Two fresh embedded stores: two secrets too.
    let m1 = spawn_app(config(&up, &Backend::memory())).await;
    let m2 = spawn_app(config(&up, &Backend::memory())).await;
    assert_ne!(record_id_of(&m1, "k").await, record_id_of(&m2, "k").await);
    for app in [a2, b, m1, m2] {
        app.shutdown().await;
    }
}

/// `format_suffixes` through the binary, configured as an operator would
/// (`IDEMGATE_ROUTES`): a listed suffix of the route's path is that operation, another
/// suffix is refused before anything reaches the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listed_format_suffix_is_the_routes_operation_through_the_binary() {
    let up = Upstream::start().await;
    let route = Route {
        path: "/v1/payees".into(),
        format_suffixes: Some(vec![".json".into()]),
        ..Route::default()
    };
    let gate = Idemgate::new(&up.url())
        .set(|c| c.routes = vec![route])
        .binary();
    let c = client();
    let first = post_url(&c, &gate.url("/v1/payees"), Some("fs-1"), "{}", &[]).await;
    assert_eq!(first.status, 201);
    let suffixed = post_url(&c, &gate.url("/v1/payees.json"), Some("fs-1"), "{}", &[]).await;
    assert!(suffixed.replayed(), "{}", suffixed.status);
    let other = post_url(&c, &gate.url("/v1/payees.xml"), Some("fs-2"), "{}", &[]).await;
    assert_eq!(other.status, 400);
    assert_eq!(up.hits(), 1);
}
