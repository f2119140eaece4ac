//! Starting and stopping: opening the store (with its start-up checks), the accept loops of
//! the proxy and admin listeners, and a bounded graceful shutdown.

use crate::scope::client_cert::ClientCert;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admin::Admin;
use crate::config::{Config, ConfigError, Settings};
use crate::connection::{Closed, Deadlines, Socket, Watch, Watched};
use crate::metrics::{self, Instrumented, Metrics};
use crate::operator::Resolver;
use crate::proxy::Proxy;
use crate::releases::Releases;
use crate::scope::Scoper;
use crate::secret::{SecretError, SecretHealth};
use crate::store::seal::Enveloped;
use crate::store::{OpenError, RedisSetup, Store, StoreError, StoreKind};
use crate::wiring::Wired;

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

/// Opens the store the settings choose ([`crate::store::open`]), behind the envelope of
/// records at rest, and reads the secret that its record ids are keyed with.
pub async fn open_store(wired: &Wired) -> Result<(Arc<dyn Store>, Scoper), Error> {
    open_store_reporting(wired, &crate::starting::Starting::default()).await
}

/// [`open_store`], telling `starting` when it waits to make the scope secret.
async fn open_store_reporting(
    wired: &Wired,
    starting: &crate::starting::Starting,
) -> Result<(Arc<dyn Store>, Scoper), Error> {
    let settings = &wired.settings;
    let mut store = crate::store::open(&settings.config, wired.redis.as_ref()).await?;
    if let Some(keys) = &wired.envelope.keys {
        tracing::info!(
            sealing_key = keys.sealing_id(),
            "recorded answers are sealed at rest"
        );
    }
    store = sealed(wired, store);
    let timeout = settings.config.store_timeout;
    // With replica acknowledgement on, the secret's write may wait for the replicas a few
    // times (`SECRET_ACK_TRIES`), each a round trip of its own that takes up to
    // `replica_ack_timeout` and then some: Redis notices a WAIT's end on its own timer
    // (every 1/hz s, 100 ms by default), so five 200 ms WAITs can take 1.5 s. Each try
    // gets a whole `store_timeout` beside its wait, so that the error says what was
    // missing (the replicas) rather than that the call timed out.
    let timeout = if settings.config.min_replicas_ack > 0 {
        let tries = crate::store::redis::SECRET_ACK_TRIES;
        timeout * (tries + 1) + settings.config.replica_ack_timeout * tries
    } else {
        timeout
    };
    let c = &settings.config;
    // A store of this process alone has no running instance to wait for.
    let delay = if store.kind().shared() {
        c.scope_secret_create_delay
    } else {
        Duration::ZERO
    };
    let secret = crate::secret::establish(
        &*store,
        settings.pinned_secret.as_ref(),
        &settings.namespace,
        delay,
        timeout,
        &store_place(wired, &*store),
        starting,
    )
    .await
    .map_err(|e| match e {
        SecretError::Store(e) => Error::Store(e),
        SecretError::Disagrees(why) => Error::ScopeSecret(why),
    })?;
    Ok((store, Scoper::new(&secret, &settings.namespace)))
}

/// Where `store` keeps its meta values, as the messages that name them spell them.
pub fn store_place(wired: &Wired, store: &dyn Store) -> crate::secret::StorePlace {
    use crate::secret::StorePlace;
    let c = &wired.settings.config;
    match store.kind() {
        StoreKind::Redis => StorePlace::Redis {
            cli: wired
                .redis
                .as_ref()
                .map_or_else(|| "redis-cli".to_string(), RedisSetup::cli),
            cluster: !store.can_list(),
        },
        StoreKind::Postgres => StorePlace::Postgres,
        StoreKind::Sqlite => StorePlace::Sqlite(
            c.store_path
                .as_deref()
                .unwrap_or(std::path::Path::new("."))
                .join(crate::store::sqlite::FILE_NAME),
        ),
        StoreKind::Memory => StorePlace::Memory,
    }
}

