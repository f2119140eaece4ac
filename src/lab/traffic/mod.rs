//! A day of transfer traffic: seeded intents, and clients that retry the way real ones do.
//!
//! The plan (`plan`) is a pure function of `(intents, seed)`. The clients then replay it as fast as
//! they can with a fixed number of workers; what is not deterministic is only the
//! interleaving, which is what a real day looks like too.
//!
//! Crates: `rand` (`StdRng` seeded, so one seed is one day); `hyper`/`hyper-util` for the
//! pooled HTTP/1.1 client that patient and impatient clients share; `http-body-util` and
//! `bytes` for request and response bodies; `tokio` for workers, deadlines and the raw TCP
//! socket of the client that hangs up; `serde`/`serde_json` for the request body and
//! to export the plan; `indicatif` for the progress bar; `tracing` for unexpected answers.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream::{FuturesUnordered, StreamExt};
use http_body_util::{BodyExt, Full};
use hyper::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use indicatif::ProgressBar;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

mod plan;
mod tally;
#[cfg(test)]
mod tests;

pub use self::plan::{Behaviour, DayPlan, Intent};
pub use self::tally::ClientTally;
use self::tally::{bump, Counters};

/// A failed attempt's client waits this much longer before each next one (a bank that is
/// restarting refuses connections for a moment).
const RETRY_BACKOFF: Duration = Duration::from_millis(25);
/// A slow reader reads this many bytes of its answer at a time ...
const SLOW_READ_CHUNK: usize = 16;
/// ... and pauses this long between reads.
const SLOW_READ_PAUSE: Duration = Duration::from_millis(5);
/// How the clients behave; shared by every worker of one run.
#[derive(Debug, Clone)]
pub struct LabClient {
    /// Where requests go: the bank itself, or idemgate in front of it.
    pub target: SocketAddr,
    /// More instances of idemgate beside `target`, on the same store: attempts go to each
    /// in turn, so that a retry lands on another instance than its first attempt.
    pub also: Vec<SocketAddr>,
    /// Prepended to every intent's key, so two lab runs against one Redis never share keys.
    pub key_prefix: String,
    /// The impatient clients' deadline; shorter than the bank's slow tail.
    pub timeout: Duration,
    /// Everyone else's deadline for one request.
    pub patient_timeout: Duration,
    /// Longest wait after idemgate's 409 in-progress, whatever its Retry-After says.
    pub in_progress_wait_cap: Duration,
    /// Attempts per request, retries included, before a client gives up on an intent.
    pub max_attempts: u32,
    /// Worker tasks, each sending one intent at a time.
    pub concurrency: usize,
    /// Over TLS, trusting this configuration's roots (`idemgate lab --tls`); else plain
    /// HTTP.
    pub tls: Option<Arc<rustls::ClientConfig>>,
}

/// How one attempt ended, from the client's point of view.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Answer {
    /// 2xx; `replayed` when idemgate answered from its record.
    Success {
        replayed: bool,
    },
    /// A 4xx/5xx the bank itself produced (idemgate may have replayed it).
    Bank(StatusCode),
    /// A response idemgate made itself, named by its `Idemgate-Error` header.
    Idemgate {
        status: StatusCode,
        problem: String,
        retry_after: Option<Duration>,
    },
    TimedOut,
    Transport,
}

/// The final answer to one request after its retries.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Final {
    Success {
        replayed: bool,
    },
    Refused(StatusCode),
    Mismatch,
    /// idemgate holds the outcome (`409 outcome-unknown`): only an operator can settle it.
    Held,
    GaveUp,
}

impl Final {
    /// Whether the client has its final answer: the bank's (first-hand or replayed) or
    /// idemgate's refusal of a changed body.
    fn answered(&self) -> bool {
        matches!(
            self,
            Final::Success { .. } | Final::Refused(_) | Final::Mismatch
        )
    }
}

