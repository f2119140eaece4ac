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
//! - serving a request (from its complete head to the last frame of its answer): no deadline
//!   here (the body read and upstream timeouts bound it);
//! - on HTTP/2, bytes are not activity: PING, SETTINGS and WINDOW_UPDATE frames flow on a
//!   connection without any request, so once the client's preface has arrived the
//!   connection is idle whenever no stream is being served, and closed `idle_timeout` after
//!   its last stream ended (or its preface), whatever frames arrive meanwhile;
//! - a write that makes no progress (a client that stopped reading, so its socket buffer is
//!   full): closed after `send_timeout`, in every phase, as nginx's `send_timeout` does.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
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
    // towards (`State::scheduled`): a head starting after an idle spell, a connection going
    // idle (its last answer given), an answer or a write that may stall. Without the
    // second, a connection that went idle slept towards its head deadline from accept
    // (`header_read_timeout`), and `idle_timeout` shorter than that was never applied.
    // A deadline later than the one slept towards wakes nothing: the supervisor looks
    // again then, and on a busy keep-alive connection the answers' own deadlines (each
    // request's idle and head deadlines, its answer's send deadline) are all later than
    // the one it sleeps towards, so it is not woken per request.
    deadline_moved: Notify,
    // The answers being sent, each with since when it has waited for the client to take
    // more (process milliseconds; 0 while it waits on its own source, or is done).
    answers: Mutex<Vec<std::sync::Weak<AtomicU64>>>,
}

#[derive(Clone, Copy)]
struct State {
    // Requests handed to the service and not yet answered.
    serving: usize,
    phase: Phase,
    // Since when a write has been waiting for room in the socket, if one is.
    stalled: Option<Instant>,
    // The client spoke HTTP/2: only its streams count as activity.
    h2: bool,
    // Closed to make room for another connection (the admin listener at its cap).
    evicted: bool,
    // When the supervisor looks next, and the deadlines it keeps, once it runs: a deadline
    // before that time must wake it.
    scheduled: Option<(Instant, Deadlines)>,
}

