//! The operator's pass at the end of a bad day, as docs/runbook.md tells it
//! (IdemgateRecordsUnknown): list the records held `unknown`, find each one's request (the
//! lab looks its keys up, as an operator does with a client's report), ask the bank's
//! ledger whether it executed, **complete** the ones that did with the bank's answer and
//! **release** the ones that did not, all through the admin API.
//!
//! Crates: `hyper`/`hyper-util` for the admin API over loopback; `serde_json` for its
//! bodies.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;

use super::bank::LedgerSnapshot;
use super::traffic::DayPlan;

/// Every admin call's deadline.
const ADMIN_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a release or completion refused as `owner-busy` is tried again before the
/// operator forces it (the owner is gone: the day has ended, the bank is idle).
const OWNER_BUSY_TRIES: u32 = 3;
/// ... this long apart.
const OWNER_BUSY_WAIT: Duration = Duration::from_millis(200);

/// What the pass found and did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PassFigures {
    /// Records held `unknown` when the pass began (`GET /records?state=unknown`).
    pub unknown_before: u64,
    /// Completed with the bank's answer: the ledger shows them executed.
    pub completed: u64,
    /// Released: the ledger shows no execution.
    pub released: u64,
    /// Held `unknown` that the pass could not settle (no intent of the day, or the admin
    /// API refused).
    pub left: u64,
}

/// One admin call: status and body.
pub(super) async fn call(
    admin: SocketAddr,
    method: Method,
    path: &str,
    body: String,
) -> Result<(StatusCode, Bytes), String> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let req = Request::builder()
        .method(method)
        .uri(format!("http://{admin}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    let exchange = async {
        let res = client.request(req).await.map_err(|e| e.to_string())?;
        let status = res.status();
        let bytes = res
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok::<_, String>((status, bytes))
    };
    match tokio::time::timeout(ADMIN_TIMEOUT, exchange).await {
        Ok(result) => result.map_err(|e| format!("admin {path}: {e}")),
        Err(_) => Err(format!("admin {path}: no answer within {ADMIN_TIMEOUT:?}")),
    }
}

async fn call_json(
    admin: SocketAddr,
    method: Method,
    path: &str,
    body: String,
) -> Result<(StatusCode, serde_json::Value), String> {
    let (status, bytes) = call(admin, method, path, body).await?;
    Ok((status, serde_json::from_slice(&bytes).unwrap_or_default()))
}

/// Whether the instance's `GET /readyz` answers 200.
pub async fn ready(admin: SocketAddr) -> bool {
    matches!(
        call(admin, Method::GET, "/readyz", String::new()).await,
        Ok((StatusCode::OK, _))
    )
}

/// The ids of the records in `state` (every page of the walk).
async fn list(admin: SocketAddr, state: &str) -> Result<BTreeSet<String>, String> {
    let mut ids = BTreeSet::new();
    let mut cursor = String::new();
    loop {
        let path = format!("/records?state={state}&count=1000&cursor={cursor}");
        let (status, page) = call_json(admin, Method::GET, &path, String::new()).await?;
        if !status.is_success() {
            return Err(format!("admin {path}: {status}: {page}"));
        }
        for record in page["records"].as_array().into_iter().flatten() {
            if let Some(id) = record["id"].as_str() {
                ids.insert(id.to_owned());
            }
        }
        match page["cursor"].as_str() {
            Some(next) if !next.is_empty() => cursor = next.to_owned(),
            _ => return Ok(ids),
        }
    }
}

/// Record id per intent (by plan position) for every intent that has a record
/// (`POST /records/lookup` with the key the clients sent).
pub async fn record_ids(
    admin: SocketAddr,
    plan: &DayPlan,
    key_prefix: &str,
) -> Result<BTreeMap<String, usize>, String> {
    let mut ids = BTreeMap::new();
    for intent in &plan.intents {
        let lookup = serde_json::json!({
            "method": "POST",
            "path": "/transfers",
            "key": format!("{key_prefix}{}", intent.key),
        });
        let (status, found) =
            call_json(admin, Method::POST, "/records/lookup", lookup.to_string()).await?;
        if !status.is_success() {
            return Err(format!("admin /records/lookup: {status}: {found}"));
        }
        if let (Some(id), false) = (found["id"].as_str(), found["state"].is_null()) {
            ids.insert(id.to_owned(), intent.seq);
        }
    }
    Ok(ids)
}

