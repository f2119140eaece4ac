//! The responses idemgate makes itself: RFC 9457 `application/problem+json`, one stable
//! `type` per case, produced in one place so every synthetic answer looks the same.

use hyper::header::{HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use hyper::{Response, StatusCode};
use serde::Serialize;

use crate::body::Body;
use crate::key::RecordId;

/// Header that marks a response as idemgate's own (not the upstream's), carrying the
/// problem name, so clients and the lab can tell idemgate's 409/422 from the upstream's.
/// A parsed name: as a `&str` it was parsed anew for every answer.
pub const IDEMGATE_ERROR: HeaderName = HeaderName::from_static("idemgate-error");

/// The base of every problem `type` URI, as a literal for `concat!`.
macro_rules! type_base {
    () => {
        "https://idemgate.dev/problems/"
    };
}

/// Base of every problem `type` URI.
pub const TYPE_BASE: &str = type_base!();

/// Every case in which idemgate answers instead of (or on behalf of) the upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Problem {
    /// The route requires an `Idempotency-Key` and the request had none.
    MissingKey,
    /// The `Idempotency-Key` header is malformed, too long or repeated.
    InvalidKey,
    /// A protected request from which no tenant can be read, on a route without a shared
    /// anonymous scope.
    MissingTenant,
    /// The bearer token that names the tenant failed verification.
    InvalidToken,
    /// A protected request's path cannot be normalized safely (an encoded `/`, dot segments
    /// above the root, broken percent-encoding).
    InvalidPath,
    /// A protected request names another method in a method-override header or `_method`
    /// that its route does not declare (`method_override_headers`), or its override is
    /// malformed: what the upstream would execute is not what idemgate would scope.
    InvalidMethodOverride,
    /// A protected request's method is a protected method spelt in another letter case
    /// (`post`), which some frameworks upper-case (Django) and others do not: refused unless
    /// the route says its upstream folds (`method_case = "fold"`).
    InvalidMethod,
    /// The body is larger than `max_body_bytes`.
    BodyTooLarge,
    /// A protected request's `Content-Encoding` names more codings than
    /// `max_content_codings`: refused before any of them is undone.
    TooManyCodings,
    /// The client stopped sending the body, or sent it too slowly.
    BodyTimeout,
    /// The body could not be read (the client broke the connection or the framing).
    BodyUnreadable,
    /// A protected request carried trailer fields, which are outside its fingerprint.
    TrailersNotSupported,
    /// Another request with this key is still being executed.
    InProgress,
    /// The key was used before with a different request.
    FingerprintMismatch,
    /// The request was sent upstream once and its outcome is unknown.
    OutcomeUnknown,
    /// The record store did not answer (or is full), so nothing was forwarded.
    StoreUnavailable,
    /// The upstream could not be reached; the request was provably not sent.
    UpstreamUnreachable,
    /// The request was sent and no complete answer came back.
    UpstreamTimeout,
    /// The request was sent and what came back is not one answer: its declared length
    /// disagrees with the bytes the upstream sent, its head could not be parsed, or its
    /// final status is interim (`101`). It may have run.
    UpstreamBrokenAnswer,
    /// A request header that idemgate decides on is hidden from the upstream (named by
    /// `Connection`) or has a look-alike (`_` for `-`) that some servers merge with it.
    InvalidHeader,
    /// A method idemgate does not forward (`CONNECT`).
    MethodNotAllowed,
    /// The request was executed, but its answer was too large to keep, so it cannot be
    /// replayed.
    ResponseNotStored,
    /// Too many protected requests are in flight (`max_in_flight`); nothing was claimed.
    Overloaded,
    /// Admin API: a release refused because the record's owner may still be working on it.
    OwnerBusy,
    /// A recorded answer exists and cannot be opened (its encryption key was removed).
    RecordUnreadable,
    /// idemgate failed while handling the request (a panic, counted in
    /// `idemgate_panics_total`); a claim it held follows the failure rules of its step.
    Internal,
    /// Admin API: the request names a host the admin listener does not answer to (not an IP
    /// literal, `localhost` or an `admin_hosts` entry): a DNS-rebinding page's.
    AdminHostRefused,
    /// Admin API: a write from another origin (`Origin`, `Sec-Fetch-Site`): a web page's.
    CrossOriginRefused,
    /// Admin API: a body that is not `Content-Type: application/json`.
    UnsupportedMediaType,
    /// Admin API: no valid operator token where operators are configured.
    OperatorTokenRequired,
    /// Admin API: the operator's role does not allow it.
    RoleForbidden,
    /// Admin API: a decision without a `reason`, or with one that is not 1 to 500
    /// characters of text.
    ReasonRequired,
}

