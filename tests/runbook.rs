//! The runbook's record commands, run as written (each block marked `<!-- runbook-test:
//! NAME -->` in docs/runbook.md, by `sh`) against an idemgate on a real redis-server: the
//! open `unknown` records listed and shown, one released (its retry then executes), one
//! completed (its retries replay the operator's answer). A completed record is not
//! released by the same command: it says that the next retry would execute again, and only
//! `--completed` releases it.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;

const TRANSFER: &str = r#"{"from":"acc-1","to":"acc-2","amount":1250}"#;
const ALICE: &str = "Bearer alice-token";
const TOKEN: &str = "runbook-admin-token-0123456789";

/// The shell block that follows `<!-- runbook-test: NAME -->` in docs/runbook.md, without
/// its indentation.
fn block(name: &str) -> String {
    let runbook =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/runbook.md"))
            .unwrap();
    let marker = format!("<!-- runbook-test: {name} -->");
    let at = runbook
        .find(&marker)
        .unwrap_or_else(|| panic!("docs/runbook.md has no {marker}"));
    let rest = &runbook[at + marker.len()..];
    let open = rest.find("```sh\n").expect("a sh block after the marker") + "```sh\n".len();
    let close = rest[open..].find("```").expect("the block's end");
    rest[open..open + close]
        .lines()
        .map(str::trim_start)
        .collect::<Vec<_>>()
        .join("\n")
}

/// What one block did.
struct Ran {
    code: i32,
    stdout: String,
    stderr: String,
}

impl std::fmt::Display for Ran {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit {}\n--- stdout ---\n{}--- stderr ---\n{}",
            self.code, self.stdout, self.stderr
        )
    }
}

