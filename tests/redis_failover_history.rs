//! The history check of `tests/history.rs`, against replicated Redis with failovers
//! injected: clients of several tenants send retried transfers through two idemgate
//! instances while primaries are killed (SIGKILL), replicas promoted, and the killed nodes
//! brought back as replicas. With `min_replicas_ack` covering every replica that can be
//! promoted, every forwarded claim is acknowledged, and the checker asserts over the whole
//! history:
//!
//! - at most one upstream execution per operation (a tenant's key, which the client names
//!   in its `x-test-op` header);
//! - every 201 a client saw (first-hand or replayed) is the answer of the one execution of
//!   its own operation;
//! - no status but 201, 409 (in progress or outcome unknown) and 503 `store-unavailable`.
//!
//! The clients and the checker are `tests/common/history.rs`; this file is the topologies
//! and the failover injector.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::history::*;
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
                common::wait_until(Duration::from_secs(60), "no replica took over", || {
                    c.primaries().len() >= 3
                });
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

    let clients = Clients {
        seed,
        clients: CLIENTS,
        keys: KEYS_PER_CLIENT,
        stop: Stop::Flag(done),
        attempts: ATTEMPTS,
        faults: &[],
        addrs: vec![addrs],
        paths: &["/pay"],
        transport: Transport::Reqwest,
        upstream_delay_ms: None,
        retry_pause_ms: 50..400,
        key_pause_ms: Some(10..60),
        intent: Arc::new(|n, k, rng| {
            let tenant = format!("Bearer tenant-{}", rng.random_range(0..TENANTS));
            let key = format!("c{n}-k{k}");
            Intent {
                service: 0,
                op: format!("{tenant}/{key}"),
                body: body_for(&key),
                key,
                credentials: vec![tenant.clone()],
                final_credential: tenant,
                multipart: false,
            }
        }),
    };
    let history = run(&clients).await;
    let _topo = injector.await.unwrap();
    for app in apps {
        app.shutdown().await;
    }

    // Neither a hang-up nor a 502 or 504 is allowed here: the upstream never fails.
    let verdict = check(
        &history,
        Check {
            upstreams: std::slice::from_ref(&up),
            allowed: &[Some(409), Some(503)],
            problems: Some(&["in-progress", "outcome-unknown", "store-unavailable"]),
            unknown_means_may_have_run: false,
        },
    );
    eprintln!(
        "history: {verdict}; {} failovers",
        failovers.load(Ordering::SeqCst)
    );
    verdict.assert_clean();
    assert_eq!(failovers.load(Ordering::SeqCst), FAILOVERS);
    assert!(
        verdict.executions > CLIENTS * KEYS_PER_CLIENT / 2,
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
