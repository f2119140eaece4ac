//! The lab: reproduce double transfers on a legacy bank, then show idemgate preventing them.
//!
//! `idemgate lab` runs one seeded day of transfer traffic twice, in-process on loopback:
//! first straight at a fresh [`bank::Bank`], then through idemgate at another fresh bank. The
//! clients time out and retry, hang up and retry, double-click and correct amounts under the
//! same key, as real ones do. The [`auditor`] then reads both ledgers and counts what was
//! executed more than once and which balances are wrong.
//!
//! # Layout
//! - [`bank`]: the deliberately non-idempotent payment API (`idemgate bank`).
//! - [`traffic`]: the seeded day of intents and the retrying clients.
//! - [`auditor`]: ledger against intents: double transfers, money moved twice, balances.
//! - [`report`]: figures per run, the table, the summary line, JSON.
//! - [`tracked`]: the store wrapper that lets a lab on Redis delete the records it made
//!   (and freezes the embedded store on a bad day).
//! - [`badday`]: `idemgate lab --bad-day`, the same day with [`incidents`]: the bank's
//!   [`outages`], the [`fleet`] of idemgate instances (one killed) and its store frozen, a
//!   retry storm, slow clients; then the operator's pass ([`reconcile`]) and its verdict.
//!
//! Crates: `tokio` to bind loopback listeners and run both servers in-process; `indicatif`
//! for the progress bar (hidden unless stderr is a terminal); `thiserror` for [`LabError`];
//! `tracing` for warnings that do not stop the lab.

pub mod auditor;
pub mod badday;
pub mod bank;
mod fleet;
pub mod incidents;
pub mod observe;
mod outages;
mod reconcile;
mod redis_server;
pub mod report;
mod tls;
mod tracked;
pub mod traffic;

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tokio::net::TcpListener;

pub use badday::{run_bad_day, BadDayReport};
pub use bank::{Bank, BankOptions, LedgerSnapshot, TransferRow};
pub use report::{LabReport, RunFigures};
pub use traffic::{Behaviour, DayPlan, Intent};

/// How long the lab waits, after the last client finished, for requests whose clients left
/// (hang-ups, timeouts) to finish in the bank before it audits.
const SETTLE_LIMIT: Duration = Duration::from_secs(10);

/// What to run.
#[derive(Debug, Clone)]
pub struct LabOptions {
    /// Transfer intents in the day.
    pub intents: usize,
    /// Seeds the day; the same seed replays the same intents with the same behaviours.
    pub seed: u64,
    /// Clients sending at the same time.
    pub concurrency: usize,
    /// Run idemgate on this Redis instead of the embedded store.
    pub redis_url: Option<String>,
    /// On a bad day: run idemgate on a `redis-server` the lab starts itself, with
    /// persistence on, which the day freezes (SIGSTOP) and restarts.
    pub redis_server: bool,
    /// Draw a progress bar on stderr (only ever when stderr is a terminal).
    pub progress: bool,
    /// The impatient clients' deadline; must be shorter than `bank.slow_latency`.
    pub client_timeout: Duration,
    /// How both banks answer.
    pub bank: BankOptions,
    /// Run the idemgate column with the route in `mode = "observe"`.
    pub observe: bool,
    /// The whole day over TLS: clients to idemgate's TLS listener (and to the bank in the
    /// direct run), idemgate to an HTTPS bank, with certificates made for the run.
    pub tls: bool,
}

impl Default for LabOptions {
    /// A day sized to finish in well under a minute on two cores.
    fn default() -> Self {
        LabOptions {
            intents: 3_000,
            seed: 20_240_917,
            concurrency: 32,
            redis_url: None,
            redis_server: false,
            progress: true,
            client_timeout: Duration::from_millis(100),
            bank: BankOptions::default(),
            observe: false,
            tls: false,
        }
    }
}

