//! The upstream of `bench/run`: answers every request with 201 and a small JSON body, at
//! once. `idemgate bank` sleeps and keeps a ledger, so it would measure itself, not
//! idemgate; this one costs as little as a hyper server can, so the figures show idemgate's
//! overhead over one upstream hop.
//!
//! ```sh
//! cargo run --release --example bench_upstream -- 127.0.0.1:9000
//! BENCH_UPSTREAM_DELAY_MS=20 cargo run --release --example bench_upstream  # a 20 ms upstream
//! BENCH_UPSTREAM_TLS_DIR=/tmp/up cargo run --release --example bench_upstream  # HTTPS
//! ```
//!
//! `GET /__accepted` answers how many connections it has accepted so far (that request's
//! own included), for `bench/measure.py` to count an idemgate's upstream connections.
//!
//! With `BENCH_UPSTREAM_TLS_DIR` it speaks TLS (ALPN h2 and http/1.1) with a certificate
//! for 127.0.0.1 made at start by a CA of its own, whose certificate it writes to `ca.pem`
//! in that directory for idemgate's `upstream_tls_ca_file`; the certificate and its key go
//! to `server.pem` and `server.key` there too, for an idemgate TLS listener to serve.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;

const BODY: &[u8] = br#"{"id":"tr_1","status":"accepted","amount":1250,"currency":"EUR"}"#;

/// Connections accepted so far.
static ACCEPTED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

async fn answer(req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    if req.uri().path() == "/__accepted" {
        let n = ACCEPTED.load(std::sync::atomic::Ordering::Relaxed);
        return Ok(Response::new(Full::new(Bytes::from(n.to_string()))));
    }
    // Read the request body, as a real API would, before answering.
    let _ = req.into_body().collect().await;
    let delay = delay();
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let res = Response::builder()
        .status(201)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(BODY)));
    Ok(res.unwrap_or_else(|_| Response::new(Full::new(Bytes::new()))))
}

/// How long each answer takes (`BENCH_UPSTREAM_DELAY_MS`, 0 by default).
fn delay() -> std::time::Duration {
    static DELAY: std::sync::OnceLock<std::time::Duration> = std::sync::OnceLock::new();
    *DELAY.get_or_init(|| {
        let ms = std::env::var("BENCH_UPSTREAM_DELAY_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        std::time::Duration::from_millis(ms)
    })
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let addr: SocketAddr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:9000".into())
        .parse()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let tls = match std::env::var_os("BENCH_UPSTREAM_TLS_DIR") {
        Some(dir) => Some(acceptor(std::path::Path::new(&dir))?),
        None => None,
    };
    let listener = tokio::net::TcpListener::bind(addr).await?;
    loop {
        let (stream, _) = listener.accept().await?;
        ACCEPTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let _ = stream.set_nodelay(true);
        let tls = tls.clone();
        tokio::spawn(async move {
            let serve = auto::Builder::new(TokioExecutor::new());
            let _ = match tls {
                None => {
                    serve
                        .serve_connection(TokioIo::new(stream), service_fn(answer))
                        .await
                }
                Some(tls) => match tls.accept(stream).await {
                    Ok(stream) => {
                        serve
                            .serve_connection(TokioIo::new(stream), service_fn(answer))
                            .await
                    }
                    Err(_) => return,
                },
            };
        });
    }
}

/// A CA and a certificate for 127.0.0.1 signed by it; the CA's certificate is written to
/// `dir/ca.pem`.
fn acceptor(dir: &std::path::Path) -> std::io::Result<tokio_rustls::TlsAcceptor> {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
    let err = |e: rcgen::Error| std::io::Error::other(e.to_string());
    let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(err)?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().map_err(err)?).map_err(err)?;
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("ca.pem"), ca.pem())?;
    let key = KeyPair::generate().map_err(err)?;
    let leaf = CertificateParams::new(vec!["127.0.0.1".to_string()])
        .map_err(err)?
        .signed_by(&key, &ca)
        .map_err(err)?;
    std::fs::write(dir.join("server.pem"), leaf.pem())?;
    std::fs::write(dir.join("server.key"), key.serialize_pem())?;
    let chain = vec![CertificateDer::from(leaf.der().to_vec())];
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .and_then(|b| b.with_no_client_auth().with_single_cert(chain, key))
        .map_err(std::io::Error::other)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}