/// The pass: settles every record held `unknown` by the bank's ledger.
pub async fn operator_pass(
    admin: SocketAddr,
    plan: &DayPlan,
    key_prefix: &str,
    ledger: &LedgerSnapshot,
) -> Result<PassFigures, String> {
    let unknown = list(admin, "unknown").await?;
    let mut figures = PassFigures {
        unknown_before: unknown.len() as u64,
        ..PassFigures::default()
    };
    if unknown.is_empty() {
        return Ok(figures);
    }
    let ids = record_ids(admin, plan, key_prefix).await?;
    // The ledger's row per key: the first execution is the one the client paid for.
    let mut executed: BTreeMap<&str, &super::bank::TransferRow> = BTreeMap::new();
    for row in &ledger.transfers {
        if let Some(key) = row.idempotency_key.as_deref() {
            executed.entry(key).or_insert(row);
        }
    }
    for id in &unknown {
        let Some(&seq) = ids.get(id) else {
            figures.left += 1;
            continue;
        };
        let key = format!("{key_prefix}{}", plan.intents[seq].key);
        let settled = match executed.get(key.as_str()) {
            Some(row) => {
                // The answer the bank gave for this transfer, from its ledger.
                let answer = serde_json::json!({
                    "id": row.id, "from": row.from, "to": row.to, "amount": row.amount,
                });
                let outcome = serde_json::json!({
                    "status": 201,
                    "headers": {"content-type": "application/json"},
                    "body": answer.to_string(),
                });
                let path = format!(
                    "/records/{id}/complete?reason=lab+operator%3A+the+bank%27s+ledger+holds+the+transfer+{}",
                    row.id
                );
                settle(admin, Method::POST, &path, outcome.to_string()).await
            }
            None => {
                settle(
                    admin,
                    Method::DELETE,
                    &format!("/records/{id}?reason=lab+operator%3A+the+bank%27s+ledger+holds+no+transfer+of+this+key"),
                    String::new(),
                )
                .await
            }
        };
        match (settled, executed.contains_key(key.as_str())) {
            (Ok(()), true) => figures.completed += 1,
            (Ok(()), false) => figures.released += 1,
            (Err(err), _) => {
                tracing::warn!(error = %err, record = %id, "lab: the operator's pass could not settle a record");
                figures.left += 1;
            }
        }
    }
    Ok(figures)
}

/// One release or completion; an `owner-busy` refusal is tried again after the time it
/// names, then forced (the day is over: no owner is still waiting for the bank).
async fn settle(admin: SocketAddr, method: Method, path: &str, body: String) -> Result<(), String> {
    for attempt in 0..=OWNER_BUSY_TRIES {
        let path = if attempt == OWNER_BUSY_TRIES {
            format!("{path}&force=true")
        } else {
            path.to_owned()
        };
        let (status, answer) = call_json(admin, method.clone(), &path, body.clone()).await?;
        if status.is_success() {
            return Ok(());
        }
        let busy = status == StatusCode::CONFLICT
            && answer["type"]
                .as_str()
                .is_some_and(|t| t.ends_with("owner-busy"));
        if !busy {
            return Err(format!("admin {path}: {status}: {answer}"));
        }
        tokio::time::sleep(OWNER_BUSY_WAIT).await;
    }
    Err(format!("admin {path}: the owner stayed busy"))
}

/// Deletes the records of `ids` (a lab on someone's Redis leaves nothing behind). Returns
/// how many could not be deleted.
pub async fn remove(admin: SocketAddr, ids: impl IntoIterator<Item = String>) -> usize {
    let mut failed = 0;
    for id in ids {
        let path = format!(
            "/records/{id}?force=true&completed=true&reason=lab+clean-up%3A+its+records+leave+nothing+behind"
        );
        match call(admin, Method::DELETE, &path, String::new()).await {
            Ok((status, _)) if status.is_success() || status == StatusCode::NOT_FOUND => {}
            _ => failed += 1,
        }
    }
    failed
}
