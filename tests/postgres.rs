//! idemgate on PostgreSQL, end to end with a real server of the test's own: the round trips
//! per request (counted by the server's pg_stat_statements), two instances sharing one
//! database, and the database restarted under it.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::postgres::PgServer;
use common::*;
use idemgate::config::{Config, PgSynchronousCommit};

const TRANSFER: &str = r#"{"from":"acc-1","to":"acc-2","amount":1250,"currency":"EUR"}"#;
const N: usize = 30;

fn pg_config(up: &Upstream, url: &str) -> Config {
    let mut c = Config::for_upstream(&up.url());
    c.scope_secret_create_delay = Duration::ZERO;
    c.postgres_url = Some(url.into());
    c.namespace = Some(NAMESPACE.into());
    c.admin_listen = Some("127.0.0.1:0".parse().unwrap());
    c.defaults.anonymous = idemgate::config::Anonymous::Shared;
    c
}

async fn start_pg() -> PgServer {
    tokio::task::spawn_blocking(PgServer::start).await.unwrap()
}

/// Statements that idemgate's connections executed for requests since the last reset: each
/// is one round trip (prepared once per connection, then bind and execute). Those on
/// `idemgate_meta` (the heartbeat every second, the scope secret's check) are not a
/// request's.
async fn statements(url: &str) -> u64 {
    PgServer::query(
        url,
        "SELECT coalesce(sum(s.calls), 0)::text FROM pg_stat_statements s
         WHERE s.query NOT ILIKE '%pg_stat_statements%'
           AND s.query NOT ILIKE '%idemgate_meta%'",
    )
    .await[0]
        .parse()
        .unwrap()
}

