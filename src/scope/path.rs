//! One spelling per path: the form that route matching, the scope and the fingerprint all
//! use, so that `/v1/transfers`, `/v1//transfers/`, `/v1/%74ransfers` and
//! `/v1/./transfers` are one operation, as they are to most upstream frameworks.
//!
//! Two requests are one operation when the upstream's framework hands its handler the same
//! decoded route parameters, and every framework decodes percent-escapes before it does: so
//! the scope's form decodes the escape of every character that may also come raw
//! (`alice%40example.com` is `alice@example.com`, as JavaScript's `encodeURIComponent` and
//! Python's requests spell one account two ways), not only RFC 3986's unreserved ones; a
//! character that cannot come raw (space, bytes beyond ASCII) keeps its one spelling, its
//! uppercase escape. Dot segments are removed (RFC 3986 5.2.4). Unless the
//! route asks for `path_match = "strict"`, empty segments (repeated slashes) are dropped and
//! a trailing slash is ignored; with `case_insensitive_paths = true` ASCII letters are
//! compared in lower case. An encoded `;` or `%` stays an escape in that form, so decoding
//! can never make a parameter or an escape of its own.
//!
//! What is forwarded is the RFC 3986 form (section 6.2.2: unreserved escapes decoded, the
//! others in uppercase hex, dot segments removed), which the upstream decodes to the same
//! parameters, with the client's letter case kept.
//!
//! Frameworks fold more than RFC 3986, and what they fold is the same handler:
//! - `;` path parameters (`/v1/transfers;jsessionid=A`, `/v1;v=2/transfers`) are cut off
//!   each segment by servlet containers (Jetty, Tomcat) before routing. The normal form
//!   leaves them out; whether a route accepts them is the route's choice (`path_params`).
//! - IIS and ASP.NET drop trailing dots and spaces of each segment (`/v1/transfers.`,
//!   `/v1/transfers%20`): on `case_insensitive_paths` routes the normal form drops them too.
//!   Elsewhere a path that is a route's but for them belongs to that route, refused
//!   ([`PathError::TrailingSpelling`]): it never falls through to a shorter route.
//!
//! Some spellings cannot be normalized safely, because upstreams disagree on what they
//! mean: an encoded `/` or `\` (one segment to some frameworks, two to others), a raw `\`,
//! an encoded control character (Starlette routes `/v1/transfers%0A` to `/v1/transfers`),
//! escapes that are not UTF-8 (replaced by U+FFFD, so `jos%E9` and `jos%E8` become one
//! account, or refused), dot segments that climb above the root or carry parameters
//! (`..;x`, a traversal to Tomcat, a name to others), segments that are only dots and
//! spaces on a case-insensitive route, and broken percent-encoding. Protected requests with
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
    /// A raw `+` is a space (`%20`) and `%2B` the plus, as older Koa routers (koa-router) decode a
    /// parameter (`plus_is_space`); elsewhere a raw `+` and `%2B` are one character.
    pub plus_is_space: bool,
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
    /// A `.` or `..` segment with `;` parameters: a dot segment to servlet containers, a
    /// name to others.
    #[error("the path has a dot segment with ';' parameters, which upstreams read differently")]
    DotSegmentParams,
    /// On a case-insensitive route, a segment made only of dots and spaces beyond `.` and
    /// `..`, which Windows servers fold to something else.
    #[error("the path has a segment of only dots and spaces, which Windows servers fold")]
    OnlyDots,
    /// `;` path parameters, on a route that does not accept them (`path_params`).
    #[error("the path has ';' parameters (servlet containers cut them off before routing); this route refuses them: send the path without them, or set path_params = \"strip\" on the route")]
    PathParams,
    /// An escape that decodes to a control character (`%00` to `%1F`, `%7F`): a trailing
    /// `%0A` is cut off by some frameworks' routing (Starlette's regular expressions) and
    /// kept by others.
    #[error("the path contains an encoded control character, which upstreams read differently")]
    ControlCharacter,
    /// Escapes that do not decode to UTF-8, which frameworks replace (U+FFFD) or refuse.
    #[error(
        "the path's percent-encoding does not decode to UTF-8, which upstreams read differently"
    )]
    InvalidUtf8,
    /// A path that is a protected route's but for a segment's trailing dots or spaces
    /// (`/v1/transfers.`, `/v1/transfers%20`), which IIS, ASP.NET and Express's
    /// case-insensitive routing drop and others keep: it must not fall through to a shorter
    /// route or the defaults as another operation.
    #[error("the path is this route's but for a segment's trailing dots or spaces, which some frameworks drop and others keep: send the path without them")]
    TrailingSpelling,
    /// A path that is a route's only when letter case is ignored (`/V1/Transfers`,
    /// `/v1/transfer%53`), on a route that does not say how its upstream compares letters:
    /// Express and Koa route it to the same handler, most others do not.
    #[error("the path is this route's only when letter case is ignored, which some frameworks (Express, Koa) do and others do not: send the route's spelling, or set case_insensitive_paths (or framework) on the route")]
    LetterCase,
    /// A raw `+`, which some routers read as a space (@koa/router 13 and older) and others
    /// as a plus, on a route that does not say which (`plus_is_space`).
    #[error("the path contains a raw '+', which some routers read as a space and others as a plus: send it as %2B (a plus) or %20 (a space), or set plus_is_space on the route")]
    RawPlus,
    /// A raw byte beyond ASCII, which most frameworks read as UTF-8 and some as Latin-1
    /// (Tornado), on a route that does not say its upstream reads UTF-8 (`raw_utf8_paths`).
    #[error("the path contains raw bytes beyond ASCII, which some frameworks read as UTF-8 and others as Latin-1: percent-encode them, or set raw_utf8_paths = true on a route whose upstream reads them as UTF-8")]
    RawNonAscii,
    /// A format suffix (`/v1/transfers.json`) that the route does not list.
    #[error("the path ends in a format suffix ('.{0}') that frameworks such as Rails route to the same handler; this route does not list it in format_suffixes: send the path without it")]
    FormatSuffix(FormatExt),
}

