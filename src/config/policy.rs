//! Routes resolved into policies: what applies to one request on a route, from the
//! defaults and the route's own settings.

use std::sync::Arc;
use std::time::Duration;

use hyper::header::{HeaderName, AUTHORIZATION};
use hyper::Method;

use super::{invalid, Anonymous, ConfigError, Defaults, Mode, OnAmbiguous, OnStoreError};
use super::{ErrorFormatName, MethodCase, OverrideParam, PathMatch, PathParams, RecordMode, Route};
use crate::fingerprint::{JsonPointer, QueryOrder, Rules};
use crate::retry_after::TypicalTime;
use crate::scope::method::OverrideParams;
use crate::scope::{path, PathRules, TenantSource};

/// The policy that applies to one request, resolved from defaults and its route.
#[derive(Debug, Clone)]
pub struct Policy {
    /// The route prefix that matched, or `None` for the defaults.
    pub route: Option<String>,
    /// Its place in [`Settings::modes`] (0 for the defaults, then the routes longest
    /// first): the row of its per-route metrics.
    pub index: usize,
    #[allow(missing_docs)]
    pub methods: Vec<Method>,
    #[allow(missing_docs)]
    pub require_key: bool,
    #[allow(missing_docs)]
    pub retention: Duration,
    #[allow(missing_docs)]
    pub lease: Duration,
    #[allow(missing_docs)]
    pub upstream_timeout: Duration,
    /// How long a duplicate waits for the first request of its key (zero: not at all).
    pub in_progress_wait: Duration,
    #[allow(missing_docs)]
    pub max_body_bytes: u64,
    #[allow(missing_docs)]
    pub max_content_codings: usize,
    #[allow(missing_docs)]
    pub max_response_bytes: u64,
    #[allow(missing_docs)]
    pub max_key_length: usize,
    /// Where the tenant comes from (`tenant_headers`, `tenant_jwt_claim` or
    /// `tenant_client_cert`).
    pub tenant: TenantSource,
    /// `tenant_qualifier_headers`: headers whose values are added to the principal.
    pub tenant_qualifiers: Vec<HeaderName>,
    #[allow(missing_docs)]
    pub anonymous: Anonymous,
    /// `path_match` and `case_insensitive_paths`.
    pub path_rules: PathRules,
    /// Which spellings the route says how its upstream reads; the others are refused on
    /// protected methods (see [`crate::config::route`]).
    pub spellings: Spellings,
    /// The route's path when it names parameters (`/v1/accounts/{id}/transfers`): matched
    /// segment by segment instead of as a prefix.
    pub template: Option<crate::scope::template::Template>,
    #[allow(missing_docs)]
    pub on_store_error: OnStoreError,
    #[allow(missing_docs)]
    pub on_ambiguous: OnAmbiguous,
    #[allow(missing_docs)]
    pub record_mode: RecordMode,
    #[allow(missing_docs)]
    pub mode: Mode,
    /// The shape of idemgate's own answers on this route.
    pub error_format: crate::problem::ErrorFormat,
    #[allow(missing_docs)]
    pub fingerprint_ignore: Vec<JsonPointer>,
    #[allow(missing_docs)]
    pub query_order: QueryOrder,
    #[allow(missing_docs)]
    pub path_params: PathParams,
    /// `format_suffixes` without their dots (lower case on a case-insensitive route).
    pub format_suffixes: Vec<String>,
    /// Headers that carry the key, the preferred first.
    pub key_headers: Vec<HeaderName>,
    /// Statuses whose answers are passed on and not recorded (the claim is released).
    pub release_on_status: Vec<u16>,
    /// The upstream's header that declines a record (`record_control_header`).
    pub record_control_header: Option<HeaderName>,
    /// Where in a JSON body the key is (`key_json_pointer`), as RFC 6901 text.
    pub key_json_pointer: Option<String>,
    /// Statuses whose records are kept only `short_retention`.
    pub short_retention_statuses: Vec<u16>,
    #[allow(missing_docs)]
    pub short_retention: Duration,
    /// Override headers the upstream honours (`method_override_headers`), lowercase.
    pub method_override_headers: Vec<HeaderName>,
    /// Where the upstream reads `_method` (`method_override_params`).
    pub override_params: OverrideParams,
    #[allow(missing_docs)]
    pub method_case: MethodCase,
    /// How long this route's upstream typically takes (measured while running), for the
    /// `Retry-After` of a 409 in-progress.
    pub upstream_time: Arc<TypicalTime>,
}

