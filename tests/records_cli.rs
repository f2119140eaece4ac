//! `idemgate records` against a running idemgate: an `unknown` record listed, shown, looked
//! up from its request's parts and completed with the answer an operator found (which its
//! retries then get replayed); releases refused while the owner works on it unless forced;
//! and the exit codes (1 not found, 2 refused, 64 usage, 69 unreachable, 77 unauthorized).

#![allow(clippy::unwrap_used)]

use crate::common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::topology::Cluster;
use common::*;
use serde_json::Value;

const TRANSFER: &str = r#"{"from":"acc-1","to":"acc-2","amount":1250}"#;
const ALICE: &str = "Bearer alice-token";

/// What one run of `idemgate records ARGS` did.
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("{e}: {}", self.stdout))
    }
}

impl std::fmt::Display for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit {}\n--- stdout ---\n{}--- stderr ---\n{}",
            self.code, self.stdout, self.stderr
        )
    }
}

/// Runs `idemgate records ARGS` with only `env` of the IDEMGATE_ variables.
fn records(args: &[&str], env: &[(&str, &str)]) -> Run {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idemgate"));
    cmd.arg("records").args(args);
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("IDEMGATE_")) {
        cmd.env_remove(k);
    }
    cmd.envs(env.iter().copied());
    let out = cmd.output().unwrap();
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// `records` in a blocking task, so that the test's upstream keeps being served.
async fn records_async(args: Vec<String>, env: Vec<(String, String)>) -> Run {
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        records(&args, &env)
    })
    .await
    .unwrap()
}