/// The letters or digits of a format suffix (`json` of `.json`), at most five.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FormatExt {
    len: u8,
    bytes: [u8; 5],
}

impl FormatExt {
    /// The suffix of `seg` after its last `.`, when that is 1 to 5 ASCII letters or digits
    /// and something comes before the dot.
    pub fn of(rest: &str) -> Option<FormatExt> {
        let ext = rest.strip_prefix('.')?;
        if ext.is_empty() || ext.len() > 5 || !ext.bytes().all(|b| b.is_ascii_alphanumeric()) {
            return None;
        }
        let mut bytes = [0u8; 5];
        bytes[..ext.len()].copy_from_slice(ext.as_bytes());
        Some(FormatExt {
            len: ext.len() as u8,
            bytes,
        })
    }

    /// The suffix without its dot.
    pub fn as_str(&self) -> &str {
        std::str::from_utf8(&self.bytes[..usize::from(self.len)]).unwrap_or_default()
    }
}

impl std::fmt::Display for FormatExt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a form keeps of a path's parameters and letters.
#[derive(Debug, Clone, Copy)]
struct Form {
    rules: PathRules,
    /// Lower-case letters (the matching form of a case-insensitive route).
    fold_case: bool,
    /// Keep `;` parameters (the form the upstream gets on a `path_params = "strip"`
    /// route) instead of leaving them out.
    keep_params: bool,
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
fn is_normal(path: &str, form: Form) -> bool {
    let rules = form.rules;
    let b = path.as_bytes();
    if b.first() != Some(&b'/') {
        return false;
    }
    // An escape to normalize, a byte that must become one (a raw non-ASCII byte), a
    // backslash to refuse, or parameters to take off.
    if b.iter()
        .any(|&c| c == b'%' || c == b'\\' || c >= 0x80 || c == b';')
    {
        return false;
    }
    if form.fold_case && b.iter().any(u8::is_ascii_uppercase) {
        return false;
    }
    if rules.plus_is_space && !form.keep_params && b.contains(&b'+') {
        return false;
    }
    // Dot segments, (unless strict) empty segments, and trailing dots where they are
    // folded: look at each segment.
    let mut segments = path[1..].split('/').peekable();
    while let Some(seg) = segments.next() {
        if seg == "." || seg == ".." {
            return false;
        }
        if rules.case_insensitive && seg.ends_with('.') {
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

/// Normalizes an absolute request path (without its query) under `rules`: the form that
/// route matching, the scope and the fingerprint use. `;` parameters are left out (whether
/// the route accepts a path that had them is the caller's: the raw path contains `;`).
pub fn normalize(path: &str, rules: PathRules) -> Result<Cow<'_, str>, PathError> {
    normalize_as(
        path,
        Form {
            rules,
            fold_case: rules.case_insensitive,
            keep_params: false,
        },
    )
}

/// The form a protected path is sent upstream in: the normal form with the client's letter
/// case and its `;` parameters kept (trailing dots and spaces still folded on a
/// case-insensitive route), so the upstream runs what was scoped.
pub fn forward_form(path: &str, rules: PathRules) -> Result<Cow<'_, str>, PathError> {
    normalize_as(
        path,
        Form {
            rules,
            fold_case: false,
            keep_params: true,
        },
    )
}

fn normalize_as(path: &str, form: Form) -> Result<Cow<'_, str>, PathError> {
    if is_normal(path, form) {
        return Ok(Cow::Borrowed(path));
    }
    let (scoped, forwarded) = both_forms(path, form)?;
    Ok(Cow::Owned(if form.keep_params {
        forwarded
    } else {
        scoped
    }))
}

const HEX: &[u8; 16] = b"0123456789ABCDEF";

fn push_escape(s: &mut Vec<u8>, v: u8) {
    s.extend_from_slice(&[b'%', HEX[usize::from(v >> 4)], HEX[usize::from(v & 0xf)]]);
}

/// Whether the scope's form keeps byte `v` as an escape: bytes beyond ASCII (kept as the
/// escapes of their UTF-8, as before, so that records of such paths keep their ids), `%` and
/// `;` (which decoding would turn into an escape or a parameter of the scope's own), and
/// the characters a request target cannot carry raw (space, `#`, `<`, `>`, `?` and the
/// backquote), whose escape is their only spelling. Every other character is decoded: its
/// raw and escaped spellings are one parameter to every framework.
fn keeps_escape(v: u8) -> bool {
    v >= 0x80 || matches!(v, b' ' | b'#' | b'%' | b';' | b'<' | b'>' | b'?' | b'`')
}

/// The path's two forms, built side by side: the scope's (every escape of a character that
/// may also come raw decoded, as the upstream's framework decodes it before it hands a
/// parameter to its handler) and the one forwarded (RFC 3986 6.2.2: unreserved escapes decoded, the others in uppercase hex, so
/// the upstream decodes it to the same parameters the scope has). Their `/` and raw `;` sit
/// at the same places, so their segments pair up.
fn both_forms(path: &str, form: Form) -> Result<(String, String), PathError> {
    let rules = form.rules;
    if !path.starts_with('/') {
        return Err(PathError::NotAbsolute);
    }
    // 6.2.2.1 and 6.2.2.2: percent-encodings. An encoded `;` stays encoded in both forms
    // (so a raw `;` is one the client sent raw: a parameter), and so does an encoded `%`
    // (so the scope's escapes cannot be forged by decoding).
    let b = path.as_bytes();
    let mut scoped: Vec<u8> = Vec::with_capacity(path.len());
    let mut forwarded: Vec<u8> = Vec::with_capacity(path.len());
    // Every escape decoded, to check that they spell UTF-8.
    let mut text: Vec<u8> = Vec::with_capacity(path.len());
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
            match v {
                b'/' | b'\\' => return Err(PathError::EncodedSeparator),
                0x00..=0x1f | 0x7f => return Err(PathError::ControlCharacter),
                v if keeps_escape(v) || (v == b'+' && rules.plus_is_space) => {
                    push_escape(&mut scoped, v)
                }
                _ => scoped.push(v),
            }
            if is_unreserved(v) {
                forwarded.push(v);
            } else {
                push_escape(&mut forwarded, v);
            }
            text.push(v);
            i += 3;
        } else if c == b'+' && rules.plus_is_space {
            // A space to the handler: the scope's spelling of a space.
            push_escape(&mut scoped, b' ');
            forwarded.push(c);
            text.push(b' ');
            i += 1;
        } else if c == b'\\' {
            return Err(PathError::Backslash);
        } else if c >= 0x80 {
            // A raw byte (UTF-8 sent unencoded, as curl and decoding gateways do) is the
            // same byte as its escape: `jos\xc3\xa9` and `jos%C3%A9` are one payee. Kept
            // a byte, never read as a Latin-1 character and re-encoded as two.
            push_escape(&mut scoped, c);
            push_escape(&mut forwarded, c);
            text.push(c);
            i += 1;
        } else {
            scoped.push(c);
            forwarded.push(c);
            text.push(c);
            i += 1;
        }
    }
    // Escapes that decode to invalid UTF-8: frameworks replace them (Starlette's U+FFFD
    // makes `jos%E9` and `jos%E8` one account) or refuse them; neither can be folded.
    if std::str::from_utf8(&text).is_err() {
        return Err(PathError::InvalidUtf8);
    }
    // Only ASCII was written, escapes included.
    let scoped = String::from_utf8(scoped).map_err(|_| PathError::InvalidUtf8)?;
    let forwarded = String::from_utf8(forwarded).map_err(|_| PathError::InvalidUtf8)?;
    // 6.2.2.3: dot segments (5.2.4), and the slash rules; parameters and trailing dots
    // come off each segment first, as the frameworks that fold them do before they route.
    let mut out: Vec<(&str, &str, &str)> = Vec::new();
    let mut ends_in_dir = false;
    for (seg, fwd) in scoped[1..].split('/').zip(forwarded[1..].split('/')) {
        let (name, _) = split_params(seg);
        let (fwd_name, params) = split_params(fwd);
        if !params.is_empty() && (name == "." || name == "..") {
            return Err(PathError::DotSegmentParams);
        }
        let (name, fwd_name) = if rules.case_insensitive && name != "." && name != ".." {
            let kept = trim_dots_and_spaces(name);
            if kept.is_empty() && !name.is_empty() {
                return Err(PathError::OnlyDots);
            }
            (kept, trim_dots_and_spaces(fwd_name))
        } else {
            (name, fwd_name)
        };
        let params = if form.keep_params { params } else { "" };
        match name {
            "." => ends_in_dir = true,
            ".." => {
                if out.pop().is_none() {
                    return Err(PathError::AboveRoot);
                }
                ends_in_dir = true;
            }
            "" if !rules.strict && params.is_empty() => {}
            s => {
                out.push((s, fwd_name, params));
                ends_in_dir = false;
            }
        }
    }
    let mut normal = String::with_capacity(scoped.len());
    let mut sent = String::with_capacity(forwarded.len());
    for (seg, fwd, params) in &out {
        normal.push('/');
        normal.push_str(seg);
        sent.push('/');
        sent.push_str(fwd);
        sent.push_str(params);
    }
    // Strict paths keep the directory form that 5.2.4 leaves (`/a/.` is `/a/`); an empty
    // last segment of a strict path was pushed above and already gives its slash.
    for s in [&mut normal, &mut sent] {
        if s.is_empty() || (rules.strict && ends_in_dir) {
            s.push('/');
        }
    }
    if form.fold_case {
        lowercase_outside_escapes(&mut normal);
    }
    Ok((normal, sent))
}

