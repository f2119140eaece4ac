//! What a request *is*, decided before anything acts on it: pass it through, refuse it for
//! which reason, or protect it as which operation (tenant, method, normalized path, key).
//!
//! Every rule about routes, methods, method overrides, paths, tenants and keys lives here,
//! once, in code that does no I/O: [`decide`] reads a request head, and the body step
//! ([`declared_too_large`] and [`too_many_codings`] from the head, [`Refusal`] for a body
//! that could not be read, [`fingerprint`]) reads what the body adds. Enforcing acts on the value (`enforce.rs`); observing forwards
//! the request as sent and counts what the same value says enforcing would have done
//! (`observe.rs`); what each refusal answers and counts as is `rescue.rs`'s. The route's mode is read here and nowhere else: it is
//! [`Decision::mode`].

use std::sync::Arc;

use hyper::header::{HeaderMap, HeaderValue, CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE, HOST};
use hyper::{Method, Uri};

use crate::admission;
use crate::config::{Forward, MethodCase, Mode, Policy, Settings};
use crate::fingerprint::{self, Fingerprint, RequestParts};
use crate::key::{self, IdempotencyKey};
use crate::scope::client_cert::ClientCert;
use crate::scope::method::{self, Overrides};
use crate::scope::path::PathError;
use crate::scope::{Tenant, TenantError, TenantSource};

/// What idemgate does with one request, and under which policy and mode.
pub(crate) struct Decision<'s> {
    /// The policy of the route the path leads to (the defaults when it leads nowhere).
    pub policy: &'s Arc<Policy>,
    /// The method the upstream runs (a declared override's), or the request's own where
    /// its overrides could not be read: what the record is scoped by and the log names.
    pub method: Method,
    /// Enforce: act on [`Decision::action`]. Observe: forward as sent, and count it.
    pub mode: Mode,
    /// The route protects this method, so the request is traced and logged as a protected
    /// one even when it is then refused for its key or tenant, or forwarded for want of a
    /// key.
    pub traced: bool,
    /// What to do.
    pub action: Action,
}

/// The three things idemgate can do with a request.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Action {
    /// Forwarded as sent, unprotected, its body streamed.
    PassThrough(Pass),
    /// Answered with idemgate's own problem; nothing claimed or forwarded.
    Refuse(Refusal),
    /// Claimed, forwarded once and recorded, or answered from its record.
    Protect(Operation),
}

/// Why a request passes through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pass {
    /// Nothing protects it: as if idemgate were absent.
    Plain,
    /// It carries a key on a method its route does not protect (a `PUT`): a
    /// client that expects protection and does not get it.
    KeyIgnored,
    /// A protected method without a key, on a route that does not require one.
    NoKey,
}

/// A protected request, as the store will know it.
#[derive(PartialEq, Eq)]
pub(crate) struct Operation {
    /// Its `Idempotency-Key` (or an alias's); `None` only on a route whose key may come
    /// from the body (`key_json_pointer`), where the body step decides.
    pub key: Option<IdempotencyKey>,
    /// Who owns its record.
    pub tenant: Tenant,
    /// The path's normal form: what scope and fingerprint use.
    pub scope_path: String,
    /// The path enforcing forwards instead of the one sent (`None`: as sent). Only what
    /// the route folds stays as the client wrote it: letter case on a case-insensitive
    /// route, `;` parameters where it strips them, a format suffix it lists.
    pub forward_path: Option<String>,
}

// The tenant is a credential's hash: left out of debug output, as the key's value is.
impl std::fmt::Debug for Operation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Operation")
            .field("key", &self.key)
            .field("scope_path", &self.scope_path)
            .field("forward_path", &self.forward_path)
            .finish_non_exhaustive()
    }
}

