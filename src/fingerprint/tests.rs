use super::*;

const JSON: Option<&str> = Some("application/json");

fn parts<'a>(ct: Option<&'a str>, body: &'a [u8]) -> RequestParts<'a> {
    RequestParts {
        method: "POST",
        path: "/v1/charges",
        query: None,
        content_type: ct,
        content_encoding: None,
        body,
        decoded: None,
    }
}

fn fp(ct: Option<&str>, body: &str) -> Fingerprint {
    fingerprint(&parts(ct, body.as_bytes()), &[])
}

fn fp_ignoring(body: &str, ignore: &[&str]) -> Fingerprint {
    let pointers: Vec<JsonPointer> = ignore
        .iter()
        .map(|p| JsonPointer::parse(p).expect("pointer"))
        .collect();
    fingerprint(&parts(JSON, body.as_bytes()), &pointers)
}

#[test]
fn hex_round_trip() {
    let f = fp(JSON, "{}");
    let hex = f.to_hex();
    assert_eq!(hex.len(), 64);
    assert_eq!(hex, hex.to_ascii_lowercase());
    assert_eq!(f.to_string(), hex);
    assert_eq!(Fingerprint::from_hex(&hex), Some(f));
    assert_eq!(Fingerprint::from_hex(&hex.to_ascii_uppercase()), Some(f));
    assert_eq!(Fingerprint::from_hex(&hex[..62]), None);
    assert_eq!(Fingerprint::from_hex(&format!("{hex}00")), None);
    assert_eq!(Fingerprint::from_hex(&"g".repeat(64)), None);
}

/// The documented layout, recomputed by hand: `fields` are (presence, bytes) in order
/// after the method and path; the body kind and body close it.
fn by_hand(version: u16, fields: &[Option<&[u8]>], kind: u8, body: &[u8]) -> Fingerprint {
    let mut h = Sha256::new();
    h.update(b"idemgate-fp");
    h.update(version.to_be_bytes());
    for f in [&b"POST"[..], b"/p"] {
        h.update((f.len() as u64).to_be_bytes());
        h.update(f);
    }
    for f in fields {
        h.update([u8::from(f.is_some())]);
        let f = f.unwrap_or_default();
        h.update((f.len() as u64).to_be_bytes());
        h.update(f);
    }
    h.update([kind]);
    h.update((body.len() as u64).to_be_bytes());
    h.update(body);
    Fingerprint(h.finalize().into())
}

const PINNED: RequestParts<'static> = RequestParts {
    method: "POST",
    path: "/p",
    query: Some("y=2&x=1"),
    content_type: Some("Application/JSON; charset=utf-8"),
    content_encoding: None,
    body: b"{ \"a\" : 1.0 }",
    decoded: None,
};

#[test]
fn layout_is_pinned() {
    // A mismatch means the format changed and FINGERPRINT_VERSION must be bumped.
    let expected = by_hand(
        2,
        &[Some(b"x=1&y=2"), Some(b"application/json"), None],
        BODY_JSON,
        br#"{"a":1}"#,
    );
    assert_eq!(fingerprint(&PINNED, &[]), expected);
    assert_eq!(
        fingerprint_as(FINGERPRINT_VERSION, &PINNED, &Rules::default()),
        Some(expected)
    );
    // Raw under codings that were not decoded.
    let coded = RequestParts {
        content_encoding: Some("GZIP, x-unknown"),
        body: b"\x1f\x8b??",
        ..PINNED
    };
    let expected = by_hand(
        2,
        &[
            Some(b"x=1&y=2"),
            Some(b"application/json"),
            Some(b"gzip,x-unknown"),
        ],
        BODY_RAW,
        b"\x1f\x8b??",
    );
    assert_eq!(fingerprint(&coded, &[]), expected);
}

/// Computed from the version-1 layout outside this code.
const V1_PINNED: &str = "41c89ae98e14da1af966224c50897b4e07a86de613e9b38a6e9480c3a622b6dd";

