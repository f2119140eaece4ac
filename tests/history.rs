//! A Jepsen-style history check. Clients send retried transfers to two services, each
//! behind two idemgate instances (one keeping records as hashes, the other as values), all
//! four sharing one Redis under two namespaces, while
//! faults are injected at random: Redis frozen (SIGSTOP/SIGCONT) or killed and restarted
//! (fsynced append-only file), the upstream breaking off mid-answer or hanging, clients
//! hanging up. The clients vary what real clients vary: each attempt picks an instance, a
//! spelling of the path (raw or encoded bytes of a non-ASCII payee, repeated slashes, dot
//! segments, `;` path parameters, the query's pairs in another order) and one of its
//! principal's refreshed bearer tokens; every third operation is a multipart/form-data body
//! with a new boundary on each send; and principals reuse the same keys with the same
//! bodies, among them principals of two issuers (an HS256 secret and an RS256 JWKS key)
//! with the same `sub`.
//!
//! What one operation is comes from the clients, not from idemgate: each intent carries its
//! own id in an `x-test-op` header (headers are not fingerprinted, so bodies stay identical
//! across principals and a wrong replay would go unnoticed by a 422). The checker asserts,
//! over the whole history:
//!
//! - at most one upstream execution per operation (by that header, per service);
//! - every 201 a client saw (first-hand or replayed) is the answer of the one execution of
//!   its own operation, on its own service, byte for byte;
//! - no status outside what the failure table of docs/guarantees.md allows (a 422 or a 4xx here would be
//!   an honest retry refused).
//!
//! `HISTORY_ON_AMBIGUOUS=release` gives up at-most-once for ambiguous outcomes and
//! `HISTORY_TENANT=credential` scopes by the raw token (so a refreshed token is another
//! tenant): with either, the checker must report double executions, which shows it can fail.
//!
//! The clients, the last read and the checker are `tests/common/history.rs`; this file is
//! the topology and the fault injector.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::history::*;
use common::idp::Idp;
use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const CLIENTS: usize = 8;
const KEYS_PER_CLIENT: usize = 30;
const ATTEMPTS: usize = 4;
/// Principals: `sub` `principal-{p / 2}` of issuer `p % 2`, so each subject exists at both
/// issuers.
const PRINCIPALS: usize = 4;
const ISSUERS: [&str; 2] = ["https://internal.example", "https://idp.example"];
/// Bearer tokens minted per principal: each attempt presents one of them (a refresh).
const TOKENS_PER_PRINCIPAL: usize = 3;
const SERVICES: [&str; 2] = ["payments", "ledger"];
/// Spellings of one request target that a client may send (all mean
/// `/v1/transfers/jos%C3%A9?currency=EUR&memo=rent`; `\u{e9}` goes out as its raw UTF-8
/// bytes). The routes strip `;` parameters (`path_params = "strip"`).
const SPELLINGS: [&str; 8] = [
    "/v1/transfers/jos%C3%A9?currency=EUR&memo=rent",
    "/v1/transfers/jos\u{e9}?memo=rent&currency=EUR",
    "/v1/transfers/jos%c3%a9/?currency=EUR&memo=rent",
    "/v1//transfers/jos%C3%A9?memo=rent&currency=EUR",
    "/v1/%74ransfers/jos\u{e9}?currency=EUR&memo=rent",
    "/v1/./transfers/jos%C3%A9?currency=EUR&memo=rent",
    "/v1/transfers;jsessionid=S1/jos%C3%A9?currency=EUR&memo=rent",
    "/v1;v=2/transfers/jos\u{e9};x?memo=rent&currency=EUR",
];
/// Clients start no new key after this; the run ends a few seconds later at most.
const RUN_FOR: Duration = Duration::from_secs(12);
const JWT_SECRET: &str = "history-jwt-secret-0123456789abcdef";

