//! The strict default is strict: a spelling on which widely used frameworks disagree (letter
//! case of a route's literals, a raw `+`, raw bytes beyond ASCII) is refused on a protected
//! route unless the route, or its framework preset, says how its upstream reads it. Raw
//! bytes from the client, so that each path arrives exactly as written.

use std::time::Duration;

use idemgate::config::{Config, Framework, Route};

use crate::common::wire::{post, send_each, Read1};
use crate::common::Upstream;

async fn rig(route: Route) -> (Upstream, idemgate::Running) {
    let up = Upstream::start().await;
    let mut cfg = Config::for_upstream(&up.url());
    cfg.admin_listen = Some("127.0.0.1:0".parse().expect("addr"));
    cfg.defaults.anonymous = idemgate::config::Anonymous::Shared;
    cfg.scope_secret_create_delay = Duration::ZERO;
    cfg.routes = vec![route];
    let app = idemgate::start(cfg).await.expect("idemgate starts");
    (up, app)
}

fn transfers() -> Route {
    Route {
        path: "/v1/transfers".into(),
        require_key: Some(true),
        ..Default::default()
    }
}

/// POSTs each path under `key`, one connection each.
async fn send(app: &idemgate::Running, key: &str, paths: &[&[u8]]) -> Vec<Read1> {
    let requests: Vec<Vec<u8>> = paths
        .iter()
        .map(|p| {
            let mut r = b"POST ".to_vec();
            r.extend_from_slice(p);
            // The rest of a keyed JSON POST, after its path.
            let rest = post("", key, "{\"amount\":1}", "");
            r.extend_from_slice(&rest[5..]);
            r
        })
        .collect();
    send_each(app, requests).await
}

fn refused(a: &Read1, what: &str) {
    assert_eq!(a.status, 400, "{what}: {}", a.text());
    assert!(
        a.problem().ends_with("/invalid-path"),
        "{what}: {}",
        a.text()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn letter_case_is_refused_where_the_route_does_not_say() {
    let (up, app) = rig(transfers()).await;
    let spellings: [&[u8]; 4] = [
        b"/v1/transfers",
        b"/V1/Transfers",
        b"/v1/TRANSFERS",
        b"/v1/transfer%53",
    ];
    let answers = send(&app, "k-case", &spellings).await;
    assert_eq!(answers[0].status, 201);
    for (a, s) in answers.iter().zip(spellings).skip(1) {
        refused(a, &String::from_utf8_lossy(s));
    }
    assert_eq!(up.hits(), 1, "never executed again");
    app.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn letter_case_follows_the_route_or_its_preset_where_they_say() {
    for (route, folds) in [
        (
            Route {
                case_insensitive_paths: Some(true),
                ..transfers()
            },
            true,
        ),
        (
            Route {
                framework: Some(Framework::Koa),
                ..transfers()
            },
            true,
        ),
        (
            Route {
                case_insensitive_paths: Some(false),
                ..transfers()
            },
            false,
        ),
    ] {
        let (up, app) = rig(route).await;
        let answers = send(&app, "k-said", &[b"/v1/transfers", b"/V1/Transfers"]).await;
        assert_eq!(answers[0].status, 201);
        assert_eq!(answers[1].status, 201, "{}", answers[1].text());
        let replayed = answers[1].header("idempotent-replayed") == Some("true");
        assert_eq!(replayed, folds);
        assert_eq!(up.hits(), if folds { 1 } else { 2 });
        app.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_plus_is_refused_unless_plus_is_space_is_set() {
    // The generic default and the `koa` preset (which cannot know @koa/router's version).
    for route in [
        transfers(),
        Route {
            framework: Some(Framework::Koa),
            ..transfers()
        },
    ] {
        let (up, app) = rig(route).await;
        let answers = send(
            &app,
            "k-plus",
            &[b"/v1/transfers/a+b", b"/v1/transfers/a%2Bb"],
        )
        .await;
        refused(&answers[0], "a+b");
        assert_eq!(answers[1].status, 201, "%2B is a plus to every framework");
        assert_eq!(up.hits(), 1);
        app.shutdown().await;
    }
    // Set: a space (@koa/router 13), so `a+b` and `a%20b` are one account and `a%2Bb`
    // another, which executes on its own.
    let (up, app) = rig(Route {
        framework: Some(Framework::Koa),
        plus_is_space: Some(true),
        ..transfers()
    })
    .await;
    let answers = send(
        &app,
        "k-space",
        &[
            b"/v1/transfers/a+b",
            b"/v1/transfers/a%20b",
            b"/v1/transfers/a%2Bb",
        ],
    )
    .await;
    assert_eq!(answers[0].status, 201);
    assert_eq!(answers[1].header("idempotent-replayed"), Some("true"));
    assert_eq!(answers[2].status, 201);
    assert_eq!(
        answers[2].header("idempotent-replayed"),
        None,
        "another account"
    );
    assert_eq!(up.hits(), 2);
    app.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_bytes_beyond_ascii_are_refused_unless_the_route_reads_utf8() {
    let (up, app) = rig(transfers()).await;
    let answers = send(
        &app,
        "k-utf8",
        &[b"/v1/transfers/jos\xc3\xa9", b"/v1/transfers/jos%C3%A9"],
    )
    .await;
    refused(&answers[0], "raw UTF-8");
    assert_eq!(answers[1].status, 201);
    assert_eq!(up.hits(), 1);
    app.shutdown().await;
    let (up, app) = rig(Route {
        raw_utf8_paths: Some(true),
        ..transfers()
    })
    .await;
    let answers = send(
        &app,
        "k-utf8",
        &[b"/v1/transfers/jos\xc3\xa9", b"/v1/transfers/jos%C3%A9"],
    )
    .await;
    assert_eq!(answers[0].status, 201);
    assert_eq!(answers[1].header("idempotent-replayed"), Some("true"));
    assert_eq!(up.hits(), 1);
    app.shutdown().await;
}
