use super::*;
use crate::store::Store;

#[test]
fn label_arrays_follow_declaration_order() {
    for (i, o) in OUTCOMES.iter().enumerate() {
        assert_eq!(*o as usize, i, "{o:?}");
    }
    for (i, o) in STORE_OPS.iter().enumerate() {
        assert_eq!(*o as usize, i, "{o:?}");
    }
    // A new variant fails to compile here until it is added to the arrays above.
    let _exhaustive = |o: Outcome| match o {
        Outcome::Forwarded
        | Outcome::Replayed
        | Outcome::InProgress
        | Outcome::Mismatch
        | Outcome::Unprotected
        | Outcome::Passthrough
        | Outcome::Rejected
        | Outcome::StoreError
        | Outcome::UpstreamError
        | Outcome::Ambiguous
        | Outcome::NotStored
        | Outcome::Overloaded
        | Outcome::Released
        | Outcome::Observed => (),
    };
}

#[test]
fn every_series_is_exported_from_the_start() {
    let text = Metrics::new().encode();
    for o in OUTCOMES {
        let line = format!(
            "idemgate_requests_total{{route=\"default\",outcome=\"{}\"}} 0\n",
            o.as_str()
        );
        assert!(text.contains(&line), "{line}");
    }
    for class in STATUS_CLASSES {
        let line = format!("idemgate_answers_recorded_total{{status_class=\"{class}\"}} 0\n");
        assert!(text.contains(&line), "{line}");
    }
    for op in STORE_OPS {
        let line = format!("idemgate_store_errors_total{{op=\"{}\"}} 0\n", op.as_str());
        assert!(text.contains(&line), "{line}");
    }
    for name in [
        "idemgate_records_held_unknown 0",
        "idemgate_records_unknown_total 0",
        "idemgate_redis_evicted_keys 0",
        "idemgate_redis_restarts_total 0",
        "# TYPE idemgate_upstream_duration_seconds histogram",
    ] {
        assert!(text.contains(name), "{name}");
    }
    assert!(text.ends_with("# EOF\n"));
}

#[tokio::test]
async fn timed_out_calls_count_as_errors_and_cancelled_ones_do_not() {
    let metrics = Arc::new(Metrics::new());
    let store: Arc<dyn Store> = Arc::new(crate::store::MemoryStore::new(10));
    let slow = Instrumented::new(store, metrics.clone(), Duration::from_millis(20));
    // Dropped before its deadline: not an error.
    drop(slow.ping());
    // Finished: timed, not an error.
    slow.ping().await.unwrap();
    let text = metrics.encode();
    assert!(text.contains("idemgate_store_errors_total{op=\"ping\"} 0\n"));
    assert!(text.contains("idemgate_store_duration_seconds_count{op=\"ping\"} 1\n"));
    // Dropped after its deadline (as `store::deadline` does): an error.
    let call = slow.ping();
    tokio::time::sleep(Duration::from_millis(25)).await;
    drop(call);
    let text = metrics.encode();
    assert!(text.contains("idemgate_store_errors_total{op=\"ping\"} 1\n"));
}
