//! `error_format = "template"` through the binary: idemgate's own answers in an API's
//! shape, with typed placeholders, `Idemgate-Error` kept; the upstream's answers untouched;
//! a template that is not JSON, or names an unknown placeholder, or is missing, stops
//! start-up with exit 64 naming the key.

#![allow(clippy::unwrap_used)]

use crate::common;

use common::*;

const TEMPLATE: &str = r#"{"errors":[{"status":"{status}","code":"{code}","detail":"{title}: {detail}","meta":{"record":"{record_id}","retry":"{retry_after}"}}]}"#;

fn config_file(dir: &tempfile::TempDir, toml: &str) -> String {
    let path = dir.path().join("idemgate.toml");
    std::fs::write(&path, toml).unwrap();
    path.to_str().unwrap().to_string()
}

fn route(setting: &str) -> String {
    format!("[[routes]]\npath = \"/pay\"\n{setting}\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_shapes_idemgate_s_answers_and_nothing_else() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let file = config_file(
        &dir,
        &route(&format!(
            "error_format = \"template\"\nerror_template = '{TEMPLATE}'"
        )),
    );
    let g = Gate::start(&up.url(), "", &[("IDEMGATE_CONFIG", &file)]);
    let c = client();
    let first = post_url(&c, &g.url("/pay"), Some("t-1"), "{\"amount\":1}", &[]).await;
    assert_eq!(first.status, 201);
    assert_eq!(first.header("content-type"), Some("application/json"));
    // The replay is as it was.
    let again = post_url(&c, &g.url("/pay"), Some("t-1"), "{\"amount\":1}", &[]).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    // idemgate's own: in the template's shape.
    let other = post_url(&c, &g.url("/pay"), Some("t-1"), "{\"amount\":2}", &[]).await;
    assert_eq!(other.status, 422);
    assert_eq!(other.header("idemgate-error"), Some("fingerprint-mismatch"));
    assert_eq!(other.header("content-type"), Some("application/json"));
    let doc = other.json();
    let e = &doc["errors"][0];
    assert_eq!(e["status"], 422, "{doc}");
    assert_eq!(e["code"], "fingerprint-mismatch");
    assert!(
        e["meta"]["record"].as_str().is_some_and(|r| r.len() == 64),
        "{doc}"
    );
    assert!(e["meta"]["retry"].is_null(), "{doc}");
    // Routes without the setting keep problem+json.
    let bad = post_url(&c, &g.url("/other"), Some(""), "{}", &[]).await;
    assert_eq!(bad.status, 400);
    assert_eq!(bad.header("content-type"), Some("application/problem+json"));
}

#[test]
fn a_template_that_cannot_be_used_stops_start_up() {
    let dir = tempfile::tempdir().unwrap();
    for (setting, says) in [
        ("error_format = \"template\"", "needs error_template"),
        (
            "error_format = \"template\"\nerror_template = '{nope'",
            "not a JSON document",
        ),
        (
            "error_format = \"template\"\nerror_template = '{\"x\":\"{amount}\"}'",
            "unknown placeholder {amount}",
        ),
    ] {
        let file = config_file(&dir, &route(setting));
        let (code, log) =
            Gate::run_to_exit("http://127.0.0.1:9", "", &[("IDEMGATE_CONFIG", &file)]);
        assert_eq!(code, Some(64), "{setting}: {log}");
        assert!(log.contains("error_template"), "{setting}: {log}");
        assert!(log.contains(says), "{setting}: {log}");
    }
}

/// Whether a retry may help, said the same way in every error format (`x-should-retry`,
/// and Stripe's `Stripe-Should-Retry` beside it): `true` for a duplicate while the first
/// still runs, `false` for the key reused with another body and for an outcome that stays
/// unknown (the 504, then the 409 to its retry), none of which a retry as sent can change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_format_says_whether_a_retry_may_help() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let mut toml = String::from("[defaults]\nupstream_timeout = \"1s\"\n");
    for (path, setting) in [
        ("/problem", String::new()),
        ("/stripe", "error_format = \"stripe\"".to_string()),
        (
            "/template",
            format!("error_format = \"template\"\nerror_template = '{TEMPLATE}'"),
        ),
    ] {
        toml.push_str(&format!("[[routes]]\npath = \"{path}\"\n{setting}\n"));
    }
    let file = config_file(&dir, &toml);
    let g = Gate::start(&up.url(), "", &[("IDEMGATE_CONFIG", &file)]);
    let c = client();
    let says = |a: &Answer, path: &str, retry: &str, problem: &str| {
        assert_eq!(a.header("idemgate-error"), Some(problem), "{path}");
        assert_eq!(a.header("x-should-retry"), Some(retry), "{path} {problem}");
        let stripe = (path == "/stripe").then_some(retry);
        assert_eq!(a.header("stripe-should-retry"), stripe, "{path} {problem}");
    };
    for path in ["/problem", "/stripe", "/template"] {
        let url = g.url(path);
        let key = format!("hint{path}");
        let hits = up.hits();
        let first = post_in_background(&c, url.clone(), &key, "{\"a\":1}", &[(FAULT, "hold")]);
        eventually(HANG_GUARD, "the first at the upstream", || up.hits() > hits).await;
        let busy = post_url(&c, &url, Some(&key), "{\"a\":1}", &[]).await;
        assert_eq!(busy.status, 409, "{path}");
        says(&busy, path, "true", "in-progress");
        up.release();
        assert_eq!(first.await.unwrap().status, 201, "{path}");
        let reused = post_url(&c, &url, Some(&key), "{\"a\":2}", &[]).await;
        says(&reused, path, "false", "fingerprint-mismatch");

        let key = format!("hang{path}");
        let timed_out = post_url(&c, &url, Some(&key), "{}", &[(FAULT, "hang")]).await;
        assert_eq!(timed_out.status, 504, "{path}");
        says(&timed_out, path, "false", "upstream-timeout");
        let unknown = post_url(&c, &url, Some(&key), "{}", &[(FAULT, "hang")]).await;
        assert_eq!(unknown.status, 409, "{path}");
        says(&unknown, path, "false", "outcome-unknown");
    }
}