/// Why enforcing would answer a request itself, before any claim: each is one problem
/// type, and one `would` label of observe mode (both in `rescue.rs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The path cannot be normalized safely, or is a spelling its route refuses.
    InvalidPath(String),
    /// A malformed declared override, or an undeclared one that names another method.
    InvalidMethodOverride(String),
    /// A header this route decides on is named by `Connection` (it would be stripped as
    /// hop-by-hop after the decision), or has a look-alike spelt with `_`.
    InvalidHeader(String),
    /// A protected method in another letter case, on a route whose upstream does not say
    /// it folds it (`method_case`).
    InvalidMethod(String),
    /// The route requires a key and there is none.
    MissingKey,
    /// The key header is malformed.
    InvalidKey(String),
    /// No tenant can be read.
    MissingTenant(String),
    /// The bearer token that names the tenant failed verification.
    InvalidToken(String),
    /// The body is larger than `max_body_bytes` (`decoded`: once its codings are undone).
    BodyTooLarge {
        /// `max_body_bytes`.
        max: u64,
        /// Measured after `Content-Encoding` was decoded.
        decoded: bool,
    },
    /// `Content-Encoding` names more codings than `max_content_codings` (`max`).
    TooManyCodings {
        /// `max_content_codings`.
        max: usize,
    },
    /// The body carries trailer fields, which are outside its fingerprint.
    TrailersNotSupported,
    /// The body ended early or was malformed.
    BodyUnreadable,
    /// The body did not arrive within `body_read_timeout`.
    BodyTimeout,
    /// Not admitted: no slot, or the budget of held bodies is spent.
    Overloaded(admission::Refusal),
    /// This instance's scope secret disagrees with the store's.
    SecretDisagrees,
    /// The store's file is not the one at its path (SQLite): deleted or replaced.
    StoreFileReplaced,
}

/// Decides what a request is from its head: the route its path leads to, the method the
/// upstream will run, and for a protected request its key and tenant.
pub(crate) fn decide<'s>(
    settings: &'s Settings,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    cert: Option<&ClientCert>,
) -> Decision<'s> {
    let routed = match settings.route(uri.path()) {
        Ok(routed) => routed,
        Err(e) => return unroutable(settings, method, uri, headers, e),
    };
    let policy = routed.policy;
    let decision = |method: Method, traced: bool, action: Action| Decision {
        policy,
        method,
        mode: policy.mode,
        traced,
        action,
    };
    // What idemgate reads to decide must reach the upstream as it was read: a header that
    // `Connection` names is stripped after the decision, and one spelt with `_` for `-` is
    // the same header to CGI-style servers (Puma, Rack, PHP-FPM) and another to idemgate.
    if !policy.methods.is_empty() {
        if let Some(detail) = hidden_deciding_header(policy, headers) {
            let refusal = Refusal::InvalidHeader(detail);
            return decision(method.clone(), false, Action::Refuse(refusal));
        }
    }
    // The method the upstream will run. Which requests an unseen override refuses: those
    // where the request's method *or* a method an override names is protected on this
    // route. idemgate cannot know which of the two the upstream runs, and if either is
    // protected, scoping by one of them could be wrong: by the request's method, `POST`
    // + `X-HTTP-Method-Override: DELETE` would replay a `POST`'s answer for a `DELETE`;
    // ignoring the header, `GET` + `X-HTTP-Method-Override: POST` would run a protected
    // `POST` unprotected. Where neither is protected, whatever the upstream runs passes
    // through anyway, as it would without idemgate.
    let overrides = match method::read(
        method,
        headers,
        uri.query(),
        &policy.method_override_headers,
        policy.override_params,
    ) {
        Ok(o) => o,
        // A declared header that names no method, or two: what runs is unknown.
        Err(e) if !policy.methods.is_empty() => {
            let refusal = Refusal::InvalidMethodOverride(e.to_string());
            return decision(method.clone(), false, Action::Refuse(refusal));
        }
        Err(_) => Overrides {
            declared: None,
            unseen: Vec::new(),
        },
    };
    let effective = overrides.effective(method).clone();
    if let Some(detail) = unseen_override(policy, &overrides, &effective) {
        let refusal = Refusal::InvalidMethodOverride(detail);
        return decision(effective, false, Action::Refuse(refusal));
    }
    let effective = match fold_case(policy, effective) {
        Ok(effective) => effective,
        Err((effective, refusal)) => return decision(effective, false, Action::Refuse(refusal)),
    };
    // A form POST on a route that protects another method may be that method to an
    // upstream that reads `_method` in the body, which only the body step can see: it is
    // taken as protected, and the body step weighs its `_method`.
    let protected = policy.protects(&effective)
        || (effective == *method
            && !policy.methods.is_empty()
            && method::body_may_override(method, headers));
    // A spelling this route refuses (`;` parameters, an unlisted format suffix): the
    // framework behind it may route it to the protected handler as another operation.
    if let Some(e) = routed.refused.filter(|_| protected) {
        let refusal = Refusal::InvalidPath(e.to_string());
        return decision(effective, false, Action::Refuse(refusal));
    }
    if !protected {
        let keyed = policy.key_headers.iter().any(|h| headers.contains_key(h));
        let pass = if keyed { Pass::KeyIgnored } else { Pass::Plain };
        return decision(effective, false, Action::PassThrough(pass));
    }
    let key = match key::parse_any(headers, &policy.key_headers, policy.max_key_length) {
        Ok(Some(key)) => Some(key),
        // The key may be in the body: the body step reads it (the route requires a key).
        Ok(None) if policy.key_json_pointer.is_some() => None,
        Ok(None) if policy.require_key => {
            return decision(effective, true, Action::Refuse(Refusal::MissingKey))
        }
        Ok(None) => return decision(effective, true, Action::PassThrough(Pass::NoKey)),
        Err(e) => {
            let refusal = Refusal::InvalidKey(e.to_string());
            return decision(effective, true, Action::Refuse(refusal));
        }
    };
    let view = match authority_view(policy, uri, headers) {
        Ok(view) => view,
        Err(detail) => {
            let refusal = Refusal::InvalidHeader(detail);
            return decision(effective, true, Action::Refuse(refusal));
        }
    };
    let tenant = match tenant(settings, view.as_ref().unwrap_or(headers), cert, policy) {
        Ok(tenant) => tenant,
        Err(refusal) => return decision(effective, true, Action::Refuse(refusal)),
    };
    // Scope and fingerprint use the path's normal form; the upstream gets it too, so that
    // what was scoped as one operation is sent as one request.
    let scope_path = routed
        .normalized
        .clone()
        .unwrap_or_else(|| uri.path().to_string());
    let forward_path = match routed.forward {
        Forward::Normalized => routed.normalized,
        Forward::AsSent => None,
        Forward::Path(p) => Some(p),
    };
    let operation = Operation {
        key,
        tenant,
        scope_path,
        forward_path,
    };
    decision(effective, true, Action::Protect(operation))
}

