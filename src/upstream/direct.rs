//! Protected requests to an `http://` upstream that may speak HTTP/1.1: a fresh TCP
//! connection each, with hyper's HTTP/1.1 handshake made on it directly.
//!
//! The rule is [`super::fresh_client`]'s, unchanged: the connection is opened for the
//! request, carries it and its answer only, and is closed by a reset once the answer is
//! read ([`super::FreshConnection`], the same I/O as there). What is left out is what a
//! connection that is never pooled pays for nothing in hyper-util's pooled client: the
//! pool's checkout and bookkeeping (with `pool_max_idle_per_host(0)` still a lazy connect
//! future, a pool key, a `Pooled` wrapper), the connector stack (`HttpConnector` through
//! the TLS connector's plain-HTTP branch and the deadline's boxed future), the connection
//! info (`getsockname` and `getpeername` on every connect, for an `HttpInfo` nobody reads)
//! and the client's retry loop, which never retries on a fresh connection anyway. Over TLS,
//! and to an upstream known to be h2, the clients of [`super::Link::pair`] stay as they are.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::header::{HeaderValue, HOST};
use hyper::http::uri::Authority;
use hyper::{Request, Response, Uri};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::{FreshConnection, SendError};
use crate::body::Body;

/// Where protected requests go, and the `Host` they carry there.
#[derive(Clone)]
pub struct Direct {
    /// The upstream's address when its host is an IP literal (no resolver on the way).
    addr: Option<SocketAddr>,
    /// `host:port` for the resolver otherwise.
    name: String,
    /// As hyper-util's client writes it: the host, and the port unless it is 80.
    host: HeaderValue,
    connect_timeout: Duration,
}

impl Direct {
    /// The connector for an `http://` upstream at `authority`.
    pub fn new(authority: &Authority, connect_timeout: Duration) -> Direct {
        let port = authority.port_u16().unwrap_or(80);
        // `[::1]` in a URI, `::1` as an address.
        let bare = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        let addr = bare
            .parse::<std::net::IpAddr>()
            .ok()
            .map(|ip| SocketAddr::new(ip, port));
        let host = match authority.port_u16() {
            Some(p) if p != 80 => HeaderValue::from_str(&format!("{}:{p}", authority.host())),
            _ => HeaderValue::from_str(authority.host()),
        };
        Direct {
            addr,
            name: format!("{}:{port}", authority.host()),
            // An authority's host is a valid header value (the URI parser allows no less).
            host: host.unwrap_or_else(|_| HeaderValue::from_static("localhost")),
            connect_timeout,
        }
    }

    /// Sends `req` (already [`super::prepare`]d: an absolute URI on the upstream) on a
    /// connection of its own.
    ///
    /// Failures: connecting (refused, unresolvable, past the connect timeout) is
    /// [`SendError::Connect`], not sent; hyper's errors on the connection are
    /// [`SendError::Exchange`], which [`super::classify`] reads as it reads them under
    /// hyper-util's client: not sent only when hyper handed the request back unwritten.
    pub fn request(
        &self,
        mut req: Request<Body>,
    ) -> impl Future<Output = Result<Response<Incoming>, SendError>> + Send + 'static {
        req.headers_mut()
            .entry(HOST)
            .or_insert_with(|| self.host.clone());
        // Origin form, as hyper-util's client writes it on HTTP/1.1.
        let mut parts = hyper::http::uri::Parts::default();
        parts.path_and_query = req.uri().path_and_query().cloned();
        *req.uri_mut() = Uri::from_parts(parts).unwrap_or_default();
        let (addr, name, timeout) = (self.addr, self.name.clone(), self.connect_timeout);
        async move {
            let io = connect(addr, &name, timeout)
                .await
                .map_err(SendError::Connect)?;
            let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
                .await
                .map_err(SendError::Exchange)?;
            // Runs until the answer is read (the request says `Connection: close`), then
            // drops the socket: the reset.
            tokio::spawn(async move {
                if let Err(e) = conn.await {
                    tracing::debug!(error = %e, "upstream connection ended with an error");
                }
            });
            sender.send_request(req).await.map_err(SendError::Exchange)
        }
    }
}

/// A connected socket for one request: no delay, and a zero linger so that its close is a
/// reset (see [`super::fresh_client`]).
async fn connect(
    addr: Option<SocketAddr>,
    name: &str,
    timeout: Duration,
) -> io::Result<FreshConnection> {
    let connecting = async {
        match addr {
            Some(addr) => TcpStream::connect(addr).await,
            None => TcpStream::connect(name).await,
        }
    };
    let stream = tokio::time::timeout(timeout, connecting)
        .await
        .map_err(|_| {
            io::Error::new(
                io::ErrorKind::TimedOut,
                format!("connecting took longer than {timeout:?}"),
            )
        })??;
    stream.set_nodelay(true)?;
    stream.set_zero_linger()?;
    Ok(FreshConnection(TokioIo::new(stream)))
}
