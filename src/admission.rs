//! Who gets to run now, who waits, and who is told to come back: the slots of
//! `max_in_flight` (protected requests) and of the pass-through share of
//! `max_upstream_connections`, each with a bounded FIFO queue in front, and the byte budget
//! of bodies being buffered or written (`max_buffered_bytes`).
//!
//! An upstream outage is when every client times out and retries at once. Refusing at once
//! beyond the limit made that worse: a refusal cost nearly what an admitted request costs,
//! and clients that retry at once came straight back, so goodput fell to an eighth of its
//! best at 8x the limit's worth of clients. Here a request beyond the limit waits for a
//! slot, at most `queue_timeout` and behind at most `max_queued` others; only beyond that
//! is it refused, before its body is read, with a `Retry-After` from the queue (how many
//! wait, over how many finish a second).
//!
//! The queue is first in, first out (tokio's fair semaphore). CoDel's short timeouts and
//! adaptive LIFO (Facebook's RPC servers) serve the newest first once a queue stands, on
//! the bet that the oldest waiters' clients have given up; here `queue_timeout` (1 s) is
//! shorter than the client timeouts of payment APIs, a queued request of a client that
//! hung up is dropped from the queue with its connection, and under LIFO the oldest
//! retries (the payments waiting longest) would be the ones starved. Envoy's adaptive
//! concurrency would move `max_in_flight` with the upstream's latency; it stays a fixed
//! setting here, measured in `bench/saturation`.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Why a request was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// All slots busy and `max_queued` requests waiting already.
    QueueFull,
    /// Waited `queue_timeout` without a slot.
    QueueTimeout,
    /// Bodies being buffered or written hold `max_buffered_bytes`.
    BuffersFull,
    /// Its client connection or its tenant holds its whole share of the buffer budget
    /// (`max_buffered_bytes_per_connection`, `max_buffered_bytes_per_tenant`), or its
    /// connection its share of the pass-through slots (`max_pass_through_per_connection`),
    /// while other connections and tenants are served.
    ShareFull,
    /// Its HTTP/1.1 client closed or reset the connection while it waited in the queue:
    /// it leaves the queue, nothing done (nobody reads the 503).
    ClientGone,
}

impl Refusal {
    /// The `reason` label of `idemgate_refused_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::QueueFull => "queue_full",
            Refusal::QueueTimeout => "queue_timeout",
            Refusal::BuffersFull => "buffers_full",
            Refusal::ShareFull => "share_full",
            Refusal::ClientGone => "client_gone",
        }
    }
}

/// What one class of requests exports.
#[derive(Clone, Default)]
pub struct Gauges {
    /// Requests holding a slot.
    pub in_flight: Gauge,
    /// Requests waiting for one.
    pub queued: Gauge,
    /// How long admitted requests waited.
    pub wait: Option<Histogram>,
}

/// The slots of one class of requests and the queue in front of them.
pub struct Slots {
    slots: Arc<Semaphore>,
    max_queued: usize,
    queue_timeout: Duration,
    queued: AtomicUsize,
    rate: Completions,
    gauges: Gauges,
}

/// A slot, held for as long as its request runs (a detached exchange included).
pub struct Slot {
    _permit: OwnedSemaphorePermit,
    owner: Arc<Slots>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.owner.rate.tick();
        self.owner.gauges.in_flight.dec();
    }
}

impl Slots {
    /// `size` slots, at most `max_queued` waiting for one, each for at most `queue_timeout`.
    pub fn new(size: usize, max_queued: usize, queue_timeout: Duration, gauges: Gauges) -> Slots {
        Slots {
            slots: Arc::new(Semaphore::new(size)),
            max_queued,
            queue_timeout,
            queued: AtomicUsize::new(0),
            rate: Completions::default(),
            gauges,
        }
    }

    /// Whether a request arriving now would be refused at once: no slot free and the
    /// queue full. Asked before a body is read, so that such a refusal costs no buffering.
    pub fn would_refuse(&self) -> bool {
        self.slots.available_permits() == 0
            && self.queued.load(Ordering::Relaxed) >= self.max_queued
    }

