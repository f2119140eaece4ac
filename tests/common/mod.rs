//! Shared test fixtures: a real `redis-server` per test, a fake upstream over TCP with a hit
//! counter, a settable delay and requests held until the test releases them, and idemgate
//! itself, started from typed settings in process or as the binary ([`Idemgate`], with the
//! probes of [`Probes`]), and the waits that poll a condition (`eventually`, `until`,
//! `retry_until`, `wait_until`).
#![allow(dead_code)]
// Test helpers: a failed lock or spawn is the test failing.
#![allow(clippy::unwrap_used)]

pub mod builder;
pub mod certs;
pub mod history;
pub mod idp;
pub mod postgres;
pub mod setup;
pub mod topology;
pub mod wire;

/// Runs each named `async fn(Backend)` of the test file twice: on the embedded store and on
/// a redis-server of its own.
#[allow(unused_macros)]
macro_rules! on_both_stores {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Backend::memory()).await
                }
            )*
        }
        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Backend::redis()).await
                }
            )*
        }
    };
}

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener as StdListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use idemgate::{Config, Running};

pub mod faultproxy;

// Not every test binary starts one.
#[allow(unused_imports)]
pub use builder::{Idemgate, Probes};

/// A free loopback port (bound then released; good enough on one test machine).
pub fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// A `redis-server` of our own on a free port, killed on drop; its log is printed if the
/// test failed.
pub struct RedisServer {
    pub port: u16,
    child: Option<Child>,
    dir: tempfile::TempDir,
    extra: Vec<String>,
}

impl RedisServer {
    pub fn start() -> RedisServer {
        Self::start_with(&[])
    }

