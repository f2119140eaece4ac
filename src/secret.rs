//! One store, one secret: every instance of a namespace on one store keys record ids with
//! the same scope secret, or refuses to serve.
//!
//! Record ids are an HMAC under the scope secret, so two instances that hold different
//! secrets compute different ids for one request, and a key retried through the other
//! executes again. A store can forget the secret while instances run (a Redis restarted
//! without persistence, `FLUSHALL`, an empty replacement node, an operator deleting
//! `idemgate:*`). What keeps the fleet whole:
//!
//! - **Running instances put theirs back.** Every `scope_secret_check_interval` (and at
//!   once when the Redis `INFO` watcher sees a restart) an instance reads the store's
//!   secret and its namespace's verifier (an HMAC of a constant under the secret; in Redis
//!   the key `idemgate:scope-verifier:<namespace>`, in SQLite and PostgreSQL the meta row
//!   `scope_verifier:<namespace>`), and puts back, set-if-absent, whichever is missing.
//! - **A starting instance that finds none waits** `scope_secret_create_delay` (longer than
//!   the check interval) before it makes one, so that running instances restore theirs
//!   first; it then reads whichever won.
//! - **Disagreement refuses.** An instance whose secret differs from the store's, or from
//!   its namespace's verifier, refuses every protected request (503 `store-unavailable`,
//!   claims and replays alike), reports unready on `/readyz`, and logs an error, until it
//!   restarts and reads the store's. At start-up the same disagreement is an exit. The
//!   verifier is per namespace because several services may share one Redis, each with its
//!   own pinned secret.
//! - **Pinned secrets** (`scope_secret`, `scope_secret_file`, `IDEMGATE_SCOPE_SECRET`) do
//!   not depend on the store at all: only the verifier is checked and restored.
//!
//! A store that lost its secret but kept the namespace's verifier (a Cluster shard that
//! restarted empty while the others kept their records) still has records keyed by the
//! lost secret: a new secret would execute every one of them again, so start-up refuses
//! and says how to recover (pin the old secret, or delete the verifier to start over).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;

use crate::scope::ScopeSecret;
use crate::store::{deadline, Store, StoreError, SCOPE_SECRET};

/// The [`Store::meta`] name of a namespace's verifier.
pub fn verifier_name(namespace: &str) -> String {
    format!("scope_verifier:{namespace}")
}

/// Where this instance's store keeps its meta values, for the messages that tell an operator
/// to delete one: each names the value as the store holds it and the command that deletes
/// it there, so that following the message verbatim works.
#[derive(Clone, Debug, Default)]
pub enum StorePlace {
    /// The embedded in-memory store (its values die with the process).
    #[default]
    Memory,
    /// The persistent embedded store: its database file.
    Sqlite(PathBuf),
    /// PostgreSQL (`postgres_url`, `IDEMGATE_POSTGRES_URL`).
    Postgres,
    /// Redis: the `redis-cli` command line that reaches it, and whether it is a Cluster
    /// (which keeps a copy of each value on every primary).
    Redis {
        /// `redis-cli` with the connection flags ([`crate::store::RedisSetup::cli`]).
        cli: String,
        /// A Cluster.
        cluster: bool,
    },
}

impl StorePlace {
    /// The meta value `name` as the store holds it, and the command that deletes it.
    pub fn delete(&self, name: &str) -> String {
        match self {
            StorePlace::Memory => format!(
                "{name} (the embedded in-memory store holds it for as long as the process runs)"
            ),
            StorePlace::Sqlite(file) => format!(
                "the row named '{name}' of table meta in {file}: `sqlite3 -cmd '.timeout 5000' '{file}' \"DELETE FROM meta WHERE name = '{name}'\"`",
                file = file.display()
            ),
            StorePlace::Postgres => format!(
                "the row named '{name}' of table idemgate_meta: `psql \"$IDEMGATE_POSTGRES_URL\" -c \"DELETE FROM idemgate_meta WHERE name = '{name}'\"`"
            ),
            StorePlace::Redis { cli, cluster: false } => {
                let key = crate::store::redis::meta_key(name);
                format!("the Redis key {key}: `{cli} DEL {key}`")
            }
            StorePlace::Redis { cli, cluster: true } => {
                let key = crate::store::redis::meta_key(name);
                format!(
                    "the Redis key {key} and its copy on every primary ({key}:{{s<n>}}): list them on each primary with `{cli} --scan --pattern '{key}*'` and delete each with `{cli} DEL KEY`"
                )
            }
        }
    }
}

/// Why an instance cannot use a secret.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// The store could not be asked.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The store holds another secret, or another secret's verifier.
    #[error("{0}")]
    Disagrees(String),
}

