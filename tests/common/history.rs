//! The client side and the checker of the Jepsen-style history tests (`tests/history.rs`,
//! `tests/history_faults.rs`, `tests/postgres_history.rs`, `tests/redis_failover_history.rs`),
//! which keep only their topology and their fault injectors.
//!
//! Clients ([`run`]) send retried requests, each attempt with its `Idempotency-Key`, until
//! one is answered 201 or the attempts run out, with client-side faults at random: the
//! upstream told to break off mid-answer or hang, the client hanging up, or two sends of
//! one attempt racing. [`settle`] then reads every operation once more, fault-free, until
//! its outcome is settled, and [`check`] judges the whole history.
//!
//! What one operation is comes from the clients, never from idemgate: each intent carries
//! its own name in the [`OP`] header (headers are not fingerprinted, so bodies stay
//! identical across principals and a wrong replay would go unnoticed by a 422), and the
//! upstream's executions are attributed by that header as it saw it.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{client, execution_body, Upstream, DELAY_MS, FAULT};

/// The header that names an operation, the client's own bookkeeping.
pub const OP: &str = "x-test-op";

/// The body of a transfer with `key`: the same for everyone who uses that key.
pub fn body_for(key: &str) -> String {
    format!("{{\"key\":\"{key}\",\"amount\":{}}}", key.len() * 100 + 7)
}

/// What a client means to do once: one operation.
#[derive(Debug, Clone)]
pub struct Intent {
    /// Which service (index into [`Clients::addrs`] and the checker's upstreams).
    pub service: usize,
    /// The client's name for the operation, sent in [`OP`]; unique per service.
    pub op: String,
    pub key: String,
    pub body: String,
    /// `Authorization` values the client may present; each send picks one.
    pub credentials: Vec<String>,
    /// The `Authorization` of the last, fault-free read.
    pub final_credential: String,
    /// Sent as `multipart/form-data` with one part, `transfer`, holding `body`, and a new
    /// boundary on every send, as client libraries make them.
    pub multipart: bool,
}

/// `body` as the one part of a multipart/form-data body with `boundary`: the body and
/// its content type.
pub fn multipart(boundary: &str, body: &str) -> (String, String) {
    (
        format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"transfer\"\r\nContent-Type: application/json\r\n\r\n{body}\r\n--{boundary}--\r\n"
        ),
        format!("multipart/form-data; boundary={boundary}"),
    )
}

/// Whether an execution's body carries the operation's `body`: the same bytes, or, for a
/// multipart operation, one part `transfer` holding them under the boundary that its
/// `content-type` names. The checker's own reading of the format, not idemgate's.
fn carries(intent: &Intent, content_type: Option<&str>, got: &[u8]) -> bool {
    if !intent.multipart {
        return intent.body.as_bytes() == got;
    }
    let Some(boundary) = content_type
        .and_then(|c| c.split_once("boundary="))
        .map(|(_, b)| b)
    else {
        return false;
    };
    let Ok(text) = std::str::from_utf8(got) else {
        return false;
    };
    let delimiter = format!("--{boundary}");
    let parts: Vec<&str> = text.split(delimiter.as_str()).collect();
    // Preamble (empty), the one part, then the closing `--`.
    if parts.len() != 3 || !parts[0].is_empty() || parts[2] != "--\r\n" {
        return false;
    }
    let Some((head, content)) = parts[1].split_once("\r\n\r\n") else {
        return false;
    };
    head.contains("name=\"transfer\"") && content.strip_suffix("\r\n") == Some(&intent.body)
}

/// One request and what came back of it.
#[derive(Debug, Clone)]
pub struct Event {
    pub service: usize,
    pub op: String,
    /// The client-side fault of its attempt (`none`), or `final` for the settling read.
    pub fault: &'static str,
    /// `None`: the client hung up or the connection failed.
    pub status: Option<u16>,
    /// The `idemgate-error` header: idemgate's own problem name.
    pub problem: Option<String>,
    pub replayed: bool,
    pub answer: Vec<u8>,
}

/// What a client saw of one exchange.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub problem: Option<String>,
    pub replayed: bool,
    pub answer: Vec<u8>,
}

/// How requests are put on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// Written by hand on a fresh connection, the path exactly as given (an HTTP client
    /// would normalize it first).
    Raw,
    /// reqwest without connection reuse ([`client`]).
    Reqwest,
}

