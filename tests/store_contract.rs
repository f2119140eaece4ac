//! One contract, four stores: every test here runs against the in-memory store, the
//! persistent embedded store (SQLite in a temporary directory), a real redis-server and a
//! real PostgreSQL server, through the `Store` trait only.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::postgres::PgServer;
use common::RedisServer;
use idemgate::fingerprint::Fingerprint;
use idemgate::key::{IdempotencyKey, RecordId};
use idemgate::scope::{ScopeSecret, Scoper, Tenant};
use idemgate::store::{
    Claim, ClaimRequest, Completed, Deleted, MemoryStore, OwnerToken, PostgresStore, RecordState,
    RedisStore, SqliteStore, Store, StoreError, StoredResponse,
};

struct Fixture {
    store: Arc<dyn Store>,
    _redis: Option<RedisServer>,
    _dir: Option<tempfile::TempDir>,
    _pg: Option<Arc<PgServer>>,
}

async fn memory() -> Fixture {
    Fixture {
        store: Arc::new(MemoryStore::new(1000)),
        _redis: None,
        _dir: None,
        _pg: None,
    }
}

async fn sqlite() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path(), "default").unwrap();
    Fixture {
        store: Arc::new(store),
        _redis: None,
        _dir: Some(dir),
        _pg: None,
    }
}

async fn postgres() -> Fixture {
    // One server for the tests running at the same time, a database for each.
    let server = tokio::task::spawn_blocking(PgServer::shared).await.unwrap();
    let store = PostgresStore::connect(
        &server.fresh_db().await,
        "default",
        idemgate::config::PgSynchronousCommit::On,
        Duration::from_secs(5),
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    Fixture {
        store: Arc::new(store),
        _redis: None,
        _dir: None,
        _pg: Some(server),
    }
}

async fn redis() -> Fixture {
    let server = RedisServer::start();
    let store = RedisStore::connect(
        &server.url(),
        Duration::from_secs(1),
        Duration::from_secs(1),
    )
    .await
    .unwrap();
    Fixture {
        store: Arc::new(store),
        _redis: Some(server),
        _dir: None,
        _pg: None,
    }
}

/// Redis with records kept as one value each (`redis_record_format = "value"`).
async fn redis_value() -> Fixture {
    let server = RedisServer::start();
    Fixture {
        store: Arc::new(server.store(true).await),
        _redis: Some(server),
        _dir: None,
        _pg: None,
    }
}

fn id(key: &str) -> RecordId {
    let mut h = hyper::HeaderMap::new();
    h.insert(
        idemgate::key::HEADER,
        hyper::header::HeaderValue::from_str(key).unwrap(),
    );
    let key: IdempotencyKey = idemgate::key::parse(&h, 255).unwrap().unwrap();
    Scoper::new(
        &ScopeSecret::from_hex(&"5a".repeat(32)).unwrap(),
        "contract",
    )
    .record_id(&Tenant::anonymous(), "POST", "/t", &key)
}

fn claim(key: &str, fp: u8, lease_ms: u64) -> ClaimRequest {
    ClaimRequest {
        id: id(key),
        fingerprint: Fingerprint([fp; 32]),
        fingerprint_version: 1,
        owner: OwnerToken::random(),
        lease: Duration::from_millis(lease_ms),
        retention: Duration::from_secs(60),
        busy_for: Duration::from_millis(lease_ms),
        answer_room: 0,
        room: None,
    }
}

fn response(tag: &str) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![
            (
                "content-type".into(),
                Bytes::from_static(b"application/json"),
            ),
            ("x-multi".into(), Bytes::from_static(b"1")),
            ("x-multi".into(), Bytes::from_static(b"2")),
            ("x-binary".into(), Bytes::from_static(b"\x80\xff")),
        ],
        body: Bytes::from(format!("{{\"tag\":\"{tag}\",\"nul\":\"\u{0}\"}}")),
    }
}

