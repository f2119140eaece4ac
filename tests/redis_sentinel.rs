//! idemgate on a primary watched by three sentinels: it follows a promoted replica without
//! a restart, and with `min_replicas_ack` a claim that the replicas did not acknowledge is
//! never forwarded.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::topology::{redis_base, Node, Sentinels, MASTER};
use common::*;
use idemgate::Config;

fn sentinel_config(up: &Upstream, s: &Sentinels) -> Config {
    let mut c = redis_base(up);
    c.redis_sentinels = s.addrs();
    c.redis_sentinel_master = Some(MASTER.into());
    c.admin_listen = Some("127.0.0.1:0".parse().unwrap());
    c
}

/// The primary is killed; while the sentinels elect a replica, requests get 503
/// `store-unavailable`; afterwards idemgate works on the new primary, and a record that
/// was acknowledged by both replicas before the crash replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follows_a_promoted_replica_without_restart() {
    let mut s = Sentinels::start(2);
    let up = Upstream::start().await;
    let mut cfg = sentinel_config(&up, &s);
    cfg.min_replicas_ack = 2;
    cfg.replica_ack_timeout = Duration::from_millis(300);
    cfg.store_timeout = Duration::from_millis(1000);
    let app = spawn_app(cfg).await;
    let client = client();
    let first = post(&client, &app, "/pay", Some("before"), "{}", &[]).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    let old = s.primary_port().unwrap();

    let killed = s.fail_over();
    assert_ne!(s.primary_port(), Some(old));
    // One replica is left: min_replicas_ack = 2 cannot be met, and nothing is forwarded.
    let hits = up.hits();
    let refused = post(&client, &app, "/pay", Some("during"), "{}", &[]).await;
    assert_eq!(refused.status, 503, "{:?}", refused.body);
    assert!(refused.problem_type().ends_with("store-unavailable"));
    assert_eq!(
        up.hits(),
        hits,
        "a claim without acknowledgement was forwarded"
    );
    // The old primary comes back and the sentinels make it a replica of the new one.
    s.data[killed].restart();
    s.wait_replicas_online(2);

    let after = retry_until(
        HANG_GUARD,
        async || post(&client, &app, "/pay", Some("after"), "{}", &[]).await,
        |a| a.status != 503,
    )
    .await;
    assert_eq!(
        after.status, 201,
        "no 201 from the new primary: {:?}",
        after.body
    );
    let again = post(&client, &app, "/pay", Some("before"), "{}", &[]).await;
    assert!(again.replayed(), "{} {:?}", again.status, again.body);
    assert_eq!(again.body, first.body);
    // `during` was refused and released: it executes now, once.
    let during = post(&client, &app, "/pay", Some("during"), "{}", &[]).await;
    assert_eq!(during.status, 201, "{:?}", during.body);
    assert_eq!(up.hits(), 3);
    app.shutdown().await;
}