#[test]
fn version_1_is_unchanged() {
    // The previous release's layout, byte for byte: raw query, no codings field.
    let expected = by_hand(
        1,
        &[Some(b"y=2&x=1"), Some(b"application/json")],
        BODY_JSON,
        br#"{"a":1}"#,
    );
    assert_eq!(
        fingerprint_as(1, &PINNED, &Rules::default()),
        Some(expected)
    );
    // The previous release's own digest of this request (computed with it).
    assert_eq!(
        fingerprint_as(1, &PINNED, &Rules::default()).map(|f| f.to_hex()),
        Some(V1_PINNED.to_string())
    );
    // Version 1 never looked at codings, decoded content or query order.
    let coded = RequestParts {
        content_encoding: Some("gzip"),
        decoded: Some(b"[]"),
        ..PINNED
    };
    let significant = Rules {
        query_order: QueryOrder::Significant,
        ..Rules::default()
    };
    assert_eq!(fingerprint_as(1, &coded, &significant), Some(expected));
    assert_eq!(fingerprint_as(3, &PINNED, &Rules::default()), None);
    assert_eq!(fingerprint_as(0, &PINNED, &Rules::default()), None);
}

#[test]
fn every_field_counts() {
    let base = RequestParts {
        method: "POST",
        path: "/a",
        query: Some("q=1"),
        content_type: JSON,
        body: b"{}",
        ..RequestParts::default()
    };
    let f = fingerprint(&base, &[]);
    assert_ne!(
        f,
        fingerprint(
            &RequestParts {
                method: "PUT",
                ..base
            },
            &[]
        )
    );
    assert_ne!(f, fingerprint(&RequestParts { path: "/b", ..base }, &[]));
    assert_ne!(
        f,
        fingerprint(
            &RequestParts {
                query: Some("q=2"),
                ..base
            },
            &[]
        )
    );
    assert_ne!(
        f,
        fingerprint(
            &RequestParts {
                query: None,
                ..base
            },
            &[]
        )
    );
    assert_ne!(
        f,
        fingerprint(
            &RequestParts {
                content_type: None,
                ..base
            },
            &[]
        )
    );
    assert_ne!(
        f,
        fingerprint(
            &RequestParts {
                body: b"[]",
                ..base
            },
            &[]
        )
    );
}

#[test]
fn absent_differs_from_empty() {
    let mut p = parts(None, b"");
    let absent = fingerprint(&p, &[]);
    // A query without pairs is no query (since version 2).
    for empty in ["", "&", "&&"] {
        p.query = Some(empty);
        assert_eq!(absent, fingerprint(&p, &[]), "{empty:?}");
    }
    p.query = Some("=");
    assert_ne!(absent, fingerprint(&p, &[]));
    p.query = None;
    p.content_type = Some("");
    assert_ne!(absent, fingerprint(&p, &[]));
}

#[test]
fn length_prefixes_separate_fields() {
    let a = RequestParts {
        method: "POST",
        path: "/ab",
        query: Some("c"),
        content_type: None,
        body: b"",
        ..RequestParts::default()
    };
    let b = RequestParts {
        path: "/a",
        query: Some("bc"),
        ..a
    };
    assert_ne!(fingerprint(&a, &[]), fingerprint(&b, &[]));
}

#[test]
fn content_type_essence_and_kind() {
    assert_eq!(
        content_type_essence(" Application/JSON ; charset=UTF-8"),
        "application/json"
    );
    assert_eq!(content_type_essence("text/plain"), "text/plain");
    assert_eq!(body_kind("application/json"), BodyKind::Json);
    assert_eq!(body_kind("application/problem+json"), BodyKind::Json);
    assert_eq!(body_kind("application/vnd.api+json"), BodyKind::Json);
    assert_eq!(body_kind("text/json+json"), BodyKind::Json);
    assert_eq!(body_kind("application/jsonx"), BodyKind::Raw);
    assert_eq!(body_kind("application/json-seq"), BodyKind::Raw);
    assert_eq!(body_kind("text/plain"), BodyKind::Raw);
    assert_eq!(body_kind("+json"), BodyKind::Raw);
    assert_eq!(
        body_kind("application/x-www-form-urlencoded"),
        BodyKind::Form
    );
    // Parameters never change the fingerprint; the essence's case does not either.
    assert_eq!(
        fp(Some("application/json; charset=utf-8"), "{}"),
        fp(Some("APPLICATION/JSON"), "{}")
    );
}

