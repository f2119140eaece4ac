//! The client to an upstream known to speak h2 (`upstream_http2 = "prior_knowledge"`):
//! pooled connections on which protected requests are streams, and a connector that proves
//! a connection is h2 before hyper writes any request byte on it.
//!
//! Why a pooled h2 connection keeps "never `unknown` for a request the upstream did not
//! read": h2 says which streams it did not process. A server that closes a connection,
//! gracefully (an idle timer, a restart) or at its concurrency limit, sends `GOAWAY` with
//! the last stream id it processes, or resets a stream with `REFUSED_STREAM`; a stream
//! above that id, or refused, is "not sent" ([`super::h2_unprocessed`]). HTTP/1.1 has no
//! such word, which is why its protected requests take a fresh connection each
//! ([`super::fresh_client`]). A connection that ends without a `GOAWAY` (the upstream died,
//! the network broke) leaves its open streams ambiguous, as a fresh connection cut off
//! after its request is.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::Uri;
use hyper_rustls::{HttpsConnector, MaybeHttpsStream};
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::body::{Body, BoxError};

/// The pooled h2-only client: pass-through and protected requests alike.
pub type H2Client = Client<H2Connector, Body>;

/// The client connection preface (RFC 9113 3.4).
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Builds the h2-only client. `tls`: the TLS connector (ALPN offering h2 alone) for an
/// `https://` upstream; `None` for cleartext h2 (h2c) with prior knowledge.
///
/// Connections are shared by every request of this client: at most one is being opened at
/// a time (hyper-util's pool waits for an h2 connection under way rather than open a
/// second), and requests beyond the upstream's `SETTINGS_MAX_CONCURRENT_STREAMS` wait for
/// a stream. Requests hyper hands back unwritten (a pooled connection found closed) are
/// retried on another: they are provably unsent.
pub fn h2_client(
    tls: Option<HttpsConnector<HttpConnector>>,
    connect_timeout: Duration,
    idle_timeout: Duration,
) -> H2Client {
    let mut plain = HttpConnector::new();
    plain.set_nodelay(true);
    plain.set_connect_timeout(Some(connect_timeout));
    Client::builder(TokioExecutor::new())
        .http2_only(true)
        .pool_idle_timeout(idle_timeout)
        .retry_canceled_requests(true)
        .build(H2Connector {
            tls,
            plain,
            timeout: connect_timeout,
        })
}

/// Connects, and fails unless the connection is h2, all before any request byte is
/// written: a connect error, which [`super::classify`] reads as "not sent".
///
/// Over TLS: the upstream must have picked h2 by ALPN (the only protocol offered; a server
/// without ALPN picks none). Cleartext: the connector writes the client preface itself and
/// reads the server's first frame, which must be a `SETTINGS` frame on stream 0 (RFC 9113
/// 3.4); an HTTP/1.1 server answers the preface with an error or closes, and reads no
/// request. The preface that hyper writes next is then left out ([`H2c`]), and what was
/// read of the server's is handed to hyper first.
#[derive(Clone)]
pub struct H2Connector {
    tls: Option<HttpsConnector<HttpConnector>>,
    plain: HttpConnector,
    timeout: Duration,
}

impl tower_service::Service<Uri> for H2Connector {
    type Response = H2Connection;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<H2Connection, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        match &mut self.tls {
            Some(tls) => tls.poll_ready(cx),
            None => self.plain.poll_ready(cx).map_err(Into::into),
        }
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let timeout = self.timeout;
        match &mut self.tls {
            Some(tls) => {
                let connecting = tls.call(uri);
                Box::pin(async move {
                    let io = tokio::time::timeout(timeout, connecting)
                        .await
                        .map_err(|_| "connecting to the upstream timed out")??;
                    if !io.connected().is_negotiated_h2() {
                        return Err("the upstream did not pick h2 by ALPN, and upstream_http2 = \"prior_knowledge\" speaks h2 only".into());
                    }
                    Ok(H2Connection::Tls(Box::new(super::Accepted::new(io))))
                })
            }
            None => {
                let connecting = self.plain.call(uri);
                Box::pin(async move {
                    let io = connecting.await?;
                    let probed = tokio::time::timeout(timeout, H2c::probe(io))
                        .await
                        .map_err(|_| "the upstream sent no h2 SETTINGS frame in time (upstream_http2 = \"prior_knowledge\")")??;
                    Ok(H2Connection::Clear(probed))
                })
            }
        }
    }
}