/// A storm's copy that runs on after its client has the answer (see `Run::storm`).
type Leftover<'r> = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + 'r>>;

/// Copies of one request a client sends at once during a retry storm.
pub const STORM_COPIES: usize = 16;

/// The longest a storm's copy waits when idemgate answers `409 in-progress`: what its
/// `Retry-After` says, up to this. A storm's clients send all their copies at once and
/// retry every failure without backoff, but wait what idemgate tells them while the first
/// copy runs; polling faster than that (the good day's clients wait at most
/// `in_progress_wait_cap`) would make the storm's load as much as the machine can send,
/// not 16x.
pub const STORM_IN_PROGRESS_CAP: Duration = Duration::from_secs(2);

/// How a client behaves on top of its intent's [`Behaviour`], by the day's incidents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    /// As its behaviour says.
    Normal,
    /// Sends [`STORM_COPIES`] copies of its request at once and retries each failure
    /// without backoff (a `409 in-progress` still waits what idemgate says); goes on to
    /// its next intent once one copy has the answer, the others running on.
    Storm,
    /// Reads its answer a few bytes at a time, with pauses.
    SlowReader,
    /// Sends one patient request and retries it with backoff, whatever its behaviour:
    /// the storm's clients without the storm, so the stretch before it measures what the
    /// bank can do for them.
    Steady,
}

/// What the day's incidents do to the clients: told when the day reaches an intent, and
/// asked how that intent's client behaves.
pub trait DayHooks: Sync {
    /// The day reaches intent `seq` (its client is about to send).
    fn reached(&self, seq: usize) {
        let _ = seq;
    }
    /// How the client of intent `seq` behaves.
    fn style(&self, seq: usize) -> Style {
        let _ = seq;
        Style::Normal
    }
    /// How long the bank takes to answer intent `seq` (sent as [`LATENCY_HEADER`]), when
    /// the day decides it rather than the bank's own draws.
    fn latency(&self, seq: usize) -> Option<Duration> {
        let _ = seq;
        None
    }
}

/// The bank answers a request that carries this header (milliseconds) after that long
/// instead of its own draw: a bad day pairs the latencies of the storm's intents with
/// those just before it, so the two stretches' goodputs compare like with like.
pub const LATENCY_HEADER: &str = "lab-latency-ms";

tokio::task_local! {
    // The latency the current intent asks the bank for (see `DayHooks::latency`).
    static LATENCY: Option<Duration>;
}

/// The current intent's [`LATENCY_HEADER`] as a header line, or nothing.
fn latency_line() -> String {
    latency_header()
        .map(|ms| format!("{LATENCY_HEADER}: {ms}\r\n"))
        .unwrap_or_default()
}

/// The current intent's [`LATENCY_HEADER`] value.
fn latency_header() -> Option<String> {
    LATENCY
        .try_with(|l| *l)
        .ok()
        .flatten()
        .map(|l| l.as_millis().to_string())
}

/// A good day: no incidents.
pub struct NoIncidents;

impl DayHooks for NoIncidents {}

/// How one intent ended for its client, and when.
#[derive(Debug, Clone, Copy)]
pub struct IntentOutcome {
    /// When its client started and when it had its final answer (or gave up).
    pub started: std::time::Instant,
    pub ended: std::time::Instant,
    /// It has its final answer (the bank's, or a refused changed body).
    pub answered: bool,
    /// idemgate held its outcome `unknown` (`409 outcome-unknown`) when the client stopped.
    pub held: bool,
}

type HttpClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

struct Run<'a> {
    // Attempts so far: which instance the next one goes to.
    turn: std::sync::atomic::AtomicUsize,
    client: HttpClient,
    opts: &'a LabClient,
    counters: Counters,
}

/// Replays the day against `opts.target` and returns what the clients saw.
pub async fn replay(plan: &DayPlan, opts: &LabClient, progress: &ProgressBar) -> ClientTally {
    replay_day(plan, opts, progress, &NoIncidents).await.0
}

