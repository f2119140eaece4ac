//! The decision's table test and its edge cases.
use super::*;
use hyper::header::HeaderValue;
use hyper::Response;

use crate::outcome::Outcome;
use figment::providers::{Format, Serialized, Toml};
use figment::Figment;

use crate::config::Config;

const ROUTES: &str = r#"
    [[routes]]
    path = "/v1/transfers"
    methods = ["POST"]
    require_key = true

    [[routes]]
    path = "/v1/observed"
    mode = "observe"

    [[routes]]
    path = "/v1/shared"
    anonymous = "shared"
    tenant_headers = []

    [[routes]]
    path = "/v1/overridden"
    method_override_headers = ["X-HTTP-Method-Override"]
    methods = ["POST", "DELETE"]

    [[routes]]
    path = "/v1/strict"
    path_params = "refuse"

    [[routes]]
    path = "/v1/django"
    method_case = "fold"

    [[routes]]
    path = "/v1/patches"
    methods = ["PATCH"]
"#;

fn settings() -> Settings {
    let figment =
        Figment::from(Serialized::defaults(Config::default())).merge(Toml::string(ROUTES));
    Config::load(figment).expect("the test configuration is valid")
}

/// What a decision says, in one comparable line.
fn summary(d: &Decision<'_>) -> String {
    let route = d.policy.route.as_deref().unwrap_or("default");
    let mode = match d.mode {
        Mode::Enforce => "enforce",
        Mode::Observe => "observe",
    };
    let action = match &d.action {
        Action::PassThrough(pass) => format!("pass {pass:?}"),
        Action::Refuse(r) => format!("refuse {}", r.would()),
        Action::Protect(op) => format!(
            "protect {} key={} forward={}",
            op.scope_path,
            op.key.as_ref().map_or("-", |k| k.as_str()),
            op.forward_path.as_deref().unwrap_or("-")
        ),
    };
    format!("{mode} {route} {} {action}", d.method)
}

fn decided(s: &Settings, method: &str, uri: &str, headers: &[(&str, &str)]) -> String {
    let method = Method::from_bytes(method.as_bytes()).expect("a method");
    let uri: Uri = uri.parse().expect("a URI");
    let mut h = HeaderMap::new();
    for (n, v) in headers {
        h.append(
            hyper::header::HeaderName::from_bytes(n.as_bytes()).expect("a header name"),
            HeaderValue::from_str(v).expect("a header value"),
        );
    }
    summary(&decide(s, &method, &uri, &h, None))
}

/// Method, URI, headers, and the decision's summary.
type Row = (
    &'static str,
    &'static str,
    &'static [(&'static str, &'static str)],
    &'static str,
);

const AUTH: (&str, &str) = ("authorization", "Bearer alice");
const KEY: (&str, &str) = ("idempotency-key", "k1");

#[test]
fn a_route_that_reads_host_reads_the_authority_and_refuses_a_disagreeing_host() {
    let toml =
        "[[routes]]\npath = \"/v1/hosted\"\ntenant_headers = [\"Authorization\", \"Host\"]\n";
    let s = Config::load(
        Figment::from(Serialized::defaults(Config::default())).merge(Toml::string(toml)),
    )
    .expect("valid");
    let protect = "enforce /v1/hosted POST protect /v1/hosted key=k1 forward=-";
    let uri = "http://shop-a/v1/hosted";
    assert_eq!(decided(&s, "POST", uri, &[KEY, AUTH]), protect);
    assert_eq!(
        decided(&s, "POST", uri, &[KEY, AUTH, ("host", "SHOP-A")]),
        protect
    );
    assert_eq!(
        decided(&s, "POST", "/v1/hosted", &[KEY, AUTH, ("host", "shop-b")]),
        protect
    );
    assert_eq!(
        decided(&s, "POST", uri, &[KEY, AUTH, ("host", "shop-b")]),
        "enforce /v1/hosted POST refuse invalid_header"
    );
    // A route that does not read Host leaves it to the upstream, as before.
    assert!(decided(
        &s,
        "POST",
        "http://shop-a/v1/other",
        &[KEY, AUTH, ("host", "shop-b")]
    )
    .contains("protect"));
}

