//! Starting and stopping: the store opened with its start-up checks, the listeners bound,
//! the accept loops of the proxy and admin listeners, and a bounded graceful shutdown.
//!
//! - `build`: opening the store, binding the listeners, and the [`App`](build::App) that
//!   serves (the proxy, the admin API, their metrics and limits, the tasks beside them).
//! - `serve`: the accept loops over the app until the shutdown signal; `threads`, the
//!   serving threads besides the first (`worker_threads`) and the balance between them.
//! - `accept`: one listener's accept loop: the cap on connections, each connection's
//!   deadlines, hyper serving it; `handshake`, the TLS listener's handshakes.
//! - `drain`: the graceful shutdown within one `shutdown_grace`.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, ConfigError};
use crate::store::{OpenError, Store, StoreError};
use crate::wiring::Wired;

mod accept;
mod build;
mod drain;
mod handshake;
mod serve;
mod threads;

use self::build::open_store_reporting;
pub use self::build::{bind, open_store, store_place};
use self::serve::serve_on;
use self::threads::Worker;

/// Why idemgate could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Bad configuration (exit code 64).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A listener could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The store could not be reached at start-up.
    #[error("cannot use the store: {0}")]
    Store(#[from] StoreError),
    /// Redis could not be reached at start-up; `addr` is its host and port, never the URL's
    /// credentials.
    #[error("cannot use Redis at {addr}: {source}")]
    RedisUnreachable {
        /// `host:port` (or the socket path) from `redis_url`.
        addr: String,
        /// Why.
        source: StoreError,
    },
    /// A serving thread could not be started.
    #[error("cannot start a serving thread: {0}")]
    Runtime(std::io::Error),
    /// The store's scope secret (or its namespace's verifier) is not this instance's.
    #[error("scope secret: {0}")]
    ScopeSecret(String),
    /// Redis would evict records, which would silently turn retries into second executions.
    #[error("Redis maxmemory-policy is `{0}`: it may evict idempotency records and let retries execute twice. Set `maxmemory-policy noeviction` on the Redis that idemgate uses")]
    EvictingRedis(String),
}

impl From<OpenError> for Error {
    fn from(e: OpenError) -> Error {
        match e {
            OpenError::Store(e) => Error::Store(e),
            OpenError::RedisUnreachable { addr, source } => {
                Error::RedisUnreachable { addr, source }
            }
            OpenError::EvictingRedis(policy) => Error::EvictingRedis(policy),
        }
    }
}

impl Error {
    /// The process exit code (sysexits): 64 bad configuration, 69 a dependency unavailable,
    /// 71 an OS error.
    pub fn exit_code(&self) -> i32 {
        match self {
            Error::Config(_) | Error::EvictingRedis(_) | Error::ScopeSecret(_) => 64,
            Error::Store(_) | Error::RedisUnreachable { .. } => 69,
            Error::Bind { .. } | Error::Runtime(_) => 71,
        }
    }
}

