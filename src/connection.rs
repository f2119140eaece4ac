//! What one client connection may hold: a deadline for its request heads counted from the
//! moment it was accepted (a connection that never sends a byte included), a deadline for
//! keep-alive idleness, and a cap on how many are open at once.
//!
//! hyper's own `header_read_timeout` starts only once hyper reads a head, and hyper-util's
//! `auto` builder first reads the protocol preface without any timer: a connection that
//! sends nothing was held forever, and enough of them exhausted the file descriptors. Here
//! the connection's bytes and its requests are watched from the outside instead:
//!
//! - awaiting a head (from accept, or from the first byte after an idle spell): closed after
//!   `header_read_timeout`;
//! - idle (no request being served, no bytes either way): closed after `idle_timeout`;
//! - serving a request: no deadline here (the body read and upstream timeouts bound it);
//! - a write that makes no progress (a client that stopped reading, so its socket buffer is
//!   full): closed after `send_timeout`, in every phase, as nginx's `send_timeout` does.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;
use tokio::time::Instant;

/// The deadlines a connection lives under.
#[derive(Clone, Copy, Debug)]
pub struct Deadlines {
    /// From accept, or from the first byte of a later request, to a complete head.
    pub header: Duration,
    /// With no request being served and no bytes moving.
    pub idle: Duration,
    /// A write waiting on the client without progress.
    pub send: Duration,
}

/// Why a supervised connection was closed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Closed {
    /// No complete head in time, or idle too long.
    Quiet,
    /// A write made no progress for the send deadline.
    SendTimeout,
}

/// One connection's state, shared by its socket wrapper, its service and its supervisor.
#[derive(Clone)]
pub struct Watch {
    inner: Arc<Shared>,
}

struct Shared {
    state: Mutex<State>,
    // Woken when the deadline may have come sooner than the one the supervisor sleeps
    // towards: a head starting after an idle spell, and a connection going idle (its
    // last answer given). Without the second, a connection that went idle slept towards
    // its head deadline from accept (`header_read_timeout`), and `idle_timeout` shorter
    // than that was never applied.
    deadline_moved: Notify,
}

#[derive(Clone, Copy)]
struct State {
    // Requests handed to the service and not yet answered.
    serving: usize,
    phase: Phase,
    // Since when a write has been waiting for room in the socket, if one is.
    stalled: Option<Instant>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for a complete request head since this instant.
    AwaitingHead(Instant),
    /// Nothing to do since this instant.
    Idle(Instant),
}