/// A segment and its `;` parameters (from the first raw `;` on).
fn split_params(seg: &str) -> (&str, &str) {
    match seg.find(';') {
        Some(at) => seg.split_at(at),
        None => (seg, ""),
    }
}

/// A normal form with each segment's trailing dots and encoded spaces dropped, as IIS and
/// ASP.NET read it; `None` when there are none (or a segment is nothing else).
pub fn without_trailing_dots(normal: &str) -> Option<String> {
    if !normal.contains('.') && !normal.contains("%20") {
        return None;
    }
    let mut out = String::with_capacity(normal.len());
    let mut changed = false;
    for seg in normal.split('/').skip(1) {
        let kept = trim_dots_and_spaces(seg);
        if kept.is_empty() && !seg.is_empty() {
            return None;
        }
        changed |= kept.len() != seg.len();
        out.push('/');
        out.push_str(kept);
    }
    changed.then_some(out)
}

/// A segment without its trailing dots and (encoded) spaces, as Windows servers read it.
pub(super) fn trim_dots_and_spaces(mut seg: &str) -> &str {
    loop {
        if let Some(s) = seg.strip_suffix('.') {
            seg = s;
        } else if let Some(s) = seg.strip_suffix("%20") {
            seg = s;
        } else {
            return seg;
        }
    }
}

