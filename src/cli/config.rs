//! `idemgate config defaults` and `idemgate config check`: the configuration without
//! running the proxy.

use std::path::PathBuf;
use std::process::ExitCode;

use super::Overrides;
use crate::wiring::Wired;

/// What `idemgate config` does.
#[derive(clap::Subcommand, Debug)]
pub enum ConfigAction {
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

/// Runs `action`; `config` is the file that `--config` or `IDEMGATE_CONFIG` names.
pub fn run(action: ConfigAction, config: Option<PathBuf>, overrides: &Overrides) -> ExitCode {
    match action {
        ConfigAction::Defaults => match crate::config::defaults_toml() {
            Ok(text) => {
                print!("{text}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("idemgate config defaults: {e}");
                ExitCode::FAILURE
            }
        },
        ConfigAction::Check { file, connect } => check(file.or(config), connect, overrides),
    }
}

/// `idemgate config check`: every problem of the configuration at once (exit 64), its
/// warnings, with `connect` the store's start-up checks (exit 69 or 64 as start-up would
/// fail), then the effective configuration, redacted.
fn check(file: Option<PathBuf>, connect: bool, overrides: &Overrides) -> ExitCode {
    let figment = super::figment(file.as_deref(), overrides);
    // Every problem of this run at once: the variables that look mistyped, then
    // each invalid value.
    let wired = match Wired::check(figment, super::env_names()) {
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
    let unknown = crate::config::unknown_env();
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
        if let Err(code) = open_store(&wired) {
            return code;
        }
    }
    match crate::config::redacted_toml(&wired.settings.config) {
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

/// `config check --connect`: opens the store as start-up does, and fails as it would.
fn open_store(wired: &Wired) -> Result<(), ExitCode> {
    // What start-up logs as it connects (Redis persistence off, the store's
    // scope secret made) is printed too: warnings and errors, to stderr.
    super::init_tracing(&super::env_filter("warn"), None);
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("idemgate config check: cannot start a runtime: {e}");
            return Err(ExitCode::FAILURE);
        }
    };
    let opened = runtime.block_on(crate::server::open_store(wired));
    if let Err(e) = opened {
        eprintln!("idemgate: {e}");
        return Err(ExitCode::from(e.exit_code() as u8));
    }
    Ok(())
}
