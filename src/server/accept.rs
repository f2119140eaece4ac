//! A listener's accept loop: the cap on open connections (and, on the admin listener,
//! closing the oldest quiet one to make room), each connection's deadlines, its TLS
//! handshake, and hyper serving it until the shutdown drains it.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::handshake::Handshakes;
use super::threads::{Balance, BALANCE_DEFER};
use crate::config::Config;
use crate::connection::{Closed, Deadlines, Socket, Watch, Watched};
use crate::metrics::Metrics;
use crate::scope::client_cert::ClientCert;

/// What every accept loop of one listener shares, whichever thread it runs on.
#[derive(Clone)]
pub(super) struct Accepting {
    /// Cancelled when the shutdown starts: no new connections.
    pub(super) stop: CancellationToken,
    /// When the shutdown ends: set before `stop` is cancelled.
    pub(super) end: tokio::sync::watch::Receiver<Option<Instant>>,
    pub(super) limits: ConnLimits,
    /// The listener's cap on open connections, one for all its threads.
    pub(super) open: Arc<Semaphore>,
    /// The TLS handshakes, when the listener speaks TLS.
    pub(super) tls: Option<Handshakes>,
}

/// How long an admin connection may take to send its request head, from accept.
const ADMIN_HEAD_TIMEOUT: Duration = Duration::from_secs(1);

/// How long an admin connection may stay idle between requests.
const ADMIN_IDLE_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a new admin connection at the cap waits for the one closed for it to let go.
const EVICT_WAIT: Duration = Duration::from_millis(500);

/// A listener's open connections in the order they were accepted, for closing the oldest
/// that serves nothing when a new one arrives at the cap.
#[derive(Default)]
struct Quiet {
    open: std::sync::Mutex<std::collections::BTreeMap<u64, Watch>>,
    next: std::sync::atomic::AtomicU64,
}

