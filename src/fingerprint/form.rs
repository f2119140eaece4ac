//! Canonical form of `application/x-www-form-urlencoded` bodies.
//!
//! Crates: `percent-encoding` decodes to raw bytes. `form_urlencoded::parse` is not used for
//! decoding because it replaces invalid UTF-8 with U+FFFD, which would make `a=%FF` and `a=%FE`
//! collide; `form_urlencoded::byte_serialize` is used for re-encoding, since it encodes any byte
//! string one way only.

use std::borrow::Cow;

use percent_encoding::percent_decode;

/// A decoded name and value.
type Pair<'a> = (Cow<'a, [u8]>, Cow<'a, [u8]>);

/// Decodes the pairs (`+` is a space, then percent-decoding), stable-sorts them by name so the
/// values of one name keep their order, and re-encodes them canonically. Empty pieces between
/// `&` are dropped and a pair without `=` is a name with an empty value, as in the WHATWG URL
/// standard's parser, so inputs that parse the same canonicalize the same.
pub(crate) fn canonicalize(body: &[u8]) -> Vec<u8> {
    let mut pairs = parse(body);
    pairs.sort_by(|a, b| a.0.cmp(&b.0));
    encode(&pairs, body.len())
}

/// As [`canonicalize`], keeping the pairs in the order they were sent (a route whose
/// upstream reads its query's order: `query_order = "significant"`).
pub(crate) fn canonicalize_in_order(body: &[u8]) -> Vec<u8> {
    encode(&parse(body), body.len())
}

/// The decoded values of the pairs named `name`, in order.
pub(crate) fn values(body: &[u8], name: &str) -> Vec<Vec<u8>> {
    parse(body)
        .into_iter()
        .filter(|(n, _)| n.as_ref() == name.as_bytes())
        .map(|(_, v)| v.into_owned())
        .collect()
}

fn parse(body: &[u8]) -> Vec<Pair<'_>> {
    body.split(|&b| b == b'&')
        .filter(|piece| !piece.is_empty())
        .map(|piece| match piece.iter().position(|&b| b == b'=') {
            Some(eq) => (decode(&piece[..eq]), decode(&piece[eq + 1..])),
            None => (decode(piece), Cow::Borrowed(&[][..])),
        })
        .collect()
}

fn encode(pairs: &[Pair<'_>], capacity: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(capacity);
    for (i, (name, value)) in pairs.iter().enumerate() {
        if i > 0 {
            out.push(b'&');
        }
        for chunk in form_urlencoded::byte_serialize(name) {
            out.extend_from_slice(chunk.as_bytes());
        }
        out.push(b'=');
        for chunk in form_urlencoded::byte_serialize(value) {
            out.extend_from_slice(chunk.as_bytes());
        }
    }
    out
}

fn decode(raw: &[u8]) -> Cow<'_, [u8]> {
    if raw.contains(&b'+') {
        let spaced: Vec<u8> = raw
            .iter()
            .map(|&b| if b == b'+' { b' ' } else { b })
            .collect();
        Cow::Owned(percent_decode(&spaced).collect())
    } else {
        percent_decode(raw).into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(s: &str) -> String {
        String::from_utf8(canonicalize(s.as_bytes())).expect("ascii output")
    }

    #[test]
    fn sorts_by_name() {
        assert_eq!(canon("a=1&b=2"), canon("b=2&a=1"));
        assert_eq!(canon("b=2&a=1"), "a=1&b=2");
    }

    #[test]
    fn keeps_order_of_repeated_names() {
        assert_ne!(canon("a=1&a=2"), canon("a=2&a=1"));
        assert_eq!(canon("a=2&b=0&a=1"), "a=2&a=1&b=0");
    }

    #[test]
    fn decodes_before_comparing() {
        assert_eq!(canon("a=%41"), canon("a=A"));
        assert_eq!(canon("a=x+y"), canon("a=x%20y"));
        assert_eq!(canon("%61=1"), canon("a=1"));
        assert_eq!(canon("a=%e2%82%ac"), canon("a=%E2%82%AC"));
        assert_eq!(canon("a=\u{20ac}"), canon("a=%E2%82%AC"));
        // A literal plus is %2B and differs from a space.
        assert_ne!(canon("a=%2B"), canon("a=+"));
    }

    #[test]
    fn invalid_utf8_does_not_collide() {
        assert_ne!(canon("a=%FF"), canon("a=%FE"));
        assert_eq!(canon("a=%FF"), "a=%FF");
    }

    #[test]
    fn structure() {
        assert_eq!(canon(""), "");
        assert_eq!(canon("&&a=1&&"), "a=1");
        assert_eq!(canon("a"), "a=");
        assert_eq!(canon("a=b=c"), "a=b%3Dc");
        assert_ne!(canon("a=1&b=2"), canon("a=1%26b%3D2"));
        // Malformed escapes stay literal, as WHATWG decoding leaves them.
        assert_eq!(canon("a=%zz"), canon("a=%25zz"));
    }

    #[test]
    fn in_order_keeps_the_order_sent() {
        let in_order =
            |s: &str| String::from_utf8(canonicalize_in_order(s.as_bytes())).expect("ascii");
        assert_eq!(in_order("b=2&a=%31"), "b=2&a=1");
        assert_ne!(in_order("a=1&b=2"), in_order("b=2&a=1"));
        assert_eq!(in_order("&a=x+y&"), in_order("a=x%20y"));
        assert_eq!(in_order(""), "");
    }
}