    /// Starts with extra `--name value` arguments.
    pub fn start_with(extra: &[&str]) -> RedisServer {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut s = RedisServer {
            port: free_port(),
            child: None,
            dir,
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        setup::tools();
        let log = self.dir.path().join("redis.log");
        let mut cmd = Command::new("redis-server");
        cmd.arg("--port")
            .arg(self.port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .arg("--logfile")
            .arg(&log)
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        self.child = Some(
            cmd.spawn()
                .expect("redis-server on PATH (apt-get install redis-server)"),
        );
        let port = self.port;
        wait_until(
            Duration::from_secs(10),
            &format!("redis-server to start on port {port}"),
            || self.ping(),
        );
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// idemgate's Redis store on this server, keeping new records as one value each
    /// (`redis_record_format = "value"`) or as hashes.
    pub async fn store(&self, value_records: bool) -> idemgate::store::RedisStore {
        let setup = idemgate::store::RedisSetup {
            topology: idemgate::store::redis::setup::Topology::Single(self.url()),
            tls: None,
            username: None,
            password: None,
            replica_ack: None,
            value_records,
            publish_settled: true,
        };
        idemgate::store::RedisStore::open(&setup, Duration::from_secs(1), Duration::from_secs(1))
            .await
            .expect("the Redis store opens")
    }

    /// Sends PING over a raw socket.
    pub fn ping(&self) -> bool {
        self.command(&["PING"])
            .is_some_and(|r| r.starts_with("+PONG"))
    }

    /// Sends one command (inline protocol) and returns the raw reply.
    pub fn command(&self, args: &[&str]) -> Option<String> {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        let mut req = format!("*{}\r\n", args.len());
        for a in args {
            req.push_str(&format!("${}\r\n{}\r\n", a.len(), a));
        }
        s.write_all(req.as_bytes()).ok()?;
        let mut buf = [0u8; 65536];
        let n = s.read(&mut buf).ok()?;
        Some(String::from_utf8_lossy(&buf[..n]).into_owned())
    }

    /// Kills the server (SIGKILL) and waits for it.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same port (and data directory, so an append-only file is
    /// replayed).
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    /// Starts with append-only persistence, every write fsynced before it is acknowledged.
    pub fn start_persistent() -> RedisServer {
        Self::start_with(&["--appendonly", "yes", "--appendfsync", "always"])
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("redis-server running").id()
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing is answered.
    pub fn pause(&self) {
        signal(self.pid(), "STOP");
    }

    /// Thaws a paused server (SIGCONT).
    pub fn resume(&self) {
        signal(self.pid(), "CONT");
    }
}

/// Sends a signal by name (`STOP`, `CONT`, `TERM`, `KILL`) with kill(1).
pub fn signal(pid: u32, name: &str) {
    let status = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .status()
        .expect("kill(1)");
    assert!(status.success(), "kill -{name} {pid} failed");
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // SIGKILL also ends a stopped process, so a paused server needs no SIGCONT.
        self.stop();
        if std::thread::panicking() {
            if let Ok(log) = std::fs::read_to_string(self.dir.path().join("redis.log")) {
                eprintln!("--- redis-server log (port {}) ---\n{log}", self.port);
            }
        }
    }
}

/// How the fake upstream behaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Answer 201 with a JSON body after the delay.
    Answer,
    /// Never answer (hold the connection open).
    Hang,
    /// Send the status line, the headers and part of the body, then break the connection.
    Reset,
}

/// How long a test waits for what should come at once before it calls it a hang: far from
/// any expected time, so that a slow machine never fails a test; what is fast or slow is
/// measured in bench/, not asserted here. A test shows "at once" by an order or a state
/// (answered while the thing it must not wait for is still held) and keeps this as a guard.
pub const HANG_GUARD: Duration = Duration::from_secs(20);

/// Per-request header that makes the fake upstream misbehave for that request only:
/// `hang` or `reset` (as the [`Mode`]s), or `hold`: answer once the test calls
/// [`Upstream::release`] (a slow first call whose order the test decides, not a clock).
pub const FAULT: &str = "x-test-fault";
/// Per-request header: the fake upstream waits this many milliseconds before answering.
pub const DELAY_MS: &str = "x-test-delay-ms";
/// Per-request header: the fake upstream answers with this status instead of 201.
pub const STATUS: &str = "x-test-status";

/// Per-request header: the fake upstream answers this many bytes ([`big_answer_byte`]),
/// generated as they are sent, in 16 KiB frames without a `Content-Length` (chunked).
pub const ANSWER_BYTES: &str = "x-test-answer-bytes";

/// Byte `i` of a big answer: a pattern that shows any byte lost, repeated or reordered.
pub fn big_answer_byte(i: u64) -> u8 {
    (i % 251) as u8
}

/// What the upstream saw of one request.
#[derive(Clone, Debug)]
pub struct Seen {
    /// The execution number this request got (1 for the first hit).
    pub execution: usize,
    pub method: String,
    pub uri: String,
    pub headers: HashMap<String, Vec<String>>,
    pub body: Bytes,
}

/// A fake upstream over real TCP: counts hits, can be slowed down or made to hang.
#[derive(Clone)]
pub struct Upstream {
    pub addr: SocketAddr,
    hits: Arc<AtomicUsize>,
    delay_ms: Arc<AtomicU64>,
    mode: Arc<Mutex<Mode>>,
    seen: Arc<Mutex<Vec<Seen>>>,
    // Moved on by `restart`: every open connection shuts down gracefully.
    restarts: Arc<tokio::sync::watch::Sender<u64>>,
    // Requests being answered now, and the most there ever were at once.
    in_flight: Arc<AtomicUsize>,
    most_in_flight: Arc<AtomicUsize>,
    // Connections open now.
    open: Arc<AtomicUsize>,
    // Moved on by `release`: a request held with `FAULT: hold` answers once it has moved
    // past where it was when the request arrived.
    released: Arc<tokio::sync::watch::Sender<u64>>,
}

impl Upstream {
    /// A graceful restart, as gunicorn, uvicorn, Node's `server.close()` or an nginx reload
    /// do it: every idle keep-alive connection is closed at once, requests in flight are
    /// answered and then their connections closed. The listener stays.
    pub fn restart(&self) {
        self.restarts.send_modify(|n| *n += 1);
    }

    /// The most requests it was answering at once (delays included).
    pub fn most_in_flight(&self) -> usize {
        self.most_in_flight.load(Ordering::SeqCst)
    }

    pub async fn start() -> Upstream {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        Self::serve(listener)
    }

    /// Starts on a given port (to bring a refused upstream up).
    pub async fn start_on(port: u16) -> Upstream {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .expect("bind");
        Self::serve(listener)
    }

    fn serve(listener: tokio::net::TcpListener) -> Upstream {
        let up = Upstream {
            addr: listener.local_addr().expect("addr"),
            hits: Arc::default(),
            delay_ms: Arc::default(),
            mode: Arc::new(Mutex::new(Mode::Answer)),
            seen: Arc::default(),
            restarts: Arc::new(tokio::sync::watch::channel(0).0),
            in_flight: Arc::default(),
            most_in_flight: Arc::default(),
            open: Arc::default(),
            released: Arc::new(tokio::sync::watch::channel(0).0),
        };
        let state = up.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let state = state.clone();
                let mut restarts = state.restarts.subscribe();
                state.open.fetch_add(1, Ordering::SeqCst);
                let open = OpenConnection(state.open.clone());
                tokio::spawn(async move {
                    let _open = open;
                    let svc = service_fn(move |req| {
                        let state = state.clone();
                        async move { Ok::<_, Infallible>(state.answer(req).await) }
                    });
                    let builder =
                        hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                    let conn = builder.serve_connection(TokioIo::new(stream), svc);
                    tokio::pin!(conn);
                    tokio::select! {
                        _ = conn.as_mut() => return,
                        _ = restarts.changed() => conn.as_mut().graceful_shutdown(),
                    }
                    let _ = conn.await;
                });
            }
        });
        up
    }

    async fn answer(&self, req: Request<hyper::body::Incoming>) -> Response<UpBody> {
        // Read before the hit is counted: a test that saw the hit and then released it
        // has released this request.
        let generation = *self.released.borrow();
        let (parts, body) = req.into_parts();
        let body = body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let n = self.hits.fetch_add(1, Ordering::SeqCst) + 1;
        let mut headers: HashMap<String, Vec<String>> = HashMap::new();
        for (k, v) in &parts.headers {
            headers
                .entry(k.as_str().to_string())
                .or_default()
                .push(String::from_utf8_lossy(v.as_bytes()).into_owned());
        }
        let one = |name: &str| headers.get(name).and_then(|v| v.first()).cloned();
        let delay = one(DELAY_MS)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| self.delay_ms.load(Ordering::SeqCst));
        let status = one(STATUS).and_then(|v| v.parse().ok()).unwrap_or(201u16);
        let answer_bytes = one(ANSWER_BYTES).and_then(|v| v.parse::<u64>().ok());
        let hold = one(FAULT).as_deref() == Some("hold");
        let mode = match one(FAULT).as_deref() {
            Some("hang") => Mode::Hang,
            Some("reset") => Mode::Reset,
            _ => *self.mode.lock().expect("lock"),
        };
        self.seen.lock().expect("lock").push(Seen {
            execution: n,
            method: parts.method.to_string(),
            uri: parts.uri.to_string(),
            headers,
            body: body.clone(),
        });
        if delay > 0 {
            let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            self.most_in_flight.fetch_max(now, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(delay)).await;
            self.in_flight.fetch_sub(1, Ordering::SeqCst);
        }
        if hold {
            let _ = self
                .released
                .subscribe()
                .wait_for(|g| *g > generation)
                .await;
        }
        if mode == Mode::Hang {
            std::future::pending::<()>().await;
        }
        if let Some(size) = answer_bytes {
            return Response::builder()
                .status(status)
                .header("x-execution", n.to_string())
                .body(BodyExt::boxed(BigBody {
                    sent: 0,
                    total: size,
                }))
                .expect("response");
        }
        let out = Bytes::from(execution_body(n, parts.method.as_str(), body.len()));
        let builder = Response::builder()
            .status(status)
            .header("content-type", "application/json")
            .header("x-execution", n.to_string())
            .header("set-cookie", "session=secret")
            .header("connection", "x-upstream-hop")
            .header("x-upstream-hop", "1")
            .header("keep-alive", "timeout=5");
        if mode == Mode::Reset {
            // Content-Length promises the whole body; half of it comes, then an error,
            // which makes hyper abort the connection.
            let half = out.slice(..out.len() / 2);
            return builder
                .header("content-length", out.len().to_string())
                .body(BodyExt::boxed(BrokenBody::new(half)))
                .expect("response");
        }
        builder
            .body(Full::new(out).map_err(|e| match e {}).boxed())
            .expect("response")
    }

    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    /// Lets every request held with `FAULT: hold` so far answer (one that arrives later is
    /// held until the next release).
    pub fn release(&self) {
        self.released.send_modify(|g| *g += 1);
    }

    /// Connections to it open now.
    pub fn open_connections(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }

    pub fn set_delay(&self, d: Duration) {
        self.delay_ms.store(d.as_millis() as u64, Ordering::SeqCst);
    }

    pub fn set_mode(&self, m: Mode) {
        *self.mode.lock().expect("lock") = m;
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().expect("lock").clone()
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// Counts one of the fake upstream's connections until dropped.
struct OpenConnection(Arc<AtomicUsize>);

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The body the fake upstream answers for its `n`th execution.
pub fn execution_body(n: usize, method: &str, body_len: usize) -> String {
    format!("{{\"execution\":{n},\"method\":\"{method}\",\"body_len\":{body_len}}}")
}

type UpBody = http_body_util::combinators::BoxBody<Bytes, std::io::Error>;

/// A body of `total` pattern bytes, made as it is sent.
struct BigBody {
    sent: u64,
    total: u64,
}

impl hyper::body::Body for BigBody {
    type Data = Bytes;
    type Error = std::io::Error;
    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, std::io::Error>>> {
        let n = (self.total - self.sent).min(16 * 1024);
        if n == 0 {
            return std::task::Poll::Ready(None);
        }
        let chunk: Vec<u8> = (self.sent..self.sent + n).map(big_answer_byte).collect();
        self.sent += n;
        std::task::Poll::Ready(Some(Ok(hyper::body::Frame::data(Bytes::from(chunk)))))
    }
}

/// A body that yields one chunk and, a moment later (so that the chunk is on the wire),
/// fails.
struct BrokenBody {
    chunk: Option<Bytes>,
    pause: std::pin::Pin<Box<tokio::time::Sleep>>,
}

impl BrokenBody {
    fn new(chunk: Bytes) -> BrokenBody {
        BrokenBody {
            chunk: Some(chunk),
            pause: Box::pin(tokio::time::sleep(Duration::from_millis(50))),
        }
    }
}

impl hyper::body::Body for BrokenBody {
    type Data = Bytes;
    type Error = std::io::Error;
    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, std::io::Error>>> {
        use std::task::Poll;
        if let Some(chunk) = self.chunk.take() {
            return Poll::Ready(Some(Ok(hyper::body::Frame::data(chunk))));
        }
        match self.pause.as_mut().poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(()) => Poll::Ready(Some(Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionReset,
                "fake upstream breaks off",
            )))),
        }
    }
}

