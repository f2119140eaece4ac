//! Hot reload of the configuration (`SIGHUP`, `POST /config/reload`): the file and the
//! environment read again and checked exactly as `idemgate config check` checks them
//! ([`Wired::check`]), then applied whole or not at all.
//!
//! What a reload applies is what the request path reads per request: `[defaults]` and
//! `[[routes]]` (routes, their modes, timeouts and limits), and the log filter
//! (`log_level`). A change to any other setting
//! (listeners, the store, TLS, threads, the scope secret, connection limits...) needs a
//! restart: the reload is refused, naming it, and nothing is applied. The store is not
//! touched, so the embedded store's records stay: a route switched from observe to enforce
//! replays what it recorded while observing.

use std::sync::{Arc, Mutex};

use figment::Figment;
use serde::Serialize;

use crate::config::{changes, Live};
use crate::metrics::Metrics;
use crate::wiring::Wired;

/// Where a reload reads the configuration from, and how it changes what is logged.
#[derive(Clone)]
pub struct Source {
    /// The sources as start-up layered them (the file, the environment, the command
    /// line's flags).
    pub figment: Arc<dyn Fn() -> Figment + Send + Sync>,
    /// Puts a log filter in force.
    pub log_filter: Option<LogFilter>,
}

/// Puts a log filter (`RUST_LOG`'s syntax) in force, or says why it cannot.
pub type LogFilter = Arc<dyn Fn(&str) -> Result<(), String> + Send + Sync>;

/// The log filter of a configuration: `log_level`, else `RUST_LOG` (if it is a filter),
/// else `default`.
pub fn log_filter(log_level: Option<&str>, default: &str) -> String {
    let parses = |f: &str| tracing_subscriber::EnvFilter::builder().parse(f).is_ok();
    match (log_level, std::env::var("RUST_LOG")) {
        (Some(l), _) => l.to_string(),
        (None, Ok(env)) if parses(&env) => env,
        (None, _) => default.to_string(),
    }
}

/// What a reload did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum Reloaded {
    /// The new settings serve every request that starts from now on; `changed` names the
    /// settings that changed (empty: the configuration was the same).
    Applied {
        /// Setting names (`routes[0].mode`), never values.
        changed: Vec<String>,
    },
    /// Settings that only a restart applies changed: nothing was applied.
    Refused {
        /// The settings that need a restart.
        restart_required: Vec<String>,
    },
    /// The configuration does not pass `idemgate config check`: nothing was applied.
    Invalid {
        /// Each problem, as `config check` words it.
        problems: Vec<String>,
    },
}

impl Reloaded {
    /// The `result` label of `idemgate_config_reloads_total`.
    pub fn result(&self) -> &'static str {
        match self {
            Reloaded::Applied { .. } => "applied",
            Reloaded::Refused { .. } => "refused",
            Reloaded::Invalid { .. } => "invalid",
        }
    }
}

/// Reloads the configuration into the settings in force.
pub struct Reloader {
    source: Source,
    live: Arc<Live>,
    metrics: Arc<Metrics>,
    // One reload at a time: two at once could each check against the settings the other
    // is replacing.
    running: Mutex<()>,
}

impl Reloader {
    /// Reloads from `source` into `live`, counting into `metrics`.
    pub fn new(source: Source, live: Arc<Live>, metrics: Arc<Metrics>) -> Reloader {
        Reloader {
            source,
            live,
            metrics,
            running: Mutex::new(()),
        }
    }

    /// With a source, a reloader over `live`, and the task that reloads at each of its
    /// `SIGHUP`s.
    pub fn start(
        reload: Option<(Source, Option<Hangups>)>,
        live: &Arc<Live>,
        metrics: &Arc<Metrics>,
    ) -> (Option<Arc<Reloader>>, Option<tokio::task::JoinHandle<()>>) {
        let Some((source, hangups)) = reload else {
            return (None, None);
        };
        let reloader = Arc::new(Reloader::new(source, live.clone(), metrics.clone()));
        let task = hangups.map(|h| tokio::spawn(reload_on_hangup(reloader.clone(), h)));
        (Some(reloader), task)
    }

