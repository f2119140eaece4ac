//! TLS on both sides, against the real binary: an `https://` upstream run here (hyper over
//! tokio-rustls) with certificates made per test, and clients of idemgate's TLS listener.
//!
//! Upstream: a private CA, a client certificate the upstream requires, a wrong CA, a wrong
//! name (and `upstream_tls_server_name`), an expired certificate; a failed handshake is a
//! 502 that releases the claim. Start-up: a key that is not its certificate's, or a CA file
//! that cannot be read, is exit 64 naming the key. Listener: HTTP/1.1 and h2, client
//! certificates, the head deadline over the handshake, and certificate rotation under
//! traffic, a bad pair included.

#![allow(clippy::unwrap_used)]

use crate::common;
use common::Probes;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::certs::{Ca, Dir, Leaf};
use common::{Gate, Idemgate, Upstream};
use http_body_util::Full;
use hyper::service::service_fn;
use hyper::{Request, Response, Version};
use hyper_util::rt::{TokioExecutor, TokioIo};
use idemgate::config::{Anonymous, ClientAuth, Config, Route, UpstreamHttp2};
use idemgate::scope::client_cert::CertField;
use rcgen::DnType;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

fn ring() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// What the HTTPS upstream saw of one request.
#[derive(Clone, Debug)]
struct SeenTls {
    version: Version,
    forwarded_proto: Option<String>,
    client_certificate: bool,
}

/// An HTTPS upstream: hyper over tokio-rustls, ALPN h2 and http/1.1, a client certificate
/// required when `client_ca` is given. Answers 201 with its execution number.
struct HttpsUpstream {
    addr: SocketAddr,
    hits: Arc<AtomicUsize>,
    seen: Arc<Mutex<Vec<SeenTls>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for HttpsUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl HttpsUpstream {
    async fn start(leaf: &Leaf, client_ca: Option<&Ca>) -> HttpsUpstream {
        let builder = rustls::ServerConfig::builder_with_provider(ring())
            .with_safe_default_protocol_versions()
            .unwrap();
        let builder = match client_ca {
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                roots
                    .add(CertificateDer::from_pem_slice(ca.pem().as_bytes()).unwrap())
                    .unwrap();
                builder.with_client_cert_verifier(
                    rustls::server::WebPkiClientVerifier::builder_with_provider(
                        Arc::new(roots),
                        ring(),
                    )
                    .build()
                    .unwrap(),
                )
            }
            None => builder.with_no_client_auth(),
        };
        let chain = CertificateDer::pem_slice_iter(leaf.cert.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .unwrap();
        let key = PrivateKeyDer::from_pem_slice(leaf.key.as_bytes()).unwrap();
        let mut config = builder.with_single_cert(chain, key).unwrap();
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let hits = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (h, s) = (hits.clone(), seen.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let (acceptor, hits, seen) = (acceptor.clone(), h.clone(), s.clone());
                tokio::spawn(async move {
                    // A refused handshake (no client certificate, one from another CA):
                    // rustls has sent its alert; nothing is served.
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let client_certificate = tls.get_ref().1.peer_certificates().is_some();
                    let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
                        let (hits, seen) = (hits.clone(), seen.clone());
                        async move {
                            let n = hits.fetch_add(1, Ordering::SeqCst) + 1;
                            seen.lock().unwrap().push(SeenTls {
                                version: req.version(),
                                forwarded_proto: req
                                    .headers()
                                    .get("x-forwarded-proto")
                                    .and_then(|v| v.to_str().ok())
                                    .map(String::from),
                                client_certificate,
                            });
                            Ok::<_, Infallible>(
                                Response::builder()
                                    .status(201)
                                    .header("content-type", "application/json")
                                    .body(Full::new(Bytes::from(format!("{{\"execution\":{n}}}"))))
                                    .unwrap(),
                            )
                        }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(tls), svc)
                        .await;
                });
            }
        });
        HttpsUpstream {
            addr,
            hits,
            seen,
            task,
        }
    }

    /// `https://127.0.0.1:port` (certificates name `127.0.0.1` unless a test says not).
    fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.addr.port())
    }

    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    fn seen(&self) -> Vec<SeenTls> {
        self.seen.lock().unwrap().clone()
    }
}

async fn post(client: &reqwest::Client, url: &str, key: &str) -> common::Answer {
    common::post_url(client, url, Some(key), "{\"amount\":1}", &[]).await
}

/// Starts the binary in front of an HTTPS upstream that trusts `ca`'s certificates.
/// `ca_file` names that CA's certificate; `set` changes the rest of its settings.
fn gate(upstream: &str, ca_file: &str, set: impl FnOnce(&mut Config)) -> Gate {
    Idemgate::new(upstream)
        .set(|c| c.upstream_tls_ca_file = Some(ca_file.into()))
        .set(set)
        .binary()
}

/// What an h2-only HTTPS upstream does on one connection (the connections idemgate opens,
/// in order; protected requests take one each).
#[derive(Clone, Copy, Debug)]
enum H2Plan {
    /// Resets the request's stream with `REFUSED_STREAM`, unprocessed.
    Refuse,
    /// Sends `GOAWAY` with last stream id 0 before reading any stream, then closes.
    GoAwayFirst,
    /// Takes the request (an execution), then sends `GOAWAY` with its stream's id as the
    /// last one and closes without answering: processed, for all idemgate can know.
    RunThenGoAway,
    /// Answers 201 with its execution number.
    Serve,
}

