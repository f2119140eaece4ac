//! One store, one secret. Record ids are keyed by the store's scope secret, so instances that
//! hold different secrets execute one key once each. A Redis that forgets the secret
//! (restarted without persistence, flushed, an operator deleting it) must not split the
//! fleet: running instances put theirs back, a starting one waits for them, and an instance
//! that disagrees with the store refuses protected requests and reports unready. Operators
//! can pin the secret instead.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;

const BODY: &str = r#"{"amount":1250}"#;

/// Executions by idempotency key, from what the upstream saw.
fn executions(up: &Upstream) -> HashMap<String, usize> {
    let mut by_key: HashMap<String, usize> = HashMap::new();
    for s in up.seen() {
        if let Some(k) = s.headers.get("idempotency-key").and_then(|v| v.first()) {
            *by_key.entry(k.clone()).or_default() += 1;
        }
    }
    by_key
}

fn watching(up: &Upstream, redis: &RedisServer, create_delay: Duration) -> idemgate::Config {
    let mut c = redis_config(up, redis);
    c.scope_secret_check_interval = Duration::from_millis(500);
    c.scope_secret_create_delay = create_delay;
    c.redis_info_interval = Duration::from_millis(500);
    c
}

fn secret_in(redis: &RedisServer) -> Option<String> {
    let r = redis.command(&["GET", "idemgate:scope-secret"])?;
    r.lines().nth(1).map(str::to_string)
}

// The issue's own case: an instance runs, Redis restarts empty, a second instance starts.
// Before: the second made a new secret, and every key sent through both executed twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_restarted_empty_between_two_starts_does_not_split_the_fleet() {
    let mut redis = RedisServer::start();
    let up = Upstream::start().await;
    let a = spawn_app(watching(&up, &redis, Duration::from_secs(2))).await;
    let c = client();
    assert_eq!(
        post(&c, &a, "/pay", Some("before"), BODY, &[]).await.status,
        201
    );
    let secret = secret_in(&redis).expect("the secret is in Redis");

    redis.restart();
    assert_eq!(secret_in(&redis), None, "restarted without its data");
    let b = spawn_app(watching(&up, &redis, Duration::from_secs(2))).await;
    assert_eq!(
        secret_in(&redis).as_deref(),
        Some(secret.as_str()),
        "the running instance put its secret back before the new one made another"
    );

    // Keys first sent after the restart, each through both instances in turn.
    for i in 0..30 {
        let key = format!("after-{i}");
        let (first, second) = if i % 2 == 0 { (&a, &b) } else { (&b, &a) };
        let one = post(&c, first, "/pay", Some(&key), BODY, &[]).await;
        let two = post(&c, second, "/pay", Some(&key), BODY, &[]).await;
        assert_eq!(one.status, 201, "{:?}", one.body);
        assert!(
            two.replayed(),
            "{key} through the other instance: {:?}",
            two.body
        );
    }
    let twice: Vec<_> = executions(&up)
        .into_iter()
        .filter(|(k, n)| k.starts_with("after-") && *n > 1)
        .collect();
    assert!(twice.is_empty(), "executed more than once: {twice:?}");
    a.shutdown().await;
    b.shutdown().await;
}

// Another secret in the store than the instance's (it was lost, and something made a new
// one): the instance refuses protected requests, replays included, and is unready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_whose_secret_the_store_no_longer_holds_refuses_and_is_unready() {
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let a = spawn_app(watching(&up, &redis, Duration::from_secs(2))).await;
    let c = client();
    assert_eq!(
        post(&c, &a, "/pay", Some("k1"), BODY, &[]).await.status,
        201
    );
    let other = "ab".repeat(32);
    redis
        .command(&["SET", "idemgate:scope-secret", &other])
        .unwrap();
    let admin = a.admin_addr().unwrap();
    eventually(Duration::from_secs(5), "unready", || {
        http_get(admin, "/readyz").is_some_and(|r| r.starts_with("HTTP/1.1 503"))
    })
    .await;
    let replay = post(&c, &a, "/pay", Some("k1"), BODY, &[]).await;
    assert_eq!(replay.status, 503, "{:?}", replay.body);
    assert!(replay.problem_type().ends_with("/store-unavailable"));
    let new = post(&c, &a, "/pay", Some("k2"), BODY, &[]).await;
    assert_eq!(new.status, 503, "{:?}", new.body);
    assert_eq!(up.hits(), 1, "nothing forwarded after the disagreement");
    let metrics = http_get(admin, "/metrics").unwrap();
    assert!(
        metrics.contains("idemgate_scope_secret_agreed 0"),
        "{metrics}"
    );
    a.shutdown().await;
}