/// [`Problem::name`] and [`Problem::type_uri`] from one list: the `type` URI of each case
/// is written at compile time, not formatted on every answer.
macro_rules! names {
    ($($variant:ident => $name:literal,)*) => {
        /// The short, stable name (last segment of the `type` URI).
        pub fn name(self) -> &'static str {
            match self {
                $(Problem::$variant => $name,)*
            }
        }

        /// The `type` URI: [`TYPE_BASE`] and the name.
        pub fn type_uri(self) -> &'static str {
            match self {
                $(Problem::$variant => concat!(type_base!(), $name),)*
            }
        }

        /// Every case.
        pub const ALL: &'static [Problem] = &[$(Problem::$variant,)*];
    };
}

impl Problem {
    names! {
        MissingKey => "missing-key",
        InvalidKey => "invalid-key",
        MissingTenant => "missing-tenant",
        InvalidToken => "invalid-token",
        InvalidPath => "invalid-path",
        InvalidMethodOverride => "invalid-method-override",
        InvalidMethod => "invalid-method",
        BodyTooLarge => "body-too-large",
        TooManyCodings => "too-many-codings",
        BodyTimeout => "body-timeout",
        BodyUnreadable => "body-unreadable",
        TrailersNotSupported => "trailers-not-supported",
        InProgress => "in-progress",
        FingerprintMismatch => "fingerprint-mismatch",
        OutcomeUnknown => "outcome-unknown",
        StoreUnavailable => "store-unavailable",
        UpstreamUnreachable => "upstream-unreachable",
        UpstreamTimeout => "upstream-timeout",
        UpstreamBrokenAnswer => "upstream-broken-answer",
        InvalidHeader => "invalid-header",
        MethodNotAllowed => "method-not-allowed",
        ResponseNotStored => "response-not-stored",
        Overloaded => "overloaded",
        OwnerBusy => "owner-busy",
        RecordUnreadable => "record-unreadable",
        Internal => "internal-error",
        AdminHostRefused => "admin-host-refused",
        CrossOriginRefused => "cross-origin-refused",
        UnsupportedMediaType => "unsupported-media-type",
        OperatorTokenRequired => "operator-token-required",
        RoleForbidden => "role-forbidden",
        ReasonRequired => "reason-required",
    }

    /// The HTTP status of this case.
    pub fn status(self) -> StatusCode {
        match self {
            Problem::MissingKey
            | Problem::InvalidKey
            | Problem::MissingTenant
            | Problem::InvalidPath
            | Problem::InvalidMethodOverride
            | Problem::InvalidHeader
            | Problem::InvalidMethod => StatusCode::BAD_REQUEST,
            Problem::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Problem::UpstreamBrokenAnswer => StatusCode::BAD_GATEWAY,
            Problem::InvalidToken => StatusCode::UNAUTHORIZED,
            Problem::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Problem::TooManyCodings => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Problem::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            Problem::BodyUnreadable => StatusCode::BAD_REQUEST,
            Problem::TrailersNotSupported => StatusCode::BAD_REQUEST,
            Problem::InProgress
            | Problem::OutcomeUnknown
            | Problem::ResponseNotStored
            | Problem::OwnerBusy => StatusCode::CONFLICT,
            Problem::FingerprintMismatch => StatusCode::UNPROCESSABLE_ENTITY,
            Problem::StoreUnavailable | Problem::Overloaded => StatusCode::SERVICE_UNAVAILABLE,
            Problem::UpstreamUnreachable => StatusCode::BAD_GATEWAY,
            Problem::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            Problem::RecordUnreadable | Problem::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Problem::AdminHostRefused => StatusCode::MISDIRECTED_REQUEST,
            Problem::CrossOriginRefused | Problem::RoleForbidden => StatusCode::FORBIDDEN,
            Problem::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Problem::OperatorTokenRequired => StatusCode::UNAUTHORIZED,
            Problem::ReasonRequired => StatusCode::BAD_REQUEST,
        }
    }

