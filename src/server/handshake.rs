//! The TLS listener's handshakes: the ClientHello on its own bound, then a permit among
//! the handshakes running at once, then what a client certificate says.

use std::sync::Arc;

use tokio::sync::Semaphore;

use crate::connection::{Socket, Watched};
use crate::scope::client_cert::ClientCert;

/// What a TLS listener's accept loops share: the acceptor (its key pair swapped by the
/// reloader) and the bound on handshakes running at once.
#[derive(Clone)]
pub(super) struct Handshakes {
    pub(super) acceptor: tokio_rustls::TlsAcceptor,
    pub(super) permits: Arc<Semaphore>,
    pub(super) gauges: crate::metrics::HandshakeGauges,
    // The client CAs one by one, when a route reads its tenant from client certificates.
    pub(super) authorities: Option<Arc<crate::scope::client_cert::Authorities>>,
}

/// One on a gauge for as long as it lives.
struct Gauged<'a>(&'a prometheus_client::metrics::gauge::Gauge);

impl<'a> Gauged<'a> {
    fn new(gauge: &'a prometheus_client::metrics::gauge::Gauge) -> Gauged<'a> {
        gauge.inc();
        Gauged(gauge)
    }
}

impl Drop for Gauged<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// A client connection's bytes: as they come, or through TLS.
pub(super) type ClientIo =
    tokio_util::either::Either<Watched<Socket>, tokio_rustls::server::TlsStream<Watched<Socket>>>;

impl Handshakes {
    /// The TLS session of a new connection. It runs under the connection's head deadline
    /// (the supervisor's `header_read_timeout` from accept), waiting for a permit included:
    /// a client that opens a connection and never finishes its handshake is closed as one
    /// that never sends a head is. Its ClientHello must arrive within
    /// [`CLIENT_HELLO_TIMEOUT`](crate::tls::CLIENT_HELLO_TIMEOUT) (or the head deadline, if
    /// sooner), and only then is one of the handshake permits taken.
    ///
    /// With a route that reads its tenant from client certificates, also what the client's
    /// verified certificate says (once per connection; see [`crate::scope::client_cert`]).
    pub(super) async fn accept(
        &self,
        io: Watched<Socket>,
    ) -> Result<(ClientIo, Option<Arc<ClientCert>>), crate::body::BoxError> {
        // The ClientHello first, without a permit and on its own bound: 400 silent sockets
        // held the 256 permits for their whole head deadline and kept real clients waiting
        // for seconds.
        let hello = {
            let _waiting = Gauged::new(&self.gauges.awaiting_hello);
            let lazy =
                tokio_rustls::LazyConfigAcceptor::new(rustls::server::Acceptor::default(), io);
            tokio::time::timeout(crate::tls::CLIENT_HELLO_TIMEOUT, lazy)
                .await
                .map_err(|_| "TLS: no ClientHello in time")?
                .map_err(|e| format!("TLS ClientHello: {e}"))?
        };
        let permit = {
            let _waiting = Gauged::new(&self.gauges.waiting);
            self.permits.acquire().await?
        };
        let running = Gauged::new(&self.gauges.running);
        let tls = hello
            .into_stream(self.acceptor.config().clone())
            .await
            .map_err(|e| format!("TLS handshake: {e}"))?;
        drop(running);
        drop(permit);
        // The preface comes encrypted, so the socket cannot see it: ALPN says.
        let (io, session) = tls.get_ref();
        if session.alpn_protocol() == Some(b"h2") {
            io.watch().speaks_h2();
        }
        let cert = match (&self.authorities, session.peer_certificates()) {
            (Some(authorities), Some(chain)) => match authorities.identify(chain) {
                Ok(cert) => Some(Arc::new(cert)),
                Err(e) => {
                    tracing::info!(error = %e, "the client certificate names no tenant");
                    None
                }
            },
            _ => None,
        };
        Ok((tokio_util::either::Either::Right(tls), cert))
    }
}
