//! The `Idempotency-Key` header, and the id of the record it leads to.
//!
//! A key is only meaningful together with who sent it and where: [`crate::scope`] turns
//! (namespace, tenant, method, path, key) into a [`RecordId`].

use std::fmt;

use hyper::header::{HeaderMap, HeaderName};

/// The request header that carries the key.
pub const HEADER: &str = "idempotency-key";

/// A validated idempotency key: 1..=max visible ASCII characters.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// The key as the client meant it (sf-string quotes and escapes removed).
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

// Keys are chosen by clients and may be guessable handles to their records: keep them out of
// debug output the same way as any other client data.
impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdempotencyKey({} chars)", self.0.len())
    }
}

/// Why a key header was rejected.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KeyError {
    /// More than one `Idempotency-Key` header, or a list of values.
    #[error("several Idempotency-Key values were sent; send exactly one")]
    Multiple,
    /// An empty value (`""` or nothing).
    #[error("the Idempotency-Key is empty")]
    Empty,
    /// Longer than `max_key_length`.
    #[error("the Idempotency-Key is longer than {max} characters")]
    TooLong {
        /// The configured limit.
        max: usize,
    },
    /// A character outside visible ASCII, or a malformed sf-string.
    #[error("the Idempotency-Key must be visible ASCII, as a bare token or a quoted string")]
    Invalid,
    /// Two of the route's key headers (aliases) carry different keys.
    #[error("the headers {0} and {1} carry different keys; send one key per request")]
    Conflicting(String, String),
}

/// Reads the key from the first of `names` that the request carries (a route's
/// `key_headers`, aliases such as `PayPal-Request-Id`): `Ok(None)` when none is there. Every
/// one present must be a valid key, and the same one: two different keys are an error, not
/// a choice. Each value is read as [`parse`] reads `Idempotency-Key`.
pub fn parse_any(
    headers: &HeaderMap,
    names: &[HeaderName],
    max_len: usize,
) -> Result<Option<IdempotencyKey>, KeyError> {
    let mut found: Option<(IdempotencyKey, &HeaderName)> = None;
    for name in names {
        let Some(key) = parse_header(headers, name, max_len)? else {
            continue;
        };
        match &found {
            None => found = Some((key, name)),
            Some((first, first_name)) if *first != key => {
                return Err(KeyError::Conflicting(
                    first_name.to_string(),
                    name.to_string(),
                ))
            }
            Some(_) => {}
        }
    }
    Ok(found.map(|(k, _)| k))
}

/// Reads the key from the request headers: `Ok(None)` when there is none.
///
/// Accepts an RFC 8941 sf-string (`"abc"`, with `\"` and `\\` escapes) or a bare value of
/// visible ASCII without commas (a comma means a list, i.e. several keys).
pub fn parse(headers: &HeaderMap, max_len: usize) -> Result<Option<IdempotencyKey>, KeyError> {
    parse_header(headers, &HeaderName::from_static(HEADER), max_len)
}

fn parse_header(
    headers: &HeaderMap,
    name: &HeaderName,
    max_len: usize,
) -> Result<Option<IdempotencyKey>, KeyError> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyError::Multiple);
    }
    let raw = trim_ows(value.as_bytes());
    let key = if raw.first() == Some(&b'"') {
        parse_sf_string(raw)?
    } else {
        if raw.contains(&b',') {
            return Err(KeyError::Multiple);
        }
        if !raw.iter().all(|b| (0x21..=0x7e).contains(b)) {
            return Err(KeyError::Invalid);
        }
        // All bytes are ASCII, checked just above.
        String::from_utf8(raw.to_vec()).map_err(|_| KeyError::Invalid)?
    };
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > max_len {
        return Err(KeyError::TooLong { max: max_len });
    }
    Ok(Some(IdempotencyKey(key)))
}

/// A key taken from a request body (`key_json_pointer`): the same rules as the header's,
/// 1 to `max_len` visible ASCII characters.
pub fn from_body(value: &str, max_len: usize) -> Result<IdempotencyKey, KeyError> {
    if value.is_empty() {
        return Err(KeyError::Empty);
    }
    if !value.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
        return Err(KeyError::Invalid);
    }
    if value.len() > max_len {
        return Err(KeyError::TooLong { max: max_len });
    }
    Ok(IdempotencyKey(value.to_string()))
}

