//! Request fingerprints (interim: serde_json sorted-key canonical form; exact RFC 8785 with
//! the exactness rule replaces it).

use std::fmt;

use sha2::{Digest, Sha256};

/// Version of the fingerprint input format, stored with every record.
pub const FINGERPRINT_VERSION: u16 = 1;

/// SHA-256 of a request's meaning.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// Lowercase hex.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
    /// Parses lowercase or uppercase hex.
    pub fn from_hex(s: &str) -> Option<Self> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).ok()?;
        Some(Fingerprint(out))
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// The parts of a request that its fingerprint covers.
pub struct RequestParts<'a> {
    #[allow(missing_docs)]
    pub method: &'a str,
    #[allow(missing_docs)]
    pub path: &'a str,
    #[allow(missing_docs)]
    pub query: Option<&'a str>,
    #[allow(missing_docs)]
    pub content_type: Option<&'a str>,
    #[allow(missing_docs)]
    pub body: &'a [u8],
}

/// An RFC 6901 JSON pointer.
#[derive(Clone, Debug, PartialEq)]
pub struct JsonPointer(String);

/// A malformed JSON pointer.
#[derive(Debug, thiserror::Error)]
#[error("a JSON pointer is empty or starts with '/'")]
pub struct PointerError;

impl JsonPointer {
    /// Parses a pointer.
    pub fn parse(s: &str) -> Result<JsonPointer, PointerError> {
        if s.is_empty() || s.starts_with('/') {
            Ok(JsonPointer(s.to_string()))
        } else {
            Err(PointerError)
        }
    }
}

/// The fingerprint of a request.
pub fn fingerprint(parts: &RequestParts<'_>, ignore: &[JsonPointer]) -> Fingerprint {
    let essence = parts.content_type.map(|c| {
        c.split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase()
    });
    let is_json = essence
        .as_deref()
        .is_some_and(|e| e == "application/json" || e.ends_with("+json"));
    let canonical = if is_json {
        serde_json::from_slice::<serde_json::Value>(parts.body)
            .ok()
            .map(|mut v| {
                for p in ignore {
                    if let Some(parent) = p.0.rsplit_once('/') {
                        if let Some(serde_json::Value::Object(m)) = v.pointer_mut(parent.0) {
                            m.remove(parent.1);
                        }
                    }
                }
                serde_json::to_vec(&v).unwrap_or_default()
            })
    } else {
        None
    };
    let (kind, body): (u8, &[u8]) = match &canonical {
        Some(c) => (1, c),
        None => (0, parts.body),
    };
    let mut h = Sha256::new();
    h.update(b"idemgate-fp\x00");
    h.update(FINGERPRINT_VERSION.to_be_bytes());
    let mut field = |present: bool, b: &[u8]| {
        h.update([present as u8]);
        h.update((b.len() as u64).to_be_bytes());
        h.update(b);
    };
    field(true, parts.method.as_bytes());
    field(true, parts.path.as_bytes());
    field(parts.query.is_some(), parts.query.unwrap_or("").as_bytes());
    field(
        essence.is_some(),
        essence.as_deref().unwrap_or("").as_bytes(),
    );
    field(true, &[kind]);
    field(true, body);
    Fingerprint(h.finalize().into())
}
