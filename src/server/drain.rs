//! The graceful shutdown: no new connections, then the connections and the upstream
//! exchanges drain together within one `shutdown_grace`, and what could not finish is
//! said.

use std::sync::Arc;
use std::time::Duration;

use hyper_util::server::graceful::GracefulShutdown;
use tokio::task::{AbortHandle, JoinHandle};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::late_writes::LateWrites;
use crate::releases::Releases;

/// What serving leaves to the drain once the shutdown signal has come.
pub(super) struct Draining {
    pub(super) grace: Duration,
    /// Where the shutdown's end is told to every accept loop.
    pub(super) end: tokio::sync::watch::Sender<Option<Instant>>,
    /// Stops every accept loop.
    pub(super) stop: CancellationToken,
    /// The upstream exchanges in flight.
    pub(super) tasks: TaskTracker,
    pub(super) releases: Arc<Releases>,
    /// Record writes still being tried: drained with the exchanges, those left logged.
    pub(super) late: Arc<LateWrites>,
    /// The first thread's proxy accept loop.
    pub(super) proxy_task: JoinHandle<()>,
    /// The ends of the other serving threads.
    pub(super) workers: Vec<tokio::sync::oneshot::Receiver<()>>,
    pub(super) admin_task: Option<JoinHandle<()>>,
    /// Tasks beside the serving, stopped last.
    pub(super) background: Vec<AbortHandle>,
}

impl Draining {
    /// Stops accepting, drains within the grace, and stops the tasks beside the serving.
    pub(super) async fn drain(self) {
        tracing::info!("shutting down: no new connections, draining in-flight requests");
        let end = Instant::now() + self.grace;
        let _ = self.end.send(Some(end));
        self.stop.cancel();
        // Connections and the exchanges whose clients already left drain together, within
        // one grace period in all: what finishes is recorded before we exit.
        let tasks = self.tasks;
        tasks.close();
        let exchanges = async {
            if tokio::time::timeout_at(end, tasks.wait()).await.is_err() {
                tracing::warn!("upstream exchanges still running after the shutdown grace period; their records will read as unknown");
            }
        };
        let _ = tokio::join!(self.proxy_task, exchanges);
        // Releases still pending were retried until the grace ran out: their claims were
        // never forwarded, and an operator may release them (until their lease runs out
        // they read as in progress, then as unknown).
        for id in self.releases.ids() {
            tracing::error!(record = %id, "shut down before the release of a claim that was never forwarded landed; it is safe to release");
        }
        // Record writes still pending were tried until the grace ran out. Their requests
        // ran and their clients have their answers; their records read in progress, then
        // unknown once the lease runs out, until an operator completes them.
        for p in self.late.give_up_all() {
            tracing::error!(
                record = %p.id,
                status = p.status,
                request_id = %p.request_id,
                "shut down before the record was written: executed and answered {}; complete it from the upstream's ledger",
                p.status
            );
        }
        for d in self.workers {
            let _ = d.await;
        }
        if let Some(t) = self.admin_task {
            let _ = t.await;
        }
        for task in self.background {
            task.abort();
        }
        tracing::info!("stopped");
    }
}

/// The end of one accept loop: its open connections are closed gracefully, and those
/// still open at the shutdown's end (told through `end`) are given up.
pub(super) async fn connections(
    mut end: tokio::sync::watch::Receiver<Option<Instant>>,
    graceful: GracefulShutdown,
) {
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
