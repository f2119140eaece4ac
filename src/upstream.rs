//! The client side: a pooled client to the upstream for pass-through, a fresh connection
//! for each protected request (made directly to an `http://` upstream, [`Direct`]; through
//! a client that never pools over TLS to an `https://` one, HTTP/1.1 or h2 where the
//! upstream picks it by ALPN); one pooled h2-only client for both to an upstream known to
//! speak h2 ([`h2_client`]); how requests are rewritten on
//! their way there (hop-by-hop headers out, `X-Forwarded-*` in), and how a failure is
//! classified, because that decides between "release the claim" and "hold it as unknown".

use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::Incoming;
use hyper::header::{
    HeaderMap, HeaderName, HeaderValue, CONNECTION, COOKIE, HOST, PROXY_AUTHORIZATION, TE, TRAILER,
    TRANSFER_ENCODING, UPGRADE,
};
use hyper::http::uri::PathAndQuery;
use hyper::{Request, Response, Uri, Version};
use hyper_rustls::{FixedServerNameResolver, HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpStream;

use crate::body::{Body, BoxError};
use crate::config::Upstream;
use crate::tls::UpstreamTls;

mod accepted;
mod direct;
pub mod framing;
mod h2_only;

pub use accepted::Accepted;
pub use direct::Direct;
pub use h2_only::{h2_client, H2Client};

/// How requests reach the upstream: one of the clients below, by which protocol it speaks.
#[derive(Clone)]
pub enum Link {
    /// Pass-through to an upstream that may speak HTTP/1.1: pooled ([`client`]).
    Pooled(UpstreamClient),
    /// Protected requests to an `https://` upstream that may speak HTTP/1.1: a fresh
    /// connection each ([`fresh_client`]).
    Fresh(FreshClient),
    /// Protected requests to an `http://` upstream that may speak HTTP/1.1: the same rule,
    /// the connection made and handshaken directly ([`Direct`]).
    Direct(Direct),
    /// Everything to an upstream known to speak h2 (`upstream_http2 = "prior_knowledge"`):
    /// streams on pooled h2 connections ([`h2_client`]).
    H2(H2Client),
}

impl Link {
    /// Sends `req` on this link's client.
    pub fn request(&self, req: Request<Body>) -> Sending {
        match self {
            Link::Pooled(c) => Sending::Client(c.request(req)),
            Link::Fresh(c) => Sending::Client(c.request(req)),
            Link::Direct(d) => Sending::Direct(Box::pin(d.request(req))),
            Link::H2(c) => Sending::Client(c.request(req)),
        }
    }

    /// Whether each request has a connection of its own ([`close_after`] applies).
    pub fn fresh(&self) -> bool {
        matches!(self, Link::Fresh(_) | Link::Direct(_))
    }

    /// The links for pass-through and for protected requests. An upstream known to be h2
    /// gets one h2 client for both (one pool: the two kinds of request share its
    /// connections); any other keeps the pooled client for pass-through and a fresh
    /// connection per protected request: [`Direct`] to an `http://` upstream (`tls` is
    /// `None`), [`fresh_client`] over TLS.
    pub fn pair(
        upstream: &Upstream,
        tls: Option<&UpstreamTls>,
        h2_only: bool,
        idle_timeout: Duration,
        max_idle: usize,
    ) -> (Link, Link) {
        if h2_only {
            let tls = tls.map(|t| h2_over_tls(t, connector(CONNECT_TIMEOUT)));
            let h2 = Link::H2(h2_client(tls, CONNECT_TIMEOUT, idle_timeout));
            return (h2.clone(), h2);
        }
        let fresh = match tls {
            Some(_) => Link::Fresh(fresh_client(tls, CONNECT_TIMEOUT)),
            None => Link::Direct(Direct::new(&upstream.authority, CONNECT_TIMEOUT)),
        };
        (
            Link::Pooled(client(tls, CONNECT_TIMEOUT, idle_timeout, max_idle)),
            fresh,
        )
    }
}

/// A request on its way: hyper-util's client's future, or a [`Direct`] connection's.
pub enum Sending {
    Client(hyper_util::client::legacy::ResponseFuture),
    Direct(Pin<Box<dyn Future<Output = Result<Response<Incoming>, SendError>> + Send>>),
}

impl Future for Sending {
    type Output = Result<Response<Incoming>, SendError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.get_mut() {
            Sending::Client(f) => Pin::new(f).poll(cx).map_err(SendError::Client),
            Sending::Direct(f) => f.as_mut().poll(cx),
        }
    }
}

