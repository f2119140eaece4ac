//! Fingerprints as the client sees them: replay when two requests mean the same thing, 422
//! when they do not. Each case runs through the proxy on the embedded store and on Redis.
#![allow(clippy::unwrap_used)]

use crate::common;

use common::*;
use idemgate::config::Route;

on_both_stores!(
    equal_meanings_replay_and_different_amounts_are_422,
    bodies_that_are_not_i_json_compare_raw,
    forms_sort_by_name_but_keep_value_order,
    ignored_members_do_not_count,
);

/// Sends `first` under a fresh key, then each of `same` (must replay) and `different`
/// (must be 422) under that key.
async fn check(
    app: &idemgate::Running,
    key: &str,
    ctype: &str,
    first: &str,
    same: &[&str],
    different: &[&str],
) {
    let c = client();
    let send = |body: &str| {
        let (c, body, addr) = (c.clone(), body.to_string(), app.addr());
        let ctype = ctype.to_string();
        let key = key.to_string();
        async move {
            let r = c
                .post(format!("http://{addr}/v1/transfers"))
                .header("content-type", ctype)
                .header("idempotency-key", key)
                .body(body)
                .send()
                .await
                .unwrap();
            (
                r.status().as_u16(),
                r.headers().contains_key("idempotent-replayed"),
            )
        }
    };
    assert_eq!(send(first).await, (201, false), "first {first}");
    for body in same {
        assert_eq!(
            send(body).await,
            (201, true),
            "{first} then {body} must replay"
        );
    }
    for body in different {
        assert_eq!(send(body).await.0, 422, "{first} then {body} must be 422");
    }
}

