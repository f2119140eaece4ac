//! The connection behind the Redis store, one per topology, all multiplexed (one socket per
//! node, shared by every request):
//!
//! - one server: redis-rs's [`ConnectionManager`], which reconnects by itself when the
//!   connection breaks, made anew when a call on it went unanswered ([`Renewing`]);
//! - Sentinel: a connection to the primary that the sentinels name, given up as soon as it
//!   breaks, is cancelled, or finds a replica (`READONLY`), so that the next call asks the
//!   sentinels again and follows a promoted replica without a restart;
//! - Cluster: redis-rs's async cluster connection, which routes each script by its key's
//!   slot, follows MOVED and ASK, and reloads the slot map after a failover; made anew
//!   when a call on it went unanswered ([`Renewing`]), seeded with every node the last slot
//!   map named, so that it learns the current map even when a node went silent without
//!   closing its connections.
//!
//! TLS and the ACL user apply to every node, sentinels included.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::{
    ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection,
};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClientBuilder, SentinelServerType};
use redis::{
    AsyncConnectionConfig, Cmd, ConnectionAddr, IntoConnectionInfo, Pipeline, RedisError,
    RedisFuture, RedisResult, TlsCertificates, TlsMode, Value,
};

use super::renewing::{Opener, Renewing, RenewingInner};
use super::setup::{RedisSetup, Tls, Topology};

/// A connection to Redis, whatever its topology. Cheap to clone: clones share the sockets.
#[derive(Clone)]
pub enum Link {
    /// One server.
    Single(Renewing<ConnectionManager>),
    /// The primary named by sentinels.
    Sentinel(Renewing<MultiplexedConnection>),
    /// A cluster.
    Cluster(Renewing<ClusterConnection>),
}

impl Link {
    /// Connects, one attempt bounded by `connect_timeout` per node. Errors are redis-rs's.
    /// `response_timeout` (`store_timeout`) bounds each call to a cluster node, and says
    /// when a call that was dropped unfinished had waited long enough for its server to
    /// be taken for silent (see [`Renewing`]).
    pub async fn open(
        setup: &RedisSetup,
        connect_timeout: Duration,
        response_timeout: Duration,
    ) -> RedisResult<Link> {
        Self::open_following(setup, connect_timeout, response_timeout, None).await
    }

    /// As [`open`](Self::open); with Sentinel, a link that follows `leader`'s view of the
    /// primary (see [`Link::primary_epoch`]) instead of asking the sentinels on a timer of
    /// its own. Other topologies ignore `leader`.
    pub async fn open_following(
        setup: &RedisSetup,
        connect_timeout: Duration,
        response_timeout: Duration,
        leader: Option<Arc<AtomicU64>>,
    ) -> RedisResult<Link> {
        install_crypto();
        let certs = setup.tls.as_ref().map(certificates);
        match &setup.topology {
            Topology::Single(url) => {
                open_single(setup, url, certs, connect_timeout, response_timeout).await
            }
            Topology::Sentinel { sentinels, master } => {
                let sentinel = Sentinel {
                    sentinels,
                    master,
                    leader,
                };
                open_sentinel(setup, sentinel, certs, connect_timeout).await
            }
            Topology::Cluster { nodes } => {
                open_cluster(setup, nodes, certs, connect_timeout, response_timeout).await
            }
        }
    }

    /// With Sentinel, the count of primary changes this link's watcher has seen: links
    /// opened with it as their leader ([`open_following`](Self::open_following)) give up
    /// their connections when it moves, as this one does.
    pub fn primary_epoch(&self) -> Option<Arc<AtomicU64>> {
        match self {
            Link::Sentinel(s) => s.inner.epoch.clone(),
            _ => None,
        }
    }

    /// Whether this is a cluster (commands without a key must then be routed explicitly).
    pub fn is_cluster(&self) -> bool {
        matches!(self, Link::Cluster(_))
    }
}

