//! `idemgate lab --bad-day`: the same day, with incidents, an operator's pass, and a verdict.
//!
//! The day runs twice as in [`super::run_lab`], straight at a bank and through idemgate,
//! and both runs meet the same [`Schedule`] of incidents at the same moments. After the
//! day, in idemgate's run, the operator settles the records held `unknown`
//! ([`super::reconcile`]); then, in both runs, every client still without its final answer
//! retries one last time. The auditor reads the ledger after that.
//!
//! Crates: `tokio` for the incidents' tasks; `serde_json` for `--json`.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::bank::{Bank, CloseAfterAnswer};
use super::fleet::{self, Fleet};
use super::incidents::{self, Event, Schedule};
use super::outages::BankServer;
use super::reconcile::{self, PassFigures};
use super::report::{runs_json, table_of, Cell, LabReport, RunFigures};
use super::traffic::{self, DayHooks, DayPlan, IntentOutcome, Style};
use super::{auditor, LabError, LabOptions};

/// Intents in a bad day unless told: its incidents, the pass and the last retries make
/// each intent cost more than on a good day.
pub const DEFAULT_INTENTS: usize = 1_000;

/// The storm's goodput must stay at least this share of the goodput just before it.
pub const STORM_GOODPUT_FLOOR: f64 = 0.9;

/// How long the bank takes for each intent of the storm and of the stretch before it, in
/// idemgate's run: with [`super::bank::TELLERS`] tellers, the bank then does at most
/// `TELLERS / WINDOW_LATENCY` transfers a second (20/s), fewer than the day's clients ask,
/// so both stretches measure the bank's capacity and what idemgate keeps of it.
pub const WINDOW_LATENCY: Duration = Duration::from_millis(100);

/// What one run of the bad day adds to the good day's figures.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct BadDayFigures {
    /// Incidents that happened in this run, by kind.
    pub bank_restarts: u32,
    pub bank_crashes: u32,
    pub instance_kills: u32,
    pub store_freezes: u32,
    pub store_restarts: u32,
    /// Intents without their final answer when the day ended: the clients retry each one
    /// last time after the operator's pass.
    pub unanswered_at_end: u64,
    /// The operator's pass (idemgate's run only).
    pub pass: Option<PassFigures>,
    /// Intents still without their final answer after the pass and the clients' last
    /// retries (one for each intent unanswered at the day's end).
    pub unresolved_after_pass: u64,
    /// Payments that should have run and never did (no execution in the ledger at the end).
    pub stranded: u64,
    /// Distinct intents finished with their final answer per wall second, just before the
    /// storm and during it, with the bank's tellers the bottleneck (idemgate's run only:
    /// straight at the bank every storm copy executes, see [`goodput`]).
    pub goodput_before_storm: f64,
    pub goodput_in_storm: f64,
}

impl BadDayFigures {
    /// Goodput in the storm over goodput just before it.
    pub fn storm_ratio(&self) -> f64 {
        if self.goodput_before_storm > 0.0 {
            self.goodput_in_storm / self.goodput_before_storm
        } else {
            0.0
        }
    }
}

/// Both runs of the bad day.
#[derive(Debug, Clone)]
pub struct BadDayReport {
    /// The good day's figures of both runs (same rows as `idemgate lab`).
    pub lab: LabReport,
    pub schedule: Schedule,
    pub intents: usize,
    pub direct: BadDayFigures,
    pub idemgate: BadDayFigures,
    /// Incidents the lab did not inject into this configuration, and why.
    pub not_injected: Vec<(&'static str, &'static str)>,
}

impl BadDayReport {
    /// The verdict: the direct run shows double transfers; idemgate's run has none, no
    /// balance mismatch, no replayed correction, nothing stranded, nothing unresolved after
    /// the operator's pass, and the storm kept its goodput.
    pub fn passed(&self) -> bool {
        let (direct, through) = (&self.lab.direct, &self.lab.idemgate);
        direct.audit.double_transfers > 0
            && through.audit.double_transfers == 0
            && through.audit.balance_mismatches == 0
            && through.clients.silent_replays == 0
            && self.idemgate.stranded == 0
            && self.idemgate.unresolved_after_pass == 0
            && self.idemgate.storm_ratio() >= STORM_GOODPUT_FLOOR
    }