/// How sending a request failed, by which way it went; [`classify`] reads it.
#[derive(Debug)]
pub enum SendError {
    /// hyper-util's client (pooled, over TLS, h2).
    Client(hyper_util::client::legacy::Error),
    /// A [`Direct`] connection could not be made: nothing was written.
    Connect(io::Error),
    /// hyper's error on a [`Direct`] connection.
    Exchange(hyper::Error),
}

impl std::fmt::Display for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SendError::Client(e) => e.fmt(f),
            // As hyper-util's client says it: the cause follows in [`describe`].
            SendError::Connect(_) => f.write_str("client error (Connect)"),
            SendError::Exchange(_) => f.write_str("client error (SendRequest)"),
        }
    }
}

impl std::error::Error for SendError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            SendError::Client(e) => e.source(),
            SendError::Connect(e) => Some(e),
            SendError::Exchange(e) => Some(e),
        }
    }
}

/// The TCP connector every client starts from.
fn connector(connect_timeout: Duration) -> HttpConnector {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(connect_timeout));
    // https:// URIs reach it too, from the TLS connector around it.
    connector.enforce_http(false);
    connector
}

/// `inner` behind TLS whose ALPN offers h2 alone (`upstream_http2 = "prior_knowledge"` on
/// an `https://` upstream); [`h2_client`]'s connector checks that the upstream picked it.
fn h2_over_tls(tls: &UpstreamTls, inner: HttpConnector) -> HttpsConnector<HttpConnector> {
    let mut builder = HttpsConnectorBuilder::new()
        .with_tls_config((*tls.config).clone())
        .https_only();
    if let Some(name) = &tls.server_name {
        builder = builder.with_server_name_resolver(FixedServerNameResolver::new(name.clone()));
    }
    builder.enable_http2().wrap_connector(inner)
}

/// The pooled client to the upstream, for pass-through requests.
pub type UpstreamClient = Client<Bounded<HttpsConnector<HttpConnector>>, Body>;

/// The client for protected requests: a fresh connection for each, never a pooled one.
pub type FreshClient = Client<Bounded<HttpsConnector<FreshConnector>>, Body>;

/// A connector whose whole connect, TCP and TLS handshake together, ends within a
/// deadline. `HttpConnector`'s own timeout bounds the TCP connect alone: an `https://`
/// upstream that accepted TCP and never answered the ClientHello held its request until
/// `upstream_timeout`, and then its key as `unknown`, though nothing of the request was
/// written. Past the deadline the connect fails, which [`classify`] reads as not sent.
/// The connection it makes remembers whether the upstream has sent anything ([`Accepted`]).
#[derive(Clone)]
pub struct Bounded<C> {
    inner: C,
    timeout: Duration,
}

impl<C> tower_service::Service<Uri> for Bounded<C>
where
    C: tower_service::Service<Uri>,
    C::Future: Send + 'static,
    C::Error: Into<BoxError>,
{
    type Response = Accepted<C::Response>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let connecting = self.inner.call(uri);
        let timeout = self.timeout;
        Box::pin(async move {
            match tokio::time::timeout(timeout, connecting).await {
                Ok(connected) => connected.map(Accepted::new).map_err(Into::into),
                Err(_) => Err(format!(
                    "connecting (TCP and TLS handshake) took longer than {timeout:?}"
                )
                .into()),
            }
        })
    }
}

