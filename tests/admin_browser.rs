//! In a real browser (Debian's chromium, driven by Playwright): a page on another loopback
//! port, the same site as the admin listener but another origin, tries with no user action
//! to complete a payment's `unknown` record and to reload the configuration, with the
//! requests a page may send without asking (`no-cors`, a text/plain body). The browser
//! labels them `Sec-Fetch-Site: same-site`; the listener refuses them, the record stays
//! `unknown`, and the client's retry never gets the page's forged answer.

#![allow(clippy::unwrap_used)]

use crate::common;

use common::*;
use serde_json::Value;

const PAYMENT: &str = r#"{"amount":1250,"currency":"EUR"}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_on_another_port_cannot_complete_a_record_in_a_real_browser() {
    let dir = setup::browser();
    let up = Upstream::start().await;
    let gate = Gate::start(
        &up.url(),
        "",
        &[("IDEMGATE_DEFAULTS__UPSTREAM_TIMEOUT", "300ms")],
    );
    let c = client();
    let lost = post_url(
        &c,
        &gate.url("/v1/pay"),
        Some("b-1"),
        PAYMENT,
        &[(FAULT, "hang")],
    )
    .await;
    assert_eq!(lost.status, 504);
    let id = lost.json()["record_id"].as_str().unwrap().to_string();

    let admin = format!("http://{}", gate.admin);
    let out = tokio::task::spawn_blocking({
        let (dir, admin, id) = (dir.clone(), admin.clone(), id.clone());
        move || {
            std::process::Command::new("python3")
                .arg(dir.join("browser_attack.py"))
                .args(["/usr/bin/chromium", &admin, &id])
                .env("PYTHONPATH", dir.join("site"))
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "the browser run failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let seen: Value = serde_json::from_slice(&out.stdout).unwrap();
    let sent = seen["sent"].as_array().unwrap();
    // The browser did send the write, as the same site: a same-site rule would let it in.
    let complete = sent
        .iter()
        .find(|r| r["url"].as_str().unwrap().contains("/complete"))
        .unwrap_or_else(|| panic!("the page's complete never left the browser: {seen}"));
    assert_eq!(complete["status"], 403, "{seen}");
    assert_eq!(complete["sec_fetch_site"], "same-site", "{seen}");
    assert_eq!(
        complete["origin"].as_str(),
        seen["page"].as_str().map(|p| p.trim_end_matches('/')),
        "{seen}"
    );
    assert!(
        complete["content_type"]
            .as_str()
            .unwrap()
            .starts_with("text/plain"),
        "{seen}"
    );

    // Refused: the record is unchanged, the retry is told the outcome is unknown.
    let view: Value = c
        .get(gate.admin_url(&format!("/records/{id}")))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(view["state"], "unknown", "{view}");
    let retry = post_url(&c, &gate.url("/v1/pay"), Some("b-1"), PAYMENT, &[]).await;
    assert_eq!(retry.status, 409);
    assert!(!retry.replayed());
    assert!(!String::from_utf8_lossy(&retry.body).contains("forged"));
    // Both attempts reached the listener and were refused as cross-origin.
    let log = gate.log();
    for action in ["complete", "reload"] {
        assert!(
            log.lines().any(|l| l.contains("idemgate::audit")
                && l.contains(&format!("action=\"{action}\""))
                && l.contains("answered=403")),
            "{action}: {log}"
        );
    }
}
