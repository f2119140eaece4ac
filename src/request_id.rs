//! `X-Request-Id`: the name one request goes by in every log it passes through. A client's
//! (or a gateway's) id is kept; a request without one gets a fresh one. Either way the
//! upstream receives it, the client gets it back, and the request's log line carries it.

use hyper::header::{HeaderMap, HeaderName, HeaderValue};

/// The header.
pub const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Longest id that is passed on as it came; a longer one is replaced.
const MAX_LEN: usize = 128;

/// The request's id: its own `X-Request-Id` when it has exactly one of 1 to 128 visible
/// ASCII characters, else a fresh one (32 hex digits, 128 random bits), which then replaces
/// whatever the request had. Control characters and the like never reach a log line.
pub fn ensure(headers: &mut HeaderMap) -> HeaderValue {
    let mut given = headers.get_all(&X_REQUEST_ID).iter();
    if let (Some(v), None) = (given.next(), given.next()) {
        let b = v.as_bytes();
        if (1..=MAX_LEN).contains(&b.len()) && b.iter().all(u8::is_ascii_graphic) {
            return v.clone();
        }
    }
    let id = fresh();
    headers.insert(X_REQUEST_ID, id.clone());
    id
}

/// A new id: 32 lowercase hex digits, like nginx's `$request_id`.
pub fn fresh() -> HeaderValue {
    let mut hex = [0u8; 32];
    // The buffer is exactly twice the 16 random bytes, the only way encoding can fail.
    let _ = hex::encode_to_slice(rand::random::<[u8; 16]>(), &mut hex);
    HeaderValue::from_bytes(&hex).unwrap_or_else(|_| HeaderValue::from_static("-"))
}

/// The id as text for a log line (always visible ASCII, see [`ensure`]).
pub fn as_str(id: &HeaderValue) -> &str {
    id.to_str().unwrap_or("-")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_good_id_is_kept_and_anything_else_replaced() {
        let mut h = HeaderMap::new();
        h.insert(X_REQUEST_ID, HeaderValue::from_static("gw-7f3a:01"));
        assert_eq!(ensure(&mut h), "gw-7f3a:01");
        assert_eq!(h.get_all(&X_REQUEST_ID).iter().count(), 1);

        for bad in [
            vec![HeaderValue::from_static("")],
            vec![HeaderValue::from_static("has space")],
            vec![HeaderValue::from_str(&"x".repeat(129)).unwrap()],
            vec![HeaderValue::from_static("a"), HeaderValue::from_static("b")],
            vec![],
        ] {
            let mut h = HeaderMap::new();
            for v in &bad {
                h.append(X_REQUEST_ID, v.clone());
            }
            let id = ensure(&mut h);
            assert_eq!(id.len(), 32, "{bad:?}");
            assert!(id.as_bytes().iter().all(u8::is_ascii_hexdigit));
            let now: Vec<_> = h.get_all(&X_REQUEST_ID).iter().collect();
            assert_eq!(now, [&id], "{bad:?}");
        }
        assert_ne!(fresh(), fresh());
    }
}
