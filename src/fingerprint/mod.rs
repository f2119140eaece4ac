//! Request fingerprints: whether a retry with the same Idempotency-Key is the same request.
//!
//! Crates: `sha2` for the digest (SHA-256, collision resistant, so equal fingerprints mean equal
//! canonical inputs); `hex` for the text form stored and logged.
//!
//! The digest input is a versioned, length-prefixed tuple, so no two different tuples share a
//! byte string. Version 2 (the current one):
//!
//! ```text
//! "idemgate-fp" | version u16 BE
//! | field(method) | field(path)
//! | presence(query) field(canonical query or "")
//! | presence(content-type) field(essence or "")
//! | presence(codings) field(codings or "")
//! | body kind u8 | field(body)
//! field(x) = u64 BE length of x | x;   presence = 0 absent, 1 present
//! ```
//!
//! The query is its decoded pairs, stable-sorted by name (or in the order sent, for a route
//! with `query_order = "significant"`), re-encoded as form bodies are; a query without pairs
//! (`?`, `?&`) is absent. A `Content-Encoding`d body is decoded first (gzip, deflate, br; see
//! [`decode_content`]) and then canonicalized as the same body sent unencoded; the codings are
//! present only for a body fingerprinted raw under them (an unknown coding, a body that does
//! not decode), so that such a body never equals the same bytes sent unencoded.
//!
//! The body is the RFC 8785 form under the exactness rule for JSON content types (with the
//! route's `fingerprint_ignore` pointers applied), the canonical pair list for form bodies, the
//! parts for `multipart/form-data` (see `multipart`), and the raw bytes otherwise, including
//! JSON and multipart bodies that do not parse. The body kind keeps a raw body from ever
//! equalling a canonical one.
//!
//! Version 1 (before the query, multipart and encoded bodies were canonicalized) had the raw
//! query, no codings field, and no multipart kind; [`fingerprint_as`] still computes it, so
//! records made by instances of the previous release are compared like with like.

use std::fmt;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

mod encoding;
mod form;
pub mod jcs;
mod multipart;
mod number;
mod pointer;

pub use encoding::{decode as decode_content, is_heavy as decoding_is_heavy, Decoded, TooLarge};
pub use jcs::JcsError;
pub use pointer::{JsonPointer, PointerError};

/// The decoded values of a form-encoded body's fields named `name` (`_method`).
pub fn form_values(body: &[u8], name: &str) -> Vec<Vec<u8>> {
    form::values(body, name)
}

/// The contents of a multipart body's fields named `name`; `None` when it is not
/// well-formed.
pub fn multipart_values(body: &[u8], boundary: &[u8], name: &str) -> Option<Vec<Vec<u8>>> {
    multipart::values(body, boundary, name)
}

/// The `boundary` of a `multipart/form-data` content type.
pub fn multipart_boundary(content_type: &str) -> Option<Vec<u8>> {
    multipart::boundary(content_type)
}

/// Part of the digest input: a change to any canonical form or to the layout must bump it, so
/// stored records made under another version never match by accident.
pub const FINGERPRINT_VERSION: u16 = 2;

/// The version before [`FINGERPRINT_VERSION`], still computed for the records it made.
pub const PREVIOUS_FINGERPRINT_VERSION: u16 = 1;

const DOMAIN_TAG: &[u8] = b"idemgate-fp";

const BODY_RAW: u8 = 0;
const BODY_JSON: u8 = 1;
const BODY_FORM: u8 = 2;
const BODY_MULTIPART: u8 = 3;

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
#[derive(Clone, Copy, Debug, Default)]
pub struct RequestParts<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub query: Option<&'a str>,
    pub content_type: Option<&'a str>,
    /// The `Content-Encoding` as sent (several header lines joined with `,`).
    pub content_encoding: Option<&'a str>,
    /// The body as sent.
    pub body: &'a [u8],
    /// The body's content when [`decode_content`] decoded it ([`Decoded::Content`]).
    pub decoded: Option<&'a [u8]>,
}

/// Whether the order of a query's pairs counts (a route's `query_order`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QueryOrder {
    /// Pairs are compared stable-sorted by name: `?a=1&b=2` and `?b=2&a=1` are one request;
    /// the values of one name keep their order (default).
    #[default]
    Sorted,
    /// Pairs are compared in the order sent, for upstreams that read it.
    Significant,
}

/// A route's settings that the fingerprint depends on.
#[derive(Clone, Copy, Debug, Default)]
pub struct Rules<'a> {
    /// `fingerprint_ignore`: JSON pointers left out (only of JSON bodies that canonicalize).
    pub ignore: &'a [JsonPointer],
    pub query_order: QueryOrder,
}