/// Sends one POST with `headers` and `body` (as JSON) to `addr` and `path`. `limit` bounds
/// the whole exchange; `None` on a hang-up or a broken connection.
pub async fn send(
    transport: Transport,
    http: &reqwest::Client,
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
    limit: Duration,
) -> Option<Reply> {
    match transport {
        Transport::Raw => send_raw(addr, path, headers, body, limit).await,
        Transport::Reqwest => {
            let mut req = http
                .post(format!("http://{addr}{path}"))
                .body(body.to_string());
            if !headers
                .iter()
                .any(|(k, _)| k.eq_ignore_ascii_case("content-type"))
            {
                req = req.header("content-type", "application/json");
            }
            for (k, v) in headers {
                req = req.header(*k, *v);
            }
            let exchange = async {
                let res = req.send().await.ok()?;
                let header = |name: &str| {
                    res.headers()
                        .get(name)
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_string)
                };
                let status = res.status().as_u16();
                let problem = header("idemgate-error");
                let replayed = header("idempotent-replayed").as_deref() == Some("true");
                let answer = res.bytes().await.ok()?.to_vec();
                Some(Reply {
                    status,
                    problem,
                    replayed,
                    answer,
                })
            };
            tokio::time::timeout(limit, exchange).await.ok().flatten()
        }
    }
}

async fn send_raw(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
    limit: Duration,
) -> Option<Reply> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut req = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    if !headers
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("content-type"))
    {
        req.push_str("Content-Type: application/json\r\n");
    }
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
    let answer = raw.get(split + 4..split + 4 + length)?.to_vec();
    let replayed = header("idempotent-replayed").as_deref() == Some("true");
    Some(Reply {
        status,
        problem: header("idemgate-error"),
        replayed,
        answer,
    })
}

/// When clients stop starting new keys.
#[derive(Clone)]
pub enum Stop {
    /// After this long, or after [`Clients::keys`] keys, whichever comes first.
    After(Duration),
    /// Once the flag is set, and not before [`Clients::keys`] keys.
    Flag(Arc<AtomicBool>),
}

/// Makes client `n`'s `k`th intent (`k` from 0), drawing on that client's random numbers.
pub type MakeIntent = Arc<dyn Fn(usize, usize, &mut StdRng) -> Intent + Send + Sync>;

/// The clients of a history run.
#[derive(Clone)]
pub struct Clients {
    /// Client `n` draws its random numbers from `seed + n`.
    pub seed: u64,
    pub clients: usize,
    pub keys: usize,
    pub stop: Stop,
    /// Attempts per key (an attempt is one send, two with the `double` fault).
    pub attempts: usize,
    /// The client-side faults, each with its chance in percent; the rest of an attempt's
    /// hundred is `none`. `reset` and `hang` tell the upstream to break off or never
    /// answer, `hangup` gives up after 1 to 120 ms, `double` sends the attempt twice at
    /// once. Empty: no fault, and no roll.
    pub faults: &'static [(&'static str, usize)],
    /// Per service, its idemgate instances: each send picks one, the final read the first.
    pub addrs: Vec<Vec<SocketAddr>>,
    /// Spellings of the path: each send picks one, the final read the first.
    pub paths: &'static [&'static str],
    pub transport: Transport,
    /// If set, each send asks the upstream to wait this many milliseconds ([`DELAY_MS`]).
    pub upstream_delay_ms: Option<Range<u64>>,
    /// The pause after an attempt that got no 201.
    pub retry_pause_ms: Range<u64>,
    /// If set, the pause after each key.
    pub key_pause_ms: Option<Range<u64>>,
    pub intent: MakeIntent,
}

/// A whole history: every request and its answer, and every operation meant.
#[derive(Debug, Default)]
pub struct History {
    pub events: Vec<Event>,
    /// Every operation, once, ordered by service and name.
    pub intents: Vec<Intent>,
    /// Attempts with a client-side fault.
    pub client_faults: usize,
}

/// The longest a send waits for its answer, short of a hang-up.
const PATIENCE: Duration = Duration::from_secs(10);

