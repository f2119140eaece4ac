//! The responses idemgate makes itself: RFC 9457 `application/problem+json`, one stable
//! `type` per case, produced in one place so every synthetic answer looks the same.

use hyper::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use hyper::{Response, StatusCode};
use serde::Serialize;

use crate::body::Body;
use crate::key::RecordId;

/// Header that marks a response as idemgate's own (not the upstream's), carrying the
/// problem name, so clients and the lab can tell idemgate's 409/422 from the upstream's.
pub const IDEMGATE_ERROR: &str = "idemgate-error";

/// Base of every problem `type` URI.
pub const TYPE_BASE: &str = "https://idemgate.dev/problems/";

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
    /// The body is larger than `max_body_bytes`.
    BodyTooLarge,
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
    /// The request was executed, but its answer was too large to keep, so it cannot be
    /// replayed.
    ResponseNotStored,
    /// Too many protected requests are in flight (`max_in_flight`); nothing was claimed.
    Overloaded,
    /// Admin API: a release refused because the record's owner may still be working on it.
    OwnerBusy,
    /// A recorded answer exists and cannot be opened (its encryption key was removed).
    RecordUnreadable,
}

impl Problem {
    /// The short, stable name (last segment of the `type` URI).
    pub fn name(self) -> &'static str {
        match self {
            Problem::MissingKey => "missing-key",
            Problem::InvalidKey => "invalid-key",
            Problem::MissingTenant => "missing-tenant",
            Problem::InvalidToken => "invalid-token",
            Problem::InvalidPath => "invalid-path",
            Problem::InvalidMethodOverride => "invalid-method-override",
            Problem::BodyTooLarge => "body-too-large",
            Problem::BodyTimeout => "body-timeout",
            Problem::BodyUnreadable => "body-unreadable",
            Problem::TrailersNotSupported => "trailers-not-supported",
            Problem::InProgress => "in-progress",
            Problem::FingerprintMismatch => "fingerprint-mismatch",
            Problem::OutcomeUnknown => "outcome-unknown",
            Problem::StoreUnavailable => "store-unavailable",
            Problem::UpstreamUnreachable => "upstream-unreachable",
            Problem::UpstreamTimeout => "upstream-timeout",
            Problem::ResponseNotStored => "response-not-stored",
            Problem::Overloaded => "overloaded",
            Problem::OwnerBusy => "owner-busy",
            Problem::RecordUnreadable => "record-unreadable",
        }
    }

    /// The HTTP status of this case.
    pub fn status(self) -> StatusCode {
        match self {
            Problem::MissingKey
            | Problem::InvalidKey
            | Problem::MissingTenant
            | Problem::InvalidPath
            | Problem::InvalidMethodOverride => StatusCode::BAD_REQUEST,
            Problem::InvalidToken => StatusCode::UNAUTHORIZED,
            Problem::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
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
            Problem::RecordUnreadable => StatusCode::INTERNAL_SERVER_ERROR,
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
            Problem::BodyTooLarge => "The request body is too large",
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
            Problem::ResponseNotStored => {
                "The request with this Idempotency-Key was executed, but its answer was not kept"
            }
            Problem::Overloaded => "Too many requests are in progress",
            Problem::OwnerBusy => "The record's owner may still be working on it",
            Problem::RecordUnreadable => {
                "The recorded answer for this Idempotency-Key cannot be read"
            }
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
            kind: String,
            title: &'a str,
            status: u16,
            detail: String,
            #[serde(skip_serializing_if = "Option::is_none")]
            record_id: Option<String>,
        }
        let doc = Doc {
            kind: format!("{TYPE_BASE}{}", self.name()),
            title: self.title(),
            status: self.status().as_u16(),
            detail: detail.into(),
            record_id: record.map(|r| r.to_string()),
        };
        // Serializing a struct of strings cannot fail; fall back to an empty object anyway
        // rather than panic on the request path.
        let body = serde_json::to_vec(&doc).unwrap_or_else(|_| b"{}".to_vec());
        let mut res = Response::new(crate::body::full(body));
        *res.status_mut() = self.status();
        let h = res.headers_mut();
        h.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        h.insert(IDEMGATE_ERROR, HeaderValue::from_static(self.name()));
        if let Some(secs) = retry_after_secs {
            h.insert(RETRY_AFTER, HeaderValue::from(secs));
        }
        res
    }
}
