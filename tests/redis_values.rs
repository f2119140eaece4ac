//! Records kept as one Redis string value each (`redis_record_format = "value"`), beside
//! the hash form: what each form reads of the other on one Redis, what turns a value into
//! its hash, what a new key and a replay cost in commands, and what a record takes in
//! memory. The contract common to every store runs on this form in `tests/store_contract.rs`.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use common::RedisServer;
use idemgate::fingerprint::Fingerprint;
use idemgate::key::RecordId;
use idemgate::store::{
    Claim, ClaimRequest, Deleted, OwnerToken, RecordState, RedisStore, Store, StoredResponse,
};

async fn store(server: &RedisServer, value_records: bool) -> RedisStore {
    server.store(value_records).await
}

fn con(server: &RedisServer) -> redis::Connection {
    redis::Client::open(server.url())
        .unwrap()
        .get_connection_with_timeout(Duration::from_secs(5))
        .unwrap()
}

fn claim(n: u8, fp: u8, lease_ms: u64) -> ClaimRequest {
    ClaimRequest {
        id: RecordId::from_bytes([n; 32]),
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

fn answer(body: Vec<u8>) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![
            (
                "content-type".into(),
                Bytes::from_static(b"application/json"),
            ),
            ("x-binary".into(), Bytes::from_static(b"\x00\x80\xff")),
        ],
        body: Bytes::from(body),
    }
}

fn key(req: &ClaimRequest) -> String {
    format!("idemgate:{{{}}}", req.id)
}

fn kind(con: &mut redis::Connection, req: &ClaimRequest) -> String {
    redis::cmd("TYPE").arg(key(req)).query(con).unwrap()
}

/// Calls per command from `INFO commandstats`.
fn calls(con: &mut redis::Connection) -> HashMap<String, u64> {
    let info: String = redis::cmd("INFO").arg("commandstats").query(con).unwrap();
    info.lines()
        .filter_map(|l| {
            let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(':')?;
            let n = rest
                .strip_prefix("calls=")?
                .split(',')
                .next()?
                .parse()
                .ok()?;
            Some((name.to_string(), n))
        })
        .collect()
}

#[tokio::test]
async fn both_forms_on_one_redis_read_each_other() {
    let server = RedisServer::start();
    let (hash, value) = (store(&server, false).await, store(&server, true).await);
    let mut con = con(&server);

    // Claimed as a value: the other form sees it in progress, a mismatch, then replays it.
    let v = claim(1, 1, 10_000);
    assert_eq!(value.claim(&v).await.unwrap(), Claim::Claimed);
    assert_eq!(kind(&mut con, &v), "string");
    match hash.claim(&claim(1, 1, 10_000)).await.unwrap() {
        Claim::InFlight { lease_left } => {
            assert!(lease_left > Duration::ZERO && lease_left <= Duration::from_secs(10))
        }
        other => panic!("expected in flight, got {other:?}"),
    }
    assert_eq!(
        hash.claim(&claim(1, 2, 10_000)).await.unwrap(),
        Claim::Mismatch
    );
    let mut other_version = claim(1, 1, 10_000);
    other_version.fingerprint_version = 2;
    assert_eq!(
        value.claim(&other_version).await.unwrap(),
        Claim::OtherVersion(1)
    );
    let a = answer(b"{\"id\":\"tr_1\",\"nul\":\"\\u0000\"}".to_vec());
    assert!(value.record(&v.id, &v.owner, &a).await.unwrap());
    assert_eq!(kind(&mut con, &v), "string");
    for s in [&hash, &value] {
        assert_eq!(
            s.claim(&claim(1, 1, 10_000)).await.unwrap(),
            Claim::Replay(a.clone())
        );
        assert_eq!(
            s.claim(&claim(1, 2, 10_000)).await.unwrap(),
            Claim::Mismatch
        );
    }

    // Claimed as a hash: the value form reads it through its script.
    let h = claim(2, 1, 10_000);
    assert_eq!(hash.claim(&h).await.unwrap(), Claim::Claimed);
    assert_eq!(kind(&mut con, &h), "hash");
    assert!(matches!(
        value.claim(&claim(2, 1, 10_000)).await.unwrap(),
        Claim::InFlight { .. }
    ));
    assert!(hash.record(&h.id, &h.owner, &a).await.unwrap());
    assert_eq!(
        value.claim(&claim(2, 1, 10_000)).await.unwrap(),
        Claim::Replay(a.clone())
    );
    assert_eq!(kind(&mut con, &h), "hash", "a hash is never made a value");

    // A hash-writing instance's late record on a key that is now another claim's value
    // is refused, as any record by a former owner.
    let gone = claim(3, 1, 10_000);
    assert_eq!(hash.claim(&gone).await.unwrap(), Claim::Claimed);
    assert_eq!(
        hash.delete(&gone.id, true, false).await.unwrap(),
        Deleted::Deleted
    );
    let now = claim(3, 1, 10_000);
    assert_eq!(value.claim(&now).await.unwrap(), Claim::Claimed);
    assert!(!hash.record(&gone.id, &gone.owner, &a).await.unwrap());
    assert!(value.record(&now.id, &now.owner, &a).await.unwrap());

    // Both forms are listed and inspected alike.
    for s in [&hash, &value] {
        let page = s.list(Some(RecordState::Completed), "", 100).await.unwrap();
        assert_eq!(page.records.len(), 3, "{:?}", page.records);
        let seen = s.inspect(&v.id, true).await.unwrap().unwrap();
        assert_eq!(seen.state, RecordState::Completed);
        assert_eq!(seen.status, Some(201));
        assert_eq!(seen.body_kept, Some(true));
        assert_eq!(
            seen.body.as_deref(),
            Some("{\"id\":\"tr_1\",\"nul\":\"\\u0000\"}")
        );
        assert_eq!(seen.fingerprint, "01".repeat(32));
        assert!(seen.ttl_ms.is_some_and(|t| t > 50_000 && t <= 60_000));
    }
}

