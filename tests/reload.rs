//! Hot reload of the configuration, through the binary: `SIGHUP` and `POST
//! /config/reload` read the file again and apply routes, modes, timeouts and limits to new
//! requests, keeping the embedded store's records (observe, then enforce, replays what
//! observe recorded); an invalid file or a setting that needs a restart is refused whole,
//! and the configuration in force keeps serving.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;

const TOKEN: &str = "0123456789abcdef0123456789abcdef";

/// A configuration file in its own directory, rewritten by the tests.
struct File {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

impl File {
    fn new(toml: &str) -> File {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("idemgate.toml");
        std::fs::write(&path, toml).unwrap();
        File { _dir: dir, path }
    }

    fn write(&self, toml: &str) {
        std::fs::write(&self.path, toml).unwrap();
    }
}

/// The binary on the embedded store, configured by `file` (and the tests' environment).
fn gate(up: &Upstream, file: &Path, env: &[(&str, &str)]) -> Gate {
    let mut all = vec![("IDEMGATE_CONFIG", file.to_str().unwrap())];
    all.extend_from_slice(env);
    Gate::start(&up.url(), "", &all)
}

fn reloads(gate: &Gate, result: &str) -> u64 {
    let text = http_get(gate.admin, "/metrics").unwrap_or_default();
    let series = format!("idemgate_config_reloads_total{{result=\"{result}\"}}");
    text.lines()
        .find_map(|l| l.strip_prefix(&series)?.trim().parse().ok())
        .unwrap_or(0)
}

/// Sends SIGHUP and waits until the reload has been counted as `result`.
async fn hangup(gate: &Gate, result: &str) {
    let before = reloads(gate, result);
    signal(gate.pid(), "HUP");
    eventually(Duration::from_secs(5), "the reload to be counted", || {
        reloads(gate, result) > before
    })
    .await;
}

/// `POST /config/reload` with `token`: the status and the JSON answer.
async fn post_reload(gate: &Gate, token: Option<&str>) -> (u16, String, serde_json::Value) {
    let mut req = client().post(gate.admin_url("/config/reload"));
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let res = req.send().await.unwrap();
    let status = res.status().as_u16();
    let kind = res
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let text = res.text().await.unwrap();
    (
        status,
        kind,
        serde_json::from_str(&text).unwrap_or(serde_json::Value::Null),
    )
}

const OBSERVING: &str =
    "[[routes]]\npath = \"/v1/transfers\"\nmode = \"observe\"\nupstream_timeout = \"10s\"\n";
const ENFORCING: &str =
    "[[routes]]\npath = \"/v1/transfers\"\nmode = \"enforce\"\nupstream_timeout = \"300ms\"\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_switches_observe_to_enforce_on_the_embedded_store_and_replays() {
    let up = Upstream::start().await;
    let file = File::new(OBSERVING);
    let gate = gate(&up, &file.path, &[]);
    let c = client();
    let url = gate.url("/v1/transfers");
    let first = post_url(&c, &url, Some("k1"), "{\"amount\":1}", &[]).await;
    assert_eq!(first.status, 201);
    // Observing: a slow answer is waited for (upstream_timeout 10 s).
    let slow = post_url(&c, &url, Some("k2"), "{}", &[(DELAY_MS, "600")]).await;
    assert_eq!(slow.status, 201);
    assert_eq!(up.hits(), 2);