    /// Every figure the verdict reads, in one line.
    pub fn summary_line(&self) -> String {
        let (direct, through) = (&self.lab.direct, &self.lab.idemgate);
        let skipped = if self.not_injected.is_empty() {
            String::new()
        } else {
            let names: Vec<&str> = self.not_injected.iter().map(|(n, _)| *n).collect();
            format!(" not_injected={}", names.join(","))
        };
        format!(
            "bad day: direct double_transfers={}; idemgate double_transfers={} balance_mismatches={} corrections_replayed={} stranded={} unresolved_after_pass={} storm_goodput={:.2}x (floor {STORM_GOODPUT_FLOOR:.2}x){skipped} -> {}",
            direct.audit.double_transfers,
            through.audit.double_transfers,
            through.audit.balance_mismatches,
            through.clients.silent_replays,
            self.idemgate.stranded,
            self.idemgate.unresolved_after_pass,
            self.idemgate.storm_ratio(),
            if self.passed() { "passed" } else { "FAILED" },
        )
    }

    fn rows(&self) -> Vec<(&'static str, [Cell; 2])> {
        let n = self.intents;
        let when = |event: Event, ran: [u32; 2]| {
            let at: Vec<String> = self
                .schedule
                .moments(event, n)
                .iter()
                .map(|p| format!("{p}%"))
                .collect();
            ran.map(|count| {
                if count == 0 {
                    Cell::Text("-".into())
                } else {
                    Cell::Text(format!("{count} at {}", at.join(" ")))
                }
            })
        };
        let stretch = |range: &std::ops::Range<usize>| {
            let text = format!(
                "{}-{}%",
                incidents::percent(range.start, n),
                incidents::percent(range.end, n)
            );
            [Cell::Text(text.clone()), Cell::Text(text)]
        };
        let runs = [&self.direct, &self.idemgate];
        let count = |f: fn(&BadDayFigures) -> u64| runs.map(|r| Cell::Count(f(r)));
        let pass = |f: fn(&PassFigures) -> u64| {
            runs.map(|r| match &r.pass {
                Some(p) => Cell::Count(f(p)),
                None => Cell::Text("-".into()),
            })
        };
        // The storm's goodput is measured in idemgate's run only (see `goodput`).
        let measured = |f: fn(&BadDayFigures) -> Cell| {
            runs.map(|r| {
                if r.goodput_before_storm > 0.0 {
                    f(r)
                } else {
                    Cell::Text("-".into())
                }
            })
        };
        let mut rows = self.lab.rows();
        rows.extend([
            (
                "bank restarts (graceful)",
                when(Event::BankRestart, runs.map(|r| r.bank_restarts)),
            ),
            (
                "bank crashes",
                when(Event::BankCrash, runs.map(|r| r.bank_crashes)),
            ),
            (
                "bank closes after answer",
                stretch(&self.schedule.close_announced),
            ),
            (
                "... without saying so",
                stretch(&self.schedule.close_silent),
            ),
            (
                "idemgate instance killed",
                when(Event::InstanceKill, runs.map(|r| r.instance_kills)),
            ),
            (
                "store frozen 2 s",
                when(Event::StoreFreeze, runs.map(|r| r.store_freezes)),
            ),
            (
                "store restarted (AOF)",
                when(Event::StoreRestart, runs.map(|r| r.store_restarts)),
            ),
            ("retry storm (16x)", stretch(&self.schedule.storm)),
            ("slow clients", stretch(&self.schedule.slow_clients)),
            ("unanswered at day's end", count(|r| r.unanswered_at_end)),
            ("held unknown before pass", pass(|p| p.unknown_before)),
            ("completed by the pass", pass(|p| p.completed)),
            ("released by the pass", pass(|p| p.released)),
            ("left unknown by the pass", pass(|p| p.left)),
            (
                "unresolved after the pass",
                count(|r| r.unresolved_after_pass),
            ),
            ("stranded", count(|r| r.stranded)),
            (
                "goodput before storm",
                measured(|r| Cell::Text(format!("{:.0}/s", r.goodput_before_storm))),
            ),
            (
                "goodput in storm",
                measured(|r| Cell::Text(format!("{:.0}/s", r.goodput_in_storm))),
            ),
            (
                "storm goodput ratio",
                measured(|r| Cell::Ratio(r.storm_ratio())),
            ),
        ]);
        rows
    }

