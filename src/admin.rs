//! The admin listener: `GET /healthz`, `GET /readyz`, `GET /metrics`, `GET /records/{id}`,
//! `DELETE /records/{id}` and the rest of the admin API. Loopback by default; it can release
//! records, so keep it private. Who may do what, from where, is [`crate::admin_access`]'s:
//! the listener answers only under known hosts, takes writes only from the operator's own
//! tools, and, once `admin_token` or `admin_operators` is set, wants a token whose role
//! allows the endpoint. The probes (`/healthz`, `/readyz`) are open so that a plain
//! `httpGet` probe can use them; they say up or not, nothing else (the store's error only to
//! a known operator).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE, WWW_AUTHENTICATE};
use hyper::{Method, Request, Response, StatusCode};

use crate::admin_access::{self as access, Operator};
use crate::body::{self, Body};
use crate::config::{Live, Role};
use crate::key::RecordId;
use crate::metrics::{self, Metrics};
use crate::operator::{self, Lookup, Resolver};
use crate::problem::{Problem, TYPE_BASE};
use crate::reload::{Reloaded, Reloader};
use crate::scope::ScopeSecret;
use crate::secret::SecretHealth;
use crate::store::{deadline, Completed, Deleted, RecordState, RecordView, Store};

/// The largest request body the admin API takes (a `complete` with its answer).
pub use crate::limits::ADMIN_MAX_BODY as MAX_BODY;
/// How long the admin listener waits for a request body.
const BODY_TIMEOUT: Duration = Duration::from_secs(10);
/// Records examined per page of `GET /records`, unless `count` says otherwise (at most
/// [`MAX_COUNT`]).
const DEFAULT_COUNT: usize = 100;
const MAX_COUNT: usize = 1000;

/// The admin service.
#[derive(Clone)]
pub struct Admin {
    store: Arc<dyn Store>,
    store_timeout: Duration,
    metrics: Arc<Metrics>,
    // The settings in force: `admin_token`, `admin_operators` and `admin_hosts` change on
    // reload.
    settings: Arc<Live>,
    // Record ids from a request's parts, as the proxy computes them.
    resolver: Option<Resolver>,
    // Whether the scope secret agrees with the store's (unready once not), and the secret
    // itself for `GET /scope-secret`.
    secret: Option<(Arc<SecretHealth>, ScopeSecret)>,
    // `POST /config/reload`: the binary's, which knows where its configuration comes from.
    reloader: Option<Arc<Reloader>>,
}

/// What [`Admin::route`] made of a request.
enum Routed {
    /// An answer that no audit line records (a read, a malformed request).
    Answer(Response<Body>),
    /// A refusal of an action, audited as refused.
    Refused(Response<Body>),
    /// An action's answer, audited with its reason, the record before it, and the status it
    /// wrote.
    Acted {
        res: Response<Body>,
        reason: Option<String>,
        before: Option<String>,
        written: Option<u16>,
    },
}

impl Admin {
    /// Builds it over the proxy's store and metrics.
    pub fn new(
        store: Arc<dyn Store>,
        store_timeout: Duration,
        metrics: Arc<Metrics>,
        settings: Arc<Live>,
    ) -> Admin {
        Admin {
            store,
            store_timeout,
            metrics,
            settings,
            resolver: None,
            secret: None,
            reloader: None,
        }
    }

    /// Makes `/readyz` follow the scope secret's agreement, and enables `GET /scope-secret`
    /// (only with `admin_token` set).
    pub fn with_secret(mut self, health: Arc<SecretHealth>, secret: ScopeSecret) -> Admin {
        self.secret = Some((health, secret));
        self
    }

    /// Enables `POST /config/reload` (with a reloader).
    pub fn with_reloader(mut self, reloader: Option<Arc<Reloader>>) -> Admin {
        self.reloader = reloader;
        self
    }

    /// Enables `POST /records/lookup`.
    pub fn with_resolver(mut self, resolver: Resolver) -> Admin {
        self.resolver = Some(resolver);
        self
    }

