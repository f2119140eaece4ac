//! A connection that is given up and made anew: [`Renewing`], what every Redis topology's
//! [`Link`](super::link::Link) holds its connections in.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::ConnectionLike;
use redis::{Cmd, Pipeline, RedisError, RedisFuture, RedisResult, Value};

use super::link::{fails_fast, timed_out};

/// How a [`Renewing`] connection is made.
pub(super) type Opener<C> =
    Box<dyn Fn() -> crate::store::BoxFuture<'static, RedisResult<C>> + Send + Sync>;

/// A multiplexed connection (one server's, the primary that Sentinel names, or a
/// cluster's) that is given up when a call on it ends in an error its topology names, or is
/// dropped unfinished after waiting at least its `patience`; the next call makes a new one.
///
/// One server and a cluster give it up on a timeout, or after half of `store_timeout`
/// unanswered: its caller's deadline passed on a server that did not answer. redis-rs
/// replaces a connection, or reloads a cluster's slot map, on the errors it sees: a closed
/// connection, MOVED. A server that stops answering without closing anything (a frozen
/// process, a host behind a silent network fault, a connection that a NAT or a managed
/// service's failover left dangling) shows it none, and every call would wait on it until
/// its caller gave up, for as long as TCP keeps the connection (about 15 minutes), even
/// when a new connection would be answered at once. A call dropped sooner (its client went
/// away) says nothing about the server; giving the connection up for each of those would
/// reconnect again and again. Sentinel gives it up on any cut-off call, and on `READONLY`
/// or a broken connection, so that the sentinels are asked again.
///
/// Connecting runs in a task of its own, which every caller waiting for it shares: a caller
/// whose deadline passes leaves it to finish for the next.
///
/// A connection that failed on TLS (a certificate that does not verify, a refused client
/// certificate) is not retried by waiting: until a connection succeeds again, a call that
/// finds none fails at once with that error, rustls' words included, while a new attempt
/// runs for the calls after it. Without this, a Redis restarted with an expired
/// certificate was only ever reported as "store call timed out": every call waited on
/// redis-rs's reconnection retries until its deadline passed.
pub struct Renewing<C> {
    pub(super) inner: Arc<RenewingInner<C>>,
}

impl<C> Clone for Renewing<C> {
    fn clone(&self) -> Self {
        Renewing {
            inner: self.inner.clone(),
        }
    }
}

pub(super) struct RenewingInner<C> {
    open: Opener<C>,
    /// The connection attempt under way, if any: it reports its outcome here.
    #[allow(clippy::type_complexity)]
    pending: Mutex<Option<tokio::sync::watch::Receiver<Option<RedisResult<()>>>>>,
    /// The connection, its generation and the primary epoch it was opened in; `None`
    /// once given up.
    current: Mutex<Option<(u64, C, u64)>>,
    /// With Sentinel: moved on when the sentinels name another primary than the one
    /// connected to; a connection opened in an older epoch is given up at its next call.
    pub(super) epoch: Option<Arc<AtomicU64>>,
    generation: AtomicU64,
    /// A call dropped unfinished after waiting this long gives the connection up.
    patience: Duration,
    /// Whether a call's error gives the connection up.
    gives_up: fn(&RedisError) -> bool,
    /// The last TLS failure, connecting or on a call, and when; cleared by a connection
    /// made. `failing` says whether there is one without taking the lock.
    failed: Mutex<Option<(std::time::Instant, RedisError)>>,
    failing: std::sync::atomic::AtomicBool,
    /// How long a TLS failure is told to the calls that find no connection, rather than
    /// having them wait on a new attempt: one attempt's time at most.
    fail_fast: Duration,
}

