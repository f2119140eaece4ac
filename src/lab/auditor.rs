//! The auditor: what the ledger says happened against what the day's intents meant.
//!
//! It needs no cooperation from the clients or the proxy: the bank writes the
//! `Idempotency-Key` header into every ledger row, so executions per key are counted from the
//! ledger alone, and the expected balances follow from the intents alone.
//!
//! Crates: `serde` to export the figures; everything else is the standard library.

use std::collections::BTreeMap;

use serde::Serialize;

use super::bank::LedgerSnapshot;
use super::traffic::DayPlan;

/// What the auditor found in one bank's ledger.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Audit {
    /// Ledger rows: transfers the bank executed.
    pub executions: u64,
    /// Executions the day called for: one per intent that should succeed.
    pub expected_executions: u64,
    /// Keys executed more than once.
    pub keys_executed_twice: u64,
    /// Executions beyond the first for the same key: each one is a double transfer.
    pub double_transfers: u64,
    /// Sum of the amounts of those extra executions, in minor units.
    pub money_moved_twice: i64,
    /// Ledger rows without an `Idempotency-Key`; they cannot be checked per key, only through
    /// the balances. Every lab request carries a key, so this should stay 0.
    pub unkeyed_executions: u64,
    /// Accounts whose balance differs from what the intents imply.
    pub balance_mismatches: u64,
    /// Sum over accounts of |actual - expected|, in minor units.
    pub balance_error: i64,
}

/// Balances the day implies: opening balances plus each intent that should succeed, applied
/// once with its first amount. A teller's corrected amount is never applied.
pub fn expected_balances(plan: &DayPlan) -> BTreeMap<String, i64> {
    let mut balances = plan.opening.clone();
    for intent in plan.intents.iter().filter(|i| i.should_succeed) {
        *balances.entry(intent.from.clone()).or_default() -= intent.amount;
        *balances.entry(intent.to.clone()).or_default() += intent.amount;
    }
    balances
}

/// Audits a ledger against the plan it was meant to follow.
pub fn audit(plan: &DayPlan, ledger: &LedgerSnapshot) -> Audit {
    let mut report = Audit {
        executions: ledger.transfers.len() as u64,
        expected_executions: plan.intents.iter().filter(|i| i.should_succeed).count() as u64,
        ..Audit::default()
    };

    // Ledger order: the first execution of a key is the legitimate one, the rest are extra.
    let mut seen: BTreeMap<&str, u64> = BTreeMap::new();
    for row in &ledger.transfers {
        let Some(key) = row.idempotency_key.as_deref() else {
            report.unkeyed_executions += 1;
            continue;
        };
        let count = seen.entry(key).or_default();
        *count += 1;
        if *count > 1 {
            report.double_transfers += 1;
            report.money_moved_twice += row.amount;
        }
        if *count == 2 {
            report.keys_executed_twice += 1;
        }
    }

    let expected = expected_balances(plan);
    let accounts: std::collections::BTreeSet<&String> =
        expected.keys().chain(ledger.accounts.keys()).collect();
    for account in accounts {
        let want = expected.get(account).copied().unwrap_or(0);
        let got = ledger.accounts.get(account).copied().unwrap_or(0);
        if want != got {
            report.balance_mismatches += 1;
            report.balance_error += (got - want).abs();
        }
    }
    report
}

#[cfg(test)]
mod tests {
    use super::super::bank::TransferRow;
    use super::super::traffic::{Behaviour, Intent};
    use super::*;

    fn intent(seq: usize, from: &str, to: &str, amount: i64, behaviour: Behaviour) -> Intent {
        Intent {
            seq,
            at_ms: seq as u32,
            key: format!("k{seq}"),
            from: from.to_owned(),
            to: to.to_owned(),
            amount,
            behaviour,
            should_succeed: from != "empty",
        }
    }

    fn row(id: u64, from: &str, to: &str, amount: i64, key: &str) -> TransferRow {
        TransferRow {
            id,
            from: from.to_owned(),
            to: to.to_owned(),
            amount,
            idempotency_key: Some(key.to_owned()),
        }
    }

