//! Upstreams known to speak h2 (`upstream_http2 = "prior_knowledge"`), against the real
//! binary: protected requests are streams on shared connections, over cleartext h2 (h2c)
//! and over HTTPS, while an HTTP/1.1 upstream keeps one connection per protected request;
//! an h2 upstream that goes away gracefully and comes back at random moments, and refuses
//! some streams, strands no key and runs none twice.

#![allow(clippy::unwrap_used)]

use crate::common;
use common::Probes;

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::certs::{Ca, Dir, Leaf};
use common::Gate;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use idemgate::config::UpstreamHttp2;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// What the upstream counts: connections accepted, executions per key, streams refused
/// (and their keys).
#[derive(Default)]
struct Counts {
    accepted: AtomicUsize,
    executions: Mutex<HashMap<String, usize>>,
    refused: Mutex<Vec<String>>,
}

impl Counts {
    fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
    fn executions(&self, key: &str) -> usize {
        self.executions
            .lock()
            .unwrap()
            .get(key)
            .copied()
            .unwrap_or(0)
    }
    fn execute(&self, key: &str) -> usize {
        let mut e = self.executions.lock().unwrap();
        let n = e.entry(key.to_string()).or_default();
        *n += 1;
        *n
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Proto {
    /// h2 on the h2 crate; TLS (ALPN h2) when the server has an acceptor.
    H2,
    /// HTTP/1.1 on hyper, keep-alive on.
    Http1,
}

/// The upstream: one accept loop on a fixed port, which [`Server::restart`] replaces; each
/// connection a task of its own, told to shut down gracefully by a generation change.
struct Server {
    port: u16,
    proto: Proto,
    tls: Option<tokio_rustls::TlsAcceptor>,
    counts: Arc<Counts>,
    // One stream in `refuse_one_in` is reset with REFUSED_STREAM, unprocessed (0: none).
    refuse_one_in: AtomicUsize,
    generation: tokio::sync::watch::Sender<u64>,
    accepting: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(t) = self.accepting.lock().unwrap().take() {
            t.abort();
        }
    }
}

fn ring() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn acceptor(leaf: &Leaf) -> tokio_rustls::TlsAcceptor {
    acceptor_with(leaf, &[b"h2"])
}

/// A TLS acceptor for `leaf` whose ALPN picks among `alpn`.
fn acceptor_with(leaf: &Leaf, alpn: &[&[u8]]) -> tokio_rustls::TlsAcceptor {
    let chain = CertificateDer::pem_slice_iter(leaf.cert.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_slice(leaf.key.as_bytes()).unwrap();
    let mut config = rustls::ServerConfig::builder_with_provider(ring())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .unwrap();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    tokio_rustls::TlsAcceptor::from(Arc::new(config))
}

fn answer(key: &str, n: usize) -> Bytes {
    Bytes::from(format!("{{\"key\":\"{key}\",\"execution\":{n}}}"))
}

impl Server {
    async fn start(
        proto: Proto,
        tls: Option<tokio_rustls::TlsAcceptor>,
        refuse_one_in: usize,
    ) -> Arc<Server> {
        let server = Arc::new(Server {
            port: common::free_port(),
            proto,
            tls,
            counts: Arc::default(),
            refuse_one_in: AtomicUsize::new(refuse_one_in),
            generation: tokio::sync::watch::channel(0).0,
            accepting: Mutex::new(None),
        });
        server.listen().await;
        server
    }

    fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    async fn listen(self: &Arc<Self>) {
        let listener = loop {
            match tokio::net::TcpListener::bind(("127.0.0.1", self.port)).await {
                Ok(l) => break l,
                Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
            }
        };
        let me = self.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                me.counts.accepted.fetch_add(1, Ordering::SeqCst);
                let me = me.clone();
                tokio::spawn(async move { me.serve(tcp).await });
            }
        });
        *self.accepting.lock().unwrap() = Some(task);
    }

    /// Goes away gracefully: no more accepts, every open connection told to finish the
    /// streams it took (GOAWAY) and close; back on the same port after `down`.
    async fn restart(self: &Arc<Self>, down: Duration) {
        if let Some(t) = self.accepting.lock().unwrap().take() {
            t.abort();
        }
        self.generation.send_modify(|g| *g += 1);
        tokio::time::sleep(down).await;
        self.listen().await;
    }

    async fn serve(self: Arc<Self>, tcp: tokio::net::TcpStream) {
        match (&self.tls, self.proto) {
            (Some(acceptor), proto) => {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                match proto {
                    Proto::H2 => self.serve_h2(tls).await,
                    Proto::Http1 => self.serve_h1(tls).await,
                }
            }
            (None, Proto::H2) => self.serve_h2(tcp).await,
            (None, Proto::Http1) => self.serve_h1(tcp).await,
        }
    }

    async fn serve_h1<T>(self: Arc<Self>, io: T)
    where
        T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let counts = self.counts.clone();
        let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
            let counts = counts.clone();
            async move {
                let key = key_of(req.headers());
                let n = counts.execute(&key);
                Ok::<_, Infallible>(
                    Response::builder()
                        .status(201)
                        .body(Full::new(answer(&key, n)))
                        .unwrap(),
                )
            }
        });
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(TokioIo::new(io), svc)
            .await;
    }

    async fn serve_h2<T>(self: Arc<Self>, io: T)
    where
        T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let Ok(mut conn) = h2::server::handshake(io).await else {
            return;
        };
        let mut generation = self.generation.subscribe();
        let mut rng = StdRng::from_os_rng();
        let mut going = false;
        loop {
            let next = tokio::select! {
                next = conn.accept() => next,
                _ = generation.changed(), if !going => {
                    going = true;
                    conn.graceful_shutdown();
                    continue;
                }
            };
            let Some(Ok((req, mut respond))) = next else {
                return;
            };
            let key = key_of(req.headers());
            let one_in = self.refuse_one_in.load(Ordering::SeqCst);
            if one_in > 0 && rng.random_range(0..one_in) == 0 {
                self.counts.refused.lock().unwrap().push(key);
                respond.send_reset(h2::Reason::REFUSED_STREAM);
                continue;
            }
            let counts = self.counts.clone();
            tokio::spawn(async move {
                let mut body = req.into_body();
                while let Some(chunk) = body.data().await {
                    let Ok(chunk) = chunk else { return };
                    let _ = body.flow_control().release_capacity(chunk.len());
                }
                let n = counts.execute(&key);
                let head = Response::builder().status(201).body(()).unwrap();
                if let Ok(mut send) = respond.send_response(head, false) {
                    let _ = send.send_data(answer(&key, n), true);
                }
            });
        }
    }
}