impl State {
    // Whether the deadline that `pick` takes from the supervisor's, counted from `since`,
    // comes before it looks again (always, before it runs).
    fn sooner(&self, since: Instant, pick: fn(&Deadlines) -> Duration) -> bool {
        self.scheduled.is_none_or(|(w, d)| since + pick(&d) < w)
    }
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
                    h2: false,
                    evicted: false,
                    scheduled: None,
                }),
                deadline_moved: Notify::new(),
                answers: Mutex::new(Vec::new()),
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

    /// The connection speaks HTTP/2 (its preface arrived, or TLS agreed on `h2`): from now on
    /// it is idle whenever none of its streams is being served, whatever bytes move.
    pub fn speaks_h2(&self) {
        let mut s = self.lock();
        if s.h2 {
            return;
        }
        s.h2 = true;
        if s.serving == 0 {
            s.phase = Phase::Idle(Instant::now());
        }
        drop(s);
        self.inner.deadline_moved.notify_one();
    }

    /// Closes the connection now if it serves no request (an idle one, or one that has not
    /// sent a complete head), for room under a connection cap; whether it was.
    pub fn evict_if_quiet(&self) -> bool {
        let mut s = self.lock();
        if s.serving > 0 || s.evicted {
            return false;
        }
        s.evicted = true;
        drop(s);
        self.inner.deadline_moved.notify_one();
        true
    }

    fn read(&self) {
        let mut s = self.lock();
        if !s.h2 && s.serving == 0 && matches!(s.phase, Phase::Idle(_)) {
            let now = Instant::now();
            s.phase = Phase::AwaitingHead(now);
            self.moved(s, now, |d| d.header);
        }
    }

    fn stalled(&self) {
        let mut s = self.lock();
        if s.stalled.is_none() {
            let now = Instant::now();
            s.stalled = Some(now);
            self.moved(s, now, |d| d.send);
        }
    }

    // A deadline (`pick` of the deadlines) runs from `since`: wakes the supervisor if it
    // sleeps towards a later time.
    fn moved(&self, s: MutexGuard<'_, State>, since: Instant, pick: fn(&Deadlines) -> Duration) {
        let sooner = s.sooner(since, pick);
        drop(s);
        if sooner {
            self.inner.deadline_moved.notify_one();
        }
    }

    fn wrote(&self) {
        let mut s = self.lock();
        s.stalled = None;
        // Bytes an HTTP/1.1 answer leaves in the socket after its last frame keep the
        // connection from counting as idle; HTTP/2 writes (a PING's acknowledgement) do not.
        if !s.h2 && s.serving == 0 && matches!(s.phase, Phase::Idle(_)) {
            s.phase = Phase::Idle(Instant::now());
        }
    }

    /// Tracks an answer's body until the guard is dropped: an answer that has a frame
    /// ready and is not asked for the next one for `send_timeout` counts as a stalled
    /// write. Over h2 a stream whose flow-control window the client keeps closed is never
    /// written to at all, so the socket's own stall never shows it: 16 replays held the
    /// whole buffer budget on one connection for as long as it stayed open.
    pub fn answering(&self) -> Answering {
        let since = Arc::new(AtomicU64::new(crate::admission::process_ms()));
        let mut answers = self.inner.answers.lock().unwrap_or_else(|p| p.into_inner());
        answers.retain(|a| a.strong_count() > 0);
        answers.push(Arc::downgrade(&since));
        drop(answers);
        self.moved(self.lock(), Instant::now(), |d| d.send);
        Answering { since }
    }

    /// The oldest wait of an answer for its client to take more, in milliseconds.
    fn answer_waiting_ms(&self) -> Option<u64> {
        let now = crate::admission::process_ms();
        let answers = self.inner.answers.lock().unwrap_or_else(|p| p.into_inner());
        answers
            .iter()
            .filter_map(std::sync::Weak::upgrade)
            .map(|a| a.load(Ordering::Relaxed))
            .filter(|&since| since != 0)
            .map(|since| now.saturating_sub(since))
            .max()
    }

    /// When the connection is due to be closed, if nothing happens before, and why: `None`
    /// while a request is being served and its writes make progress.
    fn due(&self, d: Deadlines) -> Option<(Instant, Closed)> {
        self.due_in(&self.lock(), d)
    }

    fn due_in(&self, s: &State, d: Deadlines) -> Option<(Instant, Closed)> {
        if s.evicted {
            return Some((Instant::now(), Closed::Quiet));
        }
        let answer = self.answer_waiting_ms().map(|waited| {
            let waited = Duration::from_millis(waited);
            (
                Instant::now() + d.send.saturating_sub(waited),
                Closed::SendTimeout,
            )
        });
        let send = s.stalled.map(|since| (since + d.send, Closed::SendTimeout));
        let send = match (send, answer) {
            (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
            (a, b) => a.or(b),
        };
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
            // When it looks next is noted under the same lock as the state it read: a
            // change after it sees the time, and wakes it if its deadline is sooner.
            let (due, wake) = {
                let mut s = self.lock();
                let due = self.due_in(&s, d);
                let wake = due.map_or_else(|| Instant::now() + d.idle.min(d.header), |(t, _)| t);
                s.scheduled = Some((wake, d));
                (due, wake)
            };
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
            let now = Instant::now();
            s.phase = Phase::Idle(now);
            self.watch.moved(s, now, |d| d.idle);
        }
    }
}

/// What an HTTP/2 client sends first (RFC 9113, section 3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// A socket that reports its reads and writes to its connection's [`Watch`].
pub struct Watched<S> {
    io: S,
    watch: Watch,
    // Bytes of the HTTP/2 preface matched so far; `None` once decided.
    preface: Option<usize>,
}

impl<S> Watched<S> {
    /// Wraps `io`.
    pub fn new(io: S, watch: Watch) -> Watched<S> {
        Watched {
            io,
            watch,
            preface: Some(0),
        }
    }

    /// The watch this socket reports to.
    pub fn watch(&self) -> &Watch {
        &self.watch
    }