    /// Handles one admin request from `peer`; every answer carries the security headers.
    pub async fn handle(&self, req: Request<Incoming>, peer: SocketAddr) -> Response<Body> {
        let mut res = self.answer(req, peer).await;
        access::secure(&mut res);
        res
    }

    async fn answer(&self, req: Request<Incoming>, peer: SocketAddr) -> Response<Body> {
        let settings = self.settings.get();
        let config = &settings.config;
        // Before anything, probes included: a rebinding page's requests name its host.
        let authority = match access::authority(&req) {
            Some(a) if access::host_allowed(&a, &config.admin_hosts) => a,
            other => return access::host_refused(other.as_deref()),
        };
        let operator = access::identify(config, req.headers());
        let path = req.uri().path().to_string();
        if req.method() == Method::GET && matches!(path.as_str(), "/healthz" | "/readyz") {
            return self.probe(&path, operator.is_some()).await;
        }
        let Some(op) = operator else {
            let mut res = Problem::OperatorTokenRequired.response(
                "send `Authorization: Bearer <token>`: admin_token's, or an admin_operators entry's",
                None,
                None,
            );
            res.headers_mut()
                .insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            return res;
        };
        let (action, needs) = endpoint(req.method(), &path);
        let record = record_of(&path);
        let forced = has_param(&req, "force=true");
        let query_reason = param(&req, "reason");
        let audit = |answered: u16,
                     reason: Option<&str>,
                     before: Option<String>,
                     status_written: Option<u16>| {
            access::Audit {
                operator: &op,
                action: action.unwrap_or("other"),
                reason,
                record: record.clone(),
                before,
                forced,
                status_written,
                answered,
                peer,
            }
            .write(&self.metrics)
        };
        let refused = |res: Response<Body>| {
            if action.is_some() {
                audit(res.status().as_u16(), query_reason.as_deref(), None, None);
            }
            res
        };
        if access::unsafe_method(req.method()) {
            if let Some(why) = access::cross_origin(&req, &authority) {
                return refused(Problem::CrossOriginRefused.response(why, None, None));
            }
        }
        if op.role < needs {
            let what = format!("{} {path}", req.method());
            return refused(access::role_forbidden(&op, &what, needs));
        }
        let with_body = has_param(&req, "body=1");
        if with_body && req.method() == Method::GET && !op.read_bodies {
            return access::role_forbidden(
                &op,
                "a record's body (read_bodies = true)",
                Role::Decide,
            );
        }

        let (req, body) = if access::unsafe_method(req.method()) {
            let (parts, incoming) = req.into_parts();
            let bytes = match read_body(incoming).await {
                Ok(b) => b,
                Err(res) => return res,
            };
            let req = Request::from_parts(parts, ());
            // An empty body is never refused for its type (`curl -X POST -d ''`).
            if !bytes.is_empty() && !access::is_json(&req) {
                return refused(access::not_json());
            }
            (req, bytes)
        } else {
            (Request::from_parts(req.into_parts().0, ()), Bytes::new())
        };
        let (res, reason, before, written) =
            match self.route(&req, &body, &path, &op, forced, with_body).await {
                Routed::Answer(res) => return res,
                Routed::Refused(res) => return refused(res),
                Routed::Acted {
                    res,
                    reason,
                    before,
                    written,
                } => (res, reason, before, written),
            };
        if action.is_some() {
            audit(res.status().as_u16(), reason.as_deref(), before, written);
        }
        res
    }

