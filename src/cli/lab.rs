//! `idemgate lab`: a day of retrying transfer traffic against the bank, directly and
//! through idemgate, audited ([`crate::lab`]); with `--bad-day`, the same day with
//! incidents.

use std::process::ExitCode;

use crate::lab::{LabError, LabOptions};

/// The lab's flags.
#[derive(clap::Args, Debug)]
pub struct LabArgs {
    /// Transfer intents in the day [default: 3000; 1000 with --bad-day]
    #[arg(long)]
    intents: Option<usize>,
    /// Seed of the day (the same seed replays the same day).
    #[arg(long, default_value_t = LabOptions::default().seed)]
    seed: u64,
    /// Clients sending at the same time.
    #[arg(long, default_value_t = LabOptions::default().concurrency)]
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
    /// checks that idemgate's duplicates let through equal the ledger's repeated transfers.
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

impl LabArgs {
    /// The lab's options from these flags; `intents` when the flags name none.
    fn options(&self, intents: usize) -> LabOptions {
        LabOptions {
            intents: self.intents.unwrap_or(intents),
            seed: self.seed,
            concurrency: self.concurrency,
            redis_url: self.redis_url.clone(),
            redis_server: self.redis_server,
            progress: !self.json,
            observe: self.mode == "observe",
            tls: self.tls,
            ..LabOptions::default()
        }
    }
}

/// Runs the lab (or its bad day): exit 0 when the verdict holds, 1 when not, 64 for
/// options it does not take, 2 when it could not run.
pub fn run(args: LabArgs) -> ExitCode {
    // The lab's own output is the table; per-request logs would drown it (on a bad day
    // even the errors its incidents cause on purpose, which the table counts).
    super::init_tracing(
        &super::env_filter(if args.bad_day { "off" } else { "error" }),
        None,
    );
    let rt = match super::runtime() {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    if args.bad_day {
        return bad_day(&rt, &args);
    }
    if args.redis_server {
        eprintln!(
            "idemgate lab: --redis-server is for --bad-day (it restarts the store during the day)"
        );
        return ExitCode::from(64);
    }
    let opts = args.options(LabOptions::default().intents);
    match rt.block_on(crate::lab::run_lab(opts)) {
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
fn bad_day(rt: &tokio::runtime::Runtime, args: &LabArgs) -> ExitCode {
    let opts = args.options(crate::lab::badday::DEFAULT_INTENTS);
    match rt.block_on(crate::lab::run_bad_day(opts)) {
        Ok(report) => print_report(
            args.json,
            || report.to_json(),
            || format!("{}{}\n", report.table(), report.summary_line()),
            report.passed(),
        ),
        Err(e @ LabError::Options(_)) => {
            eprintln!("idemgate lab: {e}");
            ExitCode::from(64)
        }
        Err(e) => {
            eprintln!("idemgate lab: {e}");
            ExitCode::from(2)
        }
    }
}