/// Which store a test runs against.
pub enum Backend {
    Memory,
    Redis(RedisServer),
}

impl Backend {
    pub fn memory() -> Backend {
        Backend::Memory
    }
    pub fn redis() -> Backend {
        Backend::Redis(RedisServer::start())
    }
    pub fn url(&self) -> Option<String> {
        match self {
            Backend::Memory => None,
            Backend::Redis(r) => Some(r.url()),
        }
    }
}

/// The namespace of the tests' Redis-backed instances.
pub const NAMESPACE: &str = "test";

/// A config in front of `upstream` on the given backend, admin listener on port 0.
///
/// Requests without a tenant share one anonymous scope, so tests that are not about tenants
/// need not invent credentials; the tests about tenants set `anonymous` back to `refuse`
/// or send their own headers.
pub fn config(upstream: &Upstream, backend: &Backend) -> Config {
    let mut c = Config::for_upstream(&upstream.url());
    c.redis_url = backend.url();
    if c.redis_url.is_some() {
        c.namespace = Some(NAMESPACE.into());
    }
    c.admin_listen = Some("127.0.0.1:0".parse().expect("addr"));
    c.defaults.anonymous = idemgate::config::Anonymous::Shared;
    // Each test's store is its own: no running instance to wait for.
    c.scope_secret_create_delay = Duration::ZERO;
    c
}

