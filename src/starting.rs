//! While the store is being opened (connecting, the start-up checks, and on a store without a
//! scope secret the wait of `scope_secret_create_delay` for running instances to put theirs
//! back), the listeners are already bound: they answer at once rather than hold connections
//! that a probe or a client then gives up on. `/healthz` says the process is up; `/readyz`
//! says what start-up waits for; every other request gets `503 store-unavailable` with a
//! `Retry-After` of the time left. Once the store is open, these connections are closed
//! after their answer and the real service takes the listeners over.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONNECTION, CONTENT_TYPE, RETRY_AFTER};
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use crate::body::{self, Body};
use crate::problem::Problem;

/// What start-up is doing, shared by the store's opening (which reports a wait) and the
/// answers given meanwhile.
#[derive(Debug, Default)]
pub struct Starting {
    wait: Mutex<Option<Instant>>,
}

impl Starting {
    /// A start-up that is opening the store.
    pub fn new() -> Arc<Starting> {
        Arc::new(Starting::default())
    }

    /// Start-up waits until `until` (`scope_secret_create_delay`) before making the store's
    /// scope secret.
    pub fn waiting_until(&self, until: Instant) {
        if let Ok(mut w) = self.wait.lock() {
            *w = Some(until);
        }
    }

    /// The wait's time left, while there is one.
    fn left(&self) -> Option<Duration> {
        let until = (*self.wait.lock().ok()?)?;
        Some(until.saturating_duration_since(Instant::now()))
    }

    /// What start-up waits for, and how long for at most (whole seconds, at least 1).
    fn what(&self) -> (String, u64) {
        match self.left() {
            Some(left) => (
                format!(
                    "idemgate is starting: the store holds no scope secret, and this instance waits another {:.1} s (scope_secret_create_delay) for running instances to put theirs back before it makes one; pin the secret (scope_secret_file, IDEMGATE_SCOPE_SECRET) or set scope_secret_create_delay = \"0s\" for a single instance to skip the wait",
                    left.as_secs_f64()
                ),
                left.as_secs_f64().ceil().max(1.0) as u64,
            ),
            None => (
                "idemgate is starting: opening the store".to_string(),
                1,
            ),
        }
    }
}

/// Which listener a connection came in on.
#[derive(Clone, Copy)]
enum Side {
    Proxy,
    Admin,
}

/// Runs `opening` to its end, answering on `proxy` and `admin` meanwhile as the module says.
/// With `tls`, the proxy listener's connections are TLS as they will be afterwards.
pub async fn answering_while<T>(
    proxy: &TcpListener,
    admin: Option<&TcpListener>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    header_timeout: Duration,
    starting: &Arc<Starting>,
    opening: impl Future<Output = T>,
) -> T {
    let mut connections = JoinSet::new();
    tokio::pin!(opening);
    loop {
        tokio::select! {
            biased;
            out = &mut opening => {
                // Connections still being answered get their answer (`Connection: close`);
                // a silent one is not waited for.
                let drain = async { while connections.join_next().await.is_some() {} };
                let _ = tokio::time::timeout(Duration::from_millis(200), drain).await;
                connections.abort_all();
                return out;
            }
            accepted = proxy.accept() => {
                if let Ok((stream, _)) = accepted {
                    let tls = tls.clone();
                    let starting = starting.clone();
                    connections.spawn(async move {
                        match tls {
                            None => answer(stream, Side::Proxy, starting, header_timeout).await,
                            Some(acceptor) => {
                                let handshake = tokio::time::timeout(header_timeout, acceptor.accept(stream)).await;
                                if let Ok(Ok(s)) = handshake {
                                    answer(s, Side::Proxy, starting, header_timeout).await;
                                }
                            }
                        }
                    });
                }
            }
            // `accept` is cancel-safe: a connection is never lost to the other branches.
            accepted = accept(admin) => {
                if let Ok((stream, _)) = accepted {
                    let starting = starting.clone();
                    connections.spawn(answer::<TcpStream>(stream, Side::Admin, starting, header_timeout));
                }
            }
        }
    }
}

async fn accept(l: Option<&TcpListener>) -> std::io::Result<(TcpStream, std::net::SocketAddr)> {
    match l {
        Some(l) => l.accept().await,
        None => std::future::pending().await,
    }
}

/// One connection, HTTP/1.1 without keep-alive: one answer, then closed.
async fn answer<S>(stream: S, side: Side, starting: Arc<Starting>, header_timeout: Duration)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = service_fn(move |req: Request<Incoming>| {
        let res = respond(&req, side, &starting);
        async move { Ok::<_, std::convert::Infallible>(res) }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .keep_alive(false)
        .serve_connection(TokioIo::new(stream), service)
        .await;
}

fn respond(req: &Request<Incoming>, side: Side, starting: &Starting) -> Response<Body> {
    let (what, retry_after) = starting.what();
    let mut res = match (side, req.uri().path()) {
        (Side::Admin, "/healthz") => text(StatusCode::OK, "ok\n".to_string()),
        (Side::Admin, "/readyz") => text(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {what}\n"),
        ),
        (Side::Admin, _) => text(StatusCode::SERVICE_UNAVAILABLE, format!("{what}\n")),
        (Side::Proxy, _) => Problem::StoreUnavailable.response(what, None, Some(retry_after)),
    };
    let unavailable = res.status() == StatusCode::SERVICE_UNAVAILABLE;
    let h = res.headers_mut();
    if unavailable {
        h.insert(RETRY_AFTER, HeaderValue::from(retry_after));
    }
    h.insert(CONNECTION, HeaderValue::from_static("close"));
    res
}

fn text(status: StatusCode, s: String) -> Response<Body> {
    let mut res = Response::new(body::full(s));
    *res.status_mut() = status;
    res.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    res
}
