//! A Jepsen-style history check. Clients send retried transfers to two services, each
//! behind two idemgate instances, all four sharing one Redis under two namespaces, while
//! faults are injected at random: Redis frozen (SIGSTOP/SIGCONT) or killed and restarted
//! (fsynced append-only file), the upstream breaking off mid-answer or hanging, clients
//! hanging up. The clients vary what real clients vary: each attempt picks an instance, a
//! spelling of the path and one of its principal's refreshed bearer tokens, and several
//! principals reuse the same keys with the same bodies.
//!
//! What one operation is comes from the clients, not from idemgate: each intent carries its
//! own id in an `x-test-op` header (headers are not fingerprinted, so bodies stay identical
//! across principals and a wrong replay would go unnoticed by a 422). The checker asserts,
//! over the whole history:
//!
//! - at most one upstream execution per operation (by that header, per service);
//! - every 201 a client saw (first-hand or replayed) is the answer of the one execution of
//!   its own operation, on its own service, byte for byte;
//! - no status outside what the README's failure table allows (a 422 or a 4xx here would be
//!   an honest retry refused).
//!
//! `HISTORY_ON_AMBIGUOUS=release` gives up at-most-once for ambiguous outcomes and
//! `HISTORY_TENANT=credential` scopes by the raw token (so a refreshed token is another
//! tenant): with either, the checker must report double executions, which shows it can fail.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const CLIENTS: usize = 8;
const KEYS_PER_CLIENT: usize = 30;
const ATTEMPTS: usize = 4;
const PRINCIPALS: usize = 3;
/// Bearer tokens minted per principal: each attempt presents one of them (a refresh).
const TOKENS_PER_PRINCIPAL: usize = 3;
const SERVICES: [&str; 2] = ["payments", "ledger"];
/// Spellings of one path that a client may send (all mean `/v1/transfers`).
const SPELLINGS: [&str; 5] = [
    "/v1/transfers",
    "/v1/transfers/",
    "/v1//transfers",
    "/v1/%74ransfers",
    "/v1/./transfers",
];
/// Clients start no new key after this; the run ends a few seconds later at most.
const RUN_FOR: Duration = Duration::from_secs(12);
const JWT_SECRET: &str = "history-jwt-secret-0123456789abcdef";
/// The header that names an operation, the client's own bookkeeping.
const OP: &str = "x-test-op";

#[derive(Debug, Clone)]
struct Event {
    service: usize,
    op: String,
    fault: &'static str,
    /// `None`: the client hung up or the connection failed.
    status: Option<u16>,
    problem: Option<String>,
    replayed: bool,
    answer: Vec<u8>,
}

fn body_for(key: &str) -> String {
    format!("{{\"key\":\"{key}\",\"amount\":{}}}", key.len() * 100 + 7)
}

fn token(principal: usize, refresh: usize) -> String {
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 3600;
    let claims =
        serde_json::json!({"sub": format!("principal-{principal}"), "iat": refresh, "exp": exp});
    let t = encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(JWT_SECRET.as_bytes()),
    )
    .unwrap();
    format!("Bearer {t}")
}

