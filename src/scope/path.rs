//! One spelling per path: the form that route matching, the scope and the fingerprint all
//! use, so that `/v1/transfers`, `/v1//transfers/`, `/v1/%74ransfers` and
//! `/v1/./transfers` are one operation, as they are to most upstream frameworks.
//!
//! RFC 3986 section 6.2.2 normalization, in its order: percent-encodings of unreserved
//! characters decoded and the others written with uppercase hex (6.2.2.1-2), then dot
//! segments removed (6.2.2.3, with the algorithm of 5.2.4). On top of that, unless the
//! route asks for `path_match = "strict"`, empty segments (repeated slashes) are dropped and
//! a trailing slash is ignored; with `case_insensitive_paths = true` the letters are
//! compared in lower case (percent-encodings keep their uppercase hex).
//!
//! Some spellings cannot be normalized safely, because upstreams disagree on what they
//! mean: an encoded `/` or `\` (one segment to some frameworks, two to others), dot
//! segments that climb above the root, and broken percent-encoding. Protected requests with
//! such a path are refused (400 `invalid-path`) instead of being guessed at.

use std::borrow::Cow;

/// How a route treats path spellings (`path_match` and `case_insensitive_paths`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct PathRules {
    /// Keep repeated and trailing slashes as they are (`path_match = "strict"`), for
    /// upstreams that route `/a/` and `/a` differently.
    pub strict: bool,
    /// Compare letters case-insensitively, for IIS/ASP.NET-style upstreams.
    pub case_insensitive: bool,
}

/// Why a path cannot be normalized safely.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    /// `%` not followed by two hex digits.
    #[error("the path has broken percent-encoding")]
    BadPercent,
    /// `%2F` or `%5C`: a separator that some upstreams decode and others do not.
    #[error("the path contains an encoded '/' or '\\', which upstreams read differently")]
    EncodedSeparator,
    /// A raw `\`: a separator to some upstreams (IIS, ASP.NET, Windows servers), a
    /// character to others.
    #[error("the path contains a '\\', which some upstreams read as '/'")]
    Backslash,
    /// `..` segments that climb above the root.
    #[error("the path climbs above the root with '..' segments")]
    AboveRoot,
    /// Not an absolute path (`*`, or an empty path).
    #[error("the path is not absolute")]
    NotAbsolute,
}

fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