fn pick<'a, T>(of: &'a [T], rng: &mut StdRng) -> &'a T {
    // No draw for a single choice, so that a client's random numbers go where they did
    // before the choice existed.
    if of.len() == 1 {
        &of[0]
    } else {
        &of[rng.random_range(0..of.len())]
    }
}

/// Runs the clients to the end and gathers their history.
pub async fn run(clients: &Clients) -> History {
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for n in 0..clients.clients {
        let cfg = clients.clone();
        tasks.spawn(async move { client_loop(&cfg, n, started).await });
    }
    let mut history = History::default();
    let mut intents: HashMap<(usize, String), Intent> = HashMap::new();
    while let Some(done) = tasks.join_next().await {
        let (events, meant, faults) = done.expect("client task");
        history.events.extend(events);
        history.client_faults += faults;
        for i in meant {
            let previous = intents.insert((i.service, i.op.clone()), i.clone());
            assert!(
                previous.is_none(),
                "two intents named {:?} on service {}",
                i.op,
                i.service
            );
        }
    }
    let mut intents: Vec<_> = intents.into_iter().collect();
    intents.sort_by(|a, b| a.0.cmp(&b.0));
    history.intents = intents.into_iter().map(|(_, i)| i).collect();
    history
}

async fn client_loop(
    cfg: &Clients,
    n: usize,
    started: Instant,
) -> (Vec<Event>, Vec<Intent>, usize) {
    let mut rng = StdRng::seed_from_u64(cfg.seed + n as u64);
    let http = client();
    let (mut log, mut meant, mut client_faults) = (Vec::new(), Vec::new(), 0);
    for k in 0.. {
        let over = match &cfg.stop {
            Stop::After(d) => k >= cfg.keys || started.elapsed() > *d,
            Stop::Flag(f) => k >= cfg.keys && f.load(Ordering::SeqCst),
        };
        if over {
            break;
        }
        let intent = (cfg.intent)(n, k, &mut rng);
        for _ in 0..cfg.attempts {
            let fault = if cfg.faults.is_empty() {
                "none"
            } else {
                let mut roll = rng.random_range(0..100);
                let mut fault = "none";
                for (name, chance) in cfg.faults {
                    if roll < *chance {
                        fault = name;
                        break;
                    }
                    roll -= chance;
                }
                fault
            };
            if fault != "none" {
                client_faults += 1;
            }
            let sends = if fault == "double" { 2 } else { 1 };
            let mut pending = Vec::new();
            for _ in 0..sends {
                let addr = *pick(&cfg.addrs[intent.service], &mut rng);
                let path = *pick(cfg.paths, &mut rng);
                let auth = pick(&intent.credentials, &mut rng).clone();
                let delay = cfg
                    .upstream_delay_ms
                    .clone()
                    .map(|ms| rng.random_range(ms).to_string());
                let limit = if fault == "hangup" {
                    Duration::from_millis(rng.random_range(1..120))
                } else {
                    PATIENCE
                };
                let (http, transport) = (http.clone(), cfg.transport);
                let (key, op) = (intent.key.clone(), intent.op.clone());
                let (body, content_type) = if intent.multipart {
                    let boundary = format!("----form{:016x}", rng.random::<u64>());
                    let (body, ct) = multipart(&boundary, &intent.body);
                    (body, Some(ct))
                } else {
                    (intent.body.clone(), None)
                };
                pending.push(tokio::spawn(async move {
                    let mut headers = vec![
                        ("authorization", auth.as_str()),
                        ("idempotency-key", key.as_str()),
                        (OP, op.as_str()),
                    ];
                    if let Some(ct) = &content_type {
                        headers.push(("content-type", ct.as_str()));
                    }
                    if let Some(d) = &delay {
                        headers.push((DELAY_MS, d.as_str()));
                    }
                    if fault == "reset" || fault == "hang" {
                        headers.push((FAULT, fault));
                    }
                    send(transport, &http, addr, path, &headers, &body, limit).await
                }));
            }
            let mut done = false;
            for p in pending {
                let event = event(&intent, fault, p.await.expect("send task"));
                done |= event.status == Some(201);
                log.push(event);
            }
            if done {
                break;
            }
            tokio::time::sleep(Duration::from_millis(
                rng.random_range(cfg.retry_pause_ms.clone()),
            ))
            .await;
        }
        if let Some(ms) = cfg.key_pause_ms.clone() {
            tokio::time::sleep(Duration::from_millis(rng.random_range(ms))).await;
        }
        meant.push(intent);
    }
    (log, meant, client_faults)
}

