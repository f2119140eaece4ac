//! idemgate on PostgreSQL under faults, with a real server of the test's own: connections
//! cut mid-traffic (through the TCP fault proxy) and a statement that the server cannot
//! answer in time (a lock held on the table). The tests share one server, each on a
//! database of its own; the history check on PostgreSQL restarts its server, so it has one
//! to itself (`tests/postgres_history.rs`).

#![allow(clippy::unwrap_used)]

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::faultproxy::FaultProxy;
use common::postgres::PgServer;
use common::*;
use idemgate::config::Config;

const TRANSFER: &str = r#"{"from":"acc-1","to":"acc-2","amount":1250,"currency":"EUR"}"#;
/// The header that names an operation, the client's own bookkeeping.
const OP: &str = "x-test-op";

async fn shared_pg() -> Arc<PgServer> {
    tokio::task::spawn_blocking(PgServer::shared).await.unwrap()
}

fn pg_config(up: &Upstream, url: &str) -> Config {
    let mut c = Config::for_upstream(&up.url());
    c.scope_secret_create_delay = Duration::ZERO;
    c.postgres_url = Some(url.into());
    c.namespace = Some(NAMESPACE.into());
    c.admin_listen = Some("127.0.0.1:0".parse().unwrap());
    c.defaults.anonymous = idemgate::config::Anonymous::Shared;
    c
}

/// A client whose every request has a deadline.
fn bounded_client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

/// POSTs with a deadline; `None` if the exchange failed.
async fn try_post(
    c: &reqwest::Client,
    app: &idemgate::Running,
    key: &str,
    extra: &[(&str, &str)],
) -> Option<(u16, bool, bytes::Bytes)> {
    let mut req = c
        .post(format!("http://{}/v1/transfers", app.addr()))
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(TRANSFER);
    for (k, v) in extra {
        req = req.header(*k, *v);
    }
    let res = req.send().await.ok()?;
    let status = res.status().as_u16();
    let replayed = res
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    Some((status, replayed, res.bytes().await.ok()?))
}

/// The operation and the answer of each execution, by execution number.
type Answers = HashMap<usize, (String, Vec<u8>)>;

/// Executions per operation (by the client's header), and the answer of each execution.
fn executions(up: &Upstream) -> (HashMap<String, usize>, Answers) {
    let mut per_op: HashMap<String, usize> = HashMap::new();
    let mut answers = HashMap::new();
    for s in up.seen() {
        let op = s.headers[OP][0].clone();
        *per_op.entry(op.clone()).or_default() += 1;
        let answer = execution_body(s.execution, &s.method, s.body.len()).into_bytes();
        answers.insert(s.execution, (op, answer));
    }
    (per_op, answers)
}

/// Connections between idemgate and PostgreSQL cut again and again while clients retry
/// their keys, then reconnections refused for a while: no key executes twice, every 201 is
/// its own key's answer, requests get 503 (upstream not called) while the database cannot
/// be reached, and service resumes by itself once it can.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_cut_mid_traffic_no_key_executes_twice_and_service_resumes() {
    let pg = shared_pg().await;
    let db = pg.fresh_db().await;
    let name = db.rsplit('/').next().unwrap().to_string();
    let proxy = FaultProxy::start(format!("127.0.0.1:{}", pg.port).parse().unwrap()).await;
    let up = Upstream::start().await;
    let through = format!("postgres://postgres@{}/{name}", proxy.addr);
    let mut cfg = pg_config(&up, &through);
    cfg.store_timeout = Duration::from_millis(500);
    cfg.defaults.lease = Duration::from_secs(1);
    let app = Arc::new(spawn_app(cfg).await);

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut clients = tokio::task::JoinSet::new();
    for n in 0..6 {
        let (app, stop) = (app.clone(), stop.clone());
        clients.spawn(async move {
            let c = bounded_client();
            let mut log = Vec::new();
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let key = format!("cut-{n}-{i}");
                i += 1;
                for _ in 0..6 {
                    let r = try_post(&c, &app, &key, &[(OP, &key), (DELAY_MS, "30")]).await;
                    let done = matches!(r, Some((201, ..)));
                    log.push((key.clone(), r));
                    if done {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(30)).await;
                }
            }
            log
        });
    }
    // Cut every connection, over and over, while the clients work.
    for _ in 0..8 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        proxy.cut_all();
    }
    tokio::time::sleep(Duration::from_millis(250)).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut history = Vec::new();
    while let Some(log) = clients.join_next().await {
        history.extend(log.unwrap());
    }
    assert!(proxy.cuts() >= 8, "only {} connections cut", proxy.cuts());

    // The database cannot be reached: 503, the upstream not called.
    proxy.refuse(true);
    proxy.cut_all();
    let c = bounded_client();
    let before = up.hits();
    for _ in 0..3 {
        let r = try_post(&c, &app, "while-down", &[(OP, "while-down")]).await;
        assert_eq!(r.map(|r| r.0), Some(503));
    }
    assert_eq!(
        up.hits(),
        before,
        "the upstream was called while the store was down"
    );

    // Reachable again: the same key executes, once, without a restart of idemgate.
    proxy.refuse(false);
    let r = retry_until(
        Duration::from_secs(15),
        async || try_post(&c, &app, "while-down", &[(OP, "while-down")]).await,
        |r| !matches!(r, Some((503, ..)) | None),
    )
    .await;
    assert!(
        !matches!(r, Some((503, ..)) | None),
        "still 503 after reconnections were allowed"
    );
    let r = r.unwrap();
    assert_eq!(r.0, 201);
    assert!(
        !r.1,
        "a key refused while the store was down was never executed"
    );
    history.push(("while-down".to_string(), Some(r)));

    // The checker.
    let (per_op, answers) = executions(&up);
    let twice: Vec<_> = per_op.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "executed more than once: {twice:?}");
    let mut statuses: HashMap<Option<u16>, usize> = HashMap::new();
    for (key, r) in &history {
        *statuses.entry(r.as_ref().map(|r| r.0)).or_default() += 1;
        match r {
            Some((201, _, body)) => {
                let n = serde_json::from_slice::<serde_json::Value>(body).unwrap()["execution"]
                    .as_u64()
                    .unwrap() as usize;
                let (op, answer) = &answers[&n];
                assert_eq!(op, key, "a 201 with another key's answer");
                assert_eq!(answer.as_slice(), &body[..]);
            }
            Some((409 | 503 | 504, ..)) => {}
            other => panic!("{key}: {other:?} is outside the failure table"),
        }
    }
    println!(
        "connections cut: {}; {} requests, {} keys executed; statuses {statuses:?}",
        proxy.cuts(),
        history.len(),
        per_op.len()
    );
    assert!(
        per_op.len() >= 6,
        "too few keys executed to mean anything: {statuses:?}"
    );
    Arc::into_inner(app).unwrap().shutdown().await;
}

