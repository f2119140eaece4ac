//! The `idemgate` binary: flags, configuration, logging, then [`idemgate::run`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use figment::providers::Serialized;
use idemgate::config::Config;
use serde::Serialize;

/// An idempotency sidecar: a reverse proxy that makes retried POSTs safe with the
/// Idempotency-Key header.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    /// TOML configuration file.
    #[arg(long, env = "IDEMGATE_CONFIG", value_name = "PATH")]
    config: Option<PathBuf>,
    #[command(flatten)]
    overrides: Overrides,
}

/// Flags that override the file and the environment.
#[derive(clap::Args, Debug, Serialize)]
struct Overrides {
    /// Address to listen on for clients, e.g. 127.0.0.1:8080.
    #[arg(long, value_name = "ADDR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    listen: Option<SocketAddr>,
    /// Upstream origin, e.g. http://127.0.0.1:9000.
    #[arg(long, value_name = "URL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    upstream: Option<String>,
    /// Redis URL; without it records live in this process's memory.
    #[arg(long, value_name = "URL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    redis_url: Option<String>,
    /// Address of the admin listener (/healthz, /readyz, /records/{id}).
    #[arg(long, value_name = "ADDR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    admin_listen: Option<SocketAddr>,
}

fn init_tracing() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let json = std::env::var("IDEMGATE_LOG_FORMAT").is_ok_and(|v| v.eq_ignore_ascii_case("json"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        builder.json().flatten_event(true).init();
    } else {
        builder.init();
    }
}

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

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing();
    let figment = Config::figment(cli.config.as_deref()).merge(Serialized::globals(&cli.overrides));
    let settings = match Config::load(figment) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("idemgate: configuration error: {e}");
            return ExitCode::from(64);
        }
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("idemgate: cannot start the runtime: {e}");
            return ExitCode::from(71);
        }
    };
    runtime.block_on(async move {
        let (listener, admin) = match idemgate::server::bind(&settings).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("idemgate: {e}");
                return ExitCode::from(e.exit_code() as u8);
            }
        };
        tracing::info!(
            listen = %settings.config.listen,
            upstream = %settings.config.upstream,
            admin = ?settings.config.admin_listen,
            store = if settings.config.redis_url.is_some() { "redis" } else { "memory" },
            version = env!("CARGO_PKG_VERSION"),
            "idemgate starting"
        );
        match idemgate::run(settings, listener, admin, shutdown_signal()).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("idemgate: {e}");
                ExitCode::from(e.exit_code() as u8)
            }
        }
    })
}