    /// The table: today's rows, then the bad day's, then what was not injected and why.
    pub fn table(&self) -> String {
        let labels = [
            self.lab.direct.label.as_str(),
            self.lab.idemgate.label.as_str(),
        ];
        let mut out = table_of(labels, self.rows());
        for (what, why) in &self.not_injected {
            out.push_str(&format!("not injected: {what}: {why}\n"));
        }
        out
    }

    /// The figures as JSON, under the table's row names, with the verdict.
    pub fn to_json(&self) -> String {
        let labels = [
            self.lab.direct.label.as_str(),
            self.lab.idemgate.label.as_str(),
        ];
        let [direct, idemgate] = runs_json(labels, self.rows());
        let value = serde_json::json!({
            "seed": self.lab.seed,
            "intents": self.intents,
            "concurrency": self.lab.concurrency,
            "direct": direct,
            "idemgate": idemgate,
            "not_injected": self.not_injected.iter().map(|(what, why)| serde_json::json!({"incident": what, "why": why})).collect::<Vec<_>>(),
            "passed": self.passed(),
            "summary": self.summary_line(),
        });
        serde_json::to_string_pretty(&value).unwrap_or_default()
    }
}

/// Runs the bad day directly and through idemgate.
pub async fn run_bad_day(opts: LabOptions) -> Result<BadDayReport, LabError> {
    if opts.tls {
        return Err(LabError::Options(
            "--bad-day does not run over TLS: its idemgate instances are started without certificates".into(),
        ));
    }
    if opts.observe {
        return Err(LabError::Options(
            "--bad-day with --mode observe: observe forwards every duplicate, so the bad day's verdict (0 double transfers) cannot hold; run --mode observe without --bad-day".into(),
        ));
    }
    if opts.intents < 100 || opts.concurrency == 0 {
        return Err(LabError::Options(
            "--bad-day needs at least 100 intents (its incidents are spread over the day) and 1 client".into(),
        ));
    }
    let plan = DayPlan::generate(opts.intents, opts.seed);
    let schedule = Schedule::generate(opts.intents, opts.seed);
    let (direct, direct_bad) = run(&plan, &schedule, &opts, false).await?;
    let (idemgate, idemgate_bad) = run(&plan, &schedule, &opts, true).await?;
    let mut not_injected = vec![];
    if opts.redis_url.is_none() && !opts.redis_server {
        not_injected.push((
            "instance_kill",
            "the embedded store lives in the instance's memory: a killed instance takes its records along (docs/guarantees.md); use --redis-url for two instances on a shared store, one killed",
        ));
    }
    if !opts.redis_server {
        not_injected.push((
            "store_restart",
            if opts.redis_url.is_some() {
                "the lab does not restart a Redis it did not start (and without persistence a restart loses records, docs/production.md); the store is frozen instead (in the lab's relay); --redis-server starts one with persistence on and restarts it"
            } else {
                "the embedded store does not survive a restart (its records are in memory); the store is frozen instead"
            },
        ));
    }
    Ok(BadDayReport {
        lab: LabReport {
            seed: opts.seed,
            concurrency: opts.concurrency,
            mix: plan
                .mix()
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v))
                .collect(),
            direct,
            idemgate,
        },
        schedule,
        intents: opts.intents,
        direct: direct_bad,
        idemgate: idemgate_bad,
        not_injected,
    })
}

/// The incidents of one run, fired as the clients reach them.
struct Incidents {
    schedule: Schedule,
    bank: Bank,
    server: Arc<BankServer>,
    fleet: Option<Arc<tokio::sync::Mutex<Fleet>>>,
    can_kill: bool,
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    restarts: Arc<AtomicU32>,
    crashes: Arc<AtomicU32>,
    kills: Arc<AtomicU32>,
    freezes: Arc<AtomicU32>,
    store_restarts: Arc<AtomicU32>,
}

