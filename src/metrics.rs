//! Prometheus metrics: what happened to requests, how long the upstream and the store took,
//! how often the store failed, and what the Redis server itself says about evictions and
//! restarts. One [`Metrics`] per running instance (tests run several in one process), shared
//! by the proxy, the store wrapper [`Instrumented`] and the admin listener's `/metrics`.
//!
//! Every series is created up front and kept as a handle (a counter or histogram is an `Arc`
//! inside), so the request path indexes an array and does one atomic add or one short
//! mutex-guarded histogram update: no label hashing, no family lock, no allocation.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::outcome::Outcome;

mod instrumented;
mod observed;
mod watch;
pub use instrumented::Instrumented;
use observed::IdMap;
pub use watch::{count_unknown, watch_heartbeat, watch_store};

/// The content type of [`Metrics::encode`]'s output (OpenMetrics text, which Prometheus
/// scrapes natively).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Every outcome, in declaration order (`Outcome as usize` indexes this).
const OUTCOMES: [Outcome; 14] = [
    Outcome::Forwarded,
    Outcome::Replayed,
    Outcome::InProgress,
    Outcome::Mismatch,
    Outcome::Unprotected,
    Outcome::Passthrough,
    Outcome::Rejected,
    Outcome::StoreError,
    Outcome::UpstreamError,
    Outcome::Ambiguous,
    Outcome::NotStored,
    Outcome::Overloaded,
    Outcome::Released,
    Outcome::Observed,
];

/// A store operation, the `op` label of the store metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreOp {
    #[allow(missing_docs)]
    Claim,
    #[allow(missing_docs)]
    Record,
    #[allow(missing_docs)]
    Renew,
    #[allow(missing_docs)]
    Release,
    #[allow(missing_docs)]
    MarkUnknown,
    #[allow(missing_docs)]
    Inspect,
    #[allow(missing_docs)]
    Delete,
    #[allow(missing_docs)]
    Ping,
}

const STORE_OPS: [StoreOp; 8] = [
    StoreOp::Claim,
    StoreOp::Record,
    StoreOp::Renew,
    StoreOp::Release,
    StoreOp::MarkUnknown,
    StoreOp::Inspect,
    StoreOp::Delete,
    StoreOp::Ping,
];

