//! A strict RFC 8259 / I-JSON (RFC 7493) parser and the RFC 8785 (JCS) serializer.
//!
//! Crates: `thiserror` for [`JcsError`]. The parser is written here rather than taken from
//! `serde_json` because fingerprints need what a general-purpose parser gives up: the exact
//! number lexeme (a `serde_json` build with `arbitrary_precision` enabled by any dependency
//! would otherwise change results silently), refusal of duplicate member names, and refusal of
//! lone surrogate escapes.
//!
//! Strings borrow from the input unless they contain escapes, and object members are sorted
//! once while parsing, which also finds duplicate names (adjacent after sorting) and lets
//! `fingerprint_ignore` pointers find members by binary search.
//!
//! Unicode noncharacters (U+FFFE, U+FFFF, ...) are accepted although RFC 7493 discourages them:
//! RFC 8785 implementations serialize them like any other character, and refusing them would
//! only move such bodies to raw-byte hashing.

use std::borrow::Cow;
use std::cmp::Ordering;

use thiserror::Error;

use super::number::{self, Decimal};
use super::pointer::{array_index, JsonPointer};

pub use super::number::NumberError;

/// Deepest nesting of arrays and objects accepted; deeper documents are refused so that
/// parsing and serializing stay within a small, fixed stack.
pub const MAX_DEPTH: usize = 128;