impl Watch {
    /// A connection accepted now: it owes a request head within the header deadline.
    pub fn accepted() -> Watch {
        Watch {
            inner: Arc::new(Shared {
                state: Mutex::new(State {
                    serving: 0,
                    phase: Phase::AwaitingHead(Instant::now()),
                    stalled: None,
                }),
                deadline_moved: Notify::new(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every update is a plain assignment: a poisoned lock is still consistent.
        self.inner.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A complete head arrived and its request goes to the service; the returned guard marks
    /// its answer as given when dropped.
    pub fn serving(&self) -> Serving {
        self.lock().serving += 1;
        Serving {
            watch: self.clone(),
        }
    }

    fn read(&self) {
        let mut s = self.lock();
        if s.serving == 0 && matches!(s.phase, Phase::Idle(_)) {
            s.phase = Phase::AwaitingHead(Instant::now());
            drop(s);
            self.inner.deadline_moved.notify_one();
        }
    }

    fn stalled(&self) {
        let mut s = self.lock();
        if s.stalled.is_none() {
            s.stalled = Some(Instant::now());
            drop(s);
            self.inner.deadline_moved.notify_one();
        }
    }

    fn wrote(&self) {
        let mut s = self.lock();
        s.stalled = None;
        // An answer still streaming out keeps its connection from counting as idle.
        if s.serving == 0 && matches!(s.phase, Phase::Idle(_)) {
            s.phase = Phase::Idle(Instant::now());
        }
    }

    /// When the connection is due to be closed, if nothing happens before, and why: `None`
    /// while a request is being served and its writes make progress.
    fn due(&self, d: Deadlines) -> Option<(Instant, Closed)> {
        let s = *self.lock();
        let send = s.stalled.map(|since| (since + d.send, Closed::SendTimeout));
        if s.serving > 0 {
            return send;
        }
        let quiet = match s.phase {
            Phase::AwaitingHead(since) => since + d.header,
            Phase::Idle(since) => since + d.idle,
        };
        Some(match send {
            Some(send) if send.0 < quiet => send,
            _ => (quiet, Closed::Quiet),
        })
    }

    /// Drives `conn` until it ends, or until it overstays a deadline: then it is dropped,
    /// which closes the socket, and the deadline it overstayed is returned.
    pub async fn supervise<F: Future>(self, d: Deadlines, conn: F) -> Result<F::Output, Closed> {
        tokio::pin!(conn);
        loop {
            // While a request is served there is no deadline; look again after a while.
            let due = self.due(d);
            let wake = due.map_or_else(|| Instant::now() + d.idle.min(d.header), |(t, _)| t);
            tokio::select! {
                out = &mut conn => return Ok(out),
                _ = tokio::time::sleep_until(wake) => {
                    if due.is_some() {
                        if let Some((t, why)) = self.due(d) {
                            if t <= Instant::now() {
                                return Err(why);
                            }
                        }
                    }
                }
                _ = self.inner.deadline_moved.notified() => {}
            }
        }
    }
}

/// A request being served on a watched connection.
pub struct Serving {
    watch: Watch,
}

impl Drop for Serving {
    fn drop(&mut self) {
        let mut s = self.watch.lock();
        s.serving = s.serving.saturating_sub(1);
        if s.serving == 0 {
            s.phase = Phase::Idle(Instant::now());
            drop(s);
            self.watch.inner.deadline_moved.notify_one();
        }
    }
}

/// A socket that reports its reads and writes to its connection's [`Watch`].
pub struct Watched<S> {
    io: S,
    watch: Watch,
}

impl<S> Watched<S> {
    /// Wraps `io`.
    pub fn new(io: S, watch: Watch) -> Watched<S> {
        Watched { io, watch }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.watch.read();
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write(cx, buf);
        match polled {
            Poll::Ready(Ok(n)) if n > 0 => self.watch.wrote(),
            Poll::Pending => self.watch.stalled(),
            _ => {}
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        match polled {
            Poll::Ready(Ok(n)) if n > 0 => self.watch.wrote(),
            Poll::Pending => self.watch.stalled(),
            _ => {}
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: Deadlines = Deadlines {
        header: Duration::from_secs(10),
        idle: Duration::from_secs(60),
        send: Duration::from_secs(30),
    };

    #[tokio::test(start_paused = true)]
    async fn a_silent_connection_is_due_a_header_timeout_after_accept() {
        let w = Watch::accepted();
        let accepted = Instant::now();
        assert_eq!(w.due(D), Some((accepted + D.header, Closed::Quiet)));
        let out = w.supervise(D, std::future::pending::<()>()).await;
        assert_eq!(out, Err(Closed::Quiet));
        assert_eq!(Instant::now() - accepted, D.header);
    }

    // The supervisor sleeps towards the head deadline from accept while the first request
    // arrives and is served; once it is answered, the shorter idle deadline must apply.
    #[tokio::test(start_paused = true)]
    async fn an_idle_timeout_shorter_than_the_head_timeout_is_applied() {
        let d = Deadlines {
            header: Duration::from_secs(30),
            idle: Duration::from_secs(1),
            send: Duration::from_secs(60),
        };
        let w = Watch::accepted();
        let serving = w.serving();
        let supervised = tokio::spawn(w.clone().supervise(d, std::future::pending::<()>()));
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(serving);
        let idle = Instant::now();
        assert!(supervised.await.expect("supervisor").is_err(), "closed");
        assert_eq!(Instant::now() - idle, d.idle);
    }

    #[tokio::test(start_paused = true)]
    async fn idle_after_an_answer_then_a_head_deadline_from_the_next_byte() {
        let w = Watch::accepted();
        let serving = w.serving();
        assert_eq!(w.due(D), None, "no deadline while serving");
        tokio::time::advance(Duration::from_secs(100)).await;
        drop(serving);
        let done = Instant::now();
        assert_eq!(w.due(D), Some((done + D.idle, Closed::Quiet)));
        tokio::time::advance(Duration::from_secs(5)).await;
        w.wrote();
        assert_eq!(
            w.due(D),
            Some((done + Duration::from_secs(5) + D.idle, Closed::Quiet))
        );
        tokio::time::advance(Duration::from_secs(5)).await;
        w.read();
        assert_eq!(w.due(D), Some((Instant::now() + D.header, Closed::Quiet)));
        // More bytes of the same head do not move its deadline.
        let head = Instant::now();
        tokio::time::advance(Duration::from_secs(1)).await;
        w.read();
        assert_eq!(w.due(D), Some((head + D.header, Closed::Quiet)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_head_after_idle_wakes_the_supervisor_for_its_sooner_deadline() {
        let w = Watch::accepted();
        drop(w.serving());
        let watch = w.clone();
        let started = Instant::now();
        let task =
            tokio::spawn(async move { watch.supervise(D, std::future::pending::<()>()).await });
        tokio::time::sleep(Duration::from_secs(1)).await;
        w.read();
        assert!(task.await.expect("task").is_err());
        assert_eq!(Instant::now() - started, Duration::from_secs(1) + D.header);
    }

    // A client that stops reading while its answer is written: the request is being served,
    // so no quiet deadline applies, but the stalled write closes it after `send`.
    #[tokio::test(start_paused = true)]
    async fn a_write_without_progress_closes_the_connection_after_the_send_deadline() {
        let w = Watch::accepted();
        let serving = w.serving();
        assert_eq!(w.due(D), None);
        w.stalled();
        let stalled = Instant::now();
        tokio::time::advance(Duration::from_secs(10)).await;
        // Still stalled: the deadline is from the first stall, not the latest poll.
        w.stalled();
        assert_eq!(w.due(D), Some((stalled + D.send, Closed::SendTimeout)));
        // Progress resets it.
        w.wrote();
        assert_eq!(w.due(D), None);
        w.stalled();
        let again = Instant::now();
        let out = w.clone().supervise(D, std::future::pending::<()>()).await;
        assert_eq!(out, Err(Closed::SendTimeout));
        assert_eq!(Instant::now() - again, D.send);
        drop(serving);
    }
}
