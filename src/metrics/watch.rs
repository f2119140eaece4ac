//! The store's watchers: Redis `INFO` polled into the metrics, and the records held
//! `unknown` counted.

use std::sync::Arc;
use std::time::Duration;

use super::Metrics;
use crate::store::{ServerStats, Store};

/// What the Redis watcher remembers between two polls.
#[derive(Debug, Default)]
struct RedisWatch {
    last: Option<ServerStats>,
}

impl RedisWatch {
    /// Whether Redis restarted since the last poll: a new `run_id`, or an uptime that went
    /// down (a restart between two polls that kept its run id cannot happen, but a shorter
    /// uptime is the cheap second witness).
    fn restarted(&mut self, now: ServerStats) -> bool {
        let restarted = self
            .last
            .as_ref()
            .is_some_and(|l| l.run_id != now.run_id || now.uptime_secs < l.uptime_secs);
        self.last = Some(now);
        restarted
    }
}

/// Polls the store's server statistics every `period` (Redis `INFO`) into the metrics, until
/// the task is aborted. Returns at once for a store without any (the embedded one).
///
/// A restart may have lost the scope secret: `restarted` is notified, so that it is checked
/// (and put back) at once rather than at the next `scope_secret_check_interval`.
pub async fn watch_store(
    store: Arc<dyn Store>,
    metrics: Arc<Metrics>,
    period: Duration,
    restarted_now: Arc<tokio::sync::Notify>,
) {
    let mut watch = RedisWatch::default();
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let limit = period.min(Duration::from_secs(5));
        match crate::store::deadline(limit, store.server_stats()).await {
            Ok(Some(stats)) => {
                if stats.maxmemory_policy != "noeviction" {
                    tracing::error!(
                        maxmemory_policy = %stats.maxmemory_policy,
                        "Redis maxmemory-policy changed at run time: records may be evicted and retries execute twice; set it back to noeviction"
                    );
                }
                let evicted = stats.evicted_keys;
                let restarted = watch.restarted(stats);
                if restarted {
                    tracing::warn!(
                        "Redis restarted: records written since its last save may be lost"
                    );
                    restarted_now.notify_one();
                }
                metrics.redis(evicted, restarted);
            }
            Ok(None) => return,
            Err(e) => tracing::debug!(error = %e, "could not read Redis INFO"),
        }
    }
}

/// Counts the records held `unknown` every `period` into `idemgate_records_held_unknown`,
/// walking the store a page of `PAGE` records at a time; a walk that fails leaves the last
/// count. Ends at once where the store cannot be walked or `period` is zero.
pub async fn count_unknown(
    store: Arc<dyn Store>,
    metrics: Arc<Metrics>,
    period: Duration,
    timeout: Duration,
) {
    const PAGE: usize = 1000;
    if period.is_zero() || !store.can_list() {
        return;
    }
    // The first walk one period after start: a fleet restarting at once does not walk the
    // store all together, and start-up's round trips stay start-up's.
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let (mut cursor, mut held) = (String::new(), 0u64);
        let walked = loop {
            let page = crate::store::deadline(
                timeout,
                store.list(Some(crate::store::RecordState::Unknown), &cursor, PAGE),
            )
            .await;
            match page {
                Ok(page) => {
                    held += page.records.len() as u64;
                    match page.cursor {
                        Some(next) => cursor = next,
                        None => break true,
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "could not count the records held unknown");
                    break false;
                }
            }
        };
        if walked {
            metrics
                .records_held_unknown
                .set(i64::try_from(held).unwrap_or(i64::MAX));
        }
    }
}

/// Moves the store's heartbeat forward every `period` ([`Store::heartbeat`]), and says
/// when the store went back in time: a heartbeat older than the last this instance saw
/// (or none after one was seen) is logged at error, naming the gap, and counted in
/// `idemgate_store_rewinds_total`. Ends at once for a store that keeps no heartbeat.
pub async fn watch_heartbeat(
    store: Arc<dyn Store>,
    metrics: Arc<Metrics>,
    period: Duration,
    timeout: Duration,
) {
    let mut seen: Option<i64> = None;
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let beat = match crate::store::deadline(timeout, store.heartbeat()).await {
            Ok(Some(beat)) => beat,
            Ok(None) => return,
            Err(e) => {
                tracing::debug!(error = %e, "could not write the store's heartbeat");
                continue;
            }
        };
        match (seen, beat.before) {
            (Some(seen), Some(before)) if before < seen => {
                let gap_ms = seen - before;
                tracing::error!(
                    gap_ms,
                    "the store went back in time: its heartbeat is {gap_ms} ms older than the last this instance saw (a failover to a copy that lacked its last writes, or a restore from a backup). Claims and answers written in that time are lost: retries of those keys execute again"
                );
                metrics.store_rewound();
            }
            (Some(_), None) => {
                tracing::error!(
                    "the store went back in time: its heartbeat is gone (a restore from a backup older than this instance's first heartbeat, or a failover to such a copy). Claims and answers written since are lost: retries of those keys execute again"
                );
                metrics.store_rewound();
            }
            _ => {}
        }
        // The store's timeline from now on, rewound or not.
        seen = Some(beat.now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(run_id: &str, uptime_secs: u64) -> ServerStats {
        ServerStats {
            run_id: run_id.into(),
            uptime_secs,
            evicted_keys: 0,
            maxmemory_policy: "noeviction".into(),
        }
    }

    #[test]
    fn a_restart_is_a_new_run_id_or_a_shorter_uptime() {
        let mut w = RedisWatch::default();
        assert!(
            !w.restarted(stats("a", 100)),
            "the first poll is the baseline"
        );
        assert!(!w.restarted(stats("a", 115)));
        assert!(w.restarted(stats("b", 130)));
        assert!(w.restarted(stats("b", 3)));
        assert!(!w.restarted(stats("b", 18)));
    }
}