impl Quiet {
    /// Lists `watch` until the returned guard is dropped.
    fn enlist(self: &Arc<Self>, watch: Watch) -> Enlisted {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.lock().insert(id, watch);
        Enlisted {
            list: self.clone(),
            id,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<u64, Watch>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Closes the oldest connection that serves no request; whether there was one.
    fn evict_oldest(&self) -> bool {
        self.lock().values().any(Watch::evict_if_quiet)
    }
}

/// One listed connection.
struct Enlisted {
    list: Arc<Quiet>,
    id: u64,
}

impl Drop for Enlisted {
    fn drop(&mut self) {
        self.list.lock().remove(&self.id);
    }
}

/// Connections the admin listener holds open at most: enough for probes, scrapes and an
/// operator, and separate from `max_connections`.
pub(super) const ADMIN_MAX_CONNECTIONS: usize = 64;

/// What a listener's connections may hold.
#[derive(Clone)]
pub(super) struct ConnLimits {
    // Counts connections closed by the send deadline.
    send_timeouts: prometheus_client::metrics::counter::Counter,
    deadlines: Deadlines,
    pub(super) max_connections: usize,
    // Streams one h2 connection may have open at once.
    h2_max_streams: u32,
    // At the cap, close the oldest connection serving nothing instead of the new one.
    evict: Option<Arc<Quiet>>,
}

impl ConnLimits {
    /// The proxy listener's limits, from the settings.
    pub(super) fn of(c: &Config, metrics: &Metrics) -> ConnLimits {
        ConnLimits {
            deadlines: Deadlines {
                header: c.header_read_timeout,
                idle: c.idle_timeout,
                send: c.send_timeout,
            },
            max_connections: c.max_connections,
            h2_max_streams: c.h2_max_concurrent_streams,
            send_timeouts: metrics.send_timeouts(),
            evict: None,
        }
    }

    /// The admin listener's limits, beside the proxy's (`self`).
    ///
    /// The admin listener has connections of its own, so a flood of client connections
    /// never keeps an operator out.
    /// A silent connection cannot be told from a probe before it speaks, and each holds
    /// one of the admin listener's connections: with the proxy's head deadline, 64
    /// silent connections kept `/healthz` out for 10 s (and the kubelet restarts a pod
    /// whose liveness probe fails). Probes, scrapes and the operator's calls send their
    /// head at once.
    /// An idle keep-alive connection (a scraper's, or one of a flood that made one
    /// request each) is closed after a few seconds, and at the cap the oldest connection
    /// serving nothing makes room for a new one: whatever holds the others, a probe
    /// gets in.
    pub(super) fn for_admin(&self) -> ConnLimits {
        ConnLimits {
            max_connections: ADMIN_MAX_CONNECTIONS,
            deadlines: Deadlines {
                header: self.deadlines.header.min(ADMIN_HEAD_TIMEOUT),
                idle: self.deadlines.idle.min(ADMIN_IDLE_TIMEOUT),
                ..self.deadlines
            },
            evict: Some(Arc::new(Quiet::default())),
            ..self.clone()
        }
    }
}

/// Accepts connections from `listener` and serves each with `handler` until `accepting.stop`,
/// then lets the open ones finish until the shutdown's end. `balance` spreads connections
/// across serving threads (none with one thread).
pub(super) async fn accept_loop<F, Fut>(
    listener: TcpListener,
    accepting: Accepting,
    balance: Option<Balance>,
    handler: F,
) where
    F: Fn(hyper::Request<hyper::body::Incoming>, SocketAddr) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = hyper::Response<crate::body::Body>> + Send + 'static,
{
    // Connections are served from their own tasks, which each take a handle: a TLS
    // connection is handed to hyper only once its handshake is done.
    let builder = Arc::new(http(&accepting.limits));
    let graceful = GracefulShutdown::new();
    let mut refused_since_log = 0u64;
    let stop = &accepting.stop;
    loop {
        // A thread that holds more connections than another lets the other take the next
        // one, for a moment: both are woken for every new connection, and the first awake
        // would otherwise take them all (keep-alive connections stay where they land).
        if balance.as_ref().is_some_and(Balance::ahead) {
            tokio::select! {
                _ = tokio::time::sleep(BALANCE_DEFER) => {}
                _ = stop.cancelled() => break,
            }
        }
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = stop.cancelled() => break,
        };
        let Some(permit) = admit(&accepting, &mut refused_since_log).await else {
            // Closed at once: its file descriptor is back before the next accept.
            drop(stream);
            continue;
        };
        let connection = Connection {
            permit,
            held: balance.as_ref().map(Balance::hold),
            builder: builder.clone(),
            graceful: graceful.watcher(),
        };
        connection.spawn(stream, peer, &accepting, handler.clone());
    }
    drop(listener);
    super::drain::connections(accepting.end, graceful).await;
}

/// hyper's server for one listener's connections.
fn http(limits: &ConnLimits) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        // Head and idle deadlines are kept by `connection::Watch`, from accept on; hyper's
        // own timer would start late (after protocol detection) and would count keep-alive
        // idleness as head time.
        .header_read_timeout(None)
        // A client that sends a whole request and hangs up (a load balancer cutting the
        // connection, a phone in a tunnel) is the client this product exists for: its
        // request must still be claimed, forwarded and recorded so that its retry gets
        // the replay. Without half-close hyper drops the request as soon as it reads
        // the EOF, sometimes before the claim.
        .half_close(true);
    // hyper's default (200) let two h2c clients hold 400 pass-through requests, each with
    // an upstream connection, past the file descriptors `max_connections` was sized for.
    builder
        .http2()
        .max_concurrent_streams(limits.h2_max_streams);
    builder
}

/// A place among the listener's open connections for a new one; at the cap, the oldest
/// quiet connection's when the listener evicts, else none (and the refusal is logged at
/// each power of two of `refused_since_log`).
async fn admit(accepting: &Accepting, refused_since_log: &mut u64) -> Option<OwnedSemaphorePermit> {
    let (open, limits) = (&accepting.open, &accepting.limits);
    let mut permit = open.clone().try_acquire_owned().ok();
    if permit.is_none() && limits.evict.as_ref().is_some_and(|q| q.evict_oldest()) {
        permit = tokio::time::timeout(EVICT_WAIT, open.clone().acquire_owned())
            .await
            .ok()
            .and_then(Result::ok);
    }
    if permit.is_none() {
        *refused_since_log += 1;
        if refused_since_log.is_power_of_two() {
            tracing::warn!(
                max_connections = limits.max_connections,
                refused = *refused_since_log,
                "connection limit reached; closing new connections as they arrive"
            );
        }
    } else {
        *refused_since_log = 0;
    }
    permit
}

/// What one accepted connection holds while it is served.
struct Connection {
    // Its place among the listener's open connections.
    permit: OwnedSemaphorePermit,
    // Counted as this thread's while open.
    held: Option<super::threads::Held>,
    builder: Arc<auto::Builder<TokioExecutor>>,
    // Taken before the connection's task runs: a shutdown that starts while it handshakes
    // waits for it, and closes it gracefully once it is served.
    graceful: hyper_util::server::graceful::Watcher,
}

