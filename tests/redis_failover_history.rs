//! The history check of `tests/history.rs`, against replicated Redis with failovers
//! injected: clients of several tenants send retried transfers through two idemgate
//! instances while primaries are killed (SIGKILL), replicas promoted, and the killed nodes
//! brought back as replicas. With `min_replicas_ack` covering every replica that can be
//! promoted, every forwarded claim is acknowledged, and the checker asserts over the whole
//! history:
//!
//! - at most one upstream execution per scoped key (tenant, key);
//! - every 201 a client saw (first-hand or replayed) is the answer of the one execution of
//!   its own scoped key;
//! - no status but 201, 409 (in progress or outcome unknown) and 503 `store-unavailable`.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::topology::{redis_base, Cluster, Sentinels, MASTER};
use common::*;
use idemgate::Config;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const CLIENTS: usize = 6;
/// Clients start new keys until the failovers are over, and at least this many.
const KEYS_PER_CLIENT: usize = 40;
const ATTEMPTS: usize = 6;
const TENANTS: usize = 2;
const FAILOVERS: usize = 2;

#[derive(Debug)]
struct Event {
    tenant: String,
    key: String,
    status: u16,
    body: Vec<u8>,
}

enum Topo {
    Sentinel(Sentinels),
    Cluster(Cluster),
}

impl Topo {
    /// Kills a primary, waits for its replacement, brings the killed node back as a
    /// replica and waits until it replicates again.
    fn fail_over(&mut self, rng: &mut StdRng) {
        match self {
            Topo::Sentinel(s) => {
                let killed = s.fail_over();
                s.data[killed].restart();
                s.wait_replicas_online(s.data.len() - 1);
            }
            Topo::Cluster(c) => {
                let primaries = c.primaries();
                let victim = primaries[rng.random_range(0..primaries.len())];
                c.nodes[victim].kill();
                let until = Instant::now() + Duration::from_secs(60);
                while c.primaries().len() < 3 {
                    assert!(Instant::now() < until, "no replica took over");
                    std::thread::sleep(Duration::from_millis(50));
                }
                c.nodes[victim].restart();
                c.wait_ok();
            }
        }
    }
}

async fn run_history(topo: Topo, mut cfg: Config, up: Upstream, seed: u64) {
    cfg.store_timeout = Duration::from_millis(800);
    cfg.replica_ack_timeout = Duration::from_millis(300);
    cfg.defaults.lease = Duration::from_millis(1500);
    cfg.defaults.upstream_timeout = Duration::from_millis(1000);
    let apps = [spawn_app(cfg.clone()).await, spawn_app(cfg).await];
    let addrs: Vec<_> = apps.iter().map(|a| a.addr()).collect();

    let done = Arc::new(AtomicBool::new(false));
    let failovers = Arc::new(AtomicUsize::new(0));
    let injector = {
        let (done, failovers) = (done.clone(), failovers.clone());
        let mut topo = topo;
        tokio::task::spawn_blocking(move || {
            let mut rng = StdRng::seed_from_u64(seed ^ 0xfa11);
            for _ in 0..FAILOVERS {
                std::thread::sleep(Duration::from_millis(rng.random_range(800..1500)));
                topo.fail_over(&mut rng);
                failovers.fetch_add(1, Ordering::SeqCst);
            }
            // Some traffic on the last topology, then the clients stop.
            std::thread::sleep(Duration::from_millis(1000));
            done.store(true, Ordering::SeqCst);
            topo
        })
    };

    let mut clients = Vec::new();
    for c in 0..CLIENTS {
        let addrs = addrs.clone();
        let done = done.clone();
        clients.push(tokio::spawn(async move {
            let mut rng = StdRng::seed_from_u64(seed + c as u64);
            let client = client();
            let mut events = Vec::new();
            let mut k = 0;
            while k < KEYS_PER_CLIENT || !done.load(Ordering::SeqCst) {
                k += 1;
                let tenant = format!("Bearer tenant-{}", rng.random_range(0..TENANTS));
                let key = format!("c{c}-k{k}");
                let body = format!("{{\"key\":\"{key}\",\"amount\":{}}}", k * 100 + 7);
                for _ in 0..ATTEMPTS {
                    let addr = addrs[rng.random_range(0..addrs.len())];
                    let a = post_url(
                        &client,
                        &format!("http://{addr}/pay"),
                        Some(&key),
                        &body,
                        &[("authorization", tenant.as_str())],
                    )
                    .await;
                    let settled = a.status == 201;
                    events.push(Event {
                        tenant: tenant.clone(),
                        key: key.clone(),
                        status: a.status,
                        body: a.body.to_vec(),
                    });
                    if settled {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(rng.random_range(50..400))).await;
                }
                tokio::time::sleep(Duration::from_millis(rng.random_range(10..60))).await;
            }
            events
        }));
    }
    let mut events = Vec::new();
    for c in clients {
        events.extend(c.await.unwrap());
    }
    let _topo = injector.await.unwrap();
    for app in apps {
        app.shutdown().await;
    }

    // The checker.
    let seen = up.seen();
    let by_execution: HashMap<usize, &Seen> = seen.iter().map(|s| (s.execution, s)).collect();
    let mut executions: HashMap<(String, String), Vec<usize>> = HashMap::new();
    for s in &seen {
        let scope = (
            s.headers["authorization"][0].clone(),
            s.headers["idempotency-key"][0].clone(),
        );
        executions.entry(scope).or_default().push(s.execution);
    }
    let twice: Vec<_> = executions.iter().filter(|(_, e)| e.len() > 1).collect();
    let mut statuses: HashMap<u16, usize> = HashMap::new();
    for e in &events {
        *statuses.entry(e.status).or_default() += 1;
        assert!(
            [201, 409, 503].contains(&e.status),
            "{} {}: status {} {:?}",
            e.tenant,
            e.key,
            e.status,
            String::from_utf8_lossy(&e.body)
        );
        if e.status == 201 {
            let execs = &executions[&(e.tenant.clone(), e.key.clone())];
            let n = execs[0];
            let body = &by_execution[&n].body;
            assert_eq!(
                e.body,
                execution_body(n, "POST", body.len()).into_bytes(),
                "{} {} got another key's answer",
                e.tenant,
                e.key
            );
        }
    }
    eprintln!(
        "history: {} requests, {} executions, {} failovers, statuses {statuses:?}",
        events.len(),
        seen.len(),
        failovers.load(Ordering::SeqCst)
    );
    assert!(twice.is_empty(), "executed more than once: {twice:?}");
    assert_eq!(failovers.load(Ordering::SeqCst), FAILOVERS);
    assert!(
        seen.len() > CLIENTS * KEYS_PER_CLIENT / 2,
        "too little got through"
    );
}

fn seed() -> u64 {
    std::env::var("HISTORY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20261130)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_failovers_execute_no_acknowledged_key_twice() {
    let s = Sentinels::start(2);
    let up = Upstream::start().await;
    let mut cfg = redis_base(&up);
    cfg.redis_sentinels = s.addrs();
    cfg.redis_sentinel_master = Some(MASTER.into());
    // Both replicas: whichever the sentinels promote has every forwarded claim.
    cfg.min_replicas_ack = 2;
    run_history(Topo::Sentinel(s), cfg, up, seed()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_failovers_execute_no_acknowledged_key_twice() {
    let c = Cluster::start();
    let up = Upstream::start().await;
    let mut cfg = redis_base(&up);
    cfg.redis_cluster_nodes = c.addrs();
    cfg.min_replicas_ack = 1;
    run_history(Topo::Cluster(c), cfg, up, seed()).await;
}