/// The API dialects docs/requests.md gives as templates, each started from the page's own
/// block: a duplicate while the first runs and the key reused with another body come back
/// with the vendor's code in the field its SDKs read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_dialects_write_each_vendor_s_code() {
    let page = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/requests.md"),
    )
    .unwrap();
    // The dialect, the JSON pointer its SDKs read, and the code there for a 409
    // in-progress and for a 422 fingerprint-mismatch.
    let expected = [
        (
            "gocardless",
            "/error/type",
            "invalid_state",
            "invalid_api_usage",
        ),
        (
            "paypal",
            "/name",
            "RESOURCE_CONFLICT",
            "UNPROCESSABLE_ENTITY",
        ),
        ("adyen", "/errorCode", "704", "704"),
        (
            "checkout",
            "/error_type",
            "request_in_progress",
            "request_invalid",
        ),
        (
            "square",
            "/errors/0/code",
            "CONFLICT",
            "IDEMPOTENCY_KEY_REUSED",
        ),
        (
            "modern-treasury",
            "/errors/code",
            "conflict",
            "parameter_invalid",
        ),
    ];
    let up = Upstream::start().await;
    let c = client();
    for (dialect, pointer, in_progress, mismatch) in expected {
        let marker = format!("<!-- dialect: {dialect} -->\n```toml\n");
        let at = page
            .find(&marker)
            .unwrap_or_else(|| panic!("no {dialect} template in docs/requests.md"));
        let block = &page[at + marker.len()..];
        let block = &block[..block.find("```").unwrap()];
        let path = block
            .lines()
            .find_map(|l| l.strip_prefix("path = \""))
            .and_then(|p| p.strip_suffix('"'))
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let file = config_file(&dir, block);
        let g = Gate::start(&up.url(), "", &[("IDEMGATE_CONFIG", &file)]);
        let url = g.url(path);
        let hits = up.hits();
        let first = post_in_background(&c, url.clone(), "k", "{\"a\":1}", &[(FAULT, "hold")]);
        eventually(HANG_GUARD, "the first at the upstream", || up.hits() > hits).await;
        let busy = post_url(&c, &url, Some("k"), "{\"a\":1}", &[]).await;
        assert_eq!(busy.status, 409, "{dialect}");
        let doc = busy.json();
        assert_eq!(
            doc.pointer(pointer),
            Some(&in_progress.into()),
            "{dialect}: {doc}"
        );
        up.release();
        assert_eq!(first.await.unwrap().status, 201, "{dialect}");
        let reused = post_url(&c, &url, Some("k"), "{\"a\":2}", &[]).await;
        assert_eq!(reused.status, 422, "{dialect}");
        let doc = reused.json();
        assert_eq!(
            doc.pointer(pointer),
            Some(&mismatch.into()),
            "{dialect}: {doc}"
        );
    }
}

/// `error_codes` must name problems idemgate answers, and belongs to a template.
#[test]
fn error_codes_that_cannot_be_used_stop_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let template = format!("error_format = \"template\"\nerror_template = '{TEMPLATE}'");
    for (setting, says) in [
        (
            format!("{template}\nerror_codes = {{ no-such-problem = \"x\" }}"),
            "`no-such-problem` is not a problem idemgate answers",
        ),
        (
            "error_format = \"stripe\"\nerror_codes = { in-progress = \"x\" }".to_string(),
            "error_codes are the codes of error_format = \"template\"",
        ),
    ] {
        let file = config_file(&dir, &route(&setting));
        let (code, log) =
            Gate::run_to_exit("http://127.0.0.1:9", "", &[("IDEMGATE_CONFIG", &file)]);
        assert_eq!(code, Some(64), "{setting}: {log}");
        assert!(log.contains(says), "{setting}: {log}");
        assert!(log.contains("error_codes"), "{setting}: {log}");
    }
}
