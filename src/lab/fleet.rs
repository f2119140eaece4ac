//! The idemgate instances of a bad day, and what the day does to them and to their store.
//!
//! - **Embedded store**: one instance, in-process. Its records live in its memory, so a
//!   killed instance takes them along (the docs say so): the kill is not injected there. Its
//!   store freezes through the lab's store layer ([`super::tracked`]): every call waits.
//! - **Redis**: two instances behind the clients all day, each a child process of the lab
//!   (the lab's own binary with a generated configuration), on the same Redis through a
//!   small TCP relay of the lab's own. The kill is a SIGKILL mid-request; a new instance
//!   takes the killed one's place (same ports, same store). The store freezes in the relay:
//!   it stops passing bytes both ways, as a Redis that stalls (or is SIGSTOPped) does.
//! - **The lab's own redis-server** (`--redis-server`): as on Redis, but the store is a
//!   [`LabRedis`] with persistence on; it freezes by SIGSTOP and is restarted, records kept.
//!
//! Crates: `tokio` for the relay, the child processes and the readiness probe; `hyper`
//! (through [`super::reconcile`]) for the probe itself.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use super::redis_server::LabRedis;
use super::tracked::Tracked;

/// A claim's lease on a bad day: short, so the records of a killed instance read `unknown`
/// soon after the kill and the operator's pass can settle them.
pub const LEASE: Duration = Duration::from_secs(2);
/// Protected requests in flight per instance: the day's normal load (its clients, a few of
/// them double-clicking) fits; a retry storm of 16 copies per client does not.
pub const MAX_IN_FLIGHT: usize = 64;
/// Instances on a shared store.
const INSTANCES: usize = 2;
/// How long a new instance gets to answer its readiness probe.
const READY_LIMIT: Duration = Duration::from_secs(15);

/// One idemgate instance of the day.
enum Instance {
    InProcess {
        running: crate::Running,
        store: Arc<Tracked>,
    },
    Child {
        child: tokio::process::Child,
        addr: SocketAddr,
        admin: SocketAddr,
        config: PathBuf,
    },
}

/// The instances, their store's freeze, and their kill.
pub struct Fleet {
    instances: Vec<Instance>,
    relay: Option<Relay>,
    // The redis-server the lab started itself, if it did: frozen with SIGSTOP, restarted.
    server: Option<LabRedis>,
    // The generated configurations of the child instances, removed with the fleet.
    dir: Option<PathBuf>,
}