    fn plan() -> DayPlan {
        DayPlan {
            seed: 0,
            opening: BTreeMap::from([
                ("a".to_owned(), 1_000),
                ("b".to_owned(), 1_000),
                ("empty".to_owned(), 0),
            ]),
            intents: vec![
                intent(0, "a", "b", 100, Behaviour::Plain),
                intent(
                    1,
                    "b",
                    "a",
                    30,
                    Behaviour::TellerCorrection {
                        corrected_amount: 40,
                    },
                ),
                intent(2, "empty", "a", 5, Behaviour::TimeoutRetry),
            ],
        }
    }

    fn ledger(rows: Vec<TransferRow>, a: i64, b: i64) -> LedgerSnapshot {
        LedgerSnapshot {
            accounts: BTreeMap::from([
                ("a".to_owned(), a),
                ("b".to_owned(), b),
                ("empty".to_owned(), 0),
            ]),
            transfers: rows,
        }
    }

    #[test]
    fn expected_balances_apply_each_first_amount_once() {
        let expected = expected_balances(&plan());
        assert_eq!(expected["a"], 930);
        assert_eq!(expected["b"], 1_070);
        assert_eq!(expected["empty"], 0);
    }

    #[test]
    fn a_clean_ledger_passes() {
        let rows = vec![row(1, "a", "b", 100, "k0"), row(2, "b", "a", 30, "k1")];
        let audit = audit(&plan(), &ledger(rows, 930, 1_070));
        assert_eq!(
            audit,
            Audit {
                executions: 2,
                expected_executions: 2,
                ..Audit::default()
            }
        );
    }

    #[test]
    fn a_retry_that_executed_again_is_a_double_transfer() {
        let rows = vec![
            row(1, "a", "b", 100, "k0"),
            row(2, "b", "a", 30, "k1"),
            row(3, "a", "b", 100, "k0"),
            row(4, "a", "b", 100, "k0"),
        ];
        let audit = audit(&plan(), &ledger(rows, 730, 1_270));
        assert_eq!(audit.executions, 4);
        assert_eq!(audit.keys_executed_twice, 1);
        assert_eq!(audit.double_transfers, 2);
        assert_eq!(audit.money_moved_twice, 200);
        assert_eq!(audit.balance_mismatches, 2);
        assert_eq!(audit.balance_error, 400);
    }

    #[test]
    fn an_executed_correction_is_a_double_transfer_and_a_mismatch() {
        let rows = vec![
            row(1, "a", "b", 100, "k0"),
            row(2, "b", "a", 30, "k1"),
            row(3, "b", "a", 40, "k1"),
        ];
        let audit = audit(&plan(), &ledger(rows, 970, 1_030));
        assert_eq!(audit.double_transfers, 1);
        assert_eq!(audit.money_moved_twice, 40);
        assert_eq!(audit.balance_mismatches, 2);
    }

    #[test]
    fn a_missing_execution_is_a_mismatch_without_a_double_transfer() {
        let rows = vec![row(1, "a", "b", 100, "k0")];
        let audit = audit(&plan(), &ledger(rows, 900, 1_100));
        assert_eq!(audit.double_transfers, 0);
        assert_eq!(audit.balance_mismatches, 2);
        assert_eq!(audit.executions, 1);
        assert_eq!(audit.expected_executions, 2);
    }

    #[test]
    fn rows_without_a_key_are_counted_apart() {
        let mut rows = vec![row(1, "a", "b", 100, "k0"), row(2, "b", "a", 30, "k1")];
        rows.push(TransferRow {
            idempotency_key: None,
            ..row(3, "a", "b", 100, "")
        });
        let audit = audit(&plan(), &ledger(rows, 830, 1_170));
        assert_eq!(audit.unkeyed_executions, 1);
        assert_eq!(audit.double_transfers, 0);
        assert_eq!(audit.balance_mismatches, 2);
    }
}