impl Incidents {
    /// The incidents of `schedule`, none happened yet.
    fn new(
        schedule: &Schedule,
        bank: &Bank,
        server: &Arc<BankServer>,
        fleet: Option<Arc<tokio::sync::Mutex<Fleet>>>,
        can_kill: bool,
    ) -> Incidents {
        Incidents {
            schedule: schedule.clone(),
            bank: bank.clone(),
            server: server.clone(),
            fleet,
            can_kill,
            tasks: Mutex::new(Vec::new()),
            restarts: Arc::default(),
            crashes: Arc::default(),
            kills: Arc::default(),
            freezes: Arc::default(),
            store_restarts: Arc::default(),
        }
    }

    fn spawn(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        if let Ok(mut tasks) = self.tasks.lock() {
            tasks.push(tokio::spawn(task));
        }
    }

    /// Waits for every incident's task to end.
    async fn finish(&self) {
        let tasks = self
            .tasks
            .lock()
            .map(|mut t| std::mem::take(&mut *t))
            .unwrap_or_default();
        for task in tasks {
            let _ = task.await;
        }
        self.bank.set_close_after_answer(CloseAfterAnswer::Never);
    }
}

impl DayHooks for Incidents {
    fn reached(&self, seq: usize) {
        for (_, event) in self.schedule.events.iter().filter(|(s, _)| *s == seq) {
            match *event {
                Event::BankRestart => {
                    let (server, n) = (self.server.clone(), self.restarts.clone());
                    self.spawn(async move {
                        if server.restart_gracefully().await.is_ok() {
                            n.fetch_add(1, Ordering::SeqCst);
                        }
                    });
                }
                Event::BankCrash => {
                    let (server, n) = (self.server.clone(), self.crashes.clone());
                    self.spawn(async move {
                        if server.crash().await.is_ok() {
                            n.fetch_add(1, Ordering::SeqCst);
                        }
                    });
                }
                Event::CloseAfterAnswer(mode) => self.bank.set_close_after_answer(mode),
                Event::InstanceKill => {
                    if let (Some(fleet), true) = (self.fleet.clone(), self.can_kill) {
                        let n = self.kills.clone();
                        self.spawn(async move {
                            match fleet.lock().await.kill_and_replace().await {
                                Ok(()) => {
                                    n.fetch_add(1, Ordering::SeqCst);
                                }
                                Err(err) => {
                                    tracing::warn!(error = %err, "lab: kill and replace failed")
                                }
                            }
                        });
                    }
                }
                Event::StoreRestart => {
                    if let Some(fleet) = self.fleet.clone() {
                        let n = self.store_restarts.clone();
                        self.spawn(async move {
                            match fleet.lock().await.restart_store().await {
                                Ok(true) => {
                                    n.fetch_add(1, Ordering::SeqCst);
                                }
                                Ok(false) => {}
                                Err(err) => {
                                    tracing::warn!(error = %err, "lab: store restart failed")
                                }
                            }
                        });
                    }
                }
                Event::StoreFreeze => {
                    if let Some(fleet) = self.fleet.clone() {
                        let n = self.freezes.clone();
                        self.spawn(async move {
                            fleet.lock().await.freeze(true);
                            n.fetch_add(1, Ordering::SeqCst);
                            tokio::time::sleep(incidents::FREEZE).await;
                            fleet.lock().await.freeze(false);
                        });
                    }
                }
            }
        }
    }

    fn latency(&self, seq: usize) -> Option<Duration> {
        // In idemgate's run, the storm and the stretch before it go through the bank's
        // tellers, each transfer taking as long.
        let window =
            self.schedule.storm.contains(&seq) || self.schedule.before_storm.contains(&seq);
        (window && self.fleet.is_some()).then_some(WINDOW_LATENCY)
    }

    fn style(&self, seq: usize) -> Style {
        if self.schedule.storm.contains(&seq) {
            Style::Storm
        } else if self.schedule.before_storm.contains(&seq) {
            Style::Steady
        } else if self.schedule.slow_clients.contains(&seq) {
            Style::SlowReader
        } else {
            Style::Normal
        }
    }
}

