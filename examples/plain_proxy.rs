//! The floor of `bench/run`: the plainest hyper reverse proxy (hyper-util's server and pooled
//! client, the request forwarded as it came, no header rewriting, no timeouts, no metrics).
//! Measured in the same run as idemgate's pass-through, it shows how much of a proxy hop
//! is hyper and the kernel, and how much is idemgate.
//!
//! ```sh
//! cargo run --release --example plain_proxy -- 127.0.0.1:8081 127.0.0.1:9000
//! ```

use std::convert::Infallible;
use std::net::SocketAddr;

use http_body_util::combinators::BoxBody;
use http_body_util::BodyExt;
use hyper::body::{Bytes, Incoming};
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;

type Body = BoxBody<Bytes, hyper::Error>;

fn arg(n: usize, default: &str) -> std::io::Result<SocketAddr> {
    std::env::args()
        .nth(n)
        .unwrap_or_else(|| default.into())
        .parse()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let listen = arg(1, "127.0.0.1:8081")?;
    let upstream = arg(2, "127.0.0.1:9000")?;
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<HttpConnector, Incoming> =
        Client::builder(TokioExecutor::new()).build(connector);
    let listener = tokio::net::TcpListener::bind(listen).await?;
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        let client = client.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |mut req: Request<Incoming>| {
                let client = client.clone();
                async move {
                    let pq = req.uri().path_and_query().map_or("/", |p| p.as_str());
                    if let Ok(uri) = format!("http://{upstream}{pq}").parse::<Uri>() {
                        *req.uri_mut() = uri;
                    }
                    let res: Response<Body> = match client.request(req).await {
                        Ok(res) => res.map(|b| b.boxed()),
                        Err(_) => {
                            let mut r = Response::new(
                                http_body_util::Empty::new().map_err(|e| match e {}).boxed(),
                            );
                            *r.status_mut() = StatusCode::BAD_GATEWAY;
                            r
                        }
                    };
                    Ok::<_, Infallible>(res)
                }
            });
            let _ = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}
