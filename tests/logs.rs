//! The real binary's logs: one JSON line per protected request with its outcome, and never a
//! body, an `Authorization` value, a key or the admin token, at `info` or at `debug`. Also
//! `idemgate probe`, the container health check.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

const BODY_MARKER: &str = "zebra-quartz-body-7731";
const SECRET: &str = "sk_live_hush_5f0e9c2d";
const KEY: &str = "key-marker-4417";
// Digits only: the environment provider would have read it as a number.
const ADMIN_TOKEN: &str = "73194628501736492850";

struct Binary {
    child: std::process::Child,
    addr: SocketAddr,
    admin: SocketAddr,
    log: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Binary {
    fn start(upstream: &str, rust_log: &str) -> Binary {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("stderr.log");
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_idemgate"))
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("RUST_LOG", rust_log)
            .env("IDEMGATE_LOG_FORMAT", "json")
            .env("IDEMGATE_LISTEN", addr.to_string())
            .env("IDEMGATE_ADMIN_LISTEN", admin.to_string())
            .env("IDEMGATE_UPSTREAM", upstream)
            .env("IDEMGATE_ADMIN_TOKEN", ADMIN_TOKEN)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(dir.path().join("stdout.log")).unwrap())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let b = Binary {
            child,
            addr,
            admin,
            log,
            _dir: dir,
        };
        assert!(
            common::held_within(Duration::from_secs(15), || started(admin)),
            "idemgate did not start:\n{}",
            b.output()
        );
        b
    }

    fn output(&self) -> String {
        let mut all = std::fs::read_to_string(&self.log).unwrap_or_default();
        all.push_str(&std::fs::read_to_string(self.log.with_file_name("stdout.log")).unwrap());
        all
    }

    /// SIGTERM, wait, and return everything it wrote.
    fn stop(mut self) -> String {
        signal(self.child.id(), "TERM");
        assert!(
            common::exit_within(&mut self.child, Duration::from_secs(10)).is_some(),
            "no exit after SIGTERM"
        );
        self.output()
    }
}

impl Drop for Binary {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn probe(url: &str, token: Option<&str>) -> std::process::Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idemgate"));
    cmd.env_clear().args(["probe", url]);
    if let Some(t) = token {
        cmd.env("IDEMGATE_ADMIN_TOKEN", t);
    }
    cmd.output().unwrap()
}

async fn traffic(b: &Binary) {
    let c = client();
    let url = format!("http://{}/v1/transfers", b.addr);
    let body = format!(r#"{{"amount":1250,"memo":"{BODY_MARKER}"}}"#);
    let auth = format!("Bearer {SECRET}");
    let headers = [("authorization", auth.as_str())];
    // The upstream takes a known time over the first request, so its logged latency can be
    // checked against something.
    let slow = [
        ("authorization", auth.as_str()),
        (DELAY_MS, "60"),
        ("x-request-id", "rid-first"),
    ];
    let first = post_url(&c, &url, Some(KEY), &body, &slow).await;
    assert_eq!(first.status, 201);
    let replay = post_url(&c, &url, Some(KEY), &body, &headers).await;
    assert!(replay.replayed());
    let other = body.replace("1250", "99");
    assert_eq!(
        post_url(&c, &url, Some(KEY), &other, &headers).await.status,
        422
    );
    let get = c
        .get(format!("http://{}/v1/accounts/{BODY_MARKER}", b.addr))
        .header("authorization", &auth)
        .send()
        .await
        .unwrap();
    assert_eq!(get.status(), 201);
    // The admin token comes verbatim from the environment, digits and all.
    let metrics = c
        .get(format!("http://{}/metrics", b.admin))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(metrics.status(), 200);
}

fn request_lines(out: &str) -> Vec<serde_json::Value> {
    out.lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}"))
        })
        .filter(|v| v["message"] == "request")
        .collect()
}

fn assert_nothing_secret(out: &str) {
    for (what, s) in [
        ("a request body", BODY_MARKER),
        ("an Authorization value", SECRET),
        ("a raw key", KEY),
        ("the admin token", ADMIN_TOKEN),
    ] {
        assert!(!out.contains(s), "the output holds {what}:\n{out}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_lines_per_request_and_nothing_secret_at_info() {
    let up = Upstream::start().await;
    let b = Binary::start(&up.url(), "info");
    traffic(&b).await;
    let out = b.stop();
    let lines = request_lines(&out);
    let outcomes: Vec<&str> = lines
        .iter()
        .map(|l| l["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(outcomes, ["forwarded", "replayed", "mismatch"], "{out}");
    let fwd = &lines[0];
    assert_eq!(fwd["level"], "INFO");
    assert_eq!(fwd["method"], "POST");
    // Named as the metrics name it (`route="default"`).
    assert_eq!(fwd["route"], "default");
    assert_eq!(fwd["status"], 201);
    assert_eq!(fwd["record"].as_str().unwrap().len(), 64, "{fwd}");
    assert_eq!(fwd["request_id"], "rid-first", "{fwd}");
    assert_eq!(lines[1]["request_id"].as_str().unwrap().len(), 32);
    // Rounded to the microsecond: no binary-fraction noise such as 3.8241400000000003.
    for field in ["upstream_ms", "latency_ms"] {
        let ms = fwd[field].as_f64().unwrap();
        assert_eq!((ms * 1000.0).round() / 1000.0, ms, "{field}: {fwd}");
        let text = fwd[field].to_string();
        assert!(
            text.split('.').nth(1).is_none_or(|f| f.len() <= 3),
            "{field}: {text}"
        );
    }
    assert!(fwd["upstream_ms"].as_f64().unwrap() >= 60.0, "{fwd}");
    assert!(fwd["latency_ms"].as_f64().unwrap() >= fwd["upstream_ms"].as_f64().unwrap());
    assert_eq!(lines[1]["record"], fwd["record"]);
    assert!(
        lines[1].get("upstream_ms").is_none(),
        "a replay never calls the upstream"
    );
    assert_eq!(lines[2]["status"], 422);
    assert_nothing_secret(&out);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debug_logs_hold_nothing_secret_either() {
    let up = Upstream::start().await;
    let b = Binary::start(&up.url(), "debug");
    traffic(&b).await;
    let out = b.stop();
    let lines = request_lines(&out);
    let pass = lines
        .iter()
        .find(|l| l["outcome"] == "passthrough")
        .unwrap_or_else(|| panic!("pass-through is logged at debug:\n{out}"));
    assert_eq!(pass["level"], "DEBUG");
    assert_eq!(pass["method"], "GET");
    assert!(pass["upstream_ms"].is_number());
    assert_eq!(lines.len(), 4, "{out}");
    assert_nothing_secret(&out);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_exits_zero_only_on_2xx() {
    let up = Upstream::start().await;
    let b = Binary::start(&up.url(), "warn");
    let healthz = format!("http://{}/healthz", b.admin);
    let readyz = format!("http://{}/readyz", b.admin);
    let metrics = format!("http://{}/metrics", b.admin);
    assert!(probe(&healthz, None).status.success());
    assert!(probe(&readyz, None).status.success());
    let denied = probe(&metrics, None);
    assert_eq!(denied.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&denied.stderr).contains("401"));
    assert!(probe(&metrics, Some(ADMIN_TOKEN)).status.success());
    let nobody = format!("http://127.0.0.1:{}/healthz", free_port());
    assert_eq!(probe(&nobody, None).status.code(), Some(1));
    assert_eq!(probe("https://x/healthz", None).status.code(), Some(1));
    let out = b.stop();
    assert_nothing_secret(&out);
}
