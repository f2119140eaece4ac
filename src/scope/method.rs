//! The method the upstream will run: the request's own, or the one a method-override header
//! names.
//!
//! Frameworks (Rails, Laravel, Symfony, ASP.NET, Express's `method-override`) read
//! `X-HTTP-Method-Override`, `X-HTTP-Method`, `X-Method-Override` or a `_method` query
//! parameter and run another method than the request line says. idemgate scopes and
//! fingerprints by method, so an override it did not see would let `POST` then `POST` +
//! `X-HTTP-Method-Override: DELETE` under one key replay the `POST`'s answer for a `DELETE`
//! the client meant to run. A route says which override headers its upstream honours
//! (`method_override_headers`): their method is the request's method for scope,
//! fingerprint and protection, and so is a `_method` field where the route says the
//! upstream reads it (`method_override_params`: the query, or a form-encoded or multipart
//! POST body, as Rack's `MethodOverride` in Rails and Sinatra, Laravel and Symfony read
//! it). Every other override signal that names another method is *unseen*, and the proxy
//! refuses the request where that matters. A body is only read for a protected request, so
//! its `_method` is weighed in the body step ([`with_body`]).

use hyper::header::{HeaderMap, HeaderName};
use hyper::Method;

/// The override headers that common frameworks honour, lowercase.
pub const OVERRIDE_HEADERS: [&str; 3] = [
    "x-http-method-override",
    "x-http-method",
    "x-method-override",
];

/// [`OVERRIDE_HEADERS`] as header names: looked up by a `&str`, each was parsed and
/// hashed anew on every request.
const OVERRIDE_HEADER_NAMES: [HeaderName; 3] = [
    HeaderName::from_static(OVERRIDE_HEADERS[0]),
    HeaderName::from_static(OVERRIDE_HEADERS[1]),
    HeaderName::from_static(OVERRIDE_HEADERS[2]),
];

/// The query parameter that common frameworks honour.
pub const OVERRIDE_PARAM: &str = "_method";

/// Where a route's upstream reads a `_method` field (`method_override_params`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct OverrideParams {
    /// `?_method=`.
    pub query: bool,
    /// A `_method` field of a form-encoded or multipart POST body.
    pub body: bool,
}

/// What the override signals of a request say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Overrides {
    /// The method named by a declared override header, when it differs from the request's.
    pub declared: Option<Method>,
    /// Methods named by override signals that the route does not declare and that differ
    /// from the effective method (`None` in the list: a value that is not a method).
    pub unseen: Vec<Option<Method>>,
}

impl Overrides {
    /// The method the upstream runs: the declared override's, else the request's.
    pub fn effective<'a>(&'a self, method: &'a Method) -> &'a Method {
        self.declared.as_ref().unwrap_or(method)
    }
}

/// Why the declared override headers cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum OverrideError {
    /// A declared header's value is not a method token.
    #[error("the `{0}` header is not an HTTP method")]
    NotAMethod(String),
    /// Declared headers name two different methods.
    #[error("the method-override headers name more than one method")]
    Conflicting,
    /// A declared header sent on more than one line: servers join the lines into a list
    /// (`DELETE, DELETE`), which frameworks then read as no method and run the request's.
    #[error("the `{0}` header is sent more than once; send it on one line, naming one method")]
    Repeated(String),
}

/// A method token, uppercased as the frameworks that read these headers do; `None` if the
/// value is not one.
fn method_of(value: &[u8]) -> Option<Method> {
    let v = value.trim_ascii();
    if v.is_empty() {
        return None;
    }
    Method::from_bytes(&v.to_ascii_uppercase()).ok()
}

/// Adds a declared signal's method to what the declared ones name so far.
fn declare(named: &mut Option<Method>, value: &[u8], what: &str) -> Result<(), OverrideError> {
    let m = method_of(value).ok_or_else(|| OverrideError::NotAMethod(what.to_string()))?;
    match named {
        Some(n) if *n != m => Err(OverrideError::Conflicting),
        _ => {
            *named = Some(m);
            Ok(())
        }
    }
}

/// The `_method` values of a query.
fn query_values(query: Option<&str>) -> impl Iterator<Item = Vec<u8>> + '_ {
    query
        .filter(|q| q.contains("method") || q.contains('%'))
        .into_iter()
        .flat_map(|q| form_urlencoded::parse(q.as_bytes()))
        .filter(|(k, _)| k == OVERRIDE_PARAM)
        .map(|(_, v)| v.as_bytes().to_vec())
}