/// As [`replay`], with the day's incidents told as it reaches them; also returns how each
/// intent ended, in plan order.
pub async fn replay_day(
    plan: &DayPlan,
    opts: &LabClient,
    progress: &ProgressBar,
    hooks: &dyn DayHooks,
) -> (ClientTally, Vec<IntentOutcome>) {
    let run = Arc::new(Run::new(opts));
    let outcomes = std::sync::Mutex::new(vec![None; plan.intents.len()]);
    let next = AtomicUsize::new(0);
    // A storm's copies that are still running when their client has its answer and goes
    // on: driven here to their own end.
    let (leftovers, mut pending) = tokio::sync::mpsc::unbounded_channel::<Leftover<'_>>();
    let workers: Vec<_> = (0..opts.concurrency.max(1))
        .map(|_| {
            let leftovers = leftovers.clone();
            let (run, outcomes, next) = (&run, &outcomes, &next);
            async move {
                loop {
                    let index = next.fetch_add(1, Ordering::Relaxed);
                    let Some(intent) = plan.intents.get(index) else {
                        break;
                    };
                    hooks.reached(index);
                    let started = std::time::Instant::now();
                    let (last, answered_at) = LATENCY
                        .scope(
                            hooks.latency(index),
                            run.send_intent(intent, hooks.style(index), &leftovers),
                        )
                        .await;
                    let outcome = IntentOutcome {
                        started,
                        ended: answered_at.unwrap_or_else(std::time::Instant::now),
                        answered: last.answered(),
                        held: last == Final::Held,
                    };
                    if let Ok(mut all) = outcomes.lock() {
                        all[index] = Some(outcome);
                    }
                    progress.inc(1);
                }
            }
        })
        .collect();
    drop(leftovers);
    let driver = async move {
        let mut running = FuturesUnordered::new();
        loop {
            tokio::select! {
                Some(copy) = pending.recv() => running.push(copy),
                Some(()) = running.next(), if !running.is_empty() => {}
                else => break,
            }
        }
    };
    // Workers borrow the plan, so they run as futures on this task rather than as spawned
    // tasks; the HTTP connections themselves are driven by the client's own spawned tasks.
    tokio::join!(join_all(workers), driver);
    let now = std::time::Instant::now();
    let outcomes = outcomes
        .into_inner()
        .unwrap_or_default()
        .into_iter()
        .map(|o| {
            o.unwrap_or(IntentOutcome {
                started: now,
                ended: now,
                answered: false,
                held: false,
            })
        })
        .collect();
    (run.counters.tally(), outcomes)
}

/// The clients' last retries at the end of the day: each intent in `seqs` is sent once
/// more (with its retries), its first amount under its key. Returns what the clients saw
/// and, per intent of `seqs`, whether it now has its final answer.
pub async fn last_retries(
    plan: &DayPlan,
    opts: &LabClient,
    seqs: &[usize],
) -> (ClientTally, Vec<bool>) {
    let run = Run::new(opts);
    let mut answered = Vec::with_capacity(seqs.len());
    for chunk in seqs.chunks(opts.concurrency.max(1)) {
        let sends = chunk.iter().map(|&seq| {
            let run = &run;
            async move {
                let intent = &plan.intents[seq];
                let key = format!("{}{}", run.opts.key_prefix, intent.key);
                let body = body_for(intent, intent.amount);
                run.request(&key, &body, run.opts.patient_timeout, true)
                    .await
                    .answered()
            }
        });
        let mut results = vec![false; chunk.len()];
        let slots = results
            .iter_mut()
            .zip(sends)
            .map(|(slot, send)| async move {
                *slot = send.await;
            });
        join_all(slots).await;
        answered.extend(results);
    }
    (run.counters.tally(), answered)
}