/// A running idemgate, started in-process (tests, the lab).
pub struct Running {
    addr: SocketAddr,
    admin_addr: Option<SocketAddr>,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl Running {
    /// Where the proxy listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
    /// Where the admin listener listens, if on.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin_addr
    }
    /// Stops accepting, drains in-flight requests (bounded) and waits until done.
    pub async fn shutdown(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}

/// Validates the configuration, binds its listeners, opens the store and serves in a
/// background task until [`Running::shutdown`].
pub async fn start(config: Config) -> Result<Running, Error> {
    start_wrapped(config, |store| store).await
}

/// [`start`], with the opened store passed through `wrap` first (the lab keeps a list of
/// the records it made, to delete them at the end).
pub async fn start_wrapped(
    config: Config,
    wrap: impl FnOnce(Arc<dyn Store>) -> Arc<dyn Store>,
) -> Result<Running, Error> {
    let wired = Wired::new(config)?;
    let (listener, admin) = bind(&wired.settings).await?;
    let listen = wired.settings.config.listen;
    let addr = local_addr(&listener, listen)?;
    let admin_addr = match &admin {
        Some(l) => Some(local_addr(l, listen)?),
        None => None,
    };
    let (store, scoper) = opening(&wired, &listener, admin.as_ref(), |starting| {
        let wired = &wired;
        async move { open_store_reporting(wired, &starting).await }
    })
    .await?;
    let store = wrap(store);
    let stop = CancellationToken::new();
    let token = stop.clone();
    let task = tokio::spawn(async move {
        let stop = token.cancelled_owned();
        serve_on(
            wired,
            store,
            scoper,
            listener,
            admin,
            stop,
            Serving::default(),
        )
        .await;
    });
    Ok(Running {
        addr,
        admin_addr,
        stop,
        task,
    })
}

fn local_addr(l: &TcpListener, fallback: SocketAddr) -> Result<SocketAddr, Error> {
    l.local_addr().map_err(|source| Error::Bind {
        addr: fallback,
        source,
    })
}

/// Opens the store and serves until `shutdown` resolves (what the binary runs).
///
/// With `worker_threads = N`, the calling thread is the first of N serving threads; each of
/// the others runs an event loop of its own (a current-thread runtime) with its own
/// connection to Redis and its own upstream connection pool, and accepts from the same
/// listener. A connection stays on the thread that accepted it, and so does everything its
/// requests do: no request crosses threads, and each thread's Redis connection writes the
/// calls of that thread's requests together. The embedded, SQLite and PostgreSQL stores are
/// shared by all threads.
/// With `reload`, `SIGHUP` (caught from the start, never the end of the process) and `POST
/// /config/reload` reload the configuration from it (see [`crate::reload`]).
pub async fn run(
    wired: Wired,
    listener: TcpListener,
    admin: Option<TcpListener>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    reload: Option<crate::reload::Source>,
) -> Result<(), Error> {
    let reload = reload.map(|source| (source, crate::reload::hangups()));
    let mut shutdown = Box::pin(shutdown);
    let open = |starting: Arc<crate::starting::Starting>| {
        let wired = &wired;
        async move {
            let (store, scoper) = open_store_reporting(wired, &starting).await?;
            let mut workers = Vec::new();
            for n in 1..wired.settings.config.worker_threads.max(1) {
                workers.push(Worker::start(n, wired, &store).await?);
            }
            Ok::<_, Error>((store, scoper, workers))
        }
    };
    let started = tokio::select! {
        started = opening(&wired, &listener, admin.as_ref(), open) => started?,
        () = &mut shutdown => {
            tracing::info!("stopped before the store was open");
            return Ok(());
        }
    };
    let (store, scoper, workers) = started;
    let serving = Serving { workers, reload };
    serve_on(wired, store, scoper, listener, admin, shutdown, serving).await;
    Ok(())
}

/// What the binary's serving has beside the listeners: the other serving threads, and the
/// source that `SIGHUP` and `POST /config/reload` reload the configuration from.
#[derive(Default)]
struct Serving {
    workers: Vec<Worker>,
    reload: Option<(crate::reload::Source, Option<crate::reload::Hangups>)>,
}

/// Runs `open` (the store's opening) while the listeners answer as [`crate::starting`]
/// says: probes at once, everything else 503 with the time left.
async fn opening<T, Fut: Future<Output = T>>(
    wired: &Wired,
    listener: &TcpListener,
    admin: Option<&TcpListener>,
    open: impl FnOnce(Arc<crate::starting::Starting>) -> Fut,
) -> T {
    let starting = crate::starting::Starting::new();
    let tls = wired
        .listener_tls
        .as_ref()
        .map(|t| tokio_rustls::TlsAcceptor::from(t.config.clone()));
    crate::starting::answering_while(
        listener,
        admin,
        tls,
        wired.settings.config.header_read_timeout,
        &starting,
        open(starting.clone()),
    )
    .await
}
