//! Records whose write fails are written again until they land, through the binary: the
//! store (Redis behind a proxy that cuts the calls that carry an answer) takes every claim
//! and refuses every answer's write for a while. The client has its answer; a retry on the
//! instance holding the write is told to wait (409 `in-progress`), never that the outcome
//! is unknown; once the store takes the write, the retry replays it. Observe mode's
//! supersede of a recorded failure is kept the same way, so switching to enforce replays
//! the later answer, never the stale failure.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::faultproxy::FaultProxy;
use common::postgres::PgServer;
use common::*;
use idemgate::config::Mode;

const TRANSFER: &str = r#"{"from":"acc-1","to":"acc-2","amount":1250,"currency":"EUR"}"#;

/// The bytes every answer of the test upstream's `n`th execution carries (see
/// [`execution_body`]), and so every store call that writes it.
fn answer_of(n: usize) -> String {
    format!("\"execution\":{n},")
}

fn is(r: &Answer, problem: &str) -> bool {
    r.status == 409 && r.problem_type().ends_with(problem)
}

/// Every answer's write refused while claims pass, through `proxy` in front of the store
/// `gate` is set up on: the client has its 201, a retry on this instance is told to wait
/// (also once the lease ran out), and once the store takes writes the record lands and the
/// retry replays it.
async fn lands_and_replays(gate: Idemgate, proxy: &FaultProxy, up: &Upstream) {
    let gate = gate
        .set(|c| {
            c.store_timeout = Duration::from_millis(500);
            c.defaults.lease = Duration::from_millis(600);
        })
        .binary();
    let c = client();
    let url = gate.url("/v1/transfers");
    proxy.cut_requests_containing(Some(answer_of(1).as_bytes()));
    let first = post_url(&c, &url, Some("k-late"), TRANSFER, &[]).await;
    assert_eq!(first.status, 201, "the client has the upstream's answer");
    assert_eq!(first.header("x-execution"), Some("1"));
    eventually(Duration::from_secs(5), "the write pending", || {
        gate.metric("idemgate_record_writes_pending") == 1.0
    })
    .await;
    // Once the lease has run out the store reads the record as unknown; this instance
    // knows better: the request ran, and its answer is on its way.
    let id = record_of(&c, &url).await;
    let state = async || {
        let r = c
            .get(gate.admin_url(&format!("/records/{id}")))
            .send()
            .await;
        // A 503 when the call shares its connection with a refused write.
        match r {
            Ok(r) if r.status() == 200 => r.json::<serde_json::Value>().await.ok(),
            _ => None,
        }
    };
    let unknown = common::retry_until(Duration::from_secs(5), state, |r| {
        r.as_ref().is_some_and(|r| r["state"] == "unknown")
    })
    .await;
    assert_eq!(unknown.unwrap()["state"], "unknown", "the lease ran out");
    let during = past_blips(&c, &url).await;
    assert!(is(&during, "/in-progress"), "{:?}", during.body);
    assert!(during.header("retry-after").is_some());
    assert!(proxy.cuts() > 0, "the writes were refused");
    // The store takes the write again: it lands, and the retry replays it.
    proxy.cut_requests_containing(None);
    eventually(Duration::from_secs(5), "the write landed", || {
        gate.metric("idemgate_record_writes_pending") == 0.0
    })
    .await;
    assert_eq!(gate.metric("idemgate_record_writes_landed_total"), 1.0);
    assert_eq!(gate.metric("idemgate_record_writes_given_up_total"), 0.0);
    assert_eq!(
        gate.metric("idemgate_record_writes_oldest_pending_seconds"),
        0.0
    );
    let retry = post_url(&c, &url, Some("k-late"), TRANSFER, &[]).await;
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    assert!(retry.replayed());
    assert_eq!(retry.header("x-execution"), Some("1"));
    assert_eq!(up.hits(), 1, "executed once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_whose_write_failed_lands_and_its_retry_replays_on_redis() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::for_redis(&redis).await;
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url()).redis_url(&proxy.redis_url());
    lands_and_replays(gate, &proxy, &up).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_whose_write_failed_lands_and_its_retry_replays_on_postgres() {
    let pg = tokio::task::spawn_blocking(PgServer::shared).await.unwrap();
    let db = pg.fresh_db().await;
    let name = db.rsplit('/').next().unwrap().to_string();
    let proxy = FaultProxy::start(format!("127.0.0.1:{}", pg.port).parse().unwrap()).await;
    let up = Upstream::start().await;
    let through = format!("postgres://postgres@{}/{name}", proxy.addr);
    let gate = Idemgate::new(&up.url()).set(|c| {
        c.postgres_url = Some(through.as_str().into());
        c.scope_secret_create_delay = Duration::ZERO;
    });
    lands_and_replays(gate, &proxy, &up).await;
}

/// PostgreSQL's connections cut every 150 ms for 2 s under four retrying clients, then
/// left alone: every key whose client got a 201 replays it; none is held `unknown`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_cut_connections_no_key_answered_2xx_is_held_unknown() {
    let pg = tokio::task::spawn_blocking(PgServer::shared).await.unwrap();
    let db = pg.fresh_db().await;
    let name = db.rsplit('/').next().unwrap().to_string();
    let proxy = FaultProxy::start(format!("127.0.0.1:{}", pg.port).parse().unwrap()).await;
    let up = Upstream::start().await;
    let through = format!("postgres://postgres@{}/{name}", proxy.addr);
    let gate = Idemgate::new(&up.url())
        .set(|c| {
            c.postgres_url = Some(through.as_str().into());
            c.scope_secret_create_delay = Duration::ZERO;
            c.store_timeout = Duration::from_millis(300);
            c.defaults.lease = Duration::from_millis(600);
        })
        .binary();
    let url = gate.url("/v1/transfers");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut clients = tokio::task::JoinSet::new();
    for n in 0..4 {
        let (url, stop) = (url.clone(), stop.clone());
        clients.spawn(async move {
            let c = client();
            let mut answered = Vec::new();
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let key = format!("cut-{n}-{i}");
                i += 1;
                let r = post_url(&c, &url, Some(&key), TRANSFER, &[(DELAY_MS, "20")]).await;
                if r.status == 201 && !r.replayed() {
                    answered.push((key, r.body));
                }
            }
            answered
        });
    }
    let cutting = tokio::time::Instant::now();
    while cutting.elapsed() < Duration::from_secs(2) {
        tokio::time::sleep(Duration::from_millis(150)).await;
        proxy.cut_all();
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut answered = Vec::new();
    while let Some(a) = clients.join_next().await {
        answered.extend(a.unwrap());
    }
    eventually(Duration::from_secs(10), "every write landed", || {
        gate.metric("idemgate_record_writes_pending") == 0.0
    })
    .await;
    let c = client();
    let mut held_unknown = 0;
    for (key, body) in &answered {
        let r = post_url(&c, &url, Some(key), TRANSFER, &[]).await;
        if is(&r, "/outcome-unknown") {
            held_unknown += 1;
            continue;
        }
        assert_eq!(r.status, 201, "{key}: {:?}", r.body);
        assert!(r.replayed() && r.body == *body, "{key}");
    }
    let landed = gate.metric("idemgate_record_writes_landed_total");
    eprintln!(
        "cut every 150 ms for 2 s: {} keys answered 201, {landed} records written late, {held_unknown} held unknown, {} cuts",
        answered.len(),
        proxy.cuts()
    );
    assert_eq!(held_unknown, 0);
    assert!(proxy.cuts() > 0 && !answered.is_empty());
    assert_eq!(up.hits(), answered.len(), "each executed once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_written_while_sqlite_is_locked_lands_once_the_lock_goes() {
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url())
        .on_disk(dir.path())
        .set(|c| c.store_timeout = Duration::from_millis(300))
        .binary();
    let c = client();
    let url = gate.url("/v1/transfers");
    let first = post_in_background(&c, url.clone(), "k-locked", TRANSFER, &[(DELAY_MS, "300")]);
    upstream_reached(&up, 1).await;
    // Another process's write lock on the file, held while the answer is written.
    let file = dir.path().join(idemgate::store::sqlite::FILE_NAME);
    let lock = rusqlite::Connection::open(file).unwrap();
    lock.busy_timeout(Duration::from_secs(5)).unwrap();
    lock.execute_batch("BEGIN EXCLUSIVE").unwrap();
    let first = first.await.unwrap();
    assert_eq!(first.status, 201, "{:?}", first.body);
    eventually(Duration::from_secs(5), "the write pending", || {
        gate.metric("idemgate_record_writes_pending") == 1.0
    })
    .await;
    lock.execute_batch("COMMIT").unwrap();
    eventually(Duration::from_secs(5), "the write landed", || {
        gate.metric("idemgate_record_writes_landed_total") == 1.0
    })
    .await;
    let retry = post_url(&c, &url, Some("k-locked"), TRANSFER, &[]).await;
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    assert!(retry.replayed());
    assert_eq!(up.hits(), 1, "executed once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_with_no_room_to_wait_is_written_as_its_status_alone() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::for_redis(&redis).await;
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url())
        .redis_url(&proxy.redis_url())
        .set(|c| c.max_buffered_bytes = 64 * 1024)
        .binary();
    let c = client();
    let url = gate.url("/v1/transfers");
    // The whole answer's write carries its headers; the status alone does not.
    proxy.cut_requests_containing(Some(b"x-execution"));
    let big = [(ANSWER_BYTES, "200000")];
    let first = post_url(&c, &url, Some("k-big"), TRANSFER, &big).await;
    assert_eq!((first.status, first.body.len()), (201, 200_000));
    eventually(Duration::from_secs(5), "the status alone landed", || {
        gate.metric("idemgate_record_writes_landed_total") == 1.0
    })
    .await;
    let retry = post_url(&c, &url, Some("k-big"), TRANSFER, &big).await;
    assert_eq!(retry.status, 409, "{:?}", retry.body);
    assert!(retry.problem_type().ends_with("/response-not-stored"));
    assert_eq!(up.hits(), 1, "executed once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_names_each_record_it_could_not_write() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::for_redis(&redis).await;
    let up = Upstream::start().await;
    let mut gate = Idemgate::new(&up.url())
        .redis_url(&proxy.redis_url())
        .set(|c| c.shutdown_grace = Duration::from_millis(500))
        .binary();
    let c = client();
    proxy.cut_requests_containing(Some(answer_of(1).as_bytes()));
    let first = post_url(
        &c,
        &gate.url("/v1/transfers"),
        Some("k-left"),
        TRANSFER,
        &[],
    )
    .await;
    assert_eq!(first.status, 201);
    let request_id = first.header("x-request-id").unwrap().to_string();
    eventually(Duration::from_secs(5), "the write pending", || {
        gate.metric("idemgate_record_writes_pending") == 1.0
    })
    .await;
    assert!(gate.terminate(Duration::from_secs(10)).success());
    let log = gate.log();
    let left: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("complete it from the upstream's ledger"))
        .collect();
    assert_eq!(left.len(), 1, "{log}");
    assert!(left[0].contains("executed and answered 201"), "{}", left[0]);
    assert!(left[0].contains(&request_id), "{}", left[0]);
    assert!(left[0].contains("ERROR"), "{}", left[0]);
    assert_eq!(up.hits(), 1);
}