macro_rules! contract {
    ($($name:ident),* $(,)?) => {
        mod on_memory {
            $( #[tokio::test] async fn $name() { super::$name(super::memory().await).await } )*
        }
        mod on_sqlite {
            $( #[tokio::test] async fn $name() { super::$name(super::sqlite().await).await } )*
        }
        mod on_postgres {
            $( #[tokio::test] async fn $name() { super::$name(super::postgres().await).await } )*
        }
        mod on_redis {
            $( #[tokio::test] async fn $name() { super::$name(super::redis().await).await } )*
        }
        mod on_redis_values {
            $( #[tokio::test] async fn $name() { super::$name(super::redis_value().await).await } )*
        }
    };
}

contract!(
    first_claim_wins_and_others_see_in_flight,
    owner_records_and_everyone_replays_exactly,
    different_fingerprint_is_a_mismatch_in_every_state,
    only_the_owner_records_renews_or_releases,
    unrenewed_lease_reads_as_unknown_and_renewal_keeps_it_alive,
    mark_unknown_holds_and_delete_frees,
    release_frees_the_key_for_a_new_claim,
    retention_expires_records,
    shorten_brings_expiry_forward_and_never_back,
    concurrent_claims_have_one_winner,
    inspect_shows_state_without_body_unless_asked,
    an_answer_not_kept_completes_the_record_with_its_status_alone,
    a_multi_mib_answer_replays_exactly_and_goes_with_its_record,
    a_claim_that_arrives_after_its_release_creates_nothing,
    operator_delete_refuses_while_the_owner_may_be_working,
    operator_complete_resolves_an_unsettled_record_once,
    list_walks_every_record_in_bounded_pages,
    a_later_answer_supersedes_a_recorded_failure_and_nothing_else,
);

/// How long a release remembers a withdrawn claim, in tests that do not wait for it.
const LINGER: Duration = Duration::from_secs(60);

async fn a_claim_that_arrives_after_its_release_creates_nothing(f: Fixture) {
    // The owner gave up on its claim before the claim reached the store (it was delayed on
    // a connection that was cut, and the release went down a new one).
    let late = claim("k", 1, 10_000);
    assert!(!f
        .store
        .release(&late.id, &late.owner, Duration::from_millis(400))
        .await
        .unwrap());
    assert_eq!(f.store.claim(&late).await.unwrap(), Claim::Withdrawn);
    assert!(f.store.inspect(&late.id, false).await.unwrap().is_none());
    // Anyone else's claim is not held back.
    let other = claim("k", 1, 10_000);
    assert_eq!(f.store.claim(&other).await.unwrap(), Claim::Claimed);
    // Still void when it arrives while another owner holds the record, and after that
    // owner has released it.
    assert!(matches!(
        f.store.claim(&late).await.unwrap(),
        Claim::InFlight { .. }
    ));
    assert!(f
        .store
        .release(&other.id, &other.owner, LINGER)
        .await
        .unwrap());
    assert_eq!(f.store.claim(&late).await.unwrap(), Claim::Withdrawn);
    // The release of someone else's record neither touched it nor made the key unusable.
    let held = claim("h", 1, 10_000);
    assert_eq!(f.store.claim(&held).await.unwrap(), Claim::Claimed);
    let gave_up = claim("h", 1, 10_000);
    assert!(!f
        .store
        .release(&held.id, &gave_up.owner, LINGER)
        .await
        .unwrap());
    assert!(f
        .store
        .record(&held.id, &held.owner, &response("held"))
        .await
        .unwrap());
    assert_eq!(
        f.store.claim(&claim("h", 1, 10_000)).await.unwrap(),
        Claim::Replay(response("held"))
    );
    // The note is short-lived: past its linger, that owner's claim is an ordinary one.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let mut again = claim("k", 1, 10_000);
    again.owner = late.owner.clone();
    assert_eq!(f.store.claim(&again).await.unwrap(), Claim::Claimed);
}

async fn operator_delete_refuses_while_the_owner_may_be_working(f: Fixture) {
    // A live lease.
    let mut a = claim("live", 1, 10_000);
    a.busy_for = Duration::from_secs(10);
    f.store.claim(&a).await.unwrap();
    assert_eq!(
        f.store.delete(&a.id, false, false).await.unwrap(),
        Deleted::OwnerBusy
    );
    assert!(f.store.inspect(&a.id, false).await.unwrap().is_some());
    assert_eq!(
        f.store.delete(&a.id, true, false).await.unwrap(),
        Deleted::Deleted
    );

    // A lease that lapsed (a store stall kept its owner from renewing it) while its owner
    // may still be waiting for the upstream: it reads as unknown, and is still refused.
    let mut b = claim("lapsed", 1, 100);
    b.busy_for = Duration::from_millis(900);
    f.store.claim(&b).await.unwrap();
    tokio::time::sleep(Duration::from_millis(250)).await;
    let v = f.store.inspect(&b.id, false).await.unwrap().unwrap();
    assert_eq!(v.state, RecordState::Unknown);
    assert!(v.owner_busy_ms.is_some_and(|ms| ms > 0 && ms <= 900));
    assert_eq!(
        f.store.delete(&b.id, false, false).await.unwrap(),
        Deleted::OwnerBusy
    );
    // Once the owner has given up for sure, an unforced release goes through.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let v = f.store.inspect(&b.id, false).await.unwrap().unwrap();
    assert_eq!(v.state, RecordState::Unknown);
    assert_eq!(v.owner_busy_ms, None);
    assert_eq!(
        f.store.delete(&b.id, false, false).await.unwrap(),
        Deleted::Deleted
    );

    // Settled by its owner (marked unknown, or completed): releasable at once.
    let mut c = claim("settled", 1, 10_000);
    c.busy_for = Duration::from_secs(10);
    f.store.claim(&c).await.unwrap();
    f.store.mark_unknown(&c.id, &c.owner).await.unwrap();
    assert_eq!(
        f.store
            .inspect(&c.id, false)
            .await
            .unwrap()
            .unwrap()
            .owner_busy_ms,
        None
    );
    assert_eq!(
        f.store.delete(&c.id, false, false).await.unwrap(),
        Deleted::Deleted
    );
    let mut d = claim("done", 1, 10_000);
    d.busy_for = Duration::from_secs(10);
    f.store.claim(&d).await.unwrap();
    f.store
        .record(&d.id, &d.owner, &response("d"))
        .await
        .unwrap();
    assert_eq!(
        f.store.delete(&d.id, false, false).await.unwrap(),
        Deleted::Deleted
    );
}

async fn first_claim_wins_and_others_see_in_flight(f: Fixture) {
    let a = claim("k", 1, 10_000);
    assert_eq!(f.store.claim(&a).await.unwrap(), Claim::Claimed);
    let b = claim("k", 1, 10_000);
    match f.store.claim(&b).await.unwrap() {
        Claim::InFlight { lease_left } => assert!(lease_left <= Duration::from_secs(10)),
        other => panic!("{other:?}"),
    }
    // Claiming again is harmless, even by the same owner: it never takes the record twice.
    assert!(matches!(
        f.store.claim(&a).await.unwrap(),
        Claim::InFlight { .. }
    ));
}

async fn owner_records_and_everyone_replays_exactly(f: Fixture) {
    let a = claim("k", 1, 10_000);
    f.store.claim(&a).await.unwrap();
    let r = response("first");
    assert!(f.store.record(&a.id, &a.owner, &r).await.unwrap());
    // Recording twice (a retried script) is harmless.
    assert!(f.store.record(&a.id, &a.owner, &r).await.unwrap());
    let b = claim("k", 1, 10_000);
    assert_eq!(f.store.claim(&b).await.unwrap(), Claim::Replay(r.clone()));
    assert_eq!(f.store.claim(&b).await.unwrap(), Claim::Replay(r));
}

async fn different_fingerprint_is_a_mismatch_in_every_state(f: Fixture) {
    let a = claim("k", 1, 10_000);
    f.store.claim(&a).await.unwrap();
    assert_eq!(
        f.store.claim(&claim("k", 2, 10_000)).await.unwrap(),
        Claim::Mismatch
    );
    f.store
        .record(&a.id, &a.owner, &response("x"))
        .await
        .unwrap();
    assert_eq!(
        f.store.claim(&claim("k", 2, 10_000)).await.unwrap(),
        Claim::Mismatch
    );
    // Another input-format version is not a mismatch: the caller recomputes in that version.
    let mut other_version = claim("k", 1, 10_000);
    other_version.fingerprint_version = 2;
    assert_eq!(
        f.store.claim(&other_version).await.unwrap(),
        Claim::OtherVersion(1)
    );
    let u = claim("u", 1, 10_000);
    f.store.claim(&u).await.unwrap();
    f.store.mark_unknown(&u.id, &u.owner).await.unwrap();
    assert_eq!(
        f.store.claim(&claim("u", 3, 10_000)).await.unwrap(),
        Claim::Mismatch
    );
}

async fn only_the_owner_records_renews_or_releases(f: Fixture) {
    let a = claim("k", 1, 10_000);
    f.store.claim(&a).await.unwrap();
    let stranger = OwnerToken::random();
    assert!(!f
        .store
        .record(&a.id, &stranger, &response("evil"))
        .await
        .unwrap());
    assert!(!f
        .store
        .renew(&a.id, &stranger, Duration::from_secs(10))
        .await
        .unwrap());
    assert!(!f.store.release(&a.id, &stranger, LINGER).await.unwrap());
    assert!(!f.store.mark_unknown(&a.id, &stranger).await.unwrap());
    assert!(matches!(
        f.store.claim(&claim("k", 1, 10_000)).await.unwrap(),
        Claim::InFlight { .. }
    ));
    // A stale owner whose record was released and re-claimed cannot overwrite the new one.
    assert!(f.store.release(&a.id, &a.owner, LINGER).await.unwrap());
    let b = claim("k", 1, 10_000);
    assert_eq!(f.store.claim(&b).await.unwrap(), Claim::Claimed);
    assert!(!f
        .store
        .record(&a.id, &a.owner, &response("stale"))
        .await
        .unwrap());
    assert!(f
        .store
        .record(&b.id, &b.owner, &response("fresh"))
        .await
        .unwrap());
    assert_eq!(
        f.store.claim(&claim("k", 1, 10_000)).await.unwrap(),
        Claim::Replay(response("fresh"))
    );
}

async fn unrenewed_lease_reads_as_unknown_and_renewal_keeps_it_alive(f: Fixture) {
    let a = claim("dead", 1, 150);
    f.store.claim(&a).await.unwrap();
    let b = claim("alive", 1, 150);
    f.store.claim(&b).await.unwrap();
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(75)).await;
        assert!(f
            .store
            .renew(&b.id, &b.owner, Duration::from_millis(150))
            .await
            .unwrap());
    }
    assert_eq!(
        f.store.claim(&claim("dead", 1, 150)).await.unwrap(),
        Claim::Unknown
    );
    assert!(matches!(
        f.store.claim(&claim("alive", 1, 150)).await.unwrap(),
        Claim::InFlight { .. }
    ));
    // The owner of an expired lease may still record the real answer: nobody else took it.
    assert!(f
        .store
        .record(&a.id, &a.owner, &response("late"))
        .await
        .unwrap());
    assert_eq!(
        f.store.claim(&claim("dead", 1, 150)).await.unwrap(),
        Claim::Replay(response("late"))
    );
}

async fn mark_unknown_holds_and_delete_frees(f: Fixture) {
    let a = claim("k", 1, 10_000);
    f.store.claim(&a).await.unwrap();
    assert!(f.store.mark_unknown(&a.id, &a.owner).await.unwrap());
    assert_eq!(
        f.store.claim(&claim("k", 1, 10_000)).await.unwrap(),
        Claim::Unknown
    );
    assert!(!f
        .store
        .renew(&a.id, &a.owner, Duration::from_secs(1))
        .await
        .unwrap());
    // The owner settled it: no force needed.
    assert_eq!(
        f.store.delete(&a.id, false, false).await.unwrap(),
        Deleted::Deleted
    );
    assert_eq!(
        f.store.delete(&a.id, false, false).await.unwrap(),
        Deleted::NotFound
    );
    assert_eq!(
        f.store.claim(&claim("k", 1, 10_000)).await.unwrap(),
        Claim::Claimed
    );
}

async fn release_frees_the_key_for_a_new_claim(f: Fixture) {
    let a = claim("k", 1, 10_000);
    f.store.claim(&a).await.unwrap();
    assert!(f.store.release(&a.id, &a.owner, LINGER).await.unwrap());
    assert!(!f.store.release(&a.id, &a.owner, LINGER).await.unwrap());
    assert_eq!(
        f.store.claim(&claim("k", 2, 10_000)).await.unwrap(),
        Claim::Claimed
    );
}

async fn retention_expires_records(f: Fixture) {
    let mut a = claim("k", 1, 100);
    a.retention = Duration::from_millis(300);
    f.store.claim(&a).await.unwrap();
    f.store
        .record(&a.id, &a.owner, &response("r"))
        .await
        .unwrap();
    assert!(matches!(
        f.store.claim(&claim("k", 1, 100)).await.unwrap(),
        Claim::Replay(_)
    ));
    tokio::time::sleep(Duration::from_millis(450)).await;
    assert_eq!(
        f.store.claim(&claim("k", 2, 100)).await.unwrap(),
        Claim::Claimed
    );
}

async fn shorten_brings_expiry_forward_and_never_back(f: Fixture) {
    // Recorded under a long retention, then shortened: gone after the short one.
    let a = claim("short", 1, 100);
    f.store.claim(&a).await.unwrap();
    assert!(f
        .store
        .record(&a.id, &a.owner, &response("r"))
        .await
        .unwrap());
    let other = OwnerToken::random();
    assert!(
        !f.store
            .shorten(&a.id, &other, Duration::from_millis(1))
            .await
            .unwrap(),
        "only the owner shortens"
    );
    assert!(f
        .store
        .shorten(&a.id, &a.owner, Duration::from_millis(300))
        .await
        .unwrap());
    assert!(matches!(
        f.store.claim(&claim("short", 1, 100)).await.unwrap(),
        Claim::Replay(_)
    ));
    // Never later than the retention it had: a record kept 300 ms is not lengthened.
    let mut b = claim("brief", 1, 100);
    b.retention = Duration::from_millis(300);
    f.store.claim(&b).await.unwrap();
    assert!(f
        .store
        .record(&b.id, &b.owner, &response("r"))
        .await
        .unwrap());
    f.store
        .shorten(&b.id, &b.owner, Duration::from_secs(3600))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    for key in ["short", "brief"] {
        assert_eq!(
            f.store.claim(&claim(key, 2, 100)).await.unwrap(),
            Claim::Claimed,
            "{key} expired"
        );
    }
}

async fn concurrent_claims_have_one_winner(f: Fixture) {
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..50 {
        let store = f.store.clone();
        set.spawn(async move { store.claim(&claim("race", 1, 10_000)).await.unwrap() });
    }
    let mut winners = 0;
    while let Some(r) = set.join_next().await {
        match r.unwrap() {
            Claim::Claimed => winners += 1,
            Claim::InFlight { .. } => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(winners, 1);
}

async fn inspect_shows_state_without_body_unless_asked(f: Fixture) {
    let a = claim("k", 7, 10_000);
    assert!(f.store.inspect(&a.id, false).await.unwrap().is_none());
    f.store.claim(&a).await.unwrap();
    let v = f.store.inspect(&a.id, false).await.unwrap().unwrap();
    assert_eq!(v.state, RecordState::InProgress);
    assert!(v.lease_left_ms.is_some_and(|l| l <= 10_000));
    assert_eq!(v.fingerprint, Fingerprint([7; 32]).to_hex());
    assert_eq!(v.fingerprint_version, 1);
    f.store
        .record(&a.id, &a.owner, &response("seen"))
        .await
        .unwrap();
    let v = f.store.inspect(&a.id, false).await.unwrap().unwrap();
    assert_eq!(v.state, RecordState::Completed);
    assert_eq!(v.status, Some(201));
    assert!(v.body.is_none());
    assert!(v.ttl_ms.is_some_and(|t| t <= 60_000 && t > 50_000));
    let v = f.store.inspect(&a.id, true).await.unwrap().unwrap();
    assert!(v.body.unwrap().contains("seen"));
}

async fn an_answer_not_kept_completes_the_record_with_its_status_alone(f: Fixture) {
    let a = claim("k", 1, 10_000);
    f.store.claim(&a).await.unwrap();
    // Only the owner completes it.
    let stranger = OwnerToken::random();
    assert!(!f
        .store
        .record_not_kept(&a.id, &stranger, 201)
        .await
        .unwrap());
    assert!(f.store.record_not_kept(&a.id, &a.owner, 201).await.unwrap());
    let b = claim("k", 1, 10_000);
    assert_eq!(
        f.store.claim(&b).await.unwrap(),
        Claim::NotKept { status: 201 }
    );
    // Completed: it cannot be marked unknown, and another request is still a mismatch.
    assert!(!f.store.mark_unknown(&a.id, &a.owner).await.unwrap());
    assert_eq!(
        f.store.claim(&claim("k", 2, 10_000)).await.unwrap(),
        Claim::Mismatch
    );
    let v = f.store.inspect(&a.id, true).await.unwrap().unwrap();
    assert_eq!(v.state, RecordState::Completed);
    assert_eq!(v.status, Some(201));
    assert_eq!(v.body_kept, Some(false));
    assert!(v.body.is_none());
    // An answer recorded in full and then (a retried call) not kept is not kept.
    let c = claim("j", 1, 10_000);
    f.store.claim(&c).await.unwrap();
    assert!(f
        .store
        .record(&c.id, &c.owner, &response("x"))
        .await
        .unwrap());
    assert!(f.store.record_not_kept(&c.id, &c.owner, 201).await.unwrap());
    assert_eq!(
        f.store.claim(&c).await.unwrap(),
        Claim::NotKept { status: 201 }
    );
    assert_eq!(
        f.store.delete(&c.id, true, false).await.unwrap(),
        Deleted::Deleted
    );
}

async fn a_later_answer_supersedes_a_recorded_failure_and_nothing_else(f: Fixture) {
    let failed = StoredResponse {
        status: 500,
        ..response("failed")
    };
    let later = response("later");
    let a = claim("s", 1, 10_000);
    // No record: nothing to supersede.
    assert!(!f
        .store
        .supersede(&a.id, &a.fingerprint, &later)
        .await
        .unwrap());
    f.store.claim(&a).await.unwrap();
    // In progress: left alone.
    assert!(!f
        .store
        .supersede(&a.id, &a.fingerprint, &later)
        .await
        .unwrap());
    assert!(f.store.record(&a.id, &a.owner, &failed).await.unwrap());
    // Another request's fingerprint: left alone.
    assert!(!f
        .store
        .supersede(&a.id, &Fingerprint([2; 32]), &later)
        .await
        .unwrap());
    assert_eq!(
        f.store.claim(&claim("s", 1, 10_000)).await.unwrap(),
        Claim::Replay(failed.clone())
    );
    // The same request's later answer replaces the failure, and is then kept: a success is
    // never superseded.
    assert!(f
        .store
        .supersede(&a.id, &a.fingerprint, &later)
        .await
        .unwrap());
    assert_eq!(
        f.store.claim(&claim("s", 1, 10_000)).await.unwrap(),
        Claim::Replay(later.clone())
    );
    let again = StoredResponse {
        status: 502,
        ..response("again")
    };
    assert!(!f
        .store
        .supersede(&a.id, &a.fingerprint, &again)
        .await
        .unwrap());
    assert_eq!(
        f.store.claim(&claim("s", 1, 10_000)).await.unwrap(),
        Claim::Replay(later)
    );
    // A failure not kept (its answer was too large) is superseded too.
    let b = claim("t", 1, 10_000);
    f.store.claim(&b).await.unwrap();
    assert!(f.store.record_not_kept(&b.id, &b.owner, 503).await.unwrap());
    assert!(f
        .store
        .supersede(&b.id, &b.fingerprint, &response("b"))
        .await
        .unwrap());
    assert_eq!(
        f.store.claim(&claim("t", 1, 10_000)).await.unwrap(),
        Claim::Replay(response("b"))
    );
    // Unknown: left alone (an operator resolves it).
    let c = claim("u", 1, 10_000);
    f.store.claim(&c).await.unwrap();
    assert!(f.store.mark_unknown(&c.id, &c.owner).await.unwrap());
    assert!(!f
        .store
        .supersede(&c.id, &c.fingerprint, &response("c"))
        .await
        .unwrap());
}

async fn a_multi_mib_answer_replays_exactly_and_goes_with_its_record(f: Fixture) {
    let a = claim("big", 1, 10_000);
    f.store.claim(&a).await.unwrap();
    let mut r = response("big");
    // Not a multiple of any chunk size, and every byte value.
    r.body = Bytes::from(
        (0..3_000_001u32)
            .map(|i| (i % 251) as u8)
            .collect::<Vec<u8>>(),
    );
    // Only the owner writes it.
    assert!(!f
        .store
        .record(&a.id, &OwnerToken::random(), &r)
        .await
        .unwrap());
    assert!(f.store.record(&a.id, &a.owner, &r).await.unwrap());
    let b = claim("big", 1, 10_000);
    assert_eq!(f.store.claim(&b).await.unwrap(), Claim::Replay(r.clone()));
    let v = f.store.inspect(&a.id, true).await.unwrap().unwrap();
    assert_eq!(
        v.body.map(|b| b.len()),
        Some(String::from_utf8_lossy(&r.body).len())
    );
    // Deleted with its record: a new claim and a smaller answer replay that answer.
    assert_eq!(
        f.store.delete(&a.id, true, false).await.unwrap(),
        Deleted::Deleted
    );
    let c = claim("big", 1, 10_000);
    assert_eq!(f.store.claim(&c).await.unwrap(), Claim::Claimed);
    let small = response("small");
    assert!(f.store.record(&c.id, &c.owner, &small).await.unwrap());
    assert_eq!(f.store.claim(&b).await.unwrap(), Claim::Replay(small));
}

#[tokio::test]
async fn embedded_store_byte_cap_answers_full_and_counts_down_to_zero() {
    let store = MemoryStore::with_limits(1000, 8 * 1024);
    let a = claim("a", 1, 10_000);
    store.claim(&a).await.unwrap();
    let upkeep = store.bytes();
    assert!(upkeep > 0);
    let big = StoredResponse {
        status: 201,
        headers: Vec::new(),
        body: Bytes::from(vec![b'x'; 6 * 1024]),
    };
    assert!(store.record(&a.id, &a.owner, &big).await.unwrap());
    assert_eq!(store.bytes(), upkeep + 6 * 1024);
    // A second answer that does not fit: refused, and its record is left as it was.
    let b = claim("b", 1, 10_000);
    store.claim(&b).await.unwrap();
    assert!(matches!(
        store.record(&b.id, &b.owner, &big).await,
        Err(StoreError::Full(_))
    ));
    assert!(matches!(
        store.claim(&claim("b", 1, 10_000)).await.unwrap(),
        Claim::InFlight { .. }
    ));
    assert!(store.record_not_kept(&b.id, &b.owner, 201).await.unwrap());
    // Claims until the bytes run out, then 503.
    let mut n = 0;
    let full = loop {
        match store.claim(&claim(&format!("c{n}"), 1, 10_000)).await {
            Ok(Claim::Claimed) => n += 1,
            other => break other,
        }
    };
    assert!(matches!(full, Err(StoreError::Full(ref m)) if m.contains("memory_max_bytes")));
    assert!(store.bytes() <= 8 * 1024);
    assert!(n > 0);
    // Everything removed, nothing counted.
    assert!(store.release(&b.id, &b.owner, LINGER).await.unwrap());
    assert_eq!(
        store.delete(&a.id, true, false).await.unwrap(),
        Deleted::Deleted
    );
    for i in 0..n {
        assert_eq!(
            store
                .delete(&id(&format!("c{i}")), true, false)
                .await
                .unwrap(),
            Deleted::Deleted
        );
    }
    assert_eq!((store.len(), store.bytes()), (0, 0));
}

#[tokio::test]
async fn embedded_store_cap_answers_full_and_sweeps_expired() {
    let store = MemoryStore::new(2);
    let mut short = claim("a", 1, 100);
    short.retention = Duration::from_millis(150);
    store.claim(&short).await.unwrap();
    store.claim(&claim("b", 1, 100)).await.unwrap();
    assert!(matches!(
        store.claim(&claim("c", 1, 100)).await,
        Err(StoreError::Full(_))
    ));
    tokio::time::sleep(Duration::from_millis(200)).await;
    // The expired record is swept to make room.
    assert_eq!(
        store.claim(&claim("c", 1, 100)).await.unwrap(),
        Claim::Claimed
    );
    assert_eq!(store.len(), 2);
}

#[tokio::test]
async fn persistent_store_keeps_records_and_secret_across_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path(), "default").unwrap();
    let secret = store.scope_secret().await.unwrap();
    let done = claim("done", 1, 60_000);
    let busy = claim("busy", 1, 60_000);
    assert_eq!(store.claim(&done).await.unwrap(), Claim::Claimed);
    assert!(store
        .record(&done.id, &done.owner, &response("kept"))
        .await
        .unwrap());
    assert_eq!(store.claim(&busy).await.unwrap(), Claim::Claimed);
    drop(store);

    let store = SqliteStore::open(dir.path(), "default").unwrap();
    assert_eq!(
        store.scope_secret().await.unwrap().to_hex(),
        secret.to_hex()
    );
    let mut again = claim("done", 1, 60_000);
    assert_eq!(
        store.claim(&again).await.unwrap(),
        Claim::Replay(response("kept"))
    );
    again.id = busy.id;
    assert!(matches!(
        store.claim(&again).await.unwrap(),
        Claim::InFlight { .. }
    ));
    // The owner of the claim made before the reopen still owns it.
    assert!(store
        .record(&busy.id, &busy.owner, &response("late"))
        .await
        .unwrap());
}

#[tokio::test]
async fn persistent_store_sweeps_expired_records_in_batches() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path(), "default").unwrap();
    let expiring = idemgate::store::sqlite::EXPIRE_BATCH * 2 + 5;
    for n in 0..expiring {
        let mut c = claim(&format!("short-{n}"), 1, 60_000);
        c.retention = Duration::from_millis(50);
        assert_eq!(store.claim(&c).await.unwrap(), Claim::Claimed);
    }
    let live = claim("long", 1, 60_000);
    assert_eq!(store.claim(&live).await.unwrap(), Claim::Claimed);
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(store.sweep().await.unwrap(), 1);
    assert!(store.inspect(&live.id, false).await.unwrap().is_some());
    assert!(store
        .inspect(&id("short-0"), false)
        .await
        .unwrap()
        .is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn persistent_store_opened_twice_on_one_directory_has_one_winner() {
    let dir = tempfile::tempdir().unwrap();
    // Two connections to one file, as two processes on one volume would have.
    let stores: Vec<Arc<dyn Store>> = (0..2)
        .map(|_| Arc::new(SqliteStore::open(dir.path(), "default").unwrap()) as Arc<dyn Store>)
        .collect();
    assert_eq!(
        stores[0].scope_secret().await.unwrap().to_hex(),
        stores[1].scope_secret().await.unwrap().to_hex()
    );
    for round in 0..20 {
        let key = format!("race-{round}");
        let tasks: Vec<_> = (0..8)
            .map(|n| {
                let store = stores[n % 2].clone();
                let req = claim(&key, 1, 60_000);
                tokio::spawn(async move { store.claim(&req).await.unwrap() })
            })
            .collect();
        let mut claimed = 0;
        for t in tasks {
            match t.await.unwrap() {
                Claim::Claimed => claimed += 1,
                Claim::InFlight { .. } => {}
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(claimed, 1, "round {round}");
    }
}

async fn operator_complete_resolves_an_unsettled_record_once(f: Fixture) {
    let answer = response("operator");
    assert_eq!(
        f.store
            .complete(&id("none"), &answer, false, false)
            .await
            .unwrap(),
        Completed::NotFound
    );
    // Its owner may still be working: refused unless forced.
    let a = claim("a", 1, 10_000);
    assert_eq!(f.store.claim(&a).await.unwrap(), Claim::Claimed);
    assert_eq!(
        f.store
            .complete(&a.id, &answer, false, false)
            .await
            .unwrap(),
        Completed::OwnerBusy
    );
    assert!(matches!(
        f.store.claim(&claim("a", 1, 10_000)).await.unwrap(),
        Claim::InFlight { .. }
    ));
    assert_eq!(
        f.store.complete(&a.id, &answer, true, false).await.unwrap(),
        Completed::Completed
    );
    // The former owner can no longer record over it, renew it or mark it.
    assert!(!f
        .store
        .record(&a.id, &a.owner, &response("late"))
        .await
        .unwrap());
    assert!(!f.store.record_not_kept(&a.id, &a.owner, 500).await.unwrap());
    assert!(!f
        .store
        .renew(&a.id, &a.owner, Duration::from_secs(10))
        .await
        .unwrap());
    assert!(!f.store.mark_unknown(&a.id, &a.owner).await.unwrap());
    assert_eq!(
        f.store.claim(&claim("a", 1, 10_000)).await.unwrap(),
        Claim::Replay(answer.clone())
    );
    assert_eq!(
        f.store.claim(&claim("a", 2, 10_000)).await.unwrap(),
        Claim::Mismatch
    );
    assert_eq!(
        f.store
            .complete(&a.id, &response("again"), true, false)
            .await
            .unwrap(),
        Completed::AlreadyCompleted
    );

    // Sent, outcome unknown: resolved without force, then replayed.
    let b = claim("b", 1, 10_000);
    f.store.claim(&b).await.unwrap();
    assert!(f.store.mark_unknown(&b.id, &b.owner).await.unwrap());
    assert_eq!(
        f.store
            .complete(&b.id, &answer, false, false)
            .await
            .unwrap(),
        Completed::Completed
    );
    assert_eq!(
        f.store.claim(&claim("b", 1, 10_000)).await.unwrap(),
        Claim::Replay(answer.clone())
    );
    let v = f.store.inspect(&b.id, true).await.unwrap().unwrap();
    assert_eq!(v.state, RecordState::Completed);
    assert_eq!(v.status, Some(201));
    assert_eq!(v.body_kept, Some(true));
    assert!(v.body.unwrap().contains("operator"));

    // Completed by its owner, kept or not: never overwritten, even forced.
    let c = claim("c", 1, 10_000);
    f.store.claim(&c).await.unwrap();
    assert!(f
        .store
        .record(&c.id, &c.owner, &response("upstream"))
        .await
        .unwrap());
    assert_eq!(
        f.store.complete(&c.id, &answer, true, false).await.unwrap(),
        Completed::AlreadyCompleted
    );
    assert_eq!(
        f.store.claim(&claim("c", 1, 10_000)).await.unwrap(),
        Claim::Replay(response("upstream"))
    );
    let d = claim("d", 1, 10_000);
    f.store.claim(&d).await.unwrap();
    assert!(f.store.record_not_kept(&d.id, &d.owner, 202).await.unwrap());
    assert_eq!(
        f.store.complete(&d.id, &answer, true, false).await.unwrap(),
        Completed::AlreadyCompleted
    );
    assert_eq!(
        f.store.claim(&claim("d", 1, 10_000)).await.unwrap(),
        Claim::NotKept { status: 202 }
    );
}

/// Every page of a walk with `count`, and how many calls it took.
async fn walk(
    store: &dyn Store,
    state: Option<RecordState>,
    count: usize,
) -> (Vec<idemgate::store::RecordView>, usize) {
    let (mut seen, mut cursor, mut calls) = (Vec::new(), String::new(), 0);
    loop {
        calls += 1;
        assert!(calls < 500, "the walk does not end");
        let page = store.list(state, &cursor, count).await.unwrap();
        seen.extend(page.records);
        match page.cursor {
            Some(next) => cursor = next,
            None => return (seen, calls),
        }
    }
}

async fn list_walks_every_record_in_bounded_pages(f: Fixture) {
    use std::collections::HashSet;
    let (mut completed, mut unknown, mut in_progress) =
        (HashSet::new(), HashSet::new(), HashSet::new());
    for i in 0..25 {
        let c = claim(&format!("walk-{i}"), 1, 60_000);
        assert_eq!(f.store.claim(&c).await.unwrap(), Claim::Claimed);
        let set = match i % 3 {
            0 => {
                assert!(f
                    .store
                    .record(&c.id, &c.owner, &response("w"))
                    .await
                    .unwrap());
                &mut completed
            }
            1 => {
                assert!(f.store.mark_unknown(&c.id, &c.owner).await.unwrap());
                &mut unknown
            }
            _ => &mut in_progress,
        };
        set.insert(c.id.to_string());
    }
    let all: HashSet<String> = completed
        .iter()
        .chain(&unknown)
        .chain(&in_progress)
        .cloned()
        .collect();
    assert_eq!(all.len(), 25);

    let (seen, calls) = walk(&*f.store, None, 7).await;
    let ids: HashSet<String> = seen.iter().map(|v| v.id.clone()).collect();
    assert_eq!(ids, all);
    assert!(
        calls > 1,
        "25 records in pages of about 7 took {calls} call"
    );
    for (state, want) in [
        (RecordState::Completed, &completed),
        (RecordState::Unknown, &unknown),
        (RecordState::InProgress, &in_progress),
    ] {
        let (seen, _) = walk(&*f.store, Some(state), 7).await;
        assert!(seen.iter().all(|v| v.state == state), "{seen:?}");
        let ids: HashSet<String> = seen.iter().map(|v| v.id.clone()).collect();
        assert_eq!(&ids, want, "{state:?}");
        assert!(seen.iter().all(|v| v.body.is_none()));
    }
    // A record that is gone is not shown.
    let gone = completed.iter().next().unwrap().clone();
    assert_eq!(
        f.store
            .delete(&RecordId::from_hex(&gone).unwrap(), true, false)
            .await
            .unwrap(),
        Deleted::Deleted
    );
    let (seen, _) = walk(&*f.store, None, 100).await;
    let ids: HashSet<String> = seen.iter().map(|v| v.id.clone()).collect();
    assert_eq!(ids.len(), 24);
    assert!(!ids.contains(&gone));
    assert!(f.store.list(None, "not-a-cursor", 7).await.is_err());
}

// Two versions of idemgate run side by side on one Redis during a rolling upgrade: each
// must read the records that the other writes. These are the claim and record scripts as
// idemgate ran them before they were made cheaper (the others did not change), run here
// by hand beside the current store.
const PREVIOUS_CLAIM: &str = r#"
local function now_ms() local t = redis.call('TIME') return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) end
local r = redis.call('HMGET', KEYS[1], 'st', 'fp', 'fv', 'lu', 'sc', 'hd', 'bd', 'bl')
if not r[1] then
  if redis.call('SISMEMBER', KEYS[2], ARGV[3]) == 1 then return {'withdrawn'} end
  local now = now_ms()
  redis.call('HSET', KEYS[1], 'st', 'p', 'fp', ARGV[1], 'fv', ARGV[2], 'ow', ARGV[3],
             'lu', now + tonumber(ARGV[4]), 'wu', now + tonumber(ARGV[6]), 'cr', now)
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
  return {'claimed'}
end
if r[3] ~= ARGV[2] then return {'version', r[3]} end
if r[2] ~= ARGV[1] then return {'mismatch'} end
if r[1] == 'c' and r[7] then return {'completed', r[5], r[6], r[7]} end
if r[1] == 'c' then return {'completed_large', r[5], r[6], r[8]} end
if r[1] == 'n' then return {'not_kept', r[5]} end
local now = now_ms()
if r[1] == 'p' and tonumber(r[4]) > now then return {'in_progress', tostring(tonumber(r[4]) - now)} end
return {'unknown'}
"#;

const PREVIOUS_RECORD: &str = r#"
if redis.call('HGET', KEYS[1], 'ow') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'st', 'c', 'sc', ARGV[2], 'hd', ARGV[3], 'bd', ARGV[4])
redis.call('HDEL', KEYS[1], 'lu')
return 1
"#;

/// The previous claim script, with the arguments idemgate gives it.
fn previous_claim(con: &mut ::redis::Connection, req: &ClaimRequest) -> Vec<Vec<u8>> {
    let record = format!("idemgate:{{{}}}", req.id);
    ::redis::cmd("EVAL")
        .arg(PREVIOUS_CLAIM)
        .arg(2)
        .arg(&record)
        .arg(format!("{record}:w"))
        .arg(req.fingerprint.to_hex())
        .arg(req.fingerprint_version)
        .arg(req.owner.as_str())
        .arg(req.lease.as_millis() as u64)
        .arg(req.retention.as_millis() as u64)
        .arg(req.busy_for.as_millis() as u64)
        .query(con)
        .unwrap()
}

fn previous_record(con: &mut ::redis::Connection, req: &ClaimRequest, r: &StoredResponse) -> i64 {
    let record = format!("idemgate:{{{}}}", req.id);
    ::redis::cmd("EVAL")
        .arg(PREVIOUS_RECORD)
        .arg(2)
        .arg(&record)
        .arg(format!("{record}:body"))
        .arg(req.owner.as_str())
        .arg(r.status.to_string())
        .arg(r.encode_headers())
        .arg(&r.body[..])
        .query(con)
        .unwrap()
}

/// Field name -> value of a record's hash.
fn fields(
    con: &mut ::redis::Connection,
    req: &ClaimRequest,
) -> std::collections::BTreeMap<String, Vec<u8>> {
    ::redis::cmd("HGETALL")
        .arg(format!("idemgate:{{{}}}", req.id))
        .query(con)
        .unwrap()
}

#[tokio::test]
async fn redis_records_are_read_alike_by_the_previous_scripts_and_the_current_ones() {
    let f = redis().await;
    let server = f._redis.as_ref().unwrap();
    let mut con = ::redis::Client::open(server.url())
        .unwrap()
        .get_connection_with_timeout(Duration::from_secs(5))
        .unwrap();
    let text = |v: &[u8]| String::from_utf8(v.to_vec()).unwrap();

    // Written by the previous scripts, read by the current store.
    let done = claim("previous-done", 1, 10_000);
    assert_eq!(previous_claim(&mut con, &done), [b"claimed".to_vec()]);
    assert_eq!(previous_record(&mut con, &done, &response("old")), 1);
    assert_eq!(
        f.store
            .claim(&claim("previous-done", 1, 10_000))
            .await
            .unwrap(),
        Claim::Replay(response("old"))
    );
    let v = f.store.inspect(&done.id, true).await.unwrap().unwrap();
    assert_eq!(v.state, RecordState::Completed);
    assert_eq!(v.status, Some(201));
    assert!(v.created_ms > 0 && v.lease_left_ms.is_none());
    assert!(v.body.unwrap().contains("old"));

    let busy = claim("previous-busy", 2, 10_000);
    assert_eq!(previous_claim(&mut con, &busy), [b"claimed".to_vec()]);
    match f
        .store
        .claim(&claim("previous-busy", 2, 10_000))
        .await
        .unwrap()
    {
        Claim::InFlight { lease_left } => {
            assert!(lease_left > Duration::ZERO && lease_left <= Duration::from_secs(10))
        }
        other => panic!("expected in flight, got {other:?}"),
    }
    let v = f.store.inspect(&busy.id, false).await.unwrap().unwrap();
    assert_eq!(v.state, RecordState::InProgress);
    assert!(v.lease_left_ms.is_some_and(|l| l > 0 && l <= 10_000));
    assert!(v.owner_busy_ms.is_some_and(|b| b > 0 && b <= 10_000));
    assert_eq!(
        f.store.delete(&busy.id, false, false).await.unwrap(),
        Deleted::OwnerBusy
    );
    assert!(f
        .store
        .renew(&busy.id, &busy.owner, Duration::from_secs(5))
        .await
        .unwrap());
    assert!(f
        .store
        .record(&busy.id, &busy.owner, &response("new"))
        .await
        .unwrap());
    assert_eq!(
        f.store
            .claim(&claim("previous-busy", 2, 10_000))
            .await
            .unwrap(),
        Claim::Replay(response("new"))
    );

    let lapsed = claim("previous-lapsed", 3, 1);
    assert_eq!(previous_claim(&mut con, &lapsed), [b"claimed".to_vec()]);
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(
        f.store
            .claim(&claim("previous-lapsed", 3, 1))
            .await
            .unwrap(),
        Claim::Unknown
    );

    // Written by the current store, read by the previous scripts.
    let current = claim("current", 4, 10_000);
    assert_eq!(f.store.claim(&current).await.unwrap(), Claim::Claimed);
    let other = claim("current", 4, 10_000);
    let reply = previous_claim(&mut con, &other);
    assert_eq!(text(&reply[0]), "in_progress");
    let left: u64 = text(&reply[1]).parse().unwrap();
    assert!(left > 0 && left <= 10_000, "{left}");
    // The same fields, and times as the same plain integers (milliseconds, Redis clock),
    // which the previous version's INSPECT hands to a parser of integers.
    let now = fields(&mut con, &current);
    let fresh = busy_fresh(&mut con);
    let before = fields(&mut con, &fresh);
    assert_eq!(
        now.keys().collect::<Vec<_>>(),
        before.keys().collect::<Vec<_>>()
    );
    for field in ["lu", "wu", "cr"] {
        let v = text(&now[field]);
        assert!(
            v.len() == 13 && v.bytes().all(|b| b.is_ascii_digit()),
            "{field} = {v}"
        );
    }
    assert!(f
        .store
        .record(&current.id, &current.owner, &response("cur"))
        .await
        .unwrap());
    let expected = response("cur");
    let reply = previous_claim(&mut con, &other);
    assert_eq!(text(&reply[0]), "completed");
    assert_eq!(text(&reply[1]), "201");
    assert_eq!(
        StoredResponse::decode_headers(&reply[2]),
        Some(expected.headers.clone())
    );
    assert_eq!(reply[3], expected.body.to_vec());
    // Nothing the previous version reads went missing from the completed record.
    let completed = fields(&mut con, &current);
    for field in ["st", "fp", "fv", "ow", "wu", "cr", "sc", "hd", "bd"] {
        assert!(completed.contains_key(field), "{field}");
    }
}

/// A record in progress, as the previous claim script writes it.
fn busy_fresh(con: &mut ::redis::Connection) -> ClaimRequest {
    let req = claim("previous-fresh", 5, 10_000);
    assert_eq!(previous_claim(con, &req), [b"claimed".to_vec()]);
    req
}
