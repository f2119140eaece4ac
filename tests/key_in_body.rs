//! `key_json_pointer`: the key in the JSON body, as Square's APIs take it
//! (`idempotency_key`). Through the binary: the body's key protects the request as the
//! header does; the header is still accepted when it agrees and refused when it differs;
//! no key anywhere is 400 missing-key; the key's rules apply; the same key with another
//! amount is 422; and the setting needs require_key (exit 64).

#![allow(clippy::unwrap_used)]

use crate::common;

use common::*;

fn square(key: Option<&str>, amount: u64) -> String {
    let key = key.map_or("null".to_string(), |k| format!("\"{k}\""));
    format!(
        "{{\"idempotency_key\":{key},\"amount_money\":{{\"amount\":{amount},\"currency\":\"USD\"}},\"source_id\":\"cnon:card-nonce-ok\"}}"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_in_a_square_shaped_body_protects_the_payment() {
    let up = Upstream::start().await;
    let route = idemgate::config::Route {
        path: "/v2/payments".into(),
        require_key: Some(true),
        key_json_pointer: Some("/idempotency_key".into()),
        ..Default::default()
    };
    let g = Idemgate::new(&up.url())
        .set(|c| c.routes = vec![route])
        .binary();
    let c = client();
    let url = g.url("/v2/payments");
    let pay = |body: String, header: Option<&'static str>| {
        let (c, url) = (c.clone(), url.clone());
        async move { post_url(&c, &url, header, &body, &[]).await }
    };
    let first = pay(square(Some("sq-1"), 100), None).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    let again = pay(square(Some("sq-1"), 100), None).await;
    assert!(again.replayed(), "{:?}", again.body);
    assert_eq!(again.body, first.body);
    // The header agreeing with the body: the same operation.
    let both = pay(square(Some("sq-1"), 100), Some("sq-1")).await;
    assert!(both.replayed());
    assert_eq!(up.hits(), 1);
    // Disagreeing: refused, nothing run.
    let differ = pay(square(Some("sq-1"), 100), Some("other")).await;
    assert_eq!(differ.status, 400, "{:?}", differ.body);
    assert!(differ.problem_type().ends_with("/invalid-key"));
    // The same key with another amount: 422.
    let other = pay(square(Some("sq-1"), 200), None).await;
    assert_eq!(other.status, 422, "{:?}", other.body);
    // No key in the body or the header: 400 missing-key; the header alone does.
    let none = pay(square(None, 100), None).await;
    assert_eq!(none.status, 400);
    assert!(
        none.problem_type().ends_with("/missing-key"),
        "{:?}",
        none.body
    );
    let header_only = pay(square(None, 300), Some("sq-2")).await;
    assert_eq!(header_only.status, 201);
    assert_eq!(up.hits(), 2);
    // The key's rules: a number, an empty string or a space are refused.
    for bad in [
        "{\"idempotency_key\":7}".to_string(),
        square(Some(""), 1),
        square(Some("a b"), 1),
    ] {
        let a = pay(bad.clone(), None).await;
        assert_eq!(a.status, 400, "{bad}: {:?}", a.body);
        assert!(
            a.problem_type().ends_with("/invalid-key"),
            "{bad}: {:?}",
            a.body
        );
    }
    // Another key, the same payment otherwise: another operation (the key is left out of
    // the fingerprint, so only the record tells them apart).
    let next = pay(square(Some("sq-3"), 100), None).await;
    assert_eq!(next.status, 201);
    assert!(!next.replayed());
    assert_eq!(up.hits(), 3);
}

#[test]
fn key_json_pointer_needs_require_key() {
    let (code, log) = Gate::run_to_exit(
        "http://127.0.0.1:9",
        "",
        &[(
            "IDEMGATE_ROUTES",
            r#"[{path="/v2/payments", key_json_pointer="/idempotency_key"}]"#,
        )],
    );
    assert_eq!(code, Some(64), "{log}");
    assert!(log.contains("key_json_pointer"), "{log}");
    assert!(log.contains("require_key"), "{log}");
}