/// The connection to one server (`redis_url`), made now so that a wrong address,
/// password or certificate stops start-up.
async fn open_single(
    setup: &RedisSetup,
    url: &str,
    certs: Option<TlsCertificates>,
    connect_timeout: Duration,
    response_timeout: Duration,
) -> RedisResult<Link> {
    let client = single_client(setup, url, certs)?;
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(connect_timeout))
        .set_response_timeout(None)
        // Reconnection happens in the background; a request that finds the
        // connection down fails at once (503) rather than waiting through a
        // retry ladder.
        .set_number_of_retries(2)
        .set_max_delay(Duration::from_secs(1));
    let open: Opener<ConnectionManager> = Box::new(move || {
        let (client, config) = (client.clone(), config.clone());
        Box::pin(async move {
            tokio::time::timeout(
                connect_timeout * 2,
                ConnectionManager::new_with_config(client, config),
            )
            .await
            .map_err(|_| timed_out("no connection in time"))?
        })
    });
    // A call that meets a certificate the client refuses (redis-rs's own reconnect
    // after a restart) gives the manager up too, so that the calls after it are
    // told why at once (see `Renewing::failed`) instead of each waiting on the
    // manager's retries until its deadline.
    let link = Renewing::new(
        open,
        response_timeout / 2,
        |e| e.is_timeout() || fails_fast(e),
        None,
        connect_timeout * 2,
    );
    // The first connection is made now, so that a wrong address, password or
    // certificate stops start-up.
    link.connection().await?;
    Ok(Link::Single(link))
}

/// The client of one server (`redis_url`), with the ACL user and TLS of `setup`.
pub(super) fn single_client(
    setup: &RedisSetup,
    url: &str,
    certs: Option<TlsCertificates>,
) -> RedisResult<redis::Client> {
    let mut info = url.into_connection_info()?;
    let mut settings = info.redis_settings().clone();
    if let Some(user) = &setup.username {
        settings = settings.set_username(user);
    }
    if let Some(password) = &setup.password {
        settings = settings.set_password(password.expose());
    }
    info = info.set_redis_settings(settings);
    if let (ConnectionAddr::TcpTls { host, port, .. }, Some(tls)) =
        (info.addr().clone(), &setup.tls)
    {
        let addr = node_addr(&host, port, Some(tls))?;
        info = info.set_addr(addr);
    }
    match certs {
        Some(certs) => redis::Client::build_with_tls(info, certs),
        None => redis::Client::open(info),
    }
}

/// Where Sentinel is asked, and whose view of the primary a link follows.
struct Sentinel<'a> {
    sentinels: &'a [(String, u16)],
    master: &'a str,
    /// The leading link's epoch (see [`Link::open_following`]); `None` for a link that
    /// watches the sentinels itself.
    leader: Option<Arc<AtomicU64>>,
}

/// The connection to the primary that the sentinels name, made now so that a wrong
/// address, name or certificate stops start-up; a leading link also watches the sentinels.
async fn open_sentinel(
    setup: &RedisSetup,
    sentinel: Sentinel<'_>,
    certs: Option<TlsCertificates>,
    connect_timeout: Duration,
) -> RedisResult<Link> {
    let Sentinel {
        sentinels,
        master,
        leader,
    } = sentinel;
    let addrs = sentinels
        .iter()
        .map(|(h, p)| node_addr(h, *p, setup.tls.as_ref()))
        .collect::<RedisResult<Vec<_>>>()?;
    let mut b = SentinelClientBuilder::new(addrs, master, SentinelServerType::Master)?;
    if let Some(tls) = &setup.tls {
        b = b
            .set_client_to_sentinel_tls_mode(tls_mode(tls))
            .set_client_to_redis_tls_mode(tls_mode(tls));
    }
    if let Some(certs) = certs {
        b = b
            .set_client_to_sentinel_certificates(certs.clone())
            .set_client_to_redis_certificates(certs);
    }
    if let Some(user) = &setup.username {
        b = b
            .set_client_to_sentinel_username(user)
            .set_client_to_redis_username(user);
    }
    if let Some(password) = &setup.password {
        b = b
            .set_client_to_sentinel_password(password.expose())
            .set_client_to_redis_password(password.expose());
    }
    let client = Arc::new(tokio::sync::Mutex::new(b.build()?));
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(connect_timeout))
        .set_response_timeout(None);
    // Where the current connection goes, for the watcher to compare.
    let connected_to: Arc<Mutex<Option<String>>> = Arc::default();
    let (opener_client, noted) = (client.clone(), connected_to.clone());
    let open: Opener<MultiplexedConnection> = Box::new(move || {
        let (client, config, noted) = (opener_client.clone(), config.clone(), noted.clone());
        Box::pin(async move {
            let ask = async {
                let primary = client.lock().await.async_get_client().await?;
                let addr = primary.get_connection_info().addr().to_string();
                let conn = primary
                    .get_multiplexed_async_connection_with_config(&config)
                    .await?;
                if let Ok(mut to) = noted.lock() {
                    *to = Some(addr);
                }
                Ok(conn)
            };
            // Asking the sentinels and then the primary: two connections at most.
            tokio::time::timeout(connect_timeout * 2, ask)
                .await
                .map_err(|_| timed_out("no primary from the sentinels in time"))?
        })
    });
    // Given up at once when a call is cut off (the primary may be frozen or cut
    // off), when the primary answers READONLY (demoted), or when the connection
    // broke: the next call asks the sentinels again.
    let leads = leader.is_none();
    let epoch = leader.unwrap_or_default();
    let link = Renewing::new(
        open,
        Duration::ZERO,
        |e| {
            e.code() == Some("READONLY")
                || e.is_connection_dropped()
                || e.is_unrecoverable_error()
                || e.is_timeout()
                || fails_fast(e)
        },
        Some(epoch.clone()),
        connect_timeout * 2,
    );
    // The first connection is made now, so that a wrong address, name or
    // certificate stops start-up.
    link.connection().await?;
    if leads {
        tokio::spawn(watch_primary(
            Arc::downgrade(&link.inner),
            client,
            connected_to,
            epoch,
            connect_timeout,
        ));
    }
    Ok(Link::Sentinel(link))
}