impl Drop for Fleet {
    fn drop(&mut self) {
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

impl Fleet {
    /// One in-process instance on the embedded store, in front of `bank`.
    pub async fn embedded(bank: SocketAddr) -> Result<Fleet, String> {
        let mut config = crate::Config::for_upstream(&format!("http://{bank}"));
        config.admin_listen = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
        config.scope_secret_create_delay = Duration::ZERO;
        config.max_in_flight = MAX_IN_FLIGHT;
        config.defaults.lease = LEASE;
        config.routes.push(crate::config::Route {
            path: "/transfers".into(),
            require_key: Some(true),
            anonymous: Some(crate::config::Anonymous::Shared),
            ..Default::default()
        });
        let mut store = None;
        let running = crate::server::start_wrapped(config, |inner| {
            let tracked = Arc::new(Tracked::new(inner));
            store = Some(tracked.clone());
            let wrapped: Arc<dyn crate::store::Store> = tracked;
            wrapped
        })
        .await
        .map_err(|e| e.to_string())?;
        let store = store.ok_or("the store was not opened")?;
        Ok(Fleet {
            instances: vec![Instance::InProcess { running, store }],
            relay: None,
            server: None,
            dir: None,
        })
    }

    /// Two child instances on the Redis at `redis_url` (through the lab's relay), in
    /// front of `bank`, in namespace `namespace`.
    pub async fn redis(
        bank: SocketAddr,
        redis_url: &str,
        namespace: &str,
    ) -> Result<Fleet, String> {
        let (real, auth, path) = relay_target(redis_url)?;
        let relay = Relay::start(real).await.map_err(|e| e.to_string())?;
        let url = format!("redis://{auth}{}{path}", relay.addr);
        let dir = std::env::temp_dir().join(format!(
            "idemgate-lab-fleet-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).map_err(|e| format!("the instances' configuration: {e}"))?;
        // Made first, so that a failure below removes the directory and stops the
        // instances already started (they are killed on drop).
        let mut fleet = Fleet {
            instances: Vec::new(),
            relay: Some(relay),
            server: None,
            dir: Some(dir.clone()),
        };
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        for n in 0..INSTANCES {
            let addr = free_addr()?;
            let admin = free_addr()?;
            let config = dir.join(format!("instance-{n}.toml"));
            let toml = format!(
                "listen = \"{addr}\"\nupstream = \"http://{bank}\"\nadmin_listen = \"{admin}\"\n\
                 redis_url = {url:?}\nnamespace = {namespace:?}\n\
                 scope_secret_create_delay = \"0s\"\nmax_in_flight = {MAX_IN_FLIGHT}\n\
                 [defaults]\nlease = \"{}s\"\n\
                 [[routes]]\npath = \"/transfers\"\nrequire_key = true\nanonymous = \"shared\"\n",
                LEASE.as_secs()
            );
            std::fs::write(&config, toml).map_err(|e| e.to_string())?;
            // One after the other: the first makes the namespace's scope secret, the second
            // reads it.
            let child = spawn_child(&exe, &config, admin).await?;
            fleet.instances.push(Instance::Child {
                child,
                addr,
                admin,
                config,
            });
        }
        Ok(fleet)
    }

    /// Two child instances on a `redis-server` the lab starts itself, with persistence on.
    pub async fn redis_server(bank: SocketAddr, namespace: &str) -> Result<Fleet, String> {
        let server = LabRedis::start().await?;
        let mut fleet = Fleet::redis(bank, &server.url(), namespace).await?;
        fleet.server = Some(server);
        Ok(fleet)
    }

    /// Restarts the store, records kept; `false` when the fleet did not start its store.
    pub async fn restart_store(&mut self) -> Result<bool, String> {
        match &mut self.server {
            Some(server) => server.restart().await.map(|()| true),
            None => Ok(false),
        }
    }

    /// Where the clients send: every instance.
    pub fn targets(&self) -> Vec<SocketAddr> {
        self.instances
            .iter()
            .map(|i| match i {
                Instance::InProcess { running, .. } => running.addr(),
                Instance::Child { addr, .. } => *addr,
            })
            .collect()
    }

    /// The first instance's admin listener (the operator's, on a shared store any one's).
    pub fn admin(&self) -> Option<SocketAddr> {
        self.instances.first().and_then(|i| match i {
            Instance::InProcess { running, .. } => running.admin_addr(),
            Instance::Child { admin, .. } => Some(*admin),
        })
    }

    /// Whether an instance can be killed without losing the store (a shared store).
    pub fn can_kill(&self) -> bool {
        self.instances
            .iter()
            .any(|i| matches!(i, Instance::Child { .. }))
    }

    /// SIGKILLs the last instance and starts a new one on its ports and store.
    pub async fn kill_and_replace(&mut self) -> Result<(), String> {
        let Some(Instance::Child {
            child,
            admin,
            config,
            ..
        }) = self.instances.last_mut()
        else {
            return Ok(());
        };
        child.start_kill().map_err(|e| e.to_string())?;
        let _ = child.wait().await;
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        *child = spawn_child(&exe, config, *admin).await?;
        Ok(())
    }

    /// Freezes or thaws the store for every instance.
    pub fn freeze(&self, frozen: bool) {
        if let Some(server) = &self.server {
            if let Err(err) = server.signal(if frozen { "STOP" } else { "CONT" }) {
                tracing::warn!(error = %err, "lab: could not freeze or thaw redis-server");
            }
        } else if let Some(relay) = &self.relay {
            relay.freeze(frozen);
        }
        for instance in &self.instances {
            if let Instance::InProcess { store, .. } = instance {
                store.freeze(frozen);
            }
        }
    }

    /// Stops every instance: in-process ones drain, child ones are terminated.
    pub async fn shutdown(&mut self) {
        for instance in std::mem::take(&mut self.instances) {
            match instance {
                Instance::InProcess { running, store } => {
                    store.freeze(false);
                    running.shutdown().await;
                }
                Instance::Child { mut child, .. } => {
                    let _ = child.start_kill();
                    let _ = child.wait().await;
                }
            }
        }
        if let Some(server) = self.server.take() {
            server.stop().await;
        }
    }
}

/// Starts `exe --config config` and waits until its admin listener says it is ready.
async fn spawn_child(
    exe: &std::path::Path,
    config: &std::path::Path,
    admin: SocketAddr,
) -> Result<tokio::process::Child, String> {
    let mut child = tokio::process::Command::new(exe)
        .arg("--config")
        .arg(config)
        .env("RUST_LOG", "error")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("could not start an idemgate instance: {e}"))?;
    let deadline = tokio::time::Instant::now() + READY_LIMIT;
    while tokio::time::Instant::now() < deadline {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("an idemgate instance exited at start: {status}"));
        }
        if super::reconcile::ready(admin).await {
            return Ok(child);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = child.start_kill();
    Err(format!(
        "an idemgate instance was not ready within {READY_LIMIT:?}"
    ))
}

fn free_addr() -> Result<SocketAddr, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("no free port: {e}"))
}

/// The Redis address of `url`, and the parts of the URL around it (credentials with their
/// `@`, the database path), to point the same URL at a relay.
fn relay_target(url: &str) -> Result<(String, String, String), String> {
    let rest = url.strip_prefix("redis://").ok_or_else(|| {
        "the bad day relays the store's traffic to freeze it: --redis-url must be redis:// (not rediss://, unix: or a cluster)".to_owned()
    })?;
    let (authority, path) = match rest.find('/') {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    let (auth, host) = match authority.rfind('@') {
        Some(i) => (&authority[..=i], &authority[i + 1..]),
        None => ("", authority),
    };
    let host = if host.contains(':') {
        host.to_owned()
    } else {
        format!("{host}:6379")
    };
    Ok((host, auth.to_owned(), path.to_owned()))
}

/// A TCP relay to Redis that can stop passing bytes.
struct Relay {
    addr: SocketAddr,
    frozen: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    async fn start(target: String) -> std::io::Result<Relay> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let frozen = watch::Sender::new(false);
        let gate = frozen.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let target = target.clone();
                let gate = gate.clone();
                tokio::spawn(async move {
                    let Ok(Ok(server)) =
                        tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(&target))
                            .await
                    else {
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::select! {
                        _ = pump(cr, sw, gate.subscribe()) => {}
                        _ = pump(sr, cw, gate.subscribe()) => {}
                    }
                });
            }
        });
        Ok(Relay { addr, frozen, task })
    }

    fn freeze(&self, frozen: bool) {
        self.frozen.send_replace(frozen);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copies `from` to `to`, holding each chunk while the relay is frozen.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut frozen: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if frozen.wait_for(|f| !*f).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