/// An h2-only HTTPS upstream on the h2 crate, following one [`H2Plan`] per connection
/// (`Serve` once the plans run out).
struct H2Upstream {
    addr: SocketAddr,
    hits: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for H2Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl H2Upstream {
    async fn start(leaf: &Leaf, plans: Vec<H2Plan>) -> H2Upstream {
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
        config.alpn_protocols = vec![b"h2".to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let hits = Arc::new(AtomicUsize::new(0));
        let h = hits.clone();
        let task = tokio::spawn(async move {
            for n in 0.. {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let plan = plans.get(n).copied().unwrap_or(H2Plan::Serve);
                let (acceptor, hits) = (acceptor.clone(), h.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let Ok(mut conn) = h2::server::handshake(tls).await else {
                        return;
                    };
                    match plan {
                        H2Plan::GoAwayFirst => {
                            // The handshake read the client's preface only: no stream has
                            // been processed, so the GOAWAY's last stream id is 0.
                            conn.abrupt_shutdown(h2::Reason::NO_ERROR);
                            while conn.accept().await.is_some() {}
                        }
                        H2Plan::Refuse => {
                            if let Some(Ok((_req, mut respond))) = conn.accept().await {
                                respond.send_reset(h2::Reason::REFUSED_STREAM);
                            }
                            while conn.accept().await.is_some() {}
                        }
                        H2Plan::RunThenGoAway => {
                            if let Some(Ok((_req, respond))) = conn.accept().await {
                                hits.fetch_add(1, Ordering::SeqCst);
                                conn.abrupt_shutdown(h2::Reason::NO_ERROR);
                                while conn.accept().await.is_some() {}
                                drop(respond);
                            }
                        }
                        H2Plan::Serve => {
                            while let Some(Ok((_req, mut respond))) = conn.accept().await {
                                let n = hits.fetch_add(1, Ordering::SeqCst) + 1;
                                let head = Response::builder().status(201).body(()).unwrap();
                                let mut body = respond.send_response(head, false).unwrap();
                                let text = format!("{{\"execution\":{n}}}");
                                body.send_data(Bytes::from(text), true).unwrap();
                            }
                        }
                    }
                });
            }
        });
        H2Upstream { addr, hits, task }
    }

    fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.addr.port())
    }

    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

/// An h2 upstream's word that it did not process a stream releases the claim: a stream
/// reset with `REFUSED_STREAM` and one above a `GOAWAY`'s last stream id are 502
/// `upstream-unreachable`, and the retry executes, once. A stream at or below the last
/// stream id that the connection's end cuts off may have run: it is held `unknown`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2_upstream_refusing_a_stream_or_going_away_before_it_releases_the_claim() {
    let ca = Ca::new("upstream ca");
    let up = H2Upstream::start(
        &ca.leaf(&["127.0.0.1"]),
        vec![
            H2Plan::Refuse,
            H2Plan::GoAwayFirst,
            H2Plan::Serve,
            H2Plan::RunThenGoAway,
        ],
    )
    .await;
    let dir = Dir::new();
    let ca_file = dir.write("ca.pem", &ca.pem());
    let g = gate(&up.url(), &ca_file, |_| ());
    let client = common::client();
    for plan in ["REFUSED_STREAM", "GOAWAY with last stream id 0"] {
        let a = post(&client, &g.url("/pay"), "h2-refused").await;
        assert_eq!(a.status, 502, "{plan}: {:?}", a.body);
        assert!(
            a.problem_type().ends_with("/upstream-unreachable"),
            "{plan}: {:?}",
            a.body
        );
    }
    assert_eq!(up.hits(), 0);
    let ran = post(&client, &g.url("/pay"), "h2-refused").await;
    assert_eq!(ran.status, 201, "{:?}", ran.body);
    let again = post(&client, &g.url("/pay"), "h2-refused").await;
    assert!(again.replayed(), "{:?}", again.body);
    assert_eq!(again.body, ran.body);
    assert_eq!(up.hits(), 1);

    // Processed, then cut off: not released.
    let cut = post(&client, &g.url("/pay"), "h2-cut").await;
    assert_eq!(up.hits(), 2);
    assert!(cut.status >= 500, "{:?}", cut.body);
    assert!(
        !cut.problem_type().ends_with("/upstream-unreachable"),
        "{:?}",
        cut.body
    );
    let held = post(&client, &g.url("/pay"), "h2-cut").await;
    assert_eq!(held.status, 409, "{:?}", held.body);
    assert!(
        held.problem_type().ends_with("/outcome-unknown"),
        "{:?}",
        held.body
    );
    assert_eq!(up.hits(), 2);
}

// --- HTTPS upstreams ---------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_upstream_with_a_private_ca_executes_once_and_replays() {
    let ca = Ca::new("upstream ca");
    let up = HttpsUpstream::start(&ca.leaf(&["127.0.0.1"]), None).await;
    let dir = Dir::new();
    let ca_file = dir.write("ca.pem", &ca.pem());
    let g = gate(&up.url(), &ca_file, |_| ());
    let client = common::client();
    let first = post(&client, &g.url("/pay"), "https-1").await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    let again = post(&client, &g.url("/pay"), "https-1").await;
    assert_eq!(again.status, 201);
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    // Pass-through on the pooled client too.
    let get = client.get(g.url("/status")).send().await.unwrap();
    assert_eq!(get.status(), 201);
    assert_eq!(up.hits(), 2);
    let seen = up.seen();
    // ALPN: the upstream offers h2, and both clients take it.
    assert!(
        seen.iter().all(|s| s.version == Version::HTTP_2),
        "{seen:?}"
    );
    assert!(seen
        .iter()
        .all(|s| s.forwarded_proto.as_deref() == Some("http")));
    assert!(seen.iter().all(|s| !s.client_certificate));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_http2_false_speaks_http1_over_tls() {
    let ca = Ca::new("upstream ca");
    let up = HttpsUpstream::start(&ca.leaf(&["127.0.0.1"]), None).await;
    let dir = Dir::new();
    let ca_file = dir.write("ca.pem", &ca.pem());
    let g = gate(&up.url(), &ca_file, |c| {
        c.upstream_http2 = UpstreamHttp2::Off
    });
    let client = common::client();
    assert_eq!(post(&client, &g.url("/pay"), "h1-1").await.status, 201);
    let get = client.get(g.url("/status")).send().await.unwrap();
    assert_eq!(get.status(), 201);
    let seen = up.seen();
    assert_eq!(seen.len(), 2);
    assert!(
        seen.iter().all(|s| s.version == Version::HTTP_11),
        "{seen:?}"
    );
}

