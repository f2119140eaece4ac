//! The waits of duplicates for their first request (`in_progress_wait`): how each ended,
//! and how long it took.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// How a wait ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitEnd {
    /// The first request's record settled (a replay, `outcome-unknown`, a released claim
    /// this one then took): the duplicate is answered as if it had come after it.
    Settled,
    /// The wait ran out with the first still running: 409 `in-progress`.
    TimedOut,
    /// `max_waiting` duplicates were waiting already: 409 `in-progress` at once.
    Full,
    /// The client hung up.
    Gone,
    /// The instance shut down: 409 `in-progress`.
    Shutdown,
    /// No slot was free for the claim after a wake: 503 `overloaded`.
    Overloaded,
}

impl WaitEnd {
    /// Every end, in label order.
    pub const ALL: [WaitEnd; 6] = [
        WaitEnd::Settled,
        WaitEnd::TimedOut,
        WaitEnd::Full,
        WaitEnd::Gone,
        WaitEnd::Shutdown,
        WaitEnd::Overloaded,
    ];

    /// The `outcome` label.
    pub fn as_str(self) -> &'static str {
        match self {
            WaitEnd::Settled => "settled",
            WaitEnd::TimedOut => "timed_out",
            WaitEnd::Full => "full",
            WaitEnd::Gone => "client_gone",
            WaitEnd::Shutdown => "shutdown",
            WaitEnd::Overloaded => "overloaded",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EndLabel {
    outcome: &'static str,
}

/// `idemgate_in_progress_waits`, `idemgate_in_progress_wait_seconds` and
/// `idemgate_in_progress_waiting`.
#[derive(Clone)]
pub struct Waits {
    ends: [Counter; WaitEnd::ALL.len()],
    duration: Histogram,
    waiting: Gauge,
}

impl Waits {
    /// Both series, registered in `registry`, every outcome at zero.
    pub fn register(registry: &mut Registry) -> Waits {
        let family = Family::<EndLabel, Counter>::default();
        registry.register(
            "idemgate_in_progress_waits",
            "Duplicates that waited for their first request (in_progress_wait), by how the wait ended: settled (answered as if after the first), timed_out (409 in-progress), full (max_waiting reached: 409 at once), client_gone, shutdown (409), overloaded (no slot for the claim after a wake: 503)",
            family.clone(),
        );
        let duration = Histogram::new([
            0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
        ]);
        registry.register(
            "idemgate_in_progress_wait_seconds",
            "How long duplicates waited for their first request, whatever ended the wait",
            duration.clone(),
        );
        let waiting = Gauge::default();
        registry.register(
            "idemgate_in_progress_waiting",
            "Duplicates waiting for their first request now (at most max_waiting)",
            waiting.clone(),
        );
        Waits {
            waiting,
            ends: WaitEnd::ALL.map(|e| {
                family.get_or_create_owned(&EndLabel {
                    outcome: e.as_str(),
                })
            }),
            duration,
        }
    }

    /// One more duplicate waiting now (`true`), or one fewer.
    pub fn waiting(&self, more: bool) {
        if more {
            self.waiting.inc();
        } else {
            self.waiting.dec();
        }
    }

    /// Counts a wait that ended as `end` after `seconds`.
    pub fn ended(&self, end: WaitEnd, seconds: f64) {
        self.ends[end as usize].inc();
        if end != WaitEnd::Full {
            self.duration.observe(seconds);
        }
    }
}
