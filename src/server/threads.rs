//! The serving threads besides the first (`worker_threads`): each started with its own
//! store connection where the store has one per thread, then handed its share of the
//! serving, and the balance that spreads new connections across the threads.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use super::accept::{accept_loop, Accepting};
use super::Error;
use crate::metrics::{Instrumented, Metrics};
use crate::proxy::Proxy;
use crate::store::Store;
use crate::wiring::Wired;

/// A serving thread besides the first, started with its store open; it serves once it is
/// given the shared state ([`Job`]).
pub(super) struct Worker {
    job: tokio::sync::oneshot::Sender<Job>,
    done: tokio::sync::oneshot::Receiver<()>,
}

/// What a serving thread shares with the first.
struct Job {
    listener: std::net::TcpListener,
    balance: Balance,
    shared: Shared,
}

/// What every serving thread's job shares.
#[derive(Clone)]
pub(super) struct Shared {
    /// The first thread's proxy: each thread makes a sibling of it over its own store.
    pub(super) proxy: Proxy,
    pub(super) metrics: Arc<Metrics>,
    /// The upstream exchanges in flight, of every thread.
    pub(super) tasks: TaskTracker,
    pub(super) accepting: Accepting,
}

impl Worker {
    /// Starts thread `n` and opens its store there (a Redis connection of its own; the
    /// other stores are shared). Fails as start-up fails if that store cannot be opened.
    pub(super) async fn start(
        n: usize,
        wired: &Wired,
        shared: &Arc<dyn Store>,
    ) -> Result<Worker, Error> {
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
                        Ok(Some(store)) => super::build::sealed(&wired, store),
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
        let Shared {
            proxy,
            metrics,
            tasks,
            accepting,
        } = self.shared;
        let listener = match TcpListener::from_std(self.listener) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "a serving thread cannot accept connections");
                return;
            }
        };
        let store: Arc<dyn Store> = Arc::new(Instrumented::new(store, metrics, store_timeout));
        let proxy = proxy.sibling(store);
        let end = accepting.end.clone();
        accept_loop(listener, accepting, Some(self.balance), move |req, peer| {
            let proxy = proxy.clone();
            async move { proxy.handle(req, peer).await }
        })
        .await;
        // Exchanges this thread spawned run on its runtime: it stays up until they end, or
        // until the shutdown deadline.
        let end = (*end.borrow()).unwrap_or_else(Instant::now);
        let _ = tokio::time::timeout_at(end, tasks.wait()).await;
    }
}

/// Gives each of `workers` its job (another handle on `listener`, and what `shared` holds);
/// returns the signals of their ends, and the first thread's balance (none when it serves
/// alone). A thread that cannot be given the listener is left out, and said so.
pub(super) fn hand_out(
    workers: Vec<Worker>,
    listener: &TcpListener,
    shared: &Shared,
) -> (Vec<tokio::sync::oneshot::Receiver<()>>, Option<Balance>) {
    let mut done = Vec::new();
    let mut balances = Balance::for_threads(workers.len() + 1).into_iter();
    // With one thread there is nothing to balance.
    let own_balance = balances.next().filter(|_| !workers.is_empty());
    for (worker, balance) in workers.into_iter().zip(balances) {
        let job = clone_listener(listener).map(|l| Job {
            listener: l,
            balance,
            shared: shared.clone(),
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
    (done, own_balance)
}

/// Another handle on the proxy's listening socket, for a serving thread to accept from.
fn clone_listener(listener: &TcpListener) -> std::io::Result<std::net::TcpListener> {
    use std::os::fd::{AsFd, OwnedFd};
    let fd: OwnedFd = listener.as_fd().try_clone_to_owned()?;
    Ok(std::net::TcpListener::from(fd))
}

/// How long a serving thread that holds more connections than another waits before it
/// accepts the next one itself.
pub(super) const BALANCE_DEFER: Duration = Duration::from_millis(1);

/// The open connections of every serving thread, for spreading new ones across them.
#[derive(Clone)]
pub(super) struct Balance {
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
    pub(super) fn ahead(&self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        let mine = self.counts[self.me].load(Relaxed);
        self.counts
            .iter()
            .enumerate()
            .any(|(i, c)| i != self.me && c.load(Relaxed) < mine)
    }

    /// Counts one connection for this thread until the guard is dropped.
    pub(super) fn hold(&self) -> Held {
        self.counts[self.me].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Held(self.clone())
    }
}

/// One open connection of a serving thread.
pub(super) struct Held(Balance);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.counts[self.0.me].fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}