#[test]
fn request_heads_decide_as_the_table_says() {
    let s = settings();
    #[rustfmt::skip]
    let table: &[Row] = &[
        // Nothing protects it.
        ("GET", "/v1/transfers", &[], "enforce /v1/transfers GET pass Plain"),
        ("GET", "/anything", &[KEY], "enforce default GET pass KeyIgnored"),
        ("post", "/v1/other", &[KEY, AUTH], "enforce default post refuse invalid_method"),
        ("Patch", "/v1/transfers", &[KEY, AUTH], "enforce /v1/transfers Patch pass KeyIgnored"),
        ("PATCH", "/v1/transfers", &[KEY, AUTH], "enforce /v1/transfers PATCH pass KeyIgnored"),
        ("POST", "/v1/other", &[AUTH], "enforce default POST pass NoKey"),
        // Refused before the body.
        ("POST", "/v1/transfers", &[AUTH], "enforce /v1/transfers POST refuse missing_key"),
        ("POST", "/v1/other", &[("idempotency-key", ""), AUTH], "enforce default POST refuse invalid_key"),
        ("POST", "/v1/other", &[KEY], "enforce default POST refuse missing_tenant"),
        ("POST", "/v1/a%2Fb", &[KEY, AUTH], "enforce default POST refuse invalid_path"),
        ("GET", "/v1/a%2Fb", &[KEY], "enforce default GET pass Plain"),
        ("GET", "/v1/a%2Fb", &[("x-http-method-override", "POST")], "enforce default GET refuse invalid_path"),
        ("POST", "/v1/strict;jsessionid=1", &[KEY, AUTH], "enforce /v1/strict POST refuse invalid_path"),
        ("GET", "/v1/strict;jsessionid=1", &[], "enforce /v1/strict GET pass Plain"),
        ("POST", "/v1/other", &[KEY, AUTH, ("x-http-method-override", "DELETE")], "enforce default POST refuse invalid_method_override"),
        ("GET", "/v1/other", &[("x-http-method-override", "POST")], "enforce default GET refuse invalid_method_override"),
        ("GET", "/v1/other?_method=PATCH", &[], "enforce default GET refuse invalid_method_override"),
        ("GET", "/v1/other", &[("x-http-method-override", "PUT")], "enforce default GET pass Plain"),
        ("POST", "/v1/overridden", &[KEY, AUTH, ("x-http-method-override", "not a method")], "enforce /v1/overridden POST refuse invalid_method_override"),
        ("post", "/v1/django", &[KEY, AUTH], "enforce /v1/django POST protect /v1/django key=k1 forward=-"),
        ("POST", "/v1/patches", &[KEY, AUTH], "enforce /v1/patches POST pass KeyIgnored"),
        ("POST", "/v1/patches", &[KEY, AUTH, ("content-type", "application/x-www-form-urlencoded")], "enforce /v1/patches POST protect /v1/patches key=k1 forward=-"),
        ("PUT", "/v1/patches", &[KEY, AUTH, ("content-type", "application/x-www-form-urlencoded")], "enforce /v1/patches PUT pass KeyIgnored"),
        ("POST", "/v1/transfers.", &[KEY, AUTH], "enforce /v1/transfers POST refuse invalid_path"),
        ("GET", "/v1/transfers.", &[KEY], "enforce /v1/transfers GET pass KeyIgnored"),
        // Protected, as which operation.
        ("POST", "/v1/transfers", &[KEY, AUTH], "enforce /v1/transfers POST protect /v1/transfers key=k1 forward=-"),
        ("POST", "/v1/transfers//x/", &[KEY, AUTH], "enforce /v1/transfers POST protect /v1/transfers/x key=k1 forward=/v1/transfers/x"),
        ("POST", "/v1/other", &[("idempotency-key", "\"quoted\""), AUTH], "enforce default POST protect /v1/other key=quoted forward=-"),
        ("PATCH", "/v1/shared/1", &[KEY], "enforce /v1/shared PATCH protect /v1/shared/1 key=k1 forward=-"),
        ("POST", "/v1/overridden", &[KEY, AUTH, ("x-http-method-override", "DELETE")], "enforce /v1/overridden DELETE protect /v1/overridden key=k1 forward=-"),
        ("PUT", "/v1/overridden", &[KEY, AUTH, ("x-http-method-override", "post")], "enforce /v1/overridden POST protect /v1/overridden key=k1 forward=-"),
        // Observed routes decide the same; only the mode differs.
        ("POST", "/v1/observed", &[KEY, AUTH], "observe /v1/observed POST protect /v1/observed key=k1 forward=-"),
        ("POST", "/v1/observed", &[KEY], "observe /v1/observed POST refuse missing_tenant"),
        ("POST", "/v1/observed", &[AUTH], "observe /v1/observed POST pass NoKey"),
        ("GET", "/v1/observed", &[KEY], "observe /v1/observed GET pass KeyIgnored"),
    ];
    for (method, uri, headers, want) in table {
        assert_eq!(
            decided(&s, method, uri, headers),
            *want,
            "{method} {uri} {headers:?}"
        );
    }
}