    /// [`admit`](Self::admit), leaving the queue as soon as `gone` resolves (the client
    /// hung up): a free slot is taken whatever `gone` says, so that a request whose client
    /// sent it whole and left is still executed when nothing keeps it waiting.
    pub async fn admit_unless(
        self: &Arc<Self>,
        gone: impl std::future::Future<Output = ()>,
    ) -> Result<Slot, Refusal> {
        tokio::select! {
            biased;
            admitted = self.admit() => admitted,
            () = gone => Err(Refusal::ClientGone),
        }
    }

    /// A slot now, or after waiting in the queue; `Err` if the queue is full or the wait
    /// passes `queue_timeout`. Dropping the future (the client hung up) leaves the queue.
    pub async fn admit(self: &Arc<Self>) -> Result<Slot, Refusal> {
        if let Ok(p) = self.slots.clone().try_acquire_owned() {
            if let Some(h) = &self.gauges.wait {
                h.observe(0.0);
            }
            return Ok(self.slot(p));
        }
        let taken = self
            .queued
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < self.max_queued).then_some(n + 1)
            });
        if taken.is_err() {
            return Err(Refusal::QueueFull);
        }
        let _queued = Queued(self);
        self.gauges.queued.inc();
        let started = Instant::now();
        let got =
            tokio::time::timeout(self.queue_timeout, self.slots.clone().acquire_owned()).await;
        match got {
            Ok(Ok(p)) => {
                if let Some(h) = &self.gauges.wait {
                    h.observe(started.elapsed().as_secs_f64());
                }
                Ok(self.slot(p))
            }
            // The semaphore is never closed; a timeout is the only way here.
            _ => Err(Refusal::QueueTimeout),
        }
    }

    fn slot(self: &Arc<Self>, permit: OwnedSemaphorePermit) -> Slot {
        self.gauges.in_flight.inc();
        Slot {
            _permit: permit,
            owner: self.clone(),
        }
    }

    /// Seconds a refused client should wait: the queue's length over the slots' recent
    /// completions per second, rounded up, from 1 to 60.
    pub fn retry_after(&self) -> u64 {
        let queued = self.queued.load(Ordering::Relaxed) as u64;
        let per_sec = self.rate.per_second().max(1);
        queued.div_ceil(per_sec).clamp(1, 60)
    }

    /// Requests waiting now.
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }
}

/// Leaves the queue when dropped: admitted, timed out, or dropped with its connection.
struct Queued<'a>(&'a Slots);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.queued.fetch_sub(1, Ordering::Relaxed);
        self.0.gauges.queued.dec();
    }
}

/// A spell of refusals (a full buffer budget, a store that does not answer): when it began.
/// A refusal within it is told to come back after about as long as the spell has lasted
/// (at least 1 s, at most 60): a hold that lasted T seconds is, without anything better to
/// go on, as likely to last T more, so the clients it sends away come back at a pace that
/// slows as it goes on instead of every second.
#[derive(Default)]
pub struct Spell(AtomicU64);

impl Spell {
    /// A refusal now: starts the spell if none runs. The `Retry-After` seconds to give.
    pub fn refused(&self) -> u64 {
        let now = process_ms();
        let start = match self
            .0
            .compare_exchange(0, now, Ordering::Relaxed, Ordering::Relaxed)
        {
            Ok(_) => now,
            Err(start) => start,
        };
        (now.saturating_sub(start).div_ceil(1000)).clamp(1, 60)
    }

    /// What was refusing works again: the next refusal starts a new spell.
    pub fn ended(&self) {
        if self.0.load(Ordering::Relaxed) != 0 {
            self.0.store(0, Ordering::Relaxed);
        }
    }
}

/// Completions per second: counts in whole seconds since start, the last full second read.
#[derive(Default)]
struct Completions {
    // (second << 32) | count in that second; the previous second's count beside it.
    current: AtomicU64,
    previous: AtomicU64,
}

/// Milliseconds since this process first asked, plus one (so that 0 can mean "never"):
/// the clock of the per-second counters here and in the proxy.
pub(crate) fn process_ms() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    1 + START.get_or_init(Instant::now).elapsed().as_millis() as u64
}