/// `post` where `POST` is protected: Django upper-cases it and runs the POST view, most
/// others route it nowhere. Folded where the route says its upstream folds, else refused
/// (with the method as sent): passed through, it would run a protected operation
/// unprotected.
fn fold_case(policy: &Policy, effective: Method) -> Result<Method, (Method, Refusal)> {
    if policy.protects(&effective) {
        return Ok(effective);
    }
    let Some(upper) = policy
        .methods
        .iter()
        .find(|m| m.as_str().eq_ignore_ascii_case(effective.as_str()))
    else {
        return Ok(effective);
    };
    if policy.method_case == MethodCase::Fold {
        return Ok(upper.clone());
    }
    let refusal = Refusal::InvalidMethod(format!(
        "the method `{effective}` is `{upper}` in another letter case, which some frameworks (Django) run as `{upper}` and others do not; send `{upper}`, or set method_case = \"fold\" on a route whose upstream upper-cases methods"
    ));
    Err((effective, refusal))
}

/// A path that routes nowhere (it cannot be normalized safely): refused where a route that
/// enforces protects its method; where only observing routes do, observed as that refusal
/// (on no route: none could be matched); elsewhere it would pass through wherever it led.
fn unroutable<'s>(
    settings: &'s Settings,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    e: PathError,
) -> Decision<'s> {
    let policy = &settings.default_policy;
    // An override naming a method that is protected somewhere counts too: the upstream
    // would run that method.
    let overridden = |protects: &dyn Fn(&Method) -> bool| {
        method::read(method, headers, uri.query(), &[], Default::default())
            .map(|o| o.unseen.iter().any(|m| m.as_ref().is_some_and(protects)))
            .unwrap_or(false)
    };
    let enforced = |m: &Method| settings.enforces_anywhere(m);
    let observed = |m: &Method| settings.protects_anywhere(m);
    let (mode, action) = if enforced(method) || overridden(&enforced) {
        (
            Mode::Enforce,
            Action::Refuse(Refusal::InvalidPath(e.to_string())),
        )
    } else if observed(method) || overridden(&observed) {
        (
            Mode::Observe,
            Action::Refuse(Refusal::InvalidPath(e.to_string())),
        )
    } else {
        (policy.mode, Action::PassThrough(Pass::Plain))
    };
    Decision {
        policy,
        method: method.clone(),
        mode,
        traced: false,
        action,
    }
}

/// Headers every protected route decides on, whatever its settings: the credential that is
/// the default tenant, and what the fingerprint reads of the body.
const ALWAYS_DECIDING: [hyper::header::HeaderName; 3] = [
    hyper::header::AUTHORIZATION,
    CONTENT_TYPE,
    hyper::header::CONTENT_ENCODING,
];

