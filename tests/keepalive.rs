//! Upstreams that close idle connections on their own timer, as gunicorn (2 s), Node and
//! uvicorn (5 s) do, or after every answer. A request written onto a connection at the
//! moment the upstream closes it was never read, yet it fails like one that was: if
//! idemgate reused such connections it would hold keys as `unknown` that never ran. A
//! paced run around the closing moments must leave no such record.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// How the upstream closes connections.
#[derive(Clone, Copy)]
struct Closing {
    /// How long it waits for the next request on a connection; `None`: it closes after
    /// every answer.
    keep_alive: Option<Duration>,
    /// Whether an answer after which it closes says so (`Connection: close`), as RFC 9112
    /// section 9.3 requires of a server that does not keep connections.
    says_close: bool,
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
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                tokio::spawn(serve(stream, closing, executions.clone()));
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

async fn serve(mut s: TcpStream, closing: Closing, executions: Arc<Mutex<HashMap<String, usize>>>) {
    let keep_alive = closing.keep_alive;
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        // The idle timer runs from the end of the last answer until the next request's
        // first byte; when it fires the connection is closed, whatever is on its way.
        let head_end = loop {
            if let Some(p) = find(&buf, b"\r\n\r\n") {
                break p + 4;
            }
            let n = if buf.is_empty() {
                let wait = keep_alive.unwrap_or(Duration::from_secs(3600));
                match tokio::time::timeout(wait, s.read(&mut chunk)).await {
                    Ok(Ok(n)) => n,
                    Ok(Err(_)) => return,
                    Err(_) => {
                        tokio::time::sleep(CLOSING_TAKES).await;
                        return;
                    }
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
    }
}

// An upstream keep-alive below a second: `upstream_idle_timeout` is the setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_of_100ms_with_the_setting_strands_nothing() {
    let around = [MS(110), MS(40), MS(5)];
    let statuses = paced_run(keep_alive(MS(100)), Some(MS(40)), 120, &around, MS(15), 13).await;
    println!("keep-alive 100 ms, upstream_idle_timeout 40 ms: statuses {statuses:?}");
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
    };
    let around = [MS(0), MS(5), MS(15)];
    let statuses = paced_run(closing, None, 120, &around, MS(5), 7).await;
    println!("closes after every answer, says so, defaults: statuses {statuses:?}");
    assert_eq!(statuses.get(&201), Some(&120), "{statuses:?}");
}

// One that closes after every answer without saying so cannot be told from one that keeps
// connections: `upstream_idle_timeout = "0s"` gives every request a new connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_closes_silently_needs_an_idle_timeout_of_zero() {
    let closing = Closing {
        keep_alive: None,
        says_close: false,
    };
    let around = [MS(0), MS(5), MS(15)];
    let statuses = paced_run(closing, Some(Duration::ZERO), 120, &around, MS(5), 8).await;
    println!("closes after every answer silently, upstream_idle_timeout 0: statuses {statuses:?}");
    assert_eq!(statuses.get(&201), Some(&120), "{statuses:?}");
}