/// `inner` behind TLS when the upstream is `https://` (with its roots, client certificate,
/// server name and ALPN), else as it is.
///
/// A handshake is part of connecting: one that fails (an untrusted or expired certificate,
/// a wrong name) is a connect error, so [`classify`] reads it as "not sent", as it does a
/// refused connection. Early data is off (see [`crate::tls`]), so nothing of the request
/// is written before the handshake is done.
fn over_tls<C>(tls: Option<&UpstreamTls>, inner: C) -> HttpsConnector<C> {
    let Some(tls) = tls else {
        // An http:// upstream: the TLS configuration is never used (every URI is http).
        // `builder()` takes the process's provider, which rustls installs from its one
        // provider feature (ring) when nothing else did.
        let unused = rustls::ClientConfig::builder()
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        let builder = HttpsConnectorBuilder::new().with_tls_config(unused);
        return builder.https_or_http().enable_http1().wrap_connector(inner);
    };
    let mut builder = HttpsConnectorBuilder::new()
        .with_tls_config((*tls.config).clone())
        .https_only();
    if let Some(name) = &tls.server_name {
        builder = builder.with_server_name_resolver(FixedServerNameResolver::new(name.clone()));
    }
    let builder = builder.enable_http1();
    if tls.http2 {
        // ALPN offers h2 then http/1.1; hyper-util speaks whichever the upstream picks.
        builder.enable_http2().wrap_connector(inner)
    } else {
        builder.wrap_connector(inner)
    }
}

/// How long connecting to the upstream may take. It runs beside idemgate, so a connection
/// that takes longer than this is not coming; and a connect failure is the one failure that
/// proves the request was not sent (502, the claim released), so it must not wait for
/// `upstream_timeout`.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Builds the client. Connecting has its own timeout, so a black-holed upstream is reported
/// as unreachable (provably not sent) rather than as a timeout.
///
/// Pass-through requests only (protected ones use [`fresh_client`]). An idle connection is
/// reused for at most `idle_timeout` (`upstream_idle_timeout`), so that one the upstream
/// closed on a timer of its own is rarely written to; a pass-through request that loses
/// that race gets a 502 or 504 as it would from any proxy, and holds no record.
///
/// Requests that hyper hands back unwritten, because the pooled connection turned out to be
/// closed before any byte of the request went out, are retried on another connection by
/// hyper-util (`retry_canceled_requests`, on by default, and left on: those are provably
/// unsent).
pub fn client(
    tls: Option<&UpstreamTls>,
    connect_timeout: Duration,
    idle_timeout: Duration,
    max_idle: usize,
) -> UpstreamClient {
    let connector = Bounded {
        inner: over_tls(tls, connector(connect_timeout)),
        timeout: connect_timeout,
    };
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(idle_timeout)
        // Requests in use are bounded by their slots; idle connections beyond them would
        // hold file descriptors past `max_upstream_connections`.
        .pool_max_idle_per_host(max_idle)
        .retry_canceled_requests(true)
        .build(connector)
}

/// Builds the client for protected requests: each goes out on a connection of its own,
/// opened for it and closed after its answer.
///
/// Why not the pool: an upstream may close an idle keep-alive connection at any moment (an
/// idle timer, a graceful restart or reload closing every idle connection at once, a server
/// that closes after every answer without saying so), and a request written onto a
/// connection at that moment fails in a way that cannot be told from a request the upstream
/// read and executed (see [`classify`]): its key would be held as `unknown` although
/// nothing ran. No idle timer of idemgate's can win that race against an upstream that
/// closes whenever it likes. A connection opened for the request has never been idle: the
/// upstream accepted it, and the request follows the handshake at once, before any
/// keep-alive logic of the upstream's can apply to it (servers close idle connections
/// between requests, not a new one before its first). A connect that fails is "not sent",
/// as before.
///
/// Who closes, and TIME_WAIT: the request carries `Connection: close` (see
/// [`close_after`]), so the upstream expects the close; idemgate's side never half-closes
/// (the connection's shutdown is a no-op) and closes with `SO_LINGER` 0 once the answer is
/// read, which resets rather than enters TIME_WAIT. At 10,000 new keys a second a side
/// that entered TIME_WAIT for 60 s would hold 600,000 ports towards one upstream address,
/// twenty times the ephemeral range; this way neither side holds any.
///
/// Over TLS the same holds: the TLS session lives on the fresh TCP connection, a
/// `close_notify` may be written when hyper closes it, and the reset follows. On h2 (an
/// upstream that picks it by ALPN) the request is the connection's only stream, and
/// `Connection: close` is left out, as h2 forbids it.
pub fn fresh_client(tls: Option<&UpstreamTls>, connect_timeout: Duration) -> FreshClient {
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(0)
        .build(Bounded {
            inner: over_tls(tls, FreshConnector(connector(connect_timeout))),
            timeout: connect_timeout,
        })
}

