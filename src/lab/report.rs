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
        self.direct.audit.double_transfers > 0
            && through.audit.double_transfers == 0
            && through.audit.balance_mismatches == 0
            && through.clients.silent_replays == 0
    }

    /// `lab: direct double_transfers=N; idemgate double_transfers=M balance_mismatches=K`.
    pub fn summary_line(&self) -> String {
        format!(
            "lab: direct double_transfers={}; idemgate double_transfers={} balance_mismatches={}",
            self.direct.audit.double_transfers,
            self.idemgate.audit.double_transfers,
            self.idemgate.audit.balance_mismatches,
        )
    }

    /// An aligned text table, one column per run.
    pub fn table(&self) -> String {
        let runs = [&self.direct, &self.idemgate];
        let rows: Vec<(&str, [String; 2])> = vec![
            ("intents", runs.map(|r| r.intents.to_string())),
            (
                "requests sent",
                runs.map(|r| r.clients.requests_sent.to_string()),
            ),
            ("retries", runs.map(|r| r.clients.retries.to_string())),
            (
                "client timeouts",
                runs.map(|r| r.clients.timeouts.to_string()),
            ),
            ("hang-ups", runs.map(|r| r.clients.hang_ups.to_string())),
            (
                "replayed answers",
                runs.map(|r| r.clients.replays.to_string()),
            ),
            ("executions", runs.map(|r| r.audit.executions.to_string())),
            (
                "expected executions",
                runs.map(|r| r.audit.expected_executions.to_string()),
            ),
            (
                "double transfers",
                runs.map(|r| r.audit.double_transfers.to_string()),
            ),
            (
                "money moved twice",
                runs.map(|r| money(r.audit.money_moved_twice)),
            ),
            (
                "balance mismatches",
                runs.map(|r| r.audit.balance_mismatches.to_string()),
            ),
            (
                "corrections executed",
                runs.map(|r| r.clients.corrections_executed.to_string()),
            ),
            (
                "corrections replayed",
                runs.map(|r| r.clients.silent_replays.to_string()),
            ),
            (
                "409/422 from the bank",
                runs.map(|r| r.clients.bank_409_422.to_string()),
            ),
            (
                "409 in-progress (idemgate)",
                runs.map(|r| r.clients.idemgate_409_in_progress.to_string()),
            ),
            (
                "422 mismatch (idemgate)",
                runs.map(|r| r.clients.idemgate_422_mismatch.to_string()),
            ),
            (
                "other errors",
                runs.map(|r| {
                    (r.clients.idemgate_other_errors + r.clients.other_errors).to_string()
                }),
            ),
            (
                "unresolved intents",
                runs.map(|r| r.clients.unresolved.to_string()),
            ),
            (
                "wall time",
                runs.map(|r| format!("{:.2} s", r.wall_time_secs)),
            ),
        ];
        let name_width = rows.iter().map(|(name, _)| name.len()).max().unwrap_or(0);
        let col_width = rows
            .iter()
            .flat_map(|(_, cells)| cells.iter().map(String::len))
            .chain(runs.iter().map(|r| r.label.len()))
            .max()
            .unwrap_or(0);
        let mut out = format!(
            "{:name_width$}  {:>col_width$}  {:>col_width$}\n",
            "", self.direct.label, self.idemgate.label
        );
        for (name, [a, b]) in rows {
            out.push_str(&format!(
                "{name:name_width$}  {a:>col_width$}  {b:>col_width$}\n"
            ));
        }
        out
    }

    /// The same figures as JSON, plus the verdict.
    pub fn to_json(&self) -> String {
        // Serializing plain numbers and strings cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_default()
    }
}

impl Serialize for LabReport {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Wire<'a> {
            seed: u64,
            concurrency: usize,
            mix: std::collections::BTreeMap<&'a str, usize>,
            direct: &'a RunFigures,
            idemgate: &'a RunFigures,
            passed: bool,
            summary: String,
        }
        Wire {
            seed: self.seed,
            concurrency: self.concurrency,
            mix: self.mix.iter().map(|(k, v)| (k.as_str(), *v)).collect(),
            direct: &self.direct,
            idemgate: &self.idemgate,
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
        assert_eq!(value["direct"]["audit"]["double_transfers"], 3);
        assert_eq!(value["idemgate"]["audit"]["balance_mismatches"], 0);
        assert_eq!(value["passed"], true);
    }

    #[test]
    fn money_is_shown_in_major_units() {
        assert_eq!(money(0), "0.00");
        assert_eq!(money(5), "0.05");
        assert_eq!(money(123_456), "1234.56");
        assert_eq!(money(-1_050), "-10.50");
    }
}
