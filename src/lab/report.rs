//! The lab's verdict: figures per run, the table, the summary line and the JSON.
//!
//! Crates: `serde`/`serde_json` for `--json`; the table is plain `format!`, aligned by hand,
//! so its columns stay readable in a CI log.

use serde::Serialize;

use super::auditor::Audit;
use super::traffic::ClientTally;

/// Everything measured in one run of the day.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RunFigures {
    /// What the run was: `direct` or `idemgate (embedded)` / `idemgate (redis)`.
    pub label: String,
    pub intents: u64,
    /// Seconds from the first request to the last answer.
    pub wall_time_secs: f64,
    /// What the clients saw.
    pub clients: ClientTally,
    /// What the auditor found in the bank's ledger.
    pub audit: Audit,
    /// Observe mode: idemgate's count of duplicates it let through, and how many keys'
    /// counts differ from the auditor's double transfers for that key.
    pub observed: Option<Observed>,
}

/// What idemgate said it let through in observe mode, against the auditor.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Observed {
    /// `duplicates_let_through` from `GET /observe`.
    pub duplicates_let_through: u64,
    /// The ledger's executions of a transfer (its key and its body) beyond its first: the
    /// double transfers less the corrections sent under their first key, which idemgate
    /// counts as mismatches, not duplicates.
    pub repeated_transfers: u64,
    /// Keys whose repeated transfers (ledger) and duplicates let through (idemgate) differ.
    pub keys_disagreeing: u64,
}

/// Both runs of the same day.
#[derive(Debug, Clone, PartialEq)]
pub struct LabReport {
    pub seed: u64,
    pub concurrency: usize,
    /// Intents per behaviour.
    pub mix: Vec<(String, usize)>,
    /// Clients straight to a fresh bank.
    pub direct: RunFigures,
    /// The same clients through idemgate to another fresh bank.
    pub idemgate: RunFigures,
}

impl LabReport {
    /// The lab proves its point: the direct run shows double transfers, and through idemgate
    /// there are none, every balance is right, and no teller correction was answered with a
    /// replay of the old transfer.
    pub fn passed(&self) -> bool {
        let through = &self.idemgate;
        // Observe mode changes nothing about the traffic, so the bank behind idemgate shows
        // double transfers too: the lab passes when idemgate counted exactly those, in
        // total and key by key.
        if let Some(o) = through.observed {
            return self.direct.audit.double_transfers > 0
                && through.audit.double_transfers > 0
                && o.duplicates_let_through == o.repeated_transfers
                && o.keys_disagreeing == 0;
        }
        self.direct.audit.double_transfers > 0
            && through.audit.double_transfers == 0
            && through.audit.balance_mismatches == 0
            && through.clients.silent_replays == 0
    }

    /// `lab: direct double_transfers=N; idemgate double_transfers=M balance_mismatches=K`.
    pub fn summary_line(&self) -> String {
        if let Some(o) = self.idemgate.observed {
            return format!(
                "lab: direct double_transfers={}; observed double_transfers={} repeated_transfers={} duplicates_let_through={} keys_disagreeing={}",
                self.direct.audit.double_transfers,
                self.idemgate.audit.double_transfers,
                o.repeated_transfers,
                o.duplicates_let_through,
                o.keys_disagreeing,
            );
        }
        format!(
            "lab: direct double_transfers={}; idemgate double_transfers={} balance_mismatches={}",
            self.direct.audit.double_transfers,
            self.idemgate.audit.double_transfers,
            self.idemgate.audit.balance_mismatches,
        )
    }