impl LabOptions {
    /// A few seconds' worth, for tests and CI.
    pub fn small() -> Self {
        LabOptions {
            intents: 200,
            concurrency: 16,
            progress: false,
            ..LabOptions::default()
        }
    }
}

/// Why the lab could not produce a report (a report with double transfers is not an error).
#[derive(Debug, thiserror::Error)]
pub enum LabError {
    #[error("invalid lab options: {0}")]
    Options(String),
    #[error("could not bind a loopback listener: {0}")]
    Bind(#[source] std::io::Error),
    #[error("could not start idemgate: {0}")]
    Proxy(String),
}

/// Runs the day directly against a bank, then through idemgate, and audits both.
pub async fn run_lab(opts: LabOptions) -> Result<LabReport, LabError> {
    if opts.intents == 0 || opts.concurrency == 0 {
        return Err(LabError::Options(
            "intents and concurrency must be at least 1".to_owned(),
        ));
    }
    if opts.client_timeout >= opts.bank.slow_latency {
        return Err(LabError::Options(format!(
            "client timeout ({:?}) must be shorter than the bank's slow tail ({:?})",
            opts.client_timeout, opts.bank.slow_latency
        )));
    }
    let plan = DayPlan::generate(opts.intents, opts.seed);
    let direct = run_day(&plan, &opts, Through::Direct).await?;
    let through = Through::Idemgate(format!(
        "{} ({}{})",
        if opts.observe { "observe" } else { "idemgate" },
        if opts.redis_url.is_some() {
            "redis"
        } else {
            "embedded"
        },
        if opts.tls { ", TLS" } else { "" },
    ));
    let through = match through {
        Through::Idemgate(label) if opts.observe && opts.redis_url.is_some() => {
            Through::Idemgate(label.replacen(')', ", 2 instances)", 1))
        }
        other => other,
    };
    let idemgate = run_day(&plan, &opts, through).await?;
    Ok(LabReport {
        seed: opts.seed,
        concurrency: opts.concurrency,
        mix: plan
            .mix()
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect(),
        direct,
        idemgate,
    })
}

enum Through {
    Direct,
    /// With the column's label.
    Idemgate(String),
}

async fn run_day(
    plan: &DayPlan,
    opts: &LabOptions,
    through: Through,
) -> Result<RunFigures, LabError> {
    let bank = Bank::new(opts.bank.clone(), plan.opening.clone());
    let pki = if opts.tls {
        Some(tls::LabPki::new().map_err(LabError::Proxy)?)
    } else {
        None
    };
    let listener = TcpListener::bind(("127.0.0.1", 0))
        .await
        .map_err(LabError::Bind)?;
    let bank_addr = listener.local_addr().map_err(LabError::Bind)?;
    let (stop_bank, bank_stopped) = tokio::sync::oneshot::channel::<()>();
    let acceptor = pki.as_ref().map(|p| p.acceptor.clone());
    let server = tokio::spawn(bank::serve_tls(listener, bank.clone(), acceptor, async {
        let _ = bank_stopped.await;
    }));

    // Observing on a shared store, the day runs through two instances, each attempt to
    // the next in turn, as a fleet in its rollout would: what they count is summed.
    let instances = if opts.observe && opts.redis_url.is_some() {
        2
    } else {
        1
    };
    let (label, targets, proxies) = match through {
        Through::Direct if opts.tls => ("direct (TLS)".to_owned(), vec![bank_addr], Vec::new()),
        Through::Direct => ("direct".to_owned(), vec![bank_addr], Vec::new()),
        Through::Idemgate(label) => {
            match start_instances(instances, bank_addr, opts, pki.as_ref()).await {
                Ok((addrs, handles)) => (label, addrs, handles),
                Err(err) => {
                    let _ = stop_bank.send(());
                    let _ = server.await;
                    return Err(LabError::Proxy(err));
                }
            }
        }
    };

    let client = lab_client(
        &targets,
        run_tag(),
        opts,
        pki.as_ref().map(|p| p.client.clone()),
    );
    let label = label.as_str();
    let progress = progress_bar(opts.progress, plan.intents.len() as u64, label);
    let started = Instant::now();
    let clients = traffic::replay(plan, &client, &progress).await;
    let wall_time = started.elapsed();
    progress.finish_and_clear();

    // In observe mode, idemgate's count is read once the bank is idle (every forwarded
    // request has its answer) and before idemgate stops (its admin listener with it).
    let mut observed_ids = None;
    if let (true, Some((running, _))) = (opts.observe, proxies.first()) {
        let _ = bank.quiesce(SETTLE_LIMIT).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        observed_ids = running.admin_addr();
    }
    // A duplicate is counted once its record says what the first execution answered,
    // which may be written after the bank is idle: the count is read once no instance
    // is still reading a duplicate's record (`duplicates_settling`), or at the limit.
    let observed_json = match observed_ids {
        Some(_) => Some(observed_counts(&proxies).await?),
        None => None,
    };
    // idemgate drains the upstream calls its clients walked away from; then the bank's own
    // abandoned requests finish, and only then is the ledger final.
    let mut lookups = None;
    if let (Some(_), Some(admin)) = (&observed_json, observed_ids) {
        let ledger = bank.snapshot();
        lookups = Some(
            observe::record_ids(admin, &ledger)
                .await
                .map_err(LabError::Proxy)?,
        );
    }
    stop_instances(proxies, opts.redis_url.is_some()).await;
    if !bank.quiesce(SETTLE_LIMIT).await {
        tracing::warn!(
            in_flight = bank.in_flight(),
            "lab: bank still busy; auditing anyway"
        );
    }
    let ledger = bank.snapshot();
    let _ = stop_bank.send(());
    if let Ok(Err(err)) = server.await {
        tracing::warn!(error = %err, "lab: bank server ended with an error");
    }

    let observed = observed_json.map(|o| observe::compare(&o, lookups.as_ref(), &ledger));
    Ok(RunFigures {
        label: label.to_owned(),
        intents: plan.intents.len() as u64,
        wall_time_secs: wall_time.as_secs_f64(),
        clients,
        audit: auditor::audit(plan, &ledger),
        observed,
    })
}

/// The clients of a day: to `targets` (the first, then each in turn), their keys under
/// `key_prefix`, patient enough for the bank's slow answers.
fn lab_client(
    targets: &[SocketAddr],
    key_prefix: String,
    opts: &LabOptions,
    tls: Option<Arc<rustls::ClientConfig>>,
) -> traffic::LabClient {
    traffic::LabClient {
        target: targets[0],
        also: targets[1..].to_vec(),
        key_prefix,
        timeout: opts.client_timeout,
        patient_timeout: opts.bank.slow_latency * 4 + Duration::from_secs(5),
        in_progress_wait_cap: Duration::from_millis(100),
        max_attempts: 10,
        concurrency: opts.concurrency,
        tls,
    }
}

/// An idemgate started by the lab, and the records it claimed.
type Instance = (crate::Running, Arc<tracked::Tracked>);

/// Starts `n` instances of idemgate in front of the bank at `bank`: their addresses and
/// handles, or (all of them stopped again) why one could not start.
async fn start_instances(
    n: usize,
    bank: SocketAddr,
    opts: &LabOptions,
    pki: Option<&tls::LabPki>,
) -> Result<(Vec<SocketAddr>, Vec<Instance>), String> {
    let mut addrs = Vec::new();
    let mut handles = Vec::new();
    for _ in 0..n {
        match start_idemgate(bank, opts.redis_url.clone(), opts.observe, pki).await {
            Ok((addr, handle)) => {
                addrs.push(addr);
                handles.push(handle);
            }
            Err(err) => {
                for (running, _) in handles {
                    running.shutdown().await;
                }
                return Err(err);
            }
        }
    }
    Ok((addrs, handles))
}

/// What observe mode counted, summed over the instances: read once no instance is still
/// reading a duplicate's record (`duplicates_settling`), or at [`SETTLE_LIMIT`].
async fn observed_counts(proxies: &[Instance]) -> Result<serde_json::Value, LabError> {
    let until = Instant::now() + SETTLE_LIMIT;
    loop {
        let mut each = Vec::new();
        for (running, _) in proxies {
            if let Some(admin) = running.admin_addr() {
                each.push(observe::fetch(admin).await.map_err(LabError::Proxy)?);
            }
        }
        let settling: u64 = each
            .iter()
            .filter_map(|o| o["duplicates_settling"].as_u64())
            .sum();
        if settling == 0 || Instant::now() > until {
            return Ok(observe::sum(&each));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Stops the instances; on someone's Redis (`shared`), deletes every record the lab
/// claimed, so that it leaves nothing behind.
async fn stop_instances(proxies: Vec<Instance>, shared: bool) {
    for (proxy, records) in proxies {
        proxy.shutdown().await;
        if shared {
            let made = records.claimed();
            let failed = records.remove_all(Duration::from_secs(2)).await;
            if failed > 0 {
                tracing::warn!(
                    made,
                    failed,
                    "lab: some of its records could not be deleted; they expire with their retention"
                );
            }
        }
    }
}

/// Starts idemgate in-process in front of the bank, with `/transfers` requiring a key (as a
/// payments team would configure it), on a store that remembers what the lab claimed.
async fn start_idemgate(
    upstream: SocketAddr,
    redis_url: Option<String>,
    observe: bool,
    pki: Option<&tls::LabPki>,
) -> Result<(SocketAddr, Instance), String> {
    let scheme = if pki.is_some() { "https" } else { "http" };
    let mut config = crate::Config::for_upstream(&format!("{scheme}://{upstream}"));
    if let Some(pki) = pki {
        config.upstream_tls_ca_file = Some(pki.ca_file());
        config.tls_cert_file = Some(pki.cert_file());
        config.tls_key_file = Some(pki.key_file());
    }
    if observe {
        // Where the lab reads what idemgate let through (loopback, no token needed).
        config.admin_listen = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    }
    if redis_url.is_some() {
        config.namespace = Some("lab".into());
    }
    config.redis_url = redis_url;
    // The lab's instances are alone on their store (its own namespace, started together):
    // none has a running sibling to wait for, so a fresh database makes its secret at once.
    config.scope_secret_create_delay = std::time::Duration::ZERO;
    // The legacy bank has no authentication, so its clients carry no tenant: they share one
    // anonymous scope (their keys are unique per intent and per run).
    config.routes.push(crate::config::Route {
        path: "/transfers".into(),
        require_key: Some(true),
        anonymous: Some(crate::config::Anonymous::Shared),
        mode: observe.then_some(crate::config::Mode::Observe),
        ..Default::default()
    });
    let mut records = None;
    let running = crate::server::start_wrapped(config, |store| {
        let tracked = Arc::new(tracked::Tracked::new(store));
        records = Some(tracked.clone());
        let store: Arc<dyn crate::store::Store> = tracked;
        store
    })
    .await
    .map_err(|e| e.to_string())?;
    let records = records.ok_or("the store was not opened")?;
    Ok((running.addr(), (running, records)))
}

/// A per-run key prefix: a Redis store outlives one lab, and a second lab with the same seed
/// must not be answered from the first one's records.
fn run_tag() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    format!("lab{:08x}-", hasher.finish() as u32)
}

fn progress_bar(enabled: bool, len: u64, label: &str) -> ProgressBar {
    if !enabled || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    if let Ok(style) =
        ProgressStyle::with_template("{prefix:>22} [{bar:40}] {pos}/{len} intents {elapsed}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_prefix(label.to_owned());
    bar
}
