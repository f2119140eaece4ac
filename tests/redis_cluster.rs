//! idemgate on a Redis Cluster of three primaries and three replicas: records spread over
//! every primary, a slot migration (ASK, then MOVED), new keys of slots held migrating, a
//! primary killed mid-traffic and a primary frozen are survived, and no key executes twice.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::topology::{redis_base, Cluster};
use common::*;
use idemgate::Config;

fn cluster_config(up: &Upstream, cluster: &Cluster) -> Config {
    let mut c = redis_base(up);
    // One seed is enough; the rest is discovered.
    c.redis_cluster_nodes = vec![cluster.addrs()[0].clone()];
    c.admin_listen = Some("127.0.0.1:0".parse().unwrap());
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_spread_over_every_primary_and_replay() {
    let cluster = Cluster::start();
    let up = Upstream::start().await;
    let app = spawn_app(cluster_config(&up, &cluster)).await;
    let client = client();
    const KEYS: usize = 300;
    for i in 0..KEYS {
        let a = post(&client, &app, "/pay", Some(&format!("k-{i}")), "{}", &[]).await;
        assert_eq!(a.status, 201, "{:?}", a.body);
    }
    for i in (0..KEYS).step_by(7) {
        let a = post(&client, &app, "/pay", Some(&format!("k-{i}")), "{}", &[]).await;
        assert!(a.replayed(), "k-{i}: {} {:?}", a.status, a.body);
    }
    assert_eq!(up.hits(), KEYS);
    let per_primary = cluster.keys_per_primary();
    assert_eq!(per_primary.len(), 3);
    let total: u64 = per_primary.iter().map(|(_, n)| n).sum();
    assert_eq!(total, KEYS as u64);
    for (node, n) in &per_primary {
        // Uniform over three primaries: about 100 each; 50 is far outside chance.
        assert!(
            *n >= 50,
            "primary {node} holds {n} of {KEYS}: {per_primary:?}"
        );
    }
    eprintln!("keys per primary over {KEYS} keys: {per_primary:?}");
    app.shutdown().await;
}

/// The slot that holds a record moves to another primary: while it is being migrated the
/// old owner answers ASK, afterwards every node answers MOVED. Retries replay throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_migration_is_followed_through_ask_and_moved() {
    slot_migration(false).await;
}

/// The same with records kept as one value (`redis_record_format = "value"`): the bare
/// claim follows ASK and MOVED too, and a claim of a record in progress (a script) as well.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn value_records_follow_a_slot_migration() {
    slot_migration(true).await;
}