fn event(intent: &Intent, fault: &'static str, reply: Option<Reply>) -> Event {
    let (status, problem, replayed, answer) = match reply {
        Some(r) => (Some(r.status), r.problem, r.replayed, r.answer),
        None => (None, None, false, Vec::new()),
    };
    Event {
        service: intent.service,
        op: intent.op.clone(),
        fault,
        status,
        problem,
        replayed,
        answer,
    }
}

/// A last, fault-free read of every operation once things have settled (the first
/// instance of its service, the first spelling of the path, its final credential), retried
/// for up to 10 s while the answer is none, a 503 or a 409 `in-progress`; with
/// `hold_unknown`, also while it is a 409 `outcome-unknown` less than that long after the
/// call. Each read's last answer joins the history as a `final` event.
pub async fn settle(clients: &Clients, history: &mut History, hold_unknown: Option<Duration>) {
    let calm = Instant::now();
    let http = client();
    for intent in &history.intents {
        let until = Instant::now() + Duration::from_secs(10);
        let (body, content_type) = if intent.multipart {
            let (body, ct) = multipart("----final-read", &intent.body);
            (body, Some(ct))
        } else {
            (intent.body.clone(), None)
        };
        loop {
            let mut headers = vec![
                ("authorization", intent.final_credential.as_str()),
                ("idempotency-key", intent.key.as_str()),
                (OP, intent.op.as_str()),
            ];
            if let Some(ct) = &content_type {
                headers.push(("content-type", ct.as_str()));
            }
            let r = send(
                clients.transport,
                &http,
                clients.addrs[intent.service][0],
                clients.paths[0],
                &headers,
                &body,
                PATIENCE,
            )
            .await;
            let settled = match &r {
                None => false,
                Some(r) => match (r.status, r.problem.as_deref()) {
                    (503, _) | (409, Some("in-progress")) => false,
                    // A claim that was never forwarded may still be being taken back (its
                    // release retried with pauses) when the faults stop; it must free the
                    // key within seconds, so an `outcome-unknown` is final once it lasted.
                    (409, Some("outcome-unknown")) => {
                        hold_unknown.is_none_or(|d| calm.elapsed() >= d)
                    }
                    _ => true,
                },
            };
            if settled || Instant::now() > until {
                history.events.push(event(intent, "final", r));
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// What the checker is told beyond the history.
pub struct Check<'a> {
    /// Per service, its upstream.
    pub upstreams: &'a [Upstream],
    /// The statuses besides 201 that a request may end with (`None`: no answer).
    pub allowed: &'a [Option<u16>],
    /// If set, the only problems idemgate may answer with itself (its `idemgate-error`).
    pub problems: Option<&'a [&'a str]>,
    /// `unknown` means "may have executed": every operation whose `final` answer is 409
    /// `outcome-unknown` has an upstream execution or a 504 in its history.
    pub unknown_means_may_have_run: bool,
}

/// The failure table of docs/guarantees.md: 409 in progress or outcome unknown, 502 never sent, 503
/// store unavailable, 504 outcome unknown, or no answer at all (a hang-up).
pub const FAILURE_TABLE: &[Option<u16>] = &[Some(409), Some(502), Some(503), Some(504), None];

/// The checker's findings.
#[derive(Debug)]
pub struct Verdict {
    pub violations: Vec<String>,
    pub requests: usize,
    pub replays: usize,
    pub operations: usize,
    pub executions: usize,
    /// Operations whose `final` answer was 409 `outcome-unknown`.
    pub unknown_finals: usize,
    pub statuses: Vec<(String, usize)>,
    pub by_fault: Vec<(&'static str, usize)>,
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} requests ({} replayed answers), {} operations, {} upstream executions, {} operations finally outcome-unknown; requests by client-side fault {:?}; statuses {:?}; violations: {}",
            self.requests,
            self.replays,
            self.operations,
            self.executions,
            self.unknown_finals,
            self.by_fault,
            self.statuses,
            self.violations.len()
        )
    }
}

impl Verdict {
    /// Prints every violation, then fails if there was one.
    pub fn assert_clean(&self) {
        for v in &self.violations {
            println!("violation: {v}");
        }
        assert!(
            self.violations.is_empty(),
            "{} violations",
            self.violations.len()
        );
    }
}