fn now_second() -> u64 {
    process_ms() / 1000
}

impl Completions {
    fn tick(&self) {
        self.add(1);
    }

    // At most 2^32 - 1 a second (KiB for the buffer budget: 4 TiB/s).
    fn add(&self, n: u64) {
        let n = n.min(0xffff_ffff);
        let sec = now_second() & 0xffff_ffff;
        let _ = self
            .current
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                if v >> 32 == sec {
                    Some((v & !0xffff_ffff) | ((v & 0xffff_ffff) + n).min(0xffff_ffff))
                } else {
                    // A new second: the one before it becomes the estimate (zero if it was
                    // not the second just before).
                    let count = if (v >> 32) + 1 == sec {
                        v & 0xffff_ffff
                    } else {
                        0
                    };
                    self.previous.store(count, Ordering::Relaxed);
                    Some((sec << 32) | n)
                }
            });
    }

    fn per_second(&self) -> u64 {
        let sec = now_second() & 0xffff_ffff;
        let v = self.current.load(Ordering::Relaxed);
        let current = if v >> 32 == sec { v & 0xffff_ffff } else { 0 };
        let previous = if v >> 32 == sec {
            self.previous.load(Ordering::Relaxed)
        } else if (v >> 32) + 1 == sec {
            v & 0xffff_ffff
        } else {
            0
        };
        previous.max(current)
    }
}

/// Bytes of bodies being buffered (a protected request's until it is admitted) or written
/// to a client (an answer, until its last byte is handed to the socket), at most
/// `max_buffered_bytes`. An answer of a request that ran is always taken (it cannot be
/// refused any more); everything else is refused beyond the budget.
pub struct Buffers {
    used: AtomicUsize,
    max: usize,
    refused: Counter,
    gauge: Gauge,
    // KiB given back per second: how fast the budget drains, for `Retry-After`.
    released: Completions,
    // Refusals since the budget last fell below half full, and the most bytes one of them
    // asked for: how long the budget has been full, and how much must drain.
    full: Spell,
    wanted: AtomicUsize,
}

/// Bytes taken from [`Buffers`], given back when dropped.
pub struct Buffered {
    owner: Arc<Buffers>,
    bytes: usize,
}

impl Buffers {
    /// A budget of `max` bytes.
    pub fn new(max: usize, refused: Counter, gauge: Gauge) -> Buffers {
        Buffers {
            used: AtomicUsize::new(0),
            max,
            refused,
            gauge,
            released: Completions::default(),
            full: Spell::default(),
            wanted: AtomicUsize::new(0),
        }
    }

    /// An empty holding, to grow with [`Buffered::grow`].
    pub fn hold(self: &Arc<Self>) -> Buffered {
        Buffered {
            owner: self.clone(),
            bytes: 0,
        }
    }

    /// Takes `n` bytes whatever the budget says (an answer of a request that ran).
    pub fn take(self: &Arc<Self>, n: usize) -> Buffered {
        self.used.fetch_add(n, Ordering::Relaxed);
        self.gauge.inc_by(n as i64);
        Buffered {
            owner: self.clone(),
            bytes: n,
        }
    }

    /// Bytes held now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// Whether the budget is all taken: new work waits for it or is refused.
    pub fn is_full(&self) -> bool {
        self.used() >= self.max
    }

    /// Counts a request refused because the budget is all taken (see [`is_full`](Self::is_full)).
    pub fn refuse(&self) {
        self.refused.inc();
    }

    /// Seconds a request refused for want of budget should wait: what must drain for the
    /// largest refused request to fit, over the KiB given back in the last second; while
    /// nothing drains, or when what refused was a connection's or tenant's share, as long
    /// as the refusals have lasted (see [`Spell`]). From 1 to 60.
    pub fn retry_after(&self) -> u64 {
        let held_for = self.full.refused();
        let wanted = self.wanted.load(Ordering::Relaxed);
        let excess = (self.used() + wanted).saturating_sub(self.max);
        let excess_kib = (excess as u64).div_ceil(1024).max(1);
        // A refusal of a share (one connection's or tenant's, the budget itself not full)
        // wants nothing of the budget: how long the hold has lasted is all there is.
        match (wanted, self.released.per_second()) {
            (0, _) | (_, 0) => held_for,
            (_, per_sec) => excess_kib.div_ceil(per_sec).clamp(1, 60),
        }
    }
}