fn token(idp: &Idp, principal: usize, refresh: usize) -> String {
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 3600;
    let issuer = ISSUERS[principal % 2];
    let claims = serde_json::json!({
        "iss": issuer,
        "sub": format!("principal-{}", principal / 2),
        "iat": refresh,
        "exp": exp,
    });
    if principal % 2 == 1 {
        return idp.token(claims);
    }
    common::idp::hs256_bearer(JWT_SECRET, &claims)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_under_random_faults_has_no_double_execution() {
    let seed: u64 = std::env::var("HISTORY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20240917);
    let redis = RedisServer::start_persistent();
    let ups = [Upstream::start().await, Upstream::start().await];
    let idp = Arc::new(Idp::new());
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
        cfg.jwks_file = Some(idp.jwks().into());
        cfg.defaults.path_params = idemgate::config::PathParams::Strip;
        // The upstream reads a raw non-ASCII byte as UTF-8 (as `%C3%A9`): the route says so,
        // and the spellings above that send `é` raw are one request target with the others.
        cfg.defaults.raw_utf8_paths = Some(true);
        if std::env::var("HISTORY_TENANT").as_deref() != Ok("credential") {
            cfg.defaults.tenant_jwt_claim = Some("sub".into());
        }
        if std::env::var("HISTORY_ON_AMBIGUOUS").as_deref() == Ok("release") {
            cfg.defaults.on_ambiguous = idemgate::config::OnAmbiguous::Release;
        }
        // A fleet half-way through switching to records kept as values: of each pair, one
        // instance writes hashes, the other values, and each reads the other's.
        let mut values = cfg.clone();
        values.redis_record_format = idemgate::config::RedisRecordFormat::Value;
        instances.push(vec![spawn_app(cfg).await, spawn_app(values).await]);
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

    let tokens: Vec<Vec<String>> = (0..PRINCIPALS)
        .map(|p| {
            (0..TOKENS_PER_PRINCIPAL)
                .map(|r| token(&idp, p, r))
                .collect()
        })
        .collect();
    let clients = Clients {
        seed,
        clients: CLIENTS,
        keys: KEYS_PER_CLIENT,
        stop: Stop::After(RUN_FOR),
        attempts: ATTEMPTS,
        faults: &[("reset", 10), ("hang", 3), ("hangup", 12), ("double", 10)],
        addrs,
        paths: &SPELLINGS,
        transport: Transport::Raw,
        upstream_delay_ms: Some(0..150),
        retry_pause_ms: 20..200,
        key_pause_ms: None,
        intent: Arc::new(move |n, k, rng| {
            let principal = n % PRINCIPALS;
            // Keys and bodies repeat across principals and services on purpose.
            let key = format!("h-{}-{k}", n / PRINCIPALS);
            let service = rng.random_range(0..SERVICES.len());
            Intent {
                service,
                op: format!("{}/principal-{principal}/{key}", SERVICES[service]),
                body: body_for(&key),
                key,
                credentials: tokens[principal].clone(),
                // A fresh token for the last read.
                final_credential: token(&idp, principal, 99),
                multipart: k % 3 == 0,
            }
        }),
    };
    let mut history = run(&clients).await;
    stop.store(true, Ordering::SeqCst);
    let (redis, paused, restarted, up_restarts, secret_lost) = injector.await.unwrap();

    // A last, fault-free read of every operation once things have settled, with a fresh
    // token and the plainest spelling: it must also agree.
    settle(&clients, &mut history, None).await;
    let verdict = check(
        &history,
        Check {
            upstreams: &ups,
            allowed: FAILURE_TABLE,
            problems: None,
            unknown_means_may_have_run: false,
        },
    );
    println!(
        "history: seed {seed}; {verdict}; faults injected: {} (Redis paused {paused}, restarted {restarted}; upstreams restarted {up_restarts}; scope secret deleted {secret_lost}; client-side {})",
        faults.load(Ordering::SeqCst) + history.client_faults,
        history.client_faults,
    );
    verdict.assert_clean();
    assert!(
        verdict.executions >= verdict.operations / 2,
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