/// The fingerprint of a request under the input format `version`, so that a record made
/// before an upgrade is compared like with like and its retries are not turned into 422s.
/// `None` for a version this build does not know (a record made by a newer idemgate).
pub fn fingerprint_as(
    version: u16,
    parts: &RequestParts<'_>,
    rules: &Rules<'_>,
) -> Option<Fingerprint> {
    match version {
        FINGERPRINT_VERSION => Some(fingerprint_with(parts, rules)),
        PREVIOUS_FINGERPRINT_VERSION => Some(fingerprint_v1(parts, rules.ignore)),
        _ => None,
    }
}

/// The current version's fingerprint with the default rules but `ignore`.
pub fn fingerprint(parts: &RequestParts<'_>, ignore: &[JsonPointer]) -> Fingerprint {
    fingerprint_with(
        parts,
        &Rules {
            ignore,
            ..Rules::default()
        },
    )
}

/// The current version's ([`FINGERPRINT_VERSION`]) fingerprint.
pub fn fingerprint_with(parts: &RequestParts<'_>, rules: &Rules<'_>) -> Fingerprint {
    let mut h = Sha256::new();
    h.update(DOMAIN_TAG);
    h.update(FINGERPRINT_VERSION.to_be_bytes());
    field(&mut h, parts.method.as_bytes());
    field(&mut h, parts.path.as_bytes());
    let query = parts.query.map(|q| match rules.query_order {
        QueryOrder::Sorted => form::canonicalize(q.as_bytes()),
        QueryOrder::Significant => form::canonicalize_in_order(q.as_bytes()),
    });
    optional_field(&mut h, query.as_deref().filter(|q| !q.is_empty()));
    let essence = parts.content_type.map(content_type_essence);
    optional_field(&mut h, essence.as_deref().map(str::as_bytes));

    // The content: decoded, or the body as sent when it has no codings. A body that has
    // codings and was not decoded is raw, with its codings.
    let codings = encoding::codings(parts.content_encoding);
    let content = match parts.decoded {
        Some(decoded) => Some(decoded),
        None if codings.is_empty() => Some(parts.body),
        None => None,
    };
    let coded = content.is_none().then(|| codings.join(","));
    optional_field(&mut h, coded.as_deref().map(str::as_bytes));

    let canonical = content.and_then(|body| {
        let kind = essence.as_deref().map_or(BodyKind::Raw, body_kind);
        match kind {
            BodyKind::Json => jcs::canonicalize_exact(body, rules.ignore)
                .ok()
                .map(|c| (BODY_JSON, c)),
            BodyKind::Form => Some((BODY_FORM, form::canonicalize(body))),
            BodyKind::Multipart => parts
                .content_type
                .and_then(multipart::boundary)
                .and_then(|b| multipart::canonicalize(body, &b))
                .map(|c| (BODY_MULTIPART, c)),
            BodyKind::Raw => None,
        }
    });
    let canonical = canonical.as_ref().map(|(kind, body)| (*kind, &body[..]));
    body_field(h, canonical, content.unwrap_or(parts.body))
}

/// The body's kind and bytes, the last field: its canonical form where there is one, else
/// `raw`; and the fingerprint of all that went before.
fn body_field(mut h: Sha256, canonical: Option<(u8, &[u8])>, raw: &[u8]) -> Fingerprint {
    match canonical {
        Some((kind, body)) => {
            h.update([kind]);
            field(&mut h, body);
        }
        None => {
            h.update([BODY_RAW]);
            field(&mut h, raw);
        }
    }
    Fingerprint(h.finalize().into())
}

/// Version 1, exactly as the previous release computed it: the raw query, `Content-Encoding`
/// and `decoded` not looked at, multipart bodies raw.
fn fingerprint_v1(parts: &RequestParts<'_>, ignore: &[JsonPointer]) -> Fingerprint {
    let mut h = Sha256::new();
    h.update(DOMAIN_TAG);
    h.update(PREVIOUS_FINGERPRINT_VERSION.to_be_bytes());
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
        BodyKind::Multipart | BodyKind::Raw => None,
    };
    let canonical = canonical.as_ref().map(|(kind, body)| (*kind, &body[..]));
    body_field(h, canonical, parts.body)
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
    Multipart,
    Raw,
}