/// An instance that is idle while its primary is frozen and a replica promoted, and that
/// is given new keys the moment the old primary resumes (still believing it is primary,
/// until the sentinels demote it): it must write them to the new primary. Before, it kept
/// its connection to the old one, whose demotion then wiped every record written there
/// meanwhile (30 of 30 keys executed again on retry). `min_replicas_ack = 0`, and `1` for
/// the acknowledgement connections, which must follow too.
async fn an_idle_instance_follows_a_failover_it_never_saw(acks: u32) {
    let s = Sentinels::start(2);
    let up = Upstream::start().await;
    let mut cfg = sentinel_config(&up, &s);
    cfg.min_replicas_ack = acks;
    cfg.store_timeout = Duration::from_millis(1000);
    cfg.replica_ack_timeout = Duration::from_millis(500);
    let app = spawn_app(cfg).await;
    let c = client();
    let warm = post(&c, &app, "/pay", Some("warm"), "{}", &[]).await;
    assert_eq!(warm.status, 201, "{:?}", warm.body);
    let old = s.primary_port().unwrap();
    let frozen = replica_pid(&s.data[s.index_of(old)]);
    signal(frozen, "STOP");
    common::until(Duration::from_secs(60), "a failover", async || {
        s.primary_port().filter(|p| *p != old).is_some_and(|p| {
            s.data[s.index_of(p)]
                .info_field("replication", "role")
                .as_deref()
                == Some("master")
        })
    })
    .await;
    // Whatever the instance does to notice, it has a check's time while nothing is sent.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    signal(frozen, "CONT");
    let mut answered = Vec::new();
    for i in 0..30 {
        let key = format!("after-{i}");
        let r = post(&c, &app, "/pay", Some(&key), "{}", &[]).await;
        if r.status == 201 {
            answered.push(key);
        } else {
            assert_eq!(r.status, 503, "{key}: {:?}", r.body);
        }
    }
    assert!(
        answered.len() >= 20,
        "only {} of 30 answered 201",
        answered.len()
    );
    // The sentinels demote the old primary; it resyncs from the new one.
    s.wait_replicas_online(2);
    let hits = up.hits();
    for key in &answered {
        let r = post(&c, &app, "/pay", Some(key), "{}", &[]).await;
        assert!(
            r.replayed(),
            "{key} after the demotion: {} {:?}",
            r.status,
            r.body
        );
    }
    assert_eq!(up.hits(), hits, "a key answered 201 executed again");
    app.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_instance_follows_a_failover_it_never_saw_without_acks() {
    an_idle_instance_follows_a_failover_it_never_saw(0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_instance_follows_a_failover_it_never_saw_with_acks() {
    an_idle_instance_follows_a_failover_it_never_saw(1).await;
}

/// The same user and password on sentinels and data nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn password_applies_to_sentinels_and_data_nodes() {
    let password = "pw-for-this-test";
    let s = Sentinels::start_with(1, Some(password));
    let up = Upstream::start().await;
    let mut cfg = sentinel_config(&up, &s);
    cfg.redis_password = Some(password.into());
    let app = spawn_app(cfg.clone()).await;
    let a = post(&client(), &app, "/pay", Some("k"), "{}", &[]).await;
    assert_eq!(a.status, 201, "{:?}", a.body);
    app.shutdown().await;
    cfg.redis_password = None;
    let e = idemgate::start(cfg)
        .await
        .err()
        .expect("refused without the password");
    assert_eq!(e.exit_code(), 69, "{e}");
    assert!(e.to_string().contains("sentinels"), "{e}");
}

/// `min_replicas_ack` on one primary with one replica: while the replica is frozen, a new
/// key gets 503 and its claim is released (a later retry executes); a claim never reaches
/// the upstream unacknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unacknowledged_claim_is_not_forwarded() {
    let (primary, replica) = primary_with_replica().await;
    let up = Upstream::start().await;
    let app = spawn_app(acking(&up, &primary)).await;
    let client = client();
    let ok = post(&client, &app, "/pay", Some("acked"), "{}", &[]).await;
    assert_eq!(ok.status, 201);

    let pid = replica_pid(&replica);
    signal(pid, "STOP");
    let refused = post(&client, &app, "/pay", Some("frozen"), "{}", &[]).await;
    signal(pid, "CONT");
    assert_eq!(refused.status, 503, "{:?}", refused.body);
    assert!(refused.problem_type().ends_with("store-unavailable"));
    assert_eq!(up.hits(), 1, "forwarded without acknowledgement");
    // Released, not left in progress: the retry executes once the replica answers.
    let retried = post(&client, &app, "/pay", Some("frozen"), "{}", &[]).await;
    assert_eq!(retried.status, 201, "{:?}", retried.body);
    assert_eq!(up.hits(), 2);
    app.shutdown().await;
}

/// While a replica is missing under `min_replicas_ack`, Redis holds a connection for as
/// long as its `WAIT` waits. Eight clients sending new keys together each get their 503
/// after about `replica_ack_timeout` (each claim waits on a connection of its own), not
/// after `store_timeout` in a queue of other claims' `WAIT`s; and replays, which do not
/// wait for replicas, are answered meanwhile. With every claim and its `WAIT` on the one
/// shared connection, the claims queue behind each other's `WAIT`s (200 ms each) and the
/// replays behind them: both run into `store_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_waiting_for_a_missing_replica_hold_up_nothing_else() {
    let (primary, replica) = primary_with_replica().await;
    let up = Upstream::start().await;
    let mut cfg = acking(&up, &primary);
    cfg.store_timeout = Duration::from_millis(1000);
    let app = std::sync::Arc::new(spawn_app(cfg).await);
    let client = client();
    let done = post(&client, &app, "/pay", Some("done"), "{}", &[]).await;
    assert_eq!(done.status, 201, "{:?}", done.body);

    let pid = replica_pid(&replica);
    signal(pid, "STOP");
    let mut senders = Vec::new();
    for c in 0..8 {
        let app = app.clone();
        senders.push(tokio::spawn(async move {
            let client = common::client();
            let mut answers = Vec::new();
            for i in 0..4 {
                let started = std::time::Instant::now();
                let a = post(&client, &app, "/pay", Some(&format!("n{c}-{i}")), "{}", &[]).await;
                answers.push((a.status, started.elapsed()));
            }
            answers
        }));
    }
    let mut replays = Vec::new();
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let a = post(&client, &app, "/pay", Some("done"), "{}", &[]).await;
        replays.push((a.status, a.replayed()));
    }
    let mut answers = Vec::new();
    for s in senders {
        answers.extend(s.await.unwrap());
    }
    signal(pid, "CONT");
    assert!(
        replays.iter().all(|r| *r == (201, true)),
        "replays held up: {replays:?}"
    );
    assert!(
        answers
            .iter()
            .all(|(s, t)| *s == 503 && *t < Duration::from_millis(800)),
        "{answers:?}"
    );
    assert_eq!(up.hits(), 1, "forwarded without acknowledgement");
    // Once the replica answers again, new keys execute.
    let status = retry_until(
        HANG_GUARD,
        async || {
            post(&client, &app, "/pay", Some("after"), "{}", &[])
                .await
                .status
        },
        |s| *s == 201,
    )
    .await;
    assert_eq!(
        status, 201,
        "no new key executed after the replica came back"
    );
    match std::sync::Arc::try_unwrap(app) {
        Ok(app) => app.shutdown().await,
        Err(_) => panic!("the app is still shared"),
    }
}

