//! The history check again, with the faults on the wire: Redis sits behind a TCP proxy
//! (`common::faultproxy`) that cuts connections, holds replies or requests back, swallows
//! replies (and then cuts the connection, as a lost reply on TCP means a broken connection)
//! and refuses reconnections for a while, besides Redis being frozen (SIGSTOP) or restarted.
//! Clients send retried transfers through two idemgate instances on that Redis, with the
//! upstream resetting or hanging and clients hanging up, as in `tests/history.rs`.
//!
//! An operation is a tenant's key, named by the client in its `x-test-op` header. Besides
//! at most one execution per operation, answers that match their execution, and statuses
//! from the failure table, the checker asserts that `unknown` means "may have executed":
//! every operation whose final answer is 409 `outcome-unknown` has an upstream execution or
//! a 504 in its history. A claim that never reached the upstream must end released,
//! whatever happened to the store connection in between.
//!
//! The clients, the last read and the checker are `tests/common/history.rs`; this file is
//! the topology and the fault injector.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::faultproxy::FaultProxy;
use common::history::*;
use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const CLIENTS: usize = 8;
const KEYS_PER_CLIENT: usize = 30;
const ATTEMPTS: usize = 4;
const TENANTS: usize = 3;
/// Clients start no new key after this; the run ends a few seconds later at most.
const RUN_FOR: Duration = Duration::from_secs(12);
/// How long after the faults have stopped an `outcome-unknown` counts as a key's final
/// answer.
const UNKNOWN_LASTS: Duration = Duration::from_secs(4);

/// The store-side faults, by kind: how many of each were injected.
#[derive(Debug, Default)]
struct Injected {
    paused: usize,
    restarted: usize,
    cut: usize,
    replies_delayed: usize,
    requests_delayed: usize,
    replies_lost: usize,
    refused: usize,
    upstream_restarted: usize,
}