/// [`config`] on a Redis server the test holds (to stop, freeze or restart it).
pub fn redis_config(upstream: &Upstream, redis: &RedisServer) -> Config {
    let mut c = Config::for_upstream(&upstream.url());
    c.redis_url = Some(redis.url());
    c.namespace = Some(NAMESPACE.into());
    c.admin_listen = Some("127.0.0.1:0".parse().expect("addr"));
    c.defaults.anonymous = idemgate::config::Anonymous::Shared;
    // Each test's store is its own: no running instance to wait for.
    c.scope_secret_create_delay = Duration::ZERO;
    c
}

pub async fn spawn_app(config: Config) -> Running {
    idemgate::start(config).await.expect("idemgate starts")
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .expect("client")
}

/// A whole response, for byte-level comparisons.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("json body")
    }
    pub fn problem_type(&self) -> String {
        self.json()["type"].as_str().unwrap_or_default().to_string()
    }
    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }
}

/// POSTs `body` as JSON to `path` with an optional key and extra headers.
pub async fn post(
    client: &reqwest::Client,
    app: &Running,
    path: &str,
    key: Option<&str>,
    body: &str,
    extra: &[(&str, &str)],
) -> Answer {
    post_url(
        client,
        &format!("http://{}{}", app.addr(), path),
        key,
        body,
        extra,
    )
    .await
}

/// A POST with `key` that the upstream holds, and its retry sent once the first has reached
/// the upstream, while it is in progress; the first is answered after the retry was: both
/// answers, the first's first.
pub async fn post_and_retry_while_running(
    client: &reqwest::Client,
    app: &Running,
    up: &Upstream,
    path: &str,
    key: &str,
) -> (Answer, Answer) {
    let before = up.hits();
    let slow = post(client, app, path, Some(key), "{}", &[(FAULT, "hold")]);
    let busy = async {
        eventually(HANG_GUARD, "the first at the upstream", || {
            up.hits() > before
        })
        .await;
        let busy = post(client, app, path, Some(key), "{}", &[]).await;
        up.release();
        busy
    };
    tokio::join!(slow, busy)
}

/// POSTs JSON to a full URL with a key in a task of its own: a request that stays in
/// flight while the test goes on.
pub fn post_in_background(
    client: &reqwest::Client,
    url: String,
    key: &str,
    body: &str,
    extra: &[(&str, &str)],
) -> tokio::task::JoinHandle<Answer> {
    let (c, key, body) = (client.clone(), key.to_string(), body.to_string());
    let extra: Vec<(String, String)> = extra
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    tokio::spawn(async move {
        let extra: Vec<(&str, &str)> = extra.iter().map(|(k, v)| (&**k, &**v)).collect();
        post_url(&c, &url, Some(&key), &body, &extra).await
    })
}