impl Buffered {
    /// Takes `n` more bytes whatever the budget says (an answer of a request that ran).
    pub fn force(&mut self, n: usize) {
        self.owner.used.fetch_add(n, Ordering::Relaxed);
        self.owner.gauge.inc_by(n as i64);
        self.bytes += n;
    }

    /// Gives back `n` of the bytes held (at most all of them): room taken for a body that
    /// turned out shorter.
    pub fn shrink(&mut self, n: usize) {
        let n = n.min(self.bytes);
        if n == 0 {
            return;
        }
        self.owner.used.fetch_sub(n, Ordering::Relaxed);
        self.owner.gauge.dec_by(n as i64);
        self.bytes -= n;
    }

    /// Takes `n` more bytes only if the budget has room for them, and counts no refusal
    /// when it has not: for work that can be left undone (an observed duplicate's answer
    /// kept while it waits for a record), never for a request.
    pub fn grow_if_room(&mut self, n: usize) -> bool {
        self.add(n, false)
    }

    /// Adds `n` bytes if they fit the budget, or (`alone`) if this holding is all there is.
    fn add(&mut self, n: usize, alone: bool) -> bool {
        let max = self.owner.max;
        let mine = self.bytes;
        let grown = self
            .owner
            .used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| {
                u.checked_add(n)
                    .filter(|t| *t <= max || (alone && u == mine))
            });
        if grown.is_ok() {
            self.bytes += n;
            self.owner.gauge.inc_by(n as i64);
        }
        grown.is_ok()
    }

    /// Takes `n` more bytes if the budget has room, or if nothing else is held: one body
    /// larger than the whole budget (an 80 MiB answer under 64 MiB) is still served, alone.
    pub fn grow(&mut self, n: usize) -> Result<(), Refusal> {
        if self.add(n, true) {
            return Ok(());
        }
        self.owner.refused.inc();
        self.owner
            .wanted
            .fetch_max(self.bytes + n, Ordering::Relaxed);
        Err(Refusal::BuffersFull)
    }
}