/// The connection to a cluster, made now so that a wrong address or certificate stops
/// start-up.
async fn open_cluster(
    setup: &RedisSetup,
    nodes: &[(String, u16)],
    certs: Option<TlsCertificates>,
    connect_timeout: Duration,
    response_timeout: Duration,
) -> RedisResult<Link> {
    let seeds = Arc::new(ClusterSeeds {
        setup: setup.clone(),
        certs,
        configured: nodes.to_vec(),
        seeds: Mutex::new(nodes.to_vec()),
        connect_timeout,
        response_timeout,
    });
    let open: Opener<ClusterConnection> = Box::new(move || {
        let seeds = seeds.clone();
        Box::pin(async move { seeds.connect().await })
    });
    // Not given up on a TLS failure: that may be one node's, and the
    // connection to the others is still good.
    let link = Renewing::new(
        open,
        response_timeout / 2,
        |e| e.is_timeout(),
        None,
        connect_timeout * 3 + response_timeout * 2,
    );
    // The first connection is made now, so that a wrong address or certificate
    // stops start-up.
    link.connection().await?;
    Ok(Link::Cluster(link))
}

impl ConnectionLike for Link {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Link::Single(c) => c.req_packed_command(cmd),
            Link::Sentinel(s) => s.req_packed_command(cmd),
            Link::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Link::Single(c) => c.req_packed_commands(cmd, offset, count),
            Link::Sentinel(s) => s.req_packed_commands(cmd, offset, count),
            Link::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Link::Single(c) => c.get_db(),
            Link::Sentinel(s) => s.get_db(),
            Link::Cluster(c) => c.get_db(),
        }
    }
}

/// rustls needs a process-wide crypto provider; ring is the one compiled in. Installing
/// twice is harmless (the second attempt reports the first).
pub(super) fn install_crypto() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

fn tls_mode(tls: &Tls) -> TlsMode {
    if tls.insecure {
        TlsMode::Insecure
    } else {
        TlsMode::Secure
    }
}

pub(super) fn certificates(tls: &Tls) -> TlsCertificates {
    TlsCertificates {
        client_tls: tls
            .client
            .as_ref()
            .map(|(cert, key)| redis::ClientTlsConfig {
                client_cert: cert.0.clone(),
                client_key: key.0.clone(),
            }),
        root_cert: tls.ca.as_ref().map(|ca| ca.0.clone()),
    }
}

/// A node's address, with TLS when it is on (redis-rs's own URL form, so that its parser
/// decides what `insecure` means).
fn node_addr(host: &str, port: u16, tls: Option<&Tls>) -> RedisResult<ConnectionAddr> {
    let host = if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_string()
    };
    let url = match tls {
        None => format!("redis://{host}:{port}"),
        Some(t) if t.insecure => format!("rediss://{host}:{port}/#insecure"),
        Some(_) => format!("rediss://{host}:{port}"),
    };
    Ok(url.as_str().into_connection_info()?.addr().clone())
}