/// An upstream that never answers (until `set_mode(Mode::Answer)`) and the proxy in front
/// of it, which gives up after `upstream_timeout`; `tweak` changes the rest of its config.
pub async fn hanging_upstream(
    backend: &Backend,
    upstream_timeout: Duration,
    tweak: impl FnOnce(&mut Config),
) -> (Upstream, Running) {
    let up = Upstream::start().await;
    up.set_mode(Mode::Hang);
    let mut cfg = config(&up, backend);
    cfg.defaults.upstream_timeout = upstream_timeout;
    tweak(&mut cfg);
    (up, spawn_app(cfg).await)
}

/// Waits (at most 5 s) until the upstream has seen `n` requests.
pub async fn upstream_reached(up: &Upstream, n: usize) {
    eventually(Duration::from_secs(5), "upstream reached", || {
        up.hits() == n
    })
    .await;
}

/// The value of one series (its name and labels exactly as exposed) in a `/metrics` text.
pub fn series_value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

/// [`series_value`], failing the test with the whole text if the series is not there.
pub fn metric_in(text: &str, series: &str) -> f64 {
    series_value(text, series).unwrap_or_else(|| panic!("no {series} in\n{text}"))
}

/// How often the waits below look again.
const POLL: Duration = Duration::from_millis(20);

/// Waits until `cond` holds, polling; panics after `limit`.
pub async fn eventually(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    until(limit, what, async || cond()).await;
}

/// [`eventually`] for a condition that awaits (a request, a store read).
pub async fn until(limit: Duration, what: &str, mut cond: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !cond().await {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(POLL).await;
    }
}

/// [`eventually`] for a test thread outside the runtime: blocks it between looks.
pub fn wait_until(limit: Duration, what: &str, cond: impl FnMut() -> bool) {
    assert!(held_within(limit, cond), "timed out waiting for: {what}");
}

/// Whether `cond` came to hold within `limit`, looking again every 20 ms (blocking the
/// thread): for a caller whose failure message needs what it sees at the end (a log).
pub fn held_within(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while !cond() {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(POLL);
    }
    true
}

