//! The series of record writes tried again after their first try failed
//! ([`crate::late_writes`]): how many are pending, the oldest one's age, how many landed
//! late and how many were given up; and, per observed route, the supersedes still pending
//! (`GET /observe`).

use std::sync::atomic::Ordering;

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::{Metrics, RouteLabel};
use crate::late_writes::LateMetrics;

/// The late writes' series, registered once.
pub(super) struct LateSeries {
    writes: LateMetrics,
    oldest_seconds: Gauge<f64, std::sync::atomic::AtomicU64>,
    supersedes: Family<RouteLabel, Gauge>,
}

impl LateSeries {
    pub(super) fn register(registry: &mut Registry) -> LateSeries {
        let s = LateSeries {
            writes: LateMetrics::default(),
            oldest_seconds: Gauge::default(),
            supersedes: Family::default(),
        };
        registry.register(
            "idemgate_record_writes_pending",
            "Answers' records (and observe mode's supersedes) whose write failed and is being tried again in the background; while pending, a retry reaching this instance gets 409 in-progress",
            s.writes.pending.clone(),
        );
        registry.register(
            "idemgate_record_writes_oldest_pending_seconds",
            "Age of the oldest record write still being tried again (0: none)",
            s.oldest_seconds.clone(),
        );
        registry.register(
            "idemgate_record_writes_landed",
            "Record writes that landed on a later try, after their first failed",
            s.writes.landed.clone(),
        );
        registry.register(
            "idemgate_record_writes_given_up",
            "Record writes given up (too many pending, the record's retention ended, or shut down first): their records read unknown once their lease runs out",
            s.writes.given_up.clone(),
        );
        registry.register(
            "idemgate_observed_supersedes_pending",
            "Observed routes: later answers waiting to replace a recorded failure (the route is switched to enforce once this is 0 on every instance)",
            s.supersedes.clone(),
        );
        s
    }

    /// Reads the oldest pending write's age into its gauge (when scraped).
    pub(super) fn refresh(&self) {
        let since = self.writes.oldest_ms.load(Ordering::Relaxed);
        let age = match since {
            0 => 0.0,
            s => crate::admission::process_ms().saturating_sub(s - 1) as f64 / 1000.0,
        };
        self.oldest_seconds.set(age);
    }

    pub(super) fn supersedes_pending(&self, route: &str) -> i64 {
        self.supersedes
            .get(&RouteLabel {
                route: route.to_string(),
            })
            .map_or(0, |g| g.get())
    }
}

impl Metrics {
    /// The series [`crate::late_writes::LateWrites`] counts into.
    pub fn late_writes(&self) -> LateMetrics {
        self.late.writes.clone()
    }

    /// A supersede on observed route `route` starts (`true`) or stops (`false`) being
    /// tried again.
    pub fn supersede_pending(&self, route: &str, starts: bool) {
        let g = self.late.supersedes.get_or_create(&RouteLabel {
            route: route.to_string(),
        });
        if starts {
            g.inc();
        } else {
            g.dec();
        }
    }
}
