#![allow(clippy::unwrap_used)]
use super::*;

#[tokio::test]
async fn a_record_does_not_keep_the_buffer_its_body_came_from() {
    let store = MemoryStore::new(10);
    let id = RecordId::from_hex(&"07".repeat(32)).expect("hex");
    let req = ClaimRequest::for_test(id, Fingerprint([1; 32]));
    assert_eq!(store.claim(&req).await.ok(), Some(Claim::Claimed));
    let buffer = Bytes::from(vec![b'x'; 8192]);
    let response = StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), buffer.slice(0..16))],
        body: buffer.slice(16..80),
    };
    assert_eq!(
        store.record(&req.id, &req.owner, &response).await.ok(),
        Some(true)
    );
    let Ok(Claim::Replay(stored)) = store.claim(&req).await else {
        panic!("expected a replay");
    };
    assert_eq!(stored, response);
    let range = buffer.as_ptr_range();
    assert!(!range.contains(&stored.body.as_ptr()));
    assert!(!range.contains(&stored.headers[0].1.as_ptr()));
}

/// A claim for an id whose first four bytes are `n`: its record is in shard
/// `n % SHARDS`.
fn claim_req(n: u32, retention: Duration) -> ClaimRequest {
    let mut id = [0u8; 32];
    id[..4].copy_from_slice(&n.to_be_bytes());
    let id = RecordId::from_hex(&hex::encode(id)).expect("hex");
    ClaimRequest {
        retention,
        ..ClaimRequest::for_test(id, Fingerprint([1; 32]))
    }
}

const SHORT: Duration = Duration::from_millis(30);
const LONG: Duration = Duration::from_secs(600);
/// Comfortably past `SHORT`, even on a loaded machine.
const PAST_SHORT: Duration = Duration::from_millis(80);

#[tokio::test]
async fn sweep_removes_exactly_the_expired_records() {
    let store = MemoryStore::new(100_000);
    // More expiring records than one batch, so the sweep has to come back for more.
    let expiring = EXPIRE_BATCH as u32 * 2 + 10;
    for n in 0..expiring {
        assert_eq!(
            store.claim(&claim_req(n, SHORT)).await.ok(),
            Some(Claim::Claimed)
        );
    }
    let live: Vec<_> = (1_000_000..1_000_020).map(|n| claim_req(n, LONG)).collect();
    for req in &live {
        assert_eq!(store.claim(req).await.ok(), Some(Claim::Claimed));
    }
    // Released with a long retention, then made again with a short one: the released
    // incarnation's expiry must not keep the new one alive, nor be left in the index.
    let again = claim_req(2_000_000, LONG);
    assert_eq!(store.claim(&again).await.ok(), Some(Claim::Claimed));
    assert_eq!(
        store.release(&again.id, &again.owner, SHORT).await.ok(),
        Some(true)
    );
    let again = claim_req(2_000_000, SHORT);
    assert_eq!(store.claim(&again).await.ok(), Some(Claim::Claimed));

    tokio::time::sleep(PAST_SHORT).await;
    // Made again under the ids of records that have expired (not yet swept), now with a
    // long retention: the first incarnations' expiry must not take the new ones along.
    let reborn: Vec<_> = (0..5).map(|n| claim_req(n, LONG)).collect();
    for req in &reborn {
        assert_eq!(store.claim(req).await.ok(), Some(Claim::Claimed));
    }
    assert_eq!(store.len(), expiring as usize + live.len() + 1);

    let left = store.sweep();
    assert_eq!(left, live.len() + reborn.len());
    assert_eq!(store.len(), left);
    assert_eq!(store.map_len(), left);
    assert_eq!(store.index_len(), left);
    for req in live.iter().chain(&reborn) {
        let view = store.inspect(&req.id, false).await.ok().flatten();
        assert!(view.is_some_and(|v| v.state == RecordState::InProgress));
    }
    for n in [5, expiring - 1, 2_000_000] {
        let req = claim_req(n, LONG);
        assert!(store.inspect(&req.id, false).await.ok().flatten().is_none());
    }
    // Nothing more to do; the reborn records stay.
    assert_eq!(store.sweep(), left);
}

#[tokio::test]
async fn at_the_cap_a_claim_makes_room_from_expired_records_only() {
    let store = MemoryStore::new(3);
    // Each in a shard of its own: the claims at the cap below find nothing expired in
    // their own shards, and have to make room in others.
    assert_eq!(shard_of(&claim_req(1, LONG).id), 1);
    assert_eq!(shard_of(&claim_req(6, LONG).id), 6);
    for (n, retention) in [(1, SHORT), (2, SHORT), (3, LONG)] {
        assert_eq!(
            store.claim(&claim_req(n, retention)).await.ok(),
            Some(Claim::Claimed)
        );
    }
    // Full, and none expired yet.
    assert!(matches!(
        store.claim(&claim_req(4, LONG)).await,
        Err(StoreError::Full(_))
    ));
    tokio::time::sleep(PAST_SHORT).await;
    // Two have expired; no sweep has run: the claims take their places.
    assert_eq!(
        store.claim(&claim_req(4, LONG)).await.ok(),
        Some(Claim::Claimed)
    );
    assert_eq!(
        store.claim(&claim_req(5, LONG)).await.ok(),
        Some(Claim::Claimed)
    );
    assert_eq!(store.len(), 3);
    assert_eq!(store.map_len(), 3);
    assert_eq!(store.index_len(), 3);
    // Full of live records again.
    assert!(matches!(
        store.claim(&claim_req(6, LONG)).await,
        Err(StoreError::Full(_))
    ));
    for n in [3, 4, 5] {
        let req = claim_req(n, LONG);
        assert!(store.inspect(&req.id, false).await.ok().flatten().is_some());
    }
}