fn trim_ows(mut b: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = b {
        b = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = b {
        b = rest;
    }
    b
}

/// RFC 8941 section 4.2.5, plus: the string must be the whole value (no parameters, no list).
fn parse_sf_string(raw: &[u8]) -> Result<String, KeyError> {
    let mut out = String::new();
    let mut i = 1;
    loop {
        match raw.get(i) {
            None => return Err(KeyError::Invalid),
            Some(b'\\') => match raw.get(i + 1) {
                Some(&c @ (b'"' | b'\\')) => {
                    out.push(c as char);
                    i += 2;
                }
                _ => return Err(KeyError::Invalid),
            },
            Some(b'"') => {
                i += 1;
                break;
            }
            Some(&c) if (0x20..=0x7e).contains(&c) => {
                out.push(c as char);
                i += 1;
            }
            Some(_) => return Err(KeyError::Invalid),
        }
    }
    match raw.get(i..) {
        Some([]) => Ok(out),
        Some([b',', ..]) => Err(KeyError::Multiple),
        _ => Err(KeyError::Invalid),
    }
}

/// Lowercase hex of `bytes`. `hex::encode` builds its string one `char` at a time through
/// an iterator; the slice encoder is several times faster, and record ids, fingerprints and
/// owner tokens are hex-encoded on every protected request.
pub fn to_hex(bytes: &[u8]) -> String {
    let mut buf = vec![0u8; bytes.len() * 2];
    // The buffer is exactly twice the input's length, the only way encoding can fail.
    let _ = hex::encode_to_slice(bytes, &mut buf);
    // Hex digits are ASCII.
    String::from_utf8(buf).unwrap_or_default()
}

/// The id of one record: a keyed hash of its scope ([`crate::scope::Scoper`]), shown as
/// lowercase hex.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RecordId([u8; 32]);

impl RecordId {
    /// An id from its 32 bytes.
    pub fn from_bytes(bytes: [u8; 32]) -> RecordId {
        RecordId(bytes)
    }

    /// Parses the hex form that problem responses and the admin API show.
    pub fn from_hex(s: &str) -> Option<RecordId> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).ok()?;
        Some(RecordId(out))
    }

    /// The id's bytes: an HMAC-SHA-256 output, so every bit of them is uniformly distributed (the
    /// embedded store picks a record's shard from them).
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Display for RecordId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&to_hex(&self.0))
    }
}

impl fmt::Debug for RecordId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RecordId({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::header::HeaderValue;

    fn headers(values: &[&[u8]]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(HEADER, HeaderValue::from_bytes(v).expect("test header"));
        }
        h
    }

    fn key(values: &[&[u8]]) -> Result<Option<IdempotencyKey>, KeyError> {
        parse(&headers(values), 255)
    }

    #[test]
    fn aliases_take_the_first_present_and_refuse_two_different_keys() {
        let names = [
            HeaderName::from_static(HEADER),
            HeaderName::from_static("paypal-request-id"),
        ];
        let with = |pairs: &[(&'static str, &'static str)]| {
            let mut h = HeaderMap::new();
            for (n, v) in pairs {
                h.append(*n, HeaderValue::from_static(v));
            }
            parse_any(&h, &names, 255)
        };
        let key = |r: Result<Option<IdempotencyKey>, KeyError>| r.unwrap().unwrap().0;
        assert_eq!(key(with(&[("paypal-request-id", "pp-1")])), "pp-1");
        assert_eq!(key(with(&[("idempotency-key", "ik-1")])), "ik-1");
        // The same key in both (one quoted) is one key.
        let both = with(&[("paypal-request-id", "\"k\""), ("idempotency-key", "k")]);
        assert_eq!(key(both), "k");
        assert!(matches!(
            with(&[("paypal-request-id", "a"), ("idempotency-key", "b")]),
            Err(KeyError::Conflicting(..))
        ));
        // An invalid alias is an error even when the preferred header is fine.
        assert_eq!(
            with(&[("idempotency-key", "k"), ("paypal-request-id", "")]),
            Err(KeyError::Empty)
        );
        assert_eq!(with(&[("x-other", "k")]).unwrap(), None);
    }

    #[test]
    fn accepts_bare_tokens_and_sf_strings() {
        assert_eq!(key(&[b"abc-123"]).unwrap().unwrap().as_str(), "abc-123");
        assert_eq!(key(&[b"\"abc 123\""]).unwrap().unwrap().as_str(), "abc 123");
        assert_eq!(
            key(&[br#""a\"b\\c""#]).unwrap().unwrap().as_str(),
            "a\"b\\c"
        );
        assert_eq!(key(&[b"  tok  "]).unwrap().unwrap().as_str(), "tok");
        assert_eq!(key(&[]).unwrap(), None);
    }

    #[test]
    fn rejects_bad_keys() {
        assert_eq!(key(&[b""]), Err(KeyError::Empty));
        assert_eq!(key(&[b"\"\""]), Err(KeyError::Empty));
        assert_eq!(key(&[b"a", b"b"]), Err(KeyError::Multiple));
        assert_eq!(key(&[b"a,b"]), Err(KeyError::Multiple));
        assert_eq!(key(&[b"\"a\", \"b\""]), Err(KeyError::Multiple));
        assert_eq!(key(&[b"a b"]), Err(KeyError::Invalid));
        assert_eq!(key(&[b"\"abc"]), Err(KeyError::Invalid));
        assert_eq!(key(&[b"\"a\";p=1"]), Err(KeyError::Invalid));
        assert_eq!(key(&[b"\"a\\nb\""]), Err(KeyError::Invalid));
        assert_eq!(key(&["caf\u{e9}".as_bytes()]), Err(KeyError::Invalid));
        // Other control characters never reach us: HeaderValue (and hyper) refuse them.
        assert_eq!(key(&[b"a\tb"]), Err(KeyError::Invalid));
        let long = "k".repeat(256);
        assert_eq!(key(&[long.as_bytes()]), Err(KeyError::TooLong { max: 255 }));
        assert!(key(&["k".repeat(255).as_bytes()]).unwrap().is_some());
    }

    #[test]
    fn record_ids_print_as_hex_and_parse_back() {
        let id = RecordId::from_bytes([0xab; 32]);
        assert_eq!(id.to_string(), "ab".repeat(32));
        assert_eq!(RecordId::from_hex(&id.to_string()), Some(id));
        assert_eq!(RecordId::from_hex("ab"), None);
        assert_eq!(to_hex(&[0x00, 0x9f, 0xff]), "009fff");
    }
}