    /// The rows of the table: a name and, per run, the value in the table's unit (money
    /// in major units, time in seconds). The table and the JSON both come from these, so
    /// they cannot drift apart.
    pub(super) fn rows(&self) -> Vec<(&'static str, [Cell; 2])> {
        let runs = [&self.direct, &self.idemgate];
        let n = |f: fn(&RunFigures) -> u64| runs.map(|r| Cell::Count(f(r)));
        vec![
            ("intents", n(|r| r.intents)),
            ("requests sent", n(|r| r.clients.requests_sent)),
            ("retries", n(|r| r.clients.retries)),
            ("client timeouts", n(|r| r.clients.timeouts)),
            ("hang-ups", n(|r| r.clients.hang_ups)),
            ("replayed answers", n(|r| r.clients.replays)),
            ("executions", n(|r| r.audit.executions)),
            ("expected executions", n(|r| r.audit.expected_executions)),
            ("double transfers", n(|r| r.audit.double_transfers)),
            (
                "money moved twice",
                runs.map(|r| Cell::Money(r.audit.money_moved_twice)),
            ),
            ("balance mismatches", n(|r| r.audit.balance_mismatches)),
            (
                "corrections executed",
                n(|r| r.clients.corrections_executed),
            ),
            ("corrections replayed", n(|r| r.clients.silent_replays)),
            ("409/422 from the bank", n(|r| r.clients.bank_409_422)),
            (
                "409 in-progress (idemgate)",
                n(|r| r.clients.idemgate_409_in_progress),
            ),
            (
                "422 mismatch (idemgate)",
                n(|r| r.clients.idemgate_422_mismatch),
            ),
            (
                "other errors",
                n(|r| r.clients.idemgate_other_errors + r.clients.other_errors),
            ),
            ("unresolved intents", n(|r| r.clients.unresolved)),
            ("wall time", runs.map(|r| Cell::Seconds(r.wall_time_secs))),
        ]
        .into_iter()
        .chain(self.idemgate.observed.is_some().then(|| {
            (
                "repeated transfers",
                runs.map(|r| Cell::Count(r.observed.map_or(0, |o| o.repeated_transfers))),
            )
        }))
        .chain(self.idemgate.observed.is_some().then(|| {
            (
                "duplicates let through",
                runs.map(|r| Cell::Count(r.observed.map_or(0, |o| o.duplicates_let_through))),
            )
        }))
        .chain(self.idemgate.observed.is_some().then(|| {
            (
                "keys disagreeing",
                runs.map(|r| Cell::Count(r.observed.map_or(0, |o| o.keys_disagreeing))),
            )
        }))
        .collect()
    }

    /// An aligned text table, one column per run.
    pub fn table(&self) -> String {
        table_of([&self.direct.label, &self.idemgate.label], self.rows())
    }

    /// The same figures as JSON, plus the verdict.
    pub fn to_json(&self) -> String {
        // Serializing plain numbers and strings cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_default()
    }
}

/// An aligned text table of `rows`, one column per run, headed by the runs' labels.
pub(super) fn table_of(labels: [&str; 2], rows: Vec<(&str, [Cell; 2])>) -> String {
    let rows: Vec<(&str, [String; 2])> = rows
        .into_iter()
        .map(|(name, cells)| (name, cells.map(|c| c.text())))
        .collect();
    let name_width = rows.iter().map(|(name, _)| name.len()).max().unwrap_or(0);
    let col_width = rows
        .iter()
        .flat_map(|(_, cells)| cells.iter().map(String::len))
        .chain(labels.iter().map(|l| l.len()))
        .max()
        .unwrap_or(0);
    let mut out = format!(
        "{:name_width$}  {:>col_width$}  {:>col_width$}\n",
        "", labels[0], labels[1]
    );
    for (name, [a, b]) in rows {
        out.push_str(&format!(
            "{name:name_width$}  {a:>col_width$}  {b:>col_width$}\n"
        ));
    }
    out
}

/// The runs of `rows` as JSON objects under the rows' names, each with its `label`.
pub(super) fn runs_json(
    labels: [&str; 2],
    rows: Vec<(&str, [Cell; 2])>,
) -> [serde_json::Map<String, serde_json::Value>; 2] {
    let mut runs = labels.map(|label| {
        let mut m = serde_json::Map::new();
        m.insert("label".into(), label.into());
        m
    });
    for (name, cells) in rows {
        for (run, cell) in runs.iter_mut().zip(cells) {
            run.insert(name.into(), cell.json());
        }
    }
    runs
}

/// One figure of the table, in the table's unit.
#[derive(Clone)]
pub(super) enum Cell {
    Count(u64),
    /// Minor units (cents), shown in major units.
    Money(i64),
    Seconds(f64),
    /// A ratio, shown as `0.97x`.
    Ratio(f64),
    /// Words: when incidents happened, or why a figure does not apply.
    Text(String),
}

impl Cell {
    fn text(self) -> String {
        match self {
            Cell::Count(n) => n.to_string(),
            Cell::Money(minor) => money(minor),
            Cell::Seconds(s) => format!("{s:.2} s"),
            Cell::Ratio(r) => format!("{r:.2}x"),
            Cell::Text(t) => t,
        }
    }

    /// The JSON value: what the table shows, without the unit.
    fn json(self) -> serde_json::Value {
        match self {
            Cell::Count(n) => n.into(),
            Cell::Money(minor) => (minor as f64 / 100.0).into(),
            Cell::Seconds(s) => ((s * 100.0).round() / 100.0).into(),
            Cell::Ratio(r) => ((r * 100.0).round() / 100.0).into(),
            Cell::Text(t) => t.into(),
        }
    }
}

