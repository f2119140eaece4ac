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

pub use encoding::{
    count as coding_count, decode as decode_content, is_heavy as decoding_is_heavy, Decoded,
    TooLarge,
};
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
mod tests;

#[cfg(test)]
mod version_2_tests;