fn hex_val(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// Whether `path` is already in normal form under `rules`, checked in one pass without
/// allocating: the common case, so a request pays for a copy only when its client spelled
/// the path unusually.
fn is_normal(path: &str, rules: PathRules) -> bool {
    let b = path.as_bytes();
    if b.first() != Some(&b'/') {
        return false;
    }
    // An escape to normalize, a byte that must become one (a raw non-ASCII byte), or a
    // backslash to refuse.
    if b.iter().any(|&c| c == b'%' || c == b'\\' || c >= 0x80) {
        return false;
    }
    if rules.case_insensitive && b.iter().any(u8::is_ascii_uppercase) {
        return false;
    }
    // Dot segments, and (unless strict) empty segments: look at each segment.
    let mut segments = path[1..].split('/').peekable();
    while let Some(seg) = segments.next() {
        if seg == "." || seg == ".." {
            return false;
        }
        if !rules.strict && seg.is_empty() {
            // `/` alone is normal; `//` or a trailing slash is not.
            if path.len() > 1 || segments.peek().is_some() {
                return false;
            }
        }
    }
    true
}

/// Normalizes an absolute request path (without its query) under `rules`.
pub fn normalize(path: &str, rules: PathRules) -> Result<Cow<'_, str>, PathError> {
    if is_normal(path, rules) {
        return Ok(Cow::Borrowed(path));
    }
    if !path.starts_with('/') {
        return Err(PathError::NotAbsolute);
    }
    // 6.2.2.1 and 6.2.2.2: percent-encodings.
    let b = path.as_bytes();
    let mut decoded = String::with_capacity(path.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'%' {
            let (Some(hi), Some(lo)) = (
                b.get(i + 1).copied().and_then(hex_val),
                b.get(i + 2).copied().and_then(hex_val),
            ) else {
                return Err(PathError::BadPercent);
            };
            let v = hi << 4 | lo;
            if v == b'/' || v == b'\\' {
                return Err(PathError::EncodedSeparator);
            }
            if is_unreserved(v) {
                decoded.push(char::from(v));
            } else {
                decoded.push('%');
                decoded.push(char::from(b"0123456789ABCDEF"[usize::from(hi)]));
                decoded.push(char::from(b"0123456789ABCDEF"[usize::from(lo)]));
            }
            i += 3;
        } else if c == b'\\' {
            return Err(PathError::Backslash);
        } else if c >= 0x80 {
            // A raw byte (UTF-8 sent unencoded, as curl and decoding gateways do) is the
            // same byte as its escape: `jos\xc3\xa9` and `jos%C3%A9` are one payee. Kept
            // a byte, never read as a Latin-1 character and re-encoded as two.
            decoded.push('%');
            decoded.push(char::from(b"0123456789ABCDEF"[usize::from(c >> 4)]));
            decoded.push(char::from(b"0123456789ABCDEF"[usize::from(c & 0xf)]));
            i += 1;
        } else {
            decoded.push(char::from(c));
            i += 1;
        }
    }
    // 6.2.2.3: dot segments (5.2.4), and the slash rules.
    let mut out: Vec<&str> = Vec::new();
    let mut ends_in_dir = false;
    for seg in decoded[1..].split('/') {
        match seg {
            "." => ends_in_dir = true,
            ".." => {
                if out.pop().is_none() {
                    return Err(PathError::AboveRoot);
                }
                ends_in_dir = true;
            }
            "" if !rules.strict => {}
            s => {
                out.push(s);
                ends_in_dir = false;
            }
        }
    }
    let mut normal = String::with_capacity(decoded.len());
    for seg in &out {
        normal.push('/');
        normal.push_str(seg);
    }
    // Strict paths keep the directory form that 5.2.4 leaves (`/a/.` is `/a/`); an empty
    // last segment of a strict path was pushed above and already gives its slash.
    if normal.is_empty() || (rules.strict && ends_in_dir) {
        normal.push('/');
    }
    if rules.case_insensitive {
        lowercase_outside_escapes(&mut normal);
    }
    Ok(Cow::Owned(normal))
}

/// ASCII letters to lower case, except the hex digits of percent-encodings, which RFC 3986
/// wants in upper case.
fn lowercase_outside_escapes(s: &mut String) {
    let mut bytes = std::mem::take(s).into_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            i += 3;
        } else {
            bytes[i] = bytes[i].to_ascii_lowercase();
            i += 1;
        }
    }
    // Only ASCII letters changed, so the bytes are still the UTF-8 they were.
    *s = String::from_utf8(bytes).unwrap_or_default();
}

#[cfg(test)]
mod tests {
    use super::*;

    const LENIENT: PathRules = PathRules {
        strict: false,
        case_insensitive: false,
    };
    const STRICT: PathRules = PathRules {
        strict: true,
        case_insensitive: false,
    };
    const NOCASE: PathRules = PathRules {
        strict: false,
        case_insensitive: true,
    };

    fn n(p: &str, rules: PathRules) -> Result<String, PathError> {
        normalize(p, rules).map(|c| c.into_owned())
    }

    #[test]
    fn raw_non_ascii_bytes_are_their_escapes() {
        for p in [
            "/v1/payees/jos\u{e9}",
            "/v1/payees//jos\u{e9}",
            "/v1/payees/jos%C3%A9",
            "/v1/payees/jos%c3%a9",
        ] {
            assert_eq!(n(p, LENIENT).unwrap(), "/v1/payees/jos%C3%A9", "{p:?}");
        }
        // Never a byte read as a Latin-1 character and encoded again.
        assert!(!n("/v1/payees/jos\u{e9}", LENIENT)
            .unwrap()
            .contains("%C3%83"));
        assert_eq!(n("/\u{20ac}", NOCASE).unwrap(), "/%E2%82%AC");
    }

    #[test]
    fn a_raw_backslash_is_refused() {
        for p in ["/v1\\transfers", "/v1/transfers\\", "\\v1/transfers"] {
            let e = n(p, LENIENT).err();
            assert!(
                matches!(e, Some(PathError::Backslash | PathError::NotAbsolute)),
                "{p:?}: {e:?}"
            );
        }
        assert_eq!(n("/V1\\Transfers", NOCASE), Err(PathError::Backslash));
    }

