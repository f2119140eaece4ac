//! Building what serves: the store opened with its start-up checks (sealed at rest, its
//! scope secret read), the listeners bound, and the [`App`] over them: the proxy, the admin
//! API, their metrics and limits, and the tasks that run beside them.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::AbortHandle;
use tokio_util::task::TaskTracker;

use super::accept::{ConnLimits, ADMIN_MAX_CONNECTIONS};
use super::handshake::Handshakes;
use super::Error;
use crate::admin::Admin;
use crate::config::{Config, Settings};
use crate::metrics::{self, Instrumented, Metrics};
use crate::operator::Resolver;
use crate::proxy::Proxy;
use crate::releases::Releases;
use crate::scope::Scoper;
use crate::secret::{SecretError, SecretHealth};
use crate::store::seal::Enveloped;
use crate::store::{RedisSetup, Store, StoreKind};
use crate::tls::ListenerTls;
use crate::wiring::Wired;

/// How often the store's heartbeat moves forward (a store that keeps one: PostgreSQL).
const HEARTBEAT_EVERY: Duration = Duration::from_secs(1);

/// Opens the store the settings choose ([`crate::store::open`]), behind the envelope of
/// records at rest, and reads the secret that its record ids are keyed with.
pub async fn open_store(wired: &Wired) -> Result<(Arc<dyn Store>, Scoper), Error> {
    open_store_reporting(wired, &crate::starting::Starting::default()).await
}

