//! The problem types' unit tests: names, statuses, dialects and the retry table.
use super::*;
use http_body_util::BodyExt;

/// docs/requests.md's table of retry hints is this table: every problem, its status
/// and its hint.
#[test]
fn the_documented_retry_hints_are_the_table() {
    let doc = include_str!("../../docs/requests.md");
    let section = doc
        .split("## Retry hints")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("a Retry hints section");
    let rows: Vec<(String, String, String)> = section
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let name = cells[0].trim_end_matches('`').to_string();
            (
                name,
                cells[1].to_string(),
                cells[2].trim_matches('`').to_string(),
            )
        })
        .collect();
    assert_eq!(rows.len(), Problem::ALL.len(), "{rows:?}");
    for p in Problem::ALL {
        let row = rows.iter().find(|r| r.0 == p.name());
        let want = (
            p.name().to_string(),
            p.status().as_u16().to_string(),
            p.should_retry().to_string(),
        );
        assert_eq!(row, Some(&want), "{p:?}");
    }
}

#[tokio::test]
async fn every_format_carries_the_retry_hint() {
    let template = parse_template(r#"{"code":"{code}"}"#).unwrap();
    for p in Problem::ALL {
        let want = if p.should_retry() { "true" } else { "false" };
        for format in [
            ErrorFormat::Problem,
            ErrorFormat::Stripe,
            ErrorFormat::Template(std::sync::Arc::new(Template::new(template.clone(), vec![]))),
        ] {
            let res = in_dialect(p.response("", None, None), &format);
            assert_eq!(res.headers()[SHOULD_RETRY], want, "{p:?} {format:?}");
            let stripe = res.headers().get(STRIPE_SHOULD_RETRY);
            if format == ErrorFormat::Stripe {
                assert_eq!(stripe.map(|v| v.as_bytes()), Some(want.as_bytes()));
            } else {
                assert!(stripe.is_none(), "{p:?} {format:?}");
            }
        }
    }
}

#[test]
fn every_type_uri_is_the_base_and_the_name() {
    assert_eq!(Problem::ALL.len(), 32);
    for p in Problem::ALL {
        assert_eq!(p.type_uri(), format!("{TYPE_BASE}{}", p.name()));
    }
}

async fn json(res: Response<Body>) -> (u16, hyper::HeaderMap, serde_json::Value) {
    let status = res.status().as_u16();
    let headers = res.headers().clone();
    let body = res.into_body().collect().await.expect("body").to_bytes();
    (
        status,
        headers,
        serde_json::from_slice(&body).expect("json"),
    )
}

#[tokio::test]
async fn stripe_errors_carry_the_types_its_sdks_map_and_whether_to_retry() {
    let res = Problem::FingerprintMismatch.response("another amount", None, None);
    let (status, h, doc) = json(in_dialect(res, &ErrorFormat::Stripe)).await;
    // Stripe's own status for it, under which its SDKs raise their idempotency error.
    assert_eq!(status, 400);
    assert_eq!(doc["error"]["type"], "idempotency_error");
    assert_eq!(h[IDEMGATE_ERROR], "fingerprint-mismatch");
    assert_eq!(h[CONTENT_TYPE], "application/json");
    assert_eq!(h[STRIPE_SHOULD_RETRY], "false");
    assert!(doc["error"]["message"]
        .as_str()
        .unwrap()
        .contains("another amount"));

    let res = Problem::InProgress.response("running", None, Some(2));
    let (status, h, doc) = json(in_dialect(res, &ErrorFormat::Stripe)).await;
    assert_eq!(status, 409);
    assert_eq!(doc["error"]["code"], "idempotency_key_in_use");
    assert_eq!(h[STRIPE_SHOULD_RETRY], "true");
    assert_eq!(h[RETRY_AFTER], "2");

    for p in [
        Problem::OutcomeUnknown,
        Problem::UpstreamTimeout,
        Problem::UpstreamBrokenAnswer,
    ] {
        let (_, h, doc) = json(in_dialect(p.response("", None, None), &ErrorFormat::Stripe)).await;
        assert_eq!(doc["error"]["type"], "api_error", "{p:?}");
        assert_eq!(h[STRIPE_SHOULD_RETRY], "false", "{p:?}");
    }
    let (_, h, _) = json(in_dialect(
        Problem::UpstreamUnreachable.response("", None, None),
        &ErrorFormat::Stripe,
    ))
    .await;
    assert_eq!(h[STRIPE_SHOULD_RETRY], "true");
}

#[tokio::test]
async fn a_template_is_filled_with_typed_values_and_text() {
    let t = parse_template(
        r#"{"errors":[{"status":"{status}","code":"{code}","message":"{title} ({detail})","record":"{record_id}","retry":"{retry_after}"}],"kept":true}"#,
    )
    .expect("template");
    let id = RecordId::from_hex(&"ab".repeat(32)).expect("id");
    let res = Problem::InProgress.response("still running", Some(&id), Some(3));
    let (status, h, doc) = json(in_dialect(
        res,
        &ErrorFormat::Template(Template::new(t, vec![]).into()),
    ))
    .await;
    assert_eq!(status, 409);
    assert_eq!(h[IDEMGATE_ERROR], "in-progress");
    let e = &doc["errors"][0];
    assert_eq!(e["status"], 409);
    assert_eq!(e["code"], "in-progress");
    assert_eq!(e["retry"], 3);
    assert_eq!(e["record"], "ab".repeat(32));
    assert_eq!(
        e["message"],
        "A request with this Idempotency-Key is still in progress (still running)"
    );
    assert_eq!(doc["kept"], true);
    assert!(parse_template(r#"{"x":"{nope}"}"#)
        .unwrap_err()
        .contains("{nope}"));
    assert!(parse_template("not json").is_err());
}

/// `error_codes` choose what `{code}` writes for the problems they name; `{problem}`
/// always writes the problem's own name.
#[tokio::test]
async fn a_template_writes_the_vendor_s_code_and_the_problem_s_name() {
    let t =
        parse_template(r#"{"error":{"type":"{code}","reason":"{problem}"}}"#).expect("template");
    let codes = vec![(Problem::InProgress, "invalid_state".to_string())];
    let format = ErrorFormat::Template(Template::new(t, codes).into());
    let res = Problem::InProgress.response("", None, Some(1));
    let (_, _, doc) = json(in_dialect(res, &format)).await;
    assert_eq!(doc["error"]["type"], "invalid_state");
    assert_eq!(doc["error"]["reason"], "in-progress");
    let res = Problem::FingerprintMismatch.response("", None, None);
    let (_, _, doc) = json(in_dialect(res, &format)).await;
    assert_eq!(doc["error"]["type"], "fingerprint-mismatch");
    assert_eq!(doc["error"]["reason"], "fingerprint-mismatch");
}

#[tokio::test]
async fn answers_not_of_idemgate_s_own_are_left_alone() {
    let res = Response::new(crate::body::full("upstream"));
    let out = in_dialect(res, &ErrorFormat::Stripe);
    let body = out.into_body().collect().await.expect("body").to_bytes();
    assert_eq!(&body[..], b"upstream");
}
