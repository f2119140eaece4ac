//! Upstreams that close connections whenever they like: on their own idle timer, as
//! gunicorn (2 s), Node and uvicorn (5 s) do; every idle connection at once at random
//! moments, as a graceful restart or reload does (worker recycling, `max_requests`, Node's
//! `server.close()`, nginx reloading, a rolling deploy); or after every answer, announced
//! or not. A request written onto a connection at the moment the upstream closes it was
//! never read, yet it fails like one that was: if idemgate wrote protected requests onto
//! idle connections it would hold keys as `unknown` that never ran. Paced runs around the
//! closing moments must leave no such record, and no protected request may wait out
//! `upstream_timeout` on a connection the upstream closed.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// How the upstream closes connections.
#[derive(Clone, Copy)]
struct Closing {
    /// How long it waits for the next request on a connection; `None`: it closes after
    /// every answer.
    keep_alive: Option<Duration>,
    /// Whether an answer after which it closes says so (`Connection: close`), as RFC 9112
    /// section 9.3 requires of a server that does not keep connections.
    says_close: bool,
    /// Whether it also closes every idle connection at once at random moments 1 to 12 ms
    /// apart, as a graceful restart does. Idle means what servers mean by it: answered,
    /// and waiting for the next request.
    restarts: bool,
}

/// Once an upstream has decided to close a connection, it takes this long to get round to
/// it (a worker finishing what it was doing), and reads nothing meanwhile: a request that
/// arrives then is never read, and the close resets it.
const CLOSING_TAKES: Duration = Duration::from_millis(20);

/// An HTTP/1.1 upstream that closes connections as `Closing` says. It counts the requests it
/// read, by `Idempotency-Key`.
#[derive(Clone)]
struct ClosingUpstream {
    addr: SocketAddr,
    executions: Arc<Mutex<HashMap<String, usize>>>,
}

