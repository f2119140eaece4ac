//! `in_progress_wait` across instances that share a store, through the binary: a duplicate
//! sent to one instance while the first runs on another is answered with the first's
//! replay, woken by the store's message that the record landed (Redis's channel,
//! PostgreSQL's `NOTIFY`). The poll that would otherwise find it is set to a minute, far
//! beyond the test (and so is the first's lease), so only the message can have woken it. A Redis user without the
//! channel says so at start, and its duplicates are answered by the poll. A first whose
//! instance died wakes its duplicate at its lease's end.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use crate::common;

use common::builder::{Idemgate, Probes};
use common::postgres::PgServer;
use common::*;

const BODY: &str = "{\"amount\":1}";

/// Duplicates wait ten minutes, and ask a shared store again only every `poll`; the
/// first's lease, whose end also wakes them, is as long as the poll.
fn waiting(c: &mut idemgate::Config, poll: Duration) {
    c.defaults.in_progress_wait = Duration::from_secs(600);
    c.defaults.lease = poll.max(Duration::from_secs(1));
    c.wait_poll_interval = poll;
}

/// The first request of `key` held at the upstream through `a`, a duplicate sent to `b`
/// once it is there: both answers, once the duplicate waited and the first was released.
async fn first_on_a_duplicate_on_b(
    up: &Upstream,
    a: &Gate,
    b: &Gate,
    key: &str,
) -> (Answer, Answer) {
    let c = client();
    let first = post_in_background(&c, a.url("/pay"), key, BODY, &[(FAULT, "hold")]);
    eventually(HANG_GUARD, "the first at the upstream", || up.hits() == 1).await;
    let duplicate = post_in_background(&c, b.url("/pay"), key, BODY, &[]);
    eventually(HANG_GUARD, "the duplicate waiting", || {
        b.metric_or_zero("idemgate_in_progress_waiting") == 1.0
    })
    .await;
    up.release();
    // Within the guard, far shorter than the poll: only a message can have woken it.
    let duplicate = tokio::time::timeout(HANG_GUARD, duplicate).await;
    (
        first.await.unwrap(),
        duplicate.expect("woken by the message").unwrap(),
    )
}

fn assert_replayed(first: &Answer, duplicate: &Answer, up: &Upstream) {
    assert_eq!(first.status, 201);
    assert_eq!(duplicate.status, 201, "{:?}", duplicate.body);
    assert!(duplicate.replayed());
    assert_eq!(duplicate.body, first.body);
    assert_eq!(up.hits(), 1, "executed once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn across_two_instances_on_redis_the_message_wakes_the_duplicate() {
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let poll = Duration::from_secs(60);
    let a = Idemgate::new(&up.url())
        .redis(&redis)
        .set(|c| waiting(c, poll))
        .binary();
    let b = Idemgate::new(&up.url())
        .redis(&redis)
        .set(|c| waiting(c, poll))
        .binary();
    let (first, duplicate) = first_on_a_duplicate_on_b(&up, &a, &b, "s-redis").await;
    assert_replayed(&first, &duplicate, &up);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn across_two_instances_on_postgres_the_notification_wakes_the_duplicate() {
    let pg = tokio::task::spawn_blocking(PgServer::shared).await.unwrap();
    let url = pg.fresh_db().await;
    let up = Upstream::start().await;
    let poll = Duration::from_secs(60);
    let on_pg = |c: &mut idemgate::Config| {
        c.postgres_url = Some(url.as_str().into());
        waiting(c, poll);
    };
    let a = Idemgate::new(&up.url()).set(on_pg).binary();
    let b = Idemgate::new(&up.url()).set(on_pg).binary();
    let (first, duplicate) = first_on_a_duplicate_on_b(&up, &a, &b, "s-pg").await;
    assert_replayed(&first, &duplicate, &up);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_user_without_the_channel_is_told_and_its_duplicates_poll() {
    // The ACL of docs/production.md before waits: no channel, neither PUBLISH nor SUBSCRIBE.
    let redis = RedisServer::start_with(&[
        "--user",
        "idemgate",
        "on",
        ">pw",
        "resetkeys",
        "~idemgate:*",
        "resetchannels",
        "+@all",
        "-publish",
        "-subscribe",
    ]);
    let url = format!("redis://idemgate:pw@127.0.0.1:{}/0", redis.port);
    let up = Upstream::start().await;
    let poll = Duration::from_millis(100);
    let a = Idemgate::new(&up.url())
        .redis_url(&url)
        .set(|c| waiting(c, poll))
        .binary();
    let b = Idemgate::new(&up.url())
        .redis_url(&url)
        .set(|c| waiting(c, poll))
        .binary();
    eventually(HANG_GUARD, "the missing channel said at start", || {
        b.log().contains("may not subscribe")
    })
    .await;
    let (first, duplicate) = first_on_a_duplicate_on_b(&up, &a, &b, "s-acl").await;
    assert_replayed(&first, &duplicate, &up);
}

/// The first's instance dies while a duplicate waits on another: its lease runs out without
/// a record, and the duplicate, woken at the lease's end (the poll is a minute away), gets
/// what any retry then gets, 409 `outcome-unknown`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_that_runs_out_wakes_the_duplicate_to_outcome_unknown() {
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let on_redis = |c: &mut idemgate::Config| {
        waiting(c, Duration::from_secs(60));
        c.defaults.lease = Duration::from_secs(1);
    };
    let mut a = Idemgate::new(&up.url())
        .redis(&redis)
        .set(on_redis)
        .binary();
    let b = Idemgate::new(&up.url())
        .redis(&redis)
        .set(on_redis)
        .binary();
    let c = client();
    // Its client loses its connection with the instance: nothing to read of it.
    let _first = post_in_background(&c, a.url("/pay"), "s-lease", BODY, &[(FAULT, "hold")]);
    eventually(HANG_GUARD, "the first at the upstream", || up.hits() == 1).await;
    let duplicate = post_in_background(&c, b.url("/pay"), "s-lease", BODY, &[]);
    eventually(HANG_GUARD, "the duplicate waiting", || {
        b.metric_or_zero("idemgate_in_progress_waiting") == 1.0
    })
    .await;
    a.kill();
    let duplicate = tokio::time::timeout(HANG_GUARD, duplicate).await;
    let duplicate = duplicate.expect("woken at the lease's end").unwrap();
    assert_eq!(duplicate.status, 409, "{:?}", duplicate.body);
    assert_eq!(duplicate.header("idemgate-error"), Some("outcome-unknown"));
    up.release();
    assert_eq!(up.hits(), 1, "never executed twice");
}