/// Reads every override signal of a request's head. `declared`: the route's
/// `method_override_headers`; `params`: where it reads `_method`. Costs a few header
/// lookups when there is none.
pub fn read(
    method: &Method,
    headers: &HeaderMap,
    query: Option<&str>,
    declared: &[HeaderName],
    params: OverrideParams,
) -> Result<Overrides, OverrideError> {
    let mut named: Option<Method> = None;
    for name in declared {
        let values = headers.get_all(name);
        if values.iter().nth(1).is_some() {
            return Err(OverrideError::Repeated(name.as_str().to_string()));
        }
        for value in values {
            declare(&mut named, value.as_bytes(), name.as_str())?;
        }
    }
    if params.query {
        for v in query_values(query) {
            declare(&mut named, &v, "_method query parameter")?;
        }
    }
    let effective = named.clone().unwrap_or_else(|| method.clone());
    let mut unseen: Vec<Option<Method>> = Vec::new();
    let mut note = |m: Option<Method>| {
        if m.as_ref() != Some(&effective) && !unseen.contains(&m) {
            unseen.push(m);
        }
    };
    for name in &OVERRIDE_HEADER_NAMES {
        if declared.contains(name) {
            continue;
        }
        for value in headers.get_all(name) {
            note(method_of(value.as_bytes()));
        }
    }
    if !params.query {
        for v in query_values(query) {
            note(method_of(&v));
        }
    }
    Ok(Overrides {
        declared: named.filter(|m| m != method),
        unseen,
    })
}