/// Whether the debug-only test hook says to skip the operator's pass, so that a test can
/// show the verdict failing when the records held `unknown` are never settled.
fn skip_pass() -> bool {
    cfg!(debug_assertions) && std::env::var("TEST_IDEMGATE_LAB_SKIP_PASS").is_ok_and(|v| v == "1")
}

/// The fleet of idemgate instances in front of the bank, on the store `opts` names, and
/// its column's label.
async fn start_fleet(
    opts: &LabOptions,
    server: &BankServer,
) -> Result<(&'static str, Fleet), String> {
    let fleet = match &opts.redis_url {
        Some(url) => Fleet::redis(server.addr(), url, "lab").await,
        None if opts.redis_server => Fleet::redis_server(server.addr(), "lab").await,
        None => Fleet::embedded(server.addr()).await,
    }?;
    let label = if opts.redis_url.is_some() {
        "idemgate (redis, 2 instances)"
    } else if opts.redis_server {
        "idemgate (redis-server, AOF, 2 instances)"
    } else {
        "idemgate (embedded)"
    };
    Ok((label, fleet))
}

/// The operator's pass over the records held `unknown`, once a killed instance's leases
/// have run out (so that they read `unknown` as an operator finds them).
async fn operator_pass(
    admin: std::net::SocketAddr,
    bank: &Bank,
    plan: &DayPlan,
    key_prefix: &str,
) -> Result<PassFigures, LabError> {
    tokio::time::sleep(fleet::LEASE + Duration::from_millis(500)).await;
    if skip_pass() {
        return Ok(PassFigures::default());
    }
    let ledger = bank.snapshot();
    reconcile::operator_pass(admin, plan, key_prefix, &ledger)
        .await
        .map_err(LabError::Proxy)
}

/// Intents that should have succeeded and that the bank never executed.
fn stranded(plan: &DayPlan, ledger: &super::LedgerSnapshot, key_prefix: &str) -> u64 {
    let executed: BTreeSet<&str> = ledger
        .transfers
        .iter()
        .filter_map(|r| r.idempotency_key.as_deref())
        .collect();
    plan.intents
        .iter()
        .filter(|i| i.should_succeed)
        .filter(|i| !executed.contains(format!("{key_prefix}{}", i.key).as_str()))
        .count() as u64
}

/// Deletes every record of the day through the admin API.
async fn remove_records(admin: std::net::SocketAddr, plan: &DayPlan, key_prefix: &str) {
    match reconcile::record_ids(admin, plan, key_prefix).await {
        Ok(ids) => {
            let failed = reconcile::remove(admin, ids.into_keys()).await;
            if failed > 0 {
                tracing::warn!(failed, "lab: some of its records could not be deleted; they expire with their retention");
            }
        }
        Err(err) => {
            tracing::warn!(error = %err, "lab: could not list its records to delete them")
        }
    }
}

