//! The admin listener: `GET /healthz`, `GET /readyz`, `GET /metrics`, `GET /records/{id}`
//! and `DELETE /records/{id}`. Loopback by default; it can release records, so keep it
//! private, and set `admin_token` when it is not on loopback: then every endpoint but the
//! probes (`/healthz`, `/readyz`) wants `Authorization: Bearer <token>`. The probes are open
//! so that a plain `httpGet` probe can use them; they say up or not, nothing else (the
//! store's error only to a caller with the token).

use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::header::{HeaderValue, AUTHORIZATION, CONTENT_TYPE, WWW_AUTHENTICATE};
use hyper::{Method, Request, Response, StatusCode};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::body::{self, Body};
use crate::config::Secret;
use crate::key::RecordId;
use crate::metrics::{self, Metrics};
use crate::problem::Problem;
use crate::store::{deadline, Deleted, RecordState, RecordView, Store};

/// The admin service.
#[derive(Clone)]
pub struct Admin {
    store: Arc<dyn Store>,
    store_timeout: Duration,
    metrics: Arc<Metrics>,
    // SHA-256 of the token: comparing digests takes the same time whatever the length or
    // content of what a caller sends.
    token: Option<[u8; 32]>,
}

impl Admin {
    /// Builds it over the proxy's store and metrics.
    pub fn new(
        store: Arc<dyn Store>,
        store_timeout: Duration,
        metrics: Arc<Metrics>,
        token: Option<Secret>,
    ) -> Admin {
        Admin {
            store,
            store_timeout,
            metrics,
            token: token.map(|t| Sha256::digest(t.expose().as_bytes()).into()),
        }
    }

    /// Whether the request carries the admin token (always, when none is configured).
    fn authorized(&self, req: &Request<Incoming>) -> bool {
        let Some(want) = &self.token else {
            return true;
        };
        let Some(given) = req
            .headers()
            .get(AUTHORIZATION)
            .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
        else {
            return false;
        };
        let given: [u8; 32] = Sha256::digest(given).into();
        given.ct_eq(want).into()
    }

    /// Handles one admin request.
    pub async fn handle(&self, req: Request<Incoming>) -> Response<Body> {
        let authorized = self.authorized(&req);
        let probe = matches!(req.uri().path(), "/healthz" | "/readyz");
        if !probe && !authorized {
            let mut res = text(StatusCode::UNAUTHORIZED, "admin token required\n");
            res.headers_mut()
                .insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            return res;
        }
        let path = req.uri().path().to_string();
        let with_body = has_param(&req, "body=1");
        let force = has_param(&req, "force=true");
        match (req.method(), path.as_str()) {
            (&Method::GET, "/healthz") => text(StatusCode::OK, "ok\n"),
            (&Method::GET, "/readyz") => {
                match deadline(self.store_timeout, self.store.ping()).await {
                    Ok(()) => text(StatusCode::OK, "ready\n"),
                    Err(e) if authorized => text(
                        StatusCode::SERVICE_UNAVAILABLE,
                        &format!("not ready: {} store: {e}\n", self.store.kind()),
                    ),
                    Err(_) => text(
                        StatusCode::SERVICE_UNAVAILABLE,
                        &format!(
                            "not ready: the {} store does not answer\n",
                            self.store.kind()
                        ),
                    ),
                }
            }
            (&Method::GET, "/metrics") => {
                let mut res = Response::new(body::full(self.metrics.encode()));
                res.headers_mut().insert(
                    CONTENT_TYPE,
                    HeaderValue::from_static(metrics::CONTENT_TYPE),
                );
                res
            }
            (m, p) if p.starts_with("/records/") => {
                let Some(id) = RecordId::from_hex(&p["/records/".len()..]) else {
                    return json(
                        StatusCode::BAD_REQUEST,
                        &serde_json::json!({"error": "a record id is 64 hex characters"}),
                    );
                };
                match *m {
                    Method::GET => {
                        match deadline(self.store_timeout, self.store.inspect(&id, with_body)).await
                        {
                            Ok(Some(view)) => json(StatusCode::OK, &view),
                            Ok(None) => json(
                                StatusCode::NOT_FOUND,
                                &serde_json::json!({"error": "no such record", "id": id.to_string()}),
                            ),
                            Err(e) => store_error(e),
                        }
                    }
                    Method::DELETE => {
                        let before = deadline(self.store_timeout, self.store.inspect(&id, false))
                            .await
                            .ok()
                            .flatten();
                        match deadline(self.store_timeout, self.store.delete(&id, force)).await {
                            Ok(Deleted::Deleted) => {
                                tracing::warn!(record = %id, forced = force, "record released by an operator");
                                json(
                                    StatusCode::OK,
                                    &serde_json::json!({"released": before, "id": id.to_string()}),
                                )
                            }
                            Ok(Deleted::NotFound) => json(
                                StatusCode::NOT_FOUND,
                                &serde_json::json!({"error": "no such record", "id": id.to_string()}),
                            ),
                            Ok(Deleted::OwnerBusy) => owner_busy(&id, before.as_ref()),
                            Err(e) => store_error(e),
                        }
                    }
                    _ => text(StatusCode::METHOD_NOT_ALLOWED, "GET or DELETE\n"),
                }
            }
            _ => text(StatusCode::NOT_FOUND, "not found\n"),
        }
    }
}

/// Whether the query string holds `param` (`name=value`) as one of its parts.
fn has_param(req: &Request<Incoming>, param: &str) -> bool {
    req.uri()
        .query()
        .is_some_and(|q| q.split('&').any(|p| p == param))
}

/// 409: the release was refused because the owner may still be working, and why.
fn owner_busy(id: &RecordId, view: Option<&RecordView>) -> Response<Body> {
    let why = match view {
        Some(RecordView {
            state: RecordState::InProgress,
            lease_left_ms: Some(ms),
            ..
        }) => format!("its owner holds a live lease for another {ms} ms"),
        Some(RecordView {
            owner_busy_ms: Some(ms),
            ..
        }) => format!(
            "its lease ran out, but its owner may still be waiting for the upstream for another {ms} ms (upstream_timeout)"
        ),
        _ => "its owner may still be working on it".to_string(),
    };
    let detail = format!(
        "not released: {why}; a retry let through now could execute while the first call completes. Try again once it has passed, or add ?force=true if you know the idemgate instance that owns it is gone (see the README's runbook)"
    );
    Problem::OwnerBusy.response(detail, Some(id), None)
}

fn store_error(e: crate::store::StoreError) -> Response<Body> {
    json(
        StatusCode::SERVICE_UNAVAILABLE,
        &serde_json::json!({"error": e.to_string()}),
    )
}

fn text(status: StatusCode, s: &str) -> Response<Body> {
    let mut res = Response::new(body::full(s.to_string()));
    *res.status_mut() = status;
    res.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    res
}

fn json(status: StatusCode, v: &impl serde::Serialize) -> Response<Body> {
    let mut res = Response::new(body::full(serde_json::to_vec(v).unwrap_or_default()));
    *res.status_mut() = status;
    res.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    res
}