/// Whether a request's body may carry a `_method` override: a POST (the one method these
/// frameworks override) with a form-encoded or multipart body.
pub fn body_may_override(method: &Method, headers: &HeaderMap) -> bool {
    *method == Method::POST && body_kind(headers).is_some()
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

enum BodyKind {
    Form,
    Multipart(Vec<u8>),
}

fn body_kind(headers: &HeaderMap) -> Option<BodyKind> {
    let ct = headers.get(hyper::header::CONTENT_TYPE)?.to_str().ok()?;
    let essence = ct.split(';').next().unwrap_or("").trim();
    if essence.eq_ignore_ascii_case("application/x-www-form-urlencoded") {
        Some(BodyKind::Form)
    } else if essence.eq_ignore_ascii_case("multipart/form-data") {
        crate::fingerprint::multipart_boundary(ct).map(BodyKind::Multipart)
    } else {
        None
    }
}

/// The overrides of a request once its body (its content, codings undone) is read: the
/// head's, with the body's `_method` fields declared where the route reads them
/// (`params.body`) and unseen elsewhere. `method`: the request line's.
pub fn with_body(
    head: Overrides,
    method: &Method,
    headers: &HeaderMap,
    body: &[u8],
    params: OverrideParams,
) -> Result<Overrides, OverrideError> {
    if !body_may_override(method, headers) {
        return Ok(head);
    }
    let values = match body_kind(headers) {
        Some(BodyKind::Form) => crate::fingerprint::form_values(body, OVERRIDE_PARAM),
        // A multipart body that does not parse exactly may still carry a `_method` that a
        // lenient parser reads: a value that names no method.
        Some(BodyKind::Multipart(boundary)) => {
            match crate::fingerprint::multipart_values(body, &boundary, OVERRIDE_PARAM) {
                Some(values) => values,
                None if contains(body, OVERRIDE_PARAM.as_bytes()) => vec![Vec::new()],
                None => Vec::new(),
            }
        }
        None => Vec::new(),
    };
    if values.is_empty() {
        return Ok(head);
    }
    let Overrides {
        declared,
        mut unseen,
    } = head;
    let mut named = declared;
    if params.body {
        for v in &values {
            declare(&mut named, v, "_method body field")?;
        }
        // A method the body now names, where an unseen signal named the same, is seen.
        unseen.retain(|m| m.as_ref() != named.as_ref());
    } else {
        let effective = named.clone().unwrap_or_else(|| method.clone());
        for v in &values {
            let m = method_of(v);
            if m.as_ref() != Some(&effective) && !unseen.contains(&m) {
                unseen.push(m);
            }
        }
    }
    Ok(Overrides {
        declared: named.filter(|m| m != method),
        unseen,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::header::HeaderValue;

    const NONE: OverrideParams = OverrideParams {
        query: false,
        body: false,
    };

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.append(*n, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn undeclared_overrides_naming_another_method_are_unseen() {
        let post = Method::POST;
        let o = read(&post, &headers(&[]), Some("a=1"), &[], NONE).unwrap();
        assert_eq!(o, Overrides::default_for_test());
        let o = read(
            &post,
            &headers(&[("x-http-method-override", "delete")]),
            None,
            &[],
            NONE,
        )
        .unwrap();
        assert_eq!(o.unseen, vec![Some(Method::DELETE)]);
        assert_eq!(o.effective(&post), &Method::POST);
        // Naming the request's own method is no override.
        let o = read(
            &post,
            &headers(&[("x-http-method", "POST")]),
            None,
            &[],
            NONE,
        )
        .unwrap();
        assert!(o.unseen.is_empty());
        let o = read(
            &Method::GET,
            &headers(&[]),
            Some("_method=PUT&x=1"),
            &[],
            NONE,
        )
        .unwrap();
        assert_eq!(o.unseen, vec![Some(Method::PUT)]);
        let o = read(
            &Method::GET,
            &headers(&[]),
            Some("%5Fmethod=patch"),
            &[],
            NONE,
        )
        .unwrap();
        assert_eq!(o.unseen, vec![Some(Method::PATCH)]);
        let o = read(
            &post,
            &headers(&[("x-method-override", "")]),
            None,
            &[],
            NONE,
        )
        .unwrap();
        assert_eq!(o.unseen, vec![None]);
    }

    #[test]
    fn a_declared_header_is_the_method() {
        let declared = [HeaderName::from_static("x-http-method-override")];
        let h = headers(&[("x-http-method-override", "DELETE")]);
        let o = read(&Method::POST, &h, None, &declared, NONE).unwrap();
        assert_eq!(o.declared, Some(Method::DELETE));
        assert_eq!(o.effective(&Method::POST), &Method::DELETE);
        assert!(o.unseen.is_empty());
        // Another, undeclared, signal naming a third method is unseen.
        let h = headers(&[
            ("x-http-method-override", "DELETE"),
            ("x-http-method", "PUT"),
        ]);
        let o = read(&Method::POST, &h, None, &declared, NONE).unwrap();
        assert_eq!(o.unseen, vec![Some(Method::PUT)]);
        let h = headers(&[
            ("x-http-method-override", "DELETE"),
            ("x-http-method-override", "PUT"),
        ]);
        assert!(read(&Method::POST, &h, None, &declared, NONE).is_err());
        let h = headers(&[("x-http-method-override", "DE LETE")]);
        assert!(read(&Method::POST, &h, None, &declared, NONE).is_err());
    }

    #[test]
    fn a_body_method_is_declared_where_the_route_reads_it_and_unseen_elsewhere() {
        let form = headers(&[("content-type", "application/x-www-form-urlencoded")]);
        let body = b"amount=10&_method=patch";
        let head = read(&Method::POST, &form, None, &[], NONE).unwrap();
        let o = with_body(head.clone(), &Method::POST, &form, body, NONE).unwrap();
        assert_eq!(o.unseen, vec![Some(Method::PATCH)]);
        let reads = OverrideParams {
            query: false,
            body: true,
        };
        let o = with_body(head.clone(), &Method::POST, &form, body, reads).unwrap();
        assert_eq!(o.declared, Some(Method::PATCH));
        assert!(o.unseen.is_empty());
        // Two different methods, or a value that is no method, where it is declared.
        let two = b"_method=PATCH&_method=DELETE";
        assert!(with_body(head.clone(), &Method::POST, &form, two, reads).is_err());
        // Only a POST is overridden, and only by a form.
        let o = with_body(head.clone(), &Method::PUT, &form, body, NONE).unwrap();
        assert!(o.unseen.is_empty());
        let json = headers(&[("content-type", "application/json")]);
        let o = with_body(head.clone(), &Method::POST, &json, body, NONE).unwrap();
        assert!(o.unseen.is_empty());
        let multipart = headers(&[("content-type", "multipart/form-data; boundary=XyZ")]);
        let body = b"--XyZ\r\ncontent-disposition: form-data; name=\"_method\"\r\n\r\nDELETE\r\n--XyZ--\r\n";
        let o = with_body(head, &Method::POST, &multipart, body, NONE).unwrap();
        assert_eq!(o.unseen, vec![Some(Method::DELETE)]);
        // Declared in the query.
        let q = OverrideParams {
            query: true,
            body: false,
        };
        let o = read(&Method::POST, &form, Some("_method=PUT"), &[], q).unwrap();
        assert_eq!(o.declared, Some(Method::PUT));
        assert!(o.unseen.is_empty());
    }

    impl Overrides {
        fn default_for_test() -> Overrides {
            Overrides {
                declared: None,
                unseen: Vec::new(),
            }
        }
    }
}