#[test]
fn an_unroutable_path_is_observed_where_only_observing_routes_protect_its_method() {
    let figment = Figment::from(Serialized::defaults(Config::default())).merge(Toml::string(
        r#"
        [defaults]
        methods = ["POST"]
        mode = "observe"
        [[routes]]
        path = "/v1/enforced"
        methods = ["PUT"]
        mode = "enforce"
        "#,
    ));
    let s = Config::load(figment).expect("valid");
    let table = [
        ("POST", "observe default POST refuse invalid_path"),
        ("PUT", "enforce default PUT refuse invalid_path"),
        ("GET", "observe default GET pass Plain"),
    ];
    for (method, want) in table {
        assert_eq!(decided(&s, method, "/a%2Fb", &[KEY, AUTH]), want);
    }
}

#[test]
fn the_tenant_is_the_principal_or_the_shared_anonymous_scope() {
    let s = settings();
    let tenant = |uri: &str, auth: Option<&str>| {
        let mut h = HeaderMap::new();
        h.insert("idempotency-key", HeaderValue::from_static("k"));
        if let Some(a) = auth {
            h.insert("authorization", HeaderValue::from_str(a).expect("a value"));
        }
        let uri: Uri = uri.parse().expect("a URI");
        match decide(&s, &Method::POST, &uri, &h, None).action {
            Action::Protect(op) => op.tenant,
            other => panic!("not protected: {other:?}"),
        }
    };
    let alice = tenant("/v1/other", Some("Bearer alice"));
    assert_eq!(alice, tenant("/v1/other", Some("bearer alice")));
    assert_ne!(alice, tenant("/v1/other", Some("Bearer bob")));
    assert!(tenant("/v1/shared", None) == Tenant::anonymous());
}

#[test]
fn refusals_answer_with_their_problem_and_count_as_rejected() {
    let table = [
        (Refusal::MissingKey, 400, Outcome::Rejected),
        (Refusal::InvalidKey("x".into()), 400, Outcome::Rejected),
        (Refusal::InvalidToken("x".into()), 401, Outcome::Rejected),
        (
            Refusal::BodyTooLarge {
                max: 1,
                decoded: true,
            },
            413,
            Outcome::Rejected,
        ),
        (Refusal::SecretDisagrees, 503, Outcome::StoreError),
        (Refusal::StoreFileReplaced, 503, Outcome::StoreError),
    ];
    for (refusal, status, outcome) in table {
        let res = refusal.response(|_| panic!("not overloaded"));
        assert_eq!(res.status().as_u16(), status, "{refusal:?}");
        assert_eq!(refusal.outcome(), outcome, "{refusal:?}");
    }
    let overloaded = Refusal::Overloaded(admission::Refusal::QueueFull);
    let res = overloaded.response(|_| Response::new(crate::body::full("")));
    assert_eq!(res.status().as_u16(), 200, "made by the caller");
    assert_eq!(overloaded.outcome(), Outcome::Overloaded);
}

#[test]
fn a_declared_length_over_the_limit_is_refused_before_reading() {
    let mut h = HeaderMap::new();
    assert_eq!(declared_too_large(&h, 10), None);
    h.insert(CONTENT_LENGTH, HeaderValue::from_static("10"));
    assert_eq!(declared_too_large(&h, 10), None);
    h.insert(CONTENT_LENGTH, HeaderValue::from_static("11"));
    let refusal = declared_too_large(&h, 10);
    assert_eq!(refusal.as_ref().map(Refusal::would), Some("body_too_large"));
}

#[test]
fn codings_beyond_the_limit_are_refused_before_reading() {
    let mut h = HeaderMap::new();
    assert_eq!(too_many_codings(&h, 0), None);
    h.insert(
        CONTENT_ENCODING,
        HeaderValue::from_static("gzip, identity, , GZIP"),
    );
    assert_eq!(too_many_codings(&h, 2), None);
    h.append(CONTENT_ENCODING, HeaderValue::from_static("br"));
    let refusal = too_many_codings(&h, 2);
    assert_eq!(refusal, Some(Refusal::TooManyCodings { max: 2 }));
    assert_eq!(
        refusal.as_ref().map(Refusal::would),
        Some("too_many_codings")
    );
    assert!(
        crate::metrics::WOULDS.contains(&"too_many_codings"),
        "counted, not other"
    );
    let res = Refusal::TooManyCodings { max: 2 }.response(|_| panic!("not overloaded"));
    assert_eq!(res.status().as_u16(), 415);
    assert!(res.headers().contains_key(hyper::header::ACCEPT_ENCODING));
}