#[tokio::test]
async fn a_value_keeps_its_lease_and_times_on_the_redis_clock() {
    let server = RedisServer::start();
    let value = store(&server, true).await;
    let mut con = con(&server);
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let c = claim(1, 1, 400);
    assert_eq!(value.claim(&c).await.unwrap(), Claim::Claimed);
    let seen = value.inspect(&c.id, false).await.unwrap().unwrap();
    assert_eq!(seen.state, RecordState::InProgress);
    assert!(
        seen.lease_left_ms.is_some_and(|l| l > 0 && l <= 400),
        "{seen:?}"
    );
    assert!(
        seen.owner_busy_ms.is_some_and(|l| l > 0 && l <= 400),
        "{seen:?}"
    );
    // The same clock as this machine's: one Redis on loopback.
    assert!(
        seen.created_ms + 50 >= before && seen.created_ms <= before + 1_000,
        "{seen:?}"
    );
    // A renewal moves the lease, and the record stays a value.
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert!(value
        .renew(&c.id, &c.owner, Duration::from_millis(400))
        .await
        .unwrap());
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert!(matches!(
        value.claim(&claim(1, 1, 400)).await.unwrap(),
        Claim::InFlight { lease_left } if lease_left <= Duration::from_millis(400)
    ));
    assert_eq!(kind(&mut con, &c), "string");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        value.claim(&claim(1, 1, 400)).await.unwrap(),
        Claim::Unknown
    );
    assert!(!value
        .renew(&c.id, &OwnerToken::random(), Duration::from_secs(1))
        .await
        .unwrap());
    // Shortened, its creation time stays where it was.
    let s = claim(2, 1, 10_000);
    assert_eq!(value.claim(&s).await.unwrap(), Claim::Claimed);
    let created = value
        .inspect(&s.id, false)
        .await
        .unwrap()
        .unwrap()
        .created_ms;
    assert!(value
        .record(&s.id, &s.owner, &answer(b"{}".to_vec()))
        .await
        .unwrap());
    assert!(value
        .shorten(&s.id, &s.owner, Duration::from_secs(5))
        .await
        .unwrap());
    let seen = value.inspect(&s.id, false).await.unwrap().unwrap();
    assert!(seen.ttl_ms.is_some_and(|t| t <= 5_000), "{seen:?}");
    assert!(
        seen.created_ms.abs_diff(created) <= 2,
        "{created} then {seen:?}"
    );
    assert_eq!(kind(&mut con, &s), "string");
}