async fn equal_meanings_replay_and_different_amounts_are_422(backend: Backend) {
    let up = Upstream::start().await;
    let app = spawn_app(config(&up, &backend)).await;
    let json = "application/json";
    check(
        &app,
        "k1",
        json,
        r#"{"amount":4.50}"#,
        &[r#"{"amount":4.5}"#, r#"{ "amount" : 45e-1 }"#],
        &[r#"{"amount":4.51}"#],
    )
    .await;
    check(
        &app,
        "k2",
        json,
        r#"{"amount":9007199254740993}"#,
        &[r#"{"amount":9007199254740993.0}"#],
        &[r#"{"amount":9007199254740992}"#],
    )
    .await;
    check(
        &app,
        "k3",
        json,
        r#"{"amount":1e400}"#,
        &[r#"{"amount":10e399}"#],
        &[r#"{"amount":2e400}"#],
    )
    .await;
    check(
        &app,
        "k4",
        json,
        r#"{"amount":333333333.33333329}"#,
        &[],
        &[r#"{"amount":333333333.3333333}"#],
    )
    .await;
    check(
        &app,
        "k5",
        json,
        r#"{"amount":0.1}"#,
        &[],
        &[r#"{"amount":0.10000000000000001}"#],
    )
    .await;
    check(
        &app,
        "k6",
        "application/vnd.bank+json; charset=utf-8",
        r#"{"b":[1,{"y":2,"x":1}],"a":"\u00e9"}"#,
        &["{\"a\":\"\u{e9}\",\"b\":[1,{\"x\":1,\"y\":2}]}"],
        &[r#"{"a":"é","b":[{"x":1,"y":2},1]}"#],
    )
    .await;
    assert_eq!(up.hits(), 6);
    app.shutdown().await;
}

async fn bodies_that_are_not_i_json_compare_raw(backend: Backend) {
    let up = Upstream::start().await;
    let app = spawn_app(config(&up, &backend)).await;
    let json = "application/json";
    check(
        &app,
        "d1",
        json,
        r#"{"amount":1,"amount":2}"#,
        &[r#"{"amount":1,"amount":2}"#],
        &[r#"{"amount":3,"amount":2}"#, r#"{"amount":2}"#],
    )
    .await;
    check(
        &app,
        "d2",
        json,
        r#"{"a":{"b":1,"b":1}}"#,
        &[],
        &[r#"{"a":{"b":1}}"#],
    )
    .await;
    check(
        &app,
        "d3",
        json,
        r#"{"memo":"\ud800"}"#,
        &[r#"{"memo":"\ud800"}"#],
        &[r#"{"memo":"\udc00"}"#],
    )
    .await;
    check(
        &app,
        "d4",
        json,
        r#"{"amount": 1"#,
        &[r#"{"amount": 1"#],
        &[r#"{"amount":1"#],
    )
    .await;
    assert_eq!(
        up.hits(),
        4,
        "bodies that are not I-JSON are still forwarded"
    );
    app.shutdown().await;
}

async fn forms_sort_by_name_but_keep_value_order(backend: Backend) {
    let up = Upstream::start().await;
    let app = spawn_app(config(&up, &backend)).await;
    let form = "application/x-www-form-urlencoded";
    check(
        &app,
        "f1",
        form,
        "a=1&b=2",
        &["b=2&a=1", "a=%31&b=2"],
        &["a=1&b=3"],
    )
    .await;
    check(&app, "f2", form, "a=1&a=2", &[], &["a=2&a=1"]).await;
    check(
        &app,
        "f3",
        form,
        "memo=a+b",
        &["memo=a%20b"],
        &["memo=a%2Bb"],
    )
    .await;
    app.shutdown().await;
}

async fn ignored_members_do_not_count(backend: Backend) {
    let up = Upstream::start().await;
    let mut cfg = config(&up, &backend);
    cfg.routes.push(Route {
        path: "/v1/transfers".into(),
        fingerprint_ignore: Some(vec!["/client_time".into(), "/meta/nonce".into()]),
        ..Route::default()
    });
    let app = spawn_app(cfg).await;
    check(
        &app,
        "i1",
        "application/json",
        r#"{"amount":5,"client_time":"10:00","meta":{"nonce":"a","channel":"web"}}"#,
        &[
            r#"{"amount":5,"client_time":"10:01","meta":{"nonce":"b","channel":"web"}}"#,
            r#"{"amount":5,"meta":{"channel":"web"}}"#,
        ],
        &[
            r#"{"amount":6,"client_time":"10:00","meta":{"nonce":"a","channel":"web"}}"#,
            r#"{"amount":5,"meta":{"nonce":"a","channel":"app"}}"#,
        ],
    )
    .await;
    app.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_of_an_unknown_fingerprint_version_is_never_a_422() {
    use idemgate::fingerprint::Fingerprint;
    use idemgate::scope::{Scoper, Tenant};
    use idemgate::store::{ClaimRequest, OwnerToken, RedisStore, Store};
    use std::time::Duration;

    let redis = RedisServer::start();
    let up = Upstream::start().await;
    // An idemgate of a later version made this record (same scope: the shared anonymous
    // tenant, the tests' namespace, the store's secret).
    let store = RedisStore::connect(&redis.url(), Duration::from_secs(1), Duration::from_secs(1))
        .await
        .unwrap();
    let mut h = hyper::HeaderMap::new();
    h.insert(
        "idempotency-key",
        hyper::header::HeaderValue::from_static("v-key"),
    );
    let key = idemgate::key::parse(&h, 255).unwrap().unwrap();
    let secret = store.scope_secret().await.unwrap();
    let id = Scoper::new(&secret, NAMESPACE).record_id(
        &Tenant::anonymous(),
        "POST",
        "/v1/transfers",
        &key,
    );
    let planted = ClaimRequest {
        id,
        fingerprint: Fingerprint([9; 32]),
        fingerprint_version: 99,
        owner: OwnerToken::random(),
        lease: Duration::from_secs(10),
        retention: Duration::from_secs(60),
        busy_for: Duration::from_secs(10),
        answer_room: 0,
        room: None,
    };
    store.claim(&planted).await.unwrap();
    let app = spawn_app(redis_config(&up, &redis)).await;
    let r = post(
        &client(),
        &app,
        "/v1/transfers",
        Some("v-key"),
        "{\"amount\":1}",
        &[],
    )
    .await;
    assert_eq!(r.status, 409, "{:?}", r.body);
    assert!(r.problem_type().ends_with("/in-progress"));
    assert!(String::from_utf8_lossy(&r.body).contains("fingerprint version 99"));
    assert_eq!(up.hits(), 0);
    app.shutdown().await;
}

/// A record made by an instance of the previous release (fingerprint version 1, the raw
/// query) during a rolling upgrade: compared in version 1, so the identical retry replays;
/// a reordered retry was never the same request in version 1 and stays a 422, for such
/// records only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_of_the_previous_version_compares_in_that_version() {
    use bytes::Bytes;
    use idemgate::fingerprint::{fingerprint_as, RequestParts, Rules};
    use idemgate::scope::{Scoper, Tenant};
    use idemgate::store::{ClaimRequest, OwnerToken, RedisStore, Store, StoredResponse};
    use std::time::Duration;

    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let store = RedisStore::connect(&redis.url(), Duration::from_secs(1), Duration::from_secs(1))
        .await
        .unwrap();
    let secret = store.scope_secret().await.unwrap();
    let scoper = Scoper::new(&secret, NAMESPACE);
    let body = br#"{"amount":1}"#;
    let mut ids = Vec::new();
    for key in ["old-1", "old-2"] {
        let mut h = hyper::HeaderMap::new();
        h.insert(
            "idempotency-key",
            hyper::header::HeaderValue::from_str(key).unwrap(),
        );
        let key = idemgate::key::parse(&h, 255).unwrap().unwrap();
        let id = scoper.record_id(&Tenant::anonymous(), "POST", "/v1/transfers", &key);
        let parts = RequestParts {
            method: "POST",
            path: "/v1/transfers",
            query: Some("a=1&b=2"),
            content_type: Some("application/json"),
            body,
            ..Default::default()
        };
        let claim = ClaimRequest {
            id,
            fingerprint: fingerprint_as(1, &parts, &Rules::default()).unwrap(),
            fingerprint_version: 1,
            owner: OwnerToken::random(),
            lease: Duration::from_secs(10),
            retention: Duration::from_secs(60),
            busy_for: Duration::from_secs(10),
            answer_room: 0,
            room: None,
        };
        store.claim(&claim).await.unwrap();
        let answer = StoredResponse {
            status: 201,
            headers: vec![(
                "content-type".into(),
                Bytes::from_static(b"application/json"),
            )],
            body: Bytes::from_static(b"{\"execution\":0}"),
        };
        assert!(store.record(&id, &claim.owner, &answer).await.unwrap());
        ids.push(id);
    }
    let app = spawn_app(redis_config(&up, &redis)).await;
    let c = client();
    let body = std::str::from_utf8(body).unwrap();
    let same = post(&c, &app, "/v1/transfers?a=1&b=2", Some("old-1"), body, &[]).await;
    assert_eq!(same.status, 201, "{:?}", same.body);
    assert!(same.replayed());
    assert_eq!(&same.body[..], b"{\"execution\":0}");
    let reordered = post(&c, &app, "/v1/transfers?b=2&a=1", Some("old-2"), body, &[]).await;
    assert_eq!(reordered.status, 422, "{:?}", reordered.body);
    // A record this version makes takes the reordered retry as the same request.
    let new = post(&c, &app, "/v1/transfers?a=1&b=2", Some("new-1"), body, &[]).await;
    assert_eq!((new.status, new.replayed()), (201, false));
    let retry = post(&c, &app, "/v1/transfers?b=2&a=1", Some("new-1"), body, &[]).await;
    assert_eq!((retry.status, retry.replayed()), (201, true));
    assert_eq!(up.hits(), 1);
    app.shutdown().await;
}
