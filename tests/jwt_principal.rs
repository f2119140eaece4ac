//! A JWT principal is (key source, issuer, claim): whoever holds one key cannot mint the
//! principals of another key's issuer, and a claim's JSON type counts. Through the binary,
//! configured with `IDEMGATE_*` variables as an operator would.

#![allow(clippy::unwrap_used)]

use crate::common;

use common::idp::Idp;
use common::*;
use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};

const SECRET: &str = "jwt-secret-for-tests-0123456789abcdef";
const BODY: &str = r#"{"from":"acc-1","to":"acc-2","amount":1000}"#;

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

fn hs(claims: serde_json::Value) -> String {
    common::idp::hs256_bearer(SECRET, &claims)
}

fn gate(up: &Upstream, idp: &Idp, extra: &[(&str, &str)]) -> Gate {
    let jwks = idp.jwks();
    let mut env = vec![
        ("IDEMGATE_JWT_HS256_SECRET", SECRET),
        ("IDEMGATE_JWKS_FILE", jwks.as_str()),
        ("IDEMGATE_DEFAULTS__TENANT_JWT_CLAIM", "sub"),
        ("IDEMGATE_DEFAULTS__ANONYMOUS", "refuse"),
    ];
    env.extend_from_slice(extra);
    Gate::start(&up.url(), "", &env)
}