#[tokio::test]
async fn the_expiry_index_does_not_outgrow_the_records() {
    let store = MemoryStore::new(100);
    for n in 0..20_000 {
        let req = claim_req(n, LONG);
        assert_eq!(store.claim(&req).await.ok(), Some(Claim::Claimed));
        assert_eq!(
            store.release(&req.id, &req.owner, SHORT).await.ok(),
            Some(true)
        );
        let req = claim_req(n + 1_000_000, LONG);
        assert_eq!(store.claim(&req).await.ok(), Some(Claim::Claimed));
        assert_eq!(
            store.delete(&req.id, true, false).await.ok(),
            Some(Deleted::Deleted)
        );
        assert!(store.index_len() <= 1);
    }
    assert_eq!(store.len(), 0);
    assert_eq!(store.map_len(), 0);
    assert_eq!(store.index_len(), 0);
    // The same id made again and again after each incarnation expired.
    for _ in 0..5 {
        assert_eq!(
            store.claim(&claim_req(7, SHORT)).await.ok(),
            Some(Claim::Claimed)
        );
        tokio::time::sleep(PAST_SHORT).await;
    }
    assert_eq!(store.len(), 1);
    assert_eq!(store.map_len(), 1);
    assert_eq!(store.index_len(), 1);
    assert_eq!(store.sweep(), 0);
    assert_eq!(store.map_len(), 0);
    assert_eq!(store.index_len(), 0);
}

#[tokio::test]
async fn at_the_cap_a_claim_makes_room_in_its_own_shard() {
    let store = MemoryStore::new(2);
    let n = SHARDS as u32;
    // All in shard 5.
    assert_eq!(
        store.claim(&claim_req(5, SHORT)).await.ok(),
        Some(Claim::Claimed)
    );
    assert_eq!(
        store.claim(&claim_req(5 + n, LONG)).await.ok(),
        Some(Claim::Claimed)
    );
    assert!(matches!(
        store.claim(&claim_req(5 + 2 * n, LONG)).await,
        Err(StoreError::Full(_))
    ));
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(
        store.claim(&claim_req(5 + 2 * n, LONG)).await.ok(),
        Some(Claim::Claimed)
    );
    assert_eq!(store.len(), 2);
    assert_eq!(store.map_len(), 2);
    assert_eq!(store.index_len(), 2);
    // An expired record is replaced by a claim under its own id, at the cap, without
    // taking any other record's place.
    let store = MemoryStore::new(2);
    for (m, retention) in [(5, SHORT), (6, LONG)] {
        assert_eq!(
            store.claim(&claim_req(m, retention)).await.ok(),
            Some(Claim::Claimed)
        );
    }
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(
        store.claim(&claim_req(5, LONG)).await.ok(),
        Some(Claim::Claimed)
    );
    assert_eq!(store.len(), 2);
    assert_eq!(store.map_len(), 2);
    assert_eq!(store.index_len(), 2);
}

#[tokio::test]
async fn the_cap_holds_across_shards() {
    let store = MemoryStore::new(10);
    let reqs: Vec<_> = (0..10).map(|n| claim_req(n, LONG)).collect();
    let shards: std::collections::HashSet<_> = reqs.iter().map(|r| shard_of(&r.id)).collect();
    assert_eq!(shards.len(), 10);
    for req in &reqs {
        assert_eq!(store.claim(req).await.ok(), Some(Claim::Claimed));
    }
    // The eleventh, in a shard that holds nothing yet, and in one that holds a record.
    let fresh = claim_req(10, LONG);
    let crowded = claim_req(SHARDS as u32, LONG);
    assert!(!shards.contains(&shard_of(&fresh.id)));
    assert_eq!(shard_of(&crowded.id), shard_of(&reqs[0].id));
    for req in [&fresh, &crowded] {
        assert!(matches!(store.claim(req).await, Err(StoreError::Full(_))));
    }
    assert_eq!(store.len(), 10);
    assert_eq!(store.map_len(), 10);

    // A release frees a slot for a claim in any shard, and for one claim only.
    assert_eq!(
        store.release(&reqs[3].id, &reqs[3].owner, SHORT).await.ok(),
        Some(true)
    );
    assert_eq!(store.len(), 9);
    assert_eq!(store.claim(&fresh).await.ok(), Some(Claim::Claimed));
    assert!(matches!(
        store.claim(&crowded).await,
        Err(StoreError::Full(_))
    ));
    // So does a delete.
    assert_eq!(
        store.delete(&reqs[7].id, true, false).await.ok(),
        Some(Deleted::Deleted)
    );
    assert_eq!(store.claim(&crowded).await.ok(), Some(Claim::Claimed));
    assert!(matches!(
        store.claim(&claim_req(11, LONG)).await,
        Err(StoreError::Full(_))
    ));
    assert_eq!(store.len(), 10);
    assert_eq!(store.map_len(), 10);
    assert_eq!(store.index_len(), 10);
}

#[test]
fn concurrent_claims_on_all_shards_never_pass_the_cap() {
    let store = MemoryStore::new(300);
    let claimed = std::thread::scope(|s| {
        let threads: Vec<_> = (0..4u32)
            .map(|t| {
                let store = store.clone();
                s.spawn(move || {
                    (0..200u32)
                        .filter(|n| {
                            let req = claim_req(t * 1000 + n, LONG);
                            matches!(store.claim_now(&req), Ok(Claim::Claimed))
                        })
                        .count()
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().unwrap())
            .sum::<usize>()
    });
    assert_eq!(claimed, 300);
    assert_eq!(store.len(), 300);
    assert_eq!(store.map_len(), 300);
    assert_eq!(store.index_len(), 300);
}
