//! Shared test fixtures: a real `redis-server` per test, a fake upstream over TCP with a hit
//! counter and a settable delay, and idemgate in-process on port 0.
#![allow(dead_code)]

use std::collections::HashMap;
use std::convert::Infallible;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener as StdListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use idemgate::{Config, Running};

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
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self.ping() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("redis-server did not start on port {}", self.port);
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
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

    /// Starts it again on the same port.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
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
}

/// What the upstream saw of one request.
#[derive(Clone, Debug)]
pub struct Seen {
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
}

impl Upstream {
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
        };
        let state = up.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let state = state.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let state = state.clone();
                        async move { Ok::<_, Infallible>(state.answer(req).await) }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        up
    }

    async fn answer(&self, req: Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
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
        self.seen.lock().unwrap().push(Seen {
            method: parts.method.to_string(),
            uri: parts.uri.to_string(),
            headers,
            body: body.clone(),
        });
        let delay = self.delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        if *self.mode.lock().unwrap() == Mode::Hang {
            std::future::pending::<()>().await;
        }
        let out = format!(
            "{{\"execution\":{n},\"method\":\"{}\",\"body_len\":{}}}",
            parts.method,
            body.len()
        );
        Response::builder()
            .status(201)
            .header("content-type", "application/json")
            .header("x-execution", n.to_string())
            .header("set-cookie", "session=secret")
            .header("connection", "x-upstream-hop")
            .header("x-upstream-hop", "1")
            .body(Full::new(Bytes::from(out)))
            .expect("response")
    }

    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    pub fn set_delay(&self, d: Duration) {
        self.delay_ms.store(d.as_millis() as u64, Ordering::SeqCst);
    }

    pub fn set_mode(&self, m: Mode) {
        *self.mode.lock().unwrap() = m;
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
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

/// A config in front of `upstream` on the given backend, admin listener on port 0.
pub fn config(upstream: &Upstream, backend: &Backend) -> Config {
    let mut c = Config::for_upstream(&upstream.url());
    c.redis_url = backend.url();
    c.admin_listen = Some("127.0.0.1:0".parse().expect("addr"));
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
    let mut req = client
        .post(format!("http://{}{}", app.addr(), path))
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

/// Waits until `cond` holds, polling; panics after `limit`.
pub async fn eventually(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let until = Instant::now() + limit;
    while Instant::now() < until {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for: {what}");
}