    #[test]
    fn spellings_of_one_path_are_one_path() {
        for p in [
            "/v1/transfers",
            "/v1/transfers/",
            "/v1//transfers",
            "//v1/transfers//",
            "/v1/%74ransfers",
            "/v1/%74%72ansfers",
            "/v1/./transfers",
            "/v1/x/../transfers",
            "/v1/%2e/transfers",
            "/v1/%2E%2E/v1/transfers",
        ] {
            assert_eq!(n(p, LENIENT).unwrap(), "/v1/transfers", "{p}");
        }
        assert_eq!(n("/", LENIENT).unwrap(), "/");
        assert_eq!(n("//", LENIENT).unwrap(), "/");
        assert_eq!(n("/a/..", LENIENT).unwrap(), "/");
    }

    #[test]
    fn reserved_escapes_stay_escaped_in_upper_case() {
        assert_eq!(n("/a%3ab", LENIENT).unwrap(), "/a%3Ab");
        assert_eq!(n("/caf%c3%a9", LENIENT).unwrap(), "/caf%C3%A9");
        assert_ne!(n("/a%3Ab", LENIENT).unwrap(), n("/a:b", LENIENT).unwrap());
        assert_eq!(n("/%7E", LENIENT).unwrap(), "/~");
    }

    #[test]
    fn unsafe_paths_are_errors() {
        assert_eq!(n("/a%2Fb", LENIENT), Err(PathError::EncodedSeparator));
        assert_eq!(n("/a%2fb", LENIENT), Err(PathError::EncodedSeparator));
        assert_eq!(n("/a%5Cb", LENIENT), Err(PathError::EncodedSeparator));
        assert_eq!(n("/../a", LENIENT), Err(PathError::AboveRoot));
        assert_eq!(n("/a/../../b", LENIENT), Err(PathError::AboveRoot));
        assert_eq!(n("/a%2", LENIENT), Err(PathError::BadPercent));
        assert_eq!(n("/a%zz", LENIENT), Err(PathError::BadPercent));
        assert_eq!(n("*", LENIENT), Err(PathError::NotAbsolute));
    }

    #[test]
    fn strict_paths_keep_their_slashes() {
        assert_eq!(n("/v1/transfers/", STRICT).unwrap(), "/v1/transfers/");
        assert_eq!(n("/v1//transfers", STRICT).unwrap(), "/v1//transfers");
        assert_eq!(n("/v1/%74ransfers", STRICT).unwrap(), "/v1/transfers");
        assert_eq!(n("/v1/./transfers", STRICT).unwrap(), "/v1/transfers");
        assert_eq!(n("/v1/transfers/.", STRICT).unwrap(), "/v1/transfers/");
        assert_eq!(n("/v1/transfers/x/..", STRICT).unwrap(), "/v1/transfers/");
        assert_ne!(
            n("/v1/transfers/", STRICT).unwrap(),
            n("/v1/transfers", STRICT).unwrap()
        );
    }

    #[test]
    fn case_insensitive_paths_fold_letters_not_escapes() {
        assert_eq!(n("/V1/Transfers/", NOCASE).unwrap(), "/v1/transfers");
        assert_eq!(n("/a%3a", NOCASE).unwrap(), "/a%3A");
        assert_eq!(n("/%41", NOCASE).unwrap(), "/a");
        assert_eq!(n("/V1/Transfers", LENIENT).unwrap(), "/V1/Transfers");
    }

    #[test]
    fn normal_paths_are_borrowed() {
        assert!(matches!(
            normalize("/v1/transfers", LENIENT),
            Ok(Cow::Borrowed(_))
        ));
        assert!(matches!(normalize("/", LENIENT), Ok(Cow::Borrowed(_))));
        assert!(matches!(
            normalize("/v1/transfers/", STRICT),
            Ok(Cow::Borrowed(_))
        ));
        assert!(matches!(
            normalize("/v1/transfers/", LENIENT),
            Ok(Cow::Owned(_))
        ));
    }

    #[test]
    fn normalizing_is_idempotent() {
        for p in [
            "/a//b/./c/../d/",
            "/%7e%41%3a/x",
            "/V1/..//Q",
            "/a/b/.",
            "/a/b/..",
        ] {
            for rules in [LENIENT, STRICT, NOCASE] {
                let once = n(p, rules).unwrap();
                assert_eq!(n(&once, rules).unwrap(), once, "{p} {rules:?}");
            }
        }
    }
}