#[derive(Error, Debug, Clone, PartialEq, Eq)]
pub enum JcsError {
    #[error("invalid UTF-8 at byte {offset}")]
    InvalidUtf8 { offset: usize },
    #[error("JSON syntax error at byte {offset}: {reason}")]
    Syntax { offset: usize, reason: &'static str },
    #[error("duplicate member name {name:?}")]
    DuplicateMember { name: String },
    #[error("lone surrogate escape at byte {offset}")]
    LoneSurrogate { offset: usize },
    #[error("nesting deeper than {MAX_DEPTH} at byte {offset}")]
    TooDeep { offset: usize },
    #[error(transparent)]
    Number(#[from] NumberError),
}

/// Plain RFC 8785 (numbers as ECMAScript doubles). Err if not I-JSON.
pub fn canonicalize(input: &[u8]) -> Result<Vec<u8>, JcsError> {
    let doc = parse(input)?;
    let mut w = Writer::new(input.len(), Mode::Plain);
    w.value(&doc)?;
    Ok(w.out)
}

/// RFC 8785 + the exactness rule (a number is written as the ECMAScript form of its double only
/// when that form denotes exactly the input's decimal value, and as an exact normalized
/// decimal otherwise), with the members and elements named by `ignore` removed. A pointer
/// naming nothing is a no-op; the root pointer `""` removes the whole document, leaving an
/// empty output (which no JSON document produces).
pub fn canonicalize_exact(input: &[u8], ignore: &[JsonPointer]) -> Result<Vec<u8>, JcsError> {
    let mut doc = parse(input)?;
    if !ignore.is_empty() && !remove_pointers(&mut doc, ignore) {
        return Ok(Vec::new());
    }
    let mut w = Writer::new(input.len(), Mode::Exact);
    w.value(&doc)?;
    Ok(w.out)
}

type Members<'a> = Vec<(Cow<'a, str>, Value<'a>)>;

#[derive(Debug)]
enum Value<'a> {
    Null,
    Bool(bool),
    /// The lexeme as written; how it is serialized depends on the mode.
    Number(&'a str),
    String(Cow<'a, str>),
    Array(Vec<Value<'a>>),
    /// Sorted by [`cmp_utf16`], no two names equal.
    Object(Members<'a>),
}

/// Orders strings by their UTF-16 code units, as RFC 8785 section 3.2.3 requires.
///
/// UTF-8 byte order is code point order, which differs from UTF-16 order only between a
/// supplementary character (UTF-16 surrogates D800-DFFF) and one in U+E000..U+FFFF. At the
/// first differing byte both strings are at the same character boundary or inside characters
/// with the same lead byte, so the lead bytes alone settle the rare inverted case.
pub(crate) fn cmp_utf16(a: &str, b: &str) -> Ordering {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    match a.iter().zip(b).position(|(x, y)| x != y) {
        None => a.len().cmp(&b.len()),
        Some(i) => {
            let (x, y) = (a[i], b[i]);
            let bmp_high = |c: u8| c == 0xEE || c == 0xEF;
            if x >= 0xF0 && bmp_high(y) {
                Ordering::Less
            } else if y >= 0xF0 && bmp_high(x) {
                Ordering::Greater
            } else {
                x.cmp(&y)
            }
        }
    }
}

fn parse(input: &[u8]) -> Result<Value<'_>, JcsError> {
    let src = std::str::from_utf8(input).map_err(|e| JcsError::InvalidUtf8 {
        offset: e.valid_up_to(),
    })?;
    let mut p = Parser {
        src,
        bytes: input,
        pos: 0,
        depth: 0,
    };
    p.skip_ws();
    let v = p.value()?;
    p.skip_ws();
    if p.pos != p.bytes.len() {
        return Err(p.syntax("trailing characters after the JSON value"));
    }
    Ok(v)
}

struct Parser<'a> {
    src: &'a str,
    bytes: &'a [u8],
    pos: usize,
    depth: usize,
}

impl<'a> Parser<'a> {
    fn syntax(&self, reason: &'static str) -> JcsError {
        JcsError::Syntax {
            offset: self.pos,
            reason,
        }
    }

    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.pos).copied()
    }

    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.pos += 1;
        }
    }

    fn expect_literal(&mut self, lit: &'static [u8]) -> Result<(), JcsError> {
        if self.bytes[self.pos..].starts_with(lit) {
            self.pos += lit.len();
            Ok(())
        } else {
            Err(self.syntax("invalid literal"))
        }
    }

    fn value(&mut self) -> Result<Value<'a>, JcsError> {
        match self.peek() {
            Some(b'{') => self.object(),
            Some(b'[') => self.array(),
            Some(b'"') => Ok(Value::String(self.string()?)),
            Some(b't') => self.expect_literal(b"true").map(|()| Value::Bool(true)),
            Some(b'f') => self.expect_literal(b"false").map(|()| Value::Bool(false)),
            Some(b'n') => self.expect_literal(b"null").map(|()| Value::Null),
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(_) => Err(self.syntax("expected a JSON value")),
            None => Err(self.syntax("unexpected end of input")),
        }
    }

    fn enter(&mut self) -> Result<(), JcsError> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(JcsError::TooDeep { offset: self.pos });
        }
        Ok(())
    }

    fn array(&mut self) -> Result<Value<'a>, JcsError> {
        self.enter()?;
        self.pos += 1; // '['
        let mut items = Vec::new();
        self.skip_ws();
        if self.peek() == Some(b']') {
            self.pos += 1;
        } else {
            loop {
                items.push(self.value()?);
                self.skip_ws();
                match self.peek() {
                    Some(b',') => {
                        self.pos += 1;
                        self.skip_ws();
                    }
                    Some(b']') => {
                        self.pos += 1;
                        break;
                    }
                    _ => return Err(self.syntax("expected ',' or ']'")),
                }
            }
        }
        self.depth -= 1;
        Ok(Value::Array(items))
    }

    fn object(&mut self) -> Result<Value<'a>, JcsError> {
        self.enter()?;
        self.pos += 1; // '{'
        let mut members: Members<'a> = Vec::new();
        self.skip_ws();
        if self.peek() == Some(b'}') {
            self.pos += 1;
        } else {
            loop {
                if self.peek() != Some(b'"') {
                    return Err(self.syntax("expected a member name"));
                }
                let name = self.string()?;
                self.skip_ws();
                if self.peek() != Some(b':') {
                    return Err(self.syntax("expected ':'"));
                }
                self.pos += 1;
                self.skip_ws();
                let value = self.value()?;
                members.push((name, value));
                self.skip_ws();
                match self.peek() {
                    Some(b',') => {
                        self.pos += 1;
                        self.skip_ws();
                    }
                    Some(b'}') => {
                        self.pos += 1;
                        break;
                    }
                    _ => return Err(self.syntax("expected ',' or '}'")),
                }
            }
        }
        members.sort_unstable_by(|a, b| cmp_utf16(&a.0, &b.0));
        if let Some(pair) = members.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(JcsError::DuplicateMember {
                name: pair[0].0.clone().into_owned(),
            });
        }
        self.depth -= 1;
        Ok(Value::Object(members))
    }

    fn number(&mut self) -> Result<Value<'a>, JcsError> {
        let start = self.pos;
        if self.peek() == Some(b'-') {
            self.pos += 1;
        }
        match self.peek() {
            Some(b'0') => self.pos += 1,
            Some(b'1'..=b'9') => self.digits(),
            _ => return Err(self.syntax("expected a digit")),
        }
        if self.peek() == Some(b'.') {
            self.pos += 1;
            if !matches!(self.peek(), Some(b'0'..=b'9')) {
                return Err(self.syntax("expected a digit after '.'"));
            }
            self.digits();
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.pos += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.pos += 1;
            }
            if !matches!(self.peek(), Some(b'0'..=b'9')) {
                return Err(self.syntax("expected a digit in the exponent"));
            }
            self.digits();
        }
        Ok(Value::Number(&self.src[start..self.pos]))
    }

    fn digits(&mut self) {
        while let Some(b'0'..=b'9') = self.peek() {
            self.pos += 1;
        }
    }

    /// Parses a string starting at its opening quote; borrows when there are no escapes.
    fn string(&mut self) -> Result<Cow<'a, str>, JcsError> {
        self.pos += 1; // '"'
        let start = self.pos;
        loop {
            match self.peek() {
                Some(b'"') => {
                    let s = &self.src[start..self.pos];
                    self.pos += 1;
                    return Ok(Cow::Borrowed(s));
                }
                Some(b'\\') => break,
                Some(0x00..=0x1F) => return Err(self.syntax("control character in string")),
                Some(_) => self.pos += 1,
                None => return Err(self.syntax("unterminated string")),
            }
        }
        let mut owned = String::with_capacity(self.pos - start + 16);
        owned.push_str(&self.src[start..self.pos]);
        let mut run = self.pos;
        loop {
            match self.peek() {
                Some(b'"') => {
                    owned.push_str(&self.src[run..self.pos]);
                    self.pos += 1;
                    return Ok(Cow::Owned(owned));
                }
                Some(b'\\') => {
                    owned.push_str(&self.src[run..self.pos]);
                    self.escape(&mut owned)?;
                    run = self.pos;
                }
                Some(0x00..=0x1F) => return Err(self.syntax("control character in string")),
                Some(_) => self.pos += 1,
                None => return Err(self.syntax("unterminated string")),
            }
        }
    }

    /// Decodes one escape sequence starting at its backslash.
    fn escape(&mut self, out: &mut String) -> Result<(), JcsError> {
        let at = self.pos;
        self.pos += 1; // '\\'
        let c = match self.peek() {
            Some(b'"') => '"',
            Some(b'\\') => '\\',
            Some(b'/') => '/',
            Some(b'b') => '\u{8}',
            Some(b'f') => '\u{c}',
            Some(b'n') => '\n',
            Some(b'r') => '\r',
            Some(b't') => '\t',
            Some(b'u') => {
                self.pos += 1;
                let unit = self.hex4()?;
                let c = match unit {
                    0xD800..=0xDBFF => {
                        if !self.bytes[self.pos..].starts_with(b"\\u") {
                            return Err(JcsError::LoneSurrogate { offset: at });
                        }
                        self.pos += 2;
                        let low = self.hex4()?;
                        if !(0xDC00..=0xDFFF).contains(&low) {
                            return Err(JcsError::LoneSurrogate { offset: at });
                        }
                        let cp = 0x10000
                            + ((u32::from(unit) - 0xD800) << 10)
                            + (u32::from(low) - 0xDC00);
                        char::from_u32(cp)
                    }
                    0xDC00..=0xDFFF => return Err(JcsError::LoneSurrogate { offset: at }),
                    _ => char::from_u32(u32::from(unit)),
                };
                // Every non-surrogate code point below 0x110000 is a char.
                out.push(c.ok_or(JcsError::LoneSurrogate { offset: at })?);
                return Ok(());
            }
            _ => return Err(self.syntax("invalid escape sequence")),
        };
        self.pos += 1;
        out.push(c);
        Ok(())
    }

    fn hex4(&mut self) -> Result<u16, JcsError> {
        let Some(hex) = self.bytes.get(self.pos..self.pos + 4) else {
            return Err(self.syntax("truncated \\u escape"));
        };
        let mut v: u16 = 0;
        for &b in hex {
            let d = match b {
                b'0'..=b'9' => b - b'0',
                b'a'..=b'f' => b - b'a' + 10,
                b'A'..=b'F' => b - b'A' + 10,
                _ => return Err(self.syntax("invalid hex digit in \\u escape")),
            };
            v = (v << 4) | u16::from(d);
        }
        self.pos += 4;
        Ok(v)
    }
}

