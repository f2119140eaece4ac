//! The upstream of `bench/run`: answers every request with 201 and a small JSON body, at
//! once. `idemgate bank` sleeps and keeps a ledger, so it would measure itself, not
//! idemgate; this one costs as little as a hyper server can, so the figures show idemgate's
//! overhead over one upstream hop.
//!
//! ```sh
//! cargo run --release --example bench_upstream -- 127.0.0.1:9000
//! BENCH_UPSTREAM_DELAY_MS=20 cargo run --release --example bench_upstream  # a 20 ms upstream
//! ```

use std::convert::Infallible;
use std::net::SocketAddr;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;

const BODY: &[u8] = br#"{"id":"tr_1","status":"accepted","amount":1250,"currency":"EUR"}"#;

async fn answer(req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
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
    let listener = tokio::net::TcpListener::bind(addr).await?;
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        tokio::spawn(async move {
            let _ = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service_fn(answer))
                .await;
        });
    }
}