async fn slot_migration(values: bool) {
    let cluster = Cluster::start();
    let up = Upstream::start().await;
    let mut config = cluster_config(&up, &cluster);
    if values {
        config.redis_record_format = idemgate::config::RedisRecordFormat::Value;
    }
    let app = spawn_app(config).await;
    let client = client();
    if values {
        // A record in progress, asked for while it runs: the claim script reads the value.
        let (done, busy) = post_and_retry_while_running(&client, &app, &up, "/pay", "slow").await;
        assert_eq!(done.status, 201);
        assert_eq!(busy.status, 409, "{:?}", busy.body);
        let again = post(&client, &app, "/pay", Some("slow"), "{}", &[]).await;
        assert!(again.replayed(), "{} {:?}", again.status, again.body);
        assert_eq!(up.hits(), 1);
    }
    let hits = up.hits();
    // The records there before this one (the slow key's), which do not move.
    let before: Vec<String> = cluster
        .primaries()
        .into_iter()
        .filter_map(|i| cluster.nodes[i].cli(&["--scan", "--pattern", "idemgate:{*"]))
        .flat_map(|keys| {
            keys.lines()
                .map(|k| k.trim().to_string())
                .collect::<Vec<_>>()
        })
        .collect();
    let first = post(&client, &app, "/pay", Some("moving"), "{}", &[]).await;
    assert_eq!(first.status, 201);
    let (src, key) = cluster
        .primaries()
        .into_iter()
        .find_map(|i| {
            let keys = cluster.nodes[i].cli(&["--scan", "--pattern", "idemgate:{*"])?;
            keys.lines()
                .map(|k| k.trim().to_string())
                .find(|k| !k.is_empty() && !before.contains(k))
                .map(|k| (i, k))
        })
        .expect("the record on some primary");
    if values {
        let kind = cluster.nodes[src].cli(&["TYPE", &key]).unwrap();
        assert_eq!(kind.trim(), "string");
    }
    let dst = *cluster.primaries().iter().find(|i| **i != src).unwrap();
    let slot = cluster.nodes[src]
        .cli(&["CLUSTER", "KEYSLOT", &key])
        .unwrap();
    let slot = slot.trim();
    let id = |i: usize| {
        cluster.nodes[i]
            .cli(&["CLUSTER", "MYID"])
            .unwrap()
            .trim()
            .to_string()
    };
    let (src_id, dst_id) = (id(src), id(dst));
    let ok = |r: Option<String>| assert_eq!(r.as_deref().map(str::trim), Some("OK"));
    ok(cluster.nodes[dst].cli(&["CLUSTER", "SETSLOT", slot, "IMPORTING", &src_id]));
    ok(cluster.nodes[src].cli(&["CLUSTER", "SETSLOT", slot, "MIGRATING", &dst_id]));
    let dst_port = cluster.nodes[dst].port.to_string();
    ok(cluster.nodes[src].cli(&["MIGRATE", "127.0.0.1", &dst_port, &key, "0", "5000"]));
    // Mid-migration: the record is on dst, src answers ASK, and the claim (one key: the
    // record, with its withdrawal notes inside) follows it.
    let during = post(&client, &app, "/pay", Some("moving"), "{}", &[]).await;
    assert!(during.replayed(), "{} {:?}", during.status, during.body);
    assert_eq!(during.body, first.body);
    for i in cluster.primaries() {
        ok(cluster.nodes[i].cli(&["CLUSTER", "SETSLOT", slot, "NODE", &dst_id]));
    }
    let after = post(&client, &app, "/pay", Some("moving"), "{}", &[]).await;
    assert!(after.replayed(), "{} {:?}", after.status, after.body);
    assert_eq!(after.body, first.body);
    assert_eq!(up.hits(), hits + 1);
    // The source no longer has it; the destination does.
    let on = |i: usize| {
        cluster.nodes[i]
            .cli(&["--scan", "--pattern", "idemgate:{*"])
            .unwrap()
    };
    assert!(!on(src).contains(&key));
    assert!(on(dst).contains(&key));
    app.shutdown().await;
}