    /// Answers an admitted request by its method and path: an answer as it is, a refusal to
    /// audit, or an action taken with what its audit line says.
    async fn route(
        &self,
        req: &Request<()>,
        body: &Bytes,
        path: &str,
        op: &Operator,
        forced: bool,
        with_body: bool,
    ) -> Routed {
        let (res, reason, before, written) = match (req.method(), path) {
            (&Method::GET, "/records") => return Routed::Answer(self.list(req).await),
            (&Method::POST, "/config/reload") => {
                (self.reload().await, param(req, "reason"), None, None)
            }
            (&Method::POST, "/records/lookup") => return Routed::Answer(self.lookup(body).await),
            (&Method::POST, p) if p.starts_with("/records/") && p.ends_with("/complete") => {
                let hex = &p["/records/".len()..p.len() - "/complete".len()];
                match RecordId::from_hex(hex) {
                    Some(id) => self.complete(id, forced, req, body).await,
                    None => return Routed::Answer(bad_request("a record id is 64 hex characters")),
                }
            }
            (&Method::GET, "/scope-secret") => match (op.anonymous(), &self.secret) {
                // Whoever holds the secret can test record ids offline against guessed
                // credentials: never shown on an open listener.
                (true, _) => (
                    text(
                        StatusCode::FORBIDDEN,
                        "set admin_token or admin_operators to read the scope secret\n",
                    ),
                    None,
                    None,
                    None,
                ),
                (false, Some((_, secret))) => (
                    json(
                        StatusCode::OK,
                        &serde_json::json!({"scope_secret": secret.to_hex()}),
                    ),
                    param(req, "reason"),
                    None,
                    None,
                ),
                (false, None) => {
                    return Routed::Answer(text(StatusCode::NOT_FOUND, "no scope secret here\n"))
                }
            },
            // What observe-mode routes would have done.
            (&Method::GET, "/observe") => {
                let records = has_param(req, "records=1");
                let mut res = Response::new(body::full(self.metrics.observations_json(records)));
                res.headers_mut()
                    .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
                return Routed::Answer(res);
            }
            (&Method::GET, "/metrics") => {
                let mut res = Response::new(body::full(self.metrics.encode()));
                res.headers_mut().insert(
                    CONTENT_TYPE,
                    HeaderValue::from_static(metrics::CONTENT_TYPE),
                );
                return Routed::Answer(res);
            }
            (m, p) if p.starts_with("/records/") => {
                let Some(id) = RecordId::from_hex(&p["/records/".len()..]) else {
                    return Routed::Answer(bad_request("a record id is 64 hex characters"));
                };
                match *m {
                    Method::GET => return Routed::Answer(self.show(&id, with_body).await),
                    Method::DELETE => {
                        let reason = match access::reason(param(req, "reason").as_deref()) {
                            Ok(r) => r,
                            Err(why) => return Routed::Refused(access::reason_refused(why)),
                        };
                        let (res, before) = self.release(&id, forced, req).await;
                        (res, Some(reason), before, None)
                    }
                    _ => {
                        return Routed::Answer(text(
                            StatusCode::METHOD_NOT_ALLOWED,
                            "GET or DELETE\n",
                        ))
                    }
                }
            }
            _ => return Routed::Answer(text(StatusCode::NOT_FOUND, "not found\n")),
        };
        Routed::Acted {
            res,
            reason,
            before,
            written,
        }
    }