    // Follows the first bytes read: the HTTP/2 preface, or anything else.
    fn sniff(&mut self, new: &[u8]) {
        let Some(matched) = self.preface else { return };
        let want = &H2_PREFACE[matched..];
        let n = want.len().min(new.len());
        if new[..n] != want[..n] {
            self.preface = None;
        } else if matched + n == H2_PREFACE.len() {
            self.preface = None;
            self.watch.speaks_h2();
        } else {
            self.preface = Some(matched + n);
        }
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
            if self.preface.is_some() {
                self.sniff(&buf.filled()[before..]);
            }
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

/// One answer's progress on its connection (see [`Watch::answering`]).
pub struct Answering {
    since: Arc<AtomicU64>,
}

/// `body` as its connection's send deadline sees it: waiting for the client from each
/// frame it hands out until it is asked for the next; not while it waits on its own
/// source (an upstream still sending), nor once it has ended.
/// `serving` is held with it, so that its request counts as served until the body is
/// dropped (one wrapper for both: a box and an indirect call per frame less).
pub fn tracked(
    body: crate::body::Body,
    answering: Answering,
    serving: Serving,
) -> crate::body::Body {
    use http_body_util::BodyExt;
    Tracked {
        body,
        answering,
        _serving: serving,
    }
    .boxed()
}

struct Tracked {
    body: crate::body::Body,
    answering: Answering,
    _serving: Serving,
}

impl hyper::body::Body for Tracked {
    type Data = bytes::Bytes;
    type Error = crate::body::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        let since = match &polled {
            Poll::Ready(Some(Ok(_))) => crate::admission::process_ms(),
            _ => 0,
        };
        self.answering.since.store(since, Ordering::Relaxed);
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// Bytes of the buffer budget that one connection, or one tenant, holds now (replays and
/// answers waiting for their client; see `max_buffered_bytes_per_connection` and
/// `max_buffered_bytes_per_tenant`); each request of the connection carries its own.
#[derive(Clone, Default)]
pub struct Holdings(Arc<std::sync::atomic::AtomicUsize>);

/// Bytes taken from a connection's or a tenant's [`Holdings`], given back when dropped.
pub struct Held {
    holdings: Holdings,
    bytes: usize,
}

impl Holdings {
    /// An empty holding, to grow with [`Held::grow`].
    pub fn hold(&self) -> Held {
        Held {
            holdings: self.clone(),
            bytes: 0,
        }
    }

    /// Takes `n` bytes if no more than `share - n` are held already, or nothing at all (a
    /// single answer larger than the share is served, alone).
    pub fn take(&self, n: usize, share: usize) -> Option<Held> {
        let mut held = self.hold();
        held.grow(n, share).then_some(held)
    }

    /// Bytes held now.
    pub fn held(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }
}

impl Held {
    /// Takes `n` more bytes if the share has room for them, or if this holding is all
    /// there is; `false`: nothing taken.
    pub fn grow(&mut self, n: usize, share: usize) -> bool {
        let mine = self.bytes;
        let grown = self
            .holdings
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| {
                (u == mine || u.saturating_add(n) <= share).then_some(u.saturating_add(n))
            });
        if grown.is_ok() {
            self.bytes += n;
        }
        grown.is_ok()
    }

    /// Takes `n` more bytes whatever the share says (an answer of a request that ran).
    pub fn force(&mut self, n: usize) {
        self.holdings.0.fetch_add(n, Ordering::Relaxed);
        self.bytes += n;
    }

    /// Gives back `n` of the bytes held (at most all of them).
    pub fn shrink(&mut self, n: usize) {
        let n = n.min(self.bytes);
        self.holdings.0.fetch_sub(n, Ordering::Relaxed);
        self.bytes -= n;
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.holdings.0.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// Pass-through requests of one connection, or of one tenant over all its connections, now,
/// from admission to the last byte of their answers (`max_pass_through_per_connection`,
/// `max_pass_through_per_tenant`): a slot each. A request beyond a share waits for one of
/// its own connection's (or tenant's) slots, within `queue_timeout`; an h2 client that
/// multiplexes its reads is slowed to its share, not refused, while one that never pulls
/// its answers' bodies holds only its share.
#[derive(Clone, Default)]
pub struct PassThroughs(Arc<std::sync::OnceLock<Arc<tokio::sync::Semaphore>>>);

impl PassThroughs {
    /// One of the `share` slots, waiting at most `wait` for it; `None`: the share stayed
    /// full. The share is fixed by the first call.
    pub async fn take(
        &self,
        share: usize,
        wait: Duration,
    ) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let slots = self
            .0
            .get_or_init(|| Arc::new(tokio::sync::Semaphore::new(share)))
            .clone();
        take_slot(slots, wait).await
    }
}

/// One of `slots`, waiting at most `wait` for it; `None`: none came free.
pub async fn take_slot(
    slots: Arc<tokio::sync::Semaphore>,
    wait: Duration,
) -> Option<tokio::sync::OwnedSemaphorePermit> {
    match slots.clone().try_acquire_owned() {
        Ok(slot) => Some(slot),
        Err(_) => tokio::time::timeout(wait, slots.acquire_owned())
            .await
            .ok()?
            .ok(),
    }
}

/// What each tenant holds now, by the tenant's hash: its bytes of the buffer budget
/// ([`Holdings`]) and its pass-through slots ([`PassThroughs`]). A tenant's entry lives
/// while something it holds does: the maps are swept of the others as they grow, so a
/// flood of made-up tenants leaves nothing behind.
#[derive(Default)]
pub struct Tenants {
    holdings: ByTenant<std::sync::atomic::AtomicUsize>,
    passing: ByTenant<tokio::sync::Semaphore>,
}

impl Tenants {
    /// The holdings of the tenant whose hash is `tenant`.
    pub fn holdings(&self, tenant: &[u8; 32]) -> Holdings {
        Holdings(self.holdings.of(tenant, Default::default))
    }

    /// The pass-through slots of the tenant whose hash is `tenant`, `share` of them when
    /// the tenant holds none now (for [`take_slot`]; each slot taken keeps them alive).
    pub fn passing(&self, tenant: &[u8; 32], share: usize) -> Arc<tokio::sync::Semaphore> {
        self.passing
            .of(tenant, || tokio::sync::Semaphore::new(share))
    }
}

/// One shared value per tenant hash, alive while someone holds it.
struct ByTenant<T>(std::sync::Mutex<std::collections::HashMap<[u8; 32], std::sync::Weak<T>>>);

impl<T> Default for ByTenant<T> {
    fn default() -> Self {
        ByTenant(std::sync::Mutex::default())
    }
}

impl<T> ByTenant<T> {
    fn of(&self, tenant: &[u8; 32], make: impl FnOnce() -> T) -> Arc<T> {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(live) = map.get(tenant).and_then(std::sync::Weak::upgrade) {
            return live;
        }
        // Swept when the map has doubled since the last sweep left it.
        if map.len() >= 64 && map.len().is_power_of_two() {
            map.retain(|_, w| w.strong_count() > 0);
        }
        let fresh = Arc::new(make());
        map.insert(*tenant, Arc::downgrade(&fresh));
        fresh
    }
}

/// What each request of a client connection carries of it, as one request extension (one
/// allocation per request, not one per part).
#[derive(Clone, Default)]
pub struct OfConnection {
    /// HTTP/1.x only: its requests are served one at a time, so the connection's end is
    /// this request's client gone. An h2 stream's reset drops its request itself.
    pub hangup: Option<Hangup>,
    /// What the connection's replays and answers hold of the buffer budget.
    pub holdings: Holdings,
    /// The connection's pass-through slots.
    pub passing: PassThroughs,
}

/// A client's TCP socket, shared between the connection that reads and writes it and the
/// [`Hangup`] of its requests, which peeks at it to learn whether the client has gone.
pub struct Socket(Arc<tokio::net::TcpStream>);

impl Socket {
    /// Wraps a newly accepted socket.
    pub fn new(stream: tokio::net::TcpStream) -> Socket {
        Socket(Arc::new(stream))
    }

    /// What a request of this connection can wait on to learn that its client has gone.
    pub fn hangup(&self) -> Hangup {
        Hangup(Arc::downgrade(&self.0))
    }
}

impl AsyncRead for Socket {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            std::task::ready!(self.0.poll_read_ready(cx))?;
            // Into the buffer's unfilled part as it is: `try_read` wants it initialized,
            // and hyper hands a fresh, uninitialized one on every read, so zeroing it first
            // cost a memset of the whole read buffer per read (a fifth of a pass-through's
            // instructions).
            match self.0.try_read_buf(buf) {
                Ok(_) => return Poll::Ready(Ok(())),
                // Readiness was cleared: the next poll registers for more.
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncWrite for Socket {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        loop {
            std::task::ready!(self.0.poll_write_ready(cx))?;
            match self.0.try_write(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                done => return Poll::Ready(done),
            }
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        loop {
            std::task::ready!(self.0.poll_write_ready(cx))?;
            match self.0.try_write_vectored(bufs) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                done => return Poll::Ready(done),
            }
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(
            rustix::net::shutdown(&*self.0, rustix::net::Shutdown::Write).map_err(io::Error::from),
        )
    }
}

/// How often a request whose client has sent bytes beyond it (a pipelined request) looks
/// again for the end of the connection behind them.
const HANGUP_RECHECK: Duration = Duration::from_millis(100);

/// Whether an HTTP/1.1 client is still there, for a request that waits (in the admission
/// queue) before anything is done for it. hyper reads nothing more of a connection while
/// its request is served (half-close is on, so that a client that sent its request and
/// shut its side still gets it executed), so the socket is peeked at instead: an end of
/// stream or a reset means the client has gone. Bytes waiting beyond the request (a
/// pipelined request, a TLS close_notify) hide an end behind them; such a request is
/// bounded by `queue_timeout` as any other.
#[derive(Clone)]
pub struct Hangup(std::sync::Weak<tokio::net::TcpStream>);

impl Hangup {
    /// Resolves once the client has closed or reset its connection (or the connection is
    /// closed already); pending for as long as it is open.
    pub async fn gone(&self) {
        loop {
            let Some(stream) = self.0.upgrade() else {
                return;
            };
            let mut byte = [0u8; 1];
            match stream.peek(&mut byte).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {
                    drop(stream);
                    tokio::time::sleep(HANGUP_RECHECK).await;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