/// Marks a protected request's connection as closed after its answer (RFC 9112 9.6), so
/// the upstream neither waits for a next request on it nor reads idemgate's reset as a
/// failure. Called after [`prepare`], which strips the client's own `Connection`.
pub fn close_after(req: &mut Request<Body>) {
    req.headers_mut()
        .insert(CONNECTION, HeaderValue::from_static("close"));
}

/// Connects as [`HttpConnector`] does and wraps the stream in a [`FreshConnection`].
#[derive(Clone)]
pub struct FreshConnector(HttpConnector);

impl tower_service::Service<Uri> for FreshConnector {
    type Response = FreshConnection;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<FreshConnection, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.0.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let connecting = self.0.call(uri);
        Box::pin(async move {
            let io = connecting.await?;
            // Only ever closed once its answer is read, or given up on: a reset then loses
            // nothing, and leaves no TIME_WAIT on either side.
            io.inner().set_zero_linger()?;
            Ok(FreshConnection(io))
        })
    }
}

/// A connection that is closed, never half-closed: see [`fresh_client`].
pub struct FreshConnection(TokioIo<TcpStream>);

/// A write that failed because the upstream has closed (broken pipe, reset) is reported as
/// written, so that what the upstream said before it closed is read and decides.
///
/// A TLS 1.3 upstream that refuses idemgate's client certificate (or its lack of one) does
/// so after idemgate's side of the handshake is done: it sends an alert and closes, and the
/// request bytes already on their way make its kernel answer with a reset. A write after
/// that reset fails; reported as it is, the exchange ends with "broken pipe", which cannot
/// be told from an upstream that read the request and died. The alert arrived before the
/// reset and is still there to read: the read that follows returns it ([`classify`]: not
/// sent), or, if the upstream said nothing, the reset itself (ambiguous, as before). The
/// socket is dead either way: nothing is lost by writing no more to it.
fn read_on(polled: Poll<io::Result<usize>>, len: usize) -> Poll<io::Result<usize>> {
    match polled {
        Poll::Ready(Err(e))
            if matches!(
                e.kind(),
                io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
            ) =>
        {
            Poll::Ready(Ok(len))
        }
        other => other,
    }
}

impl hyper::rt::Read for FreshConnection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl hyper::rt::Write for FreshConnection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let len = buf.len();
        read_on(Pin::new(&mut self.0).poll_write(cx, buf), len)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let len = bufs.iter().map(|b| b.len()).sum();
        read_on(Pin::new(&mut self.0).poll_write_vectored(cx, bufs), len)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    // A FIN of idemgate's would make its side the one that closes first, into TIME_WAIT;
    // the drop that follows resets instead.
    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

impl Connection for FreshConnection {
    fn connected(&self) -> Connected {
        self.0.connected()
    }
}

/// Header names that are hop-by-hop by definition (RFC 9110 7.6.1, plus the legacy
/// `Keep-Alive` and `Proxy-Connection`). `Connection` may name more.
///
/// Names, not strings: removing by `&str` parsed and validated each of the eight names
/// again on every call, twice per request (about 5,000 instructions per request in
/// callgrind, a tenth of a pass-through's user-space work).
static HOP_BY_HOP: [HeaderName; 8] = [
    CONNECTION,
    HeaderName::from_static("proxy-connection"),
    HeaderName::from_static("keep-alive"),
    TE,
    TRAILER,
    TRANSFER_ENCODING,
    UPGRADE,
    PROXY_AUTHORIZATION,
];

/// Removes hop-by-hop headers, including every header that `Connection` names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most messages carry none of them: one pass over the names present is cheaper than a
    // hashed lookup for each of the eight.
    if !headers.keys().any(|k| HOP_BY_HOP.contains(k)) {
        return;
    }
    let named: Vec<HeaderName> = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in &HOP_BY_HOP {
        headers.remove(name);
    }
}

/// Whether a header is hop-by-hop (static list only; call after [`strip_hop_by_hop`]).
pub fn is_hop_by_hop(name: &HeaderName) -> bool {
    HOP_BY_HOP.contains(name)
}

