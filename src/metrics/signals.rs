//! Series of what idemgate found wrong beside the requests themselves: whether the store
//! takes writes, how large SQLite's write-ahead log is, and answers that upstreams ended by
//! closing their connection.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::RouteLabel;
use crate::store::SelfCheck;

/// The store's writability and log size, and the answers ended by a close.
pub struct Signals {
    // The last write call's failure through the metrics' store layer (`None`: it landed),
    // and whether there is one: a write that lands reads only the flag, never the lock.
    failure: Mutex<Option<String>>,
    failing: AtomicBool,
    writable: Gauge,
    wal_bytes: Gauge,
    unframed_answers: Family<RouteLabel, Counter>,
}

impl Signals {
    pub(super) fn register(registry: &mut Registry) -> Signals {
        let signals = Signals {
            failure: Mutex::new(None),
            failing: AtomicBool::new(false),
            writable: Gauge::default(),
            wal_bytes: Gauge::default(),
            unframed_answers: Family::default(),
        };
        signals.writable.set(1);
        registry.register(
            "idemgate_store_writable",
            "1 while the store takes writes: the last write call landed (and on SQLite, the last background write); 0 after a failed one. Only on SQLite does 0 also fail /readyz",
            signals.writable.clone(),
        );
        registry.register(
            "idemgate_sqlite_wal_bytes",
            "Size of the SQLite store's write-ahead log (store_path's idemgate.sqlite3-wal) at its last check, every 2 s; 0 on other stores",
            signals.wal_bytes.clone(),
        );
        registry.register(
            "idemgate_unframed_answers",
            "Protected requests' upstream answers that the upstream ended by closing the connection (no Content-Length, no chunked framing), by route, in either mode: recorded only when known whole unless the route sets close_delimited = \"trust\"",
            signals.unframed_answers.clone(),
        );
        signals
    }

    /// Counts an answer its upstream ended by closing (`route`: the route, or `default`).
    pub fn unframed_answer(&self, route: &str) {
        self.unframed_answers
            .get_or_create(&RouteLabel {
                route: route.into(),
            })
            .inc();
    }

    /// A write call landed (`None`) or failed, and why.
    pub fn wrote(&self, failure: Option<String>) {
        if failure.is_none() && !self.failing.load(Ordering::Relaxed) {
            return;
        }
        let mut held = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        self.failing.store(failure.is_some(), Ordering::Relaxed);
        *held = failure;
    }

    /// Why the last write call failed, if it did.
    pub fn write_failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Sets the gauges from the last write call and what the store found itself.
    pub fn refresh(&self, own: &SelfCheck) {
        let writable = own.write_failure.is_none() && self.write_failure().is_none();
        self.writable.set(i64::from(writable));
        if let Some(n) = own.wal_bytes {
            self.wal_bytes.set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }
}