impl StoreOp {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            StoreOp::Claim => "claim",
            StoreOp::Record => "record",
            StoreOp::Renew => "renew",
            StoreOp::Release => "release",
            StoreOp::MarkUnknown => "mark_unknown",
            StoreOp::Inspect => "inspect",
            StoreOp::Delete => "delete",
            StoreOp::Ping => "ping",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteOutcomeLabel {
    route: String,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusClassLabel {
    status_class: &'static str,
}

/// The `status_class` label values of `idemgate_answers_recorded_total`.
const STATUS_CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabel {
    op: &'static str,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// Latency buckets in seconds: 1 ms to 30 s (the default upstream timeout), roughly x2.5.
fn latency_histogram() -> Histogram {
    Histogram::new([
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    ])
}

/// Store calls are sub-millisecond when healthy and bounded by `store_timeout` otherwise.
fn store_histogram() -> Histogram {
    Histogram::new([
        0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    ])
}

/// The metrics of one running idemgate.
pub struct Metrics {
    registry: Registry,
    // Pre-resolved series, indexed by `Outcome as usize` / `StoreOp as usize`.
    /// Requests of the defaults (`route="default"`), by outcome.
    requests: [Counter; OUTCOMES.len()],
    /// The same per route, in the order of [`Metrics::routes`] (the defaults first),
    /// resolved when the routes are declared (at start-up and at each reload that changes
    /// them), so that counting is an index, a name check and an atomic add.
    route_requests: arc_swap::ArcSwap<Vec<RouteRequests>>,
    requests_family: Family<RouteOutcomeLabel, Counter>,
    answers_recorded: [Counter; STATUS_CLASSES.len()],
    records_held_unknown: Gauge,
    request_duration: [Histogram; OUTCOMES.len()],
    upstream_duration: Histogram,
    store_duration: [Histogram; STORE_OPS.len()],
    store_errors: [Counter; STORE_OPS.len()],
    records_unknown: Counter,
    redis_evicted_keys: Gauge,
    redis_restarts: Counter,
    store_rewinds: Counter,
    pending_releases: Gauge,
    scope_secret_agreed: Gauge,
    in_flight: Family<ClassLabel, Gauge>,
    queued: Family<ClassLabel, Gauge>,
    queue_wait: HistogramFamily<ClassLabel>,
    refused: Family<ReasonLabel, Counter>,
    send_timeouts: Counter,
    panics: Counter,
    buffered_bytes: Gauge,
    observed: Family<ObservedLabel, Counter>,
    observed_duplicates: Family<RouteLabel, Counter>,
    route_mode: Family<RouteModeLabel, Gauge>,
    // Per declared route (`routes`): its mode and its observe-mode series; replaced when a
    // reload declares the routes again (a route kept keeps its counts: the series are the
    // families' own).
    observed_routes: arc_swap::ArcSwap<Vec<ObservedRoute>>,
    // Configuration reloads by result (`applied`, `refused`, `invalid`).
    config_reloads: Family<ResultLabel, Counter>,
    // What operators did and tried on the admin listener, by action and result.
    operator_decisions: Family<DecisionLabel, Counter>,
    observe_since_ms: u64,
    // Duplicates this instance let through per record on observed routes (at most
    // OBSERVED_RECORDS records): what `GET /observe?records=1` shows, for checks key by key.
    answers: std::sync::Mutex<IdMap>,
    records_not_followed: Counter,
    // Duplicates answered on observed routes whose record is still being read (to count
    // them, or to replace a failure it records): `GET /observe`'s `duplicates_settling`.
    duplicates_settling: Gauge,
    // The TLS listener's certificate reloads: pairs swapped in, and new pairs refused.
    tls_reloads: Counter,
    tls_reload_failures: Counter,
    tls_handshakes: Family<StateLabel, Gauge>,
    certificate_expiry: Family<CertificateLabel, Gauge>,
}

/// Records whose duplicates observe mode lists per record; beyond, new records are not
/// listed (they are still counted per route; `GET /observe` says so in
/// `records_not_followed`).
const OBSERVED_RECORDS: usize = 200_000;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ObservedLabel {
    route: String,
    would: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CertificateLabel {
    certificate: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabel {
    route: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteModeLabel {
    route: String,
    mode: &'static str,
}

/// What enforcing would have done, the `would` label of `idemgate_observed_total`.
pub const WOULDS: [&str; 25] = [
    "execute",
    "replay",
    "in_progress",
    "mismatch",
    "missing_key",
    "invalid_key",
    "missing_tenant",
    "invalid_token",
    "unknown",
    "overloaded",
    "store_unavailable",
    "unprotected",
    "response_not_stored",
    "record_unreadable",
    "body_too_large",
    "body_timeout",
    "body_unreadable",
    "trailers_not_supported",
    "too_many_codings",
    "buffers_full",
    "invalid_method_override",
    "invalid_method",
    "invalid_path",
    "invalid_header",
    "other",
];

/// One route's observe-mode series, resolved once: counting is an atomic add.
/// One declared route's request counters, by outcome.
struct RouteRequests {
    route: String,
    by_outcome: [Counter; OUTCOMES.len()],
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabel {
    action: &'static str,
    result: &'static str,
}

struct ObservedRoute {
    route: String,
    mode: &'static str,
    would: Vec<Counter>,
    duplicates: Counter,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClassLabel {
    class: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabel {
    state: &'static str,
}

/// The TLS listener's handshakes by state (`idemgate_tls_handshakes{state}`).
#[derive(Clone, Default)]
pub struct HandshakeGauges {
    /// Connections whose ClientHello has not arrived yet (no permit held).
    pub awaiting_hello: Gauge,
    /// ClientHello in, waiting for one of the handshake permits.
    pub waiting: Gauge,
    /// Holding a permit: the handshake itself.
    pub running: Gauge,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    class: &'static str,
    reason: &'static str,
}

/// Queue waits: none at all up to the default `queue_timeout` (1 s) and beyond.
fn wait_histogram() -> Histogram {
    Histogram::new([
        0.0, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    ])
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    /// A fresh registry with every series at zero (so a dashboard sees them before the first
    /// request and `rate()` has a starting point).
    // A table: one registration per metric, with its name and help text, read top to
    // bottom; splitting it would only scatter the list.
    #[allow(clippy::too_many_lines)]
    pub fn new() -> Metrics {
        let mut registry = Registry::default();
        let requests = Family::<RouteOutcomeLabel, Counter>::default();
        let answers_recorded = Family::<StatusClassLabel, Counter>::default();
        let records_held_unknown = Gauge::default();
        registry.register(
            "idemgate_records_held_unknown",
            "Records held unknown in the store now, counted every unknown_count_interval by walking the store's records (absent on Redis Cluster, which cannot be walked)",
            records_held_unknown.clone(),
        );
        registry.register(
            "idemgate_answers_recorded",
            "Upstream answers written into their records, by status class (1xx to 5xx): a 5xx recorded is replayed to every retry of its key",
            answers_recorded.clone(),
        );
        let request_duration =
            HistogramFamily::<OutcomeLabel>::new_with_constructor(latency_histogram);
        let upstream_duration = latency_histogram();
        let store_duration = HistogramFamily::<OpLabel>::new_with_constructor(store_histogram);
        let store_errors = Family::<OpLabel, Counter>::default();
        let records_unknown = Counter::default();
        let redis_evicted_keys = Gauge::default();
        let redis_restarts = Counter::default();
        let store_rewinds = Counter::default();
        let pending_releases = Gauge::default();
        let scope_secret_agreed = Gauge::default();
        let in_flight = Family::<ClassLabel, Gauge>::default();
        let queued = Family::<ClassLabel, Gauge>::default();
        let queue_wait = HistogramFamily::<ClassLabel>::new_with_constructor(wait_histogram);
        let refused = Family::<ReasonLabel, Counter>::default();
        let send_timeouts = Counter::default();
        let panics = Counter::default();
        let buffered_bytes = Gauge::default();
        let observed = Family::<ObservedLabel, Counter>::default();
        let observed_duplicates = Family::<RouteLabel, Counter>::default();
        let route_mode = Family::<RouteModeLabel, Gauge>::default();
        let config_reloads = Family::<ResultLabel, Counter>::default();
        registry.register(
            "idemgate_config_reloads",
            "Configuration reloads (SIGHUP, POST /config/reload) by result: applied (the new settings serve new requests), refused (a setting that needs a restart changed; nothing applied), invalid (the configuration does not pass config check; nothing applied)",
            config_reloads.clone(),
        );
        for result in ["applied", "refused", "invalid"] {
            let _ = config_reloads.get_or_create(&ResultLabel { result });
        }
        let operator_decisions = Family::<DecisionLabel, Counter>::default();
        registry.register(
            "idemgate_operator_decisions",
            "What operators did on the admin listener (each one an audit line under idemgate::audit), by action (complete, release, reload, scope_secret) and result (done; refused: by idemgate, the request or the role; failed: the store or the reload)",
            operator_decisions.clone(),
        );
        let tls_reloads = Counter::default();
        let tls_reload_failures = Counter::default();
        let tls_handshakes = Family::<StateLabel, Gauge>::default();
        registry.register(
            "idemgate_tls_handshakes",
            "TLS listener handshakes by state: awaiting_hello (no ClientHello yet, no permit held), waiting (for one of the 256 handshake permits), running",
            tls_handshakes.clone(),
        );
        registry.register(
            "idemgate_tls_reloads",
            "TLS listener certificate pairs reloaded after their files changed",
            tls_reloads.clone(),
        );
        registry.register(
            "idemgate_tls_reload_failures",
            "Changed TLS listener certificate pairs that could not be loaded (the pair in use was kept)",
            tls_reload_failures.clone(),
        );
        let certificate_expiry = Family::<CertificateLabel, Gauge>::default();
        registry.register(
            "idemgate_tls_certificate_expiry_seconds",
            "When each certificate idemgate presents stops being valid, as seconds since the Unix epoch, by certificate: listener, upstream_client, redis_client, postgres_client (the listener's follows its reloads)",
            certificate_expiry.clone(),
        );
        registry.register(
            "idemgate_observed",
            "Requests on routes in observe mode, forwarded whatever enforcing would have done, by route and by what that would have been (would)",
            observed.clone(),
        );
        registry.register(
            "idemgate_observed_duplicates",
            "Duplicates let through on routes in observe mode, by route: requests forwarded and answered 2xx although their record (whichever instance made it) showed an execution already; summed over the fleet, the executions enforcing would have saved",
            observed_duplicates.clone(),
        );
        registry.register(
            "idemgate_route_mode",
            "1 for each route's mode (enforce or observe)",
            route_mode.clone(),
        );
        registry.register(
            "idemgate_in_flight",
            "Requests holding a slot: class=protected (max_in_flight) or pass_through (the rest of max_upstream_connections)",
            in_flight.clone(),
        );
        registry.register(
            "idemgate_queued",
            "Requests waiting for a slot, by class (at most max_queued each)",
            queued.clone(),
        );
        registry.register(
            "idemgate_queue_wait_seconds",
            "How long admitted requests waited for their slot, by class",
            queue_wait.clone(),
        );
        registry.register(
            "idemgate_refused",
            "Requests refused with 503 before anything was done, by class (protected, pass_through) and reason: queue_full, queue_timeout, buffers_full (503 overloaded), store_full (503 store-unavailable: the embedded store's memory_max_records or memory_max_bytes)",
            refused.clone(),
        );
        registry.register(
            "idemgate_send_timeouts",
            "Client connections closed because a write made no progress for send_timeout",
            send_timeouts.clone(),
        );
        registry.register(
            "idemgate_panics",
            "Requests whose handling panicked (answered 500 internal-error; a claim held follows the failure rules of its step)",
            panics.clone(),
        );
        registry.register(
            "idemgate_buffered_bytes",
            "Bytes of bodies held for clients (arriving or queued request bodies, answers being written), against max_buffered_bytes",
            buffered_bytes.clone(),
        );
        for class in ["protected", "pass_through"] {
            let _ = in_flight.get_or_create(&ClassLabel { class });
            let _ = queued.get_or_create(&ClassLabel { class });
            let _ = queue_wait.get_or_create(&ClassLabel { class });
        }
        for (class, reason) in [
            ("protected", "queue_full"),
            ("protected", "queue_timeout"),
            ("protected", "buffers_full"),
            ("protected", "store_full"),
            ("pass_through", "queue_full"),
            ("pass_through", "queue_timeout"),
        ] {
            let _ = refused.get_or_create(&ReasonLabel { class, reason });
        }
        registry.register(
            "idemgate_scope_secret_agreed",
            "1 while this instance's scope secret agrees with the store's; 0 once it does not (protected requests are refused until a restart)",
            scope_secret_agreed.clone(),
        );
        registry.register(
            "idemgate_pending_releases",
            "Claims never forwarded whose release has not landed yet (tried again until it does)",
            pending_releases.clone(),
        );
        registry.register(
            "idemgate_requests",
            "Requests by route (the route's configured path, default for the defaults) and outcome",
            requests.clone(),
        );
        registry.register(
            "idemgate_request_duration_seconds",
            "Time from receiving a request to its response, by outcome",
            request_duration.clone(),
        );
        registry.register(
            "idemgate_upstream_duration_seconds",
            "Time the upstream took to answer a forwarded request (whole body for protected requests, headers for pass-through)",
            upstream_duration.clone(),
        );
        registry.register(
            "idemgate_store_duration_seconds",
            "Time of store calls by operation, including calls that failed or timed out",
            store_duration.clone(),
        );
        registry.register(
            "idemgate_store_errors",
            "Store calls that failed or did not answer within their deadline, by operation",
            store_errors.clone(),
        );
        registry.register(
            "idemgate_records_unknown",
            "Records marked unknown: sent upstream without a complete answer, held until an operator releases them",
            records_unknown.clone(),
        );
        registry.register(
            "idemgate_redis_evicted_keys",
            "evicted_keys from Redis INFO (must stay 0: an evicted record lets a retry execute twice)",
            redis_evicted_keys.clone(),
        );
        registry.register(
            "idemgate_redis_restarts",
            "Redis restarts seen (run_id changed or uptime went down); records written since its last save may be lost",
            redis_restarts.clone(),
        );
        registry.register(
            "idemgate_store_rewinds",
            "Times the store was found to have gone back in time (its heartbeat older than the last this instance saw: a failover to a copy that lacked the last writes, a restore); the claims of the gap are lost and their retries execute again",
            store_rewinds.clone(),
        );
        let outcome = |o: Outcome| OutcomeLabel {
            outcome: o.as_str(),
        };
        let op = |o: StoreOp| OpLabel { op: o.as_str() };
        Metrics {
            registry,
            requests: OUTCOMES.map(|o| {
                requests.get_or_create_owned(&RouteOutcomeLabel {
                    route: "default".into(),
                    outcome: o.as_str(),
                })
            }),
            route_requests: arc_swap::ArcSwap::from_pointee(Vec::new()),
            records_held_unknown,
            requests_family: requests,
            answers_recorded: STATUS_CLASSES.map(|status_class| {
                answers_recorded.get_or_create_owned(&StatusClassLabel { status_class })
            }),
            request_duration: OUTCOMES.map(|o| request_duration.get_or_create_owned(&outcome(o))),
            upstream_duration,
            store_duration: STORE_OPS.map(|o| store_duration.get_or_create_owned(&op(o))),
            store_errors: STORE_OPS.map(|o| store_errors.get_or_create_owned(&op(o))),
            records_unknown,
            redis_evicted_keys,
            redis_restarts,
            store_rewinds,
            pending_releases,
            scope_secret_agreed,
            in_flight,
            queued,
            queue_wait,
            refused,
            send_timeouts,
            panics,
            buffered_bytes,
            observed,
            observed_duplicates,
            route_mode,
            observed_routes: arc_swap::ArcSwap::from_pointee(Vec::new()),
            config_reloads,
            operator_decisions,
            observe_since_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            answers: std::sync::Mutex::new(IdMap::default()),
            records_not_followed: Counter::default(),
            duplicates_settling: Gauge::default(),
            tls_reloads,
            tls_reload_failures,
            tls_handshakes,
            certificate_expiry,
        }
    }

    /// The counters of TLS certificate reloads: (succeeded, failed).
    pub fn tls_reloads(&self) -> (Counter, Counter) {
        (self.tls_reloads.clone(), self.tls_reload_failures.clone())
    }

    /// The gauges of the TLS listener's handshakes.
    pub fn tls_handshakes(&self) -> HandshakeGauges {
        let state = |state| {
            self.tls_handshakes
                .get_or_create_owned(&StateLabel { state })
        };
        HandshakeGauges {
            awaiting_hello: state("awaiting_hello"),
            waiting: state("waiting"),
            running: state("running"),
        }
    }

    /// `idemgate_tls_certificate_expiry_seconds{certificate}`: `listener`,
    /// `upstream_client`, `redis_client` or `postgres_client`.
    pub fn certificate_expiry(&self, certificate: &'static str) -> Gauge {
        self.certificate_expiry
            .get_or_create(&CertificateLabel { certificate })
            .clone()
    }

    /// Declares the routes and their modes (`idemgate_route_mode`, `GET /observe`): at
    /// start-up, and again at each reload. A route's series are kept across a reload (its
    /// counts go on); the mode series of a route's previous mode, or of a route no longer
    /// declared, is removed.
    pub fn routes(&self, routes: &[(String, crate::config::Mode)]) {
        let rows = routes
            .iter()
            .map(|(route, _)| RouteRequests {
                route: route.clone(),
                by_outcome: OUTCOMES.map(|o| {
                    self.requests_family
                        .get_or_create_owned(&RouteOutcomeLabel {
                            route: route.clone(),
                            outcome: o.as_str(),
                        })
                }),
            })
            .collect();
        self.route_requests.store(Arc::new(rows));
        let observed: Vec<ObservedRoute> = routes
            .iter()
            .map(|(route, mode)| ObservedRoute {
                route: route.clone(),
                mode: mode_name(*mode),
                would: WOULDS
                    .iter()
                    .map(|would| {
                        self.observed.get_or_create_owned(&ObservedLabel {
                            route: route.clone(),
                            would,
                        })
                    })
                    .collect(),
                duplicates: self.observed_duplicates.get_or_create_owned(&RouteLabel {
                    route: route.clone(),
                }),
            })
            .collect();
        let before = self.observed_routes.swap(Arc::new(observed));
        for r in before.iter() {
            if !routes
                .iter()
                .any(|(route, mode)| *route == r.route && mode_name(*mode) == r.mode)
            {
                self.route_mode.remove(&RouteModeLabel {
                    route: r.route.clone(),
                    mode: r.mode,
                });
            }
        }
        for (route, mode) in routes {
            self.route_mode
                .get_or_create(&RouteModeLabel {
                    route: route.clone(),
                    mode: mode_name(*mode),
                })
                .set(1);
        }
    }

    /// Counts a configuration reload: `applied`, `refused` or `invalid`.
    pub fn config_reload(&self, result: &'static str) {
        self.config_reloads
            .get_or_create(&ResultLabel { result })
            .inc();
    }

    /// Counts an operator's decision or attempt (`idemgate_operator_decisions_total`).
    pub fn operator_decision(&self, action: &'static str, result: &'static str) {
        self.operator_decisions
            .get_or_create(&DecisionLabel { action, result })
            .inc();
    }

    /// The gauges of one class of slots (`protected`, `pass_through`).
    pub fn slot_gauges(&self, class: &'static str) -> crate::admission::Gauges {
        let label = ClassLabel { class };
        crate::admission::Gauges {
            in_flight: self.in_flight.get_or_create_owned(&label),
            queued: self.queued.get_or_create_owned(&label),
            wait: Some(self.queue_wait.get_or_create_owned(&label)),
        }
    }

    /// The counter of one refusal reason of one class of requests (`protected`,
    /// `pass_through`).
    pub fn refused(&self, class: &'static str, why: crate::admission::Refusal) -> Counter {
        self.refused.get_or_create_owned(&ReasonLabel {
            class,
            reason: why.as_str(),
        })
    }

    /// The counter of new keys refused because the embedded store is full.
    pub fn refused_store_full(&self) -> Counter {
        self.refused.get_or_create_owned(&ReasonLabel {
            class: "protected",
            reason: "store_full",
        })
    }

    /// The counter of connections closed by `send_timeout`.
    pub fn send_timeouts(&self) -> Counter {
        self.send_timeouts.clone()
    }

    /// Counts a request whose handling panicked.
    pub fn panicked(&self) {
        self.panics.inc();
    }

    /// The gauge of bytes held against `max_buffered_bytes`.
    pub fn buffered_bytes(&self) -> Gauge {
        self.buffered_bytes.clone()
    }

    /// The gauge of scope-secret agreement, for [`crate::secret::SecretHealth`].
    pub fn scope_secret_agreed(&self) -> Gauge {
        self.scope_secret_agreed.clone()
    }

    /// The gauge of pending releases, for [`crate::releases::Releases`].
    pub fn pending_releases(&self) -> Gauge {
        self.pending_releases.clone()
    }

    /// Counts a finished request of the route at `route` (its [`Policy::index`]
    /// (crate::config::Policy::index): 0 for the defaults) named `name`, and its total
    /// time. A request that began before a reload which moved its route is counted under
    /// its route's name all the same (or the defaults' row, if that route is gone).
    pub fn request(&self, route: usize, name: &str, outcome: Outcome, elapsed: Duration) {
        let i = outcome as usize;
        let rows = self.route_requests.load();
        let row = rows
            .get(route)
            .filter(|r| r.route == name)
            .or_else(|| rows.iter().find(|r| r.route == name))
            .map_or(&self.requests, |r| &r.by_outcome);
        row[i].inc();
        self.request_duration[i].observe(elapsed.as_secs_f64());
    }

    /// Counts an upstream answer written into its record.
    pub fn answer_recorded(&self, status: u16) {
        if let Some(c) = self
            .answers_recorded
            .get(usize::from(status / 100).wrapping_sub(1))
        {
            c.inc();
        }
    }

    /// Records how long the upstream took.
    pub fn upstream(&self, elapsed: Duration) {
        self.upstream_duration.observe(elapsed.as_secs_f64());
    }

    fn store_call(&self, op: StoreOp, elapsed: Duration, failed: bool) {
        let i = op as usize;
        self.store_duration[i].observe(elapsed.as_secs_f64());
        if failed {
            self.store_errors[i].inc();
        }
    }

    /// Counts the store found gone back in time.
    fn store_rewound(&self) {
        self.store_rewinds.inc();
    }

    /// Takes in what one `INFO` poll of Redis said.
    fn redis(&self, evicted_keys: u64, restarted: bool) {
        self.redis_evicted_keys
            .set(i64::try_from(evicted_keys).unwrap_or(i64::MAX));
        if restarted {
            self.redis_restarts.inc();
        }
    }

    /// The whole registry in the OpenMetrics text format ([`CONTENT_TYPE`]).
    pub fn encode(&self) -> String {
        let mut out = String::with_capacity(8 * 1024);
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

fn mode_name(mode: crate::config::Mode) -> &'static str {
    match mode {
        crate::config::Mode::Enforce => "enforce",
        crate::config::Mode::Observe => "observe",
    }
}

#[cfg(test)]
mod tests;
