//! The `idemgate` binary: flags, configuration, logging, then [`idemgate::run`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use clap::Parser;
use figment::providers::Serialized;
use idemgate::config::Config;
use idemgate::wiring::Wired;
use serde::Serialize;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// An idempotency sidecar: a reverse proxy that makes retried POSTs safe with the
/// Idempotency-Key header.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// TOML configuration file.
    #[arg(long, env = "IDEMGATE_CONFIG", value_name = "PATH")]
    config: Option<PathBuf>,
    #[command(flatten)]
    overrides: Overrides,
}

/// Without a subcommand, idemgate runs the proxy.
#[derive(clap::Subcommand, Debug)]
enum Command {
    /// Run a deliberately non-idempotent legacy bank (every POST /transfers moves money).
    Bank {
        /// Address to listen on (a host name is resolved).
        #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9000", value_parser = resolve_addr)]
        listen: SocketAddr,
    },
    /// Replay a day of retrying transfer traffic against a bank, directly and through
    /// idemgate, and audit both ledgers for double transfers.
    Lab(LabArgs),
    /// The configuration without running: every setting's default, or a check of a file.
    Config {
        #[command(subcommand)]
        action: ConfigAction,
    },
    /// Records through the admin API: list (--state unknown), show, lookup, release,
    /// complete. `idemgate records --help` for its flags; exit codes 0 done, 1 not found,
    /// 2 refused, 64 usage, 69 unreachable, 77 unauthorized.
    #[command(disable_help_flag = true)]
    Records {
        /// Parsed by `idemgate records` itself (so that its usage errors exit 64).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
    /// GET an admin URL and exit 0 on a 2xx answer, 1 otherwise: a health check for images
    /// without curl. Sends IDEMGATE_ADMIN_TOKEN as a bearer token when it is set.
    Probe {
        /// e.g. http://127.0.0.1:9901/readyz
        url: String,
        /// How long to wait for the answer.
        #[arg(long, value_name = "DURATION", default_value = "2s", value_parser = humantime::parse_duration)]
        timeout: std::time::Duration,
    },
}

#[derive(clap::Subcommand, Debug)]
enum ConfigAction {
    /// Print every setting with its default, as TOML; settings without a default are
    /// listed as comments.
    Defaults,
    /// Run every start-up check that needs no network on FILE (or --config /
    /// IDEMGATE_CONFIG) with the IDEMGATE_ environment, with start-up's messages, and print
    /// the effective configuration as TOML, secrets redacted. Exits 0 when idemgate would
    /// start, 64 when not (69 when --connect cannot reach the store).
    Check {
        /// TOML configuration file (else --config or IDEMGATE_CONFIG, else none).
        file: Option<PathBuf>,
        /// Also open the store and run its start-up checks (Redis, PostgreSQL, SQLite).
        #[arg(long)]
        connect: bool,
    },
}

#[derive(clap::Args, Debug)]
struct LabArgs {
    /// Transfer intents in the day [default: 3000; 1000 with --bad-day]
    #[arg(long)]
    intents: Option<usize>,
    /// Seed of the day (the same seed replays the same day).
    #[arg(long, default_value_t = idemgate::lab::LabOptions::default().seed)]
    seed: u64,
    /// Clients sending at the same time.
    #[arg(long, default_value_t = idemgate::lab::LabOptions::default().concurrency)]
    concurrency: usize,
    /// Run idemgate on this Redis instead of the embedded store.
    #[arg(long, value_name = "URL")]
    redis_url: Option<String>,
    /// With --bad-day: run idemgate on a `redis-server` (from PATH) the lab starts itself on
    /// a free loopback port with persistence on (appendonly, fsync always), frozen with
    /// SIGSTOP and restarted during the day.
    #[arg(long, conflicts_with = "redis_url")]
    redis_server: bool,
    /// Print the figures as JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// `observe`: run the idemgate column with the route in observe mode; the lab then
    /// checks that idemgate's duplicates let through equal the auditor's double transfers.
    #[arg(long, value_name = "MODE", default_value = "enforce", value_parser = ["enforce", "observe"])]
    mode: String,
    /// The whole day over TLS, with certificates made for the run: clients to idemgate's
    /// TLS listener (and to the bank in the direct run), idemgate to an HTTPS bank.
    #[arg(long)]
    tls: bool,
    /// A bad day: the same day with incidents (bank restarts and crashes, connections
    /// closed after answers, an idemgate instance killed, the store frozen, a retry storm,
    /// slow clients), then the operator's pass over the records held `unknown`
    /// (default 1000 intents).
    #[arg(long)]
    bad_day: bool,
}

/// Flags that override the file and the environment. Their defaults are the
/// configuration's (shown in `--help`); a flag that is not given leaves the file and the
/// environment in charge.
#[derive(clap::Args, Debug, Clone, Serialize)]
struct Overrides {
    /// Address to listen on for clients (a host name is resolved) [default: 127.0.0.1:8080]
    #[arg(long, value_name = "ADDR", value_parser = resolve_addr)]
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
    #[arg(long, value_name = "ADDR", value_parser = resolve_addr)]
    #[serde(skip_serializing_if = "Option::is_none")]
    admin_listen: Option<SocketAddr>,
}

fn resolve_addr(s: &str) -> Result<SocketAddr, String> {
    idemgate::config::resolve_addr(s)
}

/// Logs to stderr, filtered by `filter` (`RUST_LOG`'s syntax; `log_level`, else
/// `RUST_LOG`, else a default); with a tracer, idemgate's spans also go to OpenTelemetry
/// (each output has its own filter, so the log lines are the same either way). Returns what
/// puts another filter in force (a reload of `log_level`).
fn init_tracing(
    filter: &str,
    tracer: Option<opentelemetry_sdk::trace::SdkTracer>,
) -> idemgate::reload::LogFilter {
    use std::io::IsTerminal;
    use tracing_subscriber::prelude::*;
    use tracing_subscriber::EnvFilter;
    // The audit lines stay on whatever the filter silences, unless it names their target.
    let filter = EnvFilter::builder()
        .parse(idemgate::admin_access::with_audit(filter))
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
        .with(tracer.map(idemgate::telemetry::layer))
        .init();
    Arc::new(move |filter: &str| {
        let filter = EnvFilter::builder()
            .parse(idemgate::admin_access::with_audit(filter))
            .map_err(|e| e.to_string())?;
        handle.reload(filter).map_err(|e| e.to_string())
    })
}

/// The log filter when no configuration says: `RUST_LOG`, else `default`.
fn env_filter(default: &str) -> String {
    idemgate::reload::log_filter(None, default)
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

fn runtime() -> Result<tokio::runtime::Runtime, ExitCode> {
    tokio::runtime::Runtime::new().map_err(|e| {
        eprintln!("idemgate: cannot start the runtime: {e}");
        ExitCode::from(71)
    })
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

fn bank(listen: SocketAddr) -> ExitCode {
    init_tracing(&env_filter("info"), None);
    let rt = match runtime() {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    rt.block_on(async move {
        let listener = match tokio::net::TcpListener::bind(listen).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("idemgate bank: cannot listen on {listen}: {e}");
                return ExitCode::from(71);
            }
        };
        let bank = idemgate::lab::Bank::with_demo_accounts(idemgate::lab::BankOptions::default());
        tracing::info!(%listen, "legacy bank listening (not idempotent: every POST /transfers moves money)");
        match idemgate::lab::bank::serve(listener, bank, shutdown_signal()).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("idemgate bank: {e}");
                ExitCode::FAILURE
            }
        }
    })
}