/// One primary is killed (SIGKILL) while clients send and retry; its replica takes over,
/// and the killed node comes back as the new primary's replica. With `min_replicas_ack = 1`
/// every claim that was forwarded is on the replica, so no key executes twice; during the
/// switch clients see 503 `store-unavailable` (or 409).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_killed_mid_traffic() {
    let mut cluster = Cluster::start();
    let up = Upstream::start().await;
    let mut cfg = cluster_config(&up, &cluster);
    cfg.min_replicas_ack = 1;
    cfg.replica_ack_timeout = Duration::from_millis(200);
    cfg.store_timeout = Duration::from_millis(1000);
    let app = Arc::new(spawn_app(cfg).await);
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    for c in 0..4 {
        let (app, stop) = (app.clone(), stop.clone());
        clients.push(tokio::spawn(async move {
            let client = client();
            let mut statuses: HashMap<u16, usize> = HashMap::new();
            let mut i = 0;
            while !stop.load(Ordering::SeqCst) {
                let key = format!("c{c}-{i}");
                // Each key is retried until it has an answer that is not 503.
                loop {
                    let a = post(&client, &app, "/pay", Some(&key), "{}", &[]).await;
                    *statuses.entry(a.status).or_default() += 1;
                    if a.status == 503 {
                        assert_eq!(
                            a.problem_type().rsplit('/').next(),
                            Some("store-unavailable")
                        );
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                    assert!(
                        [201, 409].contains(&a.status),
                        "{key}: {} {:?}",
                        a.status,
                        a.body
                    );
                    break;
                }
                i += 1;
            }
            statuses
        }));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = up.hits();
    assert!(before > 0);
    let victim = cluster.primaries()[0];
    cluster.nodes[victim].kill();
    common::until(
        Duration::from_secs(60),
        "no replica took over",
        async || cluster.primaries().len() >= 3,
    )
    .await;
    // Until the killed node is back (as a replica of the new primary), the shard has no
    // replica to acknowledge its claims: they get 503, as they should.
    tokio::time::sleep(Duration::from_millis(500)).await;
    cluster.nodes[victim].restart();
    eventually(Duration::from_secs(60), "the old primary to rejoin", || {
        cluster.nodes[victim]
            .info_field("replication", "master_link_status")
            .as_deref()
            == Some("up")
    })
    .await;
    // New keys keep executing after the failover, without restarting idemgate.
    let after = up.hits();
    eventually(
        Duration::from_secs(20),
        "new keys execute after the failover",
        || up.hits() > after + 20,
    )
    .await;
    stop.store(true, Ordering::SeqCst);
    let mut statuses: HashMap<u16, usize> = HashMap::new();
    for c in clients {
        for (s, n) in c.await.unwrap() {
            *statuses.entry(s).or_default() += n;
        }
    }
    eprintln!("statuses: {statuses:?}, executions {}", up.hits());
    let mut per_key: HashMap<String, usize> = HashMap::new();
    for s in up.seen() {
        let key = s.headers["idempotency-key"][0].clone();
        *per_key.entry(key).or_default() += 1;
    }
    let twice: Vec<_> = per_key.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "executed more than once: {twice:?}");
    match Arc::try_unwrap(app) {
        Ok(app) => app.shutdown().await,
        Err(_) => panic!("clients still hold the app"),
    }
}

