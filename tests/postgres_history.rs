//! The history check on PostgreSQL (as `tests/history.rs` on Redis): clients send retried
//! transfers to two idemgate instances sharing one database through the TCP fault proxy,
//! while the database is restarted (immediate stop), every connection is cut, or
//! reconnections are refused for a while; the upstream breaks off mid-answer on request and
//! clients hang up or race a duplicate. Several principals (tenants by their
//! `Authorization` header) reuse the same keys with the same bodies.
//!
//! Each intent names its operation in an `x-test-op` header (not fingerprinted). The
//! checker asserts over the whole history: at most one upstream execution per operation,
//! every 201 (first-hand or replayed) the answer of its own operation's one execution, byte
//! for byte, and no status outside the README's failure table. `HISTORY_ON_AMBIGUOUS=release`
//! gives up at-most-once for ambiguous outcomes: the checker must then report double
//! executions, which shows it can fail.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::faultproxy::FaultProxy;
use common::postgres::PgServer;
use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const CLIENTS: usize = 6;
const KEYS_PER_CLIENT: usize = 30;
const ATTEMPTS: usize = 4;
const PRINCIPALS: usize = 3;
/// Clients start no new key after this.
const RUN_FOR: Duration = Duration::from_secs(10);
const OP: &str = "x-test-op";

#[derive(Debug, Clone)]
struct Event {
    op: String,
    status: Option<u16>,
    problem: Option<String>,
    replayed: bool,
    answer: Vec<u8>,
}

fn body_for(key: &str) -> String {
    format!("{{\"key\":\"{key}\",\"amount\":{}}}", key.len() * 100 + 7)
}

