//! The connection behind the Redis store, one per topology, all multiplexed (one socket per
//! node, shared by every request):
//!
//! - one server: redis-rs's [`ConnectionManager`], which reconnects by itself;
//! - Sentinel: a connection to the primary that the sentinels name, given up as soon as it
//!   breaks, is cancelled, or finds a replica (`READONLY`), so that the next call asks the
//!   sentinels again and follows a promoted replica without a restart;
//! - Cluster: redis-rs's async cluster connection, which routes each script by its key's
//!   slot, follows MOVED and ASK, and reloads the slot map after a failover.
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
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{
    AsyncConnectionConfig, Cmd, ConnectionAddr, IntoConnectionInfo, Pipeline, RedisError,
    RedisFuture, RedisResult, TlsCertificates, TlsMode, Value,
};

use super::redis_setup::{RedisSetup, Tls, Topology};

/// A connection to Redis, whatever its topology. Cheap to clone: clones share the sockets.
#[derive(Clone)]
pub enum Link {
    /// One server.
    Single(ConnectionManager),
    /// The primary named by sentinels.
    Sentinel(SentinelLink),
    /// A cluster.
    Cluster(ClusterConnection),
}

impl Link {
    /// Connects, one attempt bounded by `connect_timeout` per node. Errors are redis-rs's.
    pub async fn open(setup: &RedisSetup, connect_timeout: Duration) -> RedisResult<Link> {
        install_crypto();
        let certs = setup.tls.as_ref().map(certificates);
        match &setup.topology {
            Topology::Single(url) => {
                let mut info = url.as_str().into_connection_info()?;
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
                let client = match certs {
                    Some(certs) => redis::Client::build_with_tls(info, certs)?,
                    None => redis::Client::open(info)?,
                };
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(connect_timeout))
                    .set_response_timeout(None)
                    // Reconnection happens in the background; a request that finds the
                    // connection down fails at once (503) rather than waiting through a
                    // retry ladder.
                    .set_number_of_retries(2)
                    .set_max_delay(Duration::from_secs(1));
                Ok(Link::Single(
                    ConnectionManager::new_with_config(client, config).await?,
                ))
            }
            Topology::Sentinel { sentinels, master } => {
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
                let link = SentinelLink {
                    inner: Arc::new(SentinelInner {
                        client: tokio::sync::Mutex::new(b.build()?),
                        current: Mutex::new(None),
                        generation: AtomicU64::new(0),
                        config: AsyncConnectionConfig::new()
                            .set_connection_timeout(Some(connect_timeout))
                            .set_response_timeout(None),
                        connect_timeout,
                    }),
                };
                // The first connection is made now, so that a wrong address, name or
                // certificate stops start-up.
                link.connection().await?;
                Ok(Link::Sentinel(link))
            }
            Topology::Cluster { nodes } => {
                let infos = nodes
                    .iter()
                    .map(|(h, p)| node_addr(h, *p, setup.tls.as_ref())?.into_connection_info())
                    .collect::<RedisResult<Vec<_>>>()?;
                let mut b = ClusterClientBuilder::new(infos)
                    .connection_timeout(connect_timeout)
                    // Per-call deadlines are the store's; a second timer per call inside
                    // redis-rs would only cost (see the single-server case).
                    .overall_response_timeout(None)
                    // Retries follow MOVED/ASK and wait out a failover while the caller's
                    // deadline lasts; a claim or record run twice is harmless.
                    .retries(6)
                    .min_retry_wait(10)
                    .max_retry_wait(200);
                if let Some(tls) = &setup.tls {
                    b = b.tls(tls_mode(tls));
                }
                if let Some(certs) = certs {
                    b = b.certs(certs);
                }
                if let Some(user) = &setup.username {
                    b = b.username(user);
                }
                if let Some(password) = &setup.password {
                    b = b.password(password.expose());
                }
                let client = b.build()?;
                Ok(Link::Cluster(client.get_async_connection().await?))
            }
        }
    }

    /// Whether this is a cluster (commands without a key must then be routed explicitly).
    pub fn is_cluster(&self) -> bool {
        matches!(self, Link::Cluster(_))
    }
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
fn install_crypto() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

fn tls_mode(tls: &Tls) -> TlsMode {
    if tls.insecure {
        TlsMode::Insecure
    } else {
        TlsMode::Secure
    }
}

fn certificates(tls: &Tls) -> TlsCertificates {
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

/// The primary that the sentinels name, followed across failovers.
#[derive(Clone)]
pub struct SentinelLink {
    inner: Arc<SentinelInner>,
}

struct SentinelInner {
    /// Asks the sentinels; one question at a time.
    client: tokio::sync::Mutex<SentinelClient>,
    /// The primary's connection and its generation, `None` once given up.
    current: Mutex<Option<(u64, MultiplexedConnection)>>,
    generation: AtomicU64,
    config: AsyncConnectionConfig,
    connect_timeout: Duration,
}

impl SentinelLink {
    async fn connection(&self) -> RedisResult<(u64, MultiplexedConnection)> {
        if let Some(c) = self.current() {
            return Ok(c);
        }
        let mut client = self.inner.client.lock().await;
        // Another caller may have reconnected while this one waited for the lock.
        if let Some(c) = self.current() {
            return Ok(c);
        }
        let ask = async {
            let primary = client.async_get_client().await?;
            primary
                .get_multiplexed_async_connection_with_config(&self.inner.config)
                .await
        };
        // Asking the sentinels and then the primary: two connections at most.
        let conn = tokio::time::timeout(self.inner.connect_timeout * 2, ask)
            .await
            .map_err(|_| {
                RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "no primary from the sentinels in time",
                ))
            })??;
        let generation = self.inner.generation.fetch_add(1, Ordering::Relaxed) + 1;
        if let Ok(mut current) = self.inner.current.lock() {
            *current = Some((generation, conn.clone()));
        }
        Ok((generation, conn))
    }

    fn current(&self) -> Option<(u64, MultiplexedConnection)> {
        self.inner.current.lock().ok().and_then(|c| c.clone())
    }

    /// Gives up the connection of `generation` (not a newer one made meanwhile).
    fn forget(&self, generation: u64) {
        if let Ok(mut current) = self.inner.current.lock() {
            if current.as_ref().is_some_and(|(g, _)| *g == generation) {
                *current = None;
            }
        }
    }

    async fn call<T, F, Fut>(&self, run: F) -> RedisResult<T>
    where
        F: FnOnce(MultiplexedConnection) -> Fut,
        Fut: std::future::Future<Output = RedisResult<T>>,
    {
        let (generation, conn) = self.connection().await?;
        // A call dropped before it finished (its deadline passed) may be waiting on a
        // primary that is frozen or cut off: the next call asks the sentinels again.
        let mut guard = Forget {
            link: self,
            generation,
            armed: true,
        };
        let result = run(conn).await;
        guard.armed = match &result {
            Ok(_) => false,
            // A demoted primary answers READONLY; a broken connection cannot be reused.
            Err(e) => {
                e.code() == Some("READONLY")
                    || e.is_connection_dropped()
                    || e.is_unrecoverable_error()
                    || e.is_timeout()
            }
        };
        result
    }
}

struct Forget<'a> {
    link: &'a SentinelLink,
    generation: u64,
    armed: bool,
}

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.link.forget(self.generation);
        }
    }
}

impl ConnectionLike for SentinelLink {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(self.call(move |mut c| async move { c.req_packed_command(cmd).await }))
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(
            self.call(move |mut c| async move { c.req_packed_commands(cmd, offset, count).await }),
        )
    }

    fn get_db(&self) -> i64 {
        0
    }
}