#[derive(Clone, Copy)]
enum Mode {
    Plain,
    Exact,
}

struct Writer {
    out: Vec<u8>,
    mode: Mode,
    dec: Decimal,
}

impl Writer {
    fn new(input_len: usize, mode: Mode) -> Self {
        Writer {
            out: Vec::with_capacity(input_len),
            mode,
            dec: Decimal::new(),
        }
    }

    fn value(&mut self, v: &Value<'_>) -> Result<(), JcsError> {
        match v {
            Value::Null => self.out.extend_from_slice(b"null"),
            Value::Bool(true) => self.out.extend_from_slice(b"true"),
            Value::Bool(false) => self.out.extend_from_slice(b"false"),
            Value::Number(lexeme) => match self.mode {
                Mode::Plain => number::write_plain(lexeme, &mut self.dec, &mut self.out)?,
                Mode::Exact => number::write_exact(lexeme, &mut self.dec, &mut self.out)?,
            },
            Value::String(s) => write_string(s, &mut self.out),
            Value::Array(items) => {
                self.out.push(b'[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        self.out.push(b',');
                    }
                    self.value(item)?;
                }
                self.out.push(b']');
            }
            Value::Object(members) => {
                self.out.push(b'{');
                for (i, (name, value)) in members.iter().enumerate() {
                    if i > 0 {
                        self.out.push(b',');
                    }
                    write_string(name, &mut self.out);
                    self.out.push(b':');
                    self.value(value)?;
                }
                self.out.push(b'}');
            }
        }
        Ok(())
    }
}