/// Whether the calls that find no connection are told `e` at once rather than wait on a new
/// attempt: a TLS failure, or a refused connection (nothing listens on the store's port:
/// without this, a stopped Redis was reported as "store call timed out", each call waiting
/// on the reconnection's retries until its deadline).
pub(super) fn fails_fast(e: &RedisError) -> bool {
    e.is_connection_refusal() || tls_failure(e)
}

/// Whether `e` comes from the TLS layer: rustls refused the server's certificate (or the
/// server refused ours, which rustls reports as the alert it received). By rustls' error
/// in the chain or, since an error shared by redis-rs's reconnection is a copy that keeps
/// only the text, by rustls' words for a handshake that failed.
pub fn tls_failure(e: &RedisError) -> bool {
    const RUSTLS: [&str; 5] = [
        "invalid peer certificate",
        "received fatal alert",
        "peer sent no certificates",
        "peer is incompatible",
        "invalid certificate revocation list",
    ];
    let text = e.to_string();
    if RUSTLS.iter().any(|w| text.contains(w)) {
        return true;
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        if err.downcast_ref::<rustls::Error>().is_some() {
            return true;
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if io
                .get_ref()
                .is_some_and(|inner| inner.is::<rustls::Error>())
            {
                return true;
            }
        }
        source = err.source();
    }
    false
}

/// How often a Sentinel link asks the sentinels which node is the primary, whether or not
/// it is busy. A link that only learned of a failover from its own calls failing kept an
/// idle instance's connection on a frozen old primary that then resumed: for the ~10 s
/// until the sentinels demoted it, every claim and record went there and was wiped by the
/// demotion (30 of 30 new keys executed twice). This bounds that window.
pub const SENTINEL_CHECK: Duration = Duration::from_secs(1);

/// Asks the sentinels every [`SENTINEL_CHECK`] which node is the primary; when it is not
/// the one the link is connected to, moves `epoch` on, which gives up this link's
/// connection and those of every link that follows it (the acknowledgement connections).
/// Ends when the link is dropped.
async fn watch_primary(
    link: std::sync::Weak<RenewingInner<MultiplexedConnection>>,
    client: Arc<tokio::sync::Mutex<redis::sentinel::SentinelClient>>,
    connected_to: Arc<Mutex<Option<String>>>,
    epoch: Arc<AtomicU64>,
    connect_timeout: Duration,
) {
    let mut tick = tokio::time::interval(SENTINEL_CHECK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if link.strong_count() == 0 {
            return;
        }
        let Some(old) = connected_to.lock().ok().and_then(|t| t.clone()) else {
            continue;
        };
        let ask = async { client.lock().await.async_get_client().await };
        let named = match tokio::time::timeout(connect_timeout * 2, ask).await {
            Ok(Ok(primary)) => primary.get_connection_info().addr().to_string(),
            // The sentinels (or the primary they name) do not answer: nothing to compare.
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "could not ask the sentinels for the primary");
                continue;
            }
            Err(_) => continue,
        };
        if named != old {
            tracing::warn!(primary = %named, was = %old, "the sentinels name another primary: giving up every connection to the old one");
            epoch.fetch_add(1, Ordering::Relaxed);
            if let Ok(mut to) = connected_to.lock() {
                *to = None;
            }
        }
    }
}

pub(super) fn timed_out(what: &str) -> RedisError {
    RedisError::from(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        what.to_string(),
    ))
}

/// What a cluster connection starts from. Each call to a node is bounded by
/// `response_timeout`, so that connecting anew, and redis-rs's own slot-map reloads, cannot
/// wait on a silent node for ever either.
struct ClusterSeeds {
    setup: RedisSetup,
    certs: Option<TlsCertificates>,
    /// `redis_cluster_nodes`.
    configured: Vec<(String, u16)>,
    /// Where the next connection starts: `configured` and the nodes of the last slot map.
    seeds: Mutex<Vec<(String, u16)>>,
    connect_timeout: Duration,
    response_timeout: Duration,
}