/// A retry of `k-late` past the 503s of store calls cut beside the refused writes (they
/// share its connection): never `outcome-unknown`.
async fn past_blips(c: &reqwest::Client, url: &str) -> Answer {
    let r = common::retry_until(
        Duration::from_secs(5),
        async || post_url(c, url, Some("k-late"), TRANSFER, &[]).await,
        |r| r.status != 503,
    )
    .await;
    assert!(!is(&r, "/outcome-unknown"), "{:?}", r.body);
    r
}

/// The record id of `k-late` as a retry's 409 names it.
async fn record_of(c: &reqwest::Client, url: &str) -> String {
    let r = past_blips(c, url).await;
    assert!(is(&r, "/in-progress"), "{:?}", r.body);
    r.json()["record_id"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observe_then_enforce_after_a_blip_at_the_supersede_replays_no_stale_failure() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::for_redis(&redis).await;
    let up = Upstream::start().await;
    let observing = Idemgate::new(&up.url())
        .redis_url(&proxy.redis_url())
        .set(|c| {
            c.store_timeout = Duration::from_millis(500);
            c.defaults.mode = Mode::Observe;
        })
        .binary();
    let c = client();
    let url = observing.url("/v1/transfers");
    // The first execution fails, and its failure is recorded.
    let failed = post_url(&c, &url, Some("k-sup"), TRANSFER, &[(STATUS, "500")]).await;
    assert_eq!(failed.status, 500);
    // The second succeeds while the store refuses its answer's write.
    proxy.cut_requests_containing(Some(answer_of(2).as_bytes()));
    let succeeded = post_url(&c, &url, Some("k-sup"), TRANSFER, &[]).await;
    assert_eq!(succeeded.status, 201);
    let pending = || observations(&observing)["routes"][0]["supersedes_pending"].clone();
    eventually(Duration::from_secs(5), "the supersede pending", || {
        pending() == 1
    })
    .await;
    proxy.cut_requests_containing(None);
    eventually(Duration::from_secs(5), "the supersede landed", || {
        pending() == 0
    })
    .await;
    assert_eq!(observing.metric("idemgate_record_writes_landed_total"), 1.0);
    // Switched to enforce (an instance that enforces, on the same store): the retry
    // replays the later answer, not the failure.
    let enforcing = Idemgate::new(&up.url()).redis(&redis).binary();
    let retry = post_url(
        &c,
        &enforcing.url("/v1/transfers"),
        Some("k-sup"),
        TRANSFER,
        &[],
    )
    .await;
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    assert!(retry.replayed());
    assert_eq!(retry.header("x-execution"), Some("2"));
    assert_eq!(up.hits(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observe_then_enforce_after_a_store_outage_at_the_claim_replays_no_stale_failure() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::for_redis(&redis).await;
    let up = Upstream::start().await;
    let observing = Idemgate::new(&up.url())
        .redis_url(&proxy.redis_url())
        .set(|c| {
            c.store_timeout = Duration::from_millis(300);
            c.defaults.mode = Mode::Observe;
        })
        .binary();
    let c = client();
    let url = observing.url("/v1/transfers");
    let failed = post_url(&c, &url, Some("k-out"), TRANSFER, &[(STATUS, "500")]).await;
    assert_eq!(failed.status, 500);
    eventually(Duration::from_secs(5), "the failure recorded", || {
        observing.metric("idemgate_answers_recorded_total{status_class=\"5xx\"}") == 1.0
    })
    .await;
    // The store is gone: the later attempt's claim fails (or the breaker skips it), and
    // it is forwarded; its 201 is kept to replace the failure once the store is back.
    proxy.refuse(true);
    proxy.cut_all();
    let succeeded = post_url(&c, &url, Some("k-out"), TRANSFER, &[]).await;
    assert_eq!(succeeded.status, 201);
    let pending = || observations(&observing)["routes"][0]["supersedes_pending"].clone();
    eventually(Duration::from_secs(5), "the supersede pending", || {
        pending() == 1
    })
    .await;
    proxy.refuse(false);
    eventually(Duration::from_secs(10), "the supersede landed", || {
        pending() == 0
    })
    .await;
    assert_eq!(observing.metric("idemgate_record_writes_landed_total"), 1.0);
    let enforcing = Idemgate::new(&up.url()).redis(&redis).binary();
    let retry = post_url(
        &c,
        &enforcing.url("/v1/transfers"),
        Some("k-out"),
        TRANSFER,
        &[],
    )
    .await;
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    assert!(retry.replayed());
    assert_eq!(retry.header("x-execution"), Some("2"));
    assert_eq!(up.hits(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pending_write_whose_claim_is_gone_says_so() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::for_redis(&redis).await;
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url())
        .redis_url(&proxy.redis_url())
        .binary();
    let c = client();
    let url = gate.url("/v1/transfers");
    proxy.cut_requests_containing(Some(answer_of(1).as_bytes()));
    let first = post_url(&c, &url, Some("k-gone"), TRANSFER, &[]).await;
    assert_eq!(first.status, 201);
    eventually(Duration::from_secs(5), "the write pending", || {
        gate.metric("idemgate_record_writes_pending") == 1.0
    })
    .await;
    let during = common::retry_until(
        Duration::from_secs(5),
        async || post_url(&c, &url, Some("k-gone"), TRANSFER, &[]).await,
        |r| r.status != 503,
    )
    .await;
    let id = during.json()["record_id"].as_str().unwrap().to_string();
    // The store loses the claim (here an operator's forced release stands in for a
    // failover to a copy that lacked it).
    let released = common::retry_until(
        Duration::from_secs(5),
        async || admin_delete(&c, gate.admin(), &id, true).await,
        |s| *s == 200,
    )
    .await;
    assert_eq!(released, 200);
    proxy.cut_requests_containing(None);
    eventually(Duration::from_secs(5), "the write ended", || {
        gate.metric("idemgate_record_writes_pending") == 0.0
    })
    .await;
    assert_eq!(gate.metric("idemgate_record_writes_landed_total"), 0.0);
    let log = gate.log();
    let gone = format!("the claim of record {id} is gone from the store");
    let lines: Vec<&str> = log.lines().filter(|l| l.contains(&gone)).collect();
    assert_eq!(lines.len(), 1, "{log}");
    assert!(lines[0].contains("ERROR"), "{}", lines[0]);
    assert!(lines[0].contains("its retries will execute again"));
}

/// `GET /observe` of an instance.
fn observations(gate: &Gate) -> serde_json::Value {
    let raw = http_get(gate.admin(), "/observe").unwrap();
    let body = raw.split("\r\n\r\n").nth(1).unwrap_or("");
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {raw}"))
}