/// A primary that stops answering without closing its connections (SIGSTOP: the kernel
/// still accepts and acknowledges for it, as for a host cut off by a silent network
/// fault). Its replica takes over, and new keys of every slot, the frozen shard's
/// included, execute again while the frozen node still answers nothing: idemgate must not
/// wait on it for ever, nor let a slot-map reload that asked it hold up the other shards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_primary_is_left_behind() {
    let cluster = Cluster::start();
    let up = Upstream::start().await;
    let mut cfg = cluster_config(&up, &cluster);
    cfg.store_timeout = Duration::from_millis(1000);
    let app = spawn_app(cfg).await;
    let client = client();
    for i in 0..30 {
        let a = post(&client, &app, "/pay", Some(&format!("k-{i}")), "{}", &[]).await;
        assert_eq!(a.status, 201, "{:?}", a.body);
    }
    let victim = cluster.primaries()[0];
    let id = cluster.nodes[victim]
        .cli(&["CLUSTER", "MYID"])
        .unwrap()
        .trim()
        .to_string();
    let other = (0..cluster.nodes.len()).find(|i| *i != victim).unwrap();
    let nodes = cluster.nodes[other].cli(&["CLUSTER", "NODES"]).unwrap();
    let replica_port: u16 = nodes
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.get(3) == Some(&id.as_str()))
        .and_then(|f| f[1].split(['@', ':']).nth(1)?.parse().ok())
        .expect("the victim's replica");
    let replica = cluster
        .nodes
        .iter()
        .position(|n| n.port == replica_port)
        .unwrap();
    let pid = cluster.nodes[victim]
        .info_field("server", "process_id")
        .unwrap();
    signal(pid.parse().unwrap(), "STOP");
    eventually(Duration::from_secs(60), "a replica to take over", || {
        cluster.nodes[replica]
            .info_field("replication", "role")
            .as_deref()
            == Some("master")
    })
    .await;
    let started = std::time::Instant::now();
    let mut retries = 0;
    for i in 0..30 {
        let key = format!("f-{i}");
        loop {
            let a = post(&client, &app, "/pay", Some(&key), "{}", &[]).await;
            if a.status == 201 {
                break;
            }
            assert_eq!(a.status, 503, "{key}: {:?}", a.body);
            retries += 1;
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "{key} still refused {:?} after the failover",
                started.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    eprintln!(
        "30 new keys after the failover in {:?}, {retries} retries",
        started.elapsed()
    );
    assert_eq!(up.hits(), 60);
    signal(pid.parse().unwrap(), "CONT");
    app.shutdown().await;
}

/// The per-primary share of records and the primaries' time in idemgate's scripts, over
/// `SCALE_KEYS` (default 100,000) new keys sent through one idemgate, 32 at a time;
/// printed, not asserted.
/// `cargo test --test stores redis_cluster::share_over_many_keys -- --ignored --nocapture`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement"]
async fn share_over_many_keys() {
    let keys: usize = std::env::var("SCALE_KEYS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000);
    let cluster = Cluster::start();
    let up = Upstream::start().await;
    let app = Arc::new(spawn_app(cluster_config(&up, &cluster)).await);
    for i in cluster.primaries() {
        cluster.nodes[i].cli(&["CONFIG", "RESETSTAT"]).unwrap();
    }
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let start = std::time::Instant::now();
    let mut workers = Vec::new();
    for _ in 0..32 {
        let (app, next) = (app.clone(), next.clone());
        workers.push(tokio::spawn(async move {
            let client = client();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= keys {
                    break;
                }
                let a = post(&client, &app, "/pay", Some(&format!("s-{i}")), "{}", &[]).await;
                assert_eq!(a.status, 201);
            }
        }));
    }
    for w in workers {
        w.await.unwrap();
    }
    let elapsed = start.elapsed();
    let per_primary = cluster.keys_per_primary();
    let total: u64 = per_primary.iter().map(|(_, n)| n).sum();
    assert_eq!(total, keys as u64);
    for (node, n) in &per_primary {
        let stats = cluster.nodes[*node].cli(&["INFO", "commandstats"]).unwrap();
        let usec = stats
            .lines()
            .find_map(|l| l.strip_prefix("cmdstat_evalsha:"))
            .and_then(|l| l.split(',').find_map(|kv| kv.strip_prefix("usec=")))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0);
        eprintln!(
            "primary {node}: {n} records ({:.2}%), {:.1} us of EVALSHA per record",
            *n as f64 * 100.0 / keys as f64,
            usec / *n as f64
        );
    }
    eprintln!(
        "{keys} new keys in {:.1} s through one idemgate (debug build): {:.0}/s",
        elapsed.as_secs_f64(),
        keys as f64 / elapsed.as_secs_f64()
    );
}

/// Redis Cluster's hash slot of `key` (CRC16-XMODEM of its hash tag, or of the whole key).
fn key_slot(key: &str) -> u16 {
    let tagged = key
        .find('{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            rest.find('}').filter(|n| *n > 0).map(|n| &rest[..n])
        })
        .unwrap_or(key);
    let mut crc: u16 = 0;
    for b in tagged.bytes() {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc & 16383
}

/// The slots that node `i` serves, from its own `CLUSTER NODES` line.
fn slots_of(cluster: &Cluster, i: usize) -> Vec<u16> {
    let nodes = cluster.nodes[i].cli(&["CLUSTER", "NODES"]).unwrap();
    let mine = nodes
        .lines()
        .find(|l| l.contains("myself"))
        .expect("the node's own line");
    let mut slots = Vec::new();
    for range in mine.split_whitespace().skip(8) {
        let (a, b) = range.split_once('-').unwrap_or((range, range));
        if let (Ok(a), Ok(b)) = (a.parse::<u16>(), b.parse::<u16>()) {
            slots.extend(a..=b);
        }
    }
    slots
}