    fn title(self) -> &'static str {
        match self {
            Problem::MissingKey => "An Idempotency-Key header is required on this route",
            Problem::InvalidKey => "The Idempotency-Key header is invalid",
            Problem::MissingTenant => "The request does not say whose it is",
            Problem::InvalidToken => "The bearer token was refused",
            Problem::InvalidPath => "The request path cannot be normalized safely",
            Problem::InvalidMethodOverride => {
                "The request names another method in a method override this route does not declare"
            }
            Problem::InvalidMethod => {
                "The request's method is a protected method in another letter case"
            }
            Problem::BodyTooLarge => "The request body is too large",
            Problem::TooManyCodings => "The request body has too many content codings",
            Problem::BodyTimeout => "The request body did not arrive in time",
            Problem::BodyUnreadable => "The request body could not be read",
            Problem::TrailersNotSupported => {
                "Trailer fields are not supported on protected requests"
            }
            Problem::InProgress => "A request with this Idempotency-Key is still in progress",
            Problem::FingerprintMismatch => {
                "This Idempotency-Key was already used with a different request"
            }
            Problem::OutcomeUnknown => {
                "The outcome of the request with this Idempotency-Key is unknown"
            }
            Problem::StoreUnavailable => "The idempotency store is unavailable",
            Problem::UpstreamUnreachable => "The upstream could not be reached",
            Problem::UpstreamTimeout => "The upstream did not answer completely in time",
            Problem::UpstreamBrokenAnswer => {
                "The upstream's answer was broken; the request may have been executed"
            }
            Problem::InvalidHeader => {
                "A header idemgate decides on would not reach the upstream as it was read"
            }
            Problem::MethodNotAllowed => "idemgate does not forward this method",
            Problem::ResponseNotStored => {
                "The request with this Idempotency-Key was executed, but its answer was not kept"
            }
            Problem::Overloaded => "Too many requests are in progress",
            Problem::OwnerBusy => "The record's owner may still be working on it",
            Problem::RecordUnreadable => {
                "The recorded answer for this Idempotency-Key cannot be read"
            }
            Problem::Internal => "idemgate failed while handling the request",
            Problem::AdminHostRefused => "The admin listener does not answer to this host",
            Problem::CrossOriginRefused => "A write from another origin is refused",
            Problem::UnsupportedMediaType => "The body must be application/json",
            Problem::OperatorTokenRequired => "An operator token is required",
            Problem::RoleForbidden => "The operator's role does not allow this",
            Problem::ReasonRequired => "A decision needs a reason",
        }
    }

    /// Builds the problem response. `detail` must never contain request data beyond what the
    /// client itself sent in headers (no bodies, no credentials).
    pub fn response(
        self,
        detail: impl Into<String>,
        record: Option<&RecordId>,
        retry_after_secs: Option<u64>,
    ) -> Response<Body> {
        #[derive(Serialize)]
        struct Doc<'a> {
            #[serde(rename = "type")]
            kind: &'static str,
            title: &'a str,
            status: u16,
            detail: String,
            #[serde(skip_serializing_if = "Option::is_none")]
            record_id: Option<String>,
        }
        let doc = Doc {
            kind: self.type_uri(),
            title: self.title(),
            status: self.status().as_u16(),
            detail: detail.into(),
            record_id: record.map(|r| r.to_string()),
        };
        // Serializing a struct of strings cannot fail; fall back to an empty object anyway
        // rather than panic on the request path.
        let body = serde_json::to_vec(&doc).unwrap_or_else(|_| b"{}".to_vec());
        let mut res = Response::new(crate::body::full(body));
        // What the route's error format needs to write the same answer in its dialect
        // (see [`in_dialect`]), kept beside the problem document rather than parsed back.
        res.extensions_mut().insert(Said {
            problem: self,
            detail: doc.detail,
            record_id: doc.record_id,
            retry_after: retry_after_secs,
        });
        *res.status_mut() = self.status();
        let h = res.headers_mut();
        h.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        h.insert(IDEMGATE_ERROR, HeaderValue::from_static(self.name()));
        h.insert(
            SHOULD_RETRY,
            HeaderValue::from_static(if self.should_retry() { "true" } else { "false" }),
        );
        if let Some(secs) = retry_after_secs {
            h.insert(RETRY_AFTER, HeaderValue::from(secs));
        }
        res
    }
}

