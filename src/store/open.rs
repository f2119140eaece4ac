//! Which store the settings choose, and opening it: the one place that knows which keys
//! choose which backend, and how each is reached and checked before idemgate serves.
//!
//! A new backend is a folder beside the others, a [`StoreKind`], its arm in [`open`], and
//! its run of the contract suite (`tests/store_contract.rs`).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::{MemoryStore, PostgresStore, RedisSetup, RedisStore, SqliteStore, Store, StoreError};
use crate::config::Config;

/// Start-up's warning for the embedded in-memory store.
pub const MEMORY_STORE_WARNING: &str = "using the embedded in-memory store: records do not survive a restart and are not shared between instances; set store_path or redis_url for production";

/// How often the backends that expire records themselves sweep them.
const SWEEP_EVERY: Duration = Duration::from_secs(10);

/// The backends a store can be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreKind {
    /// This process's memory (no setting chooses a store).
    Memory,
    /// A SQLite file in `store_path`.
    Sqlite,
    /// Redis: `redis_url`, `redis_sentinels` or `redis_cluster_nodes`.
    Redis,
    /// PostgreSQL: `postgres_url`.
    Postgres,
}

impl StoreKind {
    /// The store that `c` chooses. The settings allow one store at most (validation
    /// refuses two), so the order of the tests below never decides between two.
    pub fn of(c: &Config) -> StoreKind {
        let redis = c.redis_url.is_some()
            || !c.redis_sentinels.is_empty()
            || !c.redis_cluster_nodes.is_empty();
        if redis {
            StoreKind::Redis
        } else if c.postgres_url.is_some() {
            StoreKind::Postgres
        } else if c.store_path.is_some() {
            StoreKind::Sqlite
        } else {
            StoreKind::Memory
        }
    }

    /// Its short name for logs and messages.
    pub fn name(self) -> &'static str {
        match self {
            StoreKind::Memory => "memory",
            StoreKind::Sqlite => "sqlite",
            StoreKind::Redis => "redis",
            StoreKind::Postgres => "postgres",
        }
    }

    /// Whether several instances share it: a store of this process alone (the memory, a
    /// SQLite file whose records and secret go together) has no other instance that could
    /// be making its scope secret at the same moment.
    pub fn shared(self) -> bool {
        matches!(self, StoreKind::Redis | StoreKind::Postgres)
    }
}

impl fmt::Display for StoreKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a store could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The store failed (cannot connect, cannot migrate, cannot open its file).
    #[error("cannot use the store: {0}")]
    Store(#[from] StoreError),
    /// Redis could not be reached; `addr` is its host and port, never the URL's
    /// credentials.
    #[error("cannot use Redis at {addr}: {source}")]
    RedisUnreachable {
        /// `host:port` (or the socket path) from `redis_url`.
        addr: String,
        /// Why.
        source: StoreError,
    },
    /// Redis would evict records, which would silently turn retries into second executions.
    #[error("Redis maxmemory-policy is `{0}`: it may evict idempotency records and let retries execute twice. Set `maxmemory-policy noeviction` on the Redis that idemgate uses")]
    EvictingRedis(String),
}

/// Opens the store that `c` chooses ([`StoreKind::of`]) with its start-up checks, and
/// starts its sweeper where it has one. `redis` is how Redis is reached, built from the
/// same settings (`wiring`); it is read only when they choose Redis.
pub async fn open(c: &Config, redis: Option<&RedisSetup>) -> Result<Arc<dyn Store>, OpenError> {
    match StoreKind::of(c) {
        StoreKind::Memory => {
            tracing::warn!("{MEMORY_STORE_WARNING}");
            let store = MemoryStore::with_limits(c.memory_max_records, c.memory_max_bytes);
            store.spawn_sweeper(SWEEP_EVERY);
            Ok(Arc::new(store))
        }
        StoreKind::Sqlite => {
            let dir = c.store_path.clone().unwrap_or_default();
            let namespace = namespace_of(c);
            let store = tokio::task::spawn_blocking(move || SqliteStore::open(&dir, &namespace))
                .await
                .map_err(|e| StoreError::Backend(format!("opening the store: {e}")))??;
            store.spawn_sweeper(SWEEP_EVERY);
            tracing::info!(path = %store.path().display(), "using the persistent embedded store");
            Ok(Arc::new(store))
        }
        StoreKind::Postgres => {
            let url = c
                .postgres_url
                .as_ref()
                .map(|u| u.expose())
                .unwrap_or_default();
            let namespace = namespace_of(c);
            let store = PostgresStore::connect(
                url,
                &namespace,
                c.postgres_synchronous_commit,
                c.redis_connect_timeout,
                c.store_timeout,
            )
            .await?;
            let durability = super::deadline(c.store_timeout, store.durability()).await?;
            store.spawn_sweeper(SWEEP_EVERY);
            // What the session reads, not what was asked: the setting in force.
            tracing::info!(
                synchronous_commit = %durability.synchronous_commit,
                standbys = durability.standbys,
                "connected to PostgreSQL"
            );
            if let Some(warning) = durability.warning(c.postgres_async_standbys_acknowledged) {
                tracing::warn!("{warning}");
            }
            Ok(Arc::new(store))
        }
        StoreKind::Redis => open_redis(c, redis_setup(redis)?).await,
    }
}