    /// Reads, checks and applies the configuration (all or nothing), logs and counts what
    /// came of it. `cause` says what asked (`SIGHUP`, `POST /config/reload`). Reads files:
    /// run it where blocking is fine.
    pub fn reload(&self, cause: &'static str) -> Reloaded {
        let _one = self.running.lock().unwrap_or_else(|p| p.into_inner());
        let env = std::env::vars_os().filter_map(|(k, _)| k.into_string().ok());
        let reloaded = match Wired::check((self.source.figment)(), env) {
            Err(problems) => Reloaded::Invalid { problems },
            Ok(wired) => self.apply(wired),
        };
        self.metrics.config_reload(reloaded.result());
        match &reloaded {
            Reloaded::Applied { changed } if changed.is_empty() => {
                tracing::info!(cause, "configuration reloaded: nothing changed");
            }
            Reloaded::Applied { changed } => tracing::info!(
                cause,
                changed = %changed.join(", "),
                "configuration reloaded: new requests use the new settings, requests in flight finish under the old ones"
            ),
            Reloaded::Refused { restart_required } => tracing::warn!(
                cause,
                restart_required = %restart_required.join(", "),
                "configuration reload refused, nothing applied: these settings change only with a restart"
            ),
            Reloaded::Invalid { problems } => tracing::warn!(
                cause,
                problems = %problems.join("; "),
                "configuration reload refused, nothing applied: the configuration does not pass `idemgate config check`"
            ),
        }
        reloaded
    }

    /// Puts `wired`'s settings in force, unless a setting that needs a restart changed.
    fn apply(&self, wired: Wired) -> Reloaded {
        let now = self.live.get();
        let mut new = wired.settings;
        let mut found = changes(&now.config, &new.config);
        // The TLS listener reads client certificates only if a route took its tenant from
        // them at start-up: a route that starts to needs the listener built again.
        if new.reads_client_certs() && !now.reads_client_certs() {
            found.restart.push("tenant_client_cert".into());
        }
        if !found.restart.is_empty() {
            return Reloaded::Refused {
                restart_required: found.restart,
            };
        }
        if !found.applied.is_empty() {
            // The bearer-token keys stay those read at start-up (their settings are
            // restart-only, checked above), and with them the cache of verified tokens.
            new.jwt = now.jwt.clone();
            if new.config.log_level != now.config.log_level {
                if let Some(set) = &self.source.log_filter {
                    // Checked as a filter already: this cannot fail but on a bug.
                    if let Err(e) = set(&log_filter(new.config.log_level.as_deref(), "info")) {
                        tracing::error!(error = %e, "the new log filter could not be applied");
                    }
                }
            }
            self.metrics.routes(&new.modes());
            self.live.set(new);
        }
        Reloaded::Applied {
            changed: found.applied,
        }
    }
}

/// `SIGHUP`, as a stream of signals.
#[cfg(unix)]
pub type Hangups = tokio::signal::unix::Signal;
#[cfg(not(unix))]
pub type Hangups = std::convert::Infallible;

/// `SIGHUP`, caught from now on; `None` (and logged) if it cannot be.
pub fn hangups() -> Option<Hangups> {
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGHUP; POST /config/reload still reloads");
                None
            }
        }
    }
    #[cfg(not(unix))]
    None
}

/// Reloads the configuration at each `SIGHUP`, until aborted.
async fn reload_on_hangup(reloader: Arc<Reloader>, mut hangups: Hangups) {
    #[cfg(unix)]
    while hangups.recv().await.is_some() {
        let reloader = reloader.clone();
        // It reads files: off the serving thread.
        let _ = tokio::task::spawn_blocking(move || reloader.reload("SIGHUP")).await;
    }
    #[cfg(not(unix))]
    match hangups {}
}