/// The checker, over the whole history. Executions are attributed to operations by the
/// client's own [`OP`] header, per service. It finds:
///
/// - an operation executed more than once;
/// - an execution without the header, of an operation no client meant, or with another
///   body than its operation's;
/// - a 201 (first-hand or replayed) that is not the answer of its own operation's
///   execution, on its own service, byte for byte;
/// - a status neither 201 nor in `allowed`, or a problem of idemgate's outside `problems`;
/// - with `unknown_means_may_have_run`, a final `outcome-unknown` that never ran and never
///   timed out.
pub fn check(history: &History, check: Check<'_>) -> Verdict {
    let intents: HashMap<(usize, &str), &Intent> = history
        .intents
        .iter()
        .map(|i| ((i.service, i.op.as_str()), i))
        .collect();
    let mut violations = Vec::new();
    let mut by_op: HashMap<(usize, String), Vec<usize>> = HashMap::new();
    let mut by_number: HashMap<(usize, usize), (String, Vec<u8>)> = HashMap::new();
    let mut executions = 0;
    for (service, up) in check.upstreams.iter().enumerate() {
        for s in up.seen() {
            executions += 1;
            let Some(op) = s.headers.get(OP).and_then(|v| v.first()).cloned() else {
                violations.push(format!(
                    "execution {} on service {service} without the {OP} header",
                    s.execution
                ));
                continue;
            };
            let content_type = s
                .headers
                .get("content-type")
                .and_then(|v| v.first())
                .map(String::as_str);
            match intents.get(&(service, op.as_str())) {
                Some(i) if carries(i, content_type, &s.body) => {}
                Some(_) => violations.push(format!(
                    "execution {} of {op:?} on service {service}: another body than the operation's ({:?})",
                    s.execution,
                    String::from_utf8_lossy(&s.body)
                )),
                None => violations.push(format!(
                    "execution {} of {op:?} on service {service}, which no client meant",
                    s.execution
                )),
            }
            by_op
                .entry((service, op.clone()))
                .or_default()
                .push(s.execution);
            let answer = execution_body(s.execution, &s.method, s.body.len()).into_bytes();
            by_number.insert((service, s.execution), (op, answer));
        }
    }
    let mut twice: Vec<_> = by_op.iter().filter(|(_, runs)| runs.len() > 1).collect();
    twice.sort();
    for (op, runs) in twice {
        violations.push(format!("{op:?} executed {} times: {runs:?}", runs.len()));
    }
    let timed_out: HashSet<(usize, &str)> = history
        .events
        .iter()
        .filter(|e| e.status == Some(504))
        .map(|e| (e.service, e.op.as_str()))
        .collect();
    let mut statuses: HashMap<String, usize> = HashMap::new();
    let mut by_fault: HashMap<&'static str, usize> = HashMap::new();
    let (mut replays, mut unknown_finals) = (0, 0);
    for e in &history.events {
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
            s if check.allowed.contains(&s) => {}
            Some(s) => violations.push(format!("{e:?}: status {s} outside the failure table")),
            None => violations.push(format!("{e:?}: no answer")),
        }
        if let (Some(only), Some(p)) = (check.problems, &e.problem) {
            if !only.contains(&p.as_str()) {
                violations.push(format!("{e:?}: problem {p} not allowed here"));
            }
        }
        let unknown = e.status == Some(409) && e.problem.as_deref() == Some("outcome-unknown");
        if e.fault == "final" && unknown {
            unknown_finals += 1;
            let op = (e.service, e.op.as_str());
            if check.unknown_means_may_have_run
                && !by_op.contains_key(&(e.service, e.op.clone()))
                && !timed_out.contains(&op)
            {
                violations.push(format!(
                    "{op:?}: final answer outcome-unknown, but never executed and never a 504"
                ));
            }
        }
    }
    let mut statuses: Vec<_> = statuses.into_iter().collect();
    statuses.sort();
    let mut by_fault: Vec<_> = by_fault.into_iter().collect();
    by_fault.sort();
    Verdict {
        violations,
        requests: history.events.len(),
        replays,
        operations: history.intents.len(),
        executions,
        unknown_finals,
        statuses,
        by_fault,
    }
}