impl ClusterSeeds {
    /// Connects from the seeds, and reads the slot map's nodes for the next time.
    async fn connect(&self) -> RedisResult<ClusterConnection> {
        let seeds = self
            .seeds
            .lock()
            .map(|s| s.clone())
            .unwrap_or_else(|_| self.configured.clone());
        let client = self.client(&seeds)?;
        // The seeds (each bounded by the connect and response timeouts), then the slot map.
        let budget = self.connect_timeout * 3 + self.response_timeout * 2;
        let mut conn = tokio::time::timeout(budget, client.get_async_connection())
            .await
            .map_err(|_| timed_out("no cluster connection in time"))??;
        // The nodes of this map seed the next connection, should this one be given up;
        // without them, a cluster configured with one seed could not be reached while
        // that node is silent.
        let slots = tokio::time::timeout(
            self.response_timeout,
            redis::cmd("CLUSTER")
                .arg("SLOTS")
                .query_async::<Value>(&mut conn),
        )
        .await;
        if let Ok(Ok(map)) = slots {
            let mut next = self.configured.clone();
            for node in slot_map_nodes(&map) {
                if !next.contains(&node) {
                    next.push(node);
                }
            }
            if let Ok(mut seeds) = self.seeds.lock() {
                *seeds = next;
            }
        }
        Ok(conn)
    }

    fn client(&self, seeds: &[(String, u16)]) -> RedisResult<redis::cluster::ClusterClient> {
        let inner = self;
        let setup = &inner.setup;
        let infos = seeds
            .iter()
            .map(|(h, p)| node_addr(h, *p, setup.tls.as_ref())?.into_connection_info())
            .collect::<RedisResult<Vec<_>>>()?;
        let mut b = ClusterClientBuilder::new(infos)
            .connection_timeout(inner.connect_timeout)
            .response_timeout(inner.response_timeout)
            // Per-call deadlines are the store's; the response timeout above bounds each
            // node's answer, retries included.
            .overall_response_timeout(None)
            // Retries follow MOVED/ASK and wait out a failover while the caller's
            // deadline lasts; a claim or record run twice is harmless.
            .retries(6)
            .min_retry_wait(10)
            .max_retry_wait(200);
        if let Some(tls) = &setup.tls {
            b = b.tls(tls_mode(tls));
        }
        if let Some(certs) = &inner.certs {
            b = b.certs(certs.clone());
        }
        if let Some(user) = &setup.username {
            b = b.username(user);
        }
        if let Some(password) = &setup.password {
            b = b.password(password.expose());
        }
        b.build()
    }
}

/// One range of a `CLUSTER SLOTS` reply: its first and last slot, and its nodes' host and
/// port, the primary first.
pub(crate) struct SlotRange {
    pub from: i64,
    pub to: i64,
    pub nodes: Vec<(String, i64)>,
}

/// The ranges of a `CLUSTER SLOTS` reply; entries it cannot read are left out.
pub(crate) fn slot_ranges(map: &Value) -> Vec<SlotRange> {
    let Value::Array(ranges) = map else {
        return Vec::new();
    };
    let mut out = Vec::with_capacity(ranges.len());
    for range in ranges {
        let Value::Array(items) = range else {
            continue;
        };
        let (Some(Value::Int(from)), Some(Value::Int(to))) = (items.first(), items.get(1)) else {
            continue;
        };
        let mut nodes = Vec::new();
        for node in items.iter().skip(2) {
            let Value::Array(f) = node else {
                continue;
            };
            let host = match f.first() {
                Some(Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
                Some(Value::SimpleString(s)) => s.clone(),
                _ => continue,
            };
            let Some(Value::Int(port)) = f.get(1) else {
                continue;
            };
            nodes.push((host, *port));
        }
        out.push(SlotRange {
            from: *from,
            to: *to,
            nodes,
        });
    }
    out
}

/// `host:port` of every node in a `CLUSTER SLOTS` reply (an empty host is left out: it
/// means "the node that answered", which is among the seeds already).
fn slot_map_nodes(map: &Value) -> Vec<(String, u16)> {
    let mut nodes = Vec::new();
    for range in slot_ranges(map) {
        for (host, port) in range.nodes {
            if let (false, Ok(port)) = (host.is_empty(), u16::try_from(port)) {
                if !nodes.contains(&(host.clone(), port)) {
                    nodes.push((host, port));
                }
            }
        }
    }
    nodes
}