/// Whether `name` is a header `policy` decides on: its key headers, every method-override
/// header (declared ones decide the method, undeclared ones a refusal), its tenant headers,
/// and [`ALWAYS_DECIDING`].
fn decides(policy: &Policy, name: &str) -> bool {
    let is = |n: &hyper::header::HeaderName| n.as_str().eq_ignore_ascii_case(name);
    let tenant = match &policy.tenant {
        TenantSource::Headers(names) => names.iter().any(is),
        TenantSource::Credentials => is(&crate::scope::tenant::X_API_KEY),
        _ => false,
    };
    tenant
        || policy.tenant_qualifiers.iter().any(is)
        || ALWAYS_DECIDING.iter().any(is)
        || policy.key_headers.iter().any(is)
        || policy.method_override_headers.iter().any(is)
        || method::OVERRIDE_HEADERS
            .iter()
            .any(|h| h.eq_ignore_ascii_case(name))
}

/// The refusal's detail when a header `policy` decides on would not reach the upstream as
/// idemgate read it: named by `Connection`, or present under a name that is one of them
/// with `_` for `-`.
fn hidden_deciding_header(policy: &Policy, headers: &HeaderMap) -> Option<String> {
    for value in headers.get_all(hyper::header::CONNECTION) {
        let Ok(text) = value.to_str() else { continue };
        for token in text.split(',').map(str::trim) {
            if !token.is_empty() && decides(policy, token) {
                return Some(format!(
                    "the Connection header names `{}`, which idemgate reads to decide on this request and would then remove as hop-by-hop; the upstream would not receive what was decided on: send `{}` without naming it in Connection",
                    token.to_ascii_lowercase(),
                    token.to_ascii_lowercase()
                ));
            }
        }
    }
    for name in headers.keys() {
        let name = name.as_str();
        if name.contains('_') && decides(policy, &name.replace('_', "-")) {
            return Some(format!(
                "the header `{name}` is `{}` with `_` for `-`, which servers that map headers to CGI variables (Puma, Rack, PHP-FPM) read as the same header and idemgate does not: send it as `{}`",
                name.replace('_', "-"),
                name.replace('_', "-")
            ));
        }
    }
    None
}

/// The refusal's detail when an override the route does not declare names a method that
/// matters here (see [`decide`]).
fn unseen_override(policy: &Policy, overrides: &Overrides, effective: &Method) -> Option<String> {
    if overrides.unseen.is_empty() {
        return None;
    }
    let protected = policy.protects(effective)
        || overrides.unseen.iter().any(|m| match m {
            Some(m) => policy.protects(m),
            None => !policy.methods.is_empty(),
        });
    if !protected {
        return None;
    }
    let named: Vec<&str> = overrides
        .unseen
        .iter()
        .map(|m| m.as_ref().map_or("(not a method)", |m| m.as_str()))
        .collect();
    Some(format!(
        "this request is {} but a method override names {}; this route does not declare that override (method_override_headers, method_override_params), so idemgate cannot tell which method the upstream runs: send the method itself",
        effective,
        named.join(", ")
    ))
}

/// The body step's method: the head's (`method`, the method [`decide`] protected), or
/// the one a `_method` field of a form or multipart POST body names where the route reads
/// it; refused where an undeclared one names another method and either is protected.
/// `content`: the body with its codings undone.
pub(crate) fn body_method(
    policy: &Policy,
    method: &Method,
    parts: &hyper::http::request::Parts,
    content: &[u8],
) -> Result<Method, Refusal> {
    if !method::body_may_override(&parts.method, &parts.headers) {
        return Ok(method.clone());
    }
    let read = method::read(
        &parts.method,
        &parts.headers,
        parts.uri.query(),
        &policy.method_override_headers,
        policy.override_params,
    )
    .and_then(|head| {
        method::with_body(
            head,
            &parts.method,
            &parts.headers,
            content,
            policy.override_params,
        )
    });
    let overrides = read.map_err(|e| Refusal::InvalidMethodOverride(e.to_string()))?;
    let effective = overrides.declared.clone().unwrap_or_else(|| method.clone());
    match unseen_override(policy, &overrides, &effective) {
        Some(detail) => Err(Refusal::InvalidMethodOverride(detail)),
        None => Ok(effective),
    }
}

