//! What observe mode counts: per route, what enforcing would have done and the duplicates
//! let through; per record, the duplicates this instance let through (`GET /observe`).

use super::{Metrics, ObservedRoute, OBSERVED_RECORDS, WOULDS};
use crate::key::RecordId;

/// Identity hashing for record ids: they are HMAC outputs already, so their first eight
/// bytes are as good a hash as SipHash of all 32, for a tenth of the cost.
#[derive(Default)]
pub(super) struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8).take(1) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.0 ^= u64::from_le_bytes(b);
        }
    }

    fn write_usize(&mut self, _: usize) {}
}

pub(super) type IdMap =
    std::collections::HashMap<RecordId, u32, std::hash::BuildHasherDefault<IdHasher>>;

impl Metrics {
    /// Runs `f` on the observe-mode series of `route`, if it is declared.
    fn observed_route(&self, route: &str, f: impl FnOnce(&ObservedRoute)) {
        if let Some(r) = self
            .observed_routes
            .load()
            .iter()
            .find(|r| r.route == route)
        {
            f(r);
        }
    }

    /// Counts what enforcing would have done with a request on an observed route.
    pub fn observed(&self, route: &str, would: &'static str) {
        let i = WOULDS
            .iter()
            .position(|w| *w == would)
            .unwrap_or(WOULDS.len() - 1);
        self.observed_route(route, |r| {
            r.would[i].inc();
        });
    }

    /// Counts a duplicate let through on an observed route for record `id`: a request
    /// forwarded although its record, whichever instance or process made it, shows an
    /// execution already (see the proxy's observe mode), and answered with a 2xx.
    pub fn observed_duplicate(&self, route: &str, id: RecordId) {
        self.observed_route(route, |r| {
            r.duplicates.inc();
        });
        let mut answers = self.answers.lock().unwrap_or_else(|p| p.into_inner());
        let full = answers.len() >= OBSERVED_RECORDS;
        match answers.get_mut(&id) {
            Some(n) => *n += 1,
            None if full => {
                self.records_not_followed.inc();
            }
            None => {
                answers.insert(id, 1);
            }
        }
    }

    /// An observed duplicate's record starts (`true`) or ends (`false`) being read after
    /// its client has its answer.
    pub fn duplicate_settling(&self, starts: bool) {
        if starts {
            self.duplicates_settling.inc();
        } else {
            self.duplicates_settling.dec();
        }
    }

    /// What `GET /observe` returns: `{"since_ms", "routes": [{"route", "mode", "would",
    /// "duplicates_let_through", "supersedes_pending"}], "records_not_followed",
    /// "duplicates_settling"}`; with
    /// `records`, also the duplicates this instance let through per record
    /// (`{"<id>": n}`).
    pub fn observations_json(&self, records: bool) -> String {
        let routes: Vec<serde_json::Value> = self
            .observed_routes
            .load()
            .iter()
            .map(|r| {
                let would: serde_json::Map<String, serde_json::Value> = WOULDS
                    .iter()
                    .zip(&r.would)
                    .filter(|(_, c)| c.get() > 0)
                    .map(|(w, c)| ((*w).to_string(), c.get().into()))
                    .collect();
                serde_json::json!({
                    "route": r.route,
                    "mode": r.mode,
                    "would": would,
                    "duplicates_let_through": r.duplicates.get(),
                    "supersedes_pending": self.late.supersedes_pending(&r.route),
                })
            })
            .collect();
        let mut v = serde_json::json!({
            "since_ms": self.observe_since_ms,
            "routes": routes,
            "records_not_followed": self.records_not_followed.get(),
            "duplicates_settling": self.duplicates_settling.get(),
        });
        if records {
            let answers = self.answers.lock().unwrap_or_else(|p| p.into_inner());
            let more: serde_json::Map<String, serde_json::Value> = answers
                .iter()
                .map(|(id, n)| (id.to_string(), serde_json::Value::from(*n)))
                .collect();
            v["records"] = serde_json::Value::Object(more);
        }
        v.to_string()
    }
}
