//! Observe mode in the lab: what idemgate says it let through, against the auditor.
//!
//! idemgate counts, per record, the duplicates it let through, by what the record said of
//! executions of the same request before them (`GET /observe?records=1`); the ledger
//! shows, per key, the executions of each transfer (its accounts and amount) beyond its
//! first. A correction sent under its first key is a double transfer in the ledger but a
//! mismatch to idemgate, never a duplicate. The lab maps each key the ledger executed twice to its record id
//! with the operator API's lookup (`POST /records/lookup`), as an operator would, and the
//! two counts must agree key by key and in total.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use hyper::Method;

use super::bank::LedgerSnapshot;
use super::report::Observed;

async fn call(
    admin: SocketAddr,
    method: Method,
    path: &str,
    body: String,
) -> Result<serde_json::Value, String> {
    let (status, bytes) = super::reconcile::call(admin, method, path, body).await?;
    if !status.is_success() {
        return Err(format!(
            "admin {path}: {status}: {}",
            String::from_utf8_lossy(&bytes)
        ));
    }
    serde_json::from_slice(&bytes).map_err(|e| format!("admin {path}: {e}"))
}

/// `GET /observe?records=1`.
pub async fn fetch(admin: SocketAddr) -> Result<serde_json::Value, String> {
    call(admin, Method::GET, "/observe?records=1", String::new()).await
}

/// What several instances' `GET /observe?records=1` say together: their duplicates
/// summed per route (as one route list) and per record.
pub fn sum(each: &[serde_json::Value]) -> serde_json::Value {
    let mut duplicates: u64 = 0;
    let mut records = serde_json::Map::new();
    for one in each {
        duplicates += one["routes"]
            .as_array()
            .map(|r| {
                r.iter()
                    .filter_map(|r| r["duplicates_let_through"].as_u64())
                    .sum::<u64>()
            })
            .unwrap_or(0);
        if let Some(m) = one["records"].as_object() {
            for (id, n) in m {
                let was = records.get(id).and_then(|v| v.as_u64()).unwrap_or(0);
                records.insert(id.clone(), (was + n.as_u64().unwrap_or(0)).into());
            }
        }
    }
    serde_json::json!({
        "routes": [{"duplicates_let_through": duplicates}],
        "records": records,
    })
}

/// The record id of every key the ledger executed more than once.
pub async fn record_ids(
    admin: SocketAddr,
    ledger: &LedgerSnapshot,
) -> Result<BTreeMap<String, String>, String> {
    let mut ids = BTreeMap::new();
    for key in executions_per_key(ledger)
        .into_iter()
        .filter(|(_, n)| *n > 1)
        .map(|(k, _)| k)
    {
        let body = serde_json::json!({"method": "POST", "path": "/transfers", "key": key});
        let found = call(admin, Method::POST, "/records/lookup", body.to_string()).await?;
        let id = found["id"]
            .as_str()
            .ok_or_else(|| format!("lookup of {key}: no id in {found}"))?;
        ids.insert(key, id.to_owned());
    }
    Ok(ids)
}

fn executions_per_key(ledger: &LedgerSnapshot) -> BTreeMap<String, u64> {
    let mut per_key = BTreeMap::new();
    for row in &ledger.transfers {
        if let Some(k) = &row.idempotency_key {
            *per_key.entry(k.clone()).or_default() += 1;
        }
    }
    per_key
}

/// Per key, the executions of each of its transfers (the same accounts and amount) beyond
/// that transfer's first.
fn repeats_per_key(ledger: &LedgerSnapshot) -> BTreeMap<String, u64> {
    let mut per_transfer: BTreeMap<(&str, &str, &str, i64), u64> = BTreeMap::new();
    for row in &ledger.transfers {
        if let Some(k) = &row.idempotency_key {
            let transfer = (k.as_str(), row.from.as_str(), row.to.as_str(), row.amount);
            *per_transfer.entry(transfer).or_default() += 1;
        }
    }
    let mut per_key = BTreeMap::new();
    for ((key, ..), n) in per_transfer {
        *per_key.entry(key.to_string()).or_default() += n - 1;
    }
    per_key
}

/// idemgate's figures against the ledger's.
pub fn compare(
    observed: &serde_json::Value,
    ids: Option<&BTreeMap<String, String>>,
    ledger: &LedgerSnapshot,
) -> Observed {
    let duplicates_let_through = observed["routes"]
        .as_array()
        .map(|routes| {
            routes
                .iter()
                .filter_map(|r| r["duplicates_let_through"].as_u64())
                .sum()
        })
        .unwrap_or(0);
    let records = observed["records"].as_object();
    let duplicates = |id: &str| {
        records
            .and_then(|m| m.get(id))
            .and_then(|n| n.as_u64())
            .unwrap_or(0)
    };
    let mut keys_disagreeing = 0;
    let mut matched = std::collections::BTreeSet::new();
    let repeats = repeats_per_key(ledger);
    if let Some(ids) = ids {
        for (key, repeated) in &repeats {
            let Some(id) = ids.get(key) else {
                keys_disagreeing += u64::from(*repeated > 0);
                continue;
            };
            matched.insert(id.clone());
            if duplicates(id) != *repeated {
                keys_disagreeing += 1;
            }
        }
    }
    // Records idemgate says ran twice that the ledger does not show twice.
    if let Some(m) = records {
        keys_disagreeing += m
            .iter()
            .filter(|(id, n)| !matched.contains(*id) && n.as_u64().unwrap_or(0) > 0)
            .count() as u64;
    }
    Observed {
        duplicates_let_through,
        repeated_transfers: repeats.values().sum(),
        keys_disagreeing,
    }
}