/// Whether `key` is on node `port` while its slot is being imported there (`ASKING`).
fn exists_asking(port: u16, key: &str) -> bool {
    let mut con = ::redis::Client::open(format!("redis://127.0.0.1:{port}"))
        .unwrap()
        .get_connection_with_timeout(Duration::from_secs(5))
        .unwrap();
    let (_, n): ((), i64) = ::redis::pipe()
        .cmd("ASKING")
        .cmd("EXISTS")
        .arg(key)
        .query(&mut con)
        .unwrap();
    n == 1
}

/// Slots are held migrating (`SETSLOT MIGRATING` on the source, `IMPORTING` on the
/// destination) while clients send new keys of exactly those slots, answers above 256 KiB
/// among them. The source has none of these keys and answers ASK; the destination runs the
/// claim and the record there, because each script names one key (a script naming two,
/// the record and its withdrawal note, got TRYAGAIN from the destination: 503 for every
/// new key of a migrating slot for as long as the migration lasted). Retries replay
/// through ASK, then, once the slots belong to the destination, through MOVED; every key
/// executes once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_keys_of_migrating_slots_are_created_on_the_importing_node() {
    const KEYS: usize = 24;
    const CLIENTS: usize = 4;
    // Three pieces of 256 KiB and a bit: the large-body path, not the inline one.
    const LARGE: u64 = 600_001;
    let cluster = Cluster::start();
    let up = Upstream::start().await;
    let app = Arc::new(spawn_app(cluster_config(&up, &cluster)).await);
    let client = client();
    // The first request makes the scope secret, which record ids hang on.
    let warm = post(&client, &app, "/pay", Some("warm-up"), "{}", &[]).await;
    assert_eq!(warm.status, 201);
    let primaries = cluster.primaries();
    let (src, dst) = (primaries[0], primaries[1]);
    let src_slots: std::collections::HashSet<u16> = slots_of(&cluster, src).into_iter().collect();
    // New keys whose records fall into the source's slots, found by their record ids.
    let admin = app.admin_addr().unwrap();
    let mut keys: Vec<(String, String, u16)> = Vec::new();
    for i in 0.. {
        if keys.len() == KEYS {
            break;
        }
        assert!(i < 10_000, "too few keys in the source's slots");
        let key = format!("mig-{i}");
        let found: serde_json::Value = client
            .post(format!("http://{admin}/records/lookup"))
            .json(&serde_json::json!({"method": "POST", "path": "/pay", "key": key, "headers": {}}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert!(found["state"].is_null(), "{key} is not new: {found}");
        let record = format!("idemgate:{{{}}}", found["id"].as_str().unwrap());
        let slot = key_slot(&record);
        if src_slots.contains(&slot) {
            keys.push((key, record, slot));
        }
    }
    let reported = cluster.nodes[src]
        .cli(&["CLUSTER", "KEYSLOT", &keys[0].1])
        .unwrap();
    assert_eq!(reported.trim(), keys[0].2.to_string(), "the slot computed");
    let mut slots: Vec<u16> = keys.iter().map(|k| k.2).collect();
    slots.sort_unstable();
    slots.dedup();
    let id = |i: usize| {
        cluster.nodes[i]
            .cli(&["CLUSTER", "MYID"])
            .unwrap()
            .trim()
            .to_string()
    };
    let (src_id, dst_id) = (id(src), id(dst));
    let ok = |r: Option<String>| assert_eq!(r.as_deref().map(str::trim), Some("OK"));
    for slot in &slots {
        let slot = slot.to_string();
        // Nothing of these slots on the source beforehand: every record found afterwards
        // was made during the migration.
        let before = cluster.nodes[src]
            .cli(&["CLUSTER", "COUNTKEYSINSLOT", &slot])
            .unwrap();
        assert_eq!(before.trim(), "0", "slot {slot}");
        ok(cluster.nodes[dst].cli(&["CLUSTER", "SETSLOT", &slot, "IMPORTING", &src_id]));
        ok(cluster.nodes[src].cli(&["CLUSTER", "SETSLOT", &slot, "MIGRATING", &dst_id]));
    }

    // Under traffic: several clients at once (redis-rs's own way of following ASK did not
    // survive that, see `query_keyed` in the store), each key sent once, every fourth one
    // large, and keys of the other slots in between.
    let large = |i: usize| i % 4 == 1;
    let keys = Arc::new(keys);
    let mut clients = Vec::new();
    for c in 0..CLIENTS {
        let (app, keys) = (app.clone(), keys.clone());
        clients.push(tokio::spawn(async move {
            let client = common::client();
            let mut firsts = Vec::new();
            for (i, (key, _, _)) in keys.iter().enumerate().filter(|(i, _)| i % CLIENTS == c) {
                let size = LARGE.to_string();
                let extra: &[(&str, &str)] = if large(i) {
                    &[(ANSWER_BYTES, size.as_str())]
                } else {
                    &[]
                };
                let a = post(&client, &app, "/pay", Some(key), "{}", extra).await;
                assert_eq!(a.status, 201, "{key}: {:?}", a.body);
                if large(i) {
                    assert_eq!(a.body.len() as u64, LARGE, "{key}");
                }
                let other = format!("other-{c}-{i}");
                let b = post(&client, &app, "/pay", Some(&other), "{}", &[]).await;
                assert_eq!(b.status, 201, "{other}: {:?}", b.body);
                firsts.push((i, a.body));
            }
            firsts
        }));
    }
    let mut first: HashMap<usize, bytes::Bytes> = HashMap::new();
    for c in clients {
        first.extend(c.await.unwrap());
    }
    assert_eq!(first.len(), KEYS);
    for (i, body) in &first {
        if large(*i) {
            assert!(
                body.iter()
                    .enumerate()
                    .all(|(n, b)| *b == big_answer_byte(n as u64)),
                "{}: the large answer as sent",
                keys[*i].0
            );
        }
    }
    // Every record is on the importing node, as one key (no note, no body beside it),
    // and none on the source.
    let dst_port = cluster.nodes[dst].port;
    for (key, record, _) in keys.iter() {
        assert!(
            exists_asking(dst_port, record),
            "{key}: {record} not on the destination"
        );
    }
    for slot in &slots {
        let slot = slot.to_string();
        let on_src = cluster.nodes[src]
            .cli(&["CLUSTER", "COUNTKEYSINSLOT", &slot])
            .unwrap();
        assert_eq!(on_src.trim(), "0", "slot {slot} on the source");
        let on_dst = cluster.nodes[dst]
            .cli(&["CLUSTER", "GETKEYSINSLOT", &slot, "100"])
            .unwrap();
        // Keys of the other clients may fall into these slots too: records all the same.
        for k in on_dst.lines().map(str::trim).filter(|k| !k.is_empty()) {
            let hex = k
                .strip_prefix("idemgate:{")
                .and_then(|k| k.strip_suffix('}'));
            assert!(
                hex.is_some_and(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit())),
                "slot {slot}: {k} is not a record"
            );
        }
    }
    // Retries replay through ASK, large answers included.
    let replays = |when: &'static str| {
        let (app, keys, first) = (app.clone(), keys.clone(), first.clone());
        async move {
            let client = common::client();
            for (i, (key, _, _)) in keys.iter().enumerate() {
                let size = LARGE.to_string();
                let extra: &[(&str, &str)] = if large(i) {
                    &[(ANSWER_BYTES, size.as_str())]
                } else {
                    &[]
                };
                let a = post(&client, &app, "/pay", Some(key), "{}", extra).await;
                assert!(a.replayed(), "{when}: {key}: {} {:?}", a.status, a.body);
                assert_eq!(a.body, first[&i], "{when}: {key}");
            }
        }
    };
    replays("mid-migration").await;
    let executions = up.hits();
    assert_eq!(executions, 1 + 2 * KEYS);

    // The migration finishes: whatever the source still holds of these slots moves (none
    // of idemgate's, as checked above), then the destination owns them.
    let dst_port = dst_port.to_string();
    for slot in &slots {
        let slot = slot.to_string();
        let left = cluster.nodes[src]
            .cli(&["CLUSTER", "GETKEYSINSLOT", &slot, "1000"])
            .unwrap();
        for k in left.lines().map(str::trim).filter(|k| !k.is_empty()) {
            ok(cluster.nodes[src].cli(&["MIGRATE", "127.0.0.1", &dst_port, k, "0", "5000"]));
        }
        ok(cluster.nodes[dst].cli(&["CLUSTER", "SETSLOT", &slot, "NODE", &dst_id]));
        ok(cluster.nodes[src].cli(&["CLUSTER", "SETSLOT", &slot, "NODE", &dst_id]));
        for i in cluster.primaries() {
            if i != src && i != dst {
                ok(cluster.nodes[i].cli(&["CLUSTER", "SETSLOT", &slot, "NODE", &dst_id]));
            }
        }
    }
    replays("after the migration").await;
    assert_eq!(up.hits(), executions, "a replay executed");
    let mut per_key: HashMap<String, usize> = HashMap::new();
    for s in up.seen() {
        *per_key
            .entry(s.headers["idempotency-key"][0].clone())
            .or_default() += 1;
    }
    let twice: Vec<_> = per_key.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "not executed exactly once: {twice:?}");
    assert!(keys.iter().all(|(key, _, _)| per_key.get(key) == Some(&1)));
    match Arc::try_unwrap(app) {
        Ok(app) => app.shutdown().await,
        Err(_) => panic!("clients still hold the app"),
    }
}

