//! In `record_mode = "before_response"` (the default) a client has the last byte of its
//! answer only once its record is written, whatever the size: a retry sent the moment the
//! first answer ends is a replay. Large answers are written in pieces (Redis) or in
//! statements that take longer with their size (SQLite, PostgreSQL); one `store_timeout`
//! for the whole once cut an 80 MiB record off half way.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::postgres::PgServer;
use common::*;
use idemgate::Config;

const MIB: usize = 1024 * 1024;

/// Two clients at once, an 8 MiB and an 80 MiB answer: each retries the moment its whole
/// answer is in, and must get the replay, byte for byte.
async fn answers_replay_as_soon_as_they_end(cfg: Config, up: &Upstream) {
    let mut cfg = cfg;
    cfg.defaults.max_response_bytes = 96 * MIB as u64;

    let app = spawn_app(cfg).await;
    let url = format!("http://{}/v1/exports", app.addr());
    let mut clients = Vec::new();
    for (n, size) in [(8usize, 8 * MIB), (80, 80 * MIB)] {
        let url = url.clone();
        clients.push(tokio::spawn(async move {
            let c = client();
            let key = format!("large-{n}");
            let size_header = size.to_string();
            let first = post_url(&c, &url, Some(&key), "{}", &[(ANSWER_BYTES, &size_header)]).await;
            assert_eq!(first.status, 201, "{n} MiB");
            assert_eq!(first.body.len(), size, "{n} MiB: the whole answer");
            // The replay reads 80 MiB back; on a loaded 2-core machine that can take longer
            // than store_timeout, and while the other client's answer holds the buffer budget
            // a replay is refused room: both are a 503 with Retry-After, which a client
            // honours. What is under test is that the record is there once the answer ended
            // (a 409 would say it was not), not how fast it reads back.
            let mut retry =
                post_url(&c, &url, Some(&key), "{}", &[(ANSWER_BYTES, &size_header)]).await;
            let deadline = std::time::Instant::now() + Duration::from_secs(90);
            while retry.status == 503 && std::time::Instant::now() < deadline {
                let wait = retry
                    .header("retry-after")
                    .and_then(|s| s.parse::<u64>().ok())
                    .unwrap_or(1)
                    .clamp(1, 5);
                tokio::time::sleep(Duration::from_secs(wait)).await;
                retry = post_url(&c, &url, Some(&key), "{}", &[(ANSWER_BYTES, &size_header)]).await;
            }
            assert!(
                retry.replayed(),
                "{n} MiB: the retry right after the answer ended: {} {:?}",
                retry.status,
                String::from_utf8_lossy(&retry.body[..retry.body.len().min(300)])
            );
            assert!(retry.body == first.body, "{n} MiB: replayed byte for byte");
        }));
    }
    for c in clients {
        c.await.unwrap();
    }
    assert_eq!(up.hits(), 2, "each executed once");
    app.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_answers_on_redis_are_recorded_before_their_last_byte() {
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    answers_replay_as_soon_as_they_end(redis_config(&up, &redis), &up).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_answers_on_sqlite_are_recorded_before_their_last_byte() {
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    let mut cfg = config(&up, &Backend::memory());
    cfg.store_path = Some(dir.path().to_path_buf());
    // Reading 80 MiB back from SQLite can outlast the default store_timeout on a loaded
    // machine, every time: the replay would then never come. Whether the record is there
    // is under test, not how fast it reads.
    cfg.store_timeout = Duration::from_secs(30);
    answers_replay_as_soon_as_they_end(cfg, &up).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_answers_on_postgres_are_recorded_before_their_last_byte() {
    let pg = tokio::task::spawn_blocking(PgServer::shared).await.unwrap();
    let url = pg.fresh_db().await;
    let up = Upstream::start().await;
    let mut cfg = config(&up, &Backend::memory());
    cfg.postgres_url = Some(url.as_str().into());
    cfg.namespace = Some(NAMESPACE.into());
    // A statement of 80 MiB takes a while on a loaded machine; the record's deadline grows
    // with the answer, up to upstream_timeout.
    cfg.defaults.upstream_timeout = Duration::from_secs(60);
    answers_replay_as_soon_as_they_end(cfg, &up).await;
}