impl ClosingUpstream {
    async fn start(closing: Closing) -> ClosingUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let up = ClosingUpstream {
            addr: listener.local_addr().unwrap(),
            executions: Arc::default(),
        };
        let executions = up.executions.clone();
        let (restart, restarts) = watch::channel(0u64);
        if closing.restarts {
            tokio::spawn(async move {
                let mut rng = StdRng::seed_from_u64(23);
                for generation in 1.. {
                    tokio::time::sleep(MS(rng.random_range(1..=12))).await;
                    if restart.send(generation).is_err() {
                        return;
                    }
                }
            });
        }
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                tokio::spawn(serve(stream, closing, executions.clone(), restarts.clone()));
            }
        });
        up
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn executions(&self, key: &str) -> usize {
        self.executions
            .lock()
            .unwrap()
            .get(key)
            .copied()
            .unwrap_or(0)
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

async fn serve(
    mut s: TcpStream,
    closing: Closing,
    executions: Arc<Mutex<HashMap<String, usize>>>,
    mut restarts: watch::Receiver<u64>,
) {
    let keep_alive = closing.keep_alive;
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = [0u8; 8192];
    let mut answered = false;
    loop {
        // The idle timer runs from the end of the last answer until the next request's
        // first byte; when it fires the connection is closed, whatever is on its way.
        let head_end = loop {
            if let Some(p) = find(&buf, b"\r\n\r\n") {
                break p + 4;
            }
            let n = if buf.is_empty() {
                let wait = keep_alive.unwrap_or(Duration::from_secs(3600));
                // Only a restart from now on closes an idle connection.
                let idle = closing.restarts && answered;
                restarts.borrow_and_update();
                tokio::select! {
                    read = tokio::time::timeout(wait, s.read(&mut chunk)) => match read {
                        Ok(Ok(n)) => n,
                        Ok(Err(_)) => return,
                        Err(_) => {
                            tokio::time::sleep(CLOSING_TAKES).await;
                            return;
                        }
                    },
                    // Closed unread: whatever was written meanwhile was never read.
                    _ = restarts.changed(), if idle => return,
                }
            } else {
                match tokio::time::timeout(Duration::from_secs(5), s.read(&mut chunk)).await {
                    Ok(Ok(n)) => n,
                    _ => return,
                }
            };
            if n == 0 {
                return;
            }
            buf.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
        let header = |name: &str| {
            head.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .map(|v| v.trim().to_string())
        };
        let len: usize = header("content-length")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let key = header("idempotency-key").unwrap_or_default();
        while buf.len() < head_end + len {
            match tokio::time::timeout(Duration::from_secs(5), s.read(&mut chunk)).await {
                Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&chunk[..n]),
                _ => return,
            }
        }
        buf.drain(..head_end + len);
        let n = {
            let mut e = executions.lock().unwrap();
            let n = e.entry(key).or_default();
            *n += 1;
            *n
        };
        let body = format!("{{\"execution\":{n}}}");
        let close = if keep_alive.is_none() && closing.says_close {
            "connection: close\r\n"
        } else {
            ""
        };
        let answer = format!(
            "HTTP/1.1 201 Created\r\ncontent-type: application/json\r\n{close}content-length: {}\r\n\r\n{body}",
            body.len()
        );
        if s.write_all(answer.as_bytes()).await.is_err() {
            return;
        }
        answered = true;
        if keep_alive.is_none() {
            tokio::time::sleep(CLOSING_TAKES).await;
            return;
        }
    }
}

/// Sends `requests` keys one after another through idemgate, each pause drawn around the
/// moments that matter (`around`, ± `spread`, and a few short ones), then checks every key:
/// no key may be held as `unknown` (504 first, 409 `outcome-unknown` on a retry) without
/// having been executed; none executed twice. Returns the statuses seen.
async fn paced_run(
    closing: Closing,
    idle_timeout: Option<Duration>,
    requests: usize,
    around: &[Duration],
    spread: Duration,
    seed: u64,
) -> HashMap<u16, usize> {
    let up = ClosingUpstream::start(closing).await;
    let mut cfg = idemgate::Config::for_upstream(&up.url());
    cfg.defaults.anonymous = idemgate::config::Anonymous::Shared;
    if let Some(t) = idle_timeout {
        cfg.upstream_idle_timeout = t;
    }
    let app = spawn_app(cfg).await;
    let c = client();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut statuses: HashMap<u16, usize> = HashMap::new();
    let mut keys = Vec::new();
    for i in 0..requests {
        let key = format!("ka-{i}");
        let r = post(&c, &app, "/v1/payments", Some(&key), "{\"amount\":1}", &[]).await;
        *statuses.entry(r.status).or_default() += 1;
        keys.push((key, r.status));
        let base = around[rng.random_range(0..around.len())];
        let jitter = rng.random_range(0..=spread.as_micros() as u64 * 2);
        let pause = (base + Duration::from_micros(jitter)).saturating_sub(spread);
        tokio::time::sleep(pause).await;
    }
    let mut stranded = Vec::new();
    for (key, status) in &keys {
        let executions = up.executions(key);
        assert!(executions <= 1, "{key} executed {executions} times");
        let retry = post(&c, &app, "/v1/payments", Some(key), "{\"amount\":1}", &[]).await;
        let unknown = retry.problem_type().ends_with("/outcome-unknown");
        if unknown && executions == 0 {
            stranded.push(format!("{key} (first answer {status})"));
        }
        if executions == 1 {
            assert!(retry.replayed(), "{key}: {:?}", retry.body);
        }
    }
    assert!(
        stranded.is_empty(),
        "{} of {requests} keys held as unknown, never executed: {stranded:?}; statuses {statuses:?}",
        stranded.len()
    );
    app.shutdown().await;
    statuses
}

const MS: fn(u64) -> Duration = Duration::from_millis;

fn keep_alive(d: Duration) -> Closing {
    Closing {
        keep_alive: Some(d),
        says_close: false,
        restarts: false,
    }
}

// An upstream keep-alive far below `upstream_idle_timeout`: protected requests never take
// an idle connection, so the defaults hold for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_of_100ms_with_the_defaults_strands_nothing() {
    let around = [MS(110), MS(40), MS(5)];
    let statuses = paced_run(keep_alive(MS(100)), None, 120, &around, MS(15), 13).await;
    println!("keep-alive 100 ms, defaults: statuses {statuses:?}");
    assert_eq!(statuses.get(&201), Some(&120), "{statuses:?}");
}

// gunicorn's default, with idemgate's default configuration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_of_2s_with_the_defaults_strands_nothing() {
    let around = [MS(2010), MS(2010), MS(500)];
    let statuses = paced_run(keep_alive(MS(2000)), None, 12, &around, MS(15), 2).await;
    println!("keep-alive 2 s, defaults: statuses {statuses:?}");
    assert_eq!(statuses.get(&201), Some(&12), "{statuses:?}");
}