/// Idemgate's claims that wait on a lock, on database `url` (its releases, retried with
/// pauses while the store fails, keep coming).
async fn claims_waiting_on_lock(url: &str) -> usize {
    PgServer::query(
        url,
        "SELECT count(*)::text FROM pg_stat_activity
         WHERE application_name = 'idemgate' AND wait_event_type = 'Lock'
           AND query LIKE '%INSERT INTO idemgate_records%'",
    )
    .await[0]
        .parse()
        .unwrap()
}

/// The table locked by another transaction: statements wait, idemgate answers 503 within
/// its store deadline without calling the upstream, and the server cancels the waiting
/// statements (`statement_timeout`) instead of running them once the lock goes away. The
/// lock released, the recorded key replays and the refused one executes once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statement_timeout_answers_503_and_never_executes_twice() {
    let pg = shared_pg().await;
    let url = pg.fresh_db().await;
    let up = Upstream::start().await;
    let mut cfg = pg_config(&up, &url);
    cfg.store_timeout = Duration::from_millis(500);
    let app = spawn_app(cfg).await;
    let c = bounded_client();
    let first = try_post(&c, &app, "k-done", &[(OP, "k-done")])
        .await
        .unwrap();
    assert_eq!(first.0, 201);

    let (locker, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    let task = tokio::spawn(conn);
    locker
        .batch_execute("BEGIN; LOCK TABLE idemgate_records IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    for key in ["k-done", "k-new", "k-new"] {
        let started = Instant::now();
        let r = try_post(&c, &app, key, &[(OP, key)]).await.unwrap();
        assert_eq!(r.0, 503, "{key}: {r:?}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "503 only after {:?}",
            started.elapsed()
        );
    }
    assert_eq!(
        up.hits(),
        1,
        "the upstream was called while the store timed out"
    );
    // The claims the callers gave up on are cancelled by the server, while the lock is
    // still held.
    common::until(
        Duration::from_secs(10),
        "claims still waiting on the lock: no statement_timeout",
        async || claims_waiting_on_lock(&url).await == 0,
    )
    .await;
    locker.batch_execute("ROLLBACK").await.unwrap();
    drop(locker);
    let _ = task.await;

    let again = retry_until(
        Duration::from_secs(15),
        async || {
            try_post(&c, &app, "k-done", &[(OP, "k-done")])
                .await
                .unwrap()
        },
        |r| r.0 != 503,
    )
    .await;
    assert_ne!(again.0, 503, "still 503 after the lock was released");
    assert_eq!(again.0, 201);
    assert!(again.1, "the recorded answer replays");
    assert_eq!(again.2, first.2);
    let fresh = try_post(&c, &app, "k-new", &[(OP, "k-new")]).await.unwrap();
    assert_eq!(fresh.0, 201);
    assert!(!fresh.1);
    assert_eq!(up.hits(), 2);
    let (per_op, _) = executions(&up);
    assert!(per_op.values().all(|n| *n == 1), "{per_op:?}");
    app.shutdown().await;
}
