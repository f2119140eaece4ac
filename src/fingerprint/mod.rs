//! Request fingerprints: whether a retry with the same Idempotency-Key is the same request.
//!
//! Crates: `sha2` for the digest (SHA-256, collision resistant, so equal fingerprints mean equal
//! canonical inputs); `hex` for the text form stored and logged.
//!
//! The digest input is a versioned, length-prefixed tuple, so no two different tuples share a
//! byte string:
//!
//! ```text
//! "idemgate-fp" | version u16 BE
//! | field(method) | field(path)
//! | presence(query) field(query or "")
//! | presence(content-type) field(essence or "")
//! | body kind u8 | field(body)
//! field(x) = u64 BE length of x | x;   presence = 0 absent, 1 present
//! ```
//!
//! The body is the RFC 8785 form under the exactness rule for JSON content types (with the
//! route's `fingerprint_ignore` pointers applied), the canonical pair list for form bodies, and
//! the raw bytes otherwise, including JSON bodies that are not I-JSON. The body kind keeps a raw
//! body from ever equalling a canonical one.

use std::fmt;

use sha2::{Digest, Sha256};

mod form;
pub mod jcs;
mod number;
mod pointer;

pub use jcs::JcsError;
pub use pointer::{JsonPointer, PointerError};

/// Part of the digest input: a change to any canonical form or to the layout must bump it, so
/// stored records made under another version never match by accident.
pub const FINGERPRINT_VERSION: u16 = 1;

const DOMAIN_TAG: &[u8] = b"idemgate-fp";

const BODY_RAW: u8 = 0;
const BODY_JSON: u8 = 1;
const BODY_FORM: u8 = 2;

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// Lowercase hex, 64 characters.
    pub fn to_hex(&self) -> String {
        crate::key::to_hex(&self.0)
    }

    /// Parses 64 hex digits (either case).
    pub fn from_hex(s: &str) -> Option<Self> {
        let mut bytes = [0u8; 32];
        hex::decode_to_slice(s, &mut bytes).ok()?;
        Some(Fingerprint(bytes))
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// The parts of a request that make up its fingerprint.
#[derive(Clone, Copy, Debug)]
pub struct RequestParts<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub query: Option<&'a str>,
    pub content_type: Option<&'a str>,
    pub body: &'a [u8],
}

/// The fingerprint of a request under the input format `version`, so that a record made
/// before an upgrade is compared like with like and its retries are not turned into 422s.
/// `None` for a version this build does not know (a record made by a newer idemgate).
pub fn fingerprint_as(
    version: u16,
    parts: &RequestParts<'_>,
    ignore: &[JsonPointer],
) -> Option<Fingerprint> {
    match version {
        FINGERPRINT_VERSION => Some(fingerprint(parts, ignore)),
        _ => None,
    }
}

/// Version-1 fingerprint; `ignore` = route's fingerprint_ignore pointers (apply only to JSON
/// bodies that canonicalize).
pub fn fingerprint(parts: &RequestParts<'_>, ignore: &[JsonPointer]) -> Fingerprint {
    let mut h = Sha256::new();
    h.update(DOMAIN_TAG);
    h.update(FINGERPRINT_VERSION.to_be_bytes());
    field(&mut h, parts.method.as_bytes());
    field(&mut h, parts.path.as_bytes());
    optional_field(&mut h, parts.query.map(str::as_bytes));
    let essence = parts.content_type.map(content_type_essence);
    optional_field(&mut h, essence.as_deref().map(str::as_bytes));

    let kind = essence.as_deref().map_or(BodyKind::Raw, body_kind);
    let canonical = match kind {
        BodyKind::Json => jcs::canonicalize_exact(parts.body, ignore)
            .ok()
            .map(|c| (BODY_JSON, c)),
        BodyKind::Form => Some((BODY_FORM, form::canonicalize(parts.body))),
        BodyKind::Raw => None,
    };
    match &canonical {
        Some((kind, body)) => {
            h.update([*kind]);
            field(&mut h, body);
        }
        None => {
            h.update([BODY_RAW]);
            field(&mut h, parts.body);
        }
    }
    Fingerprint(h.finalize().into())
}

fn field(h: &mut Sha256, bytes: &[u8]) {
    h.update((bytes.len() as u64).to_be_bytes());
    h.update(bytes);
}

