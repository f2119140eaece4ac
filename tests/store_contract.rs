//! One contract, two stores: every test here runs against the embedded store and against a
//! real redis-server, through the `Store` trait only.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::RedisServer;
use idemgate::fingerprint::Fingerprint;
use idemgate::key::{IdempotencyKey, RecordId};
use idemgate::scope::{ScopeSecret, Scoper, Tenant};
use idemgate::store::{
    Claim, ClaimRequest, Deleted, MemoryStore, OwnerToken, RecordState, RedisStore, Store,
    StoreError, StoredResponse,
};

struct Fixture {
    store: Arc<dyn Store>,
    _redis: Option<RedisServer>,
}

async fn memory() -> Fixture {
    Fixture {
        store: Arc::new(MemoryStore::new(1000)),
        _redis: None,
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
        mod on_redis {
            $( #[tokio::test] async fn $name() { super::$name(super::redis().await).await } )*
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
    concurrent_claims_have_one_winner,
    inspect_shows_state_without_body_unless_asked,
    a_claim_that_arrives_after_its_release_creates_nothing,
    operator_delete_refuses_while_the_owner_may_be_working,
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
        f.store.delete(&a.id, false).await.unwrap(),
        Deleted::OwnerBusy
    );
    assert!(f.store.inspect(&a.id, false).await.unwrap().is_some());
    assert_eq!(f.store.delete(&a.id, true).await.unwrap(), Deleted::Deleted);

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
        f.store.delete(&b.id, false).await.unwrap(),
        Deleted::OwnerBusy
    );
    // Once the owner has given up for sure, an unforced release goes through.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let v = f.store.inspect(&b.id, false).await.unwrap().unwrap();
    assert_eq!(v.state, RecordState::Unknown);
    assert_eq!(v.owner_busy_ms, None);
    assert_eq!(
        f.store.delete(&b.id, false).await.unwrap(),
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
        f.store.delete(&c.id, false).await.unwrap(),
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
        f.store.delete(&d.id, false).await.unwrap(),
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
        f.store.delete(&a.id, false).await.unwrap(),
        Deleted::Deleted
    );
    assert_eq!(
        f.store.delete(&a.id, false).await.unwrap(),
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