/// [`open_store`], telling `starting` when it waits to make the scope secret.
pub(super) async fn open_store_reporting(
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
pub(super) fn sealed(wired: &Wired, store: Arc<dyn Store>) -> Arc<dyn Store> {
    Arc::new(Enveloped::new(store, wired.envelope.clone()))
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
    if let Some(warning) = crate::wiring::raw_credential_warning(settings) {
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

/// What serves, built over the opened store: the proxy and the admin API, their metrics,
/// the limits their connections get, and the tasks that run beside them.
pub(super) struct App {
    pub(super) proxy: Proxy,
    /// The admin API, when it has a listener.
    pub(super) admin: Option<Admin>,
    pub(super) metrics: Arc<Metrics>,
    /// The upstream exchanges in flight (one may outlive its client's connection).
    pub(super) tasks: TaskTracker,
    /// Releases of claims never forwarded that are still being retried.
    pub(super) releases: Arc<Releases>,
    /// What the proxy listener's connections may hold.
    pub(super) limits: ConnLimits,
    /// One cap on open connections for all serving threads.
    pub(super) open: Arc<Semaphore>,
    /// The TLS listener: one acceptor and one bound on handshakes for all serving threads.
    pub(super) tls: Option<Handshakes>,
    /// Tasks beside the serving (watchers, reloaders), stopped once it has drained.
    pub(super) background: Vec<AbortHandle>,
    pub(super) grace: Duration,
}

impl App {
    /// Builds what serves over `store`; the admin API only `with_admin` (a listener for it).
    /// `reload` is where `SIGHUP` and `POST /config/reload` read the configuration again.
    pub(super) fn build(
        wired: Wired,
        store: Arc<dyn Store>,
        scoper: Scoper,
        reload: Option<(crate::reload::Source, Option<crate::reload::Hangups>)>,
        with_admin: bool,
    ) -> App {
        let place = store_place(&wired, &*store);
        let Wired {
            settings,
            listener_tls,
            upstream_tls,
            ..
        } = wired;
        let c = &settings.config;
        let store_timeout = c.store_timeout;
        let metrics = Arc::new(Metrics::new());
        let limits = ConnLimits::of(c, &metrics);
        let open = Arc::new(Semaphore::new(limits.max_connections));
        let tls = handshakes(listener_tls.as_ref(), &settings, &metrics);
        let mut background = Vec::new();
        // The task that reloads the TLS listener's certificate.
        background.extend(listener_tls.as_ref().map(|t| {
            let (reloads, failures) = metrics.tls_reloads();
            let reloader = crate::tls::Reloader::new(t, reloads, failures)
                .with_expiry(metrics.certificate_expiry("listener"));
            tokio::spawn(reloader.run()).abort_handle()
        }));
        note_client_certs(c, &metrics);
        let store: Arc<dyn Store> =
            Arc::new(Instrumented::new(store, metrics.clone(), store_timeout));
        let restarted = Arc::new(tokio::sync::Notify::new());
        let watcher = metrics::watch_store(
            store.clone(),
            metrics.clone(),
            c.redis_info_interval,
            restarted.clone(),
        );
        background.push(tokio::spawn(watcher).abort_handle());
        let unknown = metrics::count_unknown(
            store.clone(),
            metrics.clone(),
            c.unknown_count_interval,
            store_timeout,
        );
        background.push(tokio::spawn(unknown).abort_handle());
        let heartbeat = metrics::watch_heartbeat(
            store.clone(),
            metrics.clone(),
            HEARTBEAT_EVERY,
            store_timeout,
        );
        background.push(tokio::spawn(heartbeat).abort_handle());
        let secret_health = Arc::new(SecretHealth::new(metrics.scope_secret_agreed()));
        // An embedded store's secret cannot be lost while its process runs.
        if store.kind() != StoreKind::Memory {
            let watch = crate::secret::Watch {
                store: store.clone(),
                secret: scoper.secret().clone(),
                pinned: settings.pinned_secret.is_some(),
                namespace: settings.namespace.clone(),
                interval: c.scope_secret_check_interval,
                timeout: store_timeout,
                health: secret_health.clone(),
                now: restarted,
                place,
            };
            background.push(tokio::spawn(watch.run()).abort_handle());
        }
        // The settings in force (the proxy's, the admin's lookups'): a reload swaps them.
        let live = crate::config::Live::new(settings.clone());
        let (config_reloader, hangups) = crate::reload::Reloader::start(reload, &live, &metrics);
        background.extend(hangups.map(|t| t.abort_handle()));
        let admin = with_admin.then(|| {
            let authorities = listener_tls.as_ref().and_then(|t| t.authorities.clone());
            let resolver = Resolver::new(live.clone(), scoper.clone(), authorities);
            Admin::new(store.clone(), store_timeout, metrics.clone(), live.clone())
                .with_resolver(resolver)
                .with_secret(secret_health.clone(), scoper.secret().clone())
                .with_reloader(config_reloader.clone())
        });
        let tasks = TaskTracker::new();
        let releases = Arc::new(Releases::new(metrics.pending_releases()));
        let proxy = Proxy::new(
            live,
            upstream_tls,
            store,
            scoper,
            tasks.clone(),
            metrics.clone(),
            releases.clone(),
            secret_health,
        );
        App {
            proxy,
            admin,
            metrics,
            tasks,
            releases,
            limits,
            open,
            tls,
            background,
            grace: c.shutdown_grace,
        }
    }
}

/// The TLS listener's handshakes, shared by all serving threads.
fn handshakes(
    listener_tls: Option<&ListenerTls>,
    settings: &Settings,
    metrics: &Metrics,
) -> Option<Handshakes> {
    listener_tls.map(|t| Handshakes {
        acceptor: tokio_rustls::TlsAcceptor::from(t.config.clone()),
        permits: Arc::new(Semaphore::new(crate::tls::MAX_HANDSHAKES)),
        gauges: metrics.tls_handshakes(),
        // Read only where a route takes its tenant from them.
        authorities: t
            .authorities
            .clone()
            .filter(|_| settings.reads_client_certs()),
    })
}

/// The expiry of each client certificate idemgate presents, on its gauge. They are read
/// once, at start-up, as their connections use them.
fn note_client_certs(c: &Config, metrics: &Metrics) {
    for (which, file) in [
        ("upstream_client", &c.upstream_tls_cert_file),
        ("redis_client", &c.redis_tls_cert_file),
        ("postgres_client", &c.postgres_tls_cert_file),
    ] {
        if let Some(t) = file
            .as_deref()
            .and_then(|f| std::fs::read(f).ok())
            .and_then(|pem| crate::tls::leaf_expiry(&pem))
        {
            metrics.certificate_expiry(which).set(t);
        }
    }
}