/// A 502 upstream-unreachable whose claim was released: the same key again is not held
/// (no 409 outcome-unknown) but tried again, and fails the same way.
async fn unreachable_and_released(g: &Gate, key: &str) {
    let client = common::client();
    for _ in 0..2 {
        let a = post(&client, &g.url("/pay"), key).await;
        assert_eq!(a.status, 502, "{:?}", a.body);
        assert!(
            a.problem_type().ends_with("/upstream-unreachable"),
            "{:?}",
            a.body
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_requiring_a_client_certificate() {
    let ca = Ca::new("upstream ca");
    let clients = Ca::new("client ca");
    let up = HttpsUpstream::start(&ca.leaf(&["127.0.0.1"]), Some(&clients)).await;
    let dir = Dir::new();
    let ca_file = dir.write("ca.pem", &ca.pem());
    let me = clients.leaf(&["idemgate"]);
    let cert = dir.write("client.pem", &me.cert);
    let key = dir.write("client.key", &me.key);
    let g = gate(&up.url(), &ca_file, |c| {
        c.upstream_tls_cert_file = Some(cert.into());
        c.upstream_tls_key_file = Some(key.into());
    });
    let client = common::client();
    let a = post(&client, &g.url("/pay"), "mtls-1").await;
    assert_eq!(a.status, 201, "{:?}", a.body);
    assert!(up.seen()[0].client_certificate);
    drop(g);

    // Without one: in TLS 1.3 the upstream refuses after idemgate's side of the handshake
    // is done and the request written; its alert still proves nothing was executed.
    // Over h2 and over HTTP/1.1.
    for (http2, key) in [
        (UpstreamHttp2::Offer, "mtls-2"),
        (UpstreamHttp2::Off, "mtls-3"),
    ] {
        let g = gate(&up.url(), &ca_file, |c| c.upstream_http2 = http2);
        unreachable_and_released(&g, key).await;
        assert!(g.log().contains("CertificateRequired"), "{}", g.log());
    }
    assert_eq!(up.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_is_unreachable_and_releases_the_claim() {
    let ca = Ca::new("upstream ca");
    let other = Ca::new("another ca");
    let up = HttpsUpstream::start(&ca.leaf(&["127.0.0.1"]), None).await;
    let dir = Dir::new();
    let wrong = dir.write("other.pem", &other.pem());
    let g = gate(&up.url(), &wrong, |_| ());
    unreachable_and_released(&g, "wrong-ca").await;
    assert_eq!(up.hits(), 0);
    // The reason is in the log: the certificate check that failed.
    let log = g.log();
    assert!(log.contains("releasing the claim"), "{log}");
    assert!(log.contains("UnknownIssuer"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_name_fails_unless_upstream_tls_server_name_names_the_certificate() {
    let ca = Ca::new("upstream ca");
    let up = HttpsUpstream::start(&ca.leaf(&["payments.internal"]), None).await;
    let dir = Dir::new();
    let ca_file = dir.write("ca.pem", &ca.pem());
    let g = gate(&up.url(), &ca_file, |_| ());
    unreachable_and_released(&g, "name-1").await;
    assert!(
        g.log().contains("certificate not valid for name"),
        "{}",
        g.log()
    );
    drop(g);
    let g = gate(&up.url(), &ca_file, |c| {
        c.upstream_tls_server_name = Some("payments.internal".into());
    });
    let client = common::client();
    assert_eq!(post(&client, &g.url("/pay"), "name-2").await.status, 201);
    assert_eq!(up.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_upstream_certificate_is_unreachable() {
    let ca = Ca::new("upstream ca");
    let expired = ca.leaf_with(&["127.0.0.1"], |p| {
        p.not_before = rcgen::date_time_ymd(2020, 1, 1);
        p.not_after = rcgen::date_time_ymd(2021, 1, 1);
    });
    let up = HttpsUpstream::start(&expired, None).await;
    let dir = Dir::new();
    let ca_file = dir.write("ca.pem", &ca.pem());
    let g = gate(&up.url(), &ca_file, |_| ());
    unreachable_and_released(&g, "expired").await;
    assert_eq!(up.hits(), 0);
    assert!(g.log().contains("certificate expired"), "{}", g.log());
}

// --- Start-up --------------------------------------------------------------------------

#[test]
fn bad_tls_files_stop_start_up_naming_the_key() {
    let ca = Ca::new("ca");
    let (a, b) = (ca.leaf(&["127.0.0.1"]), ca.leaf(&["127.0.0.1"]));
    let dir = Dir::new();
    let cert = dir.write("a.pem", &a.cert);
    let other_key = dir.write("b.key", &b.key);
    let ca_file = dir.write("ca.pem", &ca.pem());
    let missing = dir.path("missing.pem");
    let missing = missing.to_str().unwrap();
    let (https, http) = ("https://127.0.0.1:9", "http://127.0.0.1:9");
    let upstream_ca = ("IDEMGATE_UPSTREAM_TLS_CA_FILE", ca_file.as_str());
    let upstream_cert = ("IDEMGATE_UPSTREAM_TLS_CERT_FILE", cert.as_str());
    let upstream_key = ("IDEMGATE_UPSTREAM_TLS_KEY_FILE", other_key.as_str());
    let listener = [
        ("IDEMGATE_TLS_CERT_FILE", cert.as_str()),
        ("IDEMGATE_TLS_KEY_FILE", other_key.as_str()),
    ];
    let client_ca = ("IDEMGATE_TLS_CLIENT_CA_FILE", missing);
    for (upstream, env, key) in [
        (
            https,
            vec![upstream_ca, upstream_cert, upstream_key],
            "upstream_tls_key_file",
        ),
        (
            https,
            vec![upstream_ca, upstream_cert],
            "upstream_tls_key_file",
        ),
        (
            https,
            vec![("IDEMGATE_UPSTREAM_TLS_CA_FILE", missing)],
            "upstream_tls_ca_file",
        ),
        (http, listener.to_vec(), "tls_key_file"),
        (http, [&listener[..], &[client_ca]].concat(), "tls_key_file"),
        (
            http,
            vec![("IDEMGATE_TLS_CLIENT_AUTH", "required")],
            "tls_client_auth",
        ),
    ] {
        let (code, log) = Gate::run_to_exit(upstream, "", &env);
        assert_eq!(code, Some(64), "{env:?}: {log}");
        assert!(log.contains(&format!("`{key}`")), "{env:?}: {log}");
    }
}

// --- The TLS listener ------------------------------------------------------------------

/// A client of the TLS listener that trusts `ca`, over h2 or HTTP/1.1 only, presenting
/// `identity` if given.
fn tls_client(ca: &Ca, h2: bool, identity: Option<&Leaf>) -> reqwest::Client {
    let mut b = reqwest::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(ca.pem().as_bytes()).unwrap())
        .timeout(Duration::from_secs(10));
    if !h2 {
        b = b.http1_only();
    }
    if let Some(id) = identity {
        let pem = format!("{}{}", id.cert, id.key);
        b = b.identity(reqwest::Identity::from_pem(pem.as_bytes()).unwrap());
    }
    b.build().unwrap()
}

/// A route whose tenant is the client certificate's `field`, refusing a client without one.
fn by_certificate(path: &str, field: CertField) -> Route {
    Route {
        path: path.into(),
        tenant_client_cert: Some(field),
        anonymous: Some(Anonymous::Refuse),
        ..Route::default()
    }
}

/// The binary with a TLS listener serving `leaf`, in front of a plain upstream.
struct TlsGate {
    gate: Gate,
    dir: Dir,
    up: Upstream,
}

impl TlsGate {
    /// `set` changes the rest of its settings.
    async fn start(leaf: &Leaf, set: impl FnOnce(&mut Config)) -> TlsGate {
        let up = Upstream::start().await;
        let dir = Dir::new();
        let cert = dir.write("tls.crt", &leaf.cert);
        let key = dir.write("tls.key", &leaf.key);
        let gate = Idemgate::new(&up.url())
            .set(|c| {
                c.tls_cert_file = Some(cert.into());
                c.tls_key_file = Some(key.into());
            })
            .set(set)
            .binary();
        TlsGate { gate, dir, up }
    }

    fn url(&self, path: &str) -> String {
        format!("https://{}{}", self.gate.addr, path)
    }

    /// The certificate that a new connection is shown, DER.
    async fn presented(&self, ca: &Ca) -> Vec<u8> {
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(ca.pem().as_bytes()).unwrap())
            .unwrap();
        let config = rustls::ClientConfig::builder_with_provider(ring())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let tcp = tokio::net::TcpStream::connect(self.gate.addr)
            .await
            .unwrap();
        let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
            .await
            .unwrap();
        tls.get_ref().1.peer_certificates().unwrap()[0].to_vec()
    }

    async fn metric(&self, name: &str) -> u64 {
        self.gate.metric(name) as u64
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tls_listener_serves_http1_and_h2_and_replays_a_retry() {
    let ca = Ca::new("listener ca");
    let g = TlsGate::start(&ca.leaf(&["127.0.0.1"]), |_| ()).await;
    for (h2, key) in [(false, "tls-h1"), (true, "tls-h2")] {
        let client = tls_client(&ca, h2, None);
        let first = post(&client, &g.url("/pay"), key).await;
        assert_eq!(first.status, 201, "{:?}", first.body);
        let again = post(&client, &g.url("/pay"), key).await;
        assert_eq!(again.status, 201);
        assert!(again.replayed(), "{key}");
        assert_eq!(again.body, first.body);
        let res = client.get(g.url("/status")).send().await.unwrap();
        let want = if h2 {
            Version::HTTP_2
        } else {
            Version::HTTP_11
        };
        assert_eq!(res.version(), want);
    }
    // Each key executed once, and the upstream was told the client came over TLS.
    let seen = g.up.seen();
    assert_eq!(seen.iter().filter(|s| s.method == "POST").count(), 2);
    for s in &seen {
        assert_eq!(
            s.headers.get("x-forwarded-proto"),
            Some(&vec!["https".to_string()]),
            "{s:?}"
        );
    }
    // A client that speaks plain HTTP to it gets no answer.
    assert!(common::client()
        .get(g.gate.url("/status"))
        .send()
        .await
        .is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_required_client_certificate_refuses_clients_without_one() {
    let ca = Ca::new("listener ca");
    let clients = Ca::new("client ca");
    let dir = Dir::new();
    let client_ca = dir.write("clients.pem", &clients.pem());
    let g = TlsGate::start(&ca.leaf(&["127.0.0.1"]), |c| {
        c.tls_client_ca_file = Some(client_ca.into());
    })
    .await;
    let me = clients.leaf(&["client"]);
    let with = tls_client(&ca, false, Some(&me));
    assert_eq!(post(&with, &g.url("/pay"), "mtls-in").await.status, 201);
    let without = tls_client(&ca, false, None);
    let refused = without.get(g.url("/status")).send().await;
    assert!(refused.is_err(), "{refused:?}");
    // A certificate from another CA is refused too.
    let stranger = tls_client(&ca, false, Some(&Ca::new("other").leaf(&["client"])));
    assert!(stranger.get(g.url("/status")).send().await.is_err());
    assert_eq!(g.up.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_optional_client_certificate_serves_clients_without_one() {
    let ca = Ca::new("listener ca");
    let clients = Ca::new("client ca");
    let dir = Dir::new();
    let client_ca = dir.write("clients.pem", &clients.pem());
    let g = TlsGate::start(&ca.leaf(&["127.0.0.1"]), |c| {
        c.tls_client_ca_file = Some(client_ca.into());
        c.tls_client_auth = Some(ClientAuth::Optional);
    })
    .await;
    let without = tls_client(&ca, false, None);
    assert_eq!(post(&without, &g.url("/pay"), "opt-1").await.status, 201);
    let with = tls_client(&ca, true, Some(&clients.leaf(&["client"])));
    assert_eq!(post(&with, &g.url("/pay"), "opt-2").await.status, 201);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_finishes_its_handshake_is_cut_at_the_head_deadline() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let ca = Ca::new("listener ca");
    let g = TlsGate::start(&ca.leaf(&["127.0.0.1"]), |c| {
        c.header_read_timeout = Duration::from_millis(300);
    })
    .await;
    // The first bytes of a ClientHello record, and then nothing.
    let mut tcp = tokio::net::TcpStream::connect(g.gate.addr).await.unwrap();
    tcp.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00])
        .await
        .unwrap();
    let started = Instant::now();
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(Duration::from_secs(5), tcp.read(&mut buf)).await;
    assert!(
        matches!(read, Ok(Ok(0)) | Ok(Err(_))),
        "still open: {read:?}"
    );
    assert!(started.elapsed() >= Duration::from_millis(250));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_rotate_under_traffic_and_a_bad_pair_keeps_the_old_one() {
    let ca = Ca::new("listener ca");
    let old = ca.leaf(&["127.0.0.1"]);
    let g = TlsGate::start(&old, |c| {
        c.tls_reload_interval = Duration::from_millis(200);
    })
    .await;
    assert_eq!(g.presented(&ca).await, old.der());
    assert_eq!(g.metric("idemgate_tls_reloads_total").await, 0);

    // Traffic throughout: a keep-alive client (its connection opened before the swap and
    // kept across it) and one that opens a new connection for every request.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let failures = Arc::new(AtomicUsize::new(0));
    let sent = Arc::new(AtomicUsize::new(0));
    let mut loops = Vec::new();
    for fresh in [false, true] {
        let (stop, failures, sent) = (stop.clone(), failures.clone(), sent.clone());
        let url = g.url("/status");
        let pinned = tls_client(&ca, false, None);
        let ca_pem = ca.pem();
        loops.push(tokio::spawn(async move {
            let mut n = 0;
            while !stop.load(Ordering::SeqCst) && n < 2_000 {
                n += 1;
                let client = if fresh {
                    reqwest::Client::builder()
                        .use_rustls_tls()
                        .tls_built_in_root_certs(false)
                        .add_root_certificate(
                            reqwest::Certificate::from_pem(ca_pem.as_bytes()).unwrap(),
                        )
                        .pool_max_idle_per_host(0)
                        .build()
                        .unwrap()
                } else {
                    pinned.clone()
                };
                match client.get(&url).send().await {
                    Ok(r) if r.status() == 201 => {}
                    other => {
                        eprintln!("failed: {other:?}");
                        failures.fetch_add(1, Ordering::SeqCst);
                    }
                }
                sent.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;

    // New content in the same files (a new key too), each file replaced whole.
    let new = ca.leaf(&["127.0.0.1"]);
    g.dir.write("tls.key", &new.key);
    g.dir.write("tls.crt", &new.cert);
    common::until(
        Duration::from_secs(5),
        "the new certificate was not picked up",
        async || g.presented(&ca).await == new.der(),
    )
    .await;
    assert!(g.metric("idemgate_tls_reloads_total").await >= 1);
    tokio::time::sleep(Duration::from_millis(300)).await;

    // A pair that does not belong together: kept out, counted, the new pair stays.
    let failed_before = g.metric("idemgate_tls_reload_failures_total").await;
    let reloads_before = g.metric("idemgate_tls_reloads_total").await;
    let stray = ca.leaf(&["127.0.0.1"]);
    g.dir.write("tls.crt", &stray.cert);
    common::until(
        Duration::from_secs(5),
        "the bad pair was not counted",
        async || g.metric("idemgate_tls_reload_failures_total").await != failed_before,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(g.presented(&ca).await, new.der());
    // Counted once, not on every look.
    assert_eq!(
        g.metric("idemgate_tls_reload_failures_total").await,
        failed_before + 1
    );
    assert_eq!(g.metric("idemgate_tls_reloads_total").await, reloads_before);
    assert!(g.gate.log().contains("TLS certificate not reloaded"));

    stop.store(true, Ordering::SeqCst);
    for l in loops {
        l.await.unwrap();
    }
    assert!(sent.load(Ordering::SeqCst) > 50, "too little traffic");
    assert_eq!(failures.load(Ordering::SeqCst), 0, "requests failed");
}

// --- Client certificates as tenants ----------------------------------------------------

/// A client certificate whose one URI SAN is `uri`, with the given CN.
fn spiffe(ca: &Ca, uri: &str, cn: &str) -> Leaf {
    ca.leaf_with(&[], |p| {
        p.subject_alt_names = vec![rcgen::SanType::URI(uri.try_into().unwrap())];
        p.distinguished_name = rcgen::DistinguishedName::new();
        p.distinguished_name.push(DnType::CommonName, cn);
        p.distinguished_name
            .push(DnType::OrganizationName, "Pay, Inc.");
    })
}

/// `tenant_client_cert`: the verified client certificate's URI SAN (or subject), with the CA
/// that verified it, is the tenant. A renewed certificate (new key pair, same identity, same
/// CA) replays; the same identity from the bundle's other CA, or another identity, is
/// another tenant and executes; no certificate, none or two URI SANs: 400 missing-tenant.
/// `POST /records/lookup` finds a record from the client's certificate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_certificates_name_tenants_together_with_their_ca() {
    let ca = Ca::new("listener ca");
    let (one, two) = (Ca::new("clients one"), Ca::new("clients two"));
    let dir = Dir::new();
    let bundle = dir.write("clients.pem", &format!("{}{}", one.pem(), two.pem()));
    let g = TlsGate::start(&ca.leaf(&["127.0.0.1"]), |c| {
        c.tls_client_ca_file = Some(bundle.into());
        c.tls_client_auth = Some(ClientAuth::Optional);
        c.routes = vec![
            by_certificate("/pay", CertField::SanUri),
            by_certificate("/by-subject", CertField::Subject),
        ];
    })
    .await;
    let as_ = |leaf: &Leaf| tls_client(&ca, true, Some(leaf));
    let m1 = spiffe(&one, "spiffe://pay/merchant-1", "m1");
    let m1_renewed = spiffe(&one, "spiffe://pay/merchant-1", "m1 renewed");
    let m1_from_two = spiffe(&two, "spiffe://pay/merchant-1", "m1");
    let m2 = spiffe(&one, "spiffe://pay/merchant-2", "m1");

    let first = post(&as_(&m1), &g.url("/pay"), "cert-1").await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    let renewed = post(&as_(&m1_renewed), &g.url("/pay"), "cert-1").await;
    assert!(renewed.replayed(), "{} {:?}", renewed.status, renewed.body);
    assert_eq!(renewed.body, first.body);
    for (who, leaf) in [("the other CA's", &m1_from_two), ("another URI", &m2)] {
        let a = post(&as_(leaf), &g.url("/pay"), "cert-1").await;
        assert_eq!(a.status, 201, "{who}: {:?}", a.body);
        assert!(!a.replayed(), "{who} replayed merchant-1's answer");
    }
    assert_eq!(g.up.hits(), 3);

    // No certificate, none or two URI SANs: no tenant, nothing forwarded.
    let no_uri = one.leaf(&["client"]);
    let two_uris = one.leaf_with(&[], |p| {
        p.subject_alt_names = vec![
            rcgen::SanType::URI("spiffe://pay/a".try_into().unwrap()),
            rcgen::SanType::URI("spiffe://pay/b".try_into().unwrap()),
        ];
    });
    let anonymous = tls_client(&ca, true, None);
    for (who, client) in [
        ("no certificate", anonymous),
        ("no URI SAN", as_(&no_uri)),
        ("two URI SANs", as_(&two_uris)),
    ] {
        let a = post(&client, &g.url("/pay"), "cert-2").await;
        assert_eq!(a.status, 400, "{who}: {:?}", a.body);
        assert!(
            a.problem_type().ends_with("/missing-tenant"),
            "{who}: {:?}",
            a.body
        );
    }
    assert_eq!(g.up.hits(), 3);

    // The subject (RFC 4514), with its CA: the same subject from the other CA is another
    // tenant, from the same CA the same one.
    let s1 = post(&as_(&m1), &g.url("/by-subject"), "subject-1").await;
    assert_eq!(s1.status, 201, "{:?}", s1.body);
    let again = post(&as_(&m2), &g.url("/by-subject"), "subject-1").await;
    assert!(again.replayed(), "same subject, same CA: {:?}", again.body);
    let other = post(&as_(&m1_from_two), &g.url("/by-subject"), "subject-1").await;
    assert!(!other.replayed() && other.status == 201, "{:?}", other.body);
    assert_eq!(g.up.hits(), 5);

    // The operator finds merchant-1's record from its certificate, and not from another's.
    let lookup = |leaf: &Leaf| {
        serde_json::json!({"method": "POST", "path": "/pay", "key": "cert-1",
            "client_certificate": leaf.cert})
    };
    let c = common::client();
    let found: serde_json::Value = c
        .post(g.gate.admin_url("/records/lookup"))
        .json(&lookup(&m1_renewed))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(found["state"], "completed", "{found}");
    let stranger = Ca::new("stranger");
    let refused = c
        .post(g.gate.admin_url("/records/lookup"))
        .json(&lookup(&spiffe(&stranger, "spiffe://pay/merchant-1", "m1")))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 400);
    let text = refused.text().await.unwrap();
    assert!(text.contains("no CA of tls_client_ca_file"), "{text}");
}

/// `tenant_client_cert = "subject"` with a root and its intermediate in the bundle, in
/// either order: a leaf of the intermediate is the intermediate's, whether the client sends
/// its chain or not, and its CN is its text whatever the string type (a renewal that
/// re-encodes a BMPString CN as UTF8String replays; another CN in the same type is another
/// tenant).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subject_is_its_text_and_its_ca_the_closest_whatever_the_chain_and_the_order() {
    use rcgen::DnValue;
    let ca = Ca::new("listener ca");
    let root = Ca::new("clients root");
    let inter = root.intermediate("clients intermediate");
    let leaf = |cn: DnValue| {
        inter.leaf_with(&[], |p| {
            p.distinguished_name = rcgen::DistinguishedName::new();
            p.distinguished_name.push(DnType::CommonName, cn);
        })
    };
    let bmp = |s: &str| DnValue::BmpString(s.try_into().unwrap());
    let m1_bmp = leaf(bmp("merchant-1"));
    let m1_utf8 = leaf(DnValue::Utf8String("merchant-1".into()));
    let m1_universal = leaf(DnValue::UniversalString("merchant-1".try_into().unwrap()));
    let m1_t61 = leaf(DnValue::TeletexString("merchant-1".try_into().unwrap()));
    let m2_bmp = leaf(bmp("merchant-2"));
    // The leaf with its chain (the intermediate after it), as most clients send it.
    let chained = |l: &Leaf| Leaf {
        cert: format!("{}{}", l.cert, inter.pem()),
        key: l.key.clone(),
    };
    for (n, bundle) in [
        format!("{}{}", root.pem(), inter.pem()),
        format!("{}{}", inter.pem(), root.pem()),
    ]
    .iter()
    .enumerate()
    {
        let dir = Dir::new();
        let file = dir.write("clients.pem", bundle);
        let g = TlsGate::start(&ca.leaf(&["127.0.0.1"]), |c| {
            c.tls_client_ca_file = Some(file.into());
            c.tls_client_auth = Some(ClientAuth::Optional);
            c.routes = vec![by_certificate("/pay", CertField::Subject)];
        })
        .await;
        let as_ = |l: &Leaf| tls_client(&ca, false, Some(l));
        let key = format!("order-{n}");
        let first = post(&as_(&m1_bmp), &g.url("/pay"), &key).await;
        assert_eq!(first.status, 201, "{n}: {:?}", first.body);
        for (who, l) in [
            ("with its chain", chained(&m1_bmp)),
            ("re-encoded as UTF8String", m1_utf8.clone()),
            ("as UniversalString", m1_universal.clone()),
            ("as T61String", m1_t61.clone()),
            ("re-encoded, with its chain", chained(&m1_utf8)),
        ] {
            let again = post(&as_(&l), &g.url("/pay"), &key).await;
            assert!(
                again.replayed(),
                "bundle {n}, {who}: {} {:?}",
                again.status,
                again.body
            );
            assert_eq!(again.body, first.body, "bundle {n}, {who}");
        }
        assert_eq!(g.up.hits(), 1, "bundle {n}");
        let other = post(&as_(&m2_bmp), &g.url("/pay"), &key).await;
        assert_eq!(other.status, 201, "bundle {n}: {:?}", other.body);
        assert!(
            !other.replayed(),
            "bundle {n}: merchant-2 got merchant-1's answer"
        );
        let retry = post(&as_(&chained(&m2_bmp)), &g.url("/pay"), &key).await;
        assert!(retry.replayed(), "bundle {n}: {:?}", retry.body);
        assert_eq!(
            retry.body, other.body,
            "bundle {n}: merchant-2's own answer"
        );
        assert_eq!(g.up.hits(), 2, "bundle {n}");
    }
}

/// One principal source per route, and certificates need a listener that verifies them:
/// exit 64 naming the key.
#[test]
fn tenant_client_cert_needs_a_client_ca_and_is_a_route_s_only_source() {
    let ca = Ca::new("listener ca");
    let leaf = ca.leaf(&["127.0.0.1"]);
    let dir = Dir::new();
    let cert = dir.write("tls.crt", &leaf.cert);
    let key = dir.write("tls.key", &leaf.key);
    let clients = dir.write("clients.pem", &Ca::new("clients").pem());
    let listener = [
        ("IDEMGATE_TLS_CERT_FILE", cert.as_str()),
        ("IDEMGATE_TLS_KEY_FILE", key.as_str()),
    ];
    let with_ca: Vec<(&str, &str)> = listener
        .iter()
        .copied()
        .chain([("IDEMGATE_TLS_CLIENT_CA_FILE", clients.as_str())])
        .collect();
    let cases: Vec<(Vec<(&str, &str)>, &str)> = vec![
        (
            vec![("IDEMGATE_DEFAULTS__TENANT_CLIENT_CERT", "san_uri")],
            "defaults.tenant_client_cert",
        ),
        (
            listener
                .iter()
                .copied()
                .chain([("IDEMGATE_DEFAULTS__TENANT_CLIENT_CERT", "subject")])
                .collect(),
            "defaults.tenant_client_cert",
        ),
        (
            with_ca
                .iter()
                .copied()
                .chain([(
                    "IDEMGATE_ROUTES",
                    r#"[{path="/pay", tenant_client_cert="san_uri", tenant_headers=["x-account"]}]"#,
                )])
                .collect(),
            "routes[0].tenant_client_cert",
        ),
        (
            with_ca
                .iter()
                .copied()
                .chain([("IDEMGATE_DEFAULTS__TENANT_CLIENT_CERT", "uri")])
                .collect(),
            "tenant_client_cert",
        ),
    ];
    for (env, key) in cases {
        let (code, stderr) = Gate::run_to_exit("http://127.0.0.1:9", "", &env);
        assert_eq!(code, Some(64), "{env:?}: {stderr}");
        assert!(stderr.contains(key), "{env:?}: wants {key}: {stderr}");
    }
}

/// New keys to an HTTPS upstream, each on a fresh TLS connection (h2 by ALPN, and
/// HTTP/1.1), leave no socket in TIME_WAIT on either side, as over plain HTTP: at 10,000
/// new keys a second a side that entered it would hold the ports towards the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_keys_over_tls_leave_no_time_wait() {
    let ca = Ca::new("upstream ca");
    for (http2, name) in [
        (UpstreamHttp2::Offer, "true"),
        (UpstreamHttp2::Off, "false"),
    ] {
        let up = HttpsUpstream::start(&ca.leaf(&["127.0.0.1"]), None).await;
        let time_wait = common::TimeWait::from_now(up.addr.port());
        let dir = Dir::new();
        let ca_file = dir.write("ca.pem", &ca.pem());
        let g = gate(&up.url(), &ca_file, |c| c.upstream_http2 = http2);
        let client = common::client();
        const KEYS: usize = 200;
        for i in 0..KEYS {
            let a = post(&client, &g.url("/pay"), &format!("tw-{name}-{i}")).await;
            assert_eq!(a.status, 201, "{:?}", a.body);
        }
        assert_eq!(up.hits(), KEYS);
        let waiting = time_wait.new_since();
        assert!(
            waiting.len() < KEYS / 100,
            "upstream_http2 = {name}: {} sockets in TIME_WAIT after {KEYS} new keys: {waiting:?}",
            waiting.len()
        );
    }
}

/// `idemgate config check` with only `env` of the IDEMGATE_ variables: its exit code and
/// stderr.
fn config_check(env: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_idemgate"));
    cmd.args(["config", "check"]);
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("IDEMGATE_")) {
        cmd.env_remove(k);
    }
    let out = cmd.envs(env.iter().copied()).output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Certificates are checked as their peer will check them, by `config check` and start-up
/// alike, naming the key and the file: an expired or not yet valid leaf, one whose
/// extended key usage does not allow its role, and an X.509 version 1 client certificate
/// (which Redis's TLS would otherwise fail later as "invalid peer certificate").
#[test]
fn certificates_a_peer_would_refuse_fail_the_check_naming_the_file() {
    let ca = Ca::new("ca");
    let dir = Dir::new();
    let expired = ca.leaf_with(&["127.0.0.1"], |p| {
        p.not_before = rcgen::date_time_ymd(2020, 1, 1);
        p.not_after = rcgen::date_time_ymd(2021, 1, 1);
    });
    let early = ca.leaf_with(&["127.0.0.1"], |p| {
        p.not_before = rcgen::date_time_ymd(2090, 1, 1);
        p.not_after = rcgen::date_time_ymd(2091, 1, 1);
    });
    let client_only = ca.leaf_with(&["127.0.0.1"], |p| {
        p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    });
    for (name, leaf, says) in [
        ("expired", &expired, "expired on"),
        ("early", &early, "not valid before"),
        ("client-only", &client_only, "serverAuth"),
    ] {
        let cert = dir.write(&format!("{name}.pem"), &leaf.cert);
        let key = dir.write(&format!("{name}.key"), &leaf.key);
        let env = [
            ("IDEMGATE_TLS_CERT_FILE", cert.as_str()),
            ("IDEMGATE_TLS_KEY_FILE", key.as_str()),
        ];
        let (code, err) = config_check(&env);
        assert_eq!(code, Some(64), "{name}: {err}");
        assert!(
            err.contains("`tls_cert_file`") && err.contains(&cert) && err.contains(says),
            "{name}: {err}"
        );
        // Start-up refuses it the same way.
        let (code, log) = Gate::run_to_exit("http://127.0.0.1:9", "", &env);
        assert_eq!(code, Some(64), "{name}: {log}");
        assert!(log.contains(says), "{name}: {log}");
    }

    // An X.509 v1 certificate, as `openssl x509 -req` makes without an extension file.
    let key = dir.path("v1.key");
    let csr = dir.path("v1.csr");
    let cert = dir.path("v1.pem");
    let sh = |args: &[&str]| {
        let out = std::process::Command::new("openssl")
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let p = |p: &std::path::Path| p.to_str().unwrap().to_string();
    sh(&[
        "ecparam",
        "-name",
        "prime256v1",
        "-genkey",
        "-noout",
        "-out",
        &p(&key),
    ]);
    sh(&[
        "req",
        "-new",
        "-key",
        &p(&key),
        "-subj",
        "/CN=idemgate",
        "-out",
        &p(&csr),
    ]);
    sh(&[
        "x509",
        "-req",
        "-in",
        &p(&csr),
        "-signkey",
        &p(&key),
        "-days",
        "30",
        "-out",
        &p(&cert),
    ]);
    let (code, err) = config_check(&[
        ("IDEMGATE_NAMESPACE", "payments"),
        ("IDEMGATE_REDIS_URL", "rediss://127.0.0.1:1/0"),
        ("IDEMGATE_REDIS_TLS_CERT_FILE", &p(&cert)),
        ("IDEMGATE_REDIS_TLS_KEY_FILE", &p(&key)),
    ]);
    assert_eq!(code, Some(64), "{err}");
    assert!(
        err.contains("`redis_tls_cert_file`")
            && err.contains(&p(&cert))
            && err.contains("X.509 version 1"),
        "{err}"
    );
    // A good pair passes.
    let good = ca.leaf(&["127.0.0.1"]);
    let cert = dir.write("good.pem", &good.cert);
    let key = dir.write("good.key", &good.key);
    let (code, err) = config_check(&[
        ("IDEMGATE_TLS_CERT_FILE", cert.as_str()),
        ("IDEMGATE_TLS_KEY_FILE", key.as_str()),
    ]);
    assert_eq!(code, Some(0), "{err}");
}

/// A rotated pair whose leaf is not valid now (expired, or not yet valid) is refused as a
/// failed reload: counted, logged, the pair in use kept. The listener's certificate expiry
/// is exported, and follows the reloads that land.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reloaded_pair_that_is_not_valid_now_is_refused_and_expiry_is_exported() {
    let ca = Ca::new("listener ca");
    let until = |year: i32| {
        move |p: &mut rcgen::CertificateParams| {
            p.not_before = rcgen::date_time_ymd(2020, 1, 1);
            p.not_after = rcgen::date_time_ymd(year, 1, 1);
        }
    };
    let old = ca.leaf_with(&["127.0.0.1"], until(2090));
    let g = TlsGate::start(&old, |c| {
        c.tls_reload_interval = Duration::from_millis(100);
    })
    .await;
    let expiry = "idemgate_tls_certificate_expiry_seconds{certificate=\"listener\"}";
    // 2090-01-01T00:00:00Z.
    assert_eq!(g.metric(expiry).await, 3_786_912_000);

    let expired = ca.leaf_with(&["127.0.0.1"], until(2021));
    let early = ca.leaf_with(&["127.0.0.1"], |p| {
        p.not_before = rcgen::date_time_ymd(2089, 1, 1);
        p.not_after = rcgen::date_time_ymd(2095, 1, 1);
    });
    for (n, bad) in [expired, early].iter().enumerate() {
        let failed = g.metric("idemgate_tls_reload_failures_total").await;
        g.dir.write("tls.key", &bad.key);
        g.dir.write("tls.crt", &bad.cert);
        let failures = "idemgate_tls_reload_failures_total";
        common::until(
            Duration::from_secs(5),
            &format!("pair {n} to be counted as a failure"),
            async || g.metric(failures).await != failed,
        )
        .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(g.presented(&ca).await, old.der(), "pair {n} was swapped in");
        assert_eq!(g.metric("idemgate_tls_reloads_total").await, 0);
        assert_eq!(g.metric(expiry).await, 3_786_912_000);
    }
    let log = g.gate.log();
    assert!(log.contains("expired on"), "{log}");
    assert!(log.contains("not valid before"), "{log}");

    // A good one lands, and the gauge follows it (2091-01-01).
    let new = ca.leaf_with(&["127.0.0.1"], until(2091));
    g.dir.write("tls.key", &new.key);
    g.dir.write("tls.crt", &new.cert);
    common::until(
        Duration::from_secs(5),
        "the good pair was not picked up",
        async || g.presented(&ca).await == new.der(),
    )
    .await;
    assert_eq!(g.metric("idemgate_tls_reloads_total").await, 1);
    assert_eq!(g.metric(expiry).await, 3_818_448_000);
}
