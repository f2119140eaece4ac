//! Route templates name the handler's parameters: letter case, trailing dots and format
//! suffixes fold on the route's own segments and at the end of the path, while a
//! parameter's value keeps its case, so `ALICE` never gets `alice`'s recorded answer.
//! Prefix routes beside them work as before. Through the binary, configured from a file.

#![allow(clippy::unwrap_used)]

use crate::common;

use common::*;

const CONFIG: &str = r#"
[[routes]]
path = "/v1/accounts/{id}/transfers"
case_insensitive_paths = true
format_suffixes = [".json"]
require_key = true

[[routes]]
path = "/v2/accounts/{id}/transfers"
format_suffixes = [".json"]

[[routes]]
path = "/files/{*rest}"
methods = ["PUT"]

[[routes]]
path = "/v1"
require_key = true
"#;

async fn post(c: &reqwest::Client, gate: &Gate, path: &str, key: Option<&str>) -> Answer {
    common::post_url(c, &gate.url(path), key, "{\"amount\":1}", &[]).await
}

fn gate(up: &Upstream) -> (Gate, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("idemgate.toml");
    std::fs::write(&file, CONFIG).unwrap();
    let g = Gate::start(
        &up.url(),
        "",
        &[("IDEMGATE_CONFIG", file.to_str().unwrap())],
    );
    (g, dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn literal_segments_fold_and_parameters_keep_their_case() {
    let up = Upstream::start().await;
    let (g, _dir) = gate(&up);
    let c = client();
    let first = post(&c, &g, "/v1/accounts/alice/transfers", Some("t1")).await;
    assert_eq!((first.status, up.hits()), (201, 1));
    for spelling in [
        "/V1/Accounts/alice/TRANSFERS",
        "/v1/accounts/alice/transfers.json",
        "/v1/accounts/alice/Transfers.JSON",
        "/v1/accounts/alice/transfers.",
        "/v1/accounts/al%69ce/transfers",
    ] {
        let r = post(&c, &g, spelling, Some("t1")).await;
        assert!(r.replayed(), "{spelling}: {} {:?}", r.status, r.body);
        assert_eq!(r.body, first.body, "{spelling}");
    }
    assert_eq!(up.hits(), 1);
    // Another account's case is another account: its own execution, never alice's answer.
    let other = post(&c, &g, "/v1/accounts/ALICE/transfers", Some("t1")).await;
    assert_eq!(other.status, 201, "{:?}", other.body);
    assert!(!other.replayed());
    assert_ne!(other.body, first.body);
    assert_eq!(up.hits(), 2);
    // The upstream got the path as the client spelt it (RFC 3986's form).
    let seen = up.seen();
    assert_eq!(seen[1].uri, "/v1/accounts/ALICE/transfers");
    // A trailing dot on a parameter is what IIS would hand its handler without it.
    let r = post(&c, &g, "/v1/accounts/alice./transfers", Some("t1")).await;
    assert_eq!(r.status, 400, "{:?}", r.body);
    assert!(r.problem_type().ends_with("/invalid-path"));
    // The template protects with its own settings: no key, no forwarding.
    let r = post(&c, &g, "/v1/accounts/bob/transfers", None).await;
    assert_eq!(r.status, 400);
    assert!(r.problem_type().ends_with("/missing-key"));
    assert_eq!(up.hits(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suffixes_and_trailing_spellings_are_read_where_the_framework_reads_them() {
    let up = Upstream::start().await;
    let (g, _dir) = gate(&up);
    let c = client();
    let first = post(&c, &g, "/v2/accounts/alice/transfers", Some("s1")).await;
    assert_eq!((first.status, up.hits()), (201, 1));
    // Django REST framework routes `.json` to the same view: listed, one operation.
    let r = post(&c, &g, "/v2/accounts/alice/transfers.json", Some("s1")).await;
    assert!(r.replayed(), "{:?}", r.body);
    // Unlisted suffixes, trailing dots and spaces: refused on the template's route, never
    // the prefix route `/v1`'s or the defaults'.
    for spelling in [
        "/v2/accounts/alice/transfers.xml",
        "/v2/accounts/alice/transfers.",
        "/v2/accounts/alice/transfers%20",
    ] {
        let r = post(&c, &g, spelling, Some("s1")).await;
        assert_eq!(r.status, 400, "{spelling}: {:?}", r.body);
        assert!(r.problem_type().ends_with("/invalid-path"), "{spelling}");
    }
    // Another case of a literal, where the route does not say how its upstream compares
    // letters (a template alone says nothing of case): refused as the template's, never
    // the defaults' operation.
    let r = post(&c, &g, "/v2/Accounts/alice/transfers", Some("s1")).await;
    assert_eq!(r.status, 400, "{:?}", r.body);
    assert!(r.problem_type().ends_with("/invalid-path"));
    assert_eq!(up.hits(), 1);
    // A tail takes the rest of the path, in its case.
    let put = |path: &'static str| {
        c.put(g.url(path))
            .header("idempotency-key", "f1")
            .header("authorization", "Bearer a")
            .body("x")
            .send()
    };
    let a = put("/files/A/b.txt").await.unwrap();
    assert_eq!(a.status(), 201);
    let b = put("/files/A//b.txt").await.unwrap();
    assert_eq!(b.headers()["idempotent-replayed"], "true");
    let d = put("/files/a/b.txt").await.unwrap();
    assert!(d.headers().get("idempotent-replayed").is_none());
    // The prefix route still takes what is under it.
    let r = post(&c, &g, "/v1/other/7", None).await;
    assert_eq!(r.status, 400);
    assert!(r.problem_type().ends_with("/missing-key"));
}

#[test]
fn a_bad_template_stops_start_up() {
    for (path, why) in [
        ("/v1/a{id}", "whole segment"),
        ("/v1/{id}/{id}", "used twice"),
        ("/v1/{*rest}/x", "last segment"),
        ("/v1/{9}", "parameter name"),
    ] {
        let routes = format!("[{{path=\"{path}\"}}]");
        let (code, err) = start_up_failure(&[
            ("IDEMGATE_UPSTREAM", "http://127.0.0.1:9"),
            ("IDEMGATE_ROUTES", &routes),
        ]);
        assert_eq!(code, Some(64), "{path}: {err}");
        assert!(err.contains("`routes[0].path`"), "{path}: {err}");
        assert!(err.contains(why), "{path}: {err}");
    }
}