    file.write(ENFORCING);
    hangup(&gate, "applied").await;
    // The retry of what observe recorded is replayed: the upstream ran it once.
    let retry = post_url(&c, &url, Some("k1"), "{\"amount\":1}", &[]).await;
    assert_eq!(retry.status, 201);
    assert!(retry.replayed(), "{:?}", retry.body);
    assert_eq!(retry.body, first.body);
    assert_eq!(up.hits(), 2, "the retry was not executed again");
    // The new upstream_timeout holds for new requests.
    let timed_out = post_url(&c, &url, Some("k3"), "{}", &[(DELAY_MS, "1500")]).await;
    assert_eq!(timed_out.status, 504, "{:?}", timed_out.body);
    let log = gate.log();
    assert!(
        log.contains("configuration reloaded") && log.contains("routes[0].mode"),
        "{log}"
    );
    assert!(log.contains("routes[0].upstream_timeout"), "{log}");
    let metrics = http_get(gate.admin, "/metrics").unwrap();
    assert!(
        metrics.contains("idemgate_route_mode{route=\"/v1/transfers\",mode=\"enforce\"} 1"),
        "{metrics}"
    );
    assert!(
        !metrics.contains("idemgate_route_mode{route=\"/v1/transfers\",mode=\"observe\"}"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_file_or_a_restart_only_change_is_refused_and_the_old_config_serves() {
    let up = Upstream::start().await;
    let file = File::new(ENFORCING);
    let gate = gate(&up, &file.path, &[]);
    let c = client();
    let url = gate.url("/v1/transfers");
    let first = post_url(&c, &url, Some("k1"), "{}", &[]).await;
    assert_eq!(first.status, 201);

    // Not TOML, then a bad value: refused as invalid, nothing applied.
    file.write("[[routes]\npath = ");
    hangup(&gate, "invalid").await;
    file.write(&OBSERVING.replace("upstream_timeout", "lease = \"10ms\"\nupstream_timeout"));
    let (status, kind, doc) = post_reload(&gate, None).await;
    assert_eq!(status, 422, "{doc}");
    assert_eq!(kind, "application/problem+json");
    assert_eq!(doc["type"], "https://idemgate.dev/problems/config-invalid");
    assert!(
        doc["detail"].as_str().unwrap().contains("routes[0].lease"),
        "{doc}"
    );
    // The route still enforces: a retry is replayed, not executed.
    let retry = post_url(&c, &url, Some("k1"), "{}", &[]).await;
    assert!(retry.replayed());
    assert_eq!(up.hits(), 1);

    // A valid file that changes the embedded store's cap and the thread count, and
    // observes: refused whole, naming both settings; the mode change is not applied either.
    file.write(&format!(
        "memory_max_records = 10\nworker_threads = 2\n{OBSERVING}"
    ));
    let (status, kind, doc) = post_reload(&gate, None).await;
    assert_eq!(status, 409, "{doc}");
    assert_eq!(kind, "application/problem+json");
    assert_eq!(doc["type"], "https://idemgate.dev/problems/reload-refused");
    assert_eq!(
        doc["restart_required"],
        serde_json::json!(["memory_max_records", "worker_threads"])
    );
    hangup(&gate, "refused").await;
    let log = gate.log();
    assert!(log.contains("configuration reload refused"), "{log}");
    assert!(log.contains("memory_max_records, worker_threads"), "{log}");
    let again = post_url(&c, &url, Some("k1"), "{}", &[]).await;
    assert!(again.replayed(), "still enforcing");
    assert_eq!(up.hits(), 1);
    assert_eq!(reloads(&gate, "applied"), 0);
}

/// A reload names every problem of the file at once, each key with the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_names_every_key_of_the_wrong_type() {
    let up = Upstream::start().await;
    let file = File::new(ENFORCING);
    let gate = gate(&up, &file.path, &[]);
    file.write(&format!(
        "lease = \"10s\"\n{}",
        ENFORCING.replace(
            "mode = \"enforce\"",
            "mode = \"watch\"\nretention = \"soon\""
        )
    ));
    let (status, _, doc) = post_reload(&gate, None).await;
    assert_eq!(status, 422, "{doc}");
    let problems = doc["problems"].as_array().unwrap();
    assert_eq!(problems.len(), 3, "{doc}");
    let path = file.path.to_str().unwrap();
    for said in [
        "`lease` at the top level is a route key",
        "`routes[0].mode`",
        "`routes[0].retention`",
    ] {
        assert!(
            problems
                .iter()
                .any(|p| p.as_str().unwrap().contains(said) && p.as_str().unwrap().contains(path)),
            "{said}: {doc}"
        );
    }
    assert_eq!(reloads(&gate, "applied"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_config_reload_needs_the_admin_token_and_says_what_changed() {
    let up = Upstream::start().await;
    let file = File::new(ENFORCING);
    let gate = gate(&up, &file.path, &[("IDEMGATE_ADMIN_TOKEN", TOKEN)]);
    file.write(OBSERVING);
    let (status, _, _) = post_reload(&gate, None).await;
    assert_eq!(status, 401);
    let (status, _, _) = post_reload(&gate, Some("not-the-token-0123456789")).await;
    assert_eq!(status, 401);
    assert_eq!(reloads(&gate, "applied"), 0, "nothing was reloaded");
    let (status, _, doc) = post_reload(&gate, Some(TOKEN)).await;
    assert_eq!(status, 200, "{doc}");
    assert_eq!(doc["result"], "applied");
    assert_eq!(
        doc["changed"],
        serde_json::json!(["routes[0].mode", "routes[0].upstream_timeout"])
    );
    // The same file again: applied, nothing changed.
    let (status, _, doc) = post_reload(&gate, Some(TOKEN)).await;
    assert_eq!((status, &doc["changed"]), (200, &serde_json::json!([])));
    // Observing now: a retry is forwarded again.
    let c = client();
    let url = gate.url("/v1/transfers");
    post_url(&c, &url, Some("k"), "{}", &[]).await;
    let retry = post_url(&c, &url, Some("k"), "{}", &[]).await;
    assert!(!retry.replayed());
    assert_eq!(up.hits(), 2);
    assert!(!gate.log().contains(TOKEN), "the token is never logged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_in_flight_finishes_under_the_config_it_started_with() {
    let up = Upstream::start().await;
    let file = File::new(OBSERVING.replace("observe", "enforce").as_str());
    let gate = gate(&up, &file.path, &[]);
    let c = client();
    let url = gate.url("/v1/transfers");
    // Started under upstream_timeout = 10 s; answered after 1.2 s.
    let (c2, url2) = (c.clone(), url.clone());
    let slow = tokio::spawn(async move {
        post_url(&c2, &url2, Some("slow"), "{}", &[(DELAY_MS, "1200")]).await
    });
    upstream_reached(&up, 1).await;
    // Now 300 ms for new requests.
    file.write(ENFORCING);
    hangup(&gate, "applied").await;
    let slow = slow.await.unwrap();
    assert_eq!(slow.status, 201, "{:?}", slow.body);
    let late = post_url(&c, &url, Some("late"), "{}", &[(DELAY_MS, "1200")]).await;
    assert_eq!(late.status, 504, "{:?}", late.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_applies_the_log_level() {
    let up = Upstream::start().await;
    let file = File::new(&format!("log_level = \"warn\"\n{ENFORCING}"));
    let gate = gate(&up, &file.path, &[]);
    let c = client();
    let url = gate.url("/v1/transfers");
    assert_eq!(post_url(&c, &url, Some("k1"), "{}", &[]).await.status, 201);
    // `log_level` wins over the RUST_LOG=info the binary runs with: no request lines.
    file.write(&format!("log_level = \"info\"\n{ENFORCING}"));
    hangup(&gate, "applied").await;
    assert!(!gate.log().contains("latency_ms="), "{}", gate.log());
    assert_eq!(post_url(&c, &url, Some("k2"), "{}", &[]).await.status, 201);
    eventually(Duration::from_secs(5), "the request's info line", || {
        gate.log().contains("latency_ms=")
    })
    .await;
    assert!(gate.log().contains("changed=log_level"), "{}", gate.log());
}