/// An h2 connection, over TLS or cleartext.
pub enum H2Connection {
    // Boxed: a TLS session is a kilobyte, the cleartext stream a few words.
    Tls(Box<super::Accepted<MaybeHttpsStream<TokioIo<TcpStream>>>>),
    Clear(H2c),
}

/// A cleartext connection whose preface [`H2c::probe`] has written: the first
/// `PREFACE.len()` bytes hyper writes (its own preface) are left out, and the bytes read of
/// the server's preface are read again first.
pub struct H2c {
    io: TokioIo<TcpStream>,
    ahead: Vec<u8>,
    at: usize,
    skip: usize,
}

impl H2c {
    async fn probe(mut io: TokioIo<TcpStream>) -> Result<H2c, BoxError> {
        let tcp = io.inner_mut();
        tcp.write_all(PREFACE).await?;
        let mut ahead = Vec::with_capacity(256);
        while ahead.len() < 9 {
            if tcp.read_buf(&mut ahead).await? == 0 {
                return Err("the upstream closed the connection after the h2 preface: it does not speak h2 with prior knowledge".into());
            }
        }
        // Frame header: length (3), type (1), flags (1), stream id (4).
        let settings = ahead[3] == 0x4 && ahead[4] & 0x1 == 0 && ahead[5..9] == [0; 4];
        if !settings {
            return Err("the upstream did not answer the h2 preface with SETTINGS: it does not speak h2 with prior knowledge".into());
        }
        Ok(H2c {
            io,
            ahead,
            at: 0,
            skip: PREFACE.len(),
        })
    }

    /// Leaves out the part of hyper's preface in `buf` that is still to come.
    fn skipped(&mut self, buf: &[u8]) -> io::Result<usize> {
        let done = PREFACE.len() - self.skip;
        let n = self.skip.min(buf.len());
        if buf[..n] != PREFACE[done..done + n] {
            return Err(io::Error::other(
                "h2c: the client did not start with its preface",
            ));
        }
        self.skip -= n;
        Ok(n)
    }
}

impl hyper::rt::Read for H2Connection {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        mut buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            H2Connection::Tls(io) => Pin::new(&mut **io).poll_read(cx, buf),
            H2Connection::Clear(c) => {
                if c.at < c.ahead.len() {
                    let n = (c.ahead.len() - c.at).min(buf.remaining());
                    buf.put_slice(&c.ahead[c.at..c.at + n]);
                    c.at += n;
                    if c.at == c.ahead.len() {
                        c.ahead = Vec::new();
                        c.at = 0;
                    }
                    return Poll::Ready(Ok(()));
                }
                Pin::new(&mut c.io).poll_read(cx, buf)
            }
        }
    }
}

impl hyper::rt::Write for H2Connection {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            H2Connection::Tls(io) => Pin::new(&mut **io).poll_write(cx, buf),
            H2Connection::Clear(c) if c.skip > 0 && !buf.is_empty() => Poll::Ready(c.skipped(buf)),
            H2Connection::Clear(c) => Pin::new(&mut c.io).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            H2Connection::Tls(io) => Pin::new(&mut **io).poll_write_vectored(cx, bufs),
            H2Connection::Clear(c) if c.skip > 0 => match bufs.iter().find(|b| !b.is_empty()) {
                Some(first) => Poll::Ready(c.skipped(first)),
                None => Poll::Ready(Ok(0)),
            },
            H2Connection::Clear(c) => Pin::new(&mut c.io).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            H2Connection::Tls(io) => io.is_write_vectored(),
            H2Connection::Clear(c) => c.io.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            H2Connection::Tls(io) => Pin::new(&mut **io).poll_flush(cx),
            H2Connection::Clear(c) => Pin::new(&mut c.io).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            H2Connection::Tls(io) => Pin::new(&mut **io).poll_shutdown(cx),
            H2Connection::Clear(c) => Pin::new(&mut c.io).poll_shutdown(cx),
        }
    }
}

impl Connection for H2Connection {
    fn connected(&self) -> Connected {
        match self {
            H2Connection::Tls(io) => io.connected(),
            H2Connection::Clear(c) => c.io.connected(),
        }
    }
}