fn key_of(h: &hyper::HeaderMap) -> String {
    h.get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string()
}

/// A client to idemgate that keeps its connections: the test counts the upstream's.
fn pooled_client() -> reqwest::Client {
    reqwest::Client::builder().build().unwrap()
}

async fn post(c: &reqwest::Client, g: &Gate, key: &str) -> common::Answer {
    common::post_url(c, &g.url("/pay"), Some(key), "{\"amount\":1}", &[]).await
}

/// `keys` new keys, `parallel` at a time; every one must be answered 201.
async fn new_keys(g: &Gate, keys: usize, parallel: usize, prefix: &str) {
    let c = pooled_client();
    let mut tasks = Vec::new();
    for w in 0..parallel {
        let (c, url, prefix) = (c.clone(), g.url("/pay"), prefix.to_string());
        tasks.push(tokio::spawn(async move {
            for i in (w..keys).step_by(parallel) {
                let key = format!("{prefix}-{i}");
                let a = common::post_url(&c, &url, Some(&key), "{\"amount\":1}", &[]).await;
                assert_eq!(a.status, 201, "{key}: {:?}", a.body);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

const KEYS: usize = 1000;

/// Over h2c with prior knowledge and over HTTPS with ALPN h2 only, protected requests share
/// connections: the upstream accepts fewer than one per 100 new keys (the counts are
/// printed). Each key executed once, and its retry replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_keys_on_an_h2_upstream_share_its_connections() {
    let ca = Ca::new("upstream ca");
    let dir = Dir::new();
    let ca_file = dir.write("ca.pem", &ca.pem());
    for tls in [false, true] {
        let acceptor = tls.then(|| acceptor(&ca.leaf(&["127.0.0.1"])));
        let up = Server::start(Proto::H2, acceptor, 0).await;
        let g = common::Idemgate::new(&up.url())
            .set(|c| {
                c.upstream_http2 = UpstreamHttp2::PriorKnowledge;
                c.upstream_tls_ca_file = tls.then(|| ca_file.as_str().into());
            })
            .binary();
        new_keys(&g, KEYS, 8, "share").await;
        let accepted = up.counts.accepted();
        let what = if tls {
            "HTTPS h2"
        } else {
            "h2c prior knowledge"
        };
        println!("{what}: {accepted} upstream connections for {KEYS} new keys");
        assert!(
            accepted * 100 < KEYS,
            "{what}: {accepted} connections for {KEYS} new keys"
        );
        for i in [0, KEYS / 2, KEYS - 1] {
            let key = format!("share-{i}");
            assert_eq!(up.counts.executions(&key), 1, "{what}: {key}");
            let again = post(&pooled_client(), &g, &key).await;
            assert!(again.replayed(), "{what}: {key}: {:?}", again.body);
        }
    }
}

/// An HTTP/1.1 upstream keeps its rule: a connection of its own per protected request,
/// however many the upstream would keep alive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http1_upstream_still_gets_one_connection_per_new_key() {
    let up = Server::start(Proto::Http1, None, 0).await;
    let g = common::Idemgate::new(&up.url()).binary();
    new_keys(&g, 200, 4, "h1").await;
    let accepted = up.counts.accepted();
    println!("HTTP/1.1: {accepted} upstream connections for 200 new keys");
    assert_eq!(accepted, 200);
}

/// An upstream that does not speak h2 fails an h2-only connection before any request byte
/// reaches it: 502, the claim released, nothing executed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http1_upstream_named_h2_by_prior_knowledge_executes_nothing() {
    let up = Server::start(Proto::Http1, None, 0).await;
    let g = common::Idemgate::new(&up.url())
        .set(|c| c.upstream_http2 = UpstreamHttp2::PriorKnowledge)
        .binary();
    let a = post(&pooled_client(), &g, "not-h2").await;
    assert_eq!(a.status, 502, "{:?}", a.body);
    assert!(
        a.problem_type().ends_with("/upstream-unreachable"),
        "{:?}",
        a.body
    );
    assert_eq!(up.counts.executions(""), 0);
    assert!(up.counts.executions.lock().unwrap().is_empty());
}

/// An HTTPS upstream that speaks HTTP/1.1 only, without ALPN or with http/1.1 alone,
/// fails the h2-only connection in its handshake: 502, released, nothing executed; the
/// same upstream without `"prior_knowledge"` serves the retry of the key, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_upstream_that_does_not_pick_h2_executes_nothing() {
    let ca = Ca::new("upstream ca");
    let dir = Dir::new();
    let ca_file = dir.write("ca.pem", &ca.pem());
    let alpns: [&[&[u8]]; 2] = [&[], &[b"http/1.1"]];
    for alpn in alpns {
        let up = Server::start(
            Proto::Http1,
            Some(acceptor_with(&ca.leaf(&["127.0.0.1"]), alpn)),
            0,
        )
        .await;
        let trusting = || {
            common::Idemgate::new(&up.url())
                .set(|c| c.upstream_tls_ca_file = Some(ca_file.as_str().into()))
        };
        let g = trusting()
            .set(|c| c.upstream_http2 = UpstreamHttp2::PriorKnowledge)
            .binary();
        let a = post(&pooled_client(), &g, "tls-not-h2").await;
        assert_eq!(a.status, 502, "ALPN {alpn:?}: {:?}", a.body);
        assert!(
            a.problem_type().ends_with("/upstream-unreachable"),
            "ALPN {alpn:?}: {:?}",
            a.body
        );
        assert!(up.counts.executions.lock().unwrap().is_empty());
        drop(g);
        let g = trusting().binary();
        let a = post(&pooled_client(), &g, "tls-not-h2").await;
        assert_eq!(a.status, 201, "ALPN {alpn:?}: {:?}", a.body);
        assert_eq!(up.counts.executions("tls-not-h2"), 1);
    }
}

/// An h2 upstream that goes away gracefully (GOAWAY, finishing the streams it took) and
/// comes back at random moments, and refuses one stream in 50 with REFUSED_STREAM, under a
/// few thousand paced new keys: no key executed twice, none stranded (each either completed
/// and replayed, or released so that its retry executes once), every refused one released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2_upstream_going_away_and_refusing_streams_strands_nothing() {
    const PACED: usize = 3000;
    let up = Server::start(Proto::H2, None, 50).await;
    let g = common::Idemgate::new(&up.url())
        .set(|c| c.upstream_http2 = UpstreamHttp2::PriorKnowledge)
        .binary();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let restarts = {
        let (up, stop) = (up.clone(), stop.clone());
        tokio::spawn(async move {
            let mut rng = StdRng::seed_from_u64(41);
            let mut n = 0;
            while !stop.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(rng.random_range(5..60))).await;
                up.restart(Duration::from_millis(rng.random_range(0..5)))
                    .await;
                n += 1;
            }
            n
        })
    };
    let started = Instant::now();
    let c = pooled_client();
    let first: Arc<Mutex<HashMap<String, u16>>> = Arc::default();
    let mut tasks = Vec::new();
    for w in 0..6 {
        let (c, url, first) = (c.clone(), g.url("/pay"), first.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = StdRng::seed_from_u64(w as u64);
            for i in (w..PACED).step_by(6) {
                let key = format!("paced-{i}");
                let a = common::post_url(&c, &url, Some(&key), "{\"amount\":1}", &[]).await;
                first.lock().unwrap().insert(key, a.status);
                tokio::time::sleep(Duration::from_micros(rng.random_range(0..2000))).await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    stop.store(true, Ordering::SeqCst);
    let restarts = restarts.await.unwrap();
    // The retries below meet an upstream that refuses nothing: each must execute once.
    up.refuse_one_in.store(0, Ordering::SeqCst);
    let first = first.lock().unwrap().clone();
    let mut statuses: HashMap<u16, usize> = HashMap::new();
    for s in first.values() {
        *statuses.entry(*s).or_default() += 1;
    }
    let refused = up.counts.refused.lock().unwrap().clone();
    println!(
        "{PACED} keys in {:?}, {restarts} graceful restarts, {} streams refused, {} connections; first answers {statuses:?}",
        started.elapsed(),
        refused.len(),
        up.counts.accepted()
    );
    assert!(restarts >= 10, "{restarts} restarts");
    assert!(!refused.is_empty());
    for key in &refused {
        // A refused key's first answer was the 502 that released it (a later attempt of
        // the same key cannot have come before its answer).
        assert_eq!(first[key], 502, "{key} refused");
    }
    let mut stranded = Vec::new();
    for (key, status) in &first {
        let executed = up.counts.executions(key);
        assert!(executed <= 1, "{key} executed {executed} times");
        let retry = post(&c, &g, key).await;
        if executed == 1 {
            if !(retry.status == 201 && retry.replayed()) {
                stranded.push(format!(
                    "{key}: first {status}, executed, retry {}",
                    retry.status
                ));
            }
        } else if retry.status != 201 || retry.replayed() || up.counts.executions(key) != 1 {
            stranded.push(format!(
                "{key}: first {status}, not executed, retry {} {:?}",
                retry.status, retry.body
            ));
        }
    }
    assert!(
        stranded.is_empty(),
        "{} stranded: {stranded:?}",
        stranded.len()
    );
}
