//! `in_progress_wait` through the binary, on the embedded stores: a duplicate whose claim
//! finds the first still running waits for it and is answered as if it had come after it
//! (the replay; a released claim that it then runs itself), woken in process when the
//! record lands; another body under the key gets 422 at once; a wait that runs out, a full
//! `max_waiting` and a shutdown answer 409 `in-progress`; a client that hangs up ends its
//! wait; an observed route never waits.
//! Apart from the one that runs out, every wait and lease here is far longer than the
//! test: what ends a wait is the record, not a timer.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use crate::common;

use common::builder::{Idemgate, Probes};
use common::*;

const BODY: &str = "{\"amount\":1}";

/// The first's lease, whose end also wakes a waiting duplicate: far beyond the test, so
/// that only the record can have woken it.
const LEASE: Duration = Duration::from_secs(120);

/// An instance whose duplicates wait up to `wait`, with `change` made to its settings.
fn waiting(up: &Upstream, wait: Duration, change: impl FnOnce(&mut idemgate::Config)) -> Gate {
    Idemgate::new(&up.url())
        .set(|c| {
            c.defaults.in_progress_wait = wait;
            c.defaults.lease = LEASE;
            change(c);
        })
        .binary()
}

/// A waiting duplicate's answer, within the guard (far shorter than the lease).
async fn woken(duplicate: tokio::task::JoinHandle<Answer>) -> Answer {
    let answer = tokio::time::timeout(HANG_GUARD, duplicate).await;
    answer.expect("woken by the record").unwrap()
}

/// Waits until `g` shows `n` duplicates waiting.
async fn waiting_now(g: &Gate, n: f64) {
    eventually(HANG_GUARD, "duplicates waiting", || {
        g.metric_or_zero("idemgate_in_progress_waiting") == n
    })
    .await;
}

/// Sends the first request of `key`, held at the upstream, and waits until it is there.
async fn first_held(
    c: &reqwest::Client,
    g: &Gate,
    up: &Upstream,
    key: &str,
    extra: &[(&str, &str)],
) -> tokio::task::JoinHandle<Answer> {
    let before = up.hits();
    let mut headers = vec![(FAULT, "hold")];
    headers.extend_from_slice(extra);
    let first = post_in_background(c, g.url("/pay"), key, BODY, &headers);
    eventually(HANG_GUARD, "the first at the upstream", || {
        up.hits() > before
    })
    .await;
    first
}