impl Connection {
    /// Serves `stream` in a task of its own, under its deadlines.
    fn spawn<F, Fut>(self, stream: TcpStream, peer: SocketAddr, accepting: &Accepting, handler: F)
    where
        F: Fn(hyper::Request<hyper::body::Incoming>, SocketAddr) -> Fut
            + Clone
            + Send
            + Sync
            + 'static,
        Fut: Future<Output = hyper::Response<crate::body::Body>> + Send + 'static,
    {
        let limits = &accepting.limits;
        let _ = stream.set_nodelay(true);
        let watch = Watch::accepted();
        let enlisted = limits.evict.as_ref().map(|q| q.enlist(watch.clone()));
        // The client certificate's identity, set once the handshake is done (before any
        // request of the connection is read).
        // Only where a route reads certificates; otherwise no connection carries one.
        let peer_cert: Option<Arc<std::sync::OnceLock<Arc<ClientCert>>>> = accepting
            .tls
            .as_ref()
            .and_then(|t| t.authorities.as_ref())
            .map(|_| Arc::default());
        let socket = Socket::new(stream);
        let svc = service(handler, peer, &watch, peer_cert.clone(), &socket);
        let io = Watched::new(socket, watch.clone());
        let (deadlines, send_timeouts) = (limits.deadlines, limits.send_timeouts.clone());
        let Connection {
            permit,
            held,
            builder,
            graceful,
        } = self;
        let tls = accepting.tls.clone();
        let conn = async move {
            let io = match &tls {
                None => tokio_util::either::Either::Left(io),
                Some(tls) => {
                    let (io, cert) = tls.accept(io).await?;
                    if let Some(cert) = cert {
                        if let Some(slot) = &peer_cert {
                            let _ = slot.set(cert);
                        }
                    }
                    io
                }
            };
            let conn = builder.serve_connection(TokioIo::new(io), svc).into_owned();
            graceful.watch(conn).await
        };
        // Boxed with its output type spelled out: without it, the compiler cannot prove the
        // spawned future `Send` for every lifetime of hyper's boxed error.
        let conn: std::pin::Pin<
            Box<dyn Future<Output = Result<(), crate::body::BoxError>> + Send>,
        > = Box::pin(conn);
        tokio::spawn(async move {
            match watch.supervise(deadlines, conn).await {
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, peer = %peer, "connection ended with an error")
                }
                Ok(Ok(())) => {}
                Err(Closed::Quiet) => {
                    tracing::debug!(peer = %peer, "connection closed: no request head in time, or idle")
                }
                Err(Closed::SendTimeout) => {
                    send_timeouts.inc();
                    tracing::info!(peer = %peer, send_timeout = ?deadlines.send, "connection closed: the client read nothing of its answer for send_timeout");
                }
            }
            drop(enlisted);
            drop(permit);
            drop(held);
        });
    }
}

/// The hyper service of one connection: each request carries what the connection knows
/// (the client certificate's identity, the socket's hang-up) to `handler`, and its answer
/// is watched until its last frame is taken.
fn service<F, Fut>(
    handler: F,
    peer: SocketAddr,
    watch: &Watch,
    cert_of: Option<Arc<std::sync::OnceLock<Arc<ClientCert>>>>,
    socket: &Socket,
) -> impl hyper::service::Service<
    hyper::Request<hyper::body::Incoming>,
    Response = hyper::Response<crate::body::Body>,
    Error = Infallible,
    Future = impl Future<Output = Result<hyper::Response<crate::body::Body>, Infallible>> + Send,
> + Clone
       + Send
       + 'static
where
    F: Fn(hyper::Request<hyper::body::Incoming>, SocketAddr) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = hyper::Response<crate::body::Body>> + Send + 'static,
{
    let on_request = watch.clone();
    let of_connection = crate::connection::OfConnection {
        hangup: Some(socket.hangup()),
        ..Default::default()
    };
    service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
        if let Some(cert) = cert_of.as_ref().and_then(|c| c.get()) {
            req.extensions_mut().insert(cert.clone());
        }
        // HTTP/1.x only: its requests are served one at a time, so the connection's end
        // is this request's client gone. An h2 stream's reset drops its request itself.
        let mut of = of_connection.clone();
        if req.version() > hyper::Version::HTTP_11 {
            of.hangup = None;
        }
        req.extensions_mut().insert(of);
        let handler = handler.clone();
        let serving = on_request.serving();
        let answering_on = on_request.clone();
        async move {
            let res = handler(req, peer).await;
            // Served until the answer's last frame is taken: an HTTP/2 stream still
            // sending its answer keeps its connection from counting as idle.
            // Over h2 a closed flow-control window writes nothing, so the socket's
            // stall never shows: the answer's own progress is watched instead.
            let answering = answering_on.answering();
            Ok::<_, Infallible>(res.map(|b| crate::connection::tracked(b, answering, serving)))
        }
    })
}