fn owned(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

fn admin_env(gate: &Gate) -> Vec<(String, String)> {
    vec![(
        "IDEMGATE_ADMIN_URL".to_string(),
        format!("http://{}", gate.admin),
    )]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_record_is_listed_shown_found_and_completed_then_replays() {
    let up = Upstream::start().await;
    let gate = Gate::start(
        &up.url(),
        "",
        &[
            ("IDEMGATE_DEFAULTS__UPSTREAM_TIMEOUT", "1s"),
            ("IDEMGATE_DEFAULTS__LEASE", "1s"),
            // Known to the CLI, not a setting: no warning for it. The other one is a typo.
            ("IDEMGATE_ADMIN_URL", "http://127.0.0.1:9901"),
            ("IDEMGATE_NOT_A_SETTING", "x"),
        ],
    );
    let env = admin_env(&gate);
    let c = client();
    let url = gate.url("/v1/transfers");
    let lost = post_url(
        &c,
        &url,
        Some("tr-1"),
        TRANSFER,
        &[("authorization", ALICE), (FAULT, "hang")],
    )
    .await;
    assert_eq!(lost.status, 504);
    let id = lost.json()["record_id"].as_str().unwrap().to_string();
    let done = post_url(
        &c,
        &url,
        Some("tr-2"),
        TRANSFER,
        &[("authorization", ALICE)],
    )
    .await;
    assert_eq!(done.status, 201);

    // The only unknown record, as a table and as the API's JSON.
    let table = records_async(owned(&["list", "--state", "unknown"]), env.clone()).await;
    assert_eq!(table.code, 0, "{table}");
    let lines: Vec<&str> = table.stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{table}");
    assert!(lines[0].starts_with("ID "), "{table}");
    assert!(
        lines[0].contains("STATE") && lines[0].contains("TTL"),
        "{table}"
    );
    assert!(lines[1].starts_with(&format!("{id}  unknown ")), "{table}");
    // Aligned: each header starts where its column does.
    let at = lines[0].find("STATE").unwrap();
    assert_eq!(&lines[1][at..at + 7], "unknown", "{table}");

    let listed = records_async(
        owned(&["list", "--state", "unknown", "--json"]),
        env.clone(),
    )
    .await;
    assert_eq!(listed.code, 0, "{listed}");
    let v = listed.json();
    let ids: Vec<&str> = v["records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec![id.as_str()], "{listed}");
    assert_eq!(v["records"][0]["state"], "unknown");
    let all = records_async(owned(&["list", "--json"]), env.clone()).await;
    assert_eq!(all.json()["records"].as_array().unwrap().len(), 2, "{all}");
    let one = records_async(owned(&["list", "--limit", "1", "--json"]), env.clone()).await;
    assert_eq!(one.json()["records"].as_array().unwrap().len(), 1, "{one}");

    // show ID.
    let shown = records_async(owned(&["show", &id]), env.clone()).await;
    assert_eq!(shown.code, 0, "{shown}");
    assert!(shown.stdout.contains("id "), "{shown}");
    assert!(shown.stdout.contains(&id), "{shown}");
    assert!(shown.stdout.contains("unknown"), "{shown}");
    let shown = records_async(owned(&["show", &id, "--json"]), env.clone()).await;
    assert_eq!(shown.json()["id"], id.as_str(), "{shown}");
    assert_eq!(shown.json()["state"], "unknown", "{shown}");

    // Found from what the client reports: its method, path, key and credential.
    let lookup = owned(&[
        "lookup",
        "--method",
        "POST",
        "--path",
        "/v1/transfers",
        "--key",
        "tr-1",
        "--header",
        &format!("Authorization: {ALICE}"),
    ]);
    let found = records_async(lookup.clone(), env.clone()).await;
    assert_eq!(found.code, 0, "{found}");
    assert!(found.stdout.contains(&id), "{found}");
    let mut as_json = lookup.clone();
    as_json.push("--json".into());
    let found = records_async(as_json, env.clone()).await;
    assert_eq!(found.json()["id"], id.as_str(), "{found}");
    assert_eq!(found.json()["state"], "unknown", "{found}");
    // Another tenant's key of the same name is another record, which does not exist.
    let mut other = lookup.clone();
    *other.last_mut().unwrap() = "Authorization: Bearer mallory".into();
    let missing = records_async(other, env.clone()).await;
    assert_eq!(missing.code, 1, "{missing}");
    assert!(!missing.stdout.contains(&id), "{missing}");

    // Completed with the answer the upstream's ledger shows; the retry gets it replayed.
    let dir = tempfile::tempdir().unwrap();
    let body_file = dir.path().join("answer.json");
    std::fs::write(&body_file, r#"{"id":"tr_123","status":"booked"}"#).unwrap();
    let complete = owned(&[
        "complete",
        &id,
        "--status",
        "201",
        "--body-file",
        body_file.to_str().unwrap(),
        "--header",
        "Content-Type: application/json",
        "--reason",
        "the upstream's ledger shows tr_123 booked",
    ]);
    let completed = records_async(complete.clone(), env.clone()).await;
    assert_eq!(completed.code, 0, "{completed}");
    assert!(completed.stdout.contains("completed"), "{completed}");
    let retry = post_url(
        &c,
        &url,
        Some("tr-1"),
        TRANSFER,
        &[("authorization", ALICE)],
    )
    .await;
    assert!(retry.replayed());
    assert_eq!(retry.status, 201);
    assert_eq!(retry.header("content-type"), Some("application/json"));
    assert_eq!(&retry.body[..], br#"{"id":"tr_123","status":"booked"}"#);
    assert_eq!(
        up.hits(),
        2,
        "the hung request and tr-2; the retry executed nothing"
    );

    // An answered record is never overwritten: refused.
    let again = records_async(complete, env.clone()).await;
    assert_eq!(again.code, 2, "{again}");
    assert!(again.stderr.contains("already holds an answer"), "{again}");
    let empty = records_async(owned(&["list", "--state", "unknown"]), env.clone()).await;
    assert_eq!(empty.code, 0, "{empty}");
    assert_eq!(empty.stdout.lines().count(), 1, "header only: {empty}");

    // A missing record.
    let nothing = "0".repeat(64);
    let missing = records_async(owned(&["show", &nothing]), env.clone()).await;
    assert_eq!(missing.code, 1, "{missing}");
    assert!(missing.stderr.contains("no such record"), "{missing}");
    let missing = records_async(
        owned(&["release", &nothing, "--reason", "test"]),
        env.clone(),
    )
    .await;
    assert_eq!(missing.code, 1, "{missing}");

    // IDEMGATE_ADMIN_URL is known; a variable that names nothing is still warned about.
    let log = gate.log();
    let warning = "environment variables with the IDEMGATE_ prefix that name no setting";
    let line = log
        .lines()
        .find(|l| l.contains(warning))
        .unwrap_or_else(|| panic!("no warning for IDEMGATE_NOT_A_SETTING:\n{log}"));
    assert!(line.contains("IDEMGATE_NOT_A_SETTING"), "{line}");
    assert!(!line.contains("ADMIN_URL"), "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releasing_an_in_progress_record_wants_force_and_the_token() {
    let up = Upstream::start().await;
    let gate = Gate::start(
        &up.url(),
        "",
        &[
            ("IDEMGATE_DEFAULTS__UPSTREAM_TIMEOUT", "30s"),
            ("IDEMGATE_ADMIN_TOKEN", "s3cret-admin-token-0123456789"),
            ("IDEMGATE_ADMIN_URL", "http://127.0.0.1:9901"),
        ],
    );
    let mut env = admin_env(&gate);
    env.push((
        "IDEMGATE_ADMIN_TOKEN".into(),
        "s3cret-admin-token-0123456789".into(),
    ));
    let c = client();
    let url = gate.url("/v1/transfers");
    let held = tokio::spawn({
        let c = c.clone();
        async move {
            post_url(
                &c,
                &url,
                Some("tr-9"),
                TRANSFER,
                &[("authorization", ALICE), (FAULT, "hang")],
            )
            .await
        }
    });
    // Held in progress by its owner, which waits for the upstream.
    let listed = retry_until(
        Duration::from_secs(10),
        async || {
            let list = owned(&["list", "--state", "in_progress", "--json"]);
            records_async(list, env.clone()).await
        },
        |r| {
            assert_eq!(r.code, 0, "{r}");
            r.json()["records"][0]["id"].is_string()
        },
    )
    .await;
    let id = listed.json()["records"][0]["id"]
        .as_str()
        .expect("never in progress")
        .to_string();

    // Without the token, or with another one: 77, nothing released.
    let no_token = admin_env(&gate);
    let r = records_async(
        owned(&["release", &id, "--force", "--reason", "owner gone"]),
        no_token.clone(),
    )
    .await;
    assert_eq!(r.code, 77, "{r}");
    let r = records_async(
        owned(&[
            "--token", "wrong", "release", &id, "--force", "--reason", "x",
        ]),
        no_token,
    )
    .await;
    assert_eq!(r.code, 77, "{r}");
    assert!(r.stderr.contains("token"), "{r}");

    let refused = records_async(owned(&["release", &id, "--reason", "test"]), env.clone()).await;
    assert_eq!(refused.code, 2, "{refused}");
    assert!(refused.stderr.contains("lease"), "{refused}");
    let still = records_async(owned(&["show", &id, "--json"]), env.clone()).await;
    assert_eq!(still.json()["state"], "in_progress", "{still}");

    let forced = records_async(
        owned(&["release", &id, "--force", "--reason", "owner gone"]),
        env.clone(),
    )
    .await;
    assert_eq!(forced.code, 0, "{forced}");
    assert!(forced.stdout.contains("released"), "{forced}");
    let gone = records_async(owned(&["show", &id]), env.clone()).await;
    assert_eq!(gone.code, 1, "{gone}");
    held.abort();

    // The token's own variable is known to the proxy too: no warning at all.
    assert!(!gate.log().contains("name no setting"), "{}", gate.log());
}

#[test]
fn nothing_listening_is_69_and_bad_usage_is_64() {
    let url = format!("http://127.0.0.1:{}", free_port());
    let r = records(&["--admin-url", &url, "list"], &[]);
    assert_eq!(r.code, 69, "{r}");
    assert!(r.stderr.contains("cannot reach the admin API"), "{r}");
    let r = records(&["show", &"a".repeat(64)], &[("IDEMGATE_ADMIN_URL", &url)]);
    assert_eq!(r.code, 69, "{r}");

    // A listener that never answers: 69 once --timeout has passed.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_url = format!("http://{}", silent.local_addr().unwrap());
    let started = Instant::now();
    let r = records(
        &["--admin-url", &silent_url, "--timeout", "300ms", "list"],
        &[],
    );
    assert_eq!(r.code, 69, "{r}");
    assert!(r.stderr.contains("did not answer within"), "{r}");
    assert!(started.elapsed() < common::HANG_GUARD);
    drop(silent);

    let id = "a".repeat(64);
    for args in [
        vec![],
        vec!["frobnicate"],
        vec!["show"],
        vec!["list", "--state", "lost"],
        vec!["complete", id.as_str()],
        vec!["complete", id.as_str(), "--status", "many"],
        vec!["complete", id.as_str(), "--status", "201"],
        vec!["release", id.as_str()],
        vec!["lookup", "--path", "/v1/transfers"],
        vec![
            "lookup", "--path", "/p", "--key", "k", "--header", "no colon",
        ],
        vec!["show", "not-an-id"],
        vec!["--admin-url", "https://127.0.0.1:9901", "list"],
    ] {
        let r = records(&args, &[("IDEMGATE_ADMIN_URL", &url)]);
        assert_eq!(r.code, 64, "{args:?}: {r}");
    }
    let r = records(
        &[
            "complete",
            &id,
            "--status",
            "201",
            "--body-file",
            "/nonexistent/f",
            "--reason",
            "test",
        ],
        &[("IDEMGATE_ADMIN_URL", &url)],
    );
    assert_eq!(r.code, 64, "{r}");
    let help = records(&["--help"], &[]);
    assert_eq!(help.code, 0, "{help}");
    assert!(help.stdout.contains("lookup"), "{help}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listing_on_a_cluster_says_why_it_cannot() {
    let cluster = Cluster::start();
    let up = Upstream::start().await;
    let nodes = format!("[\"{}\"]", cluster.addrs()[0]);
    let gate = Gate::start(
        &up.url(),
        "",
        &[("IDEMGATE_REDIS_CLUSTER_NODES", nodes.as_str())],
    );
    let env = admin_env(&gate);
    let r = records_async(owned(&["list", "--state", "unknown"]), env.clone()).await;
    assert_eq!(r.code, 69, "{r}");
    assert!(
        r.stderr
            .contains("listing records is not available on Redis Cluster"),
        "{r}"
    );
    // Records are still found one by one.
    let lookup = owned(&["lookup", "--path", "/v1/transfers", "--key", "nope"]);
    let r = records_async(lookup, env).await;
    assert_eq!(r.code, 1, "{r}");
}

/// With named operators: a role that does not allow a release is exit 78 naming the role, a
/// reason the admin API refuses is 64 naming `reason-required`; the refused attempt is in
/// the audit log under the operator's name, and nothing was released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_refusal_of_the_admin_api_has_its_exit_code() {
    use sha2::Digest;
    let (reader, decider) = ("reader-token-0123456789", "decider-token-0123456789");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("idemgate.toml");
    let mut toml = String::new();
    for (name, token, role) in [("rita", reader, "read"), ("dan", decider, "decide")] {
        toml.push_str(&format!(
            "[[admin_operators]]\nname = \"{name}\"\ntoken_sha256 = \"{}\"\nrole = \"{role}\"\n",
            hex::encode(sha2::Sha256::digest(token.as_bytes()))
        ));
    }
    std::fs::write(&file, toml).unwrap();
    let up = Upstream::start().await;
    let gate = Gate::start(
        &up.url(),
        "",
        &[
            ("IDEMGATE_CONFIG", file.to_str().unwrap()),
            ("IDEMGATE_DEFAULTS__UPSTREAM_TIMEOUT", "300ms"),
        ],
    );
    let c = client();
    let lost = post_url(
        &c,
        &gate.url("/v1/transfers"),
        Some("x-1"),
        TRANSFER,
        &[(FAULT, "hang")],
    )
    .await;
    assert_eq!(lost.status, 504);
    let id = lost.json()["record_id"].as_str().unwrap().to_string();
    let with = |token: &str| {
        let mut env = admin_env(&gate);
        env.push(("IDEMGATE_ADMIN_TOKEN".into(), token.into()));
        env
    };
    let r = records_async(
        owned(&["release", &id, "--reason", "not run"]),
        with(reader),
    )
    .await;
    assert_eq!(r.code, 78, "{r}");
    assert!(
        r.stderr.contains("role-forbidden") && r.stderr.contains("`read`"),
        "{r}"
    );
    let r = records_async(
        owned(&["release", &id, "--reason", "bell\u{7}"]),
        with(decider),
    )
    .await;
    assert_eq!(r.code, 64, "{r}");
    assert!(r.stderr.contains("reason-required"), "{r}");
    let shown = records_async(owned(&["show", &id, "--json"]), with(reader)).await;
    assert_eq!(shown.json()["state"], "unknown", "{shown}");
    assert!(
        gate.log().lines().any(|l| l.contains("idemgate::audit")
            && l.contains("actor=rita")
            && l.contains("result=\"refused\"")
            && l.contains("reason=\"not run\"")),
        "{}",
        gate.log()
    );
}