fn ended(g: &Gate, outcome: &str) -> f64 {
    g.metric_or_zero(&format!(
        "idemgate_in_progress_waits_total{{outcome=\"{outcome}\"}}"
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_waits_for_the_first_and_gets_its_replay() {
    let up = Upstream::start().await;
    let g = waiting(&up, Duration::from_secs(600), |_| {});
    let c = client();
    let first = first_held(&c, &g, &up, "w-1", &[]).await;
    let duplicate = post_in_background(&c, g.url("/pay"), "w-1", BODY, &[]);
    waiting_now(&g, 1.0).await;
    up.release();
    let (first, duplicate) = (first.await.unwrap(), woken(duplicate).await);
    assert_eq!(first.status, 201);
    assert_eq!(duplicate.status, 201, "{:?}", duplicate.body);
    assert!(duplicate.replayed());
    assert_eq!(duplicate.body, first.body);
    assert_eq!(up.hits(), 1, "executed once");
    assert_eq!(ended(&g, "settled"), 1.0);
    waiting_now(&g, 0.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sqlite_a_waiting_duplicate_is_woken_by_the_record() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let g = Idemgate::new(&up.url())
        .on_disk(dir.path())
        .set(|c| {
            c.defaults.in_progress_wait = Duration::from_secs(600);
            c.defaults.lease = LEASE;
        })
        .binary();
    let c = client();
    let first = first_held(&c, &g, &up, "w-sqlite", &[]).await;
    let duplicate = post_in_background(&c, g.url("/pay"), "w-sqlite", BODY, &[]);
    waiting_now(&g, 1.0).await;
    up.release();
    let (first, duplicate) = (first.await.unwrap(), woken(duplicate).await);
    assert!(duplicate.replayed(), "{:?}", duplicate.body);
    assert_eq!(duplicate.body, first.body);
    assert_eq!(up.hits(), 1);
}

/// A first whose answer releases its claim (`release_on_status`): the waiting duplicate
/// then claims the key and runs itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_runs_itself_once_the_first_released_the_key() {
    let up = Upstream::start().await;
    let g = waiting(&up, Duration::from_secs(600), |c| {
        c.defaults.release_on_status = vec![503];
    });
    let c = client();
    let first = first_held(&c, &g, &up, "w-released", &[(STATUS, "503")]).await;
    let duplicate = post_in_background(&c, g.url("/pay"), "w-released", BODY, &[]);
    waiting_now(&g, 1.0).await;
    up.release();
    assert_eq!(first.await.unwrap().status, 503);
    let duplicate = woken(duplicate).await;
    assert_eq!(duplicate.status, 201, "{:?}", duplicate.body);
    assert!(!duplicate.replayed());
    assert_eq!(
        up.hits(),
        2,
        "the first released its claim: the duplicate ran"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_body_under_the_key_gets_422_at_once() {
    let up = Upstream::start().await;
    let g = waiting(&up, Duration::from_secs(600), |_| {});
    let c = client();
    let first = first_held(&c, &g, &up, "w-mismatch", &[]).await;
    // Answered while the first is still held: it never waited.
    let other = post_url(
        &c,
        &g.url("/pay"),
        Some("w-mismatch"),
        "{\"amount\":2}",
        &[],
    )
    .await;
    assert_eq!(other.status, 422);
    assert_eq!(g.metric_or_zero("idemgate_in_progress_waiting"), 0.0);
    up.release();
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(up.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_that_runs_out_answers_409_in_progress() {
    let up = Upstream::start().await;
    let g = waiting(&up, Duration::from_millis(200), |_| {});
    let c = client();
    let first = first_held(&c, &g, &up, "w-out", &[]).await;
    // Answered while the first is still held: the wait ran out.
    let duplicate = post_url(&c, &g.url("/pay"), Some("w-out"), BODY, &[]).await;
    assert_eq!(duplicate.status, 409);
    assert_eq!(duplicate.header("idemgate-error"), Some("in-progress"));
    assert_eq!(ended(&g, "timed_out"), 1.0);
    up.release();
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(up.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beyond_max_waiting_a_duplicate_gets_409_at_once() {
    let up = Upstream::start().await;
    let g = waiting(&up, Duration::from_secs(600), |c| c.max_waiting = 1);
    let c = client();
    let first = first_held(&c, &g, &up, "w-full", &[]).await;
    let waits = post_in_background(&c, g.url("/pay"), "w-full", BODY, &[]);
    waiting_now(&g, 1.0).await;
    // The one place is taken: the next is answered while the first is still held.
    let refused = post_url(&c, &g.url("/pay"), Some("w-full"), BODY, &[]).await;
    assert_eq!(refused.status, 409);
    assert_eq!(refused.header("idemgate-error"), Some("in-progress"));
    assert_eq!(ended(&g, "full"), 1.0);
    up.release();
    let (first, waited) = (first.await.unwrap(), woken(waits).await);
    assert!(waited.replayed());
    assert_eq!(waited.body, first.body);
    assert_eq!(up.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observed_route_never_waits() {
    let up = Upstream::start().await;
    let g = waiting(&up, Duration::from_secs(600), |c| {
        c.defaults.mode = idemgate::config::Mode::Observe;
    });
    let c = client();
    let first = first_held(&c, &g, &up, "w-observe", &[]).await;
    // Forwarded as if idemgate were not there, not held back by the first.
    let duplicate = post_in_background(&c, g.url("/pay"), "w-observe", BODY, &[]);
    eventually(HANG_GUARD, "the duplicate at the upstream", || {
        up.hits() == 2
    })
    .await;
    assert_eq!(g.metric_or_zero("idemgate_in_progress_waiting"), 0.0);
    up.release();
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(duplicate.await.unwrap().status, 201);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_answers_the_waiting_ones_409() {
    let up = Upstream::start().await;
    let mut g = waiting(&up, Duration::from_secs(600), |c| {
        c.shutdown_grace = Duration::from_secs(5);
    });
    let c = client();
    let first = first_held(&c, &g, &up, "w-shutdown", &[]).await;
    let duplicate = post_in_background(&c, g.url("/pay"), "w-shutdown", BODY, &[]);
    waiting_now(&g, 1.0).await;
    signal(g.pid(), "TERM");
    let duplicate = duplicate.await.unwrap();
    assert_eq!(duplicate.status, 409);
    assert_eq!(duplicate.header("idemgate-error"), Some("in-progress"));
    up.release();
    assert_eq!(first.await.unwrap().status, 201);
    g.terminate(Duration::from_secs(20));
    assert_eq!(up.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_ends_its_wait() {
    use std::io::Write;
    let up = Upstream::start().await;
    let g = waiting(&up, Duration::from_secs(600), |_| {});
    let c = client();
    let first = first_held(&c, &g, &up, "w-gone", &[]).await;
    let request = format!(
        "POST /pay HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nidempotency-key: w-gone\r\ncontent-length: {}\r\n\r\n{BODY}",
        BODY.len()
    );
    let mut duplicate = std::net::TcpStream::connect(g.proxy()).unwrap();
    duplicate.write_all(request.as_bytes()).unwrap();
    waiting_now(&g, 1.0).await;
    drop(duplicate);
    waiting_now(&g, 0.0).await;
    assert_eq!(ended(&g, "client_gone"), 1.0);
    up.release();
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(up.hits(), 1);
}