/// Rewrites a client request into the upstream's: absolute URI on the upstream origin,
/// hop-by-hop headers removed, the client's `Host` dropped (the client library writes the
/// upstream's as the protocol needs it), `X-Forwarded-*` added.
pub fn prepare(req: &mut Request<Body>, upstream: &Upstream, client: SocketAddr) {
    let original_host = req.headers().get(HOST).cloned().or_else(|| {
        // HTTP/2 clients send :authority (in the URI) instead of Host; read it before the
        // URI is rewritten to the upstream's.
        req.uri()
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
    });
    // The request's own path and query, as parsed already: only the origin changes.
    let mut parts = req.uri().clone().into_parts();
    parts.scheme = Some(upstream.scheme.clone());
    parts.authority = Some(upstream.authority.clone());
    if parts.path_and_query.is_none() {
        parts.path_and_query = Some(PathAndQuery::from_static("/"));
    }
    // Scheme, authority and path are all set, so this cannot fail.
    if let Ok(uri) = Uri::from_parts(parts) {
        *req.uri_mut() = uri;
    }
    *req.version_mut() = Version::HTTP_11;
    let h = req.headers_mut();
    strip_hop_by_hop(h);
    join_cookie_crumbs(h);
    // The authority travels in the URI. Which protocol carries it is known only once the
    // connection's ALPN is (an `https://` upstream may pick h2): hyper-util's client writes
    // `Host` from the URI on HTTP/1.1 only, and over h2 hyper sends the URI's authority as
    // `:authority`. A `Host` set here would go out beside `:authority` on h2, which nginx
    // refuses as a duplicate host (RFC 9113 8.3.1 allows one only if they agree).
    h.remove(HOST);
    let xff = HeaderName::from_static("x-forwarded-for");
    let forwarded_for = match h.get(&xff).and_then(|v| v.to_str().ok()) {
        Some(prev) => HeaderValue::from_str(&format!("{prev}, {}", client.ip())).ok(),
        None => ip_value(client.ip()),
    };
    if let Some(v) = forwarded_for {
        h.insert(xff, v);
    }
    h.insert(
        HeaderName::from_static("x-forwarded-proto"),
        upstream.forwarded_proto.clone(),
    );
    if let Some(host) = original_host {
        h.insert(HeaderName::from_static("x-forwarded-host"), host);
    }
}

/// HTTP/2 clients may send `Cookie` as one field per cookie (RFC 9113 8.2.3); HTTP/1.1
/// allows one `Cookie` line (RFC 6265 5.4), and the tenant read them joined with "; ":
/// the upstream gets that one line, whichever protocol carries it onward.
fn join_cookie_crumbs(h: &mut HeaderMap) {
    if h.get_all(COOKIE).iter().nth(1).is_none() {
        return;
    }
    let joined = crate::scope::tenant::field_value(h, &COOKIE)
        .and_then(|v| HeaderValue::from_bytes(&v).ok());
    h.remove(COOKIE);
    if let Some(v) = joined {
        h.insert(COOKIE, v);
    }
}

/// An IP address as a header value. IPv4, nearly every client of a sidecar, is written by
/// hand: `Display` for addresses goes through the formatting machinery, about a tenth of a
/// pass-through's instructions.
fn ip_value(ip: IpAddr) -> Option<HeaderValue> {
    match ip {
        IpAddr::V4(v4) => {
            let mut buf = [0u8; 15];
            let mut n = 0;
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    buf[n] = b'.';
                    n += 1;
                }
                if octet >= 100 {
                    buf[n] = b'0' + octet / 100;
                    n += 1;
                }
                if octet >= 10 {
                    buf[n] = b'0' + (octet / 10) % 10;
                    n += 1;
                }
                buf[n] = b'0' + octet % 10;
                n += 1;
            }
            HeaderValue::from_bytes(&buf[..n]).ok()
        }
        IpAddr::V6(_) => HeaderValue::from_str(&ip.to_string()).ok(),
    }
}

/// How an upstream exchange failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// Nothing was sent: connection refused, DNS, connect timeout.
    NotSent,
    /// Something may have been sent and no complete answer came back.
    Ambiguous,
}

