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

use hyper::header::{
    HeaderMap, HeaderValue, CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE, TRANSFER_ENCODING,
};
use hyper::{StatusCode, Version};

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

/// Whether an HTTP/1.x answer's body is delimited by its connection's close (RFC 9112 6.3,
/// rule 8): no `Content-Length` and no `Transfer-Encoding` whose final coding is chunked,
/// on a status and a request whose answer has a body. Read before [`reframe`] rewrites the
/// headers. Such a body ends where the upstream closed, whether it had finished or not.
pub fn close_delimited(
    version: Version,
    status: StatusCode,
    head: bool,
    headers: &HeaderMap,
) -> bool {
    if !matches!(version, Version::HTTP_10 | Version::HTTP_11)
        || !length_is_of_bytes_sent(status, head)
    {
        return false;
    }
    if let Some(last) = headers.get_all(TRANSFER_ENCODING).iter().next_back() {
        let chunked_last = last
            .to_str()
            .ok()
            .and_then(|v| v.rsplit(',').next())
            .is_some_and(|c| c.trim().eq_ignore_ascii_case("chunked"));
        return !chunked_last;
    }
    !headers.contains_key(CONTENT_LENGTH)
}

/// A close-delimited answer of an upstream, marked on its head's extensions by the
/// exchange.
#[derive(Debug, Clone, Copy)]
pub struct CloseDelimited;

/// What the bytes of a close-delimited answer say of whether it arrived whole.
#[derive(Debug, PartialEq, Eq)]
pub enum Wholeness {
    /// Its own format ended: JSON that parses, a gzip or br stream that ends properly.
    Whole,
    /// Its own format says it was cut short, and how.
    Cut(String),
    /// Nothing in it can say (another type, an empty body).
    Unknowable,
}

/// Whether a close-delimited body (its head's `headers`) is known whole: by its outermost
/// `Content-Encoding` when that is gzip or br, whose streams mark their end; otherwise,
/// with no coding, by a JSON (`application/json`, `+json`) body that parses.
pub fn wholeness(headers: &HeaderMap, body: &[u8]) -> Wholeness {
    if body.is_empty() {
        return Wholeness::Unknowable;
    }
    let codings: Vec<String> = headers
        .get_all(CONTENT_ENCODING)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|c| c.trim().to_ascii_lowercase())
        .filter(|c| !c.is_empty() && c != "identity")
        .collect();
    if let Some(outer) = codings.last() {
        let ended = match outer.as_str() {
            "gzip" | "x-gzip" => io::copy(
                &mut flate2::read::MultiGzDecoder::new(body),
                &mut io::sink(),
            ),
            "br" => io::copy(
                &mut brotli_decompressor::Decompressor::new(body, 16 * 1024),
                &mut io::sink(),
            ),
            _ => return Wholeness::Unknowable,
        };
        return match ended {
            Ok(_) => Wholeness::Whole,
            Err(e) => Wholeness::Cut(format!(
                "the upstream ended an answer it did not frame by closing the connection, and its {outer} stream does not end: {e}"
            )),
        };
    }
    let json = headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .map(|t| t.trim().to_ascii_lowercase())
        .is_some_and(|t| t == "application/json" || (t.contains('/') && t.ends_with("+json")));
    if !json {
        return Wholeness::Unknowable;
    }
    match serde_json::from_slice::<serde::de::IgnoredAny>(body) {
        Ok(_) => Wholeness::Whole,
        Err(e) => Wholeness::Cut(format!(
            "the upstream ended an answer it did not frame by closing the connection, and its JSON body does not parse ({e}): it was cut short"
        )),
    }
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
    fn close_delimited_is_http1_without_a_length_or_chunked_last() {
        let v11 = Version::HTTP_11;
        let ok = StatusCode::CREATED;
        assert!(close_delimited(v11, ok, false, &HeaderMap::new()));
        assert!(close_delimited(
            Version::HTTP_10,
            ok,
            false,
            &HeaderMap::new()
        ));
        assert!(!close_delimited(
            Version::HTTP_2,
            ok,
            false,
            &HeaderMap::new()
        ));
        assert!(!close_delimited(v11, ok, true, &HeaderMap::new()));
        assert!(!close_delimited(
            v11,
            StatusCode::NO_CONTENT,
            false,
            &HeaderMap::new()
        ));
        assert!(!close_delimited(
            v11,
            ok,
            false,
            &with(&[("content-length", "3")])
        ));
        let chunked = with(&[("transfer-encoding", "gzip, chunked")]);
        assert!(!close_delimited(v11, ok, false, &chunked));
        // A coding other than chunked last: read until the close (RFC 9112 6.3).
        let identity = with(&[("transfer-encoding", "identity"), ("content-length", "3")]);
        assert!(close_delimited(v11, ok, false, &identity));
    }

    /// `data` as a brotli stream of one uncompressed meta-block (RFC 7932 9.2): WBITS 16,
    /// ISLAST 0, MNIBBLES 4, MLEN - 1, ISUNCOMPRESSED, the bytes, an empty last block.
    fn brotli_stored(data: &[u8]) -> Vec<u8> {
        let mlen = u32::try_from(data.len() - 1).unwrap();
        // Bits, first to last: 0 (WBITS), 0 (ISLAST), 00 (MNIBBLES), MLEN - 1 in 16 bits,
        // 1 (ISUNCOMPRESSED), padding to the byte.
        let bits: u32 = (mlen << 4) | (1 << 20);
        let mut out = vec![bits as u8, (bits >> 8) as u8, (bits >> 16) as u8];
        out.extend_from_slice(data);
        out.push(0b11);
        out
    }

    #[test]
    fn json_and_codings_that_end_are_whole_and_their_cuts_are_known() {
        use std::io::Write;
        let json = with(&[("content-type", "application/json; charset=utf-8")]);
        let body = br#"{"id":"tr_1","amount":2500}"#;
        assert_eq!(wholeness(&json, body), Wholeness::Whole);
        assert!(matches!(wholeness(&json, &body[..14]), Wholeness::Cut(_)));
        let problem = with(&[("content-type", "application/problem+json")]);
        assert!(matches!(wholeness(&problem, b"{\"ty"), Wholeness::Cut(_)));
        let text = with(&[("content-type", "text/plain")]);
        assert_eq!(wholeness(&text, b"receipt 3"), Wholeness::Unknowable);
        assert_eq!(wholeness(&json, b""), Wholeness::Unknowable);
        assert_eq!(wholeness(&HeaderMap::new(), body), Wholeness::Unknowable);

        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(b"<receipt id='3'/>").unwrap();
        let gz = e.finish().unwrap();
        let gzip = with(&[("content-type", "text/xml"), ("content-encoding", "gzip")]);
        assert_eq!(wholeness(&gzip, &gz), Wholeness::Whole);
        assert!(matches!(
            wholeness(&gzip, &gz[..gz.len() - 4]),
            Wholeness::Cut(_)
        ));

        let br = brotli_stored(b"<receipt id='3'/>");
        let brotli = with(&[("content-type", "text/xml"), ("content-encoding", "br")]);
        assert_eq!(wholeness(&brotli, &br), Wholeness::Whole);
        assert!(matches!(
            wholeness(&brotli, &br[..br.len() - 1]),
            Wholeness::Cut(_)
        ));
        assert!(matches!(wholeness(&brotli, &br[..10]), Wholeness::Cut(_)));
        let deflate = with(&[("content-encoding", "deflate")]);
        assert_eq!(wholeness(&deflate, &gz), Wholeness::Unknowable);
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
