//! The keys of `[defaults]` and of a `[[routes]]` entry, as users write them: [`Defaults`]
//! (every key, with its default), [`Route`] (a path and the keys it overrides) and the
//! enums of their values. [`super::policy`] resolves them into a route's [`super::Policy`].

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::Framework;
use crate::fingerprint::QueryOrder;
use crate::scope::client_cert::CertField;

/// What to do when the store cannot be reached at claim time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnStoreError {
    /// 503 + Retry-After; the upstream is not called (default: at most once wins).
    Reject,
    /// Forward the request unprotected (availability wins over at most once).
    Forward,
}

/// What to do with a record whose request was sent but got no complete answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnAmbiguous {
    /// Keep it as `unknown`: retries get 409 until an operator releases it (default).
    Hold,
    /// Delete it: a retry executes again (only for upstreams that dedupe themselves).
    Release,
}

/// The shape of idemgate's own answers on a route (`error_format`): see
/// [`crate::problem::ErrorFormat`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorFormatName {
    /// RFC 9457 `application/problem+json` (the default).
    Problem,
    /// Stripe's `{"error": {"type", "code", "message", "doc_url"}}`.
    Stripe,
    /// `error_template`, a JSON document with placeholders.
    Template,
}

/// When a new key's recorded answer is written, relative to the client's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordMode {
    /// The answer is recorded, then sent to the client (default): once the client has it,
    /// every retry gets the replay.
    BeforeResponse,
    /// The answer is sent to the client as soon as the upstream's answer is complete, and
    /// recorded meanwhile: one store round trip less on the client's wait, but until the
    /// record lands a retry gets 409 `in-progress`, and if idemgate dies in that window the
    /// key reads as `unknown` although its client got the answer.
    AfterResponse,
}

/// Whether a route acts on what it decides, or only counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Refuse, replay and answer 409/422 as the flow decides (default).
    Enforce,
    /// Forward every request as if idemgate were not there, while claiming and recording
    /// as when enforcing, and count what enforcing would have done
    /// (`idemgate_observed_total`, `GET /observe`): the first step of a rollout.
    Observe,
}

/// What a protected request without a tenant gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Anonymous {
    /// 400 `missing-tenant`, nothing claimed or forwarded (default).
    Refuse,
    /// One scope shared by every request without a tenant on the route: two anonymous
    /// clients that pick the same key see each other's records.
    Shared,
}

/// How a route compares path spellings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PathMatch {
    /// RFC 3986 normalization, repeated slashes collapsed, a trailing slash ignored.
    Normalized,
    /// RFC 3986 normalization only: `/a/` and `/a`, `/a//b` and `/a/b` differ.
    Strict,
}