/// Runs `script` with `sh -e` in `dir`, `idemgate` on the PATH, `ADMIN`, `TOKEN` and `ID`
/// set as the runbook's preamble sets them.
async fn run(script: String, dir: &Path, admin: String, id: &str) -> Ran {
    let dir = dir.to_path_buf();
    let id = id.to_string();
    tokio::task::spawn_blocking(move || {
        let bin = Path::new(env!("CARGO_BIN_EXE_idemgate")).parent().unwrap();
        let path = format!(
            "{}:{}",
            bin.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let mut cmd = Command::new("sh");
        cmd.arg("-e").arg("-c").arg(&script).current_dir(&dir);
        for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("IDEMGATE_")) {
            cmd.env_remove(k);
        }
        let out = cmd
            .env("PATH", path)
            .env("ADMIN", admin)
            .env("TOKEN", TOKEN)
            .env("ID", id)
            .output()
            .unwrap();
        Ran {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    })
    .await
    .unwrap()
}

/// A request whose upstream never answers in time: its record is left `unknown`. Waits
/// until its owner is done with it (no `owner_busy_ms`), as the runbook says to.
async fn unknown_record(c: &reqwest::Client, gate: &Gate, key: &str) -> String {
    let lost = post_url(
        c,
        &gate.url("/v1/transfers"),
        Some(key),
        TRANSFER,
        &[("authorization", ALICE), (FAULT, "hang")],
    )
    .await;
    assert_eq!(lost.status, 504);
    let id = lost.json()["record_id"].as_str().unwrap().to_string();
    let record = gate.admin_url(&format!("/records/{id}"));
    let v: serde_json::Value = retry_until(
        Duration::from_secs(15),
        async || {
            let r = c.get(&record).bearer_auth(TOKEN).send().await.unwrap();
            r.json().await.unwrap()
        },
        |v: &serde_json::Value| {
            assert_eq!(v["state"], "unknown", "{v}");
            v.get("owner_busy_ms").is_none()
        },
    )
    .await;
    assert!(
        v.get("owner_busy_ms").is_none(),
        "its owner stays busy: {v}"
    );
    id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runbooks_record_commands_work_as_written_on_redis() {
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url())
        .redis(&redis)
        .set(|c| {
            c.defaults.upstream_timeout = Duration::from_secs(1);
            c.defaults.lease = Duration::from_secs(1);
            c.admin_token = Some(TOKEN.into());
        })
        .binary();
    let admin = format!("http://{}", gate.admin);
    let dir = tempfile::tempdir().unwrap();
    let c = client();
    let not_run = unknown_record(&c, &gate, "tr-not-run").await;
    let ran = unknown_record(&c, &gate, "tr-ran").await;
    // The upstream saw both (and answered neither in time).
    let seen = up.hits();

    // Check: both open records are listed (by the CLI and by curl), and each is shown.
    let listed = run(block("list"), dir.path(), admin.clone(), "").await;
    assert_eq!(listed.code, 0, "{listed}");
    for id in [&not_run, &ran] {
        assert_eq!(
            listed.stdout.matches(id.as_str()).count(),
            2,
            "table and JSON: {listed}"
        );
    }
    let shown = run(block("show"), dir.path(), admin.clone(), &ran).await;
    assert_eq!(shown.code, 0, "{shown}");
    assert!(shown.stdout.contains(&ran), "{shown}");
    assert!(shown.stdout.contains("unknown"), "{shown}");

    // It did not execute: released, and its retry executes.
    let released = run(block("release"), dir.path(), admin.clone(), &not_run).await;
    assert_eq!(released.code, 0, "{released}");
    assert!(released.stdout.contains("released"), "{released}");
    let retry = post_url(
        &c,
        &gate.url("/v1/transfers"),
        Some("tr-not-run"),
        TRANSFER,
        &[("authorization", ALICE)],
    )
    .await;
    assert_eq!(retry.status, 201);
    assert!(!retry.replayed());
    assert_eq!(up.hits(), seen + 1);

    // It did execute: completed with the upstream's answer, which its retries replay.
    let completed = run(block("complete"), dir.path(), admin.clone(), &ran).await;
    assert_eq!(completed.code, 0, "{completed}");
    let replay = |c: reqwest::Client, url: String| async move {
        post_url(
            &c,
            &url,
            Some("tr-ran"),
            TRANSFER,
            &[("authorization", ALICE)],
        )
        .await
    };
    let url = gate.url("/v1/transfers");
    let retry = replay(c.clone(), url.clone()).await;
    assert!(retry.replayed());
    assert_eq!(retry.status, 201);
    assert_eq!(retry.header("content-type"), Some("application/json"));
    assert_eq!(&retry.body[..], br#"{"id": "tr_123"}"#);
    assert_eq!(up.hits(), seen + 1, "the retry executed nothing");

    // The release block run on the completed record by mistake: refused (exit 2), saying
    // what a retry would do and which flag overrides it; the answer still replays.
    let mistaken = run(block("release"), dir.path(), admin.clone(), &ran).await;
    assert_eq!(mistaken.code, 2, "{mistaken}");
    assert!(
        mistaken.stderr.contains("completed")
            && mistaken.stderr.contains("executes the request again")
            && mistaken.stderr.contains("--completed"),
        "{mistaken}"
    );
    let retry = replay(c.clone(), url.clone()).await;
    assert!(retry.replayed());
    assert_eq!(up.hits(), seen + 1);
    // The admin API alike: DELETE without ?completed=true is a 409 naming the state.
    let refused = c
        .delete(gate.admin_url(&format!("/records/{ran}?force=true&reason=test")))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 409);
    let refused: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(refused["state"], "completed", "{refused}");
    assert!(refused["error"]
        .as_str()
        .unwrap()
        .contains("?completed=true"));

    // Only with --completed, and it says that the next retry executes again.
    let script = format!("{} --completed", block("release").trim_end());
    let forced = run(script, dir.path(), admin.clone(), &ran).await;
    assert_eq!(forced.code, 0, "{forced}");
    assert!(
        forced.stdout.contains("was completed")
            && forced.stdout.contains("executes the request again")
            && forced.stdout.contains("201"),
        "{forced}"
    );
    let retry = replay(c.clone(), url).await;
    assert!(!retry.replayed());
    assert_eq!(
        up.hits(),
        seen + 2,
        "released on purpose: the retry executed"
    );
    let log = gate.log();
    assert!(
        log.lines().any(|l| l.contains("idemgate::audit")
            && l.contains("action=\"release\"")
            && l.contains("before=\"completed\"")
            && l.contains("actor=admin")
            && l.contains("reason=\"upstream ledger: no transfer for this key\"")),
        "{log}"
    );
}