// The secret gone but the namespace's verifier kept (a Cluster shard restarted empty while
// the records lived elsewhere): start-up refuses to make a new secret, which would execute
// every surviving record's retries again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_secret_whose_verifier_remains_stops_start_up() {
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let a = spawn_app(watching(&up, &redis, Duration::from_secs(2))).await;
    a.shutdown().await;
    redis.command(&["DEL", "idemgate:scope-secret"]).unwrap();
    let err = match idemgate::start(watching(&up, &redis, Duration::ZERO)).await {
        Ok(_) => panic!("started with a new secret beside the old one's verifier"),
        Err(e) => e,
    };
    assert_eq!(err.exit_code(), 64);
    let msg = err.to_string();
    assert_eq!(secret_in(&redis), None, "no new secret was made");
    // It names the verifier as Redis holds it, and the command that deletes it: run
    // verbatim, start-up then goes on (with a new secret).
    assert!(msg.contains("idemgate:scope-verifier:test"), "{msg}");
    let command = quoted_command(&msg, "redis-cli");
    assert_eq!(
        command,
        format!(
            "redis-cli -h 127.0.0.1 -p {} DEL idemgate:scope-verifier:test",
            redis.port
        ),
        "{msg}"
    );
    run_shell(&command);
    let b = idemgate::start(watching(&up, &redis, Duration::ZERO))
        .await
        .unwrap_or_else(|e| panic!("after `{command}`: {e}"));
    assert!(secret_in(&redis).is_some(), "a new secret was made");
    b.shutdown().await;
}

/// The first `` `...` `` of `msg` that starts with `program`.
fn quoted_command(msg: &str, program: &str) -> String {
    msg.split('`')
        .skip(1)
        .step_by(2)
        .find(|c| c.starts_with(program))
        .unwrap_or_else(|| panic!("no `{program} ...` command in: {msg}"))
        .to_string()
}

fn run_shell(command: &str) {
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(command)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "`{command}`: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

// The same on the persistent embedded store: the verifier is a row of its meta table, and
// the message gives the sqlite3 command that deletes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sqlite_the_lost_secret_message_names_the_meta_row_and_its_command() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let on_disk = || {
        let mut c = config(&up, &Backend::memory());
        c.store_path = Some(dir.path().to_path_buf());
        c
    };
    let a = spawn_app(on_disk()).await;
    a.shutdown().await;
    let file = dir.path().join("idemgate.sqlite3");
    run_shell(&format!(
        "sqlite3 -cmd '.timeout 5000' {} \"DELETE FROM meta WHERE name = 'scope_secret'\"",
        file.display()
    ));
    let err = match idemgate::start(on_disk()).await {
        Ok(_) => panic!("started with a new secret beside the old one's verifier"),
        Err(e) => e,
    };
    assert_eq!(err.exit_code(), 64);
    let msg = err.to_string();
    assert!(msg.contains("'scope_verifier:default'"), "{msg}");
    let command = quoted_command(&msg, "sqlite3");
    run_shell(&command);
    let b = idemgate::start(on_disk())
        .await
        .unwrap_or_else(|e| panic!("after `{command}`: {e}"));
    b.shutdown().await;
}

// A pinned secret: the store keeps only the namespace's verifier; a second instance with
// another pinned secret on the same namespace does not start; the admin API shows the
// store's secret only behind the admin token, so an operator can pin it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_secret_is_checked_per_namespace_and_shown_only_behind_the_token() {
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let pinned = "0123456789abcdef".repeat(4);
    let token = "an-admin-token-of-some-length";
    let gate = Idemgate::new(&up.url())
        .redis(&redis)
        .set(|c| {
            c.scope_secret = Some(pinned.as_str().into());
            c.admin_token = Some(token.into());
        })
        .binary();
    let c = client();
    let r = post_url(&c, &gate.url("/pay"), Some("p1"), BODY, &[]).await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    assert_eq!(
        secret_in(&redis),
        None,
        "a pinned secret is not the store's to keep"
    );
    let shown = c
        .get(gate.admin_url("/scope-secret"))
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    assert_eq!(shown.status(), 200);
    let shown: serde_json::Value = shown.json().await.unwrap();
    assert_eq!(shown["scope_secret"], pinned.as_str());
    let refused = c.get(gate.admin_url("/scope-secret")).send().await.unwrap();
    assert_eq!(refused.status(), 401);

    let (mut cmd, _, _, _dir) = Gate::command(
        &up.url(),
        &redis.url(),
        &[("IDEMGATE_SCOPE_SECRET", &"fe".repeat(32))],
    );
    let out = cmd
        .stderr(std::process::Stdio::piped())
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    // The namespace's verifier is what disagrees; neither secret is printed.
    assert!(
        stderr.contains("idemgate:scope-verifier:test") || stderr.contains("scope_verifier:test"),
        "{stderr}"
    );
    assert!(
        !stderr.contains(&pinned) && !stderr.contains(&"fe".repeat(32)),
        "{stderr}"
    );
}