fn lab(args: LabArgs) -> ExitCode {
    // The lab's own output is the table; per-request logs would drown it (on a bad day
    // even the errors its incidents cause on purpose, which the table counts).
    init_tracing(
        &env_filter(if args.bad_day { "off" } else { "error" }),
        None,
    );
    let rt = match runtime() {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    if args.bad_day {
        return bad_day(&rt, args);
    }
    if args.redis_server {
        eprintln!(
            "idemgate lab: --redis-server is for --bad-day (it restarts the store during the day)"
        );
        return ExitCode::from(64);
    }
    let opts = idemgate::lab::LabOptions {
        intents: args
            .intents
            .unwrap_or(idemgate::lab::LabOptions::default().intents),
        seed: args.seed,
        concurrency: args.concurrency,
        redis_url: args.redis_url,
        progress: !args.json,
        observe: args.mode == "observe",
        tls: args.tls,
        ..idemgate::lab::LabOptions::default()
    };
    match rt.block_on(idemgate::lab::run_lab(opts)) {
        Ok(report) => print_report(
            args.json,
            || report.to_json(),
            || format!("{}{}\n", report.table(), report.summary_line()),
            report.passed(),
        ),
        Err(e) => {
            eprintln!("idemgate lab: {e}");
            ExitCode::from(2)
        }
    }
}

/// Prints a lab's report (its JSON, or its table and summary line); exit 0 when its
/// verdict holds, 1 when not.
fn print_report(
    json: bool,
    as_json: impl FnOnce() -> String,
    as_text: impl FnOnce() -> String,
    passed: bool,
) -> ExitCode {
    if json {
        println!("{}", as_json());
    } else {
        print!("{}", as_text());
    }
    if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// `idemgate lab --bad-day`: exit 0 when the verdict holds, 1 when not, 64 for options the
/// bad day does not take, 2 when the lab could not run.
fn bad_day(rt: &tokio::runtime::Runtime, args: LabArgs) -> ExitCode {
    let opts = idemgate::lab::LabOptions {
        intents: args
            .intents
            .unwrap_or(idemgate::lab::badday::DEFAULT_INTENTS),
        seed: args.seed,
        concurrency: args.concurrency,
        redis_url: args.redis_url,
        redis_server: args.redis_server,
        progress: !args.json,
        observe: args.mode == "observe",
        tls: args.tls,
        ..idemgate::lab::LabOptions::default()
    };
    match rt.block_on(idemgate::lab::run_bad_day(opts)) {
        Ok(report) => print_report(
            args.json,
            || report.to_json(),
            || format!("{}{}\n", report.table(), report.summary_line()),
            report.passed(),
        ),
        Err(e @ idemgate::lab::LabError::Options(_)) => {
            eprintln!("idemgate lab: {e}");
            ExitCode::from(64)
        }
        Err(e) => {
            eprintln!("idemgate lab: {e}");
            ExitCode::from(2)
        }
    }
}

fn probe(url: &str, timeout: std::time::Duration) -> ExitCode {
    let token = std::env::var("IDEMGATE_ADMIN_TOKEN").ok();
    match idemgate::probe::get(url, token.as_deref(), timeout) {
        Ok(status) if (200..300).contains(&status) => ExitCode::SUCCESS,
        Ok(status) => {
            eprintln!("idemgate probe: {url} answered {status}");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("idemgate probe: {url}: {e}");
            ExitCode::FAILURE
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Bank { listen }) => return bank(listen),
        Some(Command::Lab(args)) => return lab(args),
        Some(Command::Probe { url, timeout }) => return probe(&url, timeout),
        Some(Command::Records { args }) => {
            return ExitCode::from(idemgate::records_cli::main(args))
        }
        Some(Command::Config { action }) => {
            return config_command(action, cli.config, &cli.overrides)
        }
        None => {}
    }
    let figment = Config::figment(cli.config.as_deref()).merge(Serialized::globals(&cli.overrides));
    let mut wired = match Wired::load(figment) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("idemgate: configuration error: {e}");
            return ExitCode::from(64);
        }
    };
    let otlp_endpoint = wired.settings.config.otlp_endpoint.as_deref();
    let telemetry = if idemgate::telemetry::wanted(otlp_endpoint) {
        match idemgate::telemetry::Telemetry::start(otlp_endpoint) {
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
    let log_filter = init_tracing(&idemgate::reload::log_filter(log_level, "info"), tracer);
    let unknown = idemgate::config::unknown_env();
    if !unknown.is_empty() {
        tracing::warn!(
            ignored = %unknown.join(", "),
            "environment variables with the IDEMGATE_ prefix that name no setting are ignored"
        );
    }
    for (name, hint) in idemgate::config::mistyped_env_vars(env_names()) {
        tracing::warn!(
            variable = %name,
            "{name} names no setting and is ignored (its value does not apply): {hint} `idemgate config check` fails on it"
        );
    }
    let grace = wired.settings.config.shutdown_grace;
    // With spans to export, the drain ends a tenth of the grace early (at most 100 ms), so
    // that the last export has that much of the one grace even when the drain needs all
    // of its share.
    if telemetry.is_some() {
        wired.settings.config.shutdown_grace = grace - (grace / 10).min(Duration::from_millis(100));
    }
    // A reload reads the same sources again: the file, the environment, these flags.
    let overrides = cli.overrides.clone();
    let source = idemgate::reload::Source {
        figment: Arc::new(move || {
            Config::figment(cli.config.as_deref()).merge(Serialized::globals(&overrides))
        }),
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

/// `idemgate config defaults` and `idemgate config check`.
fn config_command(
    action: ConfigAction,
    config: Option<PathBuf>,
    overrides: &Overrides,
) -> ExitCode {
    match action {
        ConfigAction::Defaults => match idemgate::config::defaults_toml() {
            Ok(text) => {
                print!("{text}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("idemgate config defaults: {e}");
                ExitCode::FAILURE
            }
        },
        ConfigAction::Check { file, connect } => {
            let file = file.or(config);
            let figment = Config::figment(file.as_deref()).merge(Serialized::globals(overrides));
            // Every problem of this run at once: the variables that look mistyped, then
            // each invalid value.
            let wired = match Wired::check(figment, env_names()) {
                Ok(wired) => wired,
                Err(problems) => {
                    for e in problems {
                        eprintln!("idemgate: configuration error: {e}");
                    }
                    return ExitCode::from(64);
                }
            };
            // With no variable that looks mistyped (those fail above), the rest that name no
            // setting are only said.
            let unknown = idemgate::config::unknown_env();
            if !unknown.is_empty() {
                eprintln!(
                    "idemgate config check: ignored (name no setting): {}",
                    unknown.join(", ")
                );
            }

            for warning in wired.warnings() {
                eprintln!("idemgate config check: warning: {warning}");
            }
            if connect {
                // What start-up logs as it connects (Redis persistence off, the store's
                // scope secret made) is printed too: warnings and errors, to stderr.
                init_tracing(&env_filter("warn"), None);
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        eprintln!("idemgate config check: cannot start a runtime: {e}");
                        return ExitCode::FAILURE;
                    }
                };
                let opened = runtime.block_on(idemgate::server::open_store(&wired));
                if let Err(e) = opened {
                    eprintln!("idemgate: {e}");
                    return ExitCode::from(e.exit_code() as u8);
                }
            }
            match idemgate::config::redacted_toml(&wired.settings.config) {
                Ok(text) => {
                    print!("{text}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("idemgate config check: {e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

/// The names of this process's environment variables.
fn env_names() -> impl Iterator<Item = String> {
    std::env::vars_os().filter_map(|(k, _)| k.into_string().ok())
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
    reload: idemgate::reload::Source,
) -> ExitCode {
    let runtime = match serving_runtime() {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    let grace = wired.settings.config.shutdown_grace;
    let noted = signaled.clone();
    let code = runtime.block_on(async move {
        let settings = &wired.settings;
        let (listener, admin) = match idemgate::server::bind(settings).await {
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
            store = idemgate::store::StoreKind::of(&settings.config).name(),
            tracing = idemgate::telemetry::enabled(),
            version = env!("CARGO_PKG_VERSION"),
            "idemgate starting"
        );
        let signal = async move {
            shutdown_signal().await;
            let _ = noted.set(Instant::now());
        };
        match idemgate::run(wired, listener, admin, signal, Some(reload)).await {
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
