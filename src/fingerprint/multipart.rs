//! Canonical form of `multipart/form-data` bodies (RFC 7578 over RFC 2046's framing): the
//! parts in order, each by its name, filename, content type and content, without the boundary
//! that a client draws anew for every attempt. Other part headers (`Content-Length`,
//! `Content-Transfer-Encoding`, anything a client library adds) and the preamble and epilogue
//! are left out. A body that does not parse exactly is `None`: fingerprinted over its raw
//! bytes.

/// The `boundary` parameter of a `multipart/form-data` content type, unquoted.
pub(crate) fn boundary(content_type: &str) -> Option<Vec<u8>> {
    let (_, params) = content_type.split_once(';')?;
    let params = parameters(params.as_bytes())?;
    let b = params
        .into_iter()
        .find(|(name, _)| name.eq_ignore_ascii_case(b"boundary"))?
        .1;
    // RFC 2046 section 5.1.1: 1 to 70 characters.
    (1..=70).contains(&b.len()).then_some(b)
}

/// The canonical encoding of the parts, or `None` for a body that is not well-formed.
///
/// ```text
/// u64 BE part count, then for each part:
///   presence field(disposition type) | presence field(name) | presence field(filename)
///   | presence field(filename*) | presence field(content type) | field(content)
/// ```
pub(crate) fn canonicalize(body: &[u8], boundary: &[u8]) -> Option<Vec<u8>> {
    let parts = parts(body, boundary)?;
    let mut out = Vec::with_capacity(body.len());
    out.extend_from_slice(&(parts.len() as u64).to_be_bytes());
    for p in &parts {
        optional(&mut out, p.disposition.as_deref());
        optional(&mut out, p.name.as_deref());
        optional(&mut out, p.filename.as_deref());
        optional(&mut out, p.filename_ext.as_deref());
        optional(&mut out, p.content_type.as_deref());
        field(&mut out, p.content);
    }
    Some(out)
}

/// The contents of the fields named `name` (parts without a filename), in order; `None`
/// for a body that is not well-formed.
pub(crate) fn values(body: &[u8], boundary: &[u8], name: &str) -> Option<Vec<Vec<u8>>> {
    Some(
        parts(body, boundary)?
            .into_iter()
            .filter(|p| p.name.as_deref() == Some(name.as_bytes()) && p.filename.is_none())
            .map(|p| p.content.to_vec())
            .collect(),
    )
}

fn parts<'a>(body: &'a [u8], boundary: &[u8]) -> Option<Vec<Part<'a>>> {
    let mut dash = b"--".to_vec();
    dash.extend_from_slice(boundary);
    let mut delimiter = b"\r\n".to_vec();
    delimiter.extend_from_slice(&dash);

    // The first boundary may open the body or follow a preamble.
    let mut pos = if body.starts_with(&dash) {
        dash.len()
    } else {
        find(body, &delimiter)? + delimiter.len()
    };
    let mut parts = Vec::new();
    loop {
        let rest = &body[pos..];
        if rest.starts_with(b"--") {
            // The close delimiter; what follows is the epilogue.
            break;
        }
        // Transport padding, then the line break that ends the boundary line.
        let padding = rest
            .iter()
            .take_while(|&&b| b == b' ' || b == b'\t')
            .count();
        if !rest[padding..].starts_with(b"\r\n") {
            return None;
        }
        let start = pos + padding + 2;
        let end = start + find(&body[start..], &delimiter)?;
        parts.push(part(&body[start..end])?);
        pos = end + delimiter.len();
    }
    Some(parts)
}

struct Part<'a> {
    disposition: Option<Vec<u8>>,
    name: Option<Vec<u8>>,
    filename: Option<Vec<u8>>,
    filename_ext: Option<Vec<u8>>,
    content_type: Option<Vec<u8>>,
    content: &'a [u8],
}