/// Policy for protected requests, as written under `[defaults]`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Defaults {
    /// Methods that are protected.
    pub methods: Vec<String>,
    /// Whether a protected request without a key gets 400.
    pub require_key: bool,
    /// How long a record lives, from its claim.
    #[serde(with = "humantime_serde")]
    pub retention: Duration,
    /// How long a claim stays `in_progress` without renewal.
    #[serde(with = "humantime_serde")]
    pub lease: Duration,
    /// How long the upstream gets for the whole exchange.
    #[serde(with = "humantime_serde")]
    pub upstream_timeout: Duration,
    /// How long a duplicate whose claim finds the first request still running waits for
    /// it before 409 `in-progress`: woken when the record lands or the first's lease runs
    /// out, it is answered as if it had arrived after the first. `0s`: 409 at once.
    #[serde(with = "humantime_serde")]
    pub in_progress_wait: Duration,
    /// Largest protected body that is buffered (413 above).
    pub max_body_bytes: u64,
    /// Most codings a protected request's `Content-Encoding` may name (415 above):
    /// each one is a decode of up to `max_body_bytes`.
    pub max_content_codings: usize,
    /// Largest upstream answer that is recorded; a larger one still reaches its client,
    /// streamed, but is recorded without its body.
    pub max_response_bytes: u64,
    /// Longest accepted key.
    pub max_key_length: usize,
    /// Headers whose values identify the tenant.
    pub tenant_headers: Vec<String>,
    /// When set, the tenant is this claim of the verified bearer JWT instead.
    pub tenant_jwt_claim: Option<String>,
    /// When set, the tenant is this field of the client certificate verified on the TLS
    /// listener (with the CA that verified it) instead: `"san_uri"` or `"subject"`.
    pub tenant_client_cert: Option<CertField>,
    /// Headers whose values refine whichever principal the route reads (on-behalf-of
    /// headers such as `PayPal-Auth-Assertion` or `Stripe-Account`): two values are two
    /// tenants, and an absent header is one more.
    pub tenant_qualifier_headers: Vec<String>,
    /// See [`Anonymous`].
    pub anonymous: Anonymous,
    /// See [`PathMatch`].
    pub path_match: PathMatch,
    /// How the upstream treats letter case in paths: `true` compares them
    /// case-insensitively (IIS/ASP.NET, Express, Koa), `false` case-sensitively. Unset (the
    /// default, unless a framework preset knows): a protected path that is a route's only
    /// when case is ignored is refused.
    pub case_insensitive_paths: Option<bool>,
    /// How the upstream reads a raw `+` in a path: `true` as a space (`%2B` the plus), as
    /// @koa/router 13 and older decode parameters; `false` as a plus. Unset (the default,
    /// unless a framework preset knows): a protected path with a raw `+` is refused.
    pub plus_is_space: Option<bool>,
    /// Whether the upstream reads raw bytes beyond ASCII in a path as UTF-8 (the same as
    /// their percent-escapes). Unset or `false` (the default): a protected path with such a
    /// byte is refused, since some frameworks read it as Latin-1 (Tornado).
    pub raw_utf8_paths: Option<bool>,
    /// The upstream's framework (`express`, `koa`, `fastify`, `flask`, `fastapi`, `django`,
    /// `rails`, `laravel`, `spring`, `jetty`, `go`): the path, method and override rules it
    /// uses, where this route (or `[defaults]`) does not set them itself.
    pub framework: Option<Framework>,
    /// See [`OnStoreError`].
    pub on_store_error: OnStoreError,
    /// See [`OnAmbiguous`].
    pub on_ambiguous: OnAmbiguous,
    /// See [`RecordMode`].
    pub record_mode: RecordMode,
    /// See [`Mode`].
    pub mode: Mode,
    /// See [`ErrorFormatName`].
    pub error_format: ErrorFormatName,
    /// With `error_format = "template"`: the JSON document of idemgate's own answers, its
    /// strings holding `{status}`, `{code}`, `{title}`, `{detail}`, `{record_id}`,
    /// `{retry_after}`, `{problem}`.
    pub error_template: Option<String>,
    /// With `error_format = "template"`: the code `{code}` writes for each named problem
    /// (`in-progress = "invalid_state"`), so that one template speaks an API whose errors
    /// differ by code; a problem not named keeps its own name. A route's entries go over
    /// these.
    pub error_codes: Option<std::collections::BTreeMap<String, String>>,
    /// JSON pointers left out of the fingerprint.
    pub fingerprint_ignore: Vec<String>,
    /// Whether the order of the query's pairs counts in the fingerprint.
    pub query_order: QueryOrder,
    /// See [`PathParams`].
    pub path_params: PathParams,
    /// Format suffixes (`".json"`) that are the same operation as the route's path without
    /// them (`/v1/transfers.json` is `/v1/transfers`). Other suffixes of 1 to 5 letters or
    /// digits on a route's last segment are refused on protected methods.
    pub format_suffixes: Vec<String>,
    /// Headers that carry the key, in order of preference (aliases such as
    /// `PayPal-Request-Id`): the first present is the key.
    pub key_headers: Vec<String>,
    /// Answers with these statuses reach the client and release the claim instead of being
    /// recorded, so a retry executes: for upstreams that answer them without doing any work.
    pub release_on_status: Vec<u16>,
    /// A response header by which the upstream declines to have an answer kept (its value
    /// `no-store`): the answer reaches the client, the claim is released, and a retry
    /// executes again. Never forwarded to the client; read from the upstream only.
    pub record_control_header: Option<String>,
    /// A JSON pointer (RFC 6901) to the key in the request's JSON body (Square's
    /// `/idempotency_key`): the key comes from there, the header still accepted when both
    /// agree (400 when they differ); the member is left out of the fingerprint. Needs
    /// `require_key = true`.
    pub key_json_pointer: Option<String>,
    /// Answers with these statuses show that nothing ran (authentication and authorization
    /// refusals): recorded, but kept only `short_retention`, and at the embedded store's
    /// record cap they make room before a new key is refused.
    pub short_retention_statuses: Vec<u16>,
    /// How long answers with a `short_retention_statuses` status are kept.
    #[serde(with = "humantime_serde")]
    pub short_retention: Duration,
    /// Method-override headers (`X-HTTP-Method-Override`...) that the upstream honours: a
    /// request is scoped, fingerprinted and protected as the method they name. Empty: a
    /// request that names another method in an override header or `_method` gets 400
    /// `invalid-method-override` where either method is protected.
    pub method_override_headers: Vec<String>,
    /// Where the upstream reads a `_method` override (`"query"`, `"body"`): there, the
    /// method it names is scoped, fingerprinted and protected. Elsewhere a `_method` naming
    /// another method gets 400 `invalid-method-override` where either method is protected.
    pub method_override_params: Vec<OverrideParam>,
    /// See [`MethodCase`].
    pub method_case: MethodCase,
}