impl Injected {
    fn total(&self) -> usize {
        self.paused
            + self.restarted
            + self.cut
            + self.replies_delayed
            + self.requests_delayed
            + self.replies_lost
            + self.refused
            + self.upstream_restarted
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_with_wire_faults_never_strands_a_key_that_did_not_run() {
    let seed: u64 = std::env::var("HISTORY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20261130);
    let redis = RedisServer::start_persistent();
    let proxy = Arc::new(FaultProxy::for_redis(&redis).await);
    let up = Upstream::start().await;
    let mut cfg = redis_config(&up, &redis);
    cfg.redis_url = Some(proxy.redis_url());
    cfg.store_timeout = Duration::from_millis(300);
    cfg.defaults.lease = Duration::from_millis(600);
    cfg.defaults.upstream_timeout = Duration::from_millis(800);
    let apps = [spawn_app(cfg.clone()).await, spawn_app(cfg).await];
    let addrs: Vec<_> = apps.iter().map(|a| a.addr()).collect();

    // The injector owns Redis and drives the proxy; a blocking thread, because restarting
    // Redis waits for it synchronously.
    let stop = Arc::new(AtomicBool::new(false));
    let faults = Arc::new(AtomicUsize::new(0));
    let injector = {
        let (stop, faults, proxy) = (stop.clone(), faults.clone(), proxy.clone());
        let upstream = up.clone();
        tokio::task::spawn_blocking(move || {
            let mut redis = redis;
            let mut rng = StdRng::seed_from_u64(seed ^ 0xfa17);
            let mut n = Injected::default();
            let sleep = |ms: std::ops::Range<u64>, rng: &mut StdRng| {
                std::thread::sleep(Duration::from_millis(rng.random_range(ms)));
            };
            while !stop.load(Ordering::SeqCst) {
                sleep(200..700, &mut rng);
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                match rng.random_range(0..100) {
                    0..=19 => {
                        redis.pause();
                        sleep(100..700, &mut rng);
                        redis.resume();
                        n.paused += 1;
                    }
                    20..=27 => {
                        redis.restart();
                        n.restarted += 1;
                    }
                    28..=44 => {
                        proxy.cut_all();
                        n.cut += 1;
                    }
                    45..=59 => {
                        let d = Duration::from_millis(rng.random_range(100..700));
                        proxy.delay_replies(d);
                        sleep(100..700, &mut rng);
                        proxy.delay_replies(Duration::ZERO);
                        n.replies_delayed += 1;
                    }
                    60..=71 => {
                        // Requests held back on connections that are then cut: they still
                        // reach Redis, after their senders gave up on them and went on
                        // down new connections (where a release can overtake its claim).
                        let d = Duration::from_millis(rng.random_range(400..900));
                        proxy.delay_requests(d);
                        sleep(20..150, &mut rng);
                        proxy.cut_all();
                        n.requests_delayed += 1;
                    }
                    72..=89 => {
                        // Replies lost, then the connections cut and reconnections refused
                        // for a while: what was sent meanwhile ran, and nobody heard.
                        proxy.drop_replies(true);
                        sleep(20..300, &mut rng);
                        proxy.refuse(true);
                        proxy.cut_all();
                        proxy.drop_replies(false);
                        sleep(100..500, &mut rng);
                        proxy.refuse(false);
                        n.replies_lost += 1;
                    }
                    90..=94 => {
                        // A graceful upstream restart: every idle connection closed at once.
                        // A request the upstream never read must not be held `unknown`.
                        upstream.restart();
                        n.upstream_restarted += 1;
                    }
                    _ => {
                        proxy.refuse(true);
                        proxy.cut_all();
                        sleep(100..700, &mut rng);
                        proxy.refuse(false);
                        n.refused += 1;
                    }
                }
                faults.fetch_add(1, Ordering::SeqCst);
            }
            (redis, n)
        })
    };

    let clients = Clients {
        seed,
        clients: CLIENTS,
        keys: KEYS_PER_CLIENT,
        stop: Stop::After(RUN_FOR),
        attempts: ATTEMPTS,
        faults: &[("reset", 10), ("hang", 3), ("hangup", 12), ("double", 10)],
        addrs: vec![addrs],
        paths: &["/v1/transfers"],
        transport: Transport::Reqwest,
        upstream_delay_ms: Some(0..150),
        retry_pause_ms: 20..200,
        key_pause_ms: None,
        intent: Arc::new(|n, k, _| {
            let tenant = format!("Bearer tenant-{}", n % TENANTS);
            // Keys repeat across clients, so tenants collide on purpose.
            let key = format!("h-{}-{k}", n / TENANTS);
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
    let mut history = run(&clients).await;
    stop.store(true, Ordering::SeqCst);
    let (redis, injected) = injector.await.unwrap();

    // A last, fault-free read of every operation once things have settled: it must also
    // agree. A claim that was never forwarded may still be being taken back (its release
    // retried with pauses of up to a second) when the faults stop; its lease may have run
    // out meanwhile. It must free the key within seconds, so an `outcome-unknown` counts as
    // final only once it has lasted.
    settle(&clients, &mut history, Some(UNKNOWN_LASTS)).await;
    let verdict = check(
        &history,
        Check {
            upstreams: std::slice::from_ref(&up),
            allowed: FAILURE_TABLE,
            problems: None,
            unknown_means_may_have_run: true,
        },
    );
    println!(
        "history with wire faults: seed {seed}; {verdict}; store faults {injected:?} (proxy cuts {}, replies swallowed {}); client-side faults {}",
        proxy.cuts(),
        proxy.replies_dropped(),
        history.client_faults,
    );
    verdict.assert_clean();
    assert!(
        verdict.executions >= verdict.operations / 2,
        "too few executions to mean anything"
    );
    assert_eq!(injected.total(), faults.load(Ordering::SeqCst));
    assert!(
        injected.cut + injected.replies_lost > 0 && injected.replies_delayed > 0,
        "the wire faults were not injected: {injected:?}"
    );
    for app in apps {
        app.shutdown().await;
    }
    drop(redis);
}