/// `min_replicas_ack` at start-up: a replica that does not acknowledge the scope secret in
/// time (frozen here, as one that has only just finished its first sync can be) gets more
/// tries before start-up fails, so idemgate starts once it answers; one that never answers
/// still stops start-up, with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_up_waits_for_a_late_replica_to_acknowledge_the_scope_secret() {
    let (primary, replica) = primary_with_replica().await;
    let up = Upstream::start().await;
    let config = || acking(&up, &primary);
    let pid = replica_pid(&replica);

    // Frozen through the first wait (200 ms), resumed during the second or third.
    signal(pid, "STOP");
    let resume = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(450)).await;
        signal(pid, "CONT");
    });
    let started = std::time::Instant::now();
    let app = idemgate::start(config()).await;
    resume.await.unwrap();
    let app = app.expect("starts once the replica acknowledges");
    assert!(
        started.elapsed() >= Duration::from_millis(400),
        "started before the replica could acknowledge: {:?}",
        started.elapsed()
    );
    let ok = post(&client(), &app, "/pay", Some("late"), "{}", &[]).await;
    assert_eq!(ok.status, 201, "{:?}", ok.body);
    app.shutdown().await;

    // Frozen for good: start-up gives up, saying why.
    signal(pid, "STOP");
    let refused = idemgate::start(config()).await;
    signal(pid, "CONT");
    let err = refused.err().expect("no start-up without the replica");
    assert!(
        err.to_string().contains("acknowledged by 0 of 1 replicas"),
        "{err}"
    );
}