/// What a problem response said, kept in its extensions for [`in_dialect`].
#[derive(Debug, Clone)]
struct Said {
    problem: Problem,
    detail: String,
    record_id: Option<String>,
    retry_after: Option<u64>,
}

/// The shape of idemgate's own answers on a route (`error_format`): the API's dialect, so
/// that its clients (and their SDKs) read idemgate's refusals as the errors they are.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum ErrorFormat {
    /// RFC 9457 `application/problem+json` (the default).
    #[default]
    Problem,
    /// Stripe's: `{"error": {"type", "code", "message", "doc_url"}}`, with the types its
    /// SDKs map to exception classes and `Stripe-Should-Retry` where a retry is safe.
    Stripe,
    /// An API's own JSON shape: a document whose strings may hold the placeholders of
    /// [`PLACEHOLDERS`] (see [`render_template`]).
    Template(std::sync::Arc<Template>),
}

/// A route's `error_template`, checked, with its `error_codes`.
#[derive(Debug, Clone, PartialEq)]
pub struct Template {
    doc: serde_json::Value,
    codes: Vec<(Problem, String)>,
}

impl Template {
    /// `doc` as [`parse_template`] gave it; `codes` what `{code}` writes for each problem
    /// named (the others write their own name).
    pub fn new(doc: serde_json::Value, codes: Vec<(Problem, String)>) -> Template {
        Template { doc, codes }
    }

    fn code(&self, problem: Problem) -> &str {
        self.codes
            .iter()
            .find(|(p, _)| *p == problem)
            .map_or(problem.name(), |(_, code)| code.as_str())
    }
}

/// The placeholders a template may use.
pub const PLACEHOLDERS: [&str; 7] = [
    "status",
    "code",
    "problem",
    "title",
    "detail",
    "record_id",
    "retry_after",
];

/// Checks a template: a JSON document whose strings use no placeholder but those of
/// [`PLACEHOLDERS`]. The error names the first unknown one.
pub fn parse_template(text: &str) -> Result<serde_json::Value, String> {
    let doc: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("not a JSON document: {e}"))?;
    fn check(v: &serde_json::Value) -> Result<(), String> {
        match v {
            serde_json::Value::String(s) => {
                let mut rest = s.as_str();
                while let Some(open) = rest.find('{') {
                    let after = &rest[open + 1..];
                    let Some(close) = after.find('}') else { break };
                    let name = &after[..close];
                    if name.chars().all(|c| c.is_ascii_lowercase() || c == '_')
                        && !name.is_empty()
                        && !PLACEHOLDERS.contains(&name)
                    {
                        return Err(format!(
                            "unknown placeholder {{{name}}}; the placeholders are {}",
                            PLACEHOLDERS.map(|p| format!("{{{p}}}")).join(", ")
                        ));
                    }
                    rest = &after[close + 1..];
                }
                Ok(())
            }
            serde_json::Value::Array(a) => a.iter().try_for_each(check),
            serde_json::Value::Object(o) => o.values().try_for_each(check),
            _ => Ok(()),
        }
    }
    check(&doc)?;
    Ok(doc)
}

/// Fills a template: a string that is exactly one placeholder becomes that value with its
/// JSON type (`{status}` and `{retry_after}` numbers, `{record_id}` and `{retry_after}`
/// `null` when there is none); placeholders inside a longer string are replaced by their
/// text. Keys are left as written.
fn render_template(template: &Template, said: &Said) -> serde_json::Value {
    fill(&template.doc, template.code(said.problem), said)
}