    /// `GET /healthz`, `GET /readyz`: open; the store's error only to a known operator.
    async fn probe(&self, path: &str, known: bool) -> Response<Body> {
        if path == "/healthz" {
            return text(StatusCode::OK, "ok\n");
        }
        if self.secret.as_ref().is_some_and(|(h, _)| !h.agreed()) {
            return text(
                StatusCode::SERVICE_UNAVAILABLE,
                "not ready: this instance's scope secret differs from the store's; protected requests are refused until it restarts\n",
            );
        }
        match deadline(self.store_timeout, self.store.ping()).await {
            Ok(()) => text(StatusCode::OK, "ready\n"),
            Err(e) if known => text(
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

    /// `GET /records/{id}[?body=1]`.
    async fn show(&self, id: &RecordId, with_body: bool) -> Response<Body> {
        match deadline(self.store_timeout, self.store.inspect(id, with_body)).await {
            Ok(Some(view)) => json(StatusCode::OK, &view),
            Ok(None) => not_found(id),
            Err(e) => store_error(e),
        }
    }

    /// `DELETE /records/{id}[?force=true][&completed=true]`: the answer, and the record's
    /// state before.
    async fn release(
        &self,
        id: &RecordId,
        force: bool,
        req: &Request<()>,
    ) -> (Response<Body>, Option<String>) {
        let before = deadline(self.store_timeout, self.store.inspect(id, false)).await;
        let was = match &before {
            Ok(Some(v)) => Some(state_name(v.state)),
            Ok(None) => Some("absent".to_string()),
            Err(_) => None,
        };
        // A completed record holds the answer every retry of its key is replayed;
        // releasing it lets the next retry execute the request a second time. Only with
        // `?completed=true`, and never on a guess: a store that cannot say what the record
        // is refuses the release.
        let completed_ok = has_param(req, "completed=true");
        let before = match before {
            Ok(Some(v)) if v.state == RecordState::Completed && !completed_ok => {
                return (completed_refused(id, &v), was);
            }
            Err(e) if !completed_ok => return (store_error(e), was),
            Ok(v) => v,
            Err(_) => None,
        };
        let any_namespace = has_param(req, "any_namespace=true");
        let deleted = self.store.delete(id, force, any_namespace);
        let res = match deadline(self.store_timeout, deleted).await {
            Ok(Deleted::Deleted) => json(
                StatusCode::OK,
                &serde_json::json!({"released": before, "id": id.to_string()}),
            ),
            Ok(Deleted::NotFound) => not_found(id),
            Ok(Deleted::OwnerBusy) => owner_busy(id, before.as_ref()),
            Ok(Deleted::Unscoped) => unscoped(id, "released"),
            Err(e) => store_error(e),
        };
        (res, was)
    }
}

/// What an endpoint is, for the audit (`None`: not audited), and the role it needs.
fn endpoint(method: &Method, path: &str) -> (Option<&'static str>, Role) {
    match (method, path) {
        (&Method::POST, "/config/reload") => (Some("reload"), Role::Admin),
        (&Method::GET, "/scope-secret") => (Some("scope_secret"), Role::Admin),
        (&Method::POST, "/records/lookup") => (None, Role::Read),
        (&Method::POST, p) if p.starts_with("/records/") && p.ends_with("/complete") => {
            (Some("complete"), Role::Decide)
        }
        (&Method::DELETE, p) if p.starts_with("/records/") => (Some("release"), Role::Decide),
        (m, _) if access::unsafe_method(m) => (None, Role::Decide),
        _ => (None, Role::Read),
    }
}

/// The record id a path names, as written (for the audit).
fn record_of(path: &str) -> Option<String> {
    let rest = path.strip_prefix("/records/")?;
    let hex = rest.strip_suffix("/complete").unwrap_or(rest);
    RecordId::from_hex(hex).map(|id| id.to_string())
}

fn state_name(state: RecordState) -> String {
    serde_json::to_value(state)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{state:?}"))
}

fn not_found(id: &RecordId) -> Response<Body> {
    json(
        StatusCode::NOT_FOUND,
        &serde_json::json!({"error": "no such record", "id": id.to_string()}),
    )
}

impl Admin {
    /// `GET /records?state=unknown&cursor=...&count=...`: one page of a walk.
    async fn list(&self, req: &Request<()>) -> Response<Body> {
        let state = match param(req, "state") {
            None => None,
            Some(s) => match operator::parse_state(&s) {
                Some(state) => Some(state),
                None => return bad_request("state is unknown, in_progress or completed"),
            },
        };
        let cursor = param(req, "cursor").unwrap_or_default();
        let count = match param(req, "count").map(|c| c.parse::<usize>()) {
            None => DEFAULT_COUNT,
            Some(Ok(n)) if (1..=MAX_COUNT).contains(&n) => n,
            Some(_) => return bad_request("count is between 1 and 1000"),
        };
        match deadline(
            self.store_timeout * 4,
            self.store.list(state, &cursor, count),
        )
        .await
        {
            Ok(page) => json(StatusCode::OK, &page),
            Err(crate::store::StoreError::Corrupt(e)) => bad_request(&e),
            Err(e) => store_error(e),
        }
    }

    /// `POST /records/lookup`: the id and state of a request's record.
    async fn lookup(&self, body: &[u8]) -> Response<Body> {
        let Some(resolver) = &self.resolver else {
            return text(StatusCode::NOT_FOUND, "not found\n");
        };
        let lookup: Lookup = match parse_json(body) {
            Ok(l) => l,
            Err(e) => return bad_request(&e),
        };
        let id = match resolver.record_id(&lookup) {
            Ok(id) => id,
            Err(e) => return bad_request(&e),
        };
        match deadline(self.store_timeout, self.store.inspect(&id, false)).await {
            Ok(view) => json(
                StatusCode::OK,
                &serde_json::json!({
                    "id": id.to_string(),
                    "state": view.as_ref().map(|v| v.state),
                    "record": view,
                }),
            ),
            Err(e) => store_error(e),
        }
    }

    /// `POST /records/{id}/complete[?force=true]&reason=...`: resolves an `unknown` record
    /// as executed. The answer, the reason, the state before and the status written.
    async fn complete(
        &self,
        id: RecordId,
        force: bool,
        req: &Request<()>,
        body: &[u8],
    ) -> (Response<Body>, Option<String>, Option<String>, Option<u16>) {
        let outcome: operator::Outcome = match parse_json(body) {
            Ok(o) => o,
            Err(e) => return (bad_request(&e), param(req, "reason"), None, None),
        };
        let given = param(req, "reason").or_else(|| outcome.reason.clone());
        let reason = match access::reason(given.as_deref()) {
            Ok(r) => r,
            Err(why) => return (access::reason_refused(why), given, None, None),
        };
        let response = match outcome.response() {
            Ok(r) => r,
            Err(e) => return (bad_request(&e), Some(reason), None, None),
        };
        let before = deadline(self.store_timeout, self.store.inspect(&id, false))
            .await
            .ok()
            .flatten();
        let was = Some(
            before
                .as_ref()
                .map_or_else(|| "absent".into(), |v| state_name(v.state)),
        );
        let any_namespace = has_param(req, "any_namespace=true");
        let done = deadline(
            self.store_timeout,
            self.store.complete(&id, &response, force, any_namespace),
        )
        .await;
        let res = match done {
            Ok(Completed::Completed) => json(
                StatusCode::OK,
                &serde_json::json!({"completed": id.to_string(), "was": before}),
            ),
            Ok(Completed::NotFound) => not_found(&id),
            Ok(Completed::OwnerBusy) => owner_busy(&id, before.as_ref()),
            Ok(Completed::Unscoped) => unscoped(&id, "completed"),
            Ok(Completed::AlreadyCompleted) => json(
                StatusCode::CONFLICT,
                &serde_json::json!({"error": "the record already holds an answer; it replays that one", "id": id.to_string()}),
            ),
            Err(e) => store_error(e),
        };
        (res, Some(reason), was, Some(response.status))
    }
}

/// A query parameter's decoded value.
fn param<B>(req: &Request<B>, name: &str) -> Option<String> {
    let q = req.uri().query()?;
    form_urlencoded::parse(q.as_bytes())
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.into_owned())
}

/// Reads a request body (bounded in size and time).
async fn read_body(body: Incoming) -> Result<Bytes, Response<Body>> {
    use http_body_util::{BodyExt, Limited};
    let read = Limited::new(body, MAX_BODY).collect();
    match tokio::time::timeout(BODY_TIMEOUT, read).await {
        Ok(Ok(b)) => Ok(b.to_bytes()),
        Ok(Err(_)) => Err(bad_request("the body is unreadable or larger than 16 MiB")),
        Err(_) => Err(bad_request("the body did not arrive in time")),
    }
}

/// A JSON request body, read as `T`.
fn parse_json<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    serde_json::from_slice(bytes).map_err(|e| format!("body: {e}"))
}

impl Admin {
    /// `POST /config/reload`: 200 with the settings that changed, or a problem+json naming
    /// what was refused (409 `reload-refused`: settings that need a restart; 422
    /// `config-invalid`: what `config check` finds), nothing applied.
    async fn reload(&self) -> Response<Body> {
        let Some(reloader) = self.reloader.clone() else {
            return text(
                StatusCode::NOT_FOUND,
                "this instance has no configuration source to reload\n",
            );
        };
        let done = tokio::task::spawn_blocking(move || reloader.reload("POST /config/reload"));
        let reloaded = match done.await {
            Ok(r) => r,
            Err(_) => {
                return text(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "the reload failed; nothing was applied\n",
                )
            }
        };
        let (status, name, title, detail) = match &reloaded {
            Reloaded::Applied { .. } => return json(StatusCode::OK, &reloaded),
            Reloaded::Refused { restart_required } => (
                StatusCode::CONFLICT,
                "reload-refused",
                "A setting that changed needs a restart",
                format!(
                    "nothing was applied: {} change only with a restart",
                    restart_required.join(", ")
                ),
            ),
            Reloaded::Invalid { problems } => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "config-invalid",
                "The configuration does not pass idemgate config check",
                format!("nothing was applied: {}", problems.join("; ")),
            ),
        };
        let mut doc = serde_json::json!({
            "type": format!("{TYPE_BASE}{name}"),
            "title": title,
            "status": status.as_u16(),
            "detail": detail,
        });
        if let (Some(doc), Ok(serde_json::Value::Object(more))) =
            (doc.as_object_mut(), serde_json::to_value(&reloaded))
        {
            doc.extend(more);
        }
        let mut res = json(status, &doc);
        res.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        res
    }
}

