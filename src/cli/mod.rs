//! The binary's subcommands, one module each, so that `main.rs` only parses the command
//! line and calls one of them: [`serve`] (the proxy, when no subcommand is given),
//! [`config`] (`config defaults`, `config check`), [`records`], [`probe`], [`bank`] and
//! [`lab`]. What several of them share (logging, the runtime, the shutdown signal, the
//! flags that override the configuration) is here.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;

use serde::Serialize;

pub mod bank;
pub mod config;
pub mod lab;
pub mod probe;
pub mod records;
pub mod serve;

/// Flags that override the file and the environment. Their defaults are the
/// configuration's (shown in `--help`); a flag that is not given leaves the file and the
/// environment in charge.
#[derive(clap::Args, Debug, Clone, Serialize)]
pub struct Overrides {
    /// Address to listen on for clients (a host name is resolved) [default: 127.0.0.1:8080]
    #[arg(long, value_name = "ADDR", value_parser = crate::config::resolve_addr)]
    #[serde(skip_serializing_if = "Option::is_none")]
    listen: Option<SocketAddr>,
    /// Upstream origin [default: http://127.0.0.1:9000]
    #[arg(long, value_name = "URL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    upstream: Option<String>,
    /// Redis URL, e.g. redis://127.0.0.1:6379/0 [default: none, records live in this
    /// process's memory]
    #[arg(long, value_name = "URL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    redis_url: Option<String>,
    /// Directory of the persistent embedded store (records survive a restart).
    #[arg(long, value_name = "DIR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    store_path: Option<std::path::PathBuf>,
    /// Whose records these are, when several services share one store (required with Redis
    /// and PostgreSQL) [default: none]
    #[arg(long, value_name = "NAME")]
    #[serde(skip_serializing_if = "Option::is_none")]
    namespace: Option<String>,
    /// Address of the admin listener (/healthz, /readyz, /metrics, /records/{id})
    /// [default: 127.0.0.1:9901]
    #[arg(long, value_name = "ADDR", value_parser = crate::config::resolve_addr)]
    #[serde(skip_serializing_if = "Option::is_none")]
    admin_listen: Option<SocketAddr>,
}

/// The layered sources of the configuration: defaults < `file` (TOML) < the environment
/// < `overrides`.
fn figment(file: Option<&std::path::Path>, overrides: &Overrides) -> figment::Figment {
    crate::Config::figment(file).merge(figment::providers::Serialized::globals(overrides))
}

/// Logs to stderr, filtered by `filter` (`RUST_LOG`'s syntax; `log_level`, else
/// `RUST_LOG`, else a default); with a tracer, idemgate's spans also go to OpenTelemetry
/// (each output has its own filter, so the log lines are the same either way). Returns what
/// puts another filter in force (a reload of `log_level`).
fn init_tracing(
    filter: &str,
    tracer: Option<opentelemetry_sdk::trace::SdkTracer>,
) -> crate::reload::LogFilter {
    use std::io::IsTerminal;
    use tracing_subscriber::prelude::*;
    use tracing_subscriber::EnvFilter;
    // The audit lines stay on whatever the filter silences, unless it names their target.
    let filter = EnvFilter::builder()
        .parse(crate::admin_access::with_audit(filter))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let (filter, handle) = tracing_subscriber::reload::Layer::new(filter);
    let json = std::env::var("IDEMGATE_LOG_FORMAT").is_ok_and(|v| v.eq_ignore_ascii_case("json"));
    // Colours only for a person at a terminal: a log file or collector gets plain text.
    let ansi = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let fmt = tracing_subscriber::fmt::layer()
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    let fmt = if json {
        fmt.json().flatten_event(true).boxed()
    } else {
        fmt.boxed()
    };
    tracing_subscriber::registry()
        .with(fmt.with_filter(filter))
        .with(tracer.map(crate::telemetry::layer))
        .init();
    Arc::new(move |filter: &str| {
        let filter = EnvFilter::builder()
            .parse(crate::admin_access::with_audit(filter))
            .map_err(|e| e.to_string())?;
        handle.reload(filter).map_err(|e| e.to_string())
    })
}

/// The log filter when no configuration says: `RUST_LOG`, else `default`.
fn env_filter(default: &str) -> String {
    crate::reload::log_filter(None, default)
}

/// Resolves at the first SIGINT (ctrl-c) or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for ctrl-c");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = terminate => {},
    }
}

/// A multi-threaded runtime for the subcommands other than the proxy; exit code 71 when
/// the OS refuses one.
fn runtime() -> Result<tokio::runtime::Runtime, ExitCode> {
    tokio::runtime::Runtime::new().map_err(|e| {
        eprintln!("idemgate: cannot start the runtime: {e}");
        ExitCode::from(71)
    })
}

/// The names of this process's environment variables.
fn env_names() -> impl Iterator<Item = String> {
    std::env::vars_os().filter_map(|(k, _)| k.into_string().ok())
}
