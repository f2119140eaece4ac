//! An upstream answer's framing made idemgate's own: whatever length an upstream declares,
//! the bytes idemgate writes to its client are one answer, framed by idemgate.
//!
//! hyper's client reads a body by `Transfer-Encoding` when there is one, and otherwise by
//! `Content-Length` (RFC 9112 6.3), but leaves the upstream's headers as they came; hyper's
//! server then trusts a `Content-Length` it is handed. An upstream that sends both (Node's
//! `http` and uvicorn with httptools do, when the app sets both) had its length reach the
//! client beside a body of another length: the client read the rest as the next answer on
//! its connection. So the length goes when `Transfer-Encoding` is there, and is written
//! again in one canonical form (`008` and `8, 8` as `8`) when it is the framing.

use std::io;

use hyper::header::{HeaderMap, HeaderValue, CONTENT_LENGTH, TRANSFER_ENCODING};
use hyper::StatusCode;

/// Rewrites an upstream answer's framing headers before anything else reads them: with a
/// `Transfer-Encoding`, the body was read by it and the `Content-Length` is dropped; a
/// `Content-Length` alone is written as the one number hyper read the body by. Returns the
/// length the body was read by, if it was one.
pub fn reframe(headers: &mut HeaderMap) -> Option<u64> {
    if headers.contains_key(TRANSFER_ENCODING) {
        headers.remove(CONTENT_LENGTH);
        return None;
    }
    if !headers.contains_key(CONTENT_LENGTH) {
        return None;
    }
    match declared_length(headers) {
        Some(n) => {
            headers.insert(CONTENT_LENGTH, HeaderValue::from(n));
            Some(n)
        }
        // hyper refuses such an answer's head; should one come through, its length says
        // nothing idemgate can write.
        None => {
            headers.remove(CONTENT_LENGTH);
            None
        }
    }
}

/// The `Content-Length` of `headers` as one number: every line and every comma-separated
/// value all digits and all equal (RFC 9110 8.6), or none.
pub fn declared_length(headers: &HeaderMap) -> Option<u64> {
    let mut found: Option<u64> = None;
    for value in headers.get_all(CONTENT_LENGTH) {
        let text = value.to_str().ok()?;
        for part in text.split(',') {
            let part = part.trim();
            if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            let n: u64 = part.parse().ok()?;
            match found {
                Some(f) if f != n => return None,
                _ => found = Some(n),
            }
        }
    }
    found
}

/// Whether a final answer of `status` can carry a body whose length its `Content-Length`
/// states: not an answer to `HEAD`, not 1xx, 204 or 304 (RFC 9110 8.6).
pub fn length_is_of_bytes_sent(status: StatusCode, head: bool) -> bool {
    !head
        && !status.is_informational()
        && status != StatusCode::NO_CONTENT
        && status != StatusCode::NOT_MODIFIED
}

/// Whether a status cannot be the final answer to a request that asked for no protocol
/// switch: `101 Switching Protocols` (idemgate forwards no `Upgrade`) and any other 1xx,
/// which hyper's client passes on only when it reads it as final.
pub fn not_an_answer(status: StatusCode) -> bool {
    status.is_informational()
}

/// Whether an error reading an answer's body says the answer itself was broken: the
/// upstream ended it before its declared length, or its chunked framing was malformed.
/// A reset or a timeout says only that the answer stopped arriving.
pub fn broken_body(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut at = Some(e);
    while let Some(err) = at {
        if let Some(io) = err.downcast_ref::<io::Error>() {
            return matches!(
                io.kind(),
                io::ErrorKind::UnexpectedEof
                    | io::ErrorKind::InvalidData
                    | io::ErrorKind::InvalidInput
            );
        }
        if let Some(h) = err.downcast_ref::<hyper::Error>() {
            if h.is_incomplete_message() || h.is_parse() {
                return true;
            }
        }
        at = err.source();
    }
    false
}

/// Whether a failed exchange failed on the answer's head: hyper could not parse what the
/// upstream sent (an invalid or contradictory length, a malformed status line).
pub fn broken_head(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut at = Some(e);
    while let Some(err) = at {
        if let Some(h) = err.downcast_ref::<hyper::Error>() {
            if h.is_parse() || h.is_parse_status() {
                return true;
            }
        }
        at = err.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.append(*n, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn transfer_encoding_drops_the_length() {
        let mut h = with(&[("content-length", "8"), ("transfer-encoding", "chunked")]);
        assert_eq!(reframe(&mut h), None);
        assert!(!h.contains_key(CONTENT_LENGTH));
        let mut h = with(&[("content-length", "8"), ("transfer-encoding", "identity")]);
        assert_eq!(reframe(&mut h), None);
        assert!(!h.contains_key(CONTENT_LENGTH));
    }

    #[test]
    fn a_length_is_written_in_one_canonical_form() {
        for v in ["008", "8, 8", " 8"] {
            let mut h = HeaderMap::new();
            h.insert(CONTENT_LENGTH, HeaderValue::from_static(v));
            assert_eq!(reframe(&mut h), Some(8), "{v}");
            assert_eq!(h.get_all(CONTENT_LENGTH).iter().count(), 1);
            assert_eq!(h[CONTENT_LENGTH], "8", "{v}");
        }
        let mut h = with(&[("content-length", "8"), ("content-length", "08")]);
        assert_eq!(reframe(&mut h), Some(8));
        assert_eq!(h.get_all(CONTENT_LENGTH).iter().count(), 1);
    }

    #[test]
    fn contradictory_lengths_are_none() {
        for v in ["8, 9", "", "-1", "8x", "0x8"] {
            let mut h = HeaderMap::new();
            h.insert(CONTENT_LENGTH, HeaderValue::from_static(v));
            assert_eq!(declared_length(&h), None, "{v}");
            assert_eq!(reframe(&mut h), None);
            assert!(!h.contains_key(CONTENT_LENGTH));
        }
    }

    #[test]
    fn an_early_end_is_broken_and_a_reset_is_not() {
        let eof = io::Error::new(io::ErrorKind::UnexpectedEof, "incomplete body");
        assert!(broken_body(&eof));
        let reset = io::Error::from(io::ErrorKind::ConnectionReset);
        assert!(!broken_body(&reset));
    }

    #[test]
    fn interim_statuses_are_not_answers() {
        assert!(not_an_answer(StatusCode::SWITCHING_PROTOCOLS));
        assert!(not_an_answer(StatusCode::CONTINUE));
        assert!(!not_an_answer(StatusCode::OK));
        assert!(!length_is_of_bytes_sent(StatusCode::OK, true));
        assert!(!length_is_of_bytes_sent(StatusCode::NOT_MODIFIED, false));
        assert!(length_is_of_bytes_sent(StatusCode::CREATED, false));
    }
}