impl Policy {
    /// This route's settings of the fingerprint.
    pub fn fingerprint_rules(&self) -> Rules<'_> {
        Rules {
            ignore: &self.fingerprint_ignore,
            query_order: self.query_order,
        }
    }

    /// Whether requests with this method are protected.
    pub fn protects(&self, method: &Method) -> bool {
        self.methods.contains(method)
    }
}

/// A route's settings over the defaults, and the names that its errors give keys.
struct Layers<'a> {
    /// Where the route is written (`routes[0]`).
    at: &'a str,
    r: &'a Route,
    d: &'a Defaults,
}

impl Layers<'_> {
    /// The key a problem with `name` is reported under: the route's own, when it sets
    /// it, else the defaults'.
    fn key(&self, name: &str) -> String {
        if matches_override(self.r, name) {
            format!("{}.{name}", self.at)
        } else {
            format!("defaults.{name}")
        }
    }
}

/// The policy of one route (or of the defaults alone, with an empty `r`), each value
/// checked; the first problem found.
pub(super) fn resolve(
    at: &str,
    route: Option<String>,
    d: &Defaults,
    r: &Route,
    jwt_keys: bool,
    client_ca: bool,
) -> Result<Policy, ConfigError> {
    // The framework's preset fills what the route leaves unset.
    let r = &super::framework::apply(r, d);
    let l = Layers { at, r, d };
    let key_of = |name: &str| l.key(name);
    let methods = methods(&l)?;
    let tenant = tenant(&l, jwt_keys, client_ca)?;
    let tenant_qualifiers = tenant_qualifiers(&l)?;
    let (path_rules, spellings) = path_rules(&l);
    let format_suffixes = format_suffixes(&l, path_rules.case_insensitive)?;
    let mut fingerprint_ignore = fingerprint_ignore(&l)?;
    let key_headers = key_headers(&l)?;
    let release_on_status = statuses(
        &l,
        "release_on_status",
        (r.release_on_status.as_ref(), &d.release_on_status),
        400..=599,
    )?;
    let key_json_pointer = key_json_pointer(&l)?;
    // The key is not the request: its member is left out of the fingerprint, so that the
    // same request under two keys is a mismatch of nothing but its key.
    if let Some(p) = &key_json_pointer {
        if let Ok(pointer) = JsonPointer::parse(p) {
            fingerprint_ignore.push(pointer);
        }
    }
    let record_control_header = record_control_header(&l)?;
    let short_retention_statuses = statuses(
        &l,
        "short_retention_statuses",
        (
            r.short_retention_statuses.as_ref(),
            &d.short_retention_statuses,
        ),
        400..=499,
    )?;
    let method_override_headers = method_override_headers(&l, &key_headers)?;
    let p = Policy {
        route,
        methods,
        require_key: r.require_key.unwrap_or(d.require_key),
        retention: r.retention.unwrap_or(d.retention),
        lease: r.lease.unwrap_or(d.lease),
        upstream_timeout: r.upstream_timeout.unwrap_or(d.upstream_timeout),
        in_progress_wait: r.in_progress_wait.unwrap_or(d.in_progress_wait),
        max_body_bytes: r.max_body_bytes.unwrap_or(d.max_body_bytes),
        max_content_codings: r.max_content_codings.unwrap_or(d.max_content_codings),
        max_response_bytes: r.max_response_bytes.unwrap_or(d.max_response_bytes),
        max_key_length: r.max_key_length.unwrap_or(d.max_key_length),
        tenant,
        tenant_qualifiers,
        anonymous: r.anonymous.unwrap_or(d.anonymous),
        path_rules,
        spellings,
        template: None,
        on_store_error: r.on_store_error.unwrap_or(d.on_store_error),
        on_ambiguous: r.on_ambiguous.unwrap_or(d.on_ambiguous),
        record_mode: r.record_mode.unwrap_or(d.record_mode),
        mode: r.mode.unwrap_or(d.mode),
        error_format: error_format(r, d, &key_of)?,
        fingerprint_ignore,
        query_order: r.query_order.unwrap_or(d.query_order),
        path_params: r.path_params.unwrap_or(d.path_params),
        format_suffixes,
        key_headers,
        release_on_status,
        record_control_header,
        key_json_pointer,
        short_retention_statuses,
        short_retention: r.short_retention.unwrap_or(d.short_retention),
        method_override_headers,
        override_params: {
            let params = r
                .method_override_params
                .as_ref()
                .unwrap_or(&d.method_override_params);
            OverrideParams {
                query: params.contains(&OverrideParam::Query),
                body: params.contains(&OverrideParam::Body),
            }
        },
        method_case: r.method_case.unwrap_or(d.method_case),
        upstream_time: Arc::default(),
        index: 0,
    };
    check_times_and_sizes(&p, &l)?;
    Ok(p)
}