/// Runs `attempt` again until `done` accepts what it gave or `limit` has passed, and
/// returns the last result either way: the caller asserts on it, so a timeout fails with
/// the answer that was still wrong.
pub async fn retry_until<T>(
    limit: Duration,
    mut attempt: impl AsyncFnMut() -> T,
    mut done: impl FnMut(&T) -> bool,
) -> T {
    let deadline = Instant::now() + limit;
    loop {
        let got = attempt().await;
        if done(&got) || Instant::now() > deadline {
            return got;
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Waits for `child` to exit on its own, at most `limit`: its status, or `None` if it still
/// runs (left running: the caller kills it or fails).
pub fn exit_within(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let mut status = None;
    held_within(limit, || {
        status = child.try_wait().expect("wait");
        status.is_some()
    });
    status
}

/// [`retry_until`] on a test thread outside the runtime.
pub fn retry_until_blocking<T>(
    limit: Duration,
    mut attempt: impl FnMut() -> T,
    mut done: impl FnMut(&T) -> bool,
) -> T {
    let deadline = Instant::now() + limit;
    loop {
        let got = attempt();
        if done(&got) || Instant::now() > deadline {
            return got;
        }
        std::thread::sleep(POLL);
    }
}

/// The real `idemgate` binary as a child process, configured through the environment;
/// killed on drop, its log printed if the test failed.
pub struct Gate {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    child: Option<Child>,
    dir: tempfile::TempDir,
}

impl Gate {
    /// Starts the binary in front of `upstream` on `redis_url` (empty: the embedded store)
    /// with extra `IDEMGATE_*` variables, and waits until `/healthz` answers.
    /// Runs the binary as [`start`](Self::start) would, to its exit (within 20 s): its exit
    /// code and its log. For start-up refusals.
    pub fn run_to_exit(
        upstream: &str,
        redis_url: &str,
        env: &[(&str, &str)],
    ) -> (Option<i32>, String) {
        let (cmd, _, _, dir) = Self::command(upstream, redis_url, env);
        Self::run_command_to_exit(cmd, &dir)
    }

    /// Runs `cmd` to its exit (within 20 s): its exit code and the log in `dir`.
    fn run_command_to_exit(mut cmd: Command, dir: &tempfile::TempDir) -> (Option<i32>, String) {
        let mut child = cmd.spawn().expect("test set-up");
        let Some(status) = exit_within(&mut child, Duration::from_secs(20)) else {
            let _ = child.kill();
            panic!("idemgate did not exit");
        };
        let log = std::fs::read_to_string(dir.path().join("idemgate.log")).unwrap_or_default();
        (status.code(), log)
    }

    pub fn start(upstream: &str, redis_url: &str, env: &[(&str, &str)]) -> Gate {
        Self::launch_on_free_ports(|| Self::command(upstream, redis_url, env))
    }

    /// As [`start`](Self::start), on the persistent embedded store in `store_path` instead
    /// of Redis.
    pub fn start_on_disk(upstream: &str, store_path: &Path, env: &[(&str, &str)]) -> Gate {
        Self::launch_on_free_ports(|| {
            let (mut cmd, addr, admin, dir) = Self::command(upstream, "", env);
            cmd.env_remove("IDEMGATE_REDIS_URL")
                .env("IDEMGATE_STORE_PATH", store_path);
            (cmd, addr, admin, dir)
        })
    }

    /// Launches what `make` gives, with new ports when the ones it picked were taken in the
    /// meantime by another test's process (free ports are found by binding and letting go,
    /// so two tests can pick the same one): at most four tries.
    fn launch_on_free_ports(
        make: impl Fn() -> (Command, SocketAddr, SocketAddr, tempfile::TempDir),
    ) -> Gate {
        let mut tries = 0;
        loop {
            let (cmd, addr, admin, dir) = make();
            tries += 1;
            match Self::try_launch(cmd, addr, admin, dir) {
                Ok(gate) => return gate,
                Err((port_taken, why)) if port_taken && tries < 4 => {
                    eprintln!("idemgate's ports were taken, trying others: {why}");
                }
                Err((_, why)) => panic!("{why}"),
            }
        }
    }

    /// Spawns `cmd` and waits until `/healthz` answers and start-up has opened the store.
    fn launch(cmd: Command, addr: SocketAddr, admin: SocketAddr, dir: tempfile::TempDir) -> Gate {
        Self::try_launch(cmd, addr, admin, dir).unwrap_or_else(|(_, why)| panic!("{why}"))
    }

    /// As [`launch`](Self::launch); `Err((port_taken, why))` where it did not start, with
    /// `port_taken` when it could not bind a port it was given.
    fn try_launch(
        mut cmd: Command,
        addr: SocketAddr,
        admin: SocketAddr,
        dir: tempfile::TempDir,
    ) -> Result<Gate, (bool, String)> {
        let child = cmd.spawn().expect("idemgate binary");
        let mut gate = Gate {
            addr,
            admin,
            child: Some(child),
            dir,
        };
        // Healthy, and past start-up (which answers /healthz while the store opens, and
        // `/readyz` with "idemgate is starting"), or exited.
        let mut exited = None;
        let child = gate.child.as_mut().expect("running");
        let up = held_within(Duration::from_secs(15), || {
            if started(admin) {
                return true;
            }
            exited = child.try_wait().ok().flatten();
            exited.is_some()
        });
        if let Some(status) = exited {
            let log = gate.log();
            let port_taken = log.contains("Address already in use");
            return Err((
                port_taken,
                format!("idemgate exited at start-up with {status}:\n{log}"),
            ));
        }
        if up {
            return Ok(gate);
        }
        Err((
            false,
            format!("idemgate did not become healthy:\n{}", gate.log()),
        ))
    }

    /// As [`start`](Self::start), with another build of the binary (`bin`): a previous
    /// release beside this one. Variables that build may not know are left out.
    pub fn start_binary(bin: &Path, upstream: &str, redis_url: &str, env: &[(&str, &str)]) -> Gate {
        let (mut cmd, addr, admin, dir) =
            Self::command_of(Command::new(bin), upstream, redis_url, env);
        cmd.env_remove("IDEMGATE_SCOPE_SECRET_CREATE_DELAY");
        Self::launch(cmd, addr, admin, dir)
    }

    /// As [`start`](Self::start) on the embedded store, under `ulimit -n nofile`.
    pub fn start_with_nofile(upstream: &str, nofile: u32, env: &[(&str, &str)]) -> Gate {
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(format!("ulimit -n {nofile} && exec \"$0\""))
            .arg(env!("CARGO_BIN_EXE_idemgate"));
        let (cmd, addr, admin, dir) = Self::command_of(cmd, upstream, "", env);
        Self::launch(cmd, addr, admin, dir)
    }

    /// The command line for the binary, with fresh ports and a log file in a new directory.
    pub fn command(
        upstream: &str,
        redis_url: &str,
        env: &[(&str, &str)],
    ) -> (Command, SocketAddr, SocketAddr, tempfile::TempDir) {
        Self::command_of(
            Command::new(env!("CARGO_BIN_EXE_idemgate")),
            upstream,
            redis_url,
            env,
        )
    }

    fn command_of(
        mut cmd: Command,
        upstream: &str,
        redis_url: &str,
        env: &[(&str, &str)],
    ) -> (Command, SocketAddr, SocketAddr, tempfile::TempDir) {
        let dir = tempfile::tempdir().expect("tempdir");
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
        let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
        let log = std::fs::File::create(dir.path().join("idemgate.log")).expect("log file");
        cmd.env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("RUST_LOG", "info")
            .env("IDEMGATE_LISTEN", addr.to_string())
            .env("IDEMGATE_ADMIN_LISTEN", admin.to_string())
            .env("IDEMGATE_UPSTREAM", upstream)
            .env("IDEMGATE_NAMESPACE", NAMESPACE)
            .env("IDEMGATE_DEFAULTS__ANONYMOUS", "shared")
            // Each test's store is its own: no running instance to wait for.
            .env("IDEMGATE_SCOPE_SECRET_CREATE_DELAY", "0s")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        // Empty: the embedded store.
        if !redis_url.is_empty() {
            cmd.env("IDEMGATE_REDIS_URL", redis_url);
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        (cmd, addr, admin, dir)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// SIGKILL: no drain, no cleanup, as if the machine died.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, then waits (at most `limit`) for the exit status.
    pub fn terminate(&mut self, limit: Duration) -> ExitStatus {
        let mut c = self.child.take().expect("running");
        signal(c.id(), "TERM");
        let Some(status) = exit_within(&mut c, limit) else {
            let _ = c.kill();
            let _ = c.wait();
            panic!("idemgate did not exit within {limit:?} of SIGTERM");
        };
        status
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("idemgate.log")).unwrap_or_default()
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!("--- idemgate log ---\n{}", self.log());
        }
    }
}

/// A GET over a raw socket (usable from sync code); the whole response, or `None`.
/// Whether the instance whose admin listener is `admin` is healthy and past start-up
/// (which answers `/healthz` while the store opens, and `/readyz` with "idemgate is
/// starting").
pub fn started(admin: SocketAddr) -> bool {
    http_get(admin, "/healthz").is_some_and(|r| r.starts_with("HTTP/1.1 200"))
        && http_get(admin, "/readyz").is_some_and(|r| !r.contains("idemgate is starting"))
}

pub fn http_get(addr: SocketAddr, path: &str) -> Option<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).ok()?;
    Some(String::from_utf8_lossy(&out).into_owned())
}

/// Sends raw bytes, then reads until the peer closes (or 5 s pass).
pub fn send_raw(addr: SocketAddr, bytes: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    s.write_all(bytes).expect("write");
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// POSTs JSON to a full URL with optional key and extra headers.
pub async fn post_url(
    client: &reqwest::Client,
    url: &str,
    key: Option<&str>,
    body: &str,
    extra: &[(&str, &str)],
) -> Answer {
    let mut req = client
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_string());
    if let Some(k) = key {
        req = req.header("idempotency-key", k);
    }
    for (k, v) in extra {
        req = req.header(*k, *v);
    }
    let res = req.send().await.expect("request");
    Answer {
        status: res.status().as_u16(),
        headers: res.headers().clone(),
        body: res.bytes().await.expect("body"),
    }
}

/// `GET /records/{id}` on an admin listener: the record as JSON, or `None` (404).
pub async fn inspect(
    client: &reqwest::Client,
    admin: SocketAddr,
    id: &str,
) -> Option<serde_json::Value> {
    let r = client
        .get(format!("http://{admin}/records/{id}?body=1"))
        .send()
        .await
        .expect("admin request");
    match r.status().as_u16() {
        200 => Some(r.json().await.expect("record json")),
        404 => None,
        s => panic!("admin GET /records answered {s}"),
    }
}

/// `DELETE /records/{id}` on an admin listener; whether something was released.
pub async fn release(client: &reqwest::Client, admin: SocketAddr, id: &str) -> bool {
    // Whatever its state: a completed record too (`?completed=true`).
    let r = client
        .delete(format!(
            "http://{admin}/records/{id}?completed=true&reason=test+releases+it"
        ))
        .send()
        .await
        .expect("admin request");
    r.status().as_u16() == 200
}

/// `DELETE /records/{id}` on an admin listener, `?force=true` if `force`; the status.
pub async fn admin_delete(
    client: &reqwest::Client,
    admin: SocketAddr,
    id: &str,
    force: bool,
) -> u16 {
    let force = if force { "&force=true" } else { "" };
    client
        .delete(format!(
            "http://{admin}/records/{id}?reason=test+releases+it{force}"
        ))
        .send()
        .await
        .expect("admin request")
        .status()
        .as_u16()
}

/// An upstream that records the raw bytes of every connection and answers each one with a
/// fixed 201 and `Connection: close`: it shows exactly what idemgate put on the wire.
pub struct RawUpstream {
    pub addr: SocketAddr,
    received: Arc<Mutex<Vec<Vec<u8>>>>,
}

impl RawUpstream {
    pub async fn start() -> RawUpstream {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let up = RawUpstream {
            addr: listener.local_addr().expect("addr"),
            received: Arc::default(),
        };
        let received = up.received.clone();
        tokio::spawn(async move {
            loop {
                let Ok((mut stream, _)) = listener.accept().await else {
                    continue;
                };
                let received = received.clone();
                tokio::spawn(async move {
                    let slot = {
                        let mut r = received.lock().expect("lock");
                        r.push(Vec::new());
                        r.len() - 1
                    };
                    // Read what arrives within a short quiet period, then answer and close.
                    let mut buf = [0u8; 8192];
                    while let Ok(Ok(n)) =
                        tokio::time::timeout(Duration::from_millis(200), stream.read(&mut buf))
                            .await
                    {
                        if n == 0 {
                            break;
                        }
                        received.lock().expect("lock")[slot].extend_from_slice(&buf[..n]);
                    }
                    let _ = stream
                        .write_all(b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
                        .await;
                });
            }
        });
        up
    }

    /// Everything received, one entry per connection.
    pub fn received(&self) -> Vec<String> {
        self.received
            .lock()
            .expect("lock")
            .iter()
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .collect()
    }

    /// How many request lines arrived in total (a smuggled request shows up as an extra).
    pub fn requests(&self) -> usize {
        self.received()
            .iter()
            .map(|c| {
                c.split("\r\n")
                    .filter(|l| l.ends_with(" HTTP/1.1") || l.ends_with(" HTTP/1.0"))
                    .count()
            })
            .sum()
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// Runs the binary with only `env` (and `PATH`), expecting it to stop at start-up: its exit
/// code and stderr. One that keeps running after 10 s is killed and fails the test.
pub fn start_up_failure(env: &[(&str, &str)]) -> (Option<i32>, String) {
    let dir = tempfile::tempdir().expect("tempdir");
    let err_path = dir.path().join("stderr");
    let mut child = Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("IDEMGATE_LISTEN", "127.0.0.1:0")
        .env(
            "IDEMGATE_ADMIN_LISTEN",
            format!("127.0.0.1:{}", free_port()),
        )
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err_path).expect("stderr file"))
        .spawn()
        .expect("idemgate binary");
    let status = exit_within(&mut child, Duration::from_secs(10));
    let err = std::fs::read_to_string(&err_path).unwrap_or_default();
    let Some(status) = status else {
        let _ = child.kill();
        let _ = child.wait();
        panic!("idemgate started instead of refusing its configuration:\n{err}");
    };
    (status.code(), err)
}

/// Sockets in TIME_WAIT on either end of a connection to a port, counted from a moment on.
///
/// A listener bound to port 0 may be given a port that earlier sockets of other tests
/// still use: an earlier server's connections on that port, closed into TIME_WAIT (the
/// side that closes first enters it, for up to 60 s) or still closing (in FIN_WAIT_2 until
/// their peer closes, then in TIME_WAIT), or a connection that had it as its ephemeral
/// end. Taking every socket with the port at either end when the listener is bound, before
/// any traffic, and counting only TIME_WAIT sockets that were not among them leaves those
/// out: a socket keeps its addresses as it moves through those states, and once the port
/// is bound to a listener no new connection can take it as its ephemeral end, so every
/// other socket in TIME_WAIT is a connection to the listener.
pub struct TimeWait {
    port: u16,
    before: std::collections::HashSet<(String, String)>,
}

impl TimeWait {
    /// Starts counting for `port` (IPv4, /proc/net/tcp).
    pub fn from_now(port: u16) -> TimeWait {
        TimeWait {
            port,
            before: sockets_on(port, None),
        }
    }

    /// The sockets (local and remote address, in /proc/net/tcp's hex) in TIME_WAIT towards
    /// the port that were not there, in any state, when counting started.
    pub fn new_since(&self) -> Vec<(String, String)> {
        let mut new: Vec<_> = sockets_on(self.port, Some("06"))
            .into_iter()
            .filter(|s| !self.before.contains(s))
            .collect();
        new.sort();
        new
    }
}

/// The sockets with `port` at either end, in `state` (/proc/net/tcp's hex, "06" for
/// TIME_WAIT) or in any.
fn sockets_on(port: u16, state: Option<&str>) -> std::collections::HashSet<(String, String)> {
    let table = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
    let port_of = |addr: &str| {
        addr.rsplit(':')
            .next()
            .and_then(|p| u16::from_str_radix(p, 16).ok())
    };
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            (f.len() > 3
                && state.is_none_or(|s| f[3] == s)
                && (port_of(f[1]) == Some(port) || port_of(f[2]) == Some(port)))
            .then(|| (f[1].to_string(), f[2].to_string()))
        })
        .collect()
}
