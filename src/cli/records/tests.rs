use super::*;

#[test]
fn durations_are_short() {
    assert_eq!(short(850), "850ms");
    assert_eq!(short(12_000), "12s");
    assert_eq!(short(200_000), "3m20s");
    assert_eq!(short(5 * 3_600_000 + 120_000), "5h2m");
    assert_eq!(short(2 * 86_400_000 + 3 * 3_600_000), "2d3h");
}

#[test]
fn the_table_is_aligned() {
    let records = vec![
        json!({"id": "a", "state": "unknown", "created_ms": 1_000, "ttl_ms": 86_400_000, "status": null, "owner_busy_ms": 500}),
        json!({"id": "bbbb", "state": "completed", "created_ms": 1_000, "ttl_ms": 5_000, "status": 201}),
    ];
    let t = table(&records, 61_000);
    let lines: Vec<&str> = t.lines().collect();
    assert_eq!(lines.len(), 3);
    assert!(
        lines[0].starts_with("ID    STATE      STATUS  AGE   TTL   BUSY"),
        "{t}"
    );
    assert!(
        lines[1].starts_with("a     unknown    -       1m0s  1d0h  owner 500ms"),
        "{t}"
    );
    assert!(
        lines[2].starts_with("bbbb  completed  201     1m0s  5s    -"),
        "{t}"
    );
}

#[test]
fn headers_are_name_colon_value() {
    assert_eq!(
        parse_header("Authorization: Bearer x").unwrap(),
        ("Authorization".into(), "Bearer x".into())
    );
    assert!(parse_header("nothing").is_err());
    assert!(parse_header(": v").is_err());
}

#[test]
fn a_record_shows_its_namespace_or_that_it_has_none() {
    let mine = json!({"id": "a", "state": "completed", "created_ms": 1_000, "namespace": "alpha"});
    assert!(record_block(&mine, 2_000).contains("namespace            alpha\n"));
    let older = json!({"id": "a", "state": "completed", "created_ms": 1_000, "namespace": null});
    let block = record_block(&older, 2_000);
    assert!(
        block.contains("namespace            - (written without one"),
        "{block}"
    );
    let redis = json!({"id": "a", "state": "completed", "created_ms": 1_000});
    assert!(!record_block(&redis, 2_000).contains("namespace"));
}