/// `store` behind the envelope. Always, keys or not: an instance without keys must still
/// know a sealed record when it meets one (and refuse it), never replay its envelope as if
/// it were the answer.
fn sealed(wired: &Wired, store: Arc<dyn Store>) -> Arc<dyn Store> {
    Arc::new(Enveloped::new(store, wired.envelope.clone()))
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

/// Binds the proxy and (if configured) admin listeners.
pub async fn bind(settings: &Settings) -> Result<(TcpListener, Option<TcpListener>), Error> {
    let c = &settings.config;
    let listener = crate::listener::listen(c.listen).map_err(|source| Error::Bind {
        addr: c.listen,
        source,
    })?;
    let admin = match c.admin_listen {
        Some(addr) => {
            Some(crate::listener::listen(addr).map_err(|source| Error::Bind { addr, source })?)
        }
        None => None,
    };
    check_file_limit(c);
    crate::listener::check_accept_queue();
    if let Some(warning) = crate::wiring::open_admin_warning(c) {
        tracing::warn!("{warning}");
    }
    Ok((listener, admin))
}

/// File descriptors beyond the client and upstream connections: the listeners, the store's
/// connections (Redis, its replica-acknowledgement links, PostgreSQL, SQLite's files), the
/// runtime's own and the log.
const OTHER_FILES: u64 = 128;

/// Raises the soft limit on open files to the hard one (as Go's runtime and nginx's
/// `worker_rlimit_nofile` do), and warns when the connection limits still cannot fit: past
/// it, accept fails with "Too many open files" and new clients get no answer at all.
fn check_file_limit(c: &Config) {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let mut lim = getrlimit(Resource::Nofile);
    if let (Some(cur), Some(max)) = (lim.current, lim.maximum) {
        if cur < max {
            let raised = Rlimit {
                current: Some(max),
                maximum: Some(max),
            };
            if setrlimit(Resource::Nofile, raised).is_ok() {
                lim = raised;
            }
        }
    }
    let Some(limit) = lim.current else {
        return;
    };
    let needed = (c.max_connections + c.max_upstream_connections + ADMIN_MAX_CONNECTIONS) as u64
        + OTHER_FILES;
    if limit < needed {
        tracing::warn!(
            limit,
            needed,
            max_connections = c.max_connections,
            max_upstream_connections = c.max_upstream_connections,
            admin_connections = ADMIN_MAX_CONNECTIONS,
            "the open-file limit (ulimit -n) is below what the connection limits can use; lower max_connections and max_upstream_connections, or raise the limit"
        );
    }
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

/// A serving thread besides the first, started with its store open; it serves once it is
/// given the shared state ([`Job`]).
struct Worker {
    job: tokio::sync::oneshot::Sender<Job>,
    done: tokio::sync::oneshot::Receiver<()>,
}

/// What a serving thread shares with the first.
struct Job {
    listener: std::net::TcpListener,
    proxy: Proxy,
    metrics: Arc<Metrics>,
    tasks: TaskTracker,
    stop: CancellationToken,
    end: tokio::sync::watch::Receiver<Option<Instant>>,
    limits: ConnLimits,
    open: Arc<Semaphore>,
    balance: Balance,
    tls: Option<Handshakes>,
}

impl Worker {
    /// Starts thread `n` and opens its store there (a Redis connection of its own; the
    /// other stores are shared). Fails as start-up fails if that store cannot be opened.
    async fn start(n: usize, wired: &Wired, shared: &Arc<dyn Store>) -> Result<Worker, Error> {
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel::<Result<(), Error>>();
        let (job_tx, job_rx) = tokio::sync::oneshot::channel::<Job>();
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        let wired = wired.clone();
        let shared = shared.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("idemgate-worker-{n}"))
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(Error::Runtime(e)));
                        return;
                    }
                };
                runtime.block_on(async move {
                    // Its own Redis connection; the first thread's start-up checks and
                    // scope secret hold for it.
                    let c = &wired.settings.config;
                    let store = match crate::store::open::for_thread(c, wired.redis.as_ref()).await
                    {
                        Ok(Some(store)) => sealed(&wired, store),
                        Ok(None) => shared,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e.into()));
                            return;
                        }
                    };
                    let _ = ready_tx.send(Ok(()));
                    // The first thread gave up (start-up failed elsewhere): nothing to serve.
                    let Ok(job) = job_rx.await else { return };
                    job.serve(store, wired.settings.config.store_timeout).await;
                    let _ = done_tx.send(());
                });
            });
        if let Err(e) = spawned {
            return Err(Error::Runtime(e));
        }
        match ready_rx.await {
            Ok(Ok(())) => Ok(Worker {
                job: job_tx,
                done: done_rx,
            }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(Error::Runtime(std::io::Error::other(
                "a serving thread ended during start-up",
            ))),
        }
    }
}