/// Whether this instance's secret agrees with the store's: shared by the proxy (which
/// refuses protected requests once it does not), `/readyz` and the metrics.
pub struct SecretHealth {
    agreed: AtomicBool,
    // `idemgate_scope_secret_agreed`: 1, or 0 from the first disagreement on.
    gauge: Gauge,
    // Set for good once the store's file is found not to be the one at its path.
    file_replaced: std::sync::Mutex<Option<String>>,
}

impl SecretHealth {
    /// Agreeing, as start-up established.
    pub fn new(gauge: Gauge) -> SecretHealth {
        gauge.set(1);
        SecretHealth {
            agreed: AtomicBool::new(true),
            gauge,
            file_replaced: std::sync::Mutex::new(None),
        }
    }

    /// Why the store's file is not the one at its path, once found: from then until the
    /// process restarts, protected requests are refused.
    pub fn file_replaced(&self) -> Option<String> {
        self.file_replaced
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn replaced(&self, why: String) {
        let mut held = self.file_replaced.lock().unwrap_or_else(|p| p.into_inner());
        if held.is_none() {
            tracing::error!(reason = %why, "the store's file is not the one at its path: refusing every protected request until restarted (records written since went to the file this instance holds open; a restart opens the one at the path)");
            *held = Some(why);
        }
    }

    /// Whether protected requests may be served.
    pub fn agreed(&self) -> bool {
        self.agreed.load(Ordering::Relaxed)
    }

    /// From now until the process restarts, protected requests are refused.
    fn disagree(&self) {
        self.agreed.store(false, Ordering::Relaxed);
        self.gauge.set(0);
    }
}

/// The secret this instance keys record ids with, established at start-up: the pinned one,
/// or the store's (made after `create_delay` when the store holds none). Its namespace's
/// verifier is written or checked either way.
pub async fn establish(
    store: &dyn Store,
    pinned: Option<&ScopeSecret>,
    namespace: &str,
    create_delay: Duration,
    timeout: Duration,
    place: &StorePlace,
    starting: &crate::starting::Starting,
) -> Result<ScopeSecret, SecretError> {
    let verifier = verifier_name(namespace);
    let secret = match pinned {
        Some(s) => s.clone(),
        None => {
            let found = deadline(timeout, store.meta(SCOPE_SECRET, None)).await?;
            match found.value {
                Some(hex) => parse(&hex)?,
                None => {
                    if !create_delay.is_zero() {
                        tracing::warn!(delay = ?create_delay, "the store holds no scope secret: waiting scope_secret_create_delay for running instances to put theirs back before making one (meanwhile /readyz is 503 and requests get 503 store-unavailable with Retry-After; a single instance, or a pinned secret, needs no wait: scope_secret_create_delay = \"0s\" or scope_secret_file)");
                        starting.waiting_until(std::time::Instant::now() + create_delay);
                        tokio::time::sleep(create_delay).await;
                    }
                    create(store, &verifier, namespace, timeout, place).await?
                }
            }
        }
    };
    check_verifier(store, &secret, namespace, timeout, pinned.is_some(), place).await?;
    Ok(secret)
}

/// Reads the store's secret once more, and makes one if there still is none, unless the
/// namespace's verifier shows that records were made under a secret the store has lost.
async fn create(
    store: &dyn Store,
    verifier: &str,
    namespace: &str,
    timeout: Duration,
    place: &StorePlace,
) -> Result<ScopeSecret, SecretError> {
    if let Some(hex) = deadline(timeout, store.meta(SCOPE_SECRET, None))
        .await?
        .value
    {
        return parse(&hex);
    }
    if deadline(timeout, store.meta(verifier, None))
        .await?
        .value
        .is_some()
    {
        return Err(SecretError::Disagrees(format!(
            "the store holds no scope secret, but keeps namespace {namespace:?}'s verifier: records made under the lost secret may still be there, and a new secret would execute their retries again. Pin the lost secret (scope_secret_file or IDEMGATE_SCOPE_SECRET; GET /scope-secret on an instance that still runs shows it), or, to give up replaying them, delete {}",
            place.delete(verifier)
        )));
    }
    let offer = ScopeSecret::random();
    let found = deadline(timeout, store.meta(SCOPE_SECRET, Some(&offer.to_hex()))).await?;
    if found.created {
        tracing::info!("made the store's scope secret");
    }
    parse(found.value.as_deref().unwrap_or_default())
}

/// Offers `secret`'s verifier for `namespace`: set if absent, else compared.
async fn check_verifier(
    store: &dyn Store,
    secret: &ScopeSecret,
    namespace: &str,
    timeout: Duration,
    pinned: bool,
    place: &StorePlace,
) -> Result<(), SecretError> {
    let ours = secret.verifier(namespace);
    let found = deadline(timeout, store.meta(&verifier_name(namespace), Some(&ours))).await?;
    if found.value.as_deref() == Some(ours.as_str()) {
        return Ok(());
    }
    Err(disagreeing_verifier(namespace, pinned, place))
}

/// What a running check reads every interval: the value alone (one read), offered back
/// only when it is missing. Offering every time wrote a set-if-absent, and with replica
/// acknowledgement a `WAIT`, on the shared connection every interval.
async fn read_or_restore(
    store: &dyn Store,
    name: &str,
    ours: &str,
    timeout: Duration,
) -> Result<crate::store::Meta, StoreError> {
    let found = deadline(timeout, store.meta(name, None)).await?;
    if found.value.is_some() {
        return Ok(found);
    }
    deadline(timeout, store.meta(name, Some(ours))).await
}

fn disagreeing_verifier(namespace: &str, pinned: bool, place: &StorePlace) -> SecretError {
    let name = verifier_name(namespace);
    let how = if pinned {
        "the pinned scope secret (scope_secret, scope_secret_file or IDEMGATE_SCOPE_SECRET) is not the one"
    } else {
        "the store's scope secret is not the one"
    };
    SecretError::Disagrees(format!(
        "{how} that namespace {namespace:?}'s records were made under (its verifier in the store differs): serving would compute other record ids and execute retries again. Pin the secret those records were made under (GET /scope-secret on an instance that still has it), or, to give up replaying them, delete {}",
        place.delete(&name)
    ))
}

fn parse(hex: &str) -> Result<ScopeSecret, SecretError> {
    ScopeSecret::from_hex(hex)
        .ok_or_else(|| StoreError::Corrupt("the scope secret is not 64 hex digits".into()).into())
}

/// One check of a running instance: puts back a missing secret (unless pinned) and
/// verifier, and turns `health` off for good on any disagreement. A store that does not
/// answer changes nothing: its calls fail on their own.
pub async fn check(
    store: &dyn Store,
    secret: &ScopeSecret,
    pinned: bool,
    namespace: &str,
    timeout: Duration,
    health: &SecretHealth,
    place: &StorePlace,
) {
    if !health.agreed() {
        return;
    }
    let result = async {
        if !pinned {
            let ours = secret.to_hex();
            let found = read_or_restore(store, SCOPE_SECRET, &ours, timeout).await?;
            if found.created {
                tracing::warn!("the store had lost its scope secret; put this instance's back");
            }
            if found.value.as_deref() != Some(ours.as_str()) {
                return Err(SecretError::Disagrees("the store holds another scope secret than this instance's (it lost this one, and another instance made a new one): serving would compute other record ids and execute retries again".into()));
            }
        }
        let ours = secret.verifier(namespace);
        let found = read_or_restore(store, &verifier_name(namespace), &ours, timeout).await?;
        if found.value.as_deref() == Some(ours.as_str()) {
            Ok(())
        } else {
            Err(disagreeing_verifier(namespace, pinned, place))
        }
    }
    .await;
    match result {
        Ok(()) => {}
        Err(SecretError::Store(e)) => {
            tracing::debug!(error = %e, "could not check the scope secret; trying again later")
        }
        Err(SecretError::Disagrees(why)) => {
            health.disagree();
            tracing::error!(reason = %why, "scope secret disagreement: refusing every protected request until restarted");
        }
    }
}

/// What a running instance checks, and how often.
pub struct Watch {
    /// The store.
    pub store: Arc<dyn Store>,
    /// This instance's secret.
    pub secret: ScopeSecret,
    /// Whether the operator pinned it (then only the verifier is the store's to keep).
    pub pinned: bool,
    /// This instance's namespace.
    pub namespace: String,
    /// `scope_secret_check_interval`.
    pub interval: Duration,
    /// `store_timeout`.
    pub timeout: Duration,
    /// Turned off on a disagreement.
    pub health: Arc<SecretHealth>,
    /// Notified when the store's server restarted: check at once.
    pub now: Arc<tokio::sync::Notify>,
    /// Where the store keeps the values, for the error's instructions.
    pub place: StorePlace,
}

impl Watch {
    /// Checks every `interval`, and at once whenever `now` is notified, until the task is
    /// dropped.
    pub async fn run(self) {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(self.interval) => {}
                _ = self.now.notified() => {}
            }
            check(
                &*self.store,
                &self.secret,
                self.pinned,
                &self.namespace,
                self.timeout,
                &self.health,
                &self.place,
            )
            .await;
            // SQLite: the path's device and inode against the open file's.
            if let Some(why) = self.store.self_check().file_replaced {
                self.health.replaced(why);
            }
        }
    }
}
