//! Serving: the accept loops of the proxy listener (one per serving thread) and of the
//! admin listener over the built [`App`], until the shutdown signal, then the drain.

use std::future::Future;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::accept::{accept_loop, Accepting, ADMIN_MAX_CONNECTIONS};
use super::build::App;
use super::drain::Draining;
use super::threads::Shared;
use super::Serving;
use crate::scope::Scoper;
use crate::store::Store;
use crate::wiring::Wired;

/// Serves on already-bound listeners until `shutdown`, then drains; `serving.workers`
/// serve from the same listener on threads of their own.
pub(super) async fn serve_on(
    wired: Wired,
    store: Arc<dyn Store>,
    scoper: Scoper,
    listener: TcpListener,
    admin: Option<TcpListener>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    serving: Serving,
) {
    let Serving { workers, reload } = serving;
    let app = App::build(wired, store, scoper, reload, admin.is_some());
    let stop = CancellationToken::new();
    // Shutdown ends at one deadline, set when it starts; every drain below shares it.
    let (end_tx, end_rx) = tokio::sync::watch::channel(None::<Instant>);
    let admin_task = admin.zip(app.admin).map(|(l, admin)| {
        let accepting = Accepting {
            stop: stop.clone(),
            end: end_rx.clone(),
            limits: app.limits.for_admin(),
            open: Arc::new(Semaphore::new(ADMIN_MAX_CONNECTIONS)),
            // Plain HTTP, whatever `listen` speaks: see docs/tls.md.
            tls: None,
        };
        tokio::spawn(accept_loop(l, accepting, None, move |req, peer| {
            let admin = admin.clone();
            async move { admin.handle(req, peer).await }
        }))
    });
    let accepting = Accepting {
        stop: stop.clone(),
        end: end_rx,
        limits: app.limits,
        open: app.open,
        tls: app.tls,
    };
    let shared = Shared {
        proxy: app.proxy,
        metrics: app.metrics,
        tasks: app.tasks.clone(),
        accepting,
    };
    let (workers, own_balance) = super::threads::hand_out(workers, &listener, &shared);
    let Shared {
        proxy, accepting, ..
    } = shared;
    let proxy_task = tokio::spawn(accept_loop(
        listener,
        accepting,
        own_balance,
        move |req, peer| {
            let proxy = proxy.clone();
            async move { proxy.handle(req, peer).await }
        },
    ));
    shutdown.await;
    let draining = Draining {
        grace: app.grace,
        end: end_tx,
        stop,
        tasks: app.tasks,
        releases: app.releases,
        late: app.late,
        proxy_task,
        workers,
        admin_task,
        background: app.background,
    };
    draining.drain().await;
}