// Node's and uvicorn's default, with idemgate's default configuration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_of_5s_with_the_defaults_strands_nothing() {
    let around = [MS(5010), MS(5010), MS(700)];
    let statuses = paced_run(keep_alive(MS(5000)), None, 6, &around, MS(15), 5).await;
    println!("keep-alive 5 s, defaults: statuses {statuses:?}");
    assert_eq!(statuses.get(&201), Some(&6), "{statuses:?}");
}

// An upstream that closes every connection after its answer and says so, as RFC 9112
// requires: hyper never reuses such a connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_closes_after_every_answer_strands_nothing() {
    let closing = Closing {
        keep_alive: None,
        says_close: true,
        restarts: false,
    };
    let around = [MS(0), MS(5), MS(15)];
    let statuses = paced_run(closing, None, 120, &around, MS(5), 7).await;
    println!("closes after every answer, says so, defaults: statuses {statuses:?}");
    assert_eq!(statuses.get(&201), Some(&120), "{statuses:?}");
}

// One that closes after every answer without saying so cannot be told from one that keeps
// connections; protected requests never reuse one, so the defaults hold for it too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_closes_silently_strands_nothing_with_the_defaults() {
    let closing = Closing {
        keep_alive: None,
        says_close: false,
        restarts: false,
    };
    let around = [MS(0), MS(5), MS(15)];
    let statuses = paced_run(closing, None, 120, &around, MS(5), 8).await;
    println!("closes after every answer silently, defaults: statuses {statuses:?}");
    assert_eq!(statuses.get(&201), Some(&120), "{statuses:?}");
}

/// `clients` clients at once each send `per_client` new keys through idemgate (default
/// configuration but a 3 s `upstream_timeout`, so that a request stuck on a closed
/// connection shows), 1 ms apart: every one must be answered 201 and executed once, and
/// the fresh connections must leave no TIME_WAIT behind on either side (were one side to
/// enter it, 10,000 new keys a second would hold 600,000 ports towards one upstream
/// address within a minute).
async fn concurrent_run(closing: Closing, clients: usize, per_client: usize) {
    let up = ClosingUpstream::start(closing).await;
    let time_wait = TimeWait::from_now(up.addr.port());
    let mut cfg = idemgate::Config::for_upstream(&up.url());
    cfg.defaults.anonymous = idemgate::config::Anonymous::Shared;
    cfg.defaults.upstream_timeout = Duration::from_secs(3);
    let app = spawn_app(cfg).await;
    let mut tasks = Vec::new();
    for c in 0..clients {
        let url = format!("http://{}/v1/payments", app.addr());
        tasks.push(tokio::spawn(async move {
            // Keep-alive towards idemgate: only the upstream side is under test.
            let client = reqwest::Client::new();
            let mut failed = Vec::new();
            for i in 0..per_client {
                let res = client
                    .post(&url)
                    .header("idempotency-key", format!("run-{c}-{i}"))
                    .header("content-type", "application/json")
                    .body(format!("{{\"amount\":{i}}}"))
                    .send()
                    .await
                    .unwrap();
                let status = res.status().as_u16();
                if status != 201 {
                    failed.push((status, res.text().await.unwrap_or_default()));
                }
                tokio::time::sleep(MS(1)).await;
            }
            failed
        }));
    }
    let mut failed = Vec::new();
    for t in tasks {
        failed.extend(t.await.unwrap());
    }
    let requests = clients * per_client;
    let executions = up.executions.lock().unwrap().clone();
    let waiting = time_wait.new_since();
    println!(
        "{requests} new keys: {} executed, {} not answered 201, {} sockets in TIME_WAIT",
        executions.len(),
        failed.len(),
        waiting.len()
    );
    assert!(
        failed.is_empty(),
        "{} of {requests} new keys not answered 201: {:?}",
        failed.len(),
        &failed[..failed.len().min(3)]
    );
    let twice: Vec<_> = executions.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "executed more than once: {twice:?}");
    assert_eq!(executions.len(), requests, "every key executed");
    assert!(
        waiting.len() < requests / 100,
        "{} sockets in TIME_WAIT towards the upstream after {requests} new keys: {waiting:?}",
        waiting.len()
    );
    app.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_restarting_at_random_moments_strands_nothing() {
    let closing = Closing {
        keep_alive: Some(Duration::from_secs(5)),
        says_close: false,
        restarts: true,
    };
    concurrent_run(closing, 4, 600).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_clients_on_an_upstream_that_closes_silently_strand_nothing() {
    let closing = Closing {
        keep_alive: None,
        says_close: false,
        restarts: false,
    };
    concurrent_run(closing, 8, 300).await;
}
