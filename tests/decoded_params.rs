//! A path parameter is what the framework hands its handler: decoded. Through the binary,
//! the same key with a parameter escaped and raw is one operation (the second replays),
//! whichever character the client's library escaped; escapes that decode to control
//! characters or to invalid UTF-8 are refused on protected methods, never forwarded as
//! another operation; and the upstream gets the RFC 3986 form, which it decodes to the same
//! parameter.

#![allow(clippy::unwrap_used)]

use crate::common;
use common::Probes;

use common::{Idemgate, Upstream};
use idemgate::config::Route;

/// A route at `path` that requires a key.
fn keyed(path: &str) -> Route {
    Route {
        path: path.into(),
        require_key: Some(true),
        ..Route::default()
    }
}

/// Raw `@` (Python's requests, curl) and `%40` (JavaScript's `encodeURIComponent`), and
/// the other characters a framework decodes in a parameter before its handler sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_escaped_and_a_raw_parameter_are_one_operation() {
    let up = Upstream::start().await;
    // The upstream reads a raw `+` as a plus, as the route says (unset, it is refused).
    let g = Idemgate::new(&up.url())
        .set(|c| c.defaults.plus_is_space = Some(false))
        .binary();
    let client = common::client();
    let mut hits = 0;
    for (i, c) in "@:+,=$&!*'()[]|".chars().enumerate() {
        let key = format!("param-{i}");
        let raw = format!("/v1/accounts/alice{c}example.com/transfers");
        let escaped = format!(
            "/v1/accounts/alice%{:02X}example.com/transfers",
            u32::from(c)
        );
        let lower = escaped.replace(
            &format!("%{:02X}", u32::from(c)),
            &format!("%{:02x}", u32::from(c)),
        );
        let first =
            common::post_url(&client, &g.url(&raw), Some(&key), "{\"amount\":1}", &[]).await;
        assert_eq!(first.status, 201, "{raw}: {:?}", first.body);
        hits += 1;
        for other in [&escaped, &lower] {
            let again =
                common::post_url(&client, &g.url(other), Some(&key), "{\"amount\":1}", &[]).await;
            assert_eq!(again.status, 201, "{other}: {:?}", again.body);
            assert!(again.replayed(), "{other} after {raw} executed again");
            assert_eq!(again.body, first.body, "{other}");
        }
        assert_eq!(up.hits(), hits, "{c:?}");
    }
    // Escaped first, raw second: the same.
    let first = common::post_url(
        &client,
        &g.url("/v1/accounts/bob%40example.com/transfers"),
        Some("param-bob"),
        "{\"amount\":1}",
        &[],
    )
    .await;
    assert_eq!(first.status, 201);
    let again = common::post_url(
        &client,
        &g.url("/v1/accounts/bob@example.com/transfers"),
        Some("param-bob"),
        "{\"amount\":1}",
        &[],
    )
    .await;
    assert!(again.replayed(), "{:?}", again.body);
    assert_eq!(up.hits(), hits + 1);
    // What the upstream got: the RFC 3986 form, `@` escaped as the client escaped it or
    // not, so the framework decodes it to the same parameter.
    let seen = up.seen();
    let last = seen.last().unwrap();
    assert_eq!(last.uri, "/v1/accounts/bob%40example.com/transfers");
}

/// Control characters (Starlette routes `/v1/transfers%0A` to `/v1/transfers`) and escapes
/// that are not UTF-8 (Starlette makes `jos%E9`, `jos%E8` and `jos%EF%BF%BD` one account):
/// 400 invalid-path on a protected method, with or without a key, never forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_characters_and_invalid_utf8_are_refused() {
    let up = Upstream::start().await;
    let g = Idemgate::new(&up.url())
        .set(|c| c.routes = vec![keyed("/v1/transfers")])
        .binary();
    let client = common::client();
    for path in [
        "/v1/transfers%0A",
        "/v1/transfers%0d%0a",
        "/v1/transfers%00",
        "/v1/transfers%7F",
        "/v1/payees/jos%E9/transfers",
        "/v1/payees/jos%E8/transfers",
        "/v1/payees/%C3/transfers",
    ] {
        for key in [Some("ctl-1"), None] {
            let a = common::post_url(&client, &g.url(path), key, "{\"amount\":1}", &[]).await;
            assert_eq!(a.status, 400, "{path} {key:?}: {:?}", a.body);
            assert!(
                a.problem_type().ends_with("/invalid-path"),
                "{path}: {:?}",
                a.body
            );
        }
    }
    assert_eq!(up.hits(), 0);
    // The replacement character sent as itself is a name like any other.
    let a = common::post_url(
        &client,
        &g.url("/v1/payees/jos%EF%BF%BD/transfers"),
        Some("ctl-2"),
        "{\"amount\":1}",
        &[],
    )
    .await;
    assert_eq!(a.status, 201, "{:?}", a.body);
    // Pass-through methods are not refused: idemgate does not guard what it passes on.
    let get = client.get(g.url("/v1/transfers%0A")).send().await.unwrap();
    assert_eq!(get.status(), 201);
}

/// A path that is a protected route's but for a spelling some framework ignores (trailing
/// dots or spaces, which IIS and ASP.NET drop; an encoded newline, which Starlette's
/// routing drops) is refused on that route: never matched against a shorter route or the
/// defaults, where it would run as another operation, or past `require_key` without a key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spelling_some_framework_ignores_never_falls_through_to_another_route() {
    let up = Upstream::start().await;
    let unprotected = Route {
        path: "/v1".into(),
        methods: Some(Vec::new()),
        ..Route::default()
    };
    let g = Idemgate::new(&up.url())
        .set(|c| c.routes = vec![keyed("/v1/transfers"), unprotected])
        .binary();
    let client = common::client();
    let first = common::post_url(
        &client,
        &g.url("/v1/transfers"),
        Some("tr-1"),
        "{\"amount\":1}",
        &[],
    )
    .await;
    assert_eq!((first.status, up.hits()), (201, 1));
    let head = |target: &str, key: Option<&str>| {
        let key = key.map_or(String::new(), |k| format!("Idempotency-Key: {k}\r\n"));
        format!(
            "POST {target} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\r\nContent-Type: application/json\r\n{key}Content-Length: 12\r\nConnection: close\r\n\r\n{{\"amount\":1}}"
        )
    };
    for target in [
        "/v1/transfers.",
        "/v1/transfers..",
        "/v1/transfers%20",
        "/v1/transfers%2e",
        "/v1/transfers.%20",
        "/v1/transfers./7",
        "/v1%20/transfers",
        "/v1/transfers%0A",
        "/v1/transfers%0D",
    ] {
        for key in [Some("tr-1"), None] {
            let answer = common::send_raw(g.addr, head(target, key).as_bytes());
            assert!(
                answer.starts_with("HTTP/1.1 400"),
                "{target} {key:?}: {answer}"
            );
            assert!(
                answer
                    .to_ascii_lowercase()
                    .contains("idemgate-error: invalid-path"),
                "{target}: {answer}"
            );
        }
    }
    assert_eq!(up.hits(), 1, "none of them ran");
    // Another path under the shorter route is still that route's.
    let other = common::send_raw(g.addr, head("/v1/other.", None).as_bytes());
    assert!(other.starts_with("HTTP/1.1 201"), "{other}");
}