impl Job {
    async fn serve(self, store: Arc<dyn Store>, store_timeout: Duration) {
        let listener = match TcpListener::from_std(self.listener) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "a serving thread cannot accept connections");
                return;
            }
        };
        let store: Arc<dyn Store> = Arc::new(Instrumented::new(store, self.metrics, store_timeout));
        let proxy = self.proxy.sibling(store);
        accept_loop(
            listener,
            self.stop,
            self.end.clone(),
            self.limits,
            self.open,
            Some(self.balance),
            self.tls,
            move |req, peer| {
                let proxy = proxy.clone();
                async move { proxy.handle(req, peer).await }
            },
        )
        .await;
        // Exchanges this thread spawned run on its runtime: it stays up until they end, or
        // until the shutdown deadline.
        let end = (*self.end.borrow()).unwrap_or_else(Instant::now);
        let _ = tokio::time::timeout_at(end, self.tasks.wait()).await;
    }
}

/// Serves on already-bound listeners until `shutdown`, then drains; `serving.workers`
/// serve from the same listener on threads of their own.
async fn serve_on(
    wired: Wired,
    store: Arc<dyn Store>,
    scoper: Scoper,
    listener: TcpListener,
    admin: Option<TcpListener>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    serving: Serving,
) {
    let Serving { workers, reload } = serving;
    let place = store_place(&wired, &*store);
    let Wired {
        settings,
        listener_tls,
        upstream_tls,
        ..
    } = wired;
    let tasks = TaskTracker::new();
    let stop = CancellationToken::new();
    let c = &settings.config;
    let grace = c.shutdown_grace;
    let store_timeout = c.store_timeout;
    let metrics = Arc::new(Metrics::new());
    let limits = ConnLimits {
        deadlines: Deadlines {
            header: c.header_read_timeout,
            idle: c.idle_timeout,
            send: c.send_timeout,
        },
        max_connections: c.max_connections,
        h2_max_streams: c.h2_max_concurrent_streams,
        send_timeouts: metrics.send_timeouts(),
        evict: None,
    };
    // One cap on open connections for all serving threads.
    let open = Arc::new(Semaphore::new(limits.max_connections));
    // The TLS listener: one acceptor and one bound on handshakes for all serving threads,
    // and the task that reloads its certificate.
    let tls = listener_tls.as_ref().map(|t| Handshakes {
        acceptor: tokio_rustls::TlsAcceptor::from(t.config.clone()),
        permits: Arc::new(Semaphore::new(crate::tls::MAX_HANDSHAKES)),
        gauges: metrics.tls_handshakes(),
        // Read only where a route takes its tenant from them.
        authorities: t
            .authorities
            .clone()
            .filter(|_| settings.reads_client_certs()),
    });
    let reloader = listener_tls.as_ref().map(|t| {
        let (reloads, failures) = metrics.tls_reloads();
        tokio::spawn(
            crate::tls::Reloader::new(t, reloads, failures)
                .with_expiry(metrics.certificate_expiry("listener"))
                .run(),
        )
    });
    // The client certificates are read once, at start-up, as their connections use them.
    for (which, file) in [
        ("upstream_client", &settings.config.upstream_tls_cert_file),
        ("redis_client", &settings.config.redis_tls_cert_file),
        ("postgres_client", &settings.config.postgres_tls_cert_file),
    ] {
        if let Some(t) = file
            .as_deref()
            .and_then(|f| std::fs::read(f).ok())
            .and_then(|pem| crate::tls::leaf_expiry(&pem))
        {
            metrics.certificate_expiry(which).set(t);
        }
    }
    let store: Arc<dyn Store> = Arc::new(Instrumented::new(store, metrics.clone(), store_timeout));
    let restarted = Arc::new(tokio::sync::Notify::new());
    let watcher = tokio::spawn(metrics::watch_store(
        store.clone(),
        metrics.clone(),
        settings.config.redis_info_interval,
        restarted.clone(),
    ));
    let unknown_counter = tokio::spawn(metrics::count_unknown(
        store.clone(),
        metrics.clone(),
        settings.config.unknown_count_interval,
        store_timeout,
    ));
    let secret_health = Arc::new(SecretHealth::new(metrics.scope_secret_agreed()));
    // An embedded store's secret cannot be lost while its process runs.
    let secret_watch = (store.kind() != StoreKind::Memory).then(|| {
        let watch = crate::secret::Watch {
            store: store.clone(),
            secret: scoper.secret().clone(),
            pinned: settings.pinned_secret.is_some(),
            namespace: settings.namespace.clone(),
            interval: settings.config.scope_secret_check_interval,
            timeout: store_timeout,
            health: secret_health.clone(),
            now: restarted,
            place,
        };
        tokio::spawn(watch.run())
    });
    // The settings in force (the proxy's, the admin's lookups'): a reload swaps them.
    let live = crate::config::Live::new(settings.clone());
    let (config_reloader, hangup_task) = crate::reload::Reloader::start(reload, &live, &metrics);
    // Shutdown ends at one deadline, set when it starts; every drain below shares it.
    let (end_tx, end_rx) = tokio::sync::watch::channel(None::<Instant>);
    let admin_task = admin.map(|l| {
        let authorities = listener_tls.as_ref().and_then(|t| t.authorities.clone());
        let resolver = Resolver::new(live.clone(), scoper.clone(), authorities);
        let admin = Admin::new(store.clone(), store_timeout, metrics.clone(), live.clone())
            .with_resolver(resolver)
            .with_secret(secret_health.clone(), scoper.secret().clone())
            .with_reloader(config_reloader.clone());
        // The admin listener has connections of its own, so a flood of client connections
        // never keeps an operator out.
        // A silent connection cannot be told from a probe before it speaks, and each holds
        // one of the admin listener's connections: with the proxy's head deadline, 64
        // silent connections kept `/healthz` out for 10 s (and the kubelet restarts a pod
        // whose liveness probe fails). Probes, scrapes and the operator's calls send their
        // head at once.
        // An idle keep-alive connection (a scraper's, or one of a flood that made one
        // request each) is closed after a few seconds, and at the cap the oldest connection
        // serving nothing makes room for a new one: whatever holds the others, a probe
        // gets in.
        let limits = ConnLimits {
            max_connections: ADMIN_MAX_CONNECTIONS,
            deadlines: Deadlines {
                header: limits.deadlines.header.min(ADMIN_HEAD_TIMEOUT),
                idle: limits.deadlines.idle.min(ADMIN_IDLE_TIMEOUT),
                ..limits.deadlines
            },
            evict: Some(Arc::new(Quiet::default())),
            ..limits.clone()
        };
        tokio::spawn(accept_loop(
            l,
            stop.clone(),
            end_rx.clone(),
            limits,
            Arc::new(Semaphore::new(ADMIN_MAX_CONNECTIONS)),
            None,
            // Plain HTTP, whatever `listen` speaks: see docs/tls.md.
            None,
            move |req, peer| {
                let admin = admin.clone();
                async move { admin.handle(req, peer).await }
            },
        ))
    });
    let releases = Arc::new(Releases::new(metrics.pending_releases()));
    let proxy = Proxy::new(
        live,
        upstream_tls,
        store,
        scoper,
        tasks.clone(),
        metrics.clone(),
        releases.clone(),
        secret_health.clone(),
    );
    let mut done = Vec::new();
    let mut balances = Balance::for_threads(workers.len() + 1).into_iter();
    // With one thread there is nothing to balance.
    let own_balance = balances.next().filter(|_| !workers.is_empty());
    for (worker, balance) in workers.into_iter().zip(balances) {
        let job = clone_listener(&listener).map(|l| Job {
            listener: l,
            proxy: proxy.clone(),
            metrics: metrics.clone(),
            tasks: tasks.clone(),
            stop: stop.clone(),
            end: end_rx.clone(),
            limits: limits.clone(),
            open: open.clone(),
            balance,
            tls: tls.clone(),
        });
        match job {
            Ok(job) => {
                if worker.job.send(job).is_ok() {
                    done.push(worker.done);
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot share the listener with a serving thread; serving with fewer threads")
            }
        }
    }
    let proxy_task = tokio::spawn(accept_loop(
        listener,
        stop.clone(),
        end_rx,
        limits,
        open,
        own_balance,
        tls,
        move |req, peer| {
            let proxy = proxy.clone();
            async move { proxy.handle(req, peer).await }
        },
    ));
    shutdown.await;
    tracing::info!("shutting down: no new connections, draining in-flight requests");
    let end = Instant::now() + grace;
    let _ = end_tx.send(Some(end));
    stop.cancel();
    // Connections and the exchanges whose clients already left drain together, within one
    // grace period in all: what finishes is recorded before we exit.
    tasks.close();
    let exchanges = async {
        if tokio::time::timeout_at(end, tasks.wait()).await.is_err() {
            tracing::warn!("upstream exchanges still running after the shutdown grace period; their records will read as unknown");
        }
    };
    let _ = tokio::join!(proxy_task, exchanges);
    // Releases still pending were retried until the grace ran out: their claims were never
    // forwarded, and an operator may release them (until their lease runs out they read
    // as in progress, then as unknown).
    for id in releases.ids() {
        tracing::error!(record = %id, "shut down before the release of a claim that was never forwarded landed; it is safe to release");
    }
    for d in done {
        let _ = d.await;
    }
    if let Some(t) = admin_task {
        let _ = t.await;
    }
    watcher.abort();
    unknown_counter.abort();
    hangup_task.inspect(JoinHandle::abort);
    if let Some(r) = reloader {
        r.abort();
    }
    if let Some(w) = secret_watch {
        w.abort();
    }
    tracing::info!("stopped");
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
const ADMIN_MAX_CONNECTIONS: usize = 64;

/// What a listener's connections may hold.
#[derive(Clone)]
struct ConnLimits {
    // Counts connections closed by the send deadline.
    send_timeouts: prometheus_client::metrics::counter::Counter,
    deadlines: Deadlines,
    max_connections: usize,
    // Streams one h2 connection may have open at once.
    h2_max_streams: u32,
    // At the cap, close the oldest connection serving nothing instead of the new one.
    evict: Option<Arc<Quiet>>,
}

/// What a TLS listener's accept loops share: the acceptor (its key pair swapped by the
/// reloader) and the bound on handshakes running at once.
#[derive(Clone)]
struct Handshakes {
    acceptor: tokio_rustls::TlsAcceptor,
    permits: Arc<Semaphore>,
    gauges: crate::metrics::HandshakeGauges,
    // The client CAs one by one, when a route reads its tenant from client certificates.
    authorities: Option<Arc<crate::scope::client_cert::Authorities>>,
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
type ClientIo =
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
    async fn accept(
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

#[allow(clippy::too_many_arguments)]
async fn accept_loop<F, Fut>(
    listener: TcpListener,
    stop: CancellationToken,
    mut end: tokio::sync::watch::Receiver<Option<Instant>>,
    limits: ConnLimits,
    open: Arc<Semaphore>,
    balance: Option<Balance>,
    tls: Option<Handshakes>,
    handler: F,
) where
    F: Fn(hyper::Request<hyper::body::Incoming>, SocketAddr) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = hyper::Response<crate::body::Body>> + Send + 'static,
{
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
    // Connections are served from their own tasks, which each take a handle: a TLS
    // connection is handed to hyper only once its handshake is done.
    let builder = Arc::new(builder);
    let graceful = GracefulShutdown::new();
    let mut refused_since_log = 0u64;
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
        let mut permit = open.clone().try_acquire_owned().ok();
        if permit.is_none() && limits.evict.as_ref().is_some_and(|q| q.evict_oldest()) {
            permit = tokio::time::timeout(EVICT_WAIT, open.clone().acquire_owned())
                .await
                .ok()
                .and_then(Result::ok);
        }
        let Some(permit) = permit else {
            // Closed at once: its file descriptor is back before the next accept.
            drop(stream);
            refused_since_log += 1;
            if refused_since_log.is_power_of_two() {
                tracing::warn!(
                    max_connections = limits.max_connections,
                    refused = refused_since_log,
                    "connection limit reached; closing new connections as they arrive"
                );
            }
            continue;
        };
        refused_since_log = 0;
        let held = balance.as_ref().map(Balance::hold);
        let _ = stream.set_nodelay(true);
        let watch = Watch::accepted();
        let enlisted = limits.evict.as_ref().map(|q| q.enlist(watch.clone()));
        let handler = handler.clone();
        let on_request = watch.clone();
        // The client certificate's identity, set once the handshake is done (before any
        // request of the connection is read).
        // Only where a route reads certificates; otherwise no connection carries one.
        let peer_cert: Option<Arc<std::sync::OnceLock<Arc<ClientCert>>>> = tls
            .as_ref()
            .and_then(|t| t.authorities.as_ref())
            .map(|_| Arc::default());
        let cert_of = peer_cert.clone();
        let socket = Socket::new(stream);
        let hangup = socket.hangup();
        let of_connection = crate::connection::OfConnection {
            hangup: Some(hangup),
            ..Default::default()
        };
        let svc = service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
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
        });
        let io = Watched::new(socket, watch.clone());
        let (deadlines, send_timeouts) = (limits.deadlines, limits.send_timeouts.clone());
        // Taken now, before the connection's task runs: a shutdown that starts while it
        // handshakes waits for it, and closes it gracefully once it is served.
        let graceful_watch = graceful.watcher();
        let (builder, tls) = (builder.clone(), tls.clone());
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
            graceful_watch.watch(conn).await
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
    drop(listener);
    // Set before `stop` is cancelled, so it is there already.
    let current = *end.borrow_and_update();
    let end = match current {
        Some(end) => end,
        None => match end.changed().await {
            Ok(()) => end.borrow().unwrap_or_else(Instant::now),
            Err(_) => Instant::now(),
        },
    };
    if tokio::time::timeout_at(end, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("connections still open after the shutdown grace period; closing them");
    }
}

/// Another handle on the proxy's listening socket, for a serving thread to accept from.
fn clone_listener(listener: &TcpListener) -> std::io::Result<std::net::TcpListener> {
    use std::os::fd::{AsFd, OwnedFd};
    let fd: OwnedFd = listener.as_fd().try_clone_to_owned()?;
    Ok(std::net::TcpListener::from(fd))
}

/// How long a serving thread that holds more connections than another waits before it
/// accepts the next one itself.
const BALANCE_DEFER: Duration = Duration::from_millis(1);

/// The open connections of every serving thread, for spreading new ones across them.
#[derive(Clone)]
struct Balance {
    counts: Arc<[std::sync::atomic::AtomicUsize]>,
    me: usize,
}

impl Balance {
    /// One per serving thread.
    fn for_threads(n: usize) -> Vec<Balance> {
        let counts: Arc<[std::sync::atomic::AtomicUsize]> = (0..n)
            .map(|_| std::sync::atomic::AtomicUsize::new(0))
            .collect();
        (0..n)
            .map(|me| Balance {
                counts: counts.clone(),
                me,
            })
            .collect()
    }

    /// Whether this thread holds more connections than some other.
    fn ahead(&self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        let mine = self.counts[self.me].load(Relaxed);
        self.counts
            .iter()
            .enumerate()
            .any(|(i, c)| i != self.me && c.load(Relaxed) < mine)
    }

    /// Counts one connection for this thread until the guard is dropped.
    fn hold(&self) -> Held {
        self.counts[self.me].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Held(self.clone())
    }
}

/// One open connection of a serving thread.
struct Held(Balance);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.counts[self.0.me].fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}