/// `application/json` and any `type/subtype+json` are JSON; the form type is a form;
/// `multipart/form-data` is multipart.
fn body_kind(essence: &str) -> BodyKind {
    if essence == "application/x-www-form-urlencoded" {
        return BodyKind::Form;
    }
    if essence == "multipart/form-data" {
        return BodyKind::Multipart;
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

#[cfg(test)]
mod version_2_tests {
    use super::*;
    use proptest::prelude::*;
    use std::io::Write;

    fn with_query(q: Option<&str>, order: QueryOrder) -> Fingerprint {
        let parts = RequestParts {
            method: "POST",
            path: "/p",
            query: q,
            content_type: Some("application/json"),
            body: b"{}",
            ..RequestParts::default()
        };
        fingerprint_with(
            &parts,
            &Rules {
                query_order: order,
                ..Rules::default()
            },
        )
    }

    fn sorted(q: Option<&str>) -> Fingerprint {
        with_query(q, QueryOrder::Sorted)
    }

    #[test]
    fn queries_compare_as_sorted_pairs() {
        assert_eq!(sorted(Some("a=1&b=2")), sorted(Some("b=2&a=1")));
        assert_eq!(sorted(Some("a=%31&b=x+y")), sorted(Some("b=x%20y&a=1")));
        assert_ne!(sorted(Some("a=1&a=2")), sorted(Some("a=2&a=1")));
        assert_ne!(sorted(Some("a=1")), sorted(Some("a=2")));
        assert_eq!(sorted(Some("")), sorted(None));
        assert_ne!(sorted(Some("a")), sorted(None));
        let significant = |q| with_query(Some(q), QueryOrder::Significant);
        assert_ne!(significant("a=1&b=2"), significant("b=2&a=1"));
        assert_eq!(significant("a=%31"), significant("a=1"));
        assert_eq!(with_query(Some(""), QueryOrder::Significant), sorted(None));
        // A query already in order is the same request under either setting.
        assert_eq!(significant("a=1&b=2"), sorted(Some("b=2&a=1")));
    }

    #[test]
    fn a_version_1_record_compares_in_version_1() {
        // The running fleet's records: an identical retry matches in version 1, a
        // reordered one does not (only for records made before the upgrade).
        let parts = |q| RequestParts {
            method: "POST",
            path: "/p",
            query: Some(q),
            content_type: Some("application/json"),
            body: b"{}",
            ..RequestParts::default()
        };
        let rules = Rules::default();
        let recorded = fingerprint_as(1, &parts("a=1&b=2"), &rules);
        assert_eq!(fingerprint_as(1, &parts("a=1&b=2"), &rules), recorded);
        assert_ne!(fingerprint_as(1, &parts("b=2&a=1"), &rules), recorded);
        // Under version 2 both are one request, and never equal a version-1 digest.
        let v2 = fingerprint_as(2, &parts("a=1&b=2"), &rules);
        assert_eq!(fingerprint_as(2, &parts("b=2&a=1"), &rules), v2);
        assert_ne!(v2, recorded);
    }

    fn multipart(boundary: &str, amount: &str) -> (String, Vec<u8>) {
        let ct = format!("multipart/form-data; boundary={boundary}");
        let body = multipart::tests::body(
            boundary,
            &[
                ("Content-Disposition: form-data; name=\"amount\"", amount),
                (
                    "Content-Disposition: form-data; name=\"f\"; filename=\"a.csv\"\r\nContent-Type: text/csv",
                    "x,y\r\n1,2",
                ),
            ],
        );
        (ct, body)
    }

    /// A `POST /p` with this content type and body.
    fn post<'a>(ct: &'a str, body: &'a [u8]) -> RequestParts<'a> {
        RequestParts {
            method: "POST",
            path: "/p",
            content_type: Some(ct),
            body,
            ..RequestParts::default()
        }
    }

    fn fp_of(ct: &str, body: &[u8]) -> Fingerprint {
        fingerprint(&post(ct, body), &[])
    }

    #[test]
    fn multipart_compares_by_parts() {
        let (ct1, b1) = multipart("----a1", "100");
        let (ct2, b2) = multipart("xyz", "100");
        let (ct3, b3) = multipart("xyz", "101");
        assert_ne!(b1, b2);
        assert_eq!(fp_of(&ct1, &b1), fp_of(&ct2, &b2));
        assert_ne!(fp_of(&ct1, &b1), fp_of(&ct3, &b3));
        // Malformed (a boundary that is not the body's, none at all): raw bytes.
        assert_ne!(
            fp_of("multipart/form-data; boundary=q", &b1),
            fp_of(&ct1, &b1)
        );
        assert_eq!(
            fp_of("multipart/form-data; boundary=q", &b1),
            fp_of("multipart/form-data", &b1)
        );
        assert_ne!(
            fp_of("multipart/form-data; boundary=q", &b1),
            fp_of("multipart/form-data; boundary=q", &b2)
        );
        // Version 1 compared them raw.
        let v1 = |ct: &str, body: &[u8]| fingerprint_as(1, &post(ct, body), &Rules::default());
        assert_ne!(v1(&ct1, &b1), v1(&ct2, &b2));
    }

    fn gzip(data: &[u8], mtime: u32) -> Vec<u8> {
        let mut e = flate2::GzBuilder::new()
            .mtime(mtime)
            .write(Vec::new(), flate2::Compression::default());
        e.write_all(data).expect("write");
        e.finish().expect("finish")
    }

    fn coded(encoding: Option<&str>, body: &[u8]) -> Fingerprint {
        let decoded = match decode_content(encoding, body, 1 << 20).expect("within limit") {
            Decoded::Content(c) => Some(c),
            Decoded::Identity | Decoded::Raw => None,
        };
        fingerprint(
            &RequestParts {
                method: "POST",
                path: "/p",
                content_type: Some("application/json"),
                content_encoding: encoding,
                body,
                decoded: decoded.as_deref(),
                ..RequestParts::default()
            },
            &[],
        )
    }

    #[test]
    fn coded_bodies_compare_by_content() {
        let json = br#"{"amount":100,"to":"x"}"#;
        let plain = coded(None, json);
        assert_eq!(coded(Some("gzip"), &gzip(json, 1)), plain);
        assert_eq!(coded(Some("gzip"), &gzip(json, 2)), plain);
        // Canonicalized as the same body unencoded would be.
        let respelled = br#"{ "to": "x", "amount": 1e2 }"#;
        assert_eq!(coded(Some("GZIP"), &gzip(respelled, 5)), plain);
        assert_ne!(coded(Some("gzip"), &gzip(br#"{"amount":101}"#, 1)), plain);
        // Unknown codings and bodies that do not decode: raw, never equal to the same bytes
        // unencoded.
        assert_ne!(coded(Some("zstd"), json), coded(None, json));
        assert_ne!(coded(Some("gzip"), json), coded(None, json));
        assert_eq!(coded(Some("zstd"), json), coded(Some(" ZSTD"), json));
        assert_eq!(coded(Some("identity"), json), plain);
    }

    fn pair() -> impl Strategy<Value = (String, String)> {
        ("[a-c%+]{0,3}", "[0-2%+ =]{0,3}")
    }

    proptest! {
        /// Moving pairs of different names around never changes a sorted query's
        /// fingerprint; the relative order of each name's values is all that counts.
        #[test]
        fn reordering_distinct_names_keeps_the_fingerprint(
            pairs in prop::collection::vec(pair(), 0..6),
            seed in any::<u64>(),
        ) {
            let q = |ps: &[(String, String)]| {
                ps.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join("&")
            };
            // A stable sort by the decoded name of a permutation gives the same list.
            let mut shuffled: Vec<(usize, (String, String))> =
                pairs.iter().cloned().enumerate().collect();
            let mut s = seed;
            for i in (1..shuffled.len()).rev() {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let j = (s >> 33) as usize % (i + 1);
                shuffled.swap(i, j);
            }
            // Restore each name's own order: only pairs of different names moved.
            let name = |k: &str| form::canonicalize(format!("{k}=").as_bytes());
            let mut by_name: std::collections::BTreeMap<Vec<u8>, Vec<usize>> = Default::default();
            for (i, (k, _)) in pairs.iter().enumerate() {
                by_name.entry(name(k)).or_default().push(i);
            }
            let mut next: std::collections::BTreeMap<Vec<u8>, usize> = Default::default();
            let reordered: Vec<(String, String)> = shuffled
                .iter()
                .map(|(_, (k, _))| {
                    let n = name(k);
                    let slot = next.entry(n.clone()).or_default();
                    let i = by_name[&n][*slot];
                    *slot += 1;
                    pairs[i].clone()
                })
                .collect();
            prop_assert_eq!(sorted(Some(&q(&pairs))), sorted(Some(&q(&reordered))));
        }

        /// Any gzip header (mtime) and level give the content's fingerprint.
        #[test]
        fn gzip_is_its_content(body in prop::collection::vec(any::<u8>(), 0..200), mtime in any::<u32>()) {
            prop_assert_eq!(coded(Some("gzip"), &gzip(&body, mtime)), coded(None, &body));
        }

        /// A multipart body fingerprints the same under any boundary that does not occur
        /// in its parts.
        #[test]
        fn any_boundary_gives_the_same_parts(amount in "[0-9]{1,6}", a in "[a-zA-Z0-9]{1,20}", b in "[a-zA-Z0-9]{1,20}") {
            let (ct1, b1) = multipart(&format!("=_{a}"), &amount);
            let (ct2, b2) = multipart(&format!("=_{b}"), &amount);
            prop_assert_eq!(fp_of(&ct1, &b1), fp_of(&ct2, &b2));
        }
    }
}