impl<'a> Run<'a> {
    fn new(opts: &'a LabClient) -> Run<'a> {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(opts.patient_timeout));
        connector.set_nodelay(true);
        connector.enforce_http(false);
        let builder = hyper_rustls::HttpsConnectorBuilder::new();
        let connector = match &opts.tls {
            Some(tls) => builder
                .with_tls_config((**tls).clone())
                .https_only()
                .enable_http1()
                .wrap_connector(connector),
            // Plain HTTP: the TLS side is never used.
            None => builder
                .with_tls_config(
                    rustls::ClientConfig::builder()
                        .with_root_certificates(rustls::RootCertStore::empty())
                        .with_no_client_auth(),
                )
                .https_or_http()
                .enable_http1()
                .wrap_connector(connector),
        };
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(10))
            .pool_max_idle_per_host(opts.concurrency.max(1) * 2)
            .build(connector);
        Run {
            client,
            opts,
            counters: Counters::default(),
            turn: std::sync::atomic::AtomicUsize::new(0),
        }
    }
}

/// Polls every future to completion without pulling in the `futures` crate.
async fn join_all<F: std::future::Future<Output = ()>>(futures: impl IntoIterator<Item = F>) {
    let mut set: Vec<std::pin::Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    std::future::poll_fn(|cx| {
        set.retain_mut(|f| f.as_mut().poll(cx).is_pending());
        if set.is_empty() {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
}

fn body_for(intent: &Intent, amount: i64) -> Bytes {
    let body = serde_json::json!({ "from": intent.from, "to": intent.to, "amount": amount });
    Bytes::from(body.to_string())
}

impl Run<'_> {
    /// Sends one intent as its client would; returns the final answer of its first
    /// request (the one whose answer the client waits for), and, in a storm, when the first
    /// copy had it.
    async fn send_intent<'s>(
        &'s self,
        intent: &Intent,
        style: Style,
        leftovers: &tokio::sync::mpsc::UnboundedSender<Leftover<'s>>,
    ) -> (Final, Option<std::time::Instant>) {
        let key = format!("{}{}", self.opts.key_prefix, intent.key);
        let body = body_for(intent, intent.amount);
        let patient = self.opts.patient_timeout;
        match style {
            Style::Normal => {}
            Style::Steady => {
                return (
                    self.settle(self.request(&key, &body, patient, true).await),
                    None,
                );
            }
            Style::Storm => {
                let (answer, at) = self.storm(&key, &body, leftovers).await;
                return (answer, Some(at));
            }
            Style::SlowReader => {
                if let Some(answer) = self.slow_read(&key, &body).await {
                    return (answer, None);
                }
                bump(&self.counters.retries);
                return (
                    self.settle(self.request(&key, &body, patient, true).await),
                    None,
                );
            }
        }
        let outcome = match intent.behaviour {
            Behaviour::Plain => self.request(&key, &body, patient, true).await,
            Behaviour::TimeoutRetry => self.request(&key, &body, self.opts.timeout, true).await,
            Behaviour::DisconnectRetry => {
                self.hang_up(&key, &body).await;
                bump(&self.counters.retries);
                self.request(&key, &body, patient, true).await
            }
            Behaviour::DoubleClick => {
                let (first, second) = tokio::join!(
                    self.request(&key, &body, patient, true),
                    self.request(&key, &body, patient, true)
                );
                let second = self.settle(second);
                // The intent has its answer when either click got it.
                if first.answered() || !second.answered() {
                    first
                } else {
                    second
                }
            }
            Behaviour::TellerCorrection { corrected_amount } => {
                let first = self.settle(self.request(&key, &body, patient, true).await);
                let corrected = body_for(intent, corrected_amount);
                match self.request(&key, &corrected, patient, true).await {
                    Final::Success { replayed: true } => bump(&self.counters.silent_replays),
                    Final::Success { replayed: false } => bump(&self.counters.corrections_executed),
                    _ => {}
                }
                return (first, None);
            }
        };
        (self.settle(outcome), None)
    }

    /// Counts a request that ended without its final answer.
    fn settle(&self, outcome: Final) -> Final {
        if !outcome.answered() {
            bump(&self.counters.unresolved);
        }
        outcome
    }

    /// A retry storm's client: [`STORM_COPIES`] copies at once, each retried without
    /// backoff; the intent has its answer when one copy has it (returned with the moment
    /// it came). The client then goes on to its next intent, and the other copies run on to
    /// their own end (sent to `leftovers`), as the copies of a storm do: each is its own
    /// request, sent by a retry loop that does not know another one got the answer.
    async fn storm<'s>(
        &'s self,
        key: &str,
        body: &Bytes,
        leftovers: &tokio::sync::mpsc::UnboundedSender<Leftover<'s>>,
    ) -> (Final, std::time::Instant) {
        let patient = self.opts.patient_timeout;
        let latency = LATENCY.try_with(|l| *l).ok().flatten();
        let mut copies: FuturesUnordered<_> = (0..STORM_COPIES)
            .map(|_| {
                let (key, body) = (key.to_owned(), body.clone());
                Box::pin(async move {
                    self.request_waiting(&key, &body, patient, false, STORM_IN_PROGRESS_CAP)
                        .await
                })
            })
            .collect();
        let mut held = false;
        while let Some(last) = copies.next().await {
            if last.answered() {
                let at = std::time::Instant::now();
                for copy in copies {
                    // Outside this intent's scope now: take its latency along.
                    let copy: Leftover<'s> = Box::pin(LATENCY.scope(latency, async move {
                        copy.await;
                    }));
                    let _ = leftovers.send(copy);
                }
                return (self.settle(last), at);
            }
            held |= last == Final::Held;
        }
        let last = if held { Final::Held } else { Final::GaveUp };
        (self.settle(last), std::time::Instant::now())
    }

    /// Sends one request until it has a final answer, retrying with the same key and body;
    /// with `backoff`, waits a little longer after each failed attempt (a refused
    /// connection, idemgate's 502/503), as real clients do; without, retries those at once.
    async fn request(&self, key: &str, body: &Bytes, deadline: Duration, backoff: bool) -> Final {
        self.request_waiting(key, body, deadline, backoff, self.opts.in_progress_wait_cap)
            .await
    }

    /// As [`Self::request`], waiting what a `409 in-progress`'s `Retry-After` says, at
    /// most `in_progress_cap`.
    async fn request_waiting(
        &self,
        key: &str,
        body: &Bytes,
        deadline: Duration,
        backoff: bool,
        in_progress_cap: Duration,
    ) -> Final {
        for attempt in 0..self.opts.max_attempts {
            if attempt > 0 {
                bump(&self.counters.retries);
            }
            let pause = if backoff {
                RETRY_BACKOFF * (attempt + 1)
            } else {
                Duration::ZERO
            };
            match self.attempt(key, body, deadline).await {
                Answer::Success { replayed } => return Final::Success { replayed },
                Answer::Bank(status) => return Final::Refused(status),
                Answer::Idemgate {
                    problem,
                    retry_after,
                    ..
                } if problem == "in-progress" => {
                    // Not a failure: idemgate says when to come back, and even a storm's
                    // client does (else its load is no longer 16x but as much as the
                    // machine can send).
                    let wait = retry_after.unwrap_or(in_progress_cap).min(in_progress_cap);
                    tokio::time::sleep(wait).await;
                }
                Answer::Idemgate { problem, .. } if problem == "fingerprint-mismatch" => {
                    return Final::Mismatch
                }
                Answer::Idemgate { problem, .. } if problem == "outcome-unknown" => {
                    // Only an operator can settle it; the client tries again later.
                    return Final::Held;
                }
                Answer::Idemgate { problem, .. }
                    if matches!(
                        problem.as_str(),
                        "upstream-unreachable"
                            | "store-unavailable"
                            | "overloaded"
                            | "upstream-timeout"
                            | "upstream-broken-answer"
                    ) =>
                {
                    // Nothing ran (or the retry finds the record held): try again.
                    tokio::time::sleep(pause).await;
                }
                Answer::Idemgate {
                    status, problem, ..
                } => {
                    tracing::warn!(%status, %problem, key, "lab client: idemgate refused");
                    return Final::Refused(status);
                }
                Answer::Transport => tokio::time::sleep(pause).await,
                Answer::TimedOut => {}
            }
        }
        Final::GaveUp
    }

    async fn attempt(&self, key: &str, body: &Bytes, deadline: Duration) -> Answer {
        let scheme = if self.opts.tls.is_some() {
            "https"
        } else {
            "http"
        };
        let uri = format!("{scheme}://{}/transfers", self.next_target());
        let mut request = Request::builder()
            .method(Method::POST)
            .uri(uri)
            .header(CONTENT_TYPE, "application/json")
            .header("idempotency-key", key);
        if let Some(ms) = latency_header() {
            request = request.header(LATENCY_HEADER, ms);
        }
        let request = request.body(Full::new(body.clone()));
        let request = match request {
            Ok(request) => request,
            Err(err) => {
                tracing::warn!(error = %err, key, "lab client: could not build a request");
                bump(&self.counters.other_errors);
                return Answer::Transport;
            }
        };
        bump(&self.counters.requests_sent);
        let exchange = async {
            let response = self.client.request(request).await?;
            let (parts, body) = response.into_parts();
            // Read the body so the connection goes back to the pool.
            body.collect().await?;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(parts)
        };
        let parts = match tokio::time::timeout(deadline, exchange).await {
            Err(_) => {
                bump(&self.counters.timeouts);
                return Answer::TimedOut;
            }
            Ok(Err(err)) => {
                tracing::debug!(error = %err, key, "lab client: transport error");
                bump(&self.counters.other_errors);
                return Answer::Transport;
            }
            Ok(Ok(parts)) => parts,
        };
        let status = parts.status;
        let header = |name: &str| {
            parts
                .headers
                .get(name)
                .and_then(|v: &HeaderValue| v.to_str().ok())
        };
        if let Some(problem) = header("idemgate-error") {
            let problem = problem.to_owned();
            match (status.as_u16(), problem.as_str()) {
                (409, "in-progress") => bump(&self.counters.idemgate_409_in_progress),
                (422, "fingerprint-mismatch") => bump(&self.counters.idemgate_422_mismatch),
                _ => bump(&self.counters.idemgate_other_errors),
            }
            let retry_after = parts
                .headers
                .get(RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map(Duration::from_secs);
            return Answer::Idemgate {
                status,
                problem,
                retry_after,
            };
        }
        if status.is_success() {
            let replayed = header("idempotent-replayed") == Some("true");
            if replayed {
                bump(&self.counters.replays);
            }
            return Answer::Success { replayed };
        }
        if matches!(status.as_u16(), 409 | 422) {
            bump(&self.counters.bank_409_422);
        } else {
            tracing::debug!(%status, key, "lab client: unexpected status");
            bump(&self.counters.other_errors);
        }
        Answer::Bank(status)
    }

    /// The instance the next attempt goes to.
    fn next_target(&self) -> SocketAddr {
        if self.opts.also.is_empty() {
            return self.opts.target;
        }
        let n = self.turn.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        match n % (self.opts.also.len() + 1) {
            0 => self.opts.target,
            i => self.opts.also[i - 1],
        }
    }

    /// One attempt on a fresh socket whose answer is read [`SLOW_READ_CHUNK`] bytes at a
    /// time with pauses, as a client on a bad link reads it. `None` when it brought no final
    /// answer (the caller then retries as usual).
    async fn slow_read(&self, key: &str, body: &Bytes) -> Option<Final> {
        use tokio::io::AsyncReadExt;
        let exchange = async {
            let mut stream = self.write_whole(key, body).await?;
            let mut raw = Vec::new();
            let mut chunk = [0u8; SLOW_READ_CHUNK];
            loop {
                let n = stream.read(&mut chunk).await?;
                if n == 0 {
                    break;
                }
                raw.extend_from_slice(&chunk[..n]);
                tokio::time::sleep(SLOW_READ_PAUSE).await;
            }
            Ok::<_, std::io::Error>(raw)
        };
        bump(&self.counters.requests_sent);
        let raw = match tokio::time::timeout(self.opts.patient_timeout, exchange).await {
            Ok(Ok(raw)) => raw,
            Ok(Err(err)) => {
                tracing::debug!(error = %err, key, "lab client: slow read failed");
                bump(&self.counters.other_errors);
                return None;
            }
            Err(_) => {
                bump(&self.counters.timeouts);
                return None;
            }
        };
        let text = String::from_utf8_lossy(&raw);
        let (head, _) = text.split_once("\r\n\r\n")?;
        let status: u16 = head.get(9..12)?.parse().ok()?;
        let header = |name: &str| {
            head.lines().skip(1).find_map(|line| {
                let (n, v) = line.split_once(':')?;
                n.trim()
                    .eq_ignore_ascii_case(name)
                    .then(|| v.trim().to_owned())
            })
        };
        if header("idemgate-error").is_some() {
            // idemgate's own answer (in progress, held...): the ordinary client handles it.
            bump(&self.counters.idemgate_other_errors);
            return None;
        }
        if (200..300).contains(&status) {
            let replayed = header("idempotent-replayed").as_deref() == Some("true");
            if replayed {
                bump(&self.counters.replays);
            }
            return Some(Final::Success { replayed });
        }
        if matches!(status, 409 | 422) {
            bump(&self.counters.bank_409_422);
        } else {
            bump(&self.counters.other_errors);
        }
        Some(Final::Refused(StatusCode::from_u16(status).ok()?))
    }

    /// Writes the whole request (`Connection: close`) on a fresh connection to the next
    /// target, over TLS where the run is: the stream, to read the answer from or to drop.
    async fn write_whole(
        &self,
        key: &str,
        body: &Bytes,
    ) -> std::io::Result<
        tokio_util::either::Either<TcpStream, tokio_rustls::client::TlsStream<TcpStream>>,
    > {
        let target = self.next_target();
        let head = format!(
            "POST /transfers HTTP/1.1\r\nHost: {target}\r\nContent-Type: application/json\r\n\
             Idempotency-Key: {key}\r\nContent-Length: {}\r\n{}Connection: close\r\n\r\n",
            body.len(),
            latency_line(),
        );
        let stream = TcpStream::connect(target).await?;
        stream.set_nodelay(true)?;
        let mut stream = match &self.opts.tls {
            None => tokio_util::either::Either::Left(stream),
            Some(tls) => {
                let name = rustls::pki_types::ServerName::from(target.ip());
                let tls = tokio_rustls::TlsConnector::from(tls.clone());
                tokio_util::either::Either::Right(tls.connect(name, stream).await?)
            }
        };
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body).await?;
        stream.flush().await?;
        Ok(stream)
    }

    /// Writes the whole request on a fresh socket and closes it without reading the answer.
    async fn hang_up(&self, key: &str, body: &Bytes) {
        let write = async { self.write_whole(key, body).await.map(drop) };
        bump(&self.counters.requests_sent);
        match tokio::time::timeout(self.opts.patient_timeout, write).await {
            Ok(Ok(())) => bump(&self.counters.hang_ups),
            Ok(Err(err)) => {
                tracing::debug!(error = %err, key, "lab client: hang-up write failed");
                bump(&self.counters.other_errors);
            }
            Err(_) => bump(&self.counters.timeouts),
        }
    }
}