fn part(raw: &[u8]) -> Option<Part<'_>> {
    let (head, content) = if let Some(content) = raw.strip_prefix(b"\r\n") {
        (&raw[..0], content)
    } else {
        let at = find(raw, b"\r\n\r\n")?;
        (&raw[..at], &raw[at + 4..])
    };
    let mut p = Part {
        disposition: None,
        name: None,
        filename: None,
        filename_ext: None,
        content_type: None,
        content,
    };
    let mut seen_disposition = false;
    for line in split(head, b"\r\n") {
        let colon = line.iter().position(|&b| b == b':')?;
        let name = &line[..colon];
        // Obsolete line folding, or a line that is not a header: not exact, so raw.
        if name.is_empty() || !name.iter().all(|&b| is_tchar(b)) {
            return None;
        }
        let value = trim(&line[colon + 1..]);
        if name.eq_ignore_ascii_case(b"content-disposition") {
            if seen_disposition {
                return None;
            }
            seen_disposition = true;
            let (ty, params) = match value.iter().position(|&b| b == b';') {
                Some(i) => (trim(&value[..i]), parameters(&value[i + 1..])?),
                None => (value, Vec::new()),
            };
            p.disposition = Some(ty.to_ascii_lowercase());
            for (k, v) in params {
                let slot = match k.to_ascii_lowercase().as_slice() {
                    b"name" => &mut p.name,
                    b"filename" => &mut p.filename,
                    b"filename*" => &mut p.filename_ext,
                    _ => continue,
                };
                if slot.replace(v).is_some() {
                    return None;
                }
            }
        } else if name.eq_ignore_ascii_case(b"content-type") {
            if p.content_type.is_some() {
                return None;
            }
            // The media type's case does not count; its parameters are kept as sent.
            let (essence, params) = match value.iter().position(|&b| b == b';') {
                Some(i) => (&value[..i], &value[i..]),
                None => (value, &value[value.len()..]),
            };
            let mut ct = trim(essence).to_ascii_lowercase();
            ct.extend_from_slice(params);
            p.content_type = Some(ct);
        }
    }
    Some(p)
}

/// `; name=value` parameters (value a token or a quoted string), after the first `;`.
fn parameters(mut s: &[u8]) -> Option<Vec<(Vec<u8>, Vec<u8>)>> {
    let mut out = Vec::new();
    loop {
        s = trim_start(s);
        if s.is_empty() {
            return Some(out);
        }
        let eq = s.iter().position(|&b| b == b'=')?;
        let name = trim(&s[..eq]);
        if name.is_empty() || !name.iter().all(|&b| is_tchar(b)) {
            return None;
        }
        s = trim_start(&s[eq + 1..]);
        let value;
        if let Some(quoted) = s.strip_prefix(b"\"") {
            let mut v = Vec::new();
            let mut i = 0;
            loop {
                match *quoted.get(i)? {
                    b'"' => break,
                    b'\\' => {
                        v.push(*quoted.get(i + 1)?);
                        i += 2;
                    }
                    b => {
                        v.push(b);
                        i += 1;
                    }
                }
            }
            value = v;
            s = trim_start(&quoted[i + 1..]);
        } else {
            let end = s.iter().position(|&b| b == b';').unwrap_or(s.len());
            value = trim(&s[..end]).to_vec();
            s = &s[end..];
        }
        out.push((name.to_vec(), value));
        match s.split_first() {
            None => return Some(out),
            Some((b';', rest)) => s = rest,
            Some(_) => return None,
        }
    }
}

fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

fn trim_start(s: &[u8]) -> &[u8] {
    let n = s.iter().take_while(|&&b| b == b' ' || b == b'\t').count();
    &s[n..]
}

fn trim(s: &[u8]) -> &[u8] {
    let s = trim_start(s);
    let n = s
        .iter()
        .rev()
        .take_while(|&&b| b == b' ' || b == b'\t')
        .count();
    &s[..s.len() - n]
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || haystack.len() < needle.len() {
        return None;
    }
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn split<'a>(mut s: &'a [u8], sep: &'a [u8]) -> impl Iterator<Item = &'a [u8]> + 'a {
    let mut done = s.is_empty();
    std::iter::from_fn(move || {
        if done {
            return None;
        }
        match find(s, sep) {
            Some(i) => {
                let line = &s[..i];
                s = &s[i + sep.len()..];
                Some(line)
            }
            None => {
                done = true;
                Some(s)
            }
        }
    })
}

fn field(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u64).to_be_bytes());
    out.extend_from_slice(bytes);
}

