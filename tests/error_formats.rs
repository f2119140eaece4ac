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
