//! The SQLite store's upkeep, through the binary: its write-ahead log is given back once a
//! long reader has gone, and `/readyz` says not ready while the file takes no writes,
//! ready again with the first write that lands.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::path::Path;
use std::time::Duration;

use common::*;

const TRANSFER: &str = r#"{"from":"acc-1","to":"acc-2","amount":1250,"currency":"EUR"}"#;

/// `journal_size_limit`, the bound the log must be back under.
const LIMIT: u64 = 4 * 1024 * 1024;

fn file(dir: &Path) -> std::path::PathBuf {
    dir.join("idemgate.sqlite3")
}

fn wal_bytes(dir: &Path) -> u64 {
    std::fs::metadata(dir.join("idemgate.sqlite3-wal")).map_or(0, |m| m.len())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_log_is_truncated_within_10_s_of_a_long_reader_closing() {
    let store = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url()).on_disk(store.path()).binary();
    let c = client();
    let url = gate.url("/v1/transfers");
    assert_eq!(
        post_url(&c, &url, Some("k-0"), TRANSFER, &[]).await.status,
        201
    );

    // A reader that holds its snapshot, as an operator's sqlite3 session or a backup does.
    let reader = rusqlite::Connection::open(file(store.path())).unwrap();
    reader.execute_batch("BEGIN").unwrap();
    let n: i64 = reader
        .query_row("SELECT count(*) FROM records", [], |r| r.get(0))
        .unwrap();
    assert_eq!(n, 1);
    // Meanwhile the file is written: 6 MiB beside idemgate's own records, and requests.
    let writer = rusqlite::Connection::open(file(store.path())).unwrap();
    writer.busy_timeout(Duration::from_secs(5)).unwrap();
    writer
        .execute_batch("CREATE TABLE filler (b BLOB)")
        .unwrap();
    for _ in 0..6 {
        writer
            .execute("INSERT INTO filler VALUES (randomblob(1048576))", [])
            .unwrap();
    }
    for i in 1..=5 {
        let r = post_url(&c, &url, Some(&format!("k-{i}")), TRANSFER, &[]).await;
        assert_eq!(r.status, 201);
    }
    drop(writer);
    // The checkpoints cannot reset the log past the reader's snapshot.
    eventually(
        Duration::from_secs(5),
        "the gauge sees the grown log",
        || gate.metric("idemgate_sqlite_wal_bytes") > LIMIT as f64,
    )
    .await;
    assert!(
        wal_bytes(store.path()) > LIMIT,
        "the log grew under the reader"
    );

    reader.execute_batch("COMMIT").unwrap();
    drop(reader);
    eventually(
        Duration::from_secs(10),
        "the log back under journal_size_limit",
        || wal_bytes(store.path()) <= LIMIT,
    )
    .await;
    eventually(Duration::from_secs(5), "the gauge sees it", || {
        gate.metric("idemgate_sqlite_wal_bytes") <= LIMIT as f64
    })
    .await;
    // Nothing was lost on the way.
    let again = post_url(&c, &url, Some("k-3"), TRANSFER, &[]).await;
    assert!(again.replayed());
    assert_eq!(up.hits(), 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_is_503_while_the_file_takes_no_writes_and_ready_with_the_first_that_lands() {
    let store = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url()).on_disk(store.path()).binary();
    let c = client();
    let url = gate.url("/v1/transfers");
    assert!(gate.ready());
    assert_eq!(gate.metric("idemgate_store_writable"), 1.0);

    // Another process holds the write lock beyond the store's busy timeout (5 s).
    let outside = rusqlite::Connection::open(file(store.path())).unwrap();
    outside.execute_batch("BEGIN IMMEDIATE").unwrap();
    let admin = gate.admin;
    let readyz = move || http_get(admin, "/readyz").unwrap_or_default();
    // (While a claim waits for the lock on the store's thread, /readyz may also say that
    // the store does not answer.)
    common::until(Duration::from_secs(12), "/readyz says why", async || {
        let said = tokio::task::block_in_place(readyz);
        said.starts_with("HTTP/1.1 503") && said.contains("the sqlite store takes no writes")
    })
    .await;
    assert_eq!(gate.metric("idemgate_store_writable"), 0.0);
    let refused = post_url(&c, &url, Some("k-locked"), TRANSFER, &[]).await;
    assert_eq!(refused.status, 503, "{:?}", refused.body);
    assert_eq!(up.hits(), 0, "nothing forwarded unprotected");

    // The lock let go: ready again with the next background write, and the key runs once.
    outside.execute_batch("COMMIT").unwrap();
    drop(outside);
    eventually(Duration::from_secs(10), "ready again", || gate.ready()).await;
    assert_eq!(gate.metric("idemgate_store_writable"), 1.0);
    let r = common::retry_until(
        Duration::from_secs(10),
        async || post_url(&c, &url, Some("k-locked"), TRANSFER, &[]).await,
        |r| r.status != 503,
    )
    .await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    assert_eq!(up.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_deleted_or_replaced_under_the_instance_refuses_protected_requests() {
    let up = Upstream::start().await;
    let c = client();
    for replace in [false, true] {
        let store = tempfile::tempdir().unwrap();
        let gate = Idemgate::new(&up.url())
            .on_disk(store.path())
            .set(|c| c.scope_secret_check_interval = Duration::from_millis(200))
            .binary();
        let url = gate.url("/v1/transfers");
        let before = up.hits();
        let r = post_url(&c, &url, Some("k-1"), TRANSFER, &[]).await;
        assert_eq!(r.status, 201);
        let path = file(store.path());
        if replace {
            // A copy moved over the path: the same bytes, another inode.
            let copy = store.path().join("copy");
            std::fs::copy(&path, &copy).unwrap();
            std::fs::rename(&copy, &path).unwrap();
        } else {
            std::fs::remove_file(&path).unwrap();
        }
        eventually(Duration::from_secs(5), "unready", || !gate.ready()).await;
        let admin = gate.admin;
        let said = tokio::task::block_in_place(|| http_get(admin, "/readyz").unwrap_or_default());
        assert!(said.contains("not the one at its path"), "{said}");
        // Refused from the next check on (every scope_secret_check_interval): the replay
        // of k-1 first, then a new key, which is never forwarded.
        let r = common::retry_until(
            Duration::from_secs(5),
            async || post_url(&c, &url, Some("k-1"), TRANSFER, &[]).await,
            |r| r.status == 503,
        )
        .await;
        assert!(
            r.problem_type().ends_with("/store-unavailable"),
            "{:?}",
            r.body
        );
        let r = post_url(&c, &url, Some("k-2"), TRANSFER, &[]).await;
        assert_eq!(r.status, 503, "{:?}", r.body);
        assert_eq!(up.hits(), before + 1, "nothing forwarded after the check");
        let log = gate.log();
        assert!(
            log.contains(&path.display().to_string())
                && log.contains("refusing every protected request"),
            "{log}"
        );
    }
}
