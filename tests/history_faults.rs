//! The history check again, with the faults on the wire: Redis sits behind a TCP proxy
//! (`common::faultproxy`) that cuts connections, holds replies or requests back, swallows
//! replies (and then cuts the connection, as a lost reply on TCP means a broken connection)
//! and refuses reconnections for a while, besides Redis being frozen (SIGSTOP) or restarted.
//! Clients send retried transfers through two idemgate instances on that Redis, with the
//! upstream resetting or hanging and clients hanging up, as in `tests/history.rs`.
//!
//! Besides at most one execution per scoped key, answers that match their execution, and
//! statuses from the failure table, the checker asserts that `unknown` means "may have
//! executed": every scoped key whose final answer is 409 `outcome-unknown` has an upstream
//! execution or a 504 in its history. A claim that never reached the upstream must end
//! released, whatever happened to the store connection in between.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::faultproxy::FaultProxy;
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

#[derive(Debug, Clone)]
struct Event {
    tenant: String,
    key: String,
    body: String,
    fault: &'static str,
    /// `None`: the client hung up or the connection failed.
    status: Option<u16>,
    replayed: bool,
    answer: Vec<u8>,
}

fn body_for(key: &str) -> String {
    format!("{{\"key\":\"{key}\",\"amount\":{}}}", key.len() * 100 + 7)
}

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

    let started = Instant::now();
    let client_faults = Arc::new(AtomicUsize::new(0));
    let mut clients = tokio::task::JoinSet::new();
    for n in 0..CLIENTS {
        let addrs = addrs.clone();
        let client_faults = client_faults.clone();
        clients.spawn(async move {
            let mut rng = StdRng::seed_from_u64(seed + n as u64);
            let c = client();
            let tenant = format!("Bearer tenant-{}", n % TENANTS);
            let mut log = Vec::new();
            for k in 0..KEYS_PER_CLIENT {
                if started.elapsed() > RUN_FOR {
                    break;
                }
                // Keys repeat across clients, so tenants collide on purpose.
                let key = format!("h-{}-{k}", n / TENANTS);
                let body = body_for(&key);
                for _ in 0..ATTEMPTS {
                    let roll = rng.random_range(0..100);
                    let fault: &'static str = match roll {
                        0..=9 => "reset",
                        10..=12 => "hang",
                        13..=24 => "hangup",
                        25..=34 => "double",
                        _ => "none",
                    };
                    if fault != "none" {
                        client_faults.fetch_add(1, Ordering::SeqCst);
                    }
                    let sends = if fault == "double" { 2 } else { 1 };
                    let mut pending = Vec::new();
                    for _ in 0..sends {
                        let addr = addrs[rng.random_range(0..addrs.len())];
                        let delay = rng.random_range(0..150u64).to_string();
                        let mut req = c
                            .post(format!("http://{addr}/v1/transfers"))
                            .header("content-type", "application/json")
                            .header("authorization", &tenant)
                            .header("idempotency-key", &key)
                            .header(DELAY_MS, delay)
                            .body(body.clone());
                        if fault == "reset" || fault == "hang" {
                            req = req.header(FAULT, fault);
                        }
                        let limit = if fault == "hangup" {
                            Duration::from_millis(rng.random_range(1..120))
                        } else {
                            Duration::from_secs(10)
                        };
                        pending.push(async move {
                            let res = tokio::time::timeout(limit, async {
                                let r = req.send().await.ok()?;
                                let status = r.status().as_u16();
                                let replayed = r.headers().contains_key("idempotent-replayed");
                                let bytes = r.bytes().await.ok()?;
                                Some((status, replayed, bytes.to_vec()))
                            })
                            .await;
                            res.ok().flatten()
                        });
                    }
                    let results = futures_join_all(pending).await;
                    let mut done = false;
                    for r in results {
                        let (status, replayed, answer) = match r {
                            Some((s, rp, a)) => (Some(s), rp, a),
                            None => (None, false, Vec::new()),
                        };
                        done |= status == Some(201);
                        log.push(Event {
                            tenant: tenant.clone(),
                            key: key.clone(),
                            body: body.clone(),
                            fault,
                            status,
                            replayed,
                            answer,
                        });
                    }
                    if done {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(rng.random_range(20..200))).await;
                }
            }
            log
        });
    }
    let mut history = Vec::new();
    while let Some(log) = clients.join_next().await {
        history.extend(log.unwrap());
    }
    stop.store(true, Ordering::SeqCst);
    let (redis, injected) = injector.await.unwrap();
    let calm = Instant::now();

    // A last, fault-free read of every key once things have settled: it must also agree.
    let c = client();
    let mut scoped: Vec<(String, String)> = history
        .iter()
        .map(|e| (e.tenant.clone(), e.key.clone()))
        .collect();
    scoped.sort();
    scoped.dedup();
    for (tenant, key) in &scoped {
        let body = body_for(key);
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            let r = post_url(
                &c,
                &format!("http://{}/v1/transfers", addrs[0]),
                Some(key),
                &body,
                &[("authorization", tenant)],
            )
            .await;
            // A claim that was never forwarded may still be being taken back (its release
            // retried with pauses of up to a second) when the faults stop; its lease may
            // have run out meanwhile. It must free the key within seconds, so an
            // `outcome-unknown` counts as final only once it has lasted.
            let settled = !(r.status == 503
                || (r.status == 409 && r.problem_type().ends_with("/in-progress"))
                || (r.problem_type().ends_with("/outcome-unknown")
                    && calm.elapsed() < UNKNOWN_LASTS));
            if settled || Instant::now() > until {
                history.push(Event {
                    tenant: tenant.clone(),
                    key: key.clone(),
                    body,
                    fault: "final",
                    status: Some(r.status),
                    replayed: r.replayed(),
                    answer: r.body.to_vec(),
                });
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    // The checker.
    let executions = up.seen();
    let mut by_scope: HashMap<(String, String), Vec<usize>> = HashMap::new();
    let mut by_number: HashMap<usize, (String, String, Vec<u8>)> = HashMap::new();
    for s in &executions {
        let tenant = s.headers["authorization"][0].clone();
        let key = s.headers["idempotency-key"][0].clone();
        by_scope
            .entry((tenant.clone(), key.clone()))
            .or_default()
            .push(s.execution);
        let answer = execution_body(s.execution, &s.method, s.body.len()).into_bytes();
        by_number.insert(s.execution, (tenant, key, answer));
    }
    let mut violations = Vec::new();
    for (scope, runs) in &by_scope {
        if runs.len() > 1 {
            violations.push(format!("{scope:?} executed {} times: {runs:?}", runs.len()));
        }
    }
    let timed_out: HashSet<(String, String)> = history
        .iter()
        .filter(|e| e.status == Some(504))
        .map(|e| (e.tenant.clone(), e.key.clone()))
        .collect();
    let mut statuses: HashMap<String, usize> = HashMap::new();
    let mut by_fault: HashMap<&str, usize> = HashMap::new();
    let (mut replays, mut unknown_finals) = (0, 0);
    for e in &history {
        let label = e.status.map_or("no answer".to_string(), |s| s.to_string());
        *statuses.entry(label).or_default() += 1;
        *by_fault.entry(e.fault).or_default() += 1;
        match e.status {
            Some(201) => {
                replays += usize::from(e.replayed);
                let n = serde_json::from_slice::<serde_json::Value>(&e.answer)
                    .ok()
                    .and_then(|v| v["execution"].as_u64())
                    .map(|n| n as usize);
                match n.and_then(|n| by_number.get(&n)) {
                    Some((t, k, answer)) if *t == e.tenant && *k == e.key => {
                        if *answer != e.answer {
                            violations.push(format!("{e:?}: answer differs from the execution's"));
                        }
                    }
                    other => violations.push(format!(
                        "{e:?}: 201 that matches no execution of its scoped key ({other:?})"
                    )),
                }
            }
            Some(409 | 502 | 503 | 504) | None => {}
            Some(s) => violations.push(format!("{e:?}: status {s} outside the failure table")),
        }
        // `unknown` means "may have executed".
        let unknown = e.status == Some(409)
            && serde_json::from_slice::<serde_json::Value>(&e.answer)
                .ok()
                .and_then(|v| v["type"].as_str().map(|t| t.ends_with("/outcome-unknown")))
                .unwrap_or(false);
        if e.fault == "final" && unknown {
            unknown_finals += 1;
            let scope = (e.tenant.clone(), e.key.clone());
            if !by_scope.contains_key(&scope) && !timed_out.contains(&scope) {
                violations.push(format!(
                    "{scope:?}: final answer outcome-unknown, but never executed and never a 504"
                ));
            }
        }
        assert_eq!(e.body, body_for(&e.key));
    }
    let mut statuses: Vec<_> = statuses.into_iter().collect();
    statuses.sort();
    let mut by_fault: Vec<_> = by_fault.into_iter().collect();
    by_fault.sort();
    println!(
        "history with wire faults: seed {seed}; {} requests ({} replayed answers), {} scoped keys, {} upstream executions, {unknown_finals} keys finally outcome-unknown; store faults {injected:?} (proxy cuts {}, replies swallowed {}); client-side faults {}; requests by client-side fault {by_fault:?}; statuses {statuses:?}; violations: {}",
        history.len(),
        replays,
        scoped.len(),
        executions.len(),
        proxy.cuts(),
        proxy.replies_dropped(),
        client_faults.load(Ordering::SeqCst),
        violations.len()
    );
    for v in &violations {
        println!("violation: {v}");
    }
    assert!(violations.is_empty(), "{} violations", violations.len());
    assert!(
        executions.len() >= scoped.len() / 2,
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

/// Awaits all futures concurrently (two at most here), in order.
async fn futures_join_all<F: std::future::Future>(fs: Vec<F>) -> Vec<F::Output> {
    let mut handles: Vec<_> = fs.into_iter().map(Box::pin).collect();
    let mut out = Vec::new();
    if handles.len() == 2 {
        let b = handles.pop().unwrap();
        let a = handles.pop().unwrap();
        let (x, y) = tokio::join!(a, b);
        out.push(x);
        out.push(y);
    } else {
        for h in handles {
            out.push(h.await);
        }
    }
    out
}