fn bad_request(why: &str) -> Response<Body> {
    json(StatusCode::BAD_REQUEST, &serde_json::json!({"error": why}))
}

/// Whether the query string holds `param` (`name=value`) as one of its parts.
fn has_param<B>(req: &Request<B>, param: &str) -> bool {
    req.uri()
        .query()
        .is_some_and(|q| q.split('&').any(|p| p == param))
}

/// 409: a completed record is released only with `?completed=true`, and what its next
/// retry would do.
fn completed_refused(id: &RecordId, view: &RecordView) -> Response<Body> {
    let status = view
        .status
        .map_or_else(|| "an answer".to_string(), |s| format!("status {s}"));
    json(
        StatusCode::CONFLICT,
        &serde_json::json!({
            "error": format!(
                "not released: the record is completed (its request executed and was answered with {status}), and every retry of its key gets that answer replayed. Released, the client's next retry executes the request again (a second payment, if it was one). Add ?completed=true only if a second execution is what you want (the first one was undone upstream, say refunded)"
            ),
            "id": id.to_string(),
            "state": "completed",
        }),
    )
}

/// 409: the record was written by a version that kept no namespace (`namespace: null`),
/// so it may be another service's on a shared store: changed only with
/// `?any_namespace=true`.
fn unscoped(id: &RecordId, what: &str) -> Response<Body> {
    json(
        StatusCode::CONFLICT,
        &serde_json::json!({
            "error": format!(
                "not {what}: the record was written by an idemgate version that kept no namespace, so it may belong to another namespace sharing this store, whose retries it answers. Add ?any_namespace=true once you know it is this namespace's record"
            ),
            "id": id.to_string(),
            "namespace": null,
        }),
    )
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
        "not released: {why}; a retry let through now could execute while the first call completes. Try again once it has passed, or add ?force=true if you know the idemgate instance that owns it is gone (see docs/operations.md, \"Reconciling an unknown record\")"
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