#[tokio::test]
async fn what_a_value_cannot_hold_turns_it_into_its_hash() {
    let server = RedisServer::start();
    let (hash, value) = (store(&server, false).await, store(&server, true).await);
    let mut con = con(&server);

    // An answer over 16 KiB: the record becomes a hash with it, and replays from both.
    let big = claim(1, 1, 10_000);
    assert_eq!(value.claim(&big).await.unwrap(), Claim::Claimed);
    let body: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    let a = answer(body);
    assert!(value.record(&big.id, &big.owner, &a).await.unwrap());
    assert_eq!(kind(&mut con, &big), "hash");
    for s in [&hash, &value] {
        assert_eq!(
            s.claim(&claim(1, 1, 10_000)).await.unwrap(),
            Claim::Replay(a.clone())
        );
    }
    let ttl: i64 = redis::cmd("PTTL").arg(key(&big)).query(&mut con).unwrap();
    assert!(
        ttl > 50_000 && ttl <= 60_000,
        "the expiry went with it: {ttl}"
    );

    // An owner's release: the value goes, and its withdrawal note stays (a hash), so
    // that this owner's late claim creates nothing while another's claims anew.
    let gone = claim(2, 1, 10_000);
    assert!(!value
        .release(&gone.id, &gone.owner, Duration::from_secs(5))
        .await
        .unwrap());
    assert_eq!(value.claim(&gone).await.unwrap(), Claim::Withdrawn);
    let mine = claim(3, 1, 10_000);
    assert_eq!(value.claim(&mine).await.unwrap(), Claim::Claimed);
    assert!(value
        .release(&mine.id, &mine.owner, Duration::from_secs(5))
        .await
        .unwrap());
    assert_eq!(
        kind(&mut con, &mine),
        "none",
        "an owner's release leaves no note"
    );
    // Another owner's claim over the first one's notes: a hash, which its record writes as
    // such.
    let anew = claim(2, 1, 10_000);
    assert_eq!(value.claim(&anew).await.unwrap(), Claim::Claimed);
    assert_eq!(kind(&mut con, &anew), "hash");
    let small = answer(br#"{"id":"tr_3"}"#.to_vec());
    assert!(value.record(&anew.id, &anew.owner, &small).await.unwrap());
    assert_eq!(
        value.claim(&claim(2, 1, 10_000)).await.unwrap(),
        Claim::Replay(small)
    );

    // In progress: an operator's delete waits for the owner, marking unknown keeps the
    // value, a forced delete frees the key.
    let busy = claim(4, 1, 10_000);
    assert_eq!(value.claim(&busy).await.unwrap(), Claim::Claimed);
    assert_eq!(
        value.delete(&busy.id, false, false).await.unwrap(),
        Deleted::OwnerBusy
    );
    assert_eq!(kind(&mut con, &busy), "hash", "read through its hash");
    let marked = claim(5, 1, 10_000);
    assert_eq!(value.claim(&marked).await.unwrap(), Claim::Claimed);
    assert!(value.mark_unknown(&marked.id, &marked.owner).await.unwrap());
    assert_eq!(kind(&mut con, &marked), "string");
    assert_eq!(
        hash.claim(&claim(5, 1, 10_000)).await.unwrap(),
        Claim::Unknown
    );
    assert!(!value
        .record(&marked.id, &OwnerToken::random(), &a)
        .await
        .unwrap());
    assert_eq!(
        value.delete(&marked.id, false, false).await.unwrap(),
        Deleted::Deleted
    );
    assert_eq!(
        value.claim(&claim(5, 1, 10_000)).await.unwrap(),
        Claim::Claimed
    );
}

/// Item 3's structure in counts noise cannot move: a new key is one bare `SET` and one
/// script, a replay one bare `SET`.
#[tokio::test]
async fn a_new_key_is_one_bare_command_and_one_script_and_a_replay_one_bare_command() {
    let server = RedisServer::start();
    let value = store(&server, true).await;
    let mut con = con(&server);
    let before = calls(&mut con);
    let c = claim(1, 1, 10_000);
    assert_eq!(value.claim(&c).await.unwrap(), Claim::Claimed);
    assert!(value
        .record(&c.id, &c.owner, &answer(b"{}".to_vec()))
        .await
        .unwrap());
    for _ in 0..10 {
        assert!(matches!(
            value.claim(&claim(1, 1, 10_000)).await.unwrap(),
            Claim::Replay(_)
        ));
    }
    let after = calls(&mut con);
    let delta = |n: &str| after.get(n).unwrap_or(&0) - before.get(n).unwrap_or(&0);
    // Eleven bare SETs, and the one the record's script runs.
    assert_eq!(delta("set"), 12, "{after:?}");
    assert_eq!(delta("get"), 1, "the record's owner check: {after:?}");
    assert_eq!(delta("evalsha"), 1, "{after:?}");
    assert_eq!(delta("eval"), 0, "{after:?}");
}

/// Item 7: a completed record of a 1 KiB JSON answer takes at most 1.3x its size + 120 B
/// (`MEMORY USAGE ... SAMPLES 0`, everything counted), where its hash takes far more.
#[tokio::test]
async fn a_1_kib_answer_kept_as_a_value_takes_at_most_1_3x_its_size_plus_120_bytes() {
    let server = RedisServer::start();
    let (hash, value) = (store(&server, false).await, store(&server, true).await);
    let mut con = con(&server);
    let mut body = b"{\"id\":\"tr_1\",\"memo\":\"".to_vec();
    body.resize(1022, b'x');
    body.extend_from_slice(b"\"}");
    let a = StoredResponse {
        status: 201,
        headers: vec![(
            "content-type".into(),
            Bytes::from_static(b"application/json"),
        )],
        body: Bytes::from(body),
    };
    let mut usage = Vec::new();
    for (n, s) in [(1u8, &value), (2, &hash)] {
        let c = claim(n, 1, 10_000);
        assert_eq!(s.claim(&c).await.unwrap(), Claim::Claimed);
        assert!(s.record(&c.id, &c.owner, &a).await.unwrap());
        let bytes: u64 = redis::cmd("MEMORY")
            .arg("USAGE")
            .arg(key(&c))
            .arg("SAMPLES")
            .arg(0)
            .query(&mut con)
            .unwrap();
        usage.push(bytes);
    }
    let bound = (1.3 * 1024.0 + 120.0) as u64;
    eprintln!(
        "1 KiB answer: value {} B, hash {} B (bound {bound} B)",
        usage[0], usage[1]
    );
    assert!(usage[0] <= bound, "value {} B > {bound} B", usage[0]);
    assert!(usage[1] > usage[0]);
}

/// A value-writing instance refuses a Redis that cannot claim with `SET ... NX GET`.
#[tokio::test]
async fn value_records_say_which_redis_they_need() {
    // This machine's redis-server is 7.x: the version is read, and accepted.
    let server = RedisServer::start();
    let _ = store(&server, true).await;
    let mut con = con(&server);
    let info: String = redis::cmd("INFO").arg("server").query(&mut con).unwrap();
    assert!(info.contains("redis_version:7") || info.contains("redis_version:8"));
}

/// Room for replay bodies that holds nothing yet, and grants (or not) what it is asked.
struct Room(bool, std::sync::atomic::AtomicUsize);

impl idemgate::store::BodyRoom for Room {
    fn reserve(&self, len: usize) -> bool {
        if self.0 {
            self.1.store(len, std::sync::atomic::Ordering::SeqCst);
        }
        self.0
    }
    fn held(&self) -> usize {
        self.1.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// A claim that holds no room for a replay's body goes through the script, which creates
/// a value too, and brings a body only once room is found for it.
#[tokio::test]
async fn a_claim_without_room_reads_no_body_before_it_has_room() {
    let server = RedisServer::start();
    let value = store(&server, true).await;
    let mut con = con(&server);
    let room = |grant: bool| {
        Some(idemgate::store::ReplayRoom(std::sync::Arc::new(Room(
            grant,
            0.into(),
        ))))
    };
    let mut c = claim(1, 1, 10_000);
    c.room = room(false);
    assert_eq!(value.claim(&c).await.unwrap(), Claim::Claimed);
    assert_eq!(kind(&mut con, &c), "string");
    let a = answer(b"{\"id\":\"tr_9\"}".to_vec());
    assert!(value.record(&c.id, &c.owner, &a).await.unwrap());
    let before = calls(&mut con);
    let mut again = claim(1, 1, 10_000);
    again.room = room(false);
    assert_eq!(
        value.claim(&again).await.unwrap(),
        Claim::NoRoom { status: 201 }
    );
    let gets = |con: &mut redis::Connection| {
        calls(con).get("get").unwrap_or(&0) - before.get("get").unwrap_or(&0)
    };
    // The script's own GET inside Redis; the body is not sent, nor read again.
    assert_eq!(gets(&mut con), 1, "the body was not read");
    again.room = room(true);
    assert_eq!(value.claim(&again).await.unwrap(), Claim::Replay(a));
    // The script's, and the body's once room was found.
    assert_eq!(gets(&mut con), 3);
}