/// A store for one more serving thread, beside `shared` (the first thread's): Redis gets
/// a connection of its own, with no start-up checks (the first thread's hold for it); the
/// other stores are shared, and `None` says to use `shared`.
pub async fn for_thread(
    c: &Config,
    redis: Option<&RedisSetup>,
) -> Result<Option<Arc<dyn Store>>, OpenError> {
    match StoreKind::of(c) {
        StoreKind::Redis => {
            let store = connect_redis(c, redis_setup(redis)?).await?;
            Ok(Some(Arc::new(store)))
        }
        StoreKind::Memory | StoreKind::Sqlite | StoreKind::Postgres => Ok(None),
    }
}

/// The setup of settings that choose Redis ([`RedisSetup::from_config`] makes one for
/// each such settings).
fn redis_setup(redis: Option<&RedisSetup>) -> Result<&RedisSetup, OpenError> {
    redis.ok_or_else(|| {
        OpenError::Store(StoreError::Backend(
            "the settings choose Redis, but no Redis was set up".into(),
        ))
    })
}

/// Redis, checked: reachable, not evicting, and warned about when it keeps nothing on disk.
async fn open_redis(c: &Config, setup: &RedisSetup) -> Result<Arc<dyn Store>, OpenError> {
    let store = connect_redis(c, setup).await?;
    let info = super::deadline(c.store_timeout, store.server_info())
        .await
        .map_err(|source| OpenError::RedisUnreachable {
            addr: setup.addresses(),
            source,
        })?;
    if info.maxmemory_policy != "noeviction" {
        return Err(OpenError::EvictingRedis(info.maxmemory_policy));
    }
    if !info.aof_enabled {
        tracing::warn!(
            "Redis append-only persistence is off: records written since the last snapshot are lost if Redis restarts, and their keys could execute again"
        );
    }
    let records = if setup.value_records { "value" } else { "hash" };
    tracing::info!(redis_version = %info.version, records, "connected to Redis");
    Ok(Arc::new(store))
}

/// A connection to the configured Redis, its scripts loaded; no start-up checks.
async fn connect_redis(c: &Config, setup: &RedisSetup) -> Result<RedisStore, OpenError> {
    RedisStore::open(setup, c.redis_connect_timeout, c.store_timeout)
        .await
        .map_err(|source| OpenError::RedisUnreachable {
            addr: setup.addresses(),
            source,
        })
}

/// The namespace a store's records are written under: the configured one (required on a
/// shared store), `default` on an embedded one, as the settings say.
fn namespace_of(c: &Config) -> String {
    c.namespace.clone().unwrap_or_else(|| "default".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_settings_choose_one_kind() {
        let mut c = Config::default();
        assert_eq!(StoreKind::of(&c), StoreKind::Memory);
        c.store_path = Some("/tmp/x".into());
        assert_eq!(StoreKind::of(&c), StoreKind::Sqlite);
        c.store_path = None;
        c.postgres_url = Some("postgres://h/db".into());
        assert_eq!(StoreKind::of(&c), StoreKind::Postgres);
        c.postgres_url = None;
        c.redis_cluster_nodes = vec!["redis://h:7000".into()];
        assert_eq!(StoreKind::of(&c), StoreKind::Redis);
        assert!(StoreKind::Redis.shared() && !StoreKind::Sqlite.shared());
    }
}
