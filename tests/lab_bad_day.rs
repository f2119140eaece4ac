//! `idemgate lab --bad-day` through the binary: the day with its incidents and the
//! operator's pass keeps the promise on the embedded store and on Redis (two instances, one
//! killed), and its verdict fails when a guarantee is broken on purpose.
//!
//! Crates: `serde_json` reads `--json`; `tempfile` (through `common`) for redis-server.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::process::{Command, Output};

use common::RedisServer;

/// A smaller day than the default, so each test takes seconds.
const INTENTS: &str = "400";

/// One bad day at a time: the storm's goodput is measured against the stretch before it,
/// and two days on two cores at once would measure each other.
static ONE_DAY: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn bad_day(extra: &[&str], env: &[(&str, &str)]) -> (Output, serde_json::Value) {
    let _alone = ONE_DAY.lock().unwrap_or_else(|e| e.into_inner());
    let out = Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(["lab", "--bad-day", "--json", "--intents", INTENTS])
        .args(extra)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let json = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "--json: {e}\nstdout: {}\nstderr: {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out, json)
}

/// The verdict's figures, and that the incidents really happened in idemgate's run.
fn assert_kept(out: &Output, day: &serde_json::Value, kill: bool) {
    let through = &day["idemgate"];
    assert!(day["direct"]["double transfers"].as_u64().unwrap() > 0);
    assert_eq!(through["double transfers"], 0, "{day:#}");
    assert_eq!(through["balance mismatches"], 0, "{day:#}");
    assert_eq!(through["corrections replayed"], 0, "{day:#}");
    assert_eq!(through["stranded"], 0, "{day:#}");
    assert_eq!(through["unresolved after the pass"], 0, "{day:#}");
    // The storm keeps the bank's pace: its goodput ratio decides the verdict with the
    // figures above, and the day passes.
    let storm = through["storm goodput ratio"].as_f64().unwrap();
    assert!(storm >= 0.9, "{day:#}");
    assert_eq!(day["passed"], true, "{day:#}");
    assert!(out.status.success(), "{day:#}");
    assert_eq!(day["direct"]["storm goodput ratio"], "-", "{day:#}");
    assert!(day["summary"]
        .as_str()
        .unwrap()
        .contains(&format!("storm_goodput={storm:.2}x")));
    // Every incident happened, in both runs where it applies.
    for run in [&day["direct"], through] {
        assert!(
            run["bank crashes"].as_str().unwrap().starts_with("3 at"),
            "{day:#}"
        );
        assert!(run["bank restarts (graceful)"]
            .as_str()
            .unwrap()
            .starts_with("2 at"));
    }
    assert!(through["store frozen 2 s"]
        .as_str()
        .unwrap()
        .starts_with("1 at"));
    assert_eq!(
        through["idemgate instance killed"]
            .as_str()
            .unwrap()
            .starts_with("1 at"),
        kill,
        "{day:#}"
    );
    // The crashes left requests executed and unanswered: the pass had work, and settled it.
    let held = through["held unknown before pass"].as_u64().unwrap();
    assert!(held > 0, "{day:#}");
    assert_eq!(
        through["completed by the pass"].as_u64().unwrap()
            + through["released by the pass"].as_u64().unwrap(),
        held,
        "{day:#}"
    );
    assert!(day["summary"]
        .as_str()
        .unwrap()
        .contains("stranded=0 unresolved_after_pass=0"));
}

#[test]
fn the_bad_day_keeps_the_promise_on_the_embedded_store() {
    let (out, day) = bad_day(&[], &[]);
    assert_kept(&out, &day, false);
    assert_eq!(
        day["not_injected"][0]["incident"], "instance_kill",
        "{day:#}"
    );
}

#[test]
fn the_bad_day_keeps_the_promise_on_redis_with_an_instance_killed() {
    let redis = RedisServer::start();
    let (out, day) = bad_day(&["--redis-url", &redis.url()], &[]);
    assert_kept(&out, &day, true);
    // A Redis the lab did not start is frozen in its relay, never restarted.
    assert_eq!(day["idemgate"]["store restarted (AOF)"], "-", "{day:#}");
    assert_eq!(day["not_injected"][0]["incident"], "store_restart");
    assert_eq!(day["idemgate"]["label"], "idemgate (redis, 2 instances)");
    // The lab deleted the records it made: no key holds a record's state any more (the
    // scope secret stays, as for any instance, and the withdrawal notes of claims that
    // timed out in the freeze expire on their own).
    let records = redis
        .command(&[
            "EVAL",
            "local n = 0 for _, k in ipairs(redis.call('KEYS', 'idemgate:{*')) do \
             if redis.call('HEXISTS', k, 'st') == 1 then n = n + 1 end end return n",
            "0",
        ])
        .unwrap();
    assert!(records.starts_with(":0\r"), "records left: {records}");
}

/// On a redis-server the lab starts itself with persistence on, the store is restarted
/// during the day (records kept) and frozen with SIGSTOP, and the promise holds.
#[test]
fn the_bad_day_keeps_the_promise_through_a_restart_of_its_own_redis_server() {
    let on_path = Command::new("redis-server")
        .arg("--version")
        .output()
        .is_ok();
    if !on_path {
        eprintln!("skipped: redis-server is not on PATH (apt-get install redis-server)");
        return;
    }
    let (out, day) = bad_day(&["--redis-server"], &[]);
    assert_kept(&out, &day, true);
    assert_eq!(
        day["idemgate"]["label"],
        "idemgate (redis-server, AOF, 2 instances)"
    );
    assert!(
        day["idemgate"]["store restarted (AOF)"]
            .as_str()
            .unwrap()
            .starts_with("1 at"),
        "{day:#}"
    );
    assert_eq!(day["direct"]["store restarted (AOF)"], "-", "{day:#}");
    assert_eq!(day["not_injected"], serde_json::json!([]), "{day:#}");
}

/// Without the operator's pass (a debug build's test hook skips it), the records the
/// crashes left `unknown` are never settled: their clients' last retries are refused, and
/// the verdict fails naming the figure.
#[test]
fn the_verdict_fails_when_nobody_reconciles() {
    let (out, day) = bad_day(&[], &[("TEST_IDEMGATE_LAB_SKIP_PASS", "1")]);
    assert_eq!(out.status.code(), Some(1), "{day:#}");
    assert_eq!(day["passed"], false);
    let unresolved = day["idemgate"]["unresolved after the pass"]
        .as_u64()
        .unwrap();
    assert!(unresolved > 0, "{day:#}");
    let summary = day["summary"].as_str().unwrap();
    assert!(
        summary.contains(&format!("unresolved_after_pass={unresolved}"))
            && summary.ends_with("FAILED"),
        "{summary}"
    );
}

#[test]
fn options_the_bad_day_does_not_take_are_refused() {
    for extra in [&["--tls"][..], &["--mode", "observe"][..]] {
        let out = Command::new(env!("CARGO_BIN_EXE_idemgate"))
            .args(["lab", "--bad-day"])
            .args(extra)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(64), "{extra:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("--bad-day"));
    }
}
