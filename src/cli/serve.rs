//! `idemgate` with no subcommand: the proxy, run until SIGTERM or SIGINT and drained
//! within one `shutdown_grace`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use super::Overrides;
use crate::wiring::Wired;

/// Loads the configuration from `file`, the environment and `overrides`, starts logging
/// (and tracing to OpenTelemetry when configured) and runs the proxy: exit 0 after a clean
/// shutdown, 64 for a bad configuration, 69 an unavailable store, 71 an OS error.
pub fn run(file: Option<PathBuf>, overrides: Overrides) -> ExitCode {
    let mut wired = match Wired::load_all(super::figment(file.as_deref(), &overrides)) {
        Ok(s) => s,
        Err(problems) => {
            for e in problems {
                eprintln!("idemgate: configuration error: {e}");
            }
            return ExitCode::from(64);
        }
    };
    let otlp_endpoint = wired.settings.config.otlp_endpoint.as_deref();
    let telemetry = if crate::telemetry::wanted(otlp_endpoint) {
        match crate::telemetry::Telemetry::start(otlp_endpoint) {
            Ok((telemetry, tracer)) => Some((telemetry, tracer)),
            Err(e) => {
                eprintln!("idemgate: configuration error: otlp_endpoint: {e}");
                return ExitCode::from(64);
            }
        }
    } else {
        None
    };
    let (telemetry, tracer) = telemetry.unzip();
    let log_level = wired.settings.config.log_level.as_deref();
    let log_filter = super::init_tracing(&crate::reload::log_filter(log_level, "info"), tracer);
    warn_of_environment();
    let grace = wired.settings.config.shutdown_grace;
    // With spans to export, the drain ends a tenth of the grace early (at most 100 ms), so
    // that the last export has that much of the one grace even when the drain needs all
    // of its share.
    if telemetry.is_some() {
        wired.settings.config.shutdown_grace = grace - (grace / 10).min(Duration::from_millis(100));
    }
    // A reload reads the same sources again: the file, the environment, these flags.
    let source = crate::reload::Source {
        figment: Arc::new(move || super::figment(file.as_deref(), &overrides)),
        log_filter: Some(log_filter),
    };
    let signaled = Arc::new(OnceLock::new());
    let code = serve(wired, signaled.clone(), source);
    // The spans still buffered go out before the process ends, within what is left of the
    // one shutdown grace (a silent collector would otherwise add its own export timeout).
    if let Some(telemetry) = telemetry {
        telemetry.shutdown(left_of(grace, &signaled));
    }
    code
}

/// Warns of `IDEMGATE_` variables that name no setting, and of those that look like a
/// mistyped one.
fn warn_of_environment() {
    let unknown = crate::config::unknown_env();
    if !unknown.is_empty() {
        tracing::warn!(
            ignored = %unknown.join(", "),
            "environment variables with the IDEMGATE_ prefix that name no setting are ignored"
        );
    }
    for (name, hint) in crate::config::mistyped_env_vars(super::env_names()) {
        tracing::warn!(
            variable = %name,
            "{name} names no setting and is ignored (its value does not apply): {hint} `idemgate config check` fails on it"
        );
    }
}

/// The runtime of the first serving thread. It runs everything on the current thread: the
/// request tasks and the one shared Redis connection's task never hand work across threads,
/// which is where a multi-threaded scheduler spends its time. With `worker_threads` above
/// one, each further thread runs a runtime like this one (`server::run`).
fn serving_runtime() -> Result<tokio::runtime::Runtime, ExitCode> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| {
            eprintln!("idemgate: cannot start the runtime: {e}");
            ExitCode::from(71)
        })
}

/// What is left of `grace` since the shutdown signal (all of it if none came).
fn left_of(grace: Duration, signaled: &OnceLock<Instant>) -> Duration {
    signaled
        .get()
        .map_or(grace, |at| grace.saturating_sub(at.elapsed()))
}

/// Runs the proxy until SIGTERM/SIGINT; notes in `signaled` when the signal came, so that
/// everything after it (the drain, the runtime's end, the last spans) fits in one
/// `shutdown_grace`.
fn serve(
    wired: Wired,
    signaled: Arc<OnceLock<Instant>>,
    reload: crate::reload::Source,
) -> ExitCode {
    let runtime = match serving_runtime() {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    let grace = wired.settings.config.shutdown_grace;
    let noted = signaled.clone();
    let code = runtime.block_on(async move {
        let settings = &wired.settings;
        let (listener, admin) = match crate::server::bind(settings).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("idemgate: {e}");
                return ExitCode::from(e.exit_code() as u8);
            }
        };
        tracing::info!(
            listen = %settings.config.listen,
            tls = wired.listener_tls.is_some(),
            upstream = %settings.config.upstream,
            admin = %settings
                .config
                .admin_listen
                .map_or_else(|| "off".to_string(), |a| a.to_string()),
            store = crate::store::StoreKind::of(&settings.config).name(),
            tracing = crate::telemetry::enabled(),
            version = env!("CARGO_PKG_VERSION"),
            "idemgate starting"
        );
        let signal = async move {
            super::shutdown_signal().await;
            let _ = noted.set(Instant::now());
        };
        match crate::server::run(wired, listener, admin, signal, Some(reload)).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("idemgate: {e}");
                ExitCode::from(e.exit_code() as u8)
            }
        }
    });
    // Tasks still running (a store call that never returns, a connection being given up)
    // are dropped with the runtime; waiting for blocking ones is bounded by the grace.
    runtime.shutdown_timeout(left_of(grace, &signaled));
    code
}