async fn pay(c: &reqwest::Client, g: &Gate, key: &str, auth: &str) -> Answer {
    post_url(
        c,
        &g.url("/v1/transfers"),
        Some(key),
        BODY,
        &[("authorization", auth)],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_of_another_key_and_issuer_never_gets_the_first_callers_answer() {
    let (up, idp) = (Upstream::start().await, Idp::new());
    let g = gate(&up, &idp, &[]);
    let c = client();
    let exp = now() + 600;
    let internal =
        hs(serde_json::json!({"iss": "https://internal.example", "sub": "1001", "exp": exp}));
    let first = pay(&c, &g, "pay-1", &internal).await;
    assert_eq!((first.status, up.hits()), (201, 1));
    let foreign = idp.token(serde_json::json!({
        "iss": "https://idp.example", "sub": "1001", "aud": "some-other-app", "exp": exp
    }));
    let second = pay(&c, &g, "pay-1", &foreign).await;
    assert_eq!(second.status, 201, "{:?}", second.body);
    assert!(
        !second.replayed(),
        "another issuer's 1001 got the first caller's answer"
    );
    assert_ne!(second.body, first.body);
    assert_eq!(up.hits(), 2);
    // The same issuer's name signed with the other key is not that issuer's principal
    // either: the key source counts.
    let forged = hs(serde_json::json!({"iss": "https://idp.example", "sub": "1001", "exp": exp}));
    let third = pay(&c, &g, "pay-1", &forged).await;
    assert!(!third.replayed());
    assert_eq!(up.hits(), 3);
    // Each retry of its own principal is a replay, and the same token twice (kept after
    // its first verification) too.
    for (auth, of) in [
        (&internal, &first),
        (&foreign, &second),
        (&foreign, &second),
    ] {
        let r = pay(&c, &g, "pay-1", auth).await;
        assert!(r.replayed());
        assert_eq!(r.body, of.body);
    }
    // A refreshed token of the first principal is the same principal.
    let refreshed = hs(serde_json::json!({
        "iss": "https://internal.example", "sub": "1001", "iat": 7, "exp": exp
    }));
    assert!(pay(&c, &g, "pay-1", &refreshed).await.replayed());
    assert_eq!(up.hits(), 3);
    // With two key sources, a token without `iss` is refused.
    let no_iss = hs(serde_json::json!({"sub": "1001", "exp": exp}));
    let r = pay(&c, &g, "pay-2", &no_iss).await;
    assert_eq!(r.status, 401);
    assert!(r.problem_type().ends_with("/invalid-token"));
    assert_eq!(up.hits(), 3);
    assert!(!g.log().contains(SECRET));
    assert!(!g.log().contains(&internal["Bearer ".len()..]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_an_audience_a_token_for_another_app_is_refused() {
    let (up, idp) = (Upstream::start().await, Idp::new());
    let g = gate(&up, &idp, &[("IDEMGATE_JWT_AUDIENCE", "payments")]);
    let c = client();
    let exp = now() + 600;
    let internal = hs(serde_json::json!({
        "iss": "https://internal.example", "sub": "1001", "aud": "payments", "exp": exp
    }));
    assert_eq!(pay(&c, &g, "pay-1", &internal).await.status, 201);
    let foreign = idp.token(serde_json::json!({
        "iss": "https://idp.example", "sub": "1001", "aud": "some-other-app", "exp": exp
    }));
    let r = pay(&c, &g, "pay-1", &foreign).await;
    assert_eq!(r.status, 401);
    assert!(r.problem_type().ends_with("/invalid-token"));
    // No `aud` at all is refused too; one of a list of audiences is accepted.
    let none =
        idp.token(serde_json::json!({"iss": "https://idp.example", "sub": "1001", "exp": exp}));
    assert_eq!(pay(&c, &g, "pay-1", &none).await.status, 401);
    let listed = idp.token(serde_json::json!({
        "iss": "https://idp.example", "sub": "1001", "aud": ["x", "payments"], "exp": exp
    }));
    let ok = pay(&c, &g, "pay-1", &listed).await;
    assert_eq!(ok.status, 201);
    assert!(!ok.replayed());
    assert_eq!(up.hits(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn numbers_and_strings_are_different_principals_and_crit_is_refused() {
    let (up, idp) = (Upstream::start().await, Idp::new());
    let g = gate(&up, &idp, &[]);
    let c = client();
    let exp = now() + 600;
    let iss = "https://internal.example";
    let number = hs(serde_json::json!({"iss": iss, "sub": 42, "exp": exp}));
    let text = hs(serde_json::json!({"iss": iss, "sub": "42", "exp": exp}));
    let a = pay(&c, &g, "k", &number).await;
    let b = pay(&c, &g, "k", &text).await;
    assert_eq!((a.status, b.status), (201, 201));
    assert!(
        !b.replayed(),
        "{{\"sub\":42}} and {{\"sub\":\"42\"}} shared a record"
    );
    assert_eq!(up.hits(), 2);
    let mut h = Header::new(Algorithm::HS256);
    h.crit = Some(vec!["exp".into()]);
    let crit = encode(
        &h,
        &serde_json::json!({"iss": iss, "sub": 42, "exp": exp}),
        &EncodingKey::from_secret(SECRET.as_bytes()),
    )
    .unwrap();
    let r = pay(&c, &g, "k", &format!("Bearer {crit}")).await;
    assert_eq!(r.status, 401);
    assert!(r.problem_type().ends_with("/invalid-token"));
    assert_eq!(up.hits(), 2);
}

#[test]
fn bad_jwt_settings_stop_start_up() {
    for (env, key) in [
        (vec![("IDEMGATE_JWT_AUDIENCE", "payments")], "jwt_audience"),
        (
            vec![
                ("IDEMGATE_JWT_HS256_SECRET", SECRET),
                ("IDEMGATE_JWT_AUDIENCE", "[]"),
            ],
            "jwt_audience",
        ),
        (
            vec![("IDEMGATE_JWT_CACHE_ENTRIES", "many")],
            "jwt_cache_entries",
        ),
    ] {
        let mut all = vec![("IDEMGATE_UPSTREAM", "http://127.0.0.1:9")];
        all.extend(env);
        let (code, err) = start_up_failure(&all);
        assert_eq!(code, Some(64), "{err}");
        assert!(err.contains(key), "{err}");
        assert!(!err.contains(SECRET), "{err}");
    }
}
