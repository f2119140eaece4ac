//! The persistent embedded store (`store_path`) with the real `idemgate` binary: records
//! survive a SIGKILL of the process and a restart on the same directory.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::*;

const TRANSFER: &str = r#"{"from":"acc-1","to":"acc-2","amount":1250,"currency":"EUR"}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_survive_sigkill_and_restart() {
    let store = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    let gate = || {
        Idemgate::new(&up.url())
            .on_disk(store.path())
            .set(|c| c.defaults.lease = Duration::from_millis(600))
            .binary()
    };
    let c = client();

    let mut first_gate = gate();
    let url = first_gate.url("/v1/transfers");
    // A completed request...
    let done = post_url(&c, &url, Some("k-done"), TRANSFER, &[]).await;
    assert_eq!(done.status, 201);
    assert!(!done.replayed());
    // ...and one that the upstream accepted, whose answer the process never records.
    let inflight = {
        let (c, url) = (c.clone(), url.clone());
        tokio::spawn(async move {
            c.post(url)
                .header("content-type", "application/json")
                .header("idempotency-key", "k-killed")
                .header(DELAY_MS, "60000")
                .body(TRANSFER)
                .send()
                .await
        })
    };
    eventually(Duration::from_secs(5), "upstream reached", || {
        up.hits() == 2
    })
    .await;
    first_gate.kill();
    assert!(
        inflight.await.unwrap().is_err(),
        "the client lost its answer"
    );

    let gate = gate();
    let url = gate.url("/v1/transfers");
    // The completed answer replays byte for byte from disk.
    let replay = post_url(&c, &url, Some("k-done"), TRANSFER, &[]).await;
    assert_eq!(replay.status, 201);
    assert!(replay.replayed());
    assert_eq!(replay.body, done.body);
    // The request in flight at the kill is never executed again: in progress until the dead
    // process's lease runs out, then unknown.
    let busy = |r: &Answer| r.status == 409 && r.problem_type().ends_with("/in-progress");
    let r = retry_until(
        Duration::from_secs(10),
        async || post_url(&c, &url, Some("k-killed"), TRANSFER, &[]).await,
        |r| !busy(r),
    )
    .await;
    assert!(!busy(&r), "still in progress after 10 s");
    assert_eq!(r.status, 409, "{:?}", r.body);
    assert!(
        r.problem_type().ends_with("/outcome-unknown"),
        "{:?}",
        r.body
    );
    assert_eq!(up.hits(), 2);
    // A key never seen before still executes once.
    let fresh = post_url(&c, &url, Some("k-fresh"), TRANSFER, &[]).await;
    assert_eq!(fresh.status, 201);
    assert!(!fresh.replayed());
    assert_eq!(up.hits(), 3);
    assert!(gate.log().contains("persistent embedded store"));
}

/// A fresh directory starts empty: the replay above comes from the directory reopened, not
/// from anything else remembering the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_store_directory_starts_empty() {
    let up = Upstream::start().await;
    let c = client();
    let a = tempfile::tempdir().unwrap();
    let mut gate = Idemgate::new(&up.url()).on_disk(a.path()).binary();
    let first = post_url(&c, &gate.url("/v1/t"), Some("k"), TRANSFER, &[]).await;
    assert_eq!(first.status, 201);
    gate.kill();
    let b = tempfile::tempdir().unwrap();
    let gate = Idemgate::new(&up.url()).on_disk(b.path()).binary();
    let again = post_url(&c, &gate.url("/v1/t"), Some("k"), TRANSFER, &[]).await;
    assert_eq!(again.status, 201);
    assert!(!again.replayed());
    assert_eq!(up.hits(), 2);
}

/// The wall clock of idemgate's host jumps 25 h ahead while it runs (an NTP step, a VM
/// restored from a snapshot), the monotonic clock untouched, through libfaketime. Answered
/// keys must still replay: before, retention ran on the wall clock and all 10 executed
/// again; and after a restart on the stepped clock too (the store's offset, written at the
/// step, starts the next opener's clock): before, all 10 expired at the restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wall_clock_jump_expires_nothing() {
    common::setup::tools();
    let lib = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";
    assert!(
        std::path::Path::new(lib).exists(),
        "libfaketime (apt-get install faketime) is needed to move the wall clock"
    );
    let store = tempfile::tempdir().unwrap();
    let offset = store.path().join("faketime");
    std::fs::write(&offset, "+0\n").unwrap();
    let offset_path = offset.to_str().unwrap().to_string();
    let up = Upstream::start().await;
    let faked = || {
        Idemgate::new(&up.url())
            .on_disk(&store.path().join("records"))
            .env("LD_PRELOAD", lib)
            .env("FAKETIME_TIMESTAMP_FILE", &offset_path)
            .env("FAKETIME_NO_CACHE", "1")
            .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
            .binary()
    };
    let mut gate = faked();
    let c = client();
    let url = gate.url("/v1/transfers");
    for i in 0..10 {
        let r = post_url(&c, &url, Some(&format!("jump-{i}")), TRANSFER, &[]).await;
        assert_eq!(r.status, 201, "{:?}", r.body);
    }
    std::fs::write(&offset, "+25h\n").unwrap();
    for i in 0..10 {
        let r = post_url(&c, &url, Some(&format!("jump-{i}")), TRANSFER, &[]).await;
        assert!(
            r.replayed(),
            "jump-{i} after the jump: {} {:?}",
            r.status,
            r.body
        );
    }
    assert_eq!(up.hits(), 10, "nothing executed again");
    // The jump did reach the process: its log lines after it carry the next day's date.
    let log = gate.log();
    let dates: std::collections::BTreeSet<&str> = log
        .lines()
        .filter_map(|l| l.get(..10))
        .filter(|d| d.starts_with("20"))
        .collect();
    assert!(
        dates.len() >= 2,
        "the wall clock did not move: {dates:?}\n{log}"
    );
    assert!(log.contains("wrote the store's offset"), "{log}");
    // A second process opened on the path meanwhile keeps the first one's records too.
    let mut second = faked();
    let other = second.url("/v1/transfers");
    for i in 0..10 {
        let r = post_url(&c, &other, Some(&format!("jump-{i}")), TRANSFER, &[]).await;
        assert!(
            r.replayed(),
            "jump-{i} on a second process: {} {:?}",
            r.status,
            r.body
        );
    }
    second.kill();
    // A restart on the stepped clock keeps every record.
    gate.kill();
    let gate = faked();
    let url = gate.url("/v1/transfers");
    for i in 0..10 {
        let r = post_url(&c, &url, Some(&format!("jump-{i}")), TRANSFER, &[]).await;
        assert!(
            r.replayed(),
            "jump-{i} after the restart: {} {:?}",
            r.status,
            r.body
        );
    }
    assert_eq!(up.hits(), 10, "nothing executed again after the restart");
}