#[test]
fn json_bodies_compare_canonically() {
    assert_eq!(
        fp(JSON, r#"{"b":1,"a":[4.50]}"#),
        fp(JSON, "{ \"a\": [45e-1], \"b\": 1.0 }")
    );
    assert_eq!(
        fp(Some("application/merchant+json"), r#"{"a":1}"#),
        fp(Some("application/merchant+json"), r#"{ "a" : 1 }"#)
    );
    assert_ne!(fp(JSON, "9007199254740993"), fp(JSON, "9007199254740992"));
    assert_ne!(fp(JSON, "1e400"), fp(JSON, "2e400"));
    assert_ne!(
        fp(JSON, "333333333.33333329"),
        fp(JSON, "333333333.3333333")
    );
    assert_ne!(fp(JSON, "0.10000000000000001"), fp(JSON, "0.1"));
    assert_eq!(fp(JSON, "[1.0, 1e0, 100]"), fp(JSON, "[1, 1, 1e2]"));
}

#[test]
fn non_json_types_hash_raw_bytes() {
    let ct = Some("text/plain");
    assert_ne!(fp(ct, r#"{"a":1}"#), fp(ct, r#"{ "a":1}"#));
    assert_ne!(fp(None, r#"{"a":1}"#), fp(None, r#"{ "a":1}"#));
}

#[test]
fn invalid_json_hashes_raw_bytes() {
    // Duplicate names: raw bytes differ, so no collision.
    assert_ne!(fp(JSON, r#"{"a":1,"a":2}"#), fp(JSON, r#"{"a":3,"a":2}"#));
    assert_eq!(fp(JSON, r#"{"a":1,"a":2}"#), fp(JSON, r#"{"a":1,"a":2}"#));
    // Whitespace matters once the body is raw.
    assert_ne!(fp(JSON, r#"{"a":1,"a":2}"#), fp(JSON, r#"{"a":1, "a":2}"#));
    // A raw body never equals a canonical one with the same bytes.
    let raw = fingerprint(
        &RequestParts {
            path: "/p",
            ..parts(JSON, br#"{"a":1,"a":2}"#)
        },
        &[],
    );
    let by_hand = by_hand(
        2,
        &[None, Some(b"application/json"), None],
        BODY_RAW,
        br#"{"a":1,"a":2}"#,
    );
    assert_eq!(raw, by_hand);
    // Other refusals also fall back to the raw bytes.
    for bad in ["\u{feff}{}", "{} x", r#""\ud800""#, "[1,]", ""] {
        assert_eq!(fp(JSON, bad), fp(JSON, bad));
        assert_ne!(fp(JSON, bad), fp(JSON, "{}"), "{bad:?}");
    }
    assert_ne!(fp(JSON, "\"\u{ff}\""), fp(JSON, "\"\u{fe}\""));
}

#[test]
fn ignore_pointers_apply_to_json() {
    let a = r#"{"amount":100,"client_ts":"2024-01-01T00:00:00Z","items":[{"n":1,"nonce":"a"}]}"#;
    let b = r#"{"amount":100,"client_ts":"2024-06-01T12:00:00Z","items":[{"n":1,"nonce":"b"}]}"#;
    assert_ne!(fp_ignoring(a, &[]), fp_ignoring(b, &[]));
    let ignore = ["/client_ts", "/items/0/nonce", "/not/there"];
    assert_eq!(fp_ignoring(a, &ignore), fp_ignoring(b, &ignore));
    let c = r#"{"amount":101,"client_ts":"x","items":[{"n":1,"nonce":"b"}]}"#;
    assert_ne!(fp_ignoring(a, &ignore), fp_ignoring(c, &ignore));
    // A missing pointer is a no-op.
    assert_eq!(fp_ignoring(a, &["/nope"]), fp_ignoring(a, &[]));
}

#[test]
fn ignore_pointers_do_not_apply_to_raw_bodies() {
    let p = vec![JsonPointer::parse("/ts").expect("pointer")];
    let body = br#"{"ts":1,"ts":2}"#;
    assert_eq!(
        fingerprint(&parts(JSON, body), &p),
        fingerprint(&parts(JSON, body), &[])
    );
    let text = br#"{"ts":1}"#;
    assert_eq!(
        fingerprint(&parts(Some("text/plain"), text), &p),
        fingerprint(&parts(Some("text/plain"), text), &[])
    );
}

#[test]
fn form_bodies_compare_canonically() {
    let form = Some("application/x-www-form-urlencoded; charset=utf-8");
    assert_eq!(fp(form, "a=1&b=2"), fp(form, "b=2&a=1"));
    assert_ne!(fp(form, "a=1&a=2"), fp(form, "a=2&a=1"));
    assert_eq!(fp(form, "a=%41"), fp(form, "a=A"));
}