impl Serialize for LabReport {
    /// `{"seed", "concurrency", "mix", "units", "direct": {"label", <row>: <number>...},
    /// "idemgate": {...}, "passed", "summary"}`: each run under the table's row names.
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Wire<'a> {
            seed: u64,
            concurrency: usize,
            mix: std::collections::BTreeMap<&'a str, usize>,
            units: serde_json::Value,
            direct: serde_json::Map<String, serde_json::Value>,
            idemgate: serde_json::Map<String, serde_json::Value>,
            passed: bool,
            summary: String,
        }
        let runs = runs_json([&self.direct.label, &self.idemgate.label], self.rows());
        let [direct, idemgate] = runs;
        Wire {
            seed: self.seed,
            concurrency: self.concurrency,
            mix: self.mix.iter().map(|(k, v)| (k.as_str(), *v)).collect(),
            units: serde_json::json!({
                "money moved twice": "major currency units",
                "wall time": "seconds",
            }),
            direct,
            idemgate,
            passed: self.passed(),
            summary: self.summary_line(),
        }
        .serialize(serializer)
    }
}

/// Minor units as major units with two decimals: `123456` -> `1234.56`.
fn money(minor: i64) -> String {
    let sign = if minor < 0 { "-" } else { "" };
    let abs = minor.unsigned_abs();
    format!("{sign}{}.{:02}", abs / 100, abs % 100)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(direct_doubles: u64, through_doubles: u64, mismatches: u64) -> LabReport {
        let figures = |label: &str, doubles: u64, mismatches: u64| RunFigures {
            label: label.to_owned(),
            intents: 10,
            wall_time_secs: 1.5,
            clients: ClientTally::default(),
            observed: None,
            audit: Audit {
                double_transfers: doubles,
                balance_mismatches: mismatches,
                money_moved_twice: 12_345,
                ..Audit::default()
            },
        };
        LabReport {
            seed: 1,
            concurrency: 4,
            mix: vec![("plain".to_owned(), 10)],
            direct: figures("direct", direct_doubles, 7),
            idemgate: figures("idemgate (embedded)", through_doubles, mismatches),
        }
    }

    #[test]
    fn the_summary_line_has_the_agreed_shape() {
        assert_eq!(
            report(12, 0, 0).summary_line(),
            "lab: direct double_transfers=12; idemgate double_transfers=0 balance_mismatches=0"
        );
    }

    #[test]
    fn passing_needs_the_problem_shown_and_fixed() {
        assert!(report(12, 0, 0).passed());
        assert!(
            !report(0, 0, 0).passed(),
            "the direct run must show the problem"
        );
        assert!(!report(12, 1, 0).passed());
        assert!(!report(12, 0, 1).passed());
        let mut replayed = report(12, 0, 0);
        replayed.idemgate.clients.silent_replays = 1;
        assert!(!replayed.passed());
    }

    #[test]
    fn the_table_has_one_aligned_column_per_run() {
        let table = report(12, 0, 0).table();
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[0].trim_end().ends_with("idemgate (embedded)"));
        assert!(lines.iter().all(|l| l.len() == lines[0].len()), "{table}");
        assert!(table.contains("money moved twice"));
        assert!(table.contains("123.45"));
    }

    #[test]
    fn the_json_carries_the_figures_and_the_verdict() {
        let value: serde_json::Value =
            serde_json::from_str(&report(3, 0, 0).to_json()).expect("json");
        assert_eq!(value["direct"]["double transfers"], 3);
        assert_eq!(value["idemgate"]["balance mismatches"], 0);
        assert_eq!(value["passed"], true);
        assert_eq!(value["direct"]["label"], "direct");
    }

    #[test]
    fn the_json_uses_the_tables_names_and_units() {
        let r = report(3, 0, 0);
        let value: serde_json::Value = serde_json::from_str(&r.to_json()).expect("json");
        let table = r.table();
        let names: Vec<&str> = table
            .lines()
            .skip(1)
            .map(|l| l.split("  ").next().unwrap_or_default().trim_end())
            .collect();
        let run = value["direct"].as_object().expect("object");
        // Every row of the table, and nothing else but the label.
        assert_eq!(run.len(), names.len() + 1, "{table}\n{value}");
        for name in &names {
            assert!(run.contains_key(*name), "{name} missing: {value}");
        }
        // The table's units: 12345 cents are 123.45, 1.5 s is 1.5.
        assert_eq!(value["direct"]["money moved twice"], 123.45);
        assert!(table.contains("123.45"));
        assert_eq!(value["direct"]["wall time"], 1.5);
        assert_eq!(value["units"]["wall time"], "seconds");
    }

    #[test]
    fn money_is_shown_in_major_units() {
        assert_eq!(money(0), "0.00");
        assert_eq!(money(5), "0.05");
        assert_eq!(money(123_456), "1234.56");
        assert_eq!(money(-1_050), "-10.50");
    }
}