/// One exchange with a deadline: status, `idemgate-error`, replayed, body; `None` on a
/// hang-up or a broken connection.
async fn send(
    c: &reqwest::Client,
    addr: std::net::SocketAddr,
    headers: &[(&str, &str)],
    body: &str,
    limit: Duration,
) -> Option<(u16, Option<String>, bool, Vec<u8>)> {
    let mut req = c
        .post(format!("http://{addr}/v1/transfers"))
        .header("content-type", "application/json")
        .timeout(limit)
        .body(body.to_string());
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let res = req.send().await.ok()?;
    let status = res.status().as_u16();
    let header = |name: &str| {
        res.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let problem = header("idemgate-error");
    let replayed = header("idempotent-replayed").as_deref() == Some("true");
    Some((status, problem, replayed, res.bytes().await.ok()?.to_vec()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_on_postgres_under_faults_has_no_double_execution() {
    let seed: u64 = std::env::var("HISTORY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20261130);
    let pg = tokio::task::spawn_blocking(PgServer::start).await.unwrap();
    let proxy =
        Arc::new(FaultProxy::start(format!("127.0.0.1:{}", pg.port).parse().unwrap()).await);
    let up = Upstream::start().await;
    let url = format!("postgres://postgres@{}/postgres", proxy.addr);
    let mut cfg = idemgate::config::Config::for_upstream(&up.url());
    cfg.scope_secret_create_delay = Duration::ZERO;
    cfg.postgres_url = Some(url.as_str().into());
    cfg.namespace = Some(NAMESPACE.into());
    cfg.store_timeout = Duration::from_millis(300);
    cfg.defaults.lease = Duration::from_millis(600);
    cfg.defaults.upstream_timeout = Duration::from_millis(800);
    cfg.defaults.anonymous = idemgate::config::Anonymous::Refuse;
    if std::env::var("HISTORY_ON_AMBIGUOUS").as_deref() == Ok("release") {
        cfg.defaults.on_ambiguous = idemgate::config::OnAmbiguous::Release;
    }
    let instances = [spawn_app(cfg.clone()).await, spawn_app(cfg).await];
    let addrs: Vec<_> = instances.iter().map(|a| a.addr()).collect();

    // The injector owns the database; restarting it waits synchronously.
    let stop = Arc::new(AtomicBool::new(false));
    let injector = {
        let (stop, proxy) = (stop.clone(), proxy.clone());
        tokio::task::spawn_blocking(move || {
            let mut rng = StdRng::seed_from_u64(seed ^ 0xfa17);
            let (mut restarted, mut cut, mut refused) = (0, 0, 0);
            while !stop.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(rng.random_range(300..900)));
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                match rng.random_range(0..3) {
                    0 => {
                        pg.restart();
                        restarted += 1;
                    }
                    1 => {
                        proxy.cut_all();
                        cut += 1;
                    }
                    _ => {
                        proxy.refuse(true);
                        proxy.cut_all();
                        std::thread::sleep(Duration::from_millis(rng.random_range(100..500)));
                        proxy.refuse(false);
                        refused += 1;
                    }
                }
            }
            (pg, restarted, cut, refused)
        })
    };

    let started = Instant::now();
    let mut clients = tokio::task::JoinSet::new();
    for n in 0..CLIENTS {
        let addrs = addrs.clone();
        clients.spawn(async move {
            let c = reqwest::Client::builder()
                .pool_max_idle_per_host(0)
                .build()
                .unwrap();
            let mut rng = StdRng::seed_from_u64(seed + n as u64);
            let principal = n % PRINCIPALS;
            let auth = format!("Bearer principal-{principal}");
            let mut log = Vec::new();
            for k in 0..KEYS_PER_CLIENT {
                if started.elapsed() > RUN_FOR {
                    break;
                }
                // Keys and bodies repeat across principals on purpose.
                let key = format!("h-{}-{k}", n / PRINCIPALS);
                let body = body_for(&key);
                let op = format!("principal-{principal}/{key}");
                for _ in 0..ATTEMPTS {
                    let fault = match rng.random_range(0..100) {
                        0..=9 => "reset",
                        10..=21 => "hangup",
                        22..=31 => "double",
                        _ => "none",
                    };
                    let sends = if fault == "double" { 2 } else { 1 };
                    let mut pending = Vec::new();
                    for _ in 0..sends {
                        let addr = addrs[rng.random_range(0..addrs.len())];
                        let delay = rng.random_range(0..150u64).to_string();
                        let limit = if fault == "hangup" {
                            Duration::from_millis(rng.random_range(1..120))
                        } else {
                            Duration::from_secs(10)
                        };
                        let (c, body, key, op, auth) = (
                            c.clone(),
                            body.clone(),
                            key.clone(),
                            op.clone(),
                            auth.clone(),
                        );
                        pending.push(tokio::spawn(async move {
                            let mut headers = vec![
                                ("authorization", auth.as_str()),
                                ("idempotency-key", key.as_str()),
                                (OP, op.as_str()),
                                (DELAY_MS, delay.as_str()),
                            ];
                            if fault == "reset" {
                                headers.push((FAULT, "reset"));
                            }
                            send(&c, addr, &headers, &body, limit).await
                        }));
                    }
                    let mut done = false;
                    for p in pending {
                        let r = p.await.unwrap();
                        let (status, problem, replayed, answer) = match r {
                            Some((s, p, rp, a)) => (Some(s), p, rp, a),
                            None => (None, None, false, Vec::new()),
                        };
                        done |= status == Some(201);
                        log.push(Event {
                            op: op.clone(),
                            status,
                            problem,
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
    let (pg, restarted, cut, refused) = injector.await.unwrap();

    // A last, fault-free read of every operation once things have settled.
    let c = client();
    let mut ops: Vec<String> = history.iter().map(|e| e.op.clone()).collect();
    ops.sort();
    ops.dedup();
    for op in &ops {
        let (principal, key) = op.split_once('/').unwrap();
        let auth = format!("Bearer {principal}");
        let body = body_for(key);
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            let headers = [
                ("authorization", auth.as_str()),
                ("idempotency-key", key),
                (OP, op.as_str()),
            ];
            let r = send(&c, addrs[0], &headers, &body, Duration::from_secs(10)).await;
            let settled = match &r {
                Some((503, ..)) | None => false,
                Some((409, Some(p), ..)) => p != "in-progress",
                Some(_) => true,
            };
            if settled || Instant::now() > until {
                let (status, problem, replayed, answer) = match r {
                    Some((s, p, rp, a)) => (Some(s), p, rp, a),
                    None => (None, None, false, Vec::new()),
                };
                history.push(Event {
                    op: op.clone(),
                    status,
                    problem,
                    replayed,
                    answer,
                });
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    // The checker: executions are attributed to operations by the client's own header.
    let mut by_op: HashMap<String, Vec<usize>> = HashMap::new();
    let mut by_number: HashMap<usize, (String, Vec<u8>)> = HashMap::new();
    for s in up.seen() {
        let op = s.headers[OP][0].clone();
        by_op.entry(op.clone()).or_default().push(s.execution);
        let answer = execution_body(s.execution, &s.method, s.body.len()).into_bytes();
        by_number.insert(s.execution, (op, answer));
    }
    let mut violations = Vec::new();
    for (op, runs) in &by_op {
        if runs.len() > 1 {
            violations.push(format!("{op} executed {} times: {runs:?}", runs.len()));
        }
    }
    let mut statuses: HashMap<String, usize> = HashMap::new();
    let mut replays = 0;
    for e in &history {
        let label = match (e.status, &e.problem) {
            (None, _) => "no answer".to_string(),
            (Some(s), None) => s.to_string(),
            (Some(s), Some(p)) => format!("{s} {p}"),
        };
        *statuses.entry(label).or_default() += 1;
        match e.status {
            Some(201) => {
                replays += usize::from(e.replayed);
                let n = serde_json::from_slice::<serde_json::Value>(&e.answer)
                    .ok()
                    .and_then(|v| v["execution"].as_u64())
                    .map(|n| n as usize);
                match n.and_then(|n| by_number.get(&n)) {
                    Some((op, answer)) if *op == e.op => {
                        if *answer != e.answer {
                            violations.push(format!("{e:?}: answer differs from the execution's"));
                        }
                    }
                    other => violations.push(format!(
                        "{e:?}: a 201 that is the answer of another operation's execution ({other:?})"
                    )),
                }
            }
            Some(409 | 502 | 503 | 504) | None => {}
            Some(s) => violations.push(format!("{e:?}: status {s} outside the failure table")),
        }
    }
    let mut statuses: Vec<_> = statuses.into_iter().collect();
    statuses.sort();
    let executions: usize = by_op.values().map(Vec::len).sum();
    println!(
        "history on PostgreSQL: seed {seed}; {} requests ({replays} replayed answers), {} operations, {executions} upstream executions; database restarted {restarted}, connections cut {cut}, reconnections refused {refused}; statuses {statuses:?}; violations: {}",
        history.len(),
        ops.len(),
        violations.len()
    );
    for v in &violations {
        println!("violation: {v}");
    }
    assert!(violations.is_empty(), "{} violations", violations.len());
    assert!(
        executions >= ops.len() / 2,
        "too few executions to mean anything"
    );
    assert!(restarted + cut + refused > 0, "no store fault was injected");
    for app in instances {
        app.shutdown().await;
    }
    drop(pg);
}