/// RFC 8785 section 3.2.2.2: only `"`, `\` and C0 controls are escaped, with the short forms
/// where JSON has them and lowercase `\u00xx` otherwise; all else is literal UTF-8.
fn write_string(s: &str, out: &mut Vec<u8>) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let bytes = s.as_bytes();
    out.push(b'"');
    let mut run = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let short = match b {
            b'"' => b'"',
            b'\\' => b'\\',
            0x08 => b'b',
            0x09 => b't',
            0x0A => b'n',
            0x0C => b'f',
            0x0D => b'r',
            0x00..=0x1F => 0,
            _ => continue,
        };
        out.extend_from_slice(&bytes[run..i]);
        run = i + 1;
        if short != 0 {
            out.extend_from_slice(&[b'\\', short]);
        } else {
            out.extend_from_slice(&[
                b'\\',
                b'u',
                b'0',
                b'0',
                HEX[usize::from(b >> 4)],
                HEX[usize::from(b & 0xF)],
            ]);
        }
    }
    out.extend_from_slice(&bytes[run..]);
    out.push(b'"');
}

/// Removes what `pointers` name. All pointers are resolved against the document as parsed, so
/// removing one array element does not shift what another pointer names. Returns false when
/// the root pointer removes the whole document.
fn remove_pointers(doc: &mut Value<'_>, pointers: &[JsonPointer]) -> bool {
    let mut paths: Vec<Vec<usize>> = Vec::new();
    for pointer in pointers {
        if pointer.is_root() {
            return false;
        }
        if let Some(path) = resolve(doc, pointer) {
            paths.push(path);
        }
    }
    // Deepest and last first: a removal never moves anything a later removal names.
    paths.sort_unstable_by(|a, b| b.cmp(a));
    paths.dedup();
    for path in &paths {
        if let Some((&last, parent_path)) = path.split_last() {
            match child_mut(doc, parent_path) {
                Some(Value::Array(items)) => {
                    items.remove(last);
                }
                Some(Value::Object(members)) => {
                    members.remove(last);
                }
                _ => {}
            }
        }
    }
    true
}

/// The path of child positions `pointer` names, or None if it names nothing.
fn resolve(doc: &Value<'_>, pointer: &JsonPointer) -> Option<Vec<usize>> {
    let mut node = doc;
    let mut path = Vec::with_capacity(pointer.tokens().len());
    for token in pointer.tokens() {
        let (index, child) = match node {
            Value::Object(members) => {
                let i = members
                    .binary_search_by(|(name, _)| cmp_utf16(name, token))
                    .ok()?;
                (i, &members[i].1)
            }
            Value::Array(items) => {
                let i = array_index(token)?;
                (i, items.get(i)?)
            }
            _ => return None,
        };
        path.push(index);
        node = child;
    }
    Some(path)
}

fn child_mut<'v, 'a>(mut node: &'v mut Value<'a>, path: &[usize]) -> Option<&'v mut Value<'a>> {
    for &i in path {
        node = match node {
            Value::Object(members) => &mut members.get_mut(i)?.1,
            Value::Array(items) => items.get_mut(i)?,
            _ => return None,
        };
    }
    Some(node)
}

#[cfg(test)]
mod tests;