/// Classifies a client error: [`Failure::NotSent`] only when the error proves that not one
/// byte of the request reached the upstream, because that releases the key and lets a
/// retry execute; anything else may have been read and executed.
///
/// What hyper and hyper-util document, and what follows:
///
/// - `legacy::Error::is_connect()`: "an error from `Connect`": the connector failed
///   (refused, DNS, connect timeout), so there was no connection to write on. Not sent.
/// - `hyper::Error::is_canceled()`: "a `Request` that was canceled ... dropped before it
///   can be dispatched to the connection, for example because the connection was not
///   ready". In hyper's client every such error is made where the request is handed back
///   to the caller unwritten (hyper's `TrySendError` carries the message back: a request
///   still queued when the connection closed, or a connection that was not ready), and
///   hyper-util then reports kind `Canceled`, or, on a reused connection, retries it on
///   another one (`retry_canceled_requests`). Not sent.
/// - `hyper::Error::is_incomplete_message()`: "the connection reported EOF while hyper's
///   HTTP state indicates more of the message needed to be transmitted", documented with
///   "a request is written on a connection, and the next `read` reports EOF (perhaps a
///   server just closed an 'idle' connection)". The request was written: the upstream may
///   have read it and executed it, then closed without answering. Ambiguous, even when the
///   connection was idle a moment before: protected requests avoid that race by taking a
///   fresh connection each (see [`fresh_client`]), not by explaining it away here.
/// - I/O errors while writing (reset, broken pipe), errors reading the answer, timeouts:
///   part or all of the request may have been read. Ambiguous.
/// - A TLS handshake that fails while connecting is a connect error: not sent. One that
///   the upstream refuses after idemgate's side of it is done, see [`handshake_refused`]:
///   not sent either, as long as the upstream had sent no application data first
///   ([`Accepted`]); any other alert or close after writing is ambiguous.
/// - Over h2, a stream the upstream refused unprocessed, see [`h2_unprocessed`]: not sent.
///
/// On a [`Direct`] connection the same: a failed connect is not sent, and of hyper's
/// errors only one that is canceled (the request handed back unwritten).
pub fn classify(e: &SendError) -> Failure {
    use std::error::Error as _;
    let not_sent = match e {
        SendError::Client(e) => {
            let canceled = e
                .source()
                .and_then(|s| s.downcast_ref::<hyper::Error>())
                .is_some_and(hyper::Error::is_canceled);
            e.is_connect() || canceled || handshake_refused(e) || h2_unprocessed(e)
        }
        SendError::Connect(_) => true,
        SendError::Exchange(e) => e.is_canceled(),
    };
    if not_sent {
        Failure::NotSent
    } else {
        Failure::Ambiguous
    }
}

/// Whether an h2 upstream said that it did not process the request's stream (RFC 9113):
///
/// - `RST_STREAM` with `REFUSED_STREAM`, sent by the upstream: "the stream is being closed
///   prior to any processing having occurred" (8.7), the code a server uses for streams
///   beyond its concurrency limit or while it shuts down;
/// - a `GOAWAY` from the upstream whose last stream id is below the stream's: the sender
///   "might not process" such streams and they "can be safely retried" (6.8), because it
///   will not act on them.
///
/// The h2 crate gives a stream above the GOAWAY's last stream id (or one opened after the
/// GOAWAY) an error of kind `GoAway` with the remote as its initiator; streams at or below
/// the last stream id carry on, and one that the connection's end then cuts off gets an
/// I/O error (broken pipe) instead, which stays ambiguous, as it must: the upstream may
/// have processed it. A reset or GOAWAY that the h2 crate itself sends (a protocol error
/// it detected) is the library's, not the upstream's word: ambiguous.
pub fn h2_unprocessed(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut at = Some(e);
    while let Some(err) = at {
        if let Some(h2) = err.downcast_ref::<h2::Error>() {
            return h2.is_remote()
                && (h2.is_go_away() || h2.reason() == Some(h2::Reason::REFUSED_STREAM));
        }
        at = err.source();
    }
    false
}

