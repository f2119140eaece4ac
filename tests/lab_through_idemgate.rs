//! The lab's claim: through idemgate, the same day moves every amount exactly once.
//!
//! Crates: `tokio` runs the lab's servers and clients in the test's runtime.

#![allow(clippy::unwrap_used)]

use idemgate::lab::{run_lab, LabOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_idemgate_nothing_moves_twice() {
    let report = run_lab(LabOptions::small()).await.expect("lab runs");
    let through = &report.idemgate;
    let table = report.table();
    assert!(report.direct.audit.double_transfers > 0, "{table}");
    assert_eq!(through.audit.double_transfers, 0, "{table}");
    assert_eq!(through.audit.money_moved_twice, 0, "{table}");
    assert_eq!(through.audit.balance_mismatches, 0, "{table}");
    assert_eq!(
        through.audit.executions, through.audit.expected_executions,
        "{table}"
    );
    assert_eq!(through.audit.unkeyed_executions, 0, "{table}");
    // Every teller correction was refused by idemgate, none executed or replayed.
    assert_eq!(through.clients.corrections_executed, 0, "{table}");
    assert_eq!(through.clients.silent_replays, 0, "{table}");
    assert!(through.clients.idemgate_422_mismatch > 0, "{table}");
    // Retries were answered from the record.
    assert!(through.clients.replays > 0, "{table}");
    assert_eq!(through.clients.unresolved, 0, "{table}");
    assert!(report.passed(), "{table}");
    assert_eq!(
        report.summary_line(),
        format!(
            "lab: direct double_transfers={}; idemgate double_transfers=0 balance_mismatches=0",
            report.direct.audit.double_transfers
        )
    );
}

/// `idemgate lab --tls`: the same day end to end over TLS (clients to idemgate's TLS
/// listener, idemgate to an HTTPS bank, certificates made for the run) moves nothing twice.
/// The bank speaks TLS only, so any part that did not would get no answer and leave
/// intents unresolved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_nothing_moves_twice() {
    let opts = LabOptions {
        tls: true,
        ..LabOptions::small()
    };
    let report = run_lab(opts).await.expect("lab runs");
    let table = report.table();
    assert_eq!(report.direct.label, "direct (TLS)", "{table}");
    assert_eq!(report.idemgate.label, "idemgate (embedded, TLS)", "{table}");
    assert!(report.direct.audit.double_transfers > 0, "{table}");
    assert_eq!(report.idemgate.audit.double_transfers, 0, "{table}");
    assert_eq!(report.idemgate.audit.balance_mismatches, 0, "{table}");
    assert!(report.idemgate.clients.replays > 0, "{table}");
    assert_eq!(report.idemgate.clients.unresolved, 0, "{table}");
    assert_eq!(report.direct.clients.unresolved, 0, "{table}");
    assert!(report.passed(), "{table}");
}

use crate::common;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_idemgate_on_redis_nothing_moves_twice() {
    let redis = common::RedisServer::start();
    let opts = LabOptions {
        redis_url: Some(redis.url()),
        ..LabOptions::small()
    };
    let report = run_lab(opts).await.expect("lab runs");
    let table = report.table();
    assert!(report.direct.audit.double_transfers > 0, "{table}");
    assert_eq!(report.idemgate.audit.double_transfers, 0, "{table}");
    assert_eq!(report.idemgate.audit.balance_mismatches, 0, "{table}");
    assert_eq!(report.idemgate.clients.corrections_executed, 0, "{table}");
    assert!(report.passed(), "{table}");
    assert!(report.idemgate.label.contains("redis"), "{table}");
    // It went through Redis, and left nothing behind in it.
    let info = redis.command(&["INFO", "stats"]).unwrap();
    let written: u64 = info
        .lines()
        .find_map(|l| l.strip_prefix("total_commands_processed:"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap();
    assert!(written > 200, "{info}");
    // No record stays. What may: the store's record-id secret (other services on this Redis
    // share it) and the lab namespace's verifier of it, and the expiring note of a claim taken back after its client hung up
    // before the claim had landed.
    let reply = redis.command(&["KEYS", "*"]).unwrap();
    let keys: Vec<&str> = reply
        .split("\r\n")
        .filter(|l| !l.is_empty() && !l.starts_with('*') && !l.starts_with('$'))
        .collect();
    assert!(
        keys.contains(&idemgate::store::redis::SECRET_KEY),
        "{keys:?}"
    );
    for key in keys {
        // A withdrawal note is a record key that holds no record (no `st` field).
        let note = key.starts_with("idemgate:{")
            && redis
                .command(&["HEXISTS", key, "st"])
                .is_some_and(|r| r.starts_with(":0"));
        assert!(
            key == idemgate::store::redis::SECRET_KEY
                || key == "idemgate:scope-verifier:lab"
                || note,
            "left behind: {key}"
        );
    }
}

/// `--mode observe`: the traffic is unchanged (the bank behind idemgate shows double
/// transfers too), and idemgate's count of duplicates it let through equals the ledger's
/// repeated transfers (the double transfers less the corrections executed under their
/// first key, which are mismatches), in total and key by key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observed_the_day_is_unchanged_and_its_duplicates_are_counted_exactly() {
    for redis in [None, Some(common::RedisServer::start())] {
        let opts = LabOptions {
            observe: true,
            redis_url: redis.as_ref().map(|r| r.url()),
            ..LabOptions::small()
        };
        let report = run_lab(opts).await.expect("lab runs");
        let table = report.table();
        let through = &report.idemgate;
        assert!(through.audit.double_transfers > 0, "{table}");
        // On a shared store the day goes through two instances, each attempt to the next:
        // what they count from the store, summed, is the ledger's.
        assert_eq!(
            through.label.contains("2 instances"),
            redis.is_some(),
            "{table}"
        );
        let observed = through.observed.expect("observed figures");
        assert_eq!(
            observed.duplicates_let_through, observed.repeated_transfers,
            "{table}"
        );
        assert!(
            observed.repeated_transfers <= through.audit.double_transfers,
            "{table}"
        );
        assert_eq!(observed.keys_disagreeing, 0, "{table}");
        assert_eq!(through.clients.replays, 0, "observe never replays: {table}");
        assert!(report.passed(), "{table}");
        assert!(report.to_json().contains("\"duplicates let through\""));
    }
}