/// `methods`, as HTTP methods (upper-cased).
fn methods(l: &Layers) -> Result<Vec<Method>, ConfigError> {
    l.r.methods
        .as_ref()
        .unwrap_or(&l.d.methods)
        .iter()
        .map(|m| {
            Method::from_bytes(m.to_ascii_uppercase().as_bytes())
                .map_err(|_| invalid(l.key("methods"), format!("`{m}` is not an HTTP method")))
        })
        .collect()
}

/// Where the tenant comes from: a JWT claim, a client certificate's field or headers.
fn tenant(l: &Layers, jwt_keys: bool, client_ca: bool) -> Result<TenantSource, ConfigError> {
    let (r, d) = (l.r, l.d);
    let tenant_header_names = r
        .tenant_headers
        .as_ref()
        .unwrap_or(&d.tenant_headers)
        .iter()
        .map(|h| {
            HeaderName::from_bytes(h.as_bytes()).map_err(|_| {
                invalid(
                    l.key("tenant_headers"),
                    format!("`{h}` is not a header name"),
                )
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    // A certificate is a route's one principal source: a route that names it with a claim
    // or headers is refused, as are defaults naming both a claim and a certificate field
    // (the defaults' headers always have a value, so they give way to either). A claim
    // beside headers keeps its older meaning: the claim wins.
    let named = [
        ("tenant_jwt_claim", r.tenant_jwt_claim.is_some()),
        ("tenant_client_cert", r.tenant_client_cert.is_some()),
        ("tenant_headers", r.tenant_headers.is_some()),
    ];
    let set: Vec<&str> = named.iter().filter(|(_, s)| *s).map(|(n, _)| *n).collect();
    if r.tenant_client_cert.is_some() {
        if let Some(other) = set.iter().find(|n| **n != "tenant_client_cert") {
            return Err(invalid(
                format!("{}.tenant_client_cert", l.at),
                format!("a route reads its tenant from one source: {other} is set too"),
            ));
        }
    }
    if d.tenant_jwt_claim.is_some() && d.tenant_client_cert.is_some() {
        return Err(invalid(
            "defaults.tenant_client_cert",
            "a route reads its tenant from one source: tenant_jwt_claim is set too",
        ));
    }
    // A route's own choice wins: its `tenant_jwt_claim`, `tenant_client_cert` or
    // `tenant_headers`, else the defaults' claim or certificate field, else the defaults'
    // headers.
    let own = !set.is_empty();
    let cert = match (r.tenant_client_cert, own) {
        (Some(f), _) => Some(f),
        (None, true) => None,
        (None, false) => d.tenant_client_cert,
    };
    if cert.is_some() && !client_ca {
        return Err(invalid(
            l.key("tenant_client_cert"),
            "needs verified client certificates: a TLS listener (tls_cert_file, tls_key_file) with tls_client_ca_file",
        ));
    }
    let claim = match (&r.tenant_jwt_claim, own) {
        (Some(c), _) => Some(c),
        (None, true) => None,
        (None, false) => d.tenant_jwt_claim.as_ref(),
    };
    Ok(match claim {
        Some(c) if c.is_empty() => {
            return Err(invalid(l.key("tenant_jwt_claim"), "must name a claim"))
        }
        Some(_) if !jwt_keys => {
            return Err(invalid(
                l.key("tenant_jwt_claim"),
                "needs keys to verify tokens with: set jwt_hs256_secret (or IDEMGATE_JWT_HS256_SECRET) and/or jwks_file",
            ))
        }
        Some(c) => TenantSource::JwtClaim(c.clone()),
        None => match cert {
            Some(field) => TenantSource::ClientCert(field),
            // No tenant setting anywhere: the credential, wherever the API carries it.
            // On a route that shares an anonymous scope, `Authorization` alone, as before
            // `X-Api-Key` was read: a request with only a key stays anonymous there.
            None if !own && is_builtin(&tenant_header_names) => {
                match r.anonymous.unwrap_or(d.anonymous) {
                    Anonymous::Refuse => TenantSource::Credentials,
                    Anonymous::Shared => TenantSource::Headers(vec![AUTHORIZATION]),
                }
            }
            None => TenantSource::Headers(tenant_header_names),
        },
    })
}

/// `tenant_qualifier_headers`: each a header name, each once.
fn tenant_qualifiers(l: &Layers) -> Result<Vec<HeaderName>, ConfigError> {
    let mut names: Vec<HeaderName> = Vec::new();
    for h in
        l.r.tenant_qualifier_headers
            .as_ref()
            .unwrap_or(&l.d.tenant_qualifier_headers)
    {
        let key = || l.key("tenant_qualifier_headers");
        let name = HeaderName::from_bytes(h.as_bytes())
            .map_err(|_| invalid(key(), format!("`{h}` is not a header name")))?;
        if names.contains(&name) {
            return Err(invalid(key(), format!("`{h}` is named twice")));
        }
        names.push(name);
    }
    Ok(names)
}

/// Whether `names` is `tenant_headers`' built-in value, `["Authorization", "X-Api-Key"]`
/// (names in any case).
fn is_builtin(names: &[HeaderName]) -> bool {
    names == [AUTHORIZATION, crate::scope::tenant::X_API_KEY]
}

/// How paths compare (`path_match`, `case_insensitive_paths`, `plus_is_space`), and which
/// spellings the route says how its upstream reads.
fn path_rules(l: &Layers) -> (PathRules, Spellings) {
    let (r, d) = (l.r, l.d);
    let case = r.case_insensitive_paths.or(d.case_insensitive_paths);
    let plus = r.plus_is_space.or(d.plus_is_space);
    let path_rules = PathRules {
        strict: r.path_match.unwrap_or(d.path_match) == PathMatch::Strict,
        case_insensitive: case.unwrap_or(false),
        plus_is_space: plus.unwrap_or(false),
    };
    let spellings = Spellings {
        case_known: case.is_some(),
        plus_known: plus.is_some(),
        raw_utf8: r.raw_utf8_paths.or(d.raw_utf8_paths).unwrap_or(false),
    };
    (path_rules, spellings)
}

/// `format_suffixes` without their dots, each once (lower case on a case-insensitive
/// route).
fn format_suffixes(l: &Layers, case_insensitive: bool) -> Result<Vec<String>, ConfigError> {
    let mut format_suffixes = Vec::new();
    for f in l.r.format_suffixes.as_ref().unwrap_or(&l.d.format_suffixes) {
        let ext = path::FormatExt::of(f).ok_or_else(|| {
            invalid(
                l.key("format_suffixes"),
                format!("`{f}` is not a format suffix: a '.' and 1 to 5 letters or digits, such as \".json\""),
            )
        })?;
        let ext = if case_insensitive {
            ext.as_str().to_ascii_lowercase()
        } else {
            ext.as_str().to_string()
        };
        if !format_suffixes.contains(&ext) {
            format_suffixes.push(ext);
        }
    }
    Ok(format_suffixes)
}

/// `fingerprint_ignore`, as JSON pointers.
fn fingerprint_ignore(l: &Layers) -> Result<Vec<JsonPointer>, ConfigError> {
    l.r.fingerprint_ignore
        .as_ref()
        .unwrap_or(&l.d.fingerprint_ignore)
        .iter()
        .map(|p| {
            JsonPointer::parse(p)
                .map_err(|e| invalid(l.key("fingerprint_ignore"), format!("`{p}`: {e}")))
        })
        .collect()
}

/// `key_headers`: at least one, each once.
fn key_headers(l: &Layers) -> Result<Vec<HeaderName>, ConfigError> {
    let mut key_headers: Vec<HeaderName> = Vec::new();
    for h in l.r.key_headers.as_ref().unwrap_or(&l.d.key_headers) {
        let name = HeaderName::from_bytes(h.as_bytes())
            .map_err(|_| invalid(l.key("key_headers"), format!("`{h}` is not a header name")))?;
        if key_headers.contains(&name) {
            return Err(invalid(
                l.key("key_headers"),
                format!("`{h}` is listed twice"),
            ));
        }
        key_headers.push(name);
    }
    if key_headers.is_empty() {
        return Err(invalid(
            l.key("key_headers"),
            "must name at least one header",
        ));
    }
    Ok(key_headers)
}

/// `release_on_status` (4xx and 5xx) or `short_retention_statuses` (4xx), named `name`:
/// the route's own list, else the defaults'; `allowed` says which statuses it may hold.
fn statuses(
    l: &Layers,
    name: &str,
    (own, default): (Option<&Vec<u16>>, &Vec<u16>),
    allowed: std::ops::RangeInclusive<u16>,
) -> Result<Vec<u16>, ConfigError> {
    let statuses = own.unwrap_or(default).clone();
    if let Some(bad) = statuses.iter().find(|s| !allowed.contains(*s)) {
        let why = if *allowed.end() < 500 {
            "only 4xx answers can show that nothing ran"
        } else {
            "only 4xx and 5xx answers can say that nothing was done"
        };
        return Err(invalid(l.key(name), format!("{bad}: {why}")));
    }
    Ok(statuses)
}

/// `key_json_pointer`, checked: a JSON pointer, on a route that requires a key.
fn key_json_pointer(l: &Layers) -> Result<Option<String>, ConfigError> {
    let key_json_pointer =
        l.r.key_json_pointer
            .as_ref()
            .or(l.d.key_json_pointer.as_ref());
    if let Some(p) = key_json_pointer {
        JsonPointer::parse(p)
            .map_err(|e| invalid(l.key("key_json_pointer"), format!("`{p}`: {e}")))?;
        if !l.r.require_key.unwrap_or(l.d.require_key) {
            return Err(invalid(
                l.key("key_json_pointer"),
                "needs require_key = true: a request whose body holds no key cannot be forwarded unprotected once its body was read as a protected one",
            ));
        }
    }
    Ok(key_json_pointer.cloned())
}

/// `record_control_header`, as a header name.
fn record_control_header(l: &Layers) -> Result<Option<HeaderName>, ConfigError> {
    match l
        .r
        .record_control_header
        .as_ref()
        .or(l.d.record_control_header.as_ref())
    {
        None => Ok(None),
        Some(h) => Ok(Some(HeaderName::from_bytes(h.as_bytes()).map_err(
            |_| {
                invalid(
                    l.key("record_control_header"),
                    format!("`{h}` is not a header name"),
                )
            },
        )?)),
    }
}

/// `method_override_headers`: each once, none that carries the key or the credential.
fn method_override_headers(
    l: &Layers,
    key_headers: &[HeaderName],
) -> Result<Vec<HeaderName>, ConfigError> {
    let mut method_override_headers: Vec<HeaderName> = Vec::new();
    for h in
        l.r.method_override_headers
            .as_ref()
            .unwrap_or(&l.d.method_override_headers)
    {
        let name = HeaderName::from_bytes(h.as_bytes()).map_err(|_| {
            invalid(
                l.key("method_override_headers"),
                format!("`{h}` is not a header name"),
            )
        })?;
        if method_override_headers.contains(&name) {
            return Err(invalid(
                l.key("method_override_headers"),
                format!("`{h}` is listed twice"),
            ));
        }
        if key_headers.contains(&name) || name == hyper::header::AUTHORIZATION {
            return Err(invalid(
                l.key("method_override_headers"),
                format!("`{h}` already carries the key or the credential"),
            ));
        }
        method_override_headers.push(name);
    }
    Ok(method_override_headers)
}

/// The durations and sizes of a resolved policy, against each other and their bounds.
fn check_times_and_sizes(p: &Policy, l: &Layers) -> Result<(), ConfigError> {
    if p.short_retention.is_zero() {
        return Err(invalid(
            l.key("short_retention"),
            "must be greater than zero (remove the status from short_retention_statuses to keep its answers for retention)",
        ));
    }
    if p.lease < Duration::from_millis(100) {
        return Err(invalid(l.key("lease"), "must be at least 100ms"));
    }
    if p.upstream_timeout.is_zero() {
        return Err(invalid(
            l.key("upstream_timeout"),
            "must be greater than zero",
        ));
    }
    if p.retention <= p.upstream_timeout || p.retention <= p.lease {
        return Err(invalid(
            l.key("retention"),
            "must be longer than both lease and upstream_timeout, or records would expire while their request runs",
        ));
    }
    if !(1..=4096).contains(&p.max_key_length) {
        return Err(invalid(
            l.key("max_key_length"),
            "must be between 1 and 4096",
        ));
    }
    if p.max_body_bytes == 0 {
        return Err(invalid(l.key("max_body_bytes"), "must be at least 1"));
    }
    if p.max_response_bytes == 0 {
        return Err(invalid(l.key("max_response_bytes"), "must be at least 1"));
    }
    Ok(())
}

/// The route's error format, its template parsed and checked.
fn error_format(
    r: &Route,
    d: &Defaults,
    key_of: &dyn Fn(&str) -> String,
) -> Result<crate::problem::ErrorFormat, ConfigError> {
    use crate::problem::ErrorFormat;
    let template = r.error_template.as_ref().or(d.error_template.as_ref());
    let format = r.error_format.unwrap_or(d.error_format);
    if r.error_codes.is_some() && format != ErrorFormatName::Template {
        return Err(invalid(
            key_of("error_codes"),
            "error_codes are the codes of error_format = \"template\"; this route's format \
             writes its own",
        ));
    }
    Ok(match format {
        ErrorFormatName::Problem => ErrorFormat::Problem,
        ErrorFormatName::Stripe => ErrorFormat::Stripe,
        ErrorFormatName::Template => {
            let text = template.ok_or_else(|| {
                invalid(
                    key_of("error_template"),
                    "error_format = \"template\" needs error_template, a JSON document",
                )
            })?;
            let doc = crate::problem::parse_template(text)
                .map_err(|e| invalid(key_of("error_template"), e))?;
            let codes = error_codes(r, d, key_of)?;
            ErrorFormat::Template(std::sync::Arc::new(crate::problem::Template::new(
                doc, codes,
            )))
        }
    })
}

/// `[defaults]`' `error_codes`, then the route's over them, each naming a problem.
fn error_codes(
    r: &Route,
    d: &Defaults,
    key_of: &dyn Fn(&str) -> String,
) -> Result<Vec<(crate::problem::Problem, String)>, ConfigError> {
    use crate::problem::Problem;
    let mut merged = d.error_codes.clone().unwrap_or_default();
    merged.extend(r.error_codes.clone().unwrap_or_default());
    merged
        .into_iter()
        .map(|(name, code)| {
            let problem = Problem::ALL
                .iter()
                .find(|p| p.name() == name)
                .ok_or_else(|| {
                    invalid(
                        key_of("error_codes"),
                        format!(
                            "`{name}` is not a problem idemgate answers; the problems are {}",
                            Problem::ALL
                                .iter()
                                .map(|p| p.name())
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    )
                })?;
            Ok((*problem, code))
        })
        .collect()
}

fn matches_override(r: &Route, name: &str) -> bool {
    match name {
        "methods" => r.methods.is_some(),
        "tenant_headers" => r.tenant_headers.is_some(),
        "tenant_jwt_claim" => r.tenant_jwt_claim.is_some(),
        "tenant_client_cert" => r.tenant_client_cert.is_some(),
        "tenant_qualifier_headers" => r.tenant_qualifier_headers.is_some(),
        "fingerprint_ignore" => r.fingerprint_ignore.is_some(),
        "key_headers" => r.key_headers.is_some(),
        "release_on_status" => r.release_on_status.is_some(),
        "short_retention_statuses" => r.short_retention_statuses.is_some(),
        "short_retention" => r.short_retention.is_some(),
        "method_override_headers" => r.method_override_headers.is_some(),
        "method_override_params" => r.method_override_params.is_some(),
        "method_case" => r.method_case.is_some(),
        "lease" => r.lease.is_some(),
        "upstream_timeout" => r.upstream_timeout.is_some(),
        "in_progress_wait" => r.in_progress_wait.is_some(),
        "retention" => r.retention.is_some(),
        "max_key_length" => r.max_key_length.is_some(),
        "max_body_bytes" => r.max_body_bytes.is_some(),
        "max_content_codings" => r.max_content_codings.is_some(),
        "max_response_bytes" => r.max_response_bytes.is_some(),
        "error_format" => r.error_format.is_some(),
        "record_control_header" => r.record_control_header.is_some(),
        "key_json_pointer" => r.key_json_pointer.is_some(),
        "error_template" => r.error_template.is_some(),
        "error_codes" => r.error_codes.is_some(),
        _ => false,
    }
}

/// What a route says of the path spellings on which frameworks disagree: where it says
/// nothing, a protected path that depends on one is refused (400 `invalid-path`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Spellings {
    /// `case_insensitive_paths` is set (or a preset knows): a path that is this route's
    /// only when letter case is ignored is matched by that setting, not refused.
    pub case_known: bool,
    /// `plus_is_space` is set (or a preset knows): a raw `+` is read by it, not refused.
    pub plus_known: bool,
    /// `raw_utf8_paths = true`: raw bytes beyond ASCII are the UTF-8 of their escapes.
    pub raw_utf8: bool,
}

#[cfg(test)]
mod tests {
    use figment::providers::Serialized;
    use figment::Figment;

    use super::*;
    use crate::config::tests::settings;
    use crate::config::{unknown_env_vars, Config};

    #[test]
    fn query_order_is_a_route_setting() {
        let s = settings(
            r#"
            [defaults]
            query_order = "significant"
            [[routes]]
            path = "/v1/sorted"
            query_order = "sorted"
            "#,
        )
        .unwrap();
        assert_eq!(s.policy_for("/v1/x").query_order, QueryOrder::Significant);
        assert_eq!(s.policy_for("/v1/sorted").query_order, QueryOrder::Sorted);
        let s = settings("").unwrap();
        assert_eq!(s.policy_for("/").query_order, QueryOrder::Sorted);
        assert!(settings("[defaults]\nquery_order = \"random\"").is_err());
    }

    #[test]
    fn record_mode_defaults_to_before_response_and_routes_override_it() {
        let s = settings("").unwrap();
        assert_eq!(s.default_policy.record_mode, RecordMode::BeforeResponse);
        let s = settings(
            r#"
            [defaults]
            record_mode = "after_response"
            [[routes]]
            path = "/v1/transfers"
            record_mode = "before_response"
            [[routes]]
            path = "/v1/quotes"
            "#,
        )
        .unwrap();
        assert_eq!(s.default_policy.record_mode, RecordMode::AfterResponse);
        assert_eq!(
            s.policy_for("/v1/transfers").record_mode,
            RecordMode::BeforeResponse
        );
        assert_eq!(
            s.policy_for("/v1/quotes").record_mode,
            RecordMode::AfterResponse
        );
        let s = settings("[[routes]]\npath = \"/a\"\nrecord_mode = \"after_response\"").unwrap();
        assert_eq!(s.policy_for("/a").record_mode, RecordMode::AfterResponse);
        assert_eq!(s.default_policy.record_mode, RecordMode::BeforeResponse);
        // The environment's form: `IDEMGATE_DEFAULTS__RECORD_MODE=after_response` names a
        // setting, and its value is read as this string.
        assert!(
            unknown_env_vars(["IDEMGATE_DEFAULTS__RECORD_MODE".to_string()].into_iter()).is_empty()
        );
        let env = Figment::from(Serialized::defaults(Config::default())).merge(
            Serialized::default("defaults.record_mode", "after_response"),
        );
        let s = Config::load(env).unwrap();
        assert_eq!(s.default_policy.record_mode, RecordMode::AfterResponse);
        for (toml, key) in [
            (
                "[defaults]\nrecord_mode = \"after\"",
                "defaults.record_mode",
            ),
            (
                "[defaults]\nrecord_mode = \"AfterResponse\"",
                "defaults.record_mode",
            ),
            (
                "[[routes]]\npath = \"/a\"\nrecord_mode = \"later\"",
                "record_mode",
            ),
        ] {
            let err = settings(toml).unwrap_err().to_string();
            assert!(err.contains(key), "{toml:?}: {err}");
        }
    }
}
