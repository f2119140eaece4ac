//! Two services, `alpha` and `beta`, on one PostgreSQL database and on one SQLite file, as
//! docs/production.md allows: each sees, counts, releases and completes only its own
//! records, and those written by a version that kept no namespace (`namespace: null`),
//! which it changes only with `?any_namespace=true`. Through the binary.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::path::Path;
use std::time::Duration;

use common::postgres::PgServer;
use common::*;
use idemgate::config::Config;
use serde_json::Value;

const TRANSFER: &str = r#"{"from":"acc-1","to":"acc-2","amount":1250}"#;

/// An instance of `namespace` on the store `store` sets, counting `unknown` records every
/// second and giving the upstream 300 ms.
fn instance(up: &Upstream, namespace: &str, store: impl FnOnce(&mut Config)) -> Gate {
    Idemgate::new(&up.url())
        .set(|c| {
            c.namespace = Some(namespace.into());
            c.unknown_count_interval = Duration::from_secs(1);
            c.defaults.upstream_timeout = Duration::from_millis(300);
            store(c);
        })
        .binary()
}

async fn pay(c: &reqwest::Client, g: &Gate, key: &str, extra: &[(&str, &str)]) -> Answer {
    post_url(c, &g.url("/v1/transfers"), Some(key), TRANSFER, extra).await
}

/// `GET /records` on `g`: every record it lists.
async fn listed(c: &reqwest::Client, g: &Gate) -> Vec<Value> {
    let page: Value = c
        .get(g.admin_url("/records?count=1000"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    page["records"].as_array().cloned().unwrap_or_default()
}

/// `DELETE /records/{id}?completed=true` on `g`, with `more` query parameters: the status
/// and the answer's JSON.
async fn release(c: &reqwest::Client, g: &Gate, id: &str, more: &str) -> (u16, Value) {
    let res = c
        .delete(g.admin_url(&format!(
            "/records/{id}?completed=true&reason=test+releases+it{more}"
        )))
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    (status, res.json().await.unwrap_or_default())
}

/// `POST /records/{id}/complete` on `g`: the status.
async fn complete(c: &reqwest::Client, g: &Gate, id: &str) -> u16 {
    c.post(g.admin_url(&format!("/records/{id}/complete?reason=test+completes+it")))
        .json(&serde_json::json!({"status": 201, "body": "{}"}))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

/// The scenario on one store, `store` setting it on each instance; `unscope` makes a
/// record as a version that kept no namespace leaves it (its namespace NULL).
async fn two_namespaces_on_one_store(
    store: impl Fn(&mut Config) + Clone,
    unscope: impl AsyncFn(&str),
) {
    let up = Upstream::start().await;
    let alpha = instance(&up, "alpha", store.clone());
    let beta = instance(&up, "beta", store);
    let c = client();

    let paid = pay(&c, &alpha, "pay-1", &[]).await;
    assert_eq!(paid.status, 201);
    // Sent, no answer within upstream_timeout: held `unknown`, one in each namespace.
    let slow = [(DELAY_MS, "2000")];
    let (a, b) = tokio::join!(
        pay(&c, &alpha, "slow-1", &slow),
        pay(&c, &beta, "slow-1", &slow)
    );
    assert_eq!((a.status, b.status), (504, 504));
    let hits = up.hits();
    let mine = listed(&c, &alpha).await;
    assert_eq!(mine.len(), 2, "{mine:?}");
    assert!(mine.iter().all(|r| r["namespace"] == "alpha"), "{mine:?}");
    let completed = mine.iter().find(|r| r["state"] == "completed").unwrap();
    let unknown = mine.iter().find(|r| r["state"] == "unknown").unwrap();
    let (paid_id, slow_id) = (
        completed["id"].as_str().unwrap().to_string(),
        unknown["id"].as_str().unwrap().to_string(),
    );

    // Beta lists only its own, shows none of alpha's, and releases or completes none.
    let theirs = listed(&c, &beta).await;
    assert_eq!(theirs.len(), 1, "{theirs:?}");
    assert_eq!(theirs[0]["namespace"], "beta");
    assert_eq!(beta.record(&c, &paid_id).await, None);
    assert_eq!(release(&c, &beta, &paid_id, "&force=true").await.0, 404);
    assert_eq!(complete(&c, &beta, &slow_id).await, 404);
    // Each counts its own unknown record, not the other's.
    eventually(Duration::from_secs(10), "each counts its own", || {
        alpha.metric("idemgate_records_held_unknown") == 1.0
            && beta.metric("idemgate_records_held_unknown") == 1.0
    })
    .await;
    // Alpha's retries replay: the payment ran once.
    let again = pay(&c, &alpha, "pay-1", &[]).await;
    assert_eq!((again.status, again.replayed()), (201, true));
    assert_eq!(up.hits(), hits);

    // A record an older version wrote carries no namespace: every namespace sees it, and
    // changes it only when its operator says it may be any namespace's.
    unscope(&paid_id).await;
    let seen = beta.record(&c, &paid_id).await.unwrap();
    assert_eq!(seen["namespace"], Value::Null, "{seen}");
    assert!(listed(&c, &beta).await.iter().any(|r| r["id"] == paid_id));
    let (status, refusal) = release(&c, &beta, &paid_id, "").await;
    assert_eq!(
        (status, &refusal["namespace"]),
        (409, &Value::Null),
        "{refusal}"
    );
    let again = pay(&c, &alpha, "pay-1", &[]).await;
    assert_eq!((again.status, again.replayed()), (201, true));
    assert_eq!(up.hits(), hits);
    let (status, released) = release(&c, &alpha, &paid_id, "&any_namespace=true").await;
    assert_eq!(status, 200, "{released}");
    // Counted by every namespace, as listed: beta now holds two unknown records.
    unscope(&slow_id).await;
    eventually(
        Duration::from_secs(10),
        "beta counts the unscoped record",
        || beta.metric("idemgate_records_held_unknown") == 2.0,
    )
    .await;
    drop((alpha, beta));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_namespaces_on_one_postgresql_database() {
    let pg = tokio::task::spawn_blocking(PgServer::start).await.unwrap();
    let url = pg.fresh_db().await;
    let store = {
        let url = url.clone();
        move |c: &mut Config| c.postgres_url = Some(url.as_str().into())
    };
    two_namespaces_on_one_store(store, async |id: &str| {
        PgServer::query(
            &url,
            &format!(
                "UPDATE idemgate_records SET namespace = NULL WHERE id = '\\x{id}'::bytea RETURNING 1"
            ),
        )
        .await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_namespaces_on_one_sqlite_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_path_buf();
    let store = {
        let path = path.clone();
        move |c: &mut Config| c.store_path = Some(path.clone())
    };
    two_namespaces_on_one_store(store, async |id: &str| unscope_sqlite(&path, id)).await;
}

/// Clears the namespace of record `id` in the SQLite store in `dir`.
fn unscope_sqlite(dir: &Path, id: &str) {
    let db = rusqlite::Connection::open(dir.join("idemgate.sqlite3")).unwrap();
    db.busy_timeout(Duration::from_secs(5)).unwrap();
    let n = db
        .execute(
            "UPDATE records SET namespace = NULL WHERE id = ?1",
            [hex::decode(id).unwrap()],
        )
        .unwrap();
    assert_eq!(n, 1);
}