impl<C: ConnectionLike + Clone + Send + Sync + 'static> Renewing<C> {
    pub(super) fn new(
        open: Opener<C>,
        patience: Duration,
        gives_up: fn(&RedisError) -> bool,
        epoch: Option<Arc<AtomicU64>>,
        fail_fast: Duration,
    ) -> Renewing<C> {
        Renewing {
            inner: Arc::new(RenewingInner {
                open,
                pending: Mutex::new(None),
                current: Mutex::new(None),
                generation: AtomicU64::new(0),
                patience,
                gives_up,
                epoch,
                failed: Mutex::new(None),
                failing: std::sync::atomic::AtomicBool::new(false),
                fail_fast,
            }),
        }
    }

    /// The current connection, or a new one.
    pub(super) async fn connection(&self) -> RedisResult<(u64, C)> {
        loop {
            if let Some(c) = self.current() {
                return Ok(c);
            }
            let mut done = {
                let Ok(mut pending) = self.inner.pending.lock() else {
                    return Err(RedisError::from((
                        redis::ErrorKind::Io,
                        "connection state poisoned",
                    )));
                };
                match &*pending {
                    Some(rx) => rx.clone(),
                    None => {
                        let (tx, rx) = tokio::sync::watch::channel(None);
                        *pending = Some(rx.clone());
                        let inner = self.inner.clone();
                        // Read before asking: a primary change seen while connecting makes
                        // the new connection old at once, and the next call asks again.
                        let epoch = inner.epoch_now();
                        let opening = (inner.open)();
                        tokio::spawn(async move {
                            let result = opening.await.map(|conn| {
                                let generation =
                                    inner.generation.fetch_add(1, Ordering::Relaxed) + 1;
                                if let Ok(mut current) = inner.current.lock() {
                                    *current = Some((generation, conn, epoch));
                                }
                            });
                            match &result {
                                Ok(()) => inner.clear_failure(),
                                Err(e) => inner.note_failure(e),
                            }
                            if let Ok(mut pending) = inner.pending.lock() {
                                *pending = None;
                            }
                            let _ = tx.send(Some(result));
                        });
                        rx
                    }
                }
            };
            // The last attempt failed on TLS, moments ago: this one is unlikely to do
            // better, and the caller is told why now (the attempt goes on for the next).
            if let Some(e) = self.inner.recent_failure() {
                return Err(e);
            }
            let outcome = match done.wait_for(Option::is_some).await {
                Ok(v) => v.clone(),
                Err(_) => None,
            };
            match outcome {
                // Connected: `current` holds it (unless already given up: try again).
                Some(Ok(())) => {}
                Some(Err(e)) => return Err(e),
                None => return Err(timed_out("connection attempt abandoned")),
            }
        }
    }

    fn current(&self) -> Option<(u64, C)> {
        let mut current = self.inner.current.lock().ok()?;
        let now = self.inner.epoch_now();
        if current
            .as_ref()
            .is_some_and(|(_, _, opened)| *opened != now)
        {
            // Opened to a primary the sentinels no longer name: given up, never written to.
            *current = None;
        }
        current.as_ref().map(|(g, c, _)| (*g, c.clone()))
    }

    /// Gives up the connection of `generation` (not a newer one made meanwhile).
    fn forget(&self, generation: u64) {
        if let Ok(mut current) = self.inner.current.lock() {
            if current.as_ref().is_some_and(|(g, _, _)| *g == generation) {
                *current = None;
            }
        }
    }

    async fn call<T, F, Fut>(&self, run: F) -> RedisResult<T>
    where
        F: FnOnce(C) -> Fut,
        Fut: std::future::Future<Output = RedisResult<T>>,
    {
        let (generation, conn) = self.connection().await?;
        let mut guard = GiveUp {
            forget: |g| self.forget(g),
            generation,
            armed: true,
            started: std::time::Instant::now(),
            patience: self.inner.patience,
        };
        let result = run(conn).await;
        guard.armed = false;
        if let Err(e) = &result {
            self.inner.note_failure(e);
            if (self.inner.gives_up)(e) {
                self.forget(generation);
            }
        }
        result
    }
}

impl<C> RenewingInner<C> {
    pub(super) fn epoch_now(&self) -> u64 {
        self.epoch.as_ref().map_or(0, |e| e.load(Ordering::Relaxed))
    }

    /// Keeps `e` if it is a TLS failure or a refused connection.
    fn note_failure(&self, e: &RedisError) {
        if fails_fast(e) {
            if let Ok(mut failed) = self.failed.lock() {
                *failed = Some((std::time::Instant::now(), e.clone()));
                self.failing.store(true, Ordering::Relaxed);
            }
        }
    }

    fn clear_failure(&self) {
        if self.failing.load(Ordering::Relaxed) {
            if let Ok(mut failed) = self.failed.lock() {
                *failed = None;
                self.failing.store(false, Ordering::Relaxed);
            }
        }
    }

    /// The TLS failure or refused connection of less than `fail_fast` ago, if any.
    fn recent_failure(&self) -> Option<RedisError> {
        if !self.failing.load(Ordering::Relaxed) {
            return None;
        }
        let failed = self.failed.lock().ok()?;
        failed
            .as_ref()
            .filter(|(at, _)| at.elapsed() < self.fail_fast)
            .map(|(_, e)| e.clone())
    }
}

/// Gives the connection of `generation` up when its call is dropped unfinished after
/// waiting at least `patience`.
struct GiveUp<F: Fn(u64)> {
    forget: F,
    generation: u64,
    armed: bool,
    started: std::time::Instant,
    patience: Duration,
}

impl<F: Fn(u64)> Drop for GiveUp<F> {
    fn drop(&mut self) {
        if self.armed && self.started.elapsed() >= self.patience {
            (self.forget)(self.generation);
        }
    }
}

impl<C: ConnectionLike + Clone + Send + Sync + 'static> ConnectionLike for Renewing<C> {
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
