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
//! for byte, and no status outside the failure table of docs/guarantees.md. `HISTORY_ON_AMBIGUOUS=release`
//! gives up at-most-once for ambiguous outcomes: the checker must then report double
//! executions, which shows it can fail.
//!
//! The clients, the last read and the checker are `tests/common/history.rs`; this file is
//! the topology and the fault injector.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::faultproxy::FaultProxy;
use common::history::*;
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

    let clients = Clients {
        seed,
        clients: CLIENTS,
        keys: KEYS_PER_CLIENT,
        stop: Stop::After(RUN_FOR),
        attempts: ATTEMPTS,
        faults: &[("reset", 10), ("hangup", 12), ("double", 10)],
        addrs: vec![addrs],
        paths: &["/v1/transfers"],
        transport: Transport::Reqwest,
        upstream_delay_ms: Some(0..150),
        retry_pause_ms: 20..200,
        key_pause_ms: None,
        intent: Arc::new(|n, k, _| {
            let principal = format!("principal-{}", n % PRINCIPALS);
            // Keys and bodies repeat across principals on purpose.
            let key = format!("h-{}-{k}", n / PRINCIPALS);
            Intent {
                service: 0,
                op: format!("{principal}/{key}"),
                body: body_for(&key),
                key,
                credentials: vec![format!("Bearer {principal}")],
                final_credential: format!("Bearer {principal}"),
                multipart: false,
            }
        }),
    };
    let mut history = run(&clients).await;
    stop.store(true, Ordering::SeqCst);
    let (pg, restarted, cut, refused) = injector.await.unwrap();

    // A last, fault-free read of every operation once things have settled.
    settle(&clients, &mut history, None).await;
    let verdict = check(
        &history,
        Check {
            upstreams: std::slice::from_ref(&up),
            allowed: FAILURE_TABLE,
            problems: None,
            unknown_means_may_have_run: false,
        },
    );
    println!(
        "history on PostgreSQL: seed {seed}; {verdict}; database restarted {restarted}, connections cut {cut}, reconnections refused {refused}"
    );
    verdict.assert_clean();
    assert!(
        verdict.executions >= verdict.operations / 2,
        "too few executions to mean anything"
    );
    assert!(restarted + cut + refused > 0, "no store fault was injected");
    for app in instances {
        app.shutdown().await;
    }
    drop(pg);
}
