//! The `idemgate` binary: parses the command line and runs what it asks for, each
//! subcommand a function of [`idemgate::cli`] (the proxy, [`idemgate::cli::serve`], when
//! none is given).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use idemgate::cli;

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
    overrides: cli::Overrides,
}

/// Without a subcommand, idemgate runs the proxy.
#[derive(clap::Subcommand, Debug)]
enum Command {
    /// Run a deliberately non-idempotent legacy bank (every POST /transfers moves money).
    Bank {
        /// Address to listen on (a host name is resolved).
        #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9000", value_parser = idemgate::config::resolve_addr)]
        listen: SocketAddr,
    },
    /// Replay a day of retrying transfer traffic against a bank, directly and through
    /// idemgate, and audit both ledgers for double transfers.
    Lab(cli::lab::LabArgs),
    /// The configuration without running: every setting's default, or a check of a file.
    Config {
        #[command(subcommand)]
        action: cli::config::ConfigAction,
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

fn main() -> ExitCode {
    let args = Cli::parse();
    match args.command {
        Some(Command::Bank { listen }) => cli::bank::run(listen),
        Some(Command::Lab(lab)) => cli::lab::run(lab),
        Some(Command::Probe { url, timeout }) => cli::probe::run(&url, timeout),
        Some(Command::Records { args }) => ExitCode::from(cli::records::main(args)),
        Some(Command::Config { action }) => cli::config::run(action, args.config, &args.overrides),
        None => cli::serve::run(args.config, args.overrides),
    }
}