/// [`render_template`]'s walk over the document, with `{code}` already chosen.
fn fill(template: &serde_json::Value, code: &str, said: &Said) -> serde_json::Value {
    use serde_json::Value;
    let status = said.problem.status().as_u16();
    let typed = |name: &str| -> Option<Value> {
        Some(match name {
            "status" => Value::from(status),
            "code" => Value::from(code),
            "problem" => Value::from(said.problem.name()),
            "title" => Value::from(said.problem.title()),
            "detail" => Value::from(said.detail.as_str()),
            "record_id" => said.record_id.clone().map_or(Value::Null, Value::from),
            "retry_after" => said.retry_after.map_or(Value::Null, Value::from),
            _ => return None,
        })
    };
    match template {
        Value::String(s) => {
            if let Some(name) = s.strip_prefix('{').and_then(|r| r.strip_suffix('}')) {
                if let Some(v) = typed(name) {
                    return v;
                }
            }
            let mut out = s.clone();
            for name in PLACEHOLDERS {
                let pat = format!("{{{name}}}");
                if out.contains(&pat) {
                    let text = match typed(name) {
                        Some(Value::String(t)) => t,
                        Some(Value::Null) | None => String::new(),
                        Some(other) => other.to_string(),
                    };
                    out = out.replace(&pat, &text);
                }
            }
            Value::String(out)
        }
        Value::Array(a) => Value::Array(a.iter().map(|v| fill(v, code, said)).collect()),
        Value::Object(o) => Value::Object(
            o.iter()
                .map(|(k, v)| (k.clone(), fill(v, code, said)))
                .collect(),
        ),
        other => other.clone(),
    }
}

/// Stripe's error `type` for a problem (what its SDKs map to exception classes) and its
/// `code`; whether `Stripe-Should-Retry` says a retry is safe is [`Problem::should_retry`].
fn stripe_error(problem: Problem) -> (&'static str, &'static str) {
    match problem {
        Problem::FingerprintMismatch => ("idempotency_error", "idempotency_key_reused"),
        // Stripe's own answer to a concurrent request with the key: retried by the SDKs,
        // which then get the first execution's answer replayed.
        Problem::InProgress => ("invalid_request_error", "idempotency_key_in_use"),
        Problem::InvalidToken => ("authentication_error", "invalid_token"),
        Problem::MissingKey
        | Problem::InvalidKey
        | Problem::MissingTenant
        | Problem::InvalidPath
        | Problem::InvalidMethodOverride
        | Problem::InvalidMethod
        | Problem::InvalidHeader
        | Problem::MethodNotAllowed
        | Problem::BodyTooLarge
        | Problem::TooManyCodings
        | Problem::BodyTimeout
        | Problem::BodyUnreadable
        | Problem::TrailersNotSupported
        | Problem::OwnerBusy
        | Problem::AdminHostRefused
        | Problem::CrossOriginRefused
        | Problem::UnsupportedMediaType
        | Problem::ReasonRequired => ("invalid_request_error", problem.code()),
        Problem::OperatorTokenRequired | Problem::RoleForbidden => {
            ("authentication_error", problem.code())
        }
        Problem::StoreUnavailable
        | Problem::UpstreamUnreachable
        | Problem::Overloaded
        | Problem::OutcomeUnknown
        | Problem::UpstreamTimeout
        | Problem::UpstreamBrokenAnswer
        | Problem::ResponseNotStored
        | Problem::RecordUnreadable
        | Problem::Internal => ("api_error", problem.code()),
    }
}

impl Problem {
    /// Whether the same request, sent again as it is, may succeed: the one table behind
    /// `x-should-retry` (every error format) and Stripe's `Stripe-Should-Retry`. `true`
    /// only where nothing was forwarded (the store, the upstream's connection or the
    /// slots were not there) or where a retry can only find the first execution (it is
    /// still running). Everything that may reflect an execution, or that the same request
    /// meets again, is `false`; a new problem is `false` until it is shown safe.
    pub fn should_retry(self) -> bool {
        match self {
            Problem::InProgress
            | Problem::Overloaded
            | Problem::StoreUnavailable
            | Problem::UpstreamUnreachable => true,
            Problem::MissingKey
            | Problem::InvalidKey
            | Problem::MissingTenant
            | Problem::InvalidToken
            | Problem::InvalidPath
            | Problem::InvalidMethodOverride
            | Problem::InvalidMethod
            | Problem::BodyTooLarge
            | Problem::TooManyCodings
            | Problem::BodyTimeout
            | Problem::BodyUnreadable
            | Problem::TrailersNotSupported
            | Problem::FingerprintMismatch
            | Problem::OutcomeUnknown
            | Problem::UpstreamTimeout
            | Problem::UpstreamBrokenAnswer
            | Problem::InvalidHeader
            | Problem::MethodNotAllowed
            | Problem::ResponseNotStored
            | Problem::OwnerBusy
            | Problem::RecordUnreadable
            | Problem::Internal
            | Problem::AdminHostRefused
            | Problem::CrossOriginRefused
            | Problem::UnsupportedMediaType
            | Problem::OperatorTokenRequired
            | Problem::RoleForbidden
            | Problem::ReasonRequired => false,
        }
    }
}