async fn reset(url: &str) {
    PgServer::query(url, "SELECT pg_stat_statements_reset()::text").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_round_trips_per_new_key_and_one_per_replay() {
    let pg = start_pg().await;
    let url = pg.url("postgres");
    PgServer::query(&url, "CREATE EXTENSION pg_stat_statements").await;
    let up = Upstream::start().await;
    let app = spawn_app(pg_config(&up, &url)).await;
    let c = client();
    reset(&url).await;
    for i in 0..N {
        let a = post(
            &c,
            &app,
            "/v1/transfers",
            Some(&format!("k-{i}")),
            TRANSFER,
            &[],
        )
        .await;
        assert_eq!(a.status, 201);
        assert!(!a.replayed());
    }
    assert_eq!(up.hits(), N);
    assert_eq!(statements(&url).await, 2 * N as u64, "2 per new key");
    reset(&url).await;
    for i in 0..N {
        let a = post(
            &c,
            &app,
            "/v1/transfers",
            Some(&format!("k-{i}")),
            TRANSFER,
            &[],
        )
        .await;
        assert_eq!(a.status, 201);
        assert!(a.replayed());
    }
    assert_eq!(up.hits(), N);
    assert_eq!(statements(&url).await, N as u64, "1 per replay");
    app.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_on_one_database_execute_each_key_once() {
    let pg = start_pg().await;
    let url = pg.url("postgres");
    let up = Upstream::start().await;
    let a = spawn_app(pg_config(&up, &url)).await;
    let b = spawn_app(pg_config(&up, &url)).await;
    let c = client();
    for round in 0..5 {
        let key = format!("race-{round}");
        let mut tasks = Vec::new();
        for n in 0..6 {
            let addr = if n % 2 == 0 { a.addr() } else { b.addr() };
            let app_url = format!("http://{addr}/v1/transfers");
            let (c, key) = (c.clone(), key.clone());
            tasks.push(tokio::spawn(async move {
                post_url(&c, &app_url, Some(&key), TRANSFER, &[(DELAY_MS, "200")]).await
            }));
        }
        let mut statuses = Vec::new();
        for t in tasks {
            statuses.push(t.await.unwrap().status);
        }
        assert!(statuses.contains(&201), "{statuses:?}");
        assert!(
            statuses.iter().all(|s| *s == 201 || *s == 409),
            "{statuses:?}"
        );
        assert_eq!(up.hits(), round + 1, "{statuses:?}");
    }
    // Every instance replays what the other recorded.
    let r = post(&c, &b, "/v1/transfers", Some("race-0"), TRANSFER, &[]).await;
    assert!(r.replayed());
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_restarted_records_kept_and_service_resumes() {
    let pg = start_pg().await;
    let url = pg.url("postgres");
    let up = Upstream::start().await;
    let app = spawn_app(pg_config(&up, &url)).await;
    let c = client();
    let first = post(&c, &app, "/v1/transfers", Some("k-kept"), TRANSFER, &[]).await;
    assert_eq!(first.status, 201);
    pg.restart();
    // The connection broke: calls fail (503, upstream not called) until a new one is made,
    // then the recorded answer replays and nothing ran twice.
    let r = retry_until(
        Duration::from_secs(15),
        async || post(&c, &app, "/v1/transfers", Some("k-kept"), TRANSFER, &[]).await,
        |r| r.status != 503,
    )
    .await;
    assert_ne!(r.status, 503, "still 503 after the restart");
    assert_eq!(r.status, 201, "{:?}", r.body);
    assert!(r.replayed());
    assert_eq!(r.body, first.body);
    let fresh = post(&c, &app, "/v1/transfers", Some("k-new"), TRANSFER, &[]).await;
    assert_eq!(fresh.status, 201);
    assert_eq!(up.hits(), 2);
    app.shutdown().await;
}

/// A database whose default is `synchronous_commit = off` (a claim answered before it is on
/// disk, lost in a crash): idemgate's sessions commit with `postgres_synchronous_commit`
/// all the same, as the session itself reads it at start and logs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_commit_synchronously_whatever_the_database_says() {
    let pg = start_pg().await;
    let url = pg.fresh_db().await;
    let name = url.rsplit('/').next().unwrap().to_string();
    PgServer::query(
        &url,
        &format!("ALTER DATABASE {name} SET synchronous_commit = off"),
    )
    .await;
    // Another session on it has the database's default.
    assert_eq!(
        PgServer::query(&url, "SHOW synchronous_commit").await,
        ["off"]
    );
    let up = Upstream::start().await;
    for (asked, read) in [
        (None, "on"),
        (Some(PgSynchronousCommit::RemoteApply), "remote_apply"),
    ] {
        let mut gate = Idemgate::new(&up.url())
            .set(|c| {
                c.postgres_url = Some(url.as_str().into());
                if let Some(asked) = asked {
                    c.postgres_synchronous_commit = asked;
                }
            })
            .binary();
        let key = format!("sync-{read}");
        let paid = post_url(
            &client(),
            &gate.url("/v1/transfers"),
            Some(&key),
            TRANSFER,
            &[],
        )
        .await;
        assert_eq!(paid.status, 201);
        gate.terminate(Duration::from_secs(10));
        let log = gate.log();
        let line = log
            .lines()
            .find(|l| l.contains("connected to PostgreSQL"))
            .unwrap_or_else(|| panic!("no connection line in:\n{log}"));
        assert!(
            line.contains(&format!("synchronous_commit={read}")),
            "{line}"
        );
    }
}

/// The database goes back in time under a running instance (as a failover to a copy a
/// minute behind, or a restore, leaves it; here its heartbeat is set back a minute): the
/// instance says so at error, naming the gap, and counts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_gone_back_in_time_is_said_and_counted() {
    let pg = start_pg().await;
    let url = pg.fresh_db().await;
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url())
        .set(|c| c.postgres_url = Some(url.as_str().into()))
        .binary();
    let beats = async || {
        PgServer::query(
            &url,
            "SELECT value FROM idemgate_meta WHERE name = 'heartbeat'",
        )
        .await
    };
    let first = beats().await;
    until(Duration::from_secs(10), "two heartbeats", async || {
        let now = beats().await;
        !now.is_empty() && now != first
    })
    .await;
    assert_eq!(gate.metric("idemgate_store_rewinds_total"), 0.0);
    PgServer::query(
        &url,
        "UPDATE idemgate_meta SET value = (value::bigint - 60000)::text
         WHERE name = 'heartbeat' RETURNING 1",
    )
    .await;
    eventually(Duration::from_secs(10), "the rewind counted", || {
        gate.metric("idemgate_store_rewinds_total") == 1.0
    })
    .await;
    let log = gate.log();
    let said = log
        .lines()
        .find(|l| l.contains("the store went back in time"))
        .unwrap_or_else(|| panic!("no rewind said in:\n{log}"));
    assert!(said.contains("ERROR"), "{said}");
    let gap: i64 = said
        .split("gap_ms=")
        .nth(1)
        .and_then(|g| g.split_whitespace().next())
        .and_then(|g| g.parse().ok())
        .unwrap_or_else(|| panic!("no gap in: {said}"));
    assert!((60_000..70_000).contains(&gap), "{said}");
}