/// A primary and one replica of it, online.
async fn primary_with_replica() -> (RedisServer, Node) {
    let primary = RedisServer::start();
    let of = format!("127.0.0.1 {}", primary.port);
    let replica = Node::start(&["--replicaof", &of, "--save", "", "--appendonly", "no"]);
    eventually_online(&primary).await;
    (primary, replica)
}

/// The configuration on `primary` with `min_replicas_ack = 1` and a 200 ms `WAIT`.
fn acking(up: &Upstream, primary: &RedisServer) -> Config {
    let mut cfg = redis_base(up);
    cfg.redis_url = Some(primary.url());
    cfg.min_replicas_ack = 1;
    cfg.replica_ack_timeout = Duration::from_millis(200);
    cfg
}

async fn eventually_online(primary: &RedisServer) {
    let until = std::time::Instant::now() + Duration::from_secs(20);
    let streaming = tokio::task::block_in_place(|| {
        common::topology::replicas_streaming(|a| primary.command(a), 1, until)
    });
    assert!(streaming, "replica never online");
}

fn replica_pid(n: &Node) -> u32 {
    n.info_field("server", "process_id")
        .unwrap()
        .parse()
        .unwrap()
}

/// What `min_replicas_ack` costs, read from Redis itself (`INFO commandstats` and
/// `INFO cpu` of the primary) over new keys sent one at a time; printed, not asserted.
/// `cargo test --release --test stores redis_sentinel::replica_ack_cost -- --ignored --nocapture`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement"]
async fn replica_ack_cost() {
    const N: usize = 2000;
    let (primary, _replica) = primary_with_replica().await;
    let field = |info: &str, name: &str| -> f64 {
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
    };
    let stat = |info: &str, cmd: &str, what: &str| -> f64 {
        info.lines()
            .find_map(|l| l.strip_prefix(&format!("cmdstat_{cmd}:")))
            .and_then(|l| {
                l.split(',')
                    .find_map(|kv| kv.strip_prefix(&format!("{what}=")))
            })
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    for ack in [0u32, 1] {
        let up = Upstream::start().await;
        let mut cfg = redis_base(&up);
        cfg.redis_url = Some(primary.url());
        cfg.min_replicas_ack = ack;
        let app = spawn_app(cfg).await;
        let client = client();
        primary.command(&["CONFIG", "RESETSTAT"]).unwrap();
        let cpu = |i: &str| field(i, "used_cpu_sys") + field(i, "used_cpu_user");
        let before = primary.command(&["INFO", "cpu"]).unwrap();
        let start = std::time::Instant::now();
        for i in 0..N {
            let a = post(
                &client,
                &app,
                "/pay",
                Some(&format!("cost-{ack}-{i}")),
                "{}",
                &[],
            )
            .await;
            assert_eq!(a.status, 201);
        }
        let elapsed = start.elapsed();
        let after = primary.command(&["INFO", "cpu"]).unwrap();
        let stats = primary.command(&["INFO", "commandstats"]).unwrap();
        let per = |cmd: &str, what: &str| stat(&stats, cmd, what) / N as f64;
        eprintln!(
            "min_replicas_ack={ack}: per new key: evalsha {:.2} calls ({:.1} us), wait {:.2} calls ({:.1} us), \
             primary CPU {:.1} us (idle time included), client latency {:.0} us",
            per("evalsha", "calls"),
            per("evalsha", "usec"),
            per("wait", "calls"),
            per("wait", "usec"),
            (cpu(&after) - cpu(&before)) * 1e6 / N as f64,
            elapsed.as_micros() as f64 / N as f64,
        );
        app.shutdown().await;
    }
}