fn optional_field(h: &mut Sha256, bytes: Option<&[u8]>) {
    h.update([u8::from(bytes.is_some())]);
    field(h, bytes.unwrap_or_default());
}

/// The media type without parameters, trimmed and lowercased (`type/subtype`).
fn content_type_essence(content_type: &str) -> String {
    let essence = content_type.split(';').next().unwrap_or_default();
    essence
        .trim_matches(|c| c == ' ' || c == '\t')
        .to_ascii_lowercase()
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum BodyKind {
    Json,
    Form,
    Raw,
}

/// `application/json` and any `type/subtype+json` are JSON; the form type is a form.
fn body_kind(essence: &str) -> BodyKind {
    if essence == "application/x-www-form-urlencoded" {
        return BodyKind::Form;
    }
    match essence.split_once('/') {
        Some(("application", "json")) => BodyKind::Json,
        Some((ty, subtype)) if !ty.is_empty() && subtype.ends_with("+json") => BodyKind::Json,
        _ => BodyKind::Raw,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const JSON: Option<&str> = Some("application/json");

    fn parts<'a>(ct: Option<&'a str>, body: &'a [u8]) -> RequestParts<'a> {
        RequestParts {
            method: "POST",
            path: "/v1/charges",
            query: None,
            content_type: ct,
            body,
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

    #[test]
    fn layout_is_pinned() {
        // Recomputes the documented layout by hand; a mismatch means the format changed and
        // FINGERPRINT_VERSION must be bumped.
        let mut h = Sha256::new();
        h.update(b"idemgate-fp\x00\x01");
        for f in [&b"POST"[..], b"/p"] {
            h.update((f.len() as u64).to_be_bytes());
            h.update(f);
        }
        h.update([1]);
        h.update(3u64.to_be_bytes());
        h.update(b"x=1");
        h.update([1]);
        h.update(16u64.to_be_bytes());
        h.update(b"application/json");
        h.update([BODY_JSON]);
        h.update(7u64.to_be_bytes());
        h.update(br#"{"a":1}"#);
        let expected = Fingerprint(h.finalize().into());
        let got = fingerprint(
            &RequestParts {
                method: "POST",
                path: "/p",
                query: Some("x=1"),
                content_type: Some("Application/JSON; charset=utf-8"),
                body: b"{ \"a\" : 1.0 }",
            },
            &[],
        );
        assert_eq!(got, expected);
    }

    #[test]
    fn every_field_counts() {
        let base = RequestParts {
            method: "POST",
            path: "/a",
            query: Some("q=1"),
            content_type: JSON,
            body: b"{}",
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
        p.query = Some("");
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
        let raw = fingerprint(&parts(JSON, br#"{"a":1,"a":2}"#), &[]);
        let mut h = Sha256::new();
        h.update(b"idemgate-fp\x00\x01");
        for f in [&b"POST"[..], b"/v1/charges"] {
            h.update((f.len() as u64).to_be_bytes());
            h.update(f);
        }
        h.update([0]);
        h.update(0u64.to_be_bytes());
        h.update([1]);
        h.update(16u64.to_be_bytes());
        h.update(b"application/json");
        h.update([BODY_RAW]);
        h.update(13u64.to_be_bytes());
        h.update(br#"{"a":1,"a":2}"#);
        assert_eq!(raw, Fingerprint(h.finalize().into()));
        // Other refusals also fall back to the raw bytes.
        for bad in ["\u{feff}{}", "{} x", r#""\ud800""#, "[1,]", ""] {
            assert_eq!(fp(JSON, bad), fp(JSON, bad));
            assert_ne!(fp(JSON, bad), fp(JSON, "{}"), "{bad:?}");
        }
        assert_ne!(fp(JSON, "\"\u{ff}\""), fp(JSON, "\"\u{fe}\""));
    }

    #[test]
    fn ignore_pointers_apply_to_json() {
        let a =
            r#"{"amount":100,"client_ts":"2024-01-01T00:00:00Z","items":[{"n":1,"nonce":"a"}]}"#;
        let b =
            r#"{"amount":100,"client_ts":"2024-06-01T12:00:00Z","items":[{"n":1,"nonce":"b"}]}"#;
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
}
