//! When a duplicate should come back: the `Retry-After` of a 409 `in-progress`, from the
//! running request's remaining lease and its route's typical upstream time.
//!
//! Each route keeps an exponentially weighted moving average of how long its upstream
//! takes ([`TypicalTime`], one atomic per route, updated once per forwarded request). A
//! duplicate that finds a request in flight is told to retry when that request should have
//! finished: the typical time minus what has already passed, and never later than the
//! lease's end (by then the request has an answer, or its owner is gone and the record
//! reads `unknown`). Without a measurement yet, and for fast routes, that is 1 second, the
//! smallest value the header can carry.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A route's typical upstream time: an EWMA (weight 1/8 for each new measurement) in
/// microseconds; 0 until the first measurement.
#[derive(Default)]
pub struct TypicalTime(AtomicU64);

impl TypicalTime {
    /// Takes one upstream time into the average. Two requests finishing at once may lose
    /// one of their measurements to the other; an average does not mind.
    pub fn observe(&self, took: Duration) {
        let x = u64::try_from(took.as_micros()).unwrap_or(u64::MAX).max(1);
        let old = self.0.load(Ordering::Relaxed);
        let new = if old == 0 { x } else { old - old / 8 + x / 8 };
        self.0.store(new.max(1), Ordering::Relaxed);
    }

    /// The average, once there is one.
    pub fn get(&self) -> Option<Duration> {
        match self.0.load(Ordering::Relaxed) {
            0 => None,
            us => Some(Duration::from_micros(us)),
        }
    }
}

impl std::fmt::Debug for TypicalTime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TypicalTime({:?})", self.get())
    }
}

/// `Retry-After` seconds for a duplicate of a request that holds a lease of `lease` with
/// `lease_left` to run, on a route whose upstream typically takes `typical`.
///
/// The time already passed is read from the lease (`lease - lease_left`); after a renewal
/// that reads short, so the estimate errs towards later, and the lease's end bounds it.
pub fn in_progress(lease: Duration, lease_left: Duration, typical: Option<Duration>) -> u64 {
    let Some(typical) = typical else {
        return 1;
    };
    let passed = lease.saturating_sub(lease_left);
    let wait = typical.saturating_sub(passed).min(lease_left);
    // Whole seconds, rounded up: a client that comes back early gets another 409.
    let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    secs.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: fn(u64) -> Duration = Duration::from_secs;
    const MS: fn(u64) -> Duration = Duration::from_millis;

    #[test]
    fn the_wait_is_what_the_route_typically_has_left() {
        // Nothing measured yet: the smallest wait.
        assert_eq!(in_progress(S(10), S(10), None), 1);
        // A fast route: the smallest wait the header can say.
        assert_eq!(in_progress(S(10), S(10), Some(MS(40))), 1);
        // 8 s typical, 2 s passed: 6 s to go.
        assert_eq!(in_progress(S(10), S(8), Some(S(8))), 6);
        // Rounded up.
        assert_eq!(in_progress(S(10), MS(9_500), Some(MS(4_000))), 4);
        // Longer than typical already: come back soon.
        assert_eq!(in_progress(S(10), S(1), Some(S(5))), 1);
        // Never past the lease's end.
        assert_eq!(in_progress(S(10), S(3), Some(S(60))), 3);
    }

    #[test]
    fn the_average_follows_the_measurements() {
        let t = TypicalTime::default();
        assert_eq!(t.get(), None);
        t.observe(MS(800));
        assert_eq!(t.get(), Some(MS(800)));
        for _ in 0..100 {
            t.observe(MS(80));
        }
        let now = t.get().unwrap();
        assert!(now >= MS(80) && now < MS(90), "{now:?}");
    }
}