/// TLS alerts with which a server refuses the handshake itself (RFC 8446 6.2): the client's
/// certificate, or the access it would grant.
const HANDSHAKE_REFUSALS: [rustls::AlertDescription; 10] = [
    rustls::AlertDescription::HandshakeFailure,
    rustls::AlertDescription::BadCertificate,
    rustls::AlertDescription::UnsupportedCertificate,
    rustls::AlertDescription::CertificateRevoked,
    rustls::AlertDescription::CertificateExpired,
    rustls::AlertDescription::CertificateUnknown,
    rustls::AlertDescription::UnknownCA,
    rustls::AlertDescription::AccessDenied,
    rustls::AlertDescription::CertificateRequired,
    rustls::AlertDescription::DecryptError,
];

/// Whether the upstream refused the TLS handshake after idemgate's side of it was done.
///
/// In TLS 1.3 the client's handshake ends when it sends its `Finished`, before the server
/// has checked the client's certificate: a server that then refuses the certificate (or
/// its absence, `certificate_required`) sends an alert, which idemgate reads as the first
/// answer to a request it has already written. The server read the client's handshake
/// messages before any of the application data behind them, and gave up at them: the
/// request never reached the upstream's HTTP server. Only these alerts count; any other
/// error after writing stays ambiguous.
pub fn handshake_refused(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut at = Some(e);
    while let Some(err) = at {
        // tokio-rustls hands rustls' errors on inside an io::Error, whose `source()` skips
        // the error it wraps.
        let tls = err.downcast_ref::<rustls::Error>().or_else(|| {
            err.downcast_ref::<io::Error>()
                .and_then(io::Error::get_ref)
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        });
        if let Some(rustls::Error::AlertReceived(alert)) = tls {
            return HANDSHAKE_REFUSALS.contains(alert);
        }
        // The h2 crate keeps an I/O error's kind and text, not the error itself: rustls'
        // own words for the alert are what is left of it.
        if tls.is_none() {
            let text = err.to_string();
            let said = |a: &rustls::AlertDescription| {
                text.contains(&rustls::Error::AlertReceived(*a).to_string())
            };
            if HANDSHAKE_REFUSALS.iter().any(said) {
                return true;
            }
        }
        at = err.source();
    }
    false
}

/// An error and its causes, `: `-separated, for a log line: hyper-util's own message says
/// only "client error (Connect)", the cause says which certificate check failed.
pub fn describe(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut at = e.source();
    while let Some(err) = at {
        let text = err.to_string();
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        at = err.source();
    }
    out
}

#[cfg(test)]
mod tests {

    #[test]
    fn ip_values_read_as_display_writes_them() {
        for ip in [
            "0.0.0.0",
            "127.0.0.1",
            "10.20.30.40",
            "192.168.100.255",
            "1.2.3.4",
            "99.100.9.10",
            "::1",
            "2001:db8::8a2e:370:7334",
            "::ffff:10.0.0.1",
        ] {
            let addr: IpAddr = ip.parse().unwrap();
            assert_eq!(ip_value(addr).unwrap(), addr.to_string().as_str(), "{ip}");
        }
    }

    use super::*;

    #[test]
    fn a_handshake_alert_is_found_as_rustls_error_and_as_h2_keeps_it() {
        let alert = rustls::Error::AlertReceived(rustls::AlertDescription::CertificateRequired);
        // tokio-rustls: the rustls error inside an io::Error, under hyper's.
        let io = io::Error::new(io::ErrorKind::InvalidData, alert.clone());
        assert!(handshake_refused(&io));
        // h2: the same error's text only.
        let text = io::Error::new(io::ErrorKind::InvalidData, alert.to_string());
        assert!(handshake_refused(&text));
        let other = rustls::Error::AlertReceived(rustls::AlertDescription::CloseNotify);
        assert!(!handshake_refused(&io::Error::new(
            io::ErrorKind::InvalidData,
            other
        )));
        assert!(!handshake_refused(&io::Error::from(
            io::ErrorKind::ConnectionReset
        )));
    }

    #[test]
    fn strips_hop_by_hop_and_connection_named_headers() {
        let mut h = HeaderMap::new();
        h.insert(CONNECTION, HeaderValue::from_static("close, X-Secret-Hop"));
        h.insert("x-secret-hop", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("te", HeaderValue::from_static("trailers"));
        h.insert("upgrade", HeaderValue::from_static("h2c"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-kept"));
    }
}