/// The scope secret survives the loss of the shard that holds it: every primary keeps a
/// copy, so after the primary holding `idemgate:scope-secret` is flushed (as one restarted
/// empty would be) a new instance reads the secret from the others' copies and puts it
/// back, and a key first sent after the loss is one operation across both instances.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scope_secret_survives_the_loss_of_the_shard_holding_it() {
    let cluster = Cluster::start();
    let up = Upstream::start().await;
    let mut cfg = cluster_config(&up, &cluster);
    // The first instance does not put it back: the new one must find it on its own.
    cfg.scope_secret_check_interval = Duration::from_secs(3600);
    let first = spawn_app(cfg.clone()).await;
    let exists = |i: usize, key: &str| {
        cluster.nodes[i]
            .cli(&["EXISTS", key])
            .is_some_and(|s| s.trim() == "1")
    };
    let copies = |i: usize| {
        cluster.nodes[i]
            .cli(&["KEYS", "idemgate:scope-secret:{*}"])
            .map_or(0, |s| s.lines().filter(|l| !l.trim().is_empty()).count())
    };
    let primaries = cluster.primaries();
    assert_eq!(primaries.len(), 3);
    for &i in &primaries {
        assert!(copies(i) >= 1, "primary {i} holds no copy of the secret");
    }
    let holder = primaries
        .iter()
        .copied()
        .find(|&i| exists(i, "idemgate:scope-secret"))
        .expect("a primary holds the secret");
    cluster.nodes[holder].cli(&["FLUSHALL"]).unwrap();
    assert!(!exists(holder, "idemgate:scope-secret"));
    let second = spawn_app(cfg).await;
    assert!(
        exists(holder, "idemgate:scope-secret"),
        "the new instance put the secret back"
    );
    assert!(copies(holder) >= 1, "and the flushed primary's copy");
    let client = client();
    for i in 0..10 {
        let key = format!("after-loss-{i}");
        let a = post(&client, &first, "/pay", Some(&key), "{}", &[]).await;
        assert_eq!(a.status, 201, "{:?}", a.body);
        let b = post(&client, &second, "/pay", Some(&key), "{}", &[]).await;
        assert!(
            b.replayed(),
            "{key} through the new instance: {} {:?}",
            b.status,
            b.body
        );
    }
    assert_eq!(up.hits(), 10, "each executed once");
    first.shutdown().await;
    second.shutdown().await;
}