impl Drop for Buffered {
    fn drop(&mut self) {
        if self.bytes == 0 {
            return;
        }
        let before = self.owner.used.fetch_sub(self.bytes, Ordering::Relaxed);
        self.owner.gauge.dec_by(self.bytes as i64);
        self.owner.released.add(self.bytes.div_ceil(1024) as u64);
        // Below half full the spell of refusals is over.
        if before - self.bytes < self.owner.max / 2 {
            self.owner.full.ended();
            self.owner.wanted.store(0, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots(size: usize, queued: usize, timeout_ms: u64) -> Arc<Slots> {
        Arc::new(Slots::new(
            size,
            queued,
            Duration::from_millis(timeout_ms),
            Gauges::default(),
        ))
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_beyond_the_slots_waits_for_one_in_order() {
        let s = slots(1, 2, 1000);
        let first = s.admit().await.expect("a free slot");
        let (a, b) = (s.clone(), s.clone());
        let second = tokio::spawn(async move {
            let slot = a.admit().await;
            let at = tokio::time::Instant::now();
            // Held a moment, so the third is admitted only after the second lets go.
            tokio::time::sleep(Duration::from_millis(10)).await;
            slot.map(|_| at)
        });
        tokio::task::yield_now().await;
        let third =
            tokio::spawn(async move { b.admit().await.map(|_| tokio::time::Instant::now()) });
        tokio::task::yield_now().await;
        assert_eq!(s.queued(), 2);
        assert!(s.would_refuse(), "slots busy, queue full");
        assert_eq!(s.admit().await.err(), Some(Refusal::QueueFull));
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(first);
        let t2 = second.await.unwrap().expect("second admitted");
        let t3 = third.await.unwrap().expect("third admitted");
        assert!(t2 < t3, "first in, first out");
        assert_eq!(s.queued(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_ends_at_the_queue_timeout() {
        let s = slots(1, 8, 250);
        let _held = s.admit().await.expect("a free slot");
        let started = tokio::time::Instant::now();
        assert_eq!(s.admit().await.err(), Some(Refusal::QueueTimeout));
        assert_eq!(started.elapsed(), Duration::from_millis(250));
        assert_eq!(s.queued(), 0, "left the queue");
    }

    #[tokio::test(start_paused = true)]
    async fn a_dropped_waiter_leaves_the_queue() {
        let s = slots(1, 1, 10_000);
        let _held = s.admit().await.expect("a free slot");
        let a = s.clone();
        let waiter = tokio::spawn(async move { a.admit().await.is_ok() });
        tokio::task::yield_now().await;
        assert_eq!(s.queued(), 1);
        waiter.abort();
        let _ = waiter.await;
        assert_eq!(s.queued(), 0);
        assert!(!s.would_refuse());
    }

    #[test]
    fn retry_after_is_the_queue_over_the_completion_rate() {
        let s = slots(1, 100, 1000);
        assert_eq!(s.retry_after(), 1, "nothing queued");
        s.queued.store(90, Ordering::Relaxed);
        // No completions measured yet: one a second assumed, capped at 60.
        assert_eq!(s.retry_after(), 60);
        for _ in 0..30 {
            s.rate.tick();
        }
        assert_eq!(s.retry_after(), 3);
    }

    #[test]
    fn a_full_budget_says_how_long_what_must_drain_takes() {
        let b = Arc::new(Buffers::new(
            100 * 1024,
            Counter::default(),
            Gauge::default(),
        ));
        let mut big = b.hold();
        big.grow(90 * 1024).expect("room");
        let mut other = b.hold();
        assert_eq!(other.grow(50 * 1024), Err(Refusal::BuffersFull));
        // Nothing drained yet, and the hold has just begun.
        assert_eq!(b.retry_after(), 1);
        // 5 KiB a second drain; 40 KiB must before the refused 50 KiB fit.
        let mut small = b.hold();
        small.grow(5 * 1024).expect("room");
        drop(small);
        assert_eq!(b.retry_after(), 8);
        drop(big);
        assert_eq!(b.wanted.load(Ordering::Relaxed), 0, "below half full: over");
    }

    #[test]
    fn buffers_refuse_beyond_the_budget_but_answers_are_always_taken() {
        let b = Arc::new(Buffers::new(100, Counter::default(), Gauge::default()));
        let mut body = b.hold();
        body.grow(60).expect("room");
        let mut other = b.hold();
        assert_eq!(other.grow(50), Err(Refusal::BuffersFull));
        let answer = b.take(500);
        assert_eq!(b.used(), 560);
        drop(answer);
        drop(body);
        assert_eq!(b.used(), 0);
        other.grow(100).expect("room again");
        drop(other);
        // Alone, a body larger than the whole budget is served; beside it, nothing more.
        let mut huge = b.hold();
        huge.grow(80).expect("alone");
        huge.grow(900).expect("still alone");
        assert_eq!(b.hold().grow(1), Err(Refusal::BuffersFull));
    }

    /// Work that can be left undone takes bytes only where the budget has room, even
    /// with nothing else held, and a "no" is not counted as a refused request.
    #[test]
    fn grow_if_room_takes_only_room_and_counts_no_refusal() {
        let refused = Counter::default();
        let b = Arc::new(Buffers::new(100, refused.clone(), Gauge::default()));
        assert!(!b.hold().grow_if_room(101), "alone, but beyond the budget");
        let held = b.take(60);
        let mut kept = b.hold();
        assert!(!kept.grow_if_room(41));
        assert!(kept.grow_if_room(40));
        assert_eq!(b.used(), 100);
        assert_eq!(refused.get(), 0);
        drop((held, kept));
        assert_eq!(b.used(), 0);
    }
}
