//! One record as `records show` and `lookup` print it: a line per field.

use serde_json::Value;

use super::{age, ms_field, text};

/// One record as `name  value` lines.
pub(super) fn record_block(v: &Value, now_ms: u64) -> String {
    let mut lines = vec![
        ("id", text(&v["id"])),
        ("state", text(&v["state"])),
        ("status", text(&v["status"])),
        ("age", age(v, now_ms)),
        ("created_ms", text(&v["created_ms"])),
        ("ttl", ms_field(v, "ttl_ms")),
        ("lease_left", ms_field(v, "lease_left_ms")),
        ("owner_busy", ms_field(v, "owner_busy_ms")),
        ("fingerprint", text(&v["fingerprint"])),
        ("fingerprint_version", text(&v["fingerprint_version"])),
    ];
    // On the SQL stores: `null` is a record written by a version that kept no namespace.
    if let Some(ns) = v.get("namespace") {
        let ns = ns.as_str().map_or_else(
            || "- (written without one: every namespace sees it)".to_string(),
            str::to_string,
        );
        lines.push(("namespace", ns));
    }
    if !v["body_kept"].is_null() {
        lines.push(("body_kept", text(&v["body_kept"])));
    }
    if !v["body"].is_null() {
        lines.push(("body", text(&v["body"])));
    }
    let width = lines.iter().map(|(n, _)| n.len()).max().unwrap_or(0);
    lines
        .iter()
        .map(|(n, value)| format!("{n:<width$}  {value}\n"))
        .collect()
}
