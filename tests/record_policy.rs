//! What is recorded and under which header: `release_on_status` (answers passed on and not
//! kept, so the retry executes) and `key_headers` (aliases such as `PayPal-Request-Id`).

#![allow(clippy::unwrap_used)]

use crate::common;

use common::*;
use idemgate::config::{Config, Route};

const PAYMENT: &str = r#"{"amount":1250,"currency":"EUR"}"#;

on_both_stores!(
    release_on_status_passes_the_answer_on_and_the_retry_executes,
    key_aliases_share_one_record_and_two_different_keys_are_400,
);

fn route(c: &mut Config, r: Route) {
    c.routes.push(r);
}

async fn release_on_status_passes_the_answer_on_and_the_retry_executes(backend: Backend) {
    let up = Upstream::start().await;
    let mut c = config(&up, &backend);
    route(
        &mut c,
        Route {
            path: "/v1/pay".into(),
            release_on_status: Some(vec![429, 503]),
            ..Route::default()
        },
    );
    let app = spawn_app(c).await;
    let cl = client();
    let busy = post(
        &cl,
        &app,
        "/v1/pay",
        Some("r-1"),
        PAYMENT,
        &[(STATUS, "503")],
    )
    .await;
    assert_eq!(busy.status, 503);
    assert!(!busy.replayed());
    assert_eq!(busy.header("x-execution"), Some("1"));
    // The retry executes (the 503 was not kept), and its answer is what replays from then on.
    let done = post(&cl, &app, "/v1/pay", Some("r-1"), PAYMENT, &[]).await;
    assert_eq!(done.status, 201);
    assert!(!done.replayed());
    assert_eq!(done.header("x-execution"), Some("2"));
    let again = post(
        &cl,
        &app,
        "/v1/pay",
        Some("r-1"),
        PAYMENT,
        &[(STATUS, "503")],
    )
    .await;
    assert!(again.replayed());
    assert_eq!(again.status, 201);
    assert_eq!(again.body, done.body);
    assert_eq!(up.hits(), 2);
    // A status not listed is recorded like any answer, 5xx included.
    let failed = post(
        &cl,
        &app,
        "/v1/pay",
        Some("r-2"),
        PAYMENT,
        &[(STATUS, "500")],
    )
    .await;
    assert_eq!(failed.status, 500);
    let replayed = post(&cl, &app, "/v1/pay", Some("r-2"), PAYMENT, &[]).await;
    assert!(replayed.replayed());
    assert_eq!(replayed.status, 500);
    // Off the route (the defaults list nothing), a 503 is recorded too.
    let other = post(
        &cl,
        &app,
        "/v1/other",
        Some("r-3"),
        PAYMENT,
        &[(STATUS, "503")],
    )
    .await;
    assert_eq!(other.status, 503);
    let other = post(&cl, &app, "/v1/other", Some("r-3"), PAYMENT, &[]).await;
    assert!(other.replayed());
    assert_eq!(other.status, 503);
    assert_eq!(up.hits(), 4);
    app.shutdown().await;
}

async fn key_aliases_share_one_record_and_two_different_keys_are_400(backend: Backend) {
    let up = Upstream::start().await;
    let mut c = config(&up, &backend);
    route(
        &mut c,
        Route {
            path: "/v1/paypal".into(),
            key_headers: Some(vec!["Idempotency-Key".into(), "PayPal-Request-Id".into()]),
            ..Route::default()
        },
    );
    let app = spawn_app(c).await;
    let cl = client();
    let pp = [("PayPal-Request-Id", "pp-1")];
    let first = post(&cl, &app, "/v1/paypal", None, PAYMENT, &pp).await;
    assert_eq!(first.status, 201);
    // The header the client used is the one forwarded; no other is made up.
    let seen = &up.seen()[0];
    assert_eq!(seen.headers["paypal-request-id"], vec!["pp-1".to_string()]);
    assert!(!seen.headers.contains_key("idempotency-key"));
    let again = post(&cl, &app, "/v1/paypal", None, PAYMENT, &pp).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    // The same key under the other name is the same operation.
    let same = post(&cl, &app, "/v1/paypal", Some("pp-1"), PAYMENT, &[]).await;
    assert!(same.replayed());
    let both = post(&cl, &app, "/v1/paypal", Some("pp-1"), PAYMENT, &pp).await;
    assert!(both.replayed());
    assert_eq!(up.hits(), 1);
    // Two different keys: 400, nothing forwarded.
    let clash = post(&cl, &app, "/v1/paypal", Some("other"), PAYMENT, &pp).await;
    assert_eq!(clash.status, 400);
    assert!(clash.problem_type().ends_with("/invalid-key"));
    assert_eq!(up.hits(), 1);
    // Where the alias is not configured it is not a key: unprotected, executed each time.
    post(&cl, &app, "/v1/other", None, PAYMENT, &pp).await;
    let twice = post(&cl, &app, "/v1/other", None, PAYMENT, &pp).await;
    assert!(!twice.replayed());
    assert_eq!(up.hits(), 3);
    app.shutdown().await;
}

#[test]
fn bad_record_policies_stop_start_up_naming_the_key() {
    for (r, needle) in [
        (
            Route {
                path: "/a".into(),
                release_on_status: Some(vec![201]),
                ..Route::default()
            },
            "routes[0].release_on_status",
        ),
        (
            Route {
                path: "/a".into(),
                key_headers: Some(vec![]),
                ..Route::default()
            },
            "routes[0].key_headers",
        ),
        (
            Route {
                path: "/a".into(),
                key_headers: Some(vec!["bad header".into()]),
                ..Route::default()
            },
            "routes[0].key_headers",
        ),
    ] {
        let mut c = Config::for_upstream("http://127.0.0.1:9");
        c.routes.push(r);
        let err = idemgate::config::Settings::new(c).unwrap_err().to_string();
        assert!(err.contains(needle), "{err}");
    }
}
