//! Whether an upstream's TLS layer had accepted the handshake when it ended the session.
//!
//! A TLS 1.3 server checks the client's certificate after the client's side of the
//! handshake is done and its request is on the way: a refusal alert then (see
//! [`super::handshake_refused`]) proves that the upstream's HTTP server never saw the
//! request, and it is "not sent". That holds only while the upstream has sent nothing
//! else: a server sends application data (an answer's first bytes, a `100 Continue`, h2's
//! `SETTINGS`) only once it has accepted the handshake, so a refusal alert after any of it
//! proves nothing of the kind, and is reported here as an ending of the session like any
//! other ([`classify`](super::classify): ambiguous).

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use hyper::rt::{Read, ReadBuf, ReadBufCursor, Write};
use hyper_util::client::legacy::connect::{Connected, Connection};

/// A connection to the upstream that remembers whether the upstream has sent it any
/// application data.
pub struct Accepted<T> {
    io: T,
    // The upstream has sent application data: its TLS layer accepted the handshake.
    spoke: bool,
}

impl<T> Accepted<T> {
    /// Wraps a newly made connection.
    pub fn new(io: T) -> Accepted<T> {
        Accepted { io, spoke: false }
    }
}

/// The error that a refusal alert after application data becomes: what it says of the
/// alert, and nothing that reads as a handshake's refusal.
fn after_accepting(e: &io::Error) -> io::Error {
    let alert = e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        .and_then(|tls| match tls {
            rustls::Error::AlertReceived(a) => Some(format!("{a:?}")),
            _ => None,
        })
        .unwrap_or_else(|| "a refusal".into());
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        format!("the upstream ended its TLS session with alert {alert} after it had accepted the handshake and sent data"),
    )
}

impl<T: Read + Unpin> Read for Accepted<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        mut buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.spoke {
            return match ready!(Pin::new(&mut this.io).poll_read(cx, buf)) {
                Err(e) if super::handshake_refused(&e) => Poll::Ready(Err(after_accepting(&e))),
                read => Poll::Ready(read),
            };
        }
        // Until the upstream has said anything, its bytes pass through a buffer of this
        // wrapper's own, to see that they came (once they have, they pass as they are).
        let mut first = vec![0u8; buf.remaining().min(16 * 1024)];
        let mut read = ReadBuf::new(&mut first);
        ready!(Pin::new(&mut this.io).poll_read(cx, read.unfilled()))?;
        let got = read.filled();
        if !got.is_empty() {
            this.spoke = true;
            buf.put_slice(got);
        }
        Poll::Ready(Ok(()))
    }
}

impl<T: Write + Unpin> Write for Accepted<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl<T: Connection> Connection for Accepted<T> {
    fn connected(&self) -> Connected {
        self.io.connected()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_after_data_no_longer_reads_as_one() {
        let alert = rustls::Error::AlertReceived(rustls::AlertDescription::AccessDenied);
        let refused = io::Error::new(io::ErrorKind::InvalidData, alert);
        assert!(super::super::handshake_refused(&refused));
        let after = after_accepting(&refused);
        assert!(!super::super::handshake_refused(&after));
        assert!(after.to_string().contains("AccessDenied"), "{after}");
    }
}