fn optional(out: &mut Vec<u8>, bytes: Option<&[u8]>) {
    out.push(u8::from(bytes.is_some()));
    field(out, bytes.unwrap_or_default());
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A body of `(headers, content)` parts under `boundary`.
    pub(crate) fn body(boundary: &str, parts: &[(&str, &str)]) -> Vec<u8> {
        let mut b = Vec::new();
        for (headers, content) in parts {
            b.extend_from_slice(
                format!("--{boundary}\r\n{headers}\r\n\r\n{content}\r\n").as_bytes(),
            );
        }
        b.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
        b
    }

    fn canon(boundary: &str, parts: &[(&str, &str)]) -> Option<Vec<u8>> {
        canonicalize(&body(boundary, parts), boundary.as_bytes())
    }

    const A: &str = "Content-Disposition: form-data; name=\"amount\"";
    const F: &str =
        "Content-Disposition: form-data; name=\"file\"; filename=\"a.txt\"\r\nContent-Type: text/plain";

    #[test]
    fn boundaries() {
        assert_eq!(
            boundary("multipart/form-data; boundary=abc").as_deref(),
            Some(&b"abc"[..])
        );
        assert_eq!(
            boundary("multipart/form-data; charset=x; BOUNDARY=\"a b;c\"").as_deref(),
            Some(&b"a b;c"[..])
        );
        assert_eq!(boundary("multipart/form-data"), None);
        assert_eq!(boundary("multipart/form-data; boundary="), None);
        assert_eq!(
            boundary(&format!("multipart/form-data; boundary={}", "x".repeat(71))),
            None
        );
    }

    #[test]
    fn the_boundary_does_not_count() {
        let parts = [(A, "100"), (F, "hello\r\nworld")];
        let one = canon("----b1", &parts).expect("parses");
        assert_eq!(Some(one.clone()), canon("XyZ-2", &parts));
        // Preamble, epilogue and transport padding are not content.
        let mut framed = b"preamble\r\n".to_vec();
        framed.extend_from_slice(&body("q", &parts));
        framed.extend_from_slice(b"epilogue");
        assert_eq!(canonicalize(&framed, b"q"), Some(one.clone()));
        let padded = String::from_utf8(body("q", &parts))
            .unwrap()
            .replace("--q\r\n", "--q \t\r\n");
        assert_eq!(canonicalize(padded.as_bytes(), b"q"), Some(one));
    }

    #[test]
    fn what_counts() {
        let base = canon("b", &[(A, "100"), (F, "hi")]);
        assert!(base.is_some());
        // Content, order, names, filenames, content types.
        assert_ne!(base, canon("b", &[(A, "101"), (F, "hi")]));
        assert_ne!(base, canon("b", &[(F, "hi"), (A, "100")]));
        let renamed = F.replace("name=\"file\"", "name=\"doc\"");
        assert_ne!(base, canon("b", &[(A, "100"), (&renamed, "hi")]));
        let refiled = F.replace("a.txt", "b.txt");
        assert_ne!(base, canon("b", &[(A, "100"), (&refiled, "hi")]));
        let retyped = F.replace("text/plain", "text/csv");
        assert_ne!(base, canon("b", &[(A, "100"), (&retyped, "hi")]));
        let no_type = F.replace("\r\nContent-Type: text/plain", "");
        assert_ne!(base, canon("b", &[(A, "100"), (&no_type, "hi")]));
        // Not: header case, order of headers, other headers, quoting, the type's case.
        let respelled = "content-type: Text/Plain\r\nX-Trace: 1\r\nCONTENT-DISPOSITION: form-data; filename=a.txt; name=file";
        assert_eq!(base, canon("b", &[(A, "100"), (respelled, "hi")]));
        let with_length = format!("{A}\r\nContent-Length: 3");
        assert_eq!(base, canon("b", &[(&with_length, "100"), (F, "hi")]));
    }

    #[test]
    fn malformed_is_none() {
        let good = body("b", &[(A, "1")]);
        assert!(canonicalize(&good, b"b").is_some());
        // No close delimiter.
        assert_eq!(
            canonicalize(b"--b\r\nContent-Disposition: form-data\r\n\r\n1", b"b"),
            None
        );
        // Another boundary.
        assert_eq!(canonicalize(&good, b"c"), None);
        // Headers without the blank line, a folded header, a repeated disposition.
        assert_eq!(canonicalize(b"--b\r\nX: 1\r\n--b--", b"b"), None);
        let folded = body(
            "b",
            &[("Content-Disposition: form-data;\r\n name=\"a\"", "1")],
        );
        assert_eq!(canonicalize(&folded, b"b"), None);
        let twice = body("b", &[(&format!("{A}\r\n{A}"), "1")]);
        assert_eq!(canonicalize(&twice, b"b"), None);
        // Something other than a line break after a boundary.
        assert_eq!(canonicalize(b"--bX\r\n\r\n1\r\n--b--", b"b"), None);
        assert_eq!(canonicalize(b"", b"b"), None);
        // No parts at all is well-formed.
        assert!(canonicalize(b"--b--", b"b").is_some());
    }
}