/// Sends a request written by hand (an HTTP client would normalize the path first).
/// `limit` bounds the whole exchange; `None` on a hang-up or a broken connection.
async fn send(
    addr: std::net::SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
    limit: Duration,
) -> Option<(u16, Option<String>, bool, Vec<u8>)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut req = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        s.write_all(req.as_bytes()).await.ok()?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.ok()?;
        Some(out)
    };
    let raw = tokio::time::timeout(limit, exchange).await.ok().flatten()?;
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
    let status = head.split(' ').nth(1)?.parse().ok()?;
    let header = |name: &str| {
        head.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}: ")).map(str::to_string))
    };
    let length: usize = header("content-length")?.trim().parse().ok()?;
    let body = raw.get(split + 4..split + 4 + length)?.to_vec();
    let replayed = header("idempotent-replayed").as_deref() == Some("true");
    Some((status, header("idemgate-error"), replayed, body))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_under_random_faults_has_no_double_execution() {
    let seed: u64 = std::env::var("HISTORY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20240917);
    let redis = RedisServer::start_persistent();
    let ups = [Upstream::start().await, Upstream::start().await];
    let mut instances = Vec::new();
    for (service, up) in SERVICES.iter().zip(&ups) {
        let mut cfg = redis_config(up, &redis);
        cfg.namespace = Some(service.to_string());
        cfg.store_timeout = Duration::from_millis(300);
        // The deleted secret is put back within this, well inside the run.
        cfg.scope_secret_check_interval = Duration::from_millis(500);
        cfg.defaults.lease = Duration::from_millis(600);
        cfg.defaults.upstream_timeout = Duration::from_millis(800);
        cfg.defaults.anonymous = idemgate::config::Anonymous::Refuse;
        cfg.jwt_hs256_secret = Some(JWT_SECRET.into());
        if std::env::var("HISTORY_TENANT").as_deref() != Ok("credential") {
            cfg.defaults.tenant_jwt_claim = Some("sub".into());
        }
        if std::env::var("HISTORY_ON_AMBIGUOUS").as_deref() == Ok("release") {
            cfg.defaults.on_ambiguous = idemgate::config::OnAmbiguous::Release;
        }
        instances.push(vec![spawn_app(cfg.clone()).await, spawn_app(cfg).await]);
    }
    let addrs: Vec<Vec<_>> = instances
        .iter()
        .map(|pair| pair.iter().map(|a| a.addr()).collect())
        .collect();

    // The fault injector owns Redis; it runs on a blocking thread because restarting Redis
    // waits for it synchronously.
    let stop = Arc::new(AtomicBool::new(false));
    let faults = Arc::new(AtomicUsize::new(0));
    // Besides Redis faults: the upstreams restart gracefully (every idle connection closed
    // at once), and the scope secret alone is deleted from Redis (no record with it), which
    // the running instances must put back without splitting.
    let injector = {
        let (stop, faults) = (stop.clone(), faults.clone());
        let upstreams = ups.clone();
        tokio::task::spawn_blocking(move || {
            let mut redis = redis;
            let mut rng = StdRng::seed_from_u64(seed ^ 0xfa17);
            let (mut paused, mut restarted, mut up_restarts, mut secret_lost) = (0, 0, 0, 0);
            while !stop.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(rng.random_range(200..800)));
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                match rng.random_range(0..100) {
                    0..=49 => {
                        redis.pause();
                        std::thread::sleep(Duration::from_millis(rng.random_range(100..700)));
                        redis.resume();
                        paused += 1;
                    }
                    50..=69 => {
                        redis.restart();
                        restarted += 1;
                    }
                    70..=89 => {
                        for up in &upstreams {
                            up.restart();
                        }
                        up_restarts += 1;
                    }
                    _ => {
                        let _ = redis.command(&["DEL", "idemgate:scope-secret"]);
                        secret_lost += 1;
                    }
                }
                faults.fetch_add(1, Ordering::SeqCst);
            }
            (redis, paused, restarted, up_restarts, secret_lost)
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
            let principal = n % PRINCIPALS;
            let tokens: Vec<String> = (0..TOKENS_PER_PRINCIPAL)
                .map(|r| token(principal, r))
                .collect();
            let mut log = Vec::new();
            for k in 0..KEYS_PER_CLIENT {
                if started.elapsed() > RUN_FOR {
                    break;
                }
                // Keys and bodies repeat across principals and services on purpose.
                let key = format!("h-{}-{k}", n / PRINCIPALS);
                let body = body_for(&key);
                let service = rng.random_range(0..SERVICES.len());
                let op = format!("{}/principal-{principal}/{key}", SERVICES[service]);
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
                        let addr = addrs[service][rng.random_range(0..2)];
                        let path = SPELLINGS[rng.random_range(0..SPELLINGS.len())];
                        let auth = tokens[rng.random_range(0..tokens.len())].clone();
                        let delay = rng.random_range(0..150u64).to_string();
                        let limit = if fault == "hangup" {
                            Duration::from_millis(rng.random_range(1..120))
                        } else {
                            Duration::from_secs(10)
                        };
                        let (body, key, op) = (body.clone(), key.clone(), op.clone());
                        pending.push(async move {
                            let mut headers = vec![
                                ("authorization", auth.as_str()),
                                ("idempotency-key", key.as_str()),
                                (OP, op.as_str()),
                                (DELAY_MS, delay.as_str()),
                            ];
                            if fault == "reset" || fault == "hang" {
                                headers.push((FAULT, fault));
                            }
                            send(addr, path, &headers, &body, limit).await
                        });
                    }
                    let results = futures_join_all(pending).await;
                    let mut done = false;
                    for r in results {
                        let (status, problem, replayed, answer) = match r {
                            Some((s, p, rp, a)) => (Some(s), p, rp, a),
                            None => (None, None, false, Vec::new()),
                        };
                        done |= status == Some(201);
                        log.push(Event {
                            service,
                            op: op.clone(),
                            fault,
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
    let (redis, paused, restarted, up_restarts, secret_lost) = injector.await.unwrap();

    // A last, fault-free read of every operation once things have settled, with a fresh
    // token and the plainest spelling: it must also agree.
    let mut ops: Vec<(usize, String)> = history.iter().map(|e| (e.service, e.op.clone())).collect();
    ops.sort();
    ops.dedup();
    for (service, op) in &ops {
        let mut parts = op.splitn(3, '/');
        let (_, principal, key) = (parts.next(), parts.next().unwrap(), parts.next().unwrap());
        let principal: usize = principal.trim_start_matches("principal-").parse().unwrap();
        let auth = token(principal, 99);
        let body = body_for(key);
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            let headers = [
                ("authorization", auth.as_str()),
                ("idempotency-key", key),
                (OP, op.as_str()),
            ];
            let r = send(
                addrs[*service][0],
                "/v1/transfers",
                &headers,
                &body,
                Duration::from_secs(10),
            )
            .await;
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
                    service: *service,
                    op: op.clone(),
                    fault: "final",
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
    let mut by_op: HashMap<(usize, String), Vec<usize>> = HashMap::new();
    let mut by_number: HashMap<(usize, usize), (String, Vec<u8>)> = HashMap::new();
    let mut executions = 0;
    for (service, up) in ups.iter().enumerate() {
        for s in up.seen() {
            executions += 1;
            let op = s.headers[OP][0].clone();
            by_op
                .entry((service, op.clone()))
                .or_default()
                .push(s.execution);
            let answer = execution_body(s.execution, &s.method, s.body.len()).into_bytes();
            by_number.insert((service, s.execution), (op, answer));
        }
    }
    let mut violations = Vec::new();
    for (op, runs) in &by_op {
        if runs.len() > 1 {
            violations.push(format!("{op:?} executed {} times: {runs:?}", runs.len()));
        }
    }
    let mut statuses: HashMap<String, usize> = HashMap::new();
    let mut by_fault: HashMap<&str, usize> = HashMap::new();
    let mut replays = 0;
    for e in &history {
        let label = match (e.status, &e.problem) {
            (None, _) => "no answer".to_string(),
            (Some(s), None) => s.to_string(),
            (Some(s), Some(p)) => format!("{s} {p}"),
        };
        *statuses.entry(label).or_default() += 1;
        *by_fault.entry(e.fault).or_default() += 1;
        match e.status {
            Some(201) => {
                replays += usize::from(e.replayed);
                let n = serde_json::from_slice::<serde_json::Value>(&e.answer)
                    .ok()
                    .and_then(|v| v["execution"].as_u64())
                    .map(|n| n as usize);
                match n.and_then(|n| by_number.get(&(e.service, n))) {
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
            // 409 in progress / outcome unknown, 503 store unavailable, 504 outcome
            // unknown, 502 never sent: all in the README's table.
            Some(409 | 502 | 503 | 504) | None => {}
            Some(s) => violations.push(format!("{e:?}: status {s} outside the failure table")),
        }
    }
    let mut statuses: Vec<_> = statuses.into_iter().collect();
    statuses.sort();
    let mut by_fault: Vec<_> = by_fault.into_iter().collect();
    by_fault.sort();
    println!(
        "history: seed {seed}; {} requests ({} replayed answers), {} operations, {} upstream executions; faults injected: {} (Redis paused {paused}, restarted {restarted}; upstreams restarted {up_restarts}; scope secret deleted {secret_lost}; client-side {}); requests by client-side fault {by_fault:?}; statuses {statuses:?}; violations: {}",
        history.len(),
        replays,
        ops.len(),
        executions,
        faults.load(Ordering::SeqCst) + client_faults.load(Ordering::SeqCst),
        client_faults.load(Ordering::SeqCst),
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
    for up in &ups {
        assert!(up.hits() > 0, "both services executed operations");
    }
    assert!(paused + restarted > 0, "no store fault was injected");
    // Every instance still agrees on the secret, which is back in Redis.
    tokio::time::sleep(Duration::from_secs(1)).await;
    for app in instances.iter().flatten() {
        let admin = app.admin_addr().unwrap();
        let ready = tokio::task::spawn_blocking(move || http_get(admin, "/readyz"))
            .await
            .unwrap()
            .unwrap_or_default();
        assert!(
            ready.starts_with("HTTP/1.1 200"),
            "an instance is unready: {ready}"
        );
    }
    assert!(
        redis
            .command(&["EXISTS", "idemgate:scope-secret"])
            .is_some_and(|r| r.starts_with(":1")),
        "the scope secret was not put back"
    );
    for app in instances.into_iter().flatten() {
        app.shutdown().await;
    }
    drop(redis);
}

/// Awaits all futures concurrently (two at most here), in order.
async fn futures_join_all<F: std::future::Future>(fs: Vec<F>) -> Vec<F::Output> {
    let handles: Vec<_> = fs.into_iter().map(Box::pin).collect();
    let mut out = Vec::new();
    let mut handles = handles;
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