async fn run(
    plan: &DayPlan,
    schedule: &Schedule,
    opts: &LabOptions,
    through: bool,
) -> Result<(RunFigures, BadDayFigures), LabError> {
    let bank = Bank::new(opts.bank.clone(), plan.opening.clone());
    let server = Arc::new(
        BankServer::start(bank.clone(), None)
            .await
            .map_err(LabError::Bind)?,
    );
    let key_prefix = super::run_tag();
    let (label, fleet) = if through {
        match start_fleet(opts, &server).await {
            Ok((label, fleet)) => (label, Some(fleet)),
            Err(err) => {
                server.stop().await;
                return Err(LabError::Proxy(err));
            }
        }
    } else {
        ("direct", None)
    };
    let targets = match &fleet {
        Some(f) => f.targets(),
        None => vec![server.addr()],
    };
    let admin = fleet.as_ref().and_then(Fleet::admin);
    let can_kill = fleet.as_ref().is_some_and(Fleet::can_kill);
    let fleet = fleet.map(|f| Arc::new(tokio::sync::Mutex::new(f)));
    let client = super::lab_client(&targets, key_prefix.clone(), opts, None);
    let hooks = Incidents::new(schedule, &bank, &server, fleet.clone(), can_kill);
    let progress = super::progress_bar(opts.progress, plan.intents.len() as u64, label);
    let started = Instant::now();
    let (clients, outcomes) = traffic::replay_day(plan, &client, &progress, &hooks).await;
    let wall_time = started.elapsed();
    progress.finish_and_clear();
    hooks.finish().await;

    // The day is over: the bank finishes what it was given, and the leases of a killed
    // instance's records run out, so they read `unknown` as an operator finds them.
    let _ = bank.quiesce(super::SETTLE_LIMIT).await;
    let pass = match admin {
        Some(admin) => Some(operator_pass(admin, &bank, plan, &key_prefix).await?),
        None => None,
    };

    // The clients' last retries: every intent still without its final answer.
    let unanswered: Vec<usize> = outcomes
        .iter()
        .enumerate()
        .filter(|(_, o)| !o.answered)
        .map(|(seq, _)| seq)
        .collect();
    let (_, answered_now) = traffic::last_retries(plan, &client, &unanswered).await;
    let unresolved_after_pass = answered_now.iter().filter(|a| !**a).count() as u64;

    if !bank.quiesce(super::SETTLE_LIMIT).await {
        tracing::warn!(
            in_flight = bank.in_flight(),
            "lab: bank still busy; auditing anyway"
        );
    }
    let ledger = bank.snapshot();
    let stranded = stranded(plan, &ledger, &key_prefix);
    // A lab on someone's Redis leaves nothing behind.
    if let (Some(admin), true) = (admin, opts.redis_url.is_some()) {
        remove_records(admin, plan, &key_prefix).await;
    }
    if let Some(fleet) = fleet {
        fleet.lock().await.shutdown().await;
    }
    server.stop().await;

    let figures = RunFigures {
        label: label.to_owned(),
        intents: plan.intents.len() as u64,
        wall_time_secs: wall_time.as_secs_f64(),
        clients,
        audit: auditor::audit(plan, &ledger),
        observed: None,
    };
    let bad = BadDayFigures {
        bank_restarts: hooks.restarts.load(Ordering::SeqCst),
        bank_crashes: hooks.crashes.load(Ordering::SeqCst),
        instance_kills: hooks.kills.load(Ordering::SeqCst),
        store_freezes: hooks.freezes.load(Ordering::SeqCst),
        store_restarts: hooks.store_restarts.load(Ordering::SeqCst),
        unanswered_at_end: unanswered.len() as u64,
        pass,
        unresolved_after_pass,
        stranded,
        goodput_before_storm: if through {
            goodput(&outcomes, &schedule.before_storm)
        } else {
            0.0
        },
        goodput_in_storm: if through {
            goodput(&outcomes, &schedule.storm)
        } else {
            0.0
        },
    };
    Ok((figures, bad))
}

/// Distinct intents of `window` finished with their final answer, per wall second, over
/// the middle half of their answers: the intents answered between the window's first and
/// third quartile of answer times, over the time between those two answers. Each intent
/// of the window waits for one of the bank's tellers (see [`WINDOW_LATENCY`]), so the
/// bank's capacity sets the pace: before the storm the clients keep every teller busy; in
/// it, what idemgate keeps of that pace (one copy per intent reaching the bank, the others
/// shed or told to wait) is what the figure shows. The middle half leaves out both ends: at
/// the start the window's first intents queue behind the last ones before it (the tellers
/// serve in order), and at the end a few intents that met a retry's backoff would stretch
/// a short window's span by themselves. Straight at the bank every copy would hold a
/// teller: the direct run is not measured.
fn goodput(outcomes: &[IntentOutcome], window: &std::ops::Range<usize>) -> f64 {
    let Some(these) = outcomes.get(window.clone()) else {
        return 0.0;
    };
    let mut ends: Vec<std::time::Instant> = these
        .iter()
        .filter(|o| o.answered)
        .map(|o| o.ended)
        .collect();
    ends.sort();
    let (q1, q3) = (ends.len() / 4, ends.len() * 3 / 4);
    if q3 <= q1 || q3 >= ends.len() {
        return 0.0;
    }
    let span = ends[q3].saturating_duration_since(ends[q1]).as_secs_f64();
    if span <= 0.0 {
        return 0.0;
    }
    (q3 - q1) as f64 / span
}
