//! RFC 6901 JSON pointers, as used by a route's `fingerprint_ignore` list.
//!
//! Crates: `thiserror` for the parse error, so configuration loading can report it.

use std::fmt;

use thiserror::Error;

/// A parsed RFC 6901 JSON pointer. Tokens are kept unescaped so they compare directly with
/// unescaped member names.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct JsonPointer {
    tokens: Vec<String>,
}

#[derive(Error, Debug, Clone, PartialEq, Eq)]
pub enum PointerError {
    #[error("JSON pointer must be empty or start with '/'")]
    MissingLeadingSlash,
    #[error("invalid escape in JSON pointer at byte {offset}: '~' must be followed by '0' or '1'")]
    InvalidEscape { offset: usize },
}

impl JsonPointer {
    /// Parses `""` (the whole document) or `/token/token...`, where `~0` is `~` and `~1` is `/`.
    pub fn parse(s: &str) -> Result<JsonPointer, PointerError> {
        if s.is_empty() {
            return Ok(JsonPointer { tokens: Vec::new() });
        }
        let Some(rest) = s.strip_prefix('/') else {
            return Err(PointerError::MissingLeadingSlash);
        };
        let mut tokens = Vec::new();
        let mut offset = 1;
        for raw in rest.split('/') {
            tokens.push(unescape_token(raw, offset)?);
            offset += raw.len() + 1;
        }
        Ok(JsonPointer { tokens })
    }

    /// The unescaped reference tokens, outermost first; empty for the whole document.
    pub fn tokens(&self) -> &[String] {
        &self.tokens
    }

    /// True for `""`, which names the whole document.
    pub fn is_root(&self) -> bool {
        self.tokens.is_empty()
    }
}

fn unescape_token(raw: &str, base_offset: usize) -> Result<String, PointerError> {
    if !raw.contains('~') {
        return Ok(raw.to_owned());
    }
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.char_indices();
    while let Some((i, c)) = chars.next() {
        if c != '~' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some((_, '0')) => out.push('~'),
            Some((_, '1')) => out.push('/'),
            _ => {
                return Err(PointerError::InvalidEscape {
                    offset: base_offset + i,
                })
            }
        }
    }
    Ok(out)
}

impl fmt::Display for JsonPointer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for token in &self.tokens {
            f.write_str("/")?;
            for c in token.chars() {
                match c {
                    '~' => f.write_str("~0")?,
                    '/' => f.write_str("~1")?,
                    c => fmt::Write::write_char(f, c)?,
                }
            }
        }
        Ok(())
    }
}

/// An RFC 6901 array index token: `0` or digits without a leading zero. `-` (the element
/// after the last) and anything else name no existing element.
pub(crate) fn array_index(token: &str) -> Option<usize> {
    let bytes = token.as_bytes();
    if bytes.is_empty() || !bytes.iter().all(u8::is_ascii_digit) {
        return None;
    }
    if bytes.len() > 1 && bytes[0] == b'0' {
        return None;
    }
    token.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> JsonPointer {
        JsonPointer::parse(s).expect("valid pointer")
    }

    #[test]
    fn parses_rfc6901_examples() {
        assert!(p("").is_root());
        assert_eq!(p("/foo").tokens(), ["foo"]);
        assert_eq!(p("/foo/0").tokens(), ["foo", "0"]);
        assert_eq!(p("/").tokens(), [""]);
        assert_eq!(p("/a~1b").tokens(), ["a/b"]);
        assert_eq!(p("/m~0n").tokens(), ["m~n"]);
        assert_eq!(p("/~01").tokens(), ["~1"]);
        assert_eq!(p("/c%d").tokens(), ["c%d"]);
        assert_eq!(p("//").tokens(), ["", ""]);
    }

    #[test]
    fn rejects_bad_pointers() {
        assert_eq!(
            JsonPointer::parse("foo"),
            Err(PointerError::MissingLeadingSlash)
        );
        assert_eq!(
            JsonPointer::parse("/a~2"),
            Err(PointerError::InvalidEscape { offset: 2 })
        );
        assert_eq!(
            JsonPointer::parse("/ok/b~"),
            Err(PointerError::InvalidEscape { offset: 5 })
        );
        assert!(JsonPointer::parse("/~x").is_err());
    }

    #[test]
    fn display_round_trips() {
        for s in ["", "/", "/a~1b/m~0n", "/~01", "/x/0/é", "//"] {
            assert_eq!(p(s).to_string(), s);
            assert_eq!(p(&p(s).to_string()), p(s));
        }
    }

    #[test]
    fn array_indices() {
        assert_eq!(array_index("0"), Some(0));
        assert_eq!(array_index("12"), Some(12));
        assert_eq!(array_index("01"), None);
        assert_eq!(array_index("-"), None);
        assert_eq!(array_index(""), None);
        assert_eq!(array_index("1a"), None);
        assert_eq!(array_index("+1"), None);
    }
}