/// ASCII letters to lower case, except the hex digits of percent-encodings, which RFC 3986
/// wants in upper case. Other letters keep their case: frameworks that route without case
/// compare ASCII.
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
        plus_is_space: false,
    };
    const STRICT: PathRules = PathRules {
        strict: true,
        case_insensitive: false,
        plus_is_space: false,
    };
    const NOCASE: PathRules = PathRules {
        strict: false,
        case_insensitive: true,
        plus_is_space: false,
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
            assert_eq!(
                forward_form(p, LENIENT).unwrap(),
                "/v1/payees/jos%C3%A9",
                "{p:?}"
            );
        }
        // Never a byte read as a Latin-1 character and encoded again.
        assert!(!forward_form("/v1/payees/jos\u{e9}", LENIENT)
            .unwrap()
            .contains("%C3%83"));
        assert_eq!(n("/\u{20ac}", NOCASE).unwrap(), "/%E2%82%AC");
        // Other letters than ASCII keep their case on a case-insensitive route.
        assert_eq!(n("/%c3%89", NOCASE).unwrap(), "/%C3%89");
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
    fn every_escape_is_decoded_for_the_scope_and_reserved_ones_stay_escaped_upstream() {
        assert_eq!(n("/a%3ab", LENIENT).unwrap(), "/a:b");
        assert_eq!(forward_form("/a%3ab", LENIENT).unwrap(), "/a%3Ab");
        assert_eq!(n("/caf%c3%a9", LENIENT).unwrap(), "/caf%C3%A9");
        assert_eq!(forward_form("/caf%c3%a9", LENIENT).unwrap(), "/caf%C3%A9");
        assert_eq!(n("/a%3Ab", LENIENT).unwrap(), n("/a:b", LENIENT).unwrap());
        assert_eq!(n("/%7E", LENIENT).unwrap(), "/~");
        // What frameworks decode before the handler sees a parameter: one account, however
        // the client's library escaped it.
        for c in "@:+,=$&!*'()[]|\"^{}".chars() {
            let raw = format!("/v1/accounts/alice{c}example.com/transfers");
            let escaped = format!(
                "/v1/accounts/alice%{:02X}example.com/transfers",
                u32::from(c)
            );
            let lower = format!(
                "/v1/accounts/alice%{:02x}example.com/transfers",
                u32::from(c)
            );
            assert_eq!(n(&escaped, LENIENT).unwrap(), raw, "{c:?}");
            assert_eq!(n(&lower, LENIENT).unwrap(), n(&escaped, LENIENT).unwrap());
        }
        // What cannot come raw keeps its escape, its one spelling.
        for (escaped, normal) in [
            ("/a%20b", "/a%20b"),
            ("/a%3cb%3E", "/a%3Cb%3E"),
            ("/%3f%23%60", "/%3F%23%60"),
        ] {
            assert_eq!(n(escaped, LENIENT).unwrap(), normal);
        }
        // An encoded `;` and `%` stay escapes: never a parameter, never another escape.
        assert_eq!(n("/a%3Bb", LENIENT).unwrap(), "/a%3Bb");
        assert_eq!(n("/a%2541", LENIENT).unwrap(), "/a%2541");
        assert_ne!(n("/a%2541", LENIENT).unwrap(), n("/aA", LENIENT).unwrap());
        assert_ne!(
            n("/a%253Bb", LENIENT).unwrap(),
            n("/a%3Bb", LENIENT).unwrap()
        );
    }

    #[test]
    fn control_characters_and_invalid_utf8_are_refused() {
        for p in [
            "/v1/transfers%0A",
            "/v1/transfers%0a",
            "/v1/%00x",
            "/v1/a%7F",
            "/%1f",
        ] {
            assert_eq!(n(p, LENIENT), Err(PathError::ControlCharacter), "{p}");
            assert_eq!(forward_form(p, LENIENT), Err(PathError::ControlCharacter));
        }
        for p in [
            "/v1/payees/jos%E9",
            "/v1/payees/jos%E8",
            "/%C3",
            "/%C3%28",
            "/%ED%A0%80",
        ] {
            assert_eq!(n(p, LENIENT), Err(PathError::InvalidUtf8), "{p}");
        }
        // The replacement character itself, sent as such, is a name like any other.
        assert_eq!(n("/jos%EF%BF%BD", LENIENT).unwrap(), "/jos%EF%BF%BD");
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
        assert_eq!(n("/a%3a", NOCASE).unwrap(), "/a:");
        assert_eq!(n("/A%3b", NOCASE).unwrap(), "/a%3B");
        assert_eq!(n("/%41", NOCASE).unwrap(), "/a");
        assert_eq!(n("/V1/Transfers", LENIENT).unwrap(), "/V1/Transfers");
    }

    #[test]
    fn path_parameters_are_left_out_and_kept_for_forwarding() {
        for p in [
            "/v1/transfers;jsessionid=ABC123",
            "/v1;v=2/transfers",
            "/v1;/transfers;",
            "/v1/transfers;a=1;b=2/",
        ] {
            assert_eq!(n(p, LENIENT).unwrap(), "/v1/transfers", "{p}");
        }
        assert_eq!(
            forward_form("/v1//transfers;jsessionid=A", LENIENT).unwrap(),
            "/v1/transfers;jsessionid=A"
        );
        assert_eq!(
            forward_form("/V1;v=2/Transfers", NOCASE).unwrap(),
            "/V1;v=2/Transfers"
        );
        // An encoded `;` is a character of the segment, not a parameter.
        assert_eq!(n("/v1/a%3bb", LENIENT).unwrap(), "/v1/a%3Bb");
        // Dot segments with parameters: a traversal to servlet containers.
        for p in ["/v1/..;x/transfers", "/v1/.;x/transfers", "/a/..;/b"] {
            assert_eq!(n(p, LENIENT), Err(PathError::DotSegmentParams), "{p}");
            assert_eq!(forward_form(p, LENIENT), Err(PathError::DotSegmentParams));
        }
    }

    #[test]
    fn case_insensitive_routes_drop_trailing_dots_and_spaces() {
        for p in [
            "/v1/transfers.",
            "/V1/Transfers..",
            "/v1/transfers%20",
            "/v1/transfers.%20.",
            "/v1./transfers",
            "/v1%20/transfers/",
            "/v1/transfers%2e",
        ] {
            assert_eq!(n(p, NOCASE).unwrap(), "/v1/transfers", "{p}");
        }
        assert_eq!(
            forward_form("/V1/Transfers.", NOCASE).unwrap(),
            "/V1/Transfers"
        );
        // Elsewhere they are other paths.
        assert_eq!(n("/v1/transfers.", LENIENT).unwrap(), "/v1/transfers.");
        assert_eq!(n("/v1/transfers%20", LENIENT).unwrap(), "/v1/transfers%20");
        assert_eq!(
            forward_form("/v1/transfers%20", LENIENT).unwrap(),
            "/v1/transfers%20"
        );
        // Only dots and spaces: folded to something else by Windows, refused.
        for p in ["/v1/.../x", "/v1/%20", "/v1/.%20"] {
            assert_eq!(n(p, NOCASE), Err(PathError::OnlyDots), "{p}");
        }
        assert_eq!(n("/v1/x/..", NOCASE).unwrap(), "/v1");
    }

    #[test]
    fn format_suffixes_are_one_to_five_letters_or_digits() {
        assert_eq!(
            FormatExt::of(".json").map(|e| e.to_string()),
            Some("json".into())
        );
        assert_eq!(
            FormatExt::of(".v2").map(|e| e.to_string()),
            Some("v2".into())
        );
        for rest in ["", ".", ".toolong", ".js-n", "json", "/x.json", ".a.b"] {
            assert_eq!(FormatExt::of(rest), None, "{rest}");
        }
    }

    #[test]
    fn a_plus_is_a_space_where_the_router_reads_it_so() {
        let koa = PathRules {
            plus_is_space: true,
            ..LENIENT
        };
        assert_eq!(n("/a/alice+b", koa).unwrap(), "/a/alice%20b");
        assert_eq!(n("/a/alice%20b", koa).unwrap(), "/a/alice%20b");
        assert_eq!(n("/a/alice%2Bb", koa).unwrap(), "/a/alice%2Bb");
        assert_eq!(forward_form("/a/alice+b", koa).unwrap(), "/a/alice+b");
        // Elsewhere a raw `+` is its escape.
        assert_eq!(n("/a/alice%2Bb", LENIENT).unwrap(), "/a/alice+b");
        assert_eq!(n("/a/alice+b", LENIENT).unwrap(), "/a/alice+b");
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