/// Where a route's tenant or qualifier headers name `Host`: the request's headers with
/// `Host` made its authority, whichever protocol carried it (`:authority` on HTTP/2 and an
/// absolute-form target's authority, both in the URI; otherwise the `Host` line), so that
/// one request is one tenant over HTTP/1.1 and HTTP/2. `None`: read the headers as they
/// are. A `Host` that disagrees with the authority is refused: which one the upstream
/// routes by is not idemgate's to guess.
fn authority_view(
    policy: &Policy,
    uri: &Uri,
    headers: &HeaderMap,
) -> Result<Option<HeaderMap>, String> {
    let reads_host = match &policy.tenant {
        TenantSource::Headers(names) => names.contains(&HOST),
        _ => false,
    } || policy.tenant_qualifiers.contains(&HOST);
    let Some(authority) = uri.authority().filter(|_| reads_host) else {
        return Ok(None);
    };
    let authority = authority.as_str();
    if let Some(host) = headers
        .get_all(HOST)
        .iter()
        .find(|h| !h.as_bytes().eq_ignore_ascii_case(authority.as_bytes()))
    {
        return Err(format!(
            "the `host` field ({}) disagrees with the request's authority ({authority}); the tenant is read from the authority",
            String::from_utf8_lossy(host.as_bytes())
        ));
    }
    let mut view = headers.clone();
    let value = HeaderValue::from_str(authority)
        .map_err(|_| "the authority is not a header value".to_string())?;
    view.insert(HOST, value);
    Ok(Some(view))
}

/// The tenant of a protected request, or why it is refused.
fn tenant(
    settings: &Settings,
    headers: &HeaderMap,
    cert: Option<&ClientCert>,
    policy: &Policy,
) -> Result<Tenant, Refusal> {
    match settings.tenant(headers, cert, policy) {
        Ok(Some(tenant)) => Ok(tenant),
        Ok(None) => {
            let detail = match &policy.tenant {
                TenantSource::Headers(names) if names.is_empty() => "this route reads no tenant headers and does not share an anonymous scope".to_string(),
                TenantSource::Headers(names) => format!(
                    "send one of the headers that name the tenant ({}); requests without a tenant are not accepted on this route",
                    names.iter().map(|n| n.as_str()).collect::<Vec<_>>().join(", ")
                ),
                TenantSource::Credentials => "send the credential that names the tenant (Authorization or X-Api-Key); requests without a tenant are not accepted on this route".to_string(),
                TenantSource::JwtClaim(claim) => format!("send a bearer token whose `{claim}` claim names the tenant"),
                TenantSource::ClientCert(_) => "connect with a client certificate: this route reads the tenant from it".to_string(),
            };
            Err(Refusal::MissingTenant(detail))
        }
        Err(TenantError::Certificate(why)) => Err(Refusal::MissingTenant(why)),
        Err(e) => Err(Refusal::InvalidToken(e.to_string())),
    }
}

/// The body step, before reading: a body its `Content-Length` already shows to be larger
/// than `max` bytes.
pub(crate) fn declared_too_large(headers: &HeaderMap, max: u64) -> Option<Refusal> {
    let declared = headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    declared
        .filter(|n| *n > max)
        .map(|_| Refusal::BodyTooLarge {
            max,
            decoded: false,
        })
}

/// The body step, before reading: a `Content-Encoding` (all its lines) that names more
/// than `max` codings. Each coding is one more decode of up to `max_body_bytes`, so the
/// count is bounded before the body is read, let alone decoded.
pub(crate) fn too_many_codings(headers: &HeaderMap, max: usize) -> Option<Refusal> {
    let named: usize = headers
        .get_all(CONTENT_ENCODING)
        .iter()
        .map(|v| fingerprint::coding_count(&String::from_utf8_lossy(v.as_bytes())))
        .sum();
    (named > max).then_some(Refusal::TooManyCodings { max })
}

/// What the fingerprint takes of a request's body: as sent, its codings, and its content
/// when decoded.
#[derive(Clone, Copy)]
pub(crate) struct Content<'a> {
    pub encoding: Option<&'a str>,
    pub body: &'a [u8],
    pub decoded: Option<&'a [u8]>,
}

/// What the fingerprint reads of a request: the method it is scoped by, the path's normal
/// form, its query, its content type and its body's content.
pub(crate) fn request_parts<'a>(
    method: &'a Method,
    scope_path: &'a str,
    uri: &'a Uri,
    headers: &'a HeaderMap,
    content: Content<'a>,
) -> RequestParts<'a> {
    RequestParts {
        method: method.as_str(),
        path: scope_path,
        query: uri.query(),
        content_type: headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok()),
        content_encoding: content.encoding,
        body: content.body,
        decoded: content.decoded,
    }
}

/// The body step, once the body is read: the operation's fingerprint in the current
/// version.
pub(crate) fn fingerprint(
    policy: &Policy,
    method: &Method,
    operation: &Operation,
    uri: &Uri,
    headers: &HeaderMap,
    content: Content<'_>,
) -> Fingerprint {
    let parts = request_parts(method, &operation.scope_path, uri, headers, content);
    fingerprint::fingerprint_with(&parts, &policy.fingerprint_rules())
}

#[cfg(test)]
mod tests;