/// What a route does with `;` path parameters (`/v1/transfers;jsessionid=A`), which servlet
/// containers (Jetty, Tomcat) cut off each segment before they route.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PathParams {
    /// Protected requests whose path has them get 400 `invalid-path` (default): with them,
    /// a request could reach the handler under a spelling that is another operation.
    #[default]
    Refuse,
    /// Left out of route matching, scope and fingerprint, and forwarded as sent: for
    /// upstreams whose clients put `;jsessionid=` into links.
    Strip,
}

/// What a route does with a protected method spelt in another letter case (`post`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MethodCase {
    /// 400 `invalid-method` (default): Django upper-cases `post` and runs the POST view,
    /// Express and most others route it nowhere, so it may be the protected operation.
    #[default]
    Refuse,
    /// The upstream upper-cases the method (Django): `post` is protected as `POST`, and
    /// forwarded as sent.
    Fold,
}

/// Where a `_method` field is a method override the upstream honours.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OverrideParam {
    /// `?_method=PATCH` (Express's `method-override('_method')`, Symfony, Laravel).
    Query,
    /// A `_method` field of a form-encoded or multipart POST body (Rack's
    /// `MethodOverride` in Rails and Sinatra, Laravel, Symfony).
    Body,
}

/// One `[[routes]]` entry: a path prefix and the settings it overrides.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)]
pub struct Route {
    /// A path prefix, matched at segment boundaries (`/v1/t` matches `/v1/t` and `/v1/t/9`).
    pub path: String,
    pub methods: Option<Vec<String>>,
    pub require_key: Option<bool>,
    #[serde(default, with = "humantime_serde")]
    pub retention: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub lease: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub upstream_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub in_progress_wait: Option<Duration>,
    pub max_body_bytes: Option<u64>,
    pub max_content_codings: Option<usize>,
    pub max_response_bytes: Option<u64>,
    pub max_key_length: Option<usize>,
    pub tenant_headers: Option<Vec<String>>,
    pub tenant_jwt_claim: Option<String>,
    pub tenant_client_cert: Option<CertField>,
    pub tenant_qualifier_headers: Option<Vec<String>>,
    pub anonymous: Option<Anonymous>,
    pub path_match: Option<PathMatch>,
    pub case_insensitive_paths: Option<bool>,
    pub plus_is_space: Option<bool>,
    pub raw_utf8_paths: Option<bool>,
    pub framework: Option<Framework>,
    pub on_store_error: Option<OnStoreError>,
    pub on_ambiguous: Option<OnAmbiguous>,
    pub record_mode: Option<RecordMode>,
    pub mode: Option<Mode>,
    pub error_format: Option<ErrorFormatName>,
    pub error_template: Option<String>,
    pub error_codes: Option<std::collections::BTreeMap<String, String>>,
    pub fingerprint_ignore: Option<Vec<String>>,
    pub query_order: Option<QueryOrder>,
    pub path_params: Option<PathParams>,
    pub format_suffixes: Option<Vec<String>>,
    pub key_headers: Option<Vec<String>>,
    pub release_on_status: Option<Vec<u16>>,
    pub record_control_header: Option<String>,
    pub key_json_pointer: Option<String>,
    pub short_retention_statuses: Option<Vec<u16>>,
    #[serde(default, with = "humantime_serde")]
    pub short_retention: Option<Duration>,
    pub method_override_headers: Option<Vec<String>>,
    pub method_override_params: Option<Vec<OverrideParam>>,
    pub method_case: Option<MethodCase>,
}