impl Problem {
    /// The name with `_` for `-`, as error codes of JSON APIs are spelt.
    pub fn code(self) -> &'static str {
        match self {
            Problem::MissingKey => "missing_key",
            Problem::InvalidKey => "invalid_key",
            Problem::MissingTenant => "missing_tenant",
            Problem::InvalidToken => "invalid_token",
            Problem::InvalidPath => "invalid_path",
            Problem::InvalidMethodOverride => "invalid_method_override",
            Problem::InvalidMethod => "invalid_method",
            Problem::BodyTooLarge => "body_too_large",
            Problem::TooManyCodings => "too_many_codings",
            Problem::BodyTimeout => "body_timeout",
            Problem::BodyUnreadable => "body_unreadable",
            Problem::TrailersNotSupported => "trailers_not_supported",
            Problem::InProgress => "in_progress",
            Problem::FingerprintMismatch => "fingerprint_mismatch",
            Problem::OutcomeUnknown => "outcome_unknown",
            Problem::StoreUnavailable => "store_unavailable",
            Problem::UpstreamUnreachable => "upstream_unreachable",
            Problem::UpstreamTimeout => "upstream_timeout",
            Problem::UpstreamBrokenAnswer => "upstream_broken_answer",
            Problem::InvalidHeader => "invalid_header",
            Problem::MethodNotAllowed => "method_not_allowed",
            Problem::ResponseNotStored => "response_not_stored",
            Problem::Overloaded => "overloaded",
            Problem::OwnerBusy => "owner_busy",
            Problem::RecordUnreadable => "record_unreadable",
            Problem::Internal => "internal_error",
            Problem::AdminHostRefused => "admin_host_refused",
            Problem::CrossOriginRefused => "cross_origin_refused",
            Problem::UnsupportedMediaType => "unsupported_media_type",
            Problem::OperatorTokenRequired => "operator_token_required",
            Problem::RoleForbidden => "role_forbidden",
            Problem::ReasonRequired => "reason_required",
        }
    }
}

/// `res` in `format`: an answer of idemgate's own (made by [`Problem::response`]) is
/// written again in the route's dialect, with its status, `Idemgate-Error`, `Retry-After`
/// and every other header kept; any other answer (the upstream's, a replay) is returned as
/// it is.
pub fn in_dialect(mut res: Response<Body>, format: &ErrorFormat) -> Response<Body> {
    if *format == ErrorFormat::Problem {
        return res;
    }
    let Some(said) = res.extensions_mut().remove::<Said>() else {
        return res;
    };
    let doc = match format {
        ErrorFormat::Problem => return res,
        ErrorFormat::Stripe => {
            let (kind, code) = stripe_error(said.problem);
            // Stripe answers an idempotency error with 400, and its SDKs map the type to
            // their idempotency exception only under 400 (stripe-python reads a 422 as a
            // generic API error).
            if said.problem == Problem::FingerprintMismatch {
                *res.status_mut() = StatusCode::BAD_REQUEST;
            }
            if let Some(retry) = res.headers().get(SHOULD_RETRY).cloned() {
                res.headers_mut().insert(STRIPE_SHOULD_RETRY, retry);
            }
            let mut message = said.problem.title().to_string();
            if !said.detail.is_empty() {
                message = format!("{message}: {}", said.detail);
            }
            let mut error = serde_json::json!({
                "type": kind,
                "code": code,
                "message": message,
                "doc_url": said.problem.type_uri(),
            });
            if let Some(id) = &said.record_id {
                error["record_id"] = serde_json::Value::from(id.as_str());
            }
            serde_json::json!({ "error": error })
        }
        ErrorFormat::Template(t) => render_template(t, &said),
    };
    let body = serde_json::to_vec(&doc).unwrap_or_else(|_| b"{}".to_vec());
    res.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    *res.body_mut() = crate::body::full(body);
    res
}

/// Stripe's header that tells its SDKs whether to retry.
pub const STRIPE_SHOULD_RETRY: &str = "stripe-should-retry";

/// The retry hint generated SDKs read (Stainless's among them), on every answer of
/// idemgate's own whatever its error format: [`Problem::should_retry`].
pub const SHOULD_RETRY: &str = "x-should-retry";

#[cfg(test)]
mod tests;
