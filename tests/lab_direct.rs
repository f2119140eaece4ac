//! The lab end to end at a small size: the direct run must reproduce the problem.
//!
//! Crates: `tokio` runs the lab's servers and clients in the test's runtime.

use idemgate::lab::{run_lab, LabOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_direct_run_moves_money_twice() {
    let report = run_lab(LabOptions::small()).await.expect("lab runs");
    let direct = &report.direct;
    assert_eq!(direct.intents, 200);
    assert!(direct.audit.double_transfers > 0, "{}", report.table());
    assert!(direct.audit.money_moved_twice > 0, "{}", report.table());
    assert!(direct.audit.balance_mismatches > 0, "{}", report.table());
    assert!(
        direct.clients.corrections_executed > 0,
        "a teller's correction reaches a bank that cannot refuse it:\n{}",
        report.table()
    );
    assert!(direct.clients.bank_409_422 > 0, "{}", report.table());
    assert_eq!(direct.clients.unresolved, 0, "{}", report.table());
    assert!(direct.audit.executions > direct.audit.expected_executions);
    assert!(report.summary_line().starts_with(&format!(
        "lab: direct double_transfers={}; idemgate double_transfers=",
        direct.audit.double_transfers
    )));
}

#[tokio::test]
async fn a_client_timeout_longer_than_the_slow_tail_is_refused() {
    let mut opts = LabOptions::small();
    opts.client_timeout = opts.bank.slow_latency;
    assert!(run_lab(opts).await.is_err());
}
