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
//! fingerprint and protection. Every other override signal that names another method is
//! *unseen*, and the proxy refuses the request where that matters.

use hyper::header::{HeaderMap, HeaderName};
use hyper::Method;

/// The override headers that common frameworks honour, lowercase.
pub const OVERRIDE_HEADERS: [&str; 3] = [
    "x-http-method-override",
    "x-http-method",
    "x-method-override",
];

/// The query parameter that common frameworks honour.
pub const OVERRIDE_PARAM: &str = "_method";

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

/// Reads every override signal of a request. `declared`: the route's
/// `method_override_headers`. Costs a few header lookups when there is none.
pub fn read(
    method: &Method,
    headers: &HeaderMap,
    query: Option<&str>,
    declared: &[HeaderName],
) -> Result<Overrides, OverrideError> {
    let mut named: Option<Method> = None;
    for name in declared {
        for value in headers.get_all(name) {
            let m = method_of(value.as_bytes())
                .ok_or_else(|| OverrideError::NotAMethod(name.as_str().to_string()))?;
            match &named {
                Some(n) if *n != m => return Err(OverrideError::Conflicting),
                _ => named = Some(m),
            }
        }
    }
    let effective = named.clone().unwrap_or_else(|| method.clone());
    let mut unseen: Vec<Option<Method>> = Vec::new();
    let mut note = |m: Option<Method>| {
        if m.as_ref() != Some(&effective) && !unseen.contains(&m) {
            unseen.push(m);
        }
    };
    for name in OVERRIDE_HEADERS {
        if declared.iter().any(|d| d.as_str() == name) {
            continue;
        }
        for value in headers.get_all(name) {
            note(method_of(value.as_bytes()));
        }
    }
    if let Some(q) = query.filter(|q| q.contains("method") || q.contains('%')) {
        for (k, v) in form_urlencoded::parse(q.as_bytes()) {
            if k == OVERRIDE_PARAM {
                note(method_of(v.as_bytes()));
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
        let o = read(&post, &headers(&[]), Some("a=1"), &[]).unwrap();
        assert_eq!(o, Overrides::default_for_test());
        let o = read(
            &post,
            &headers(&[("x-http-method-override", "delete")]),
            None,
            &[],
        )
        .unwrap();
        assert_eq!(o.unseen, vec![Some(Method::DELETE)]);
        assert_eq!(o.effective(&post), &Method::POST);
        // Naming the request's own method is no override.
        let o = read(&post, &headers(&[("x-http-method", "POST")]), None, &[]).unwrap();
        assert!(o.unseen.is_empty());
        let o = read(&Method::GET, &headers(&[]), Some("_method=PUT&x=1"), &[]).unwrap();
        assert_eq!(o.unseen, vec![Some(Method::PUT)]);
        let o = read(&Method::GET, &headers(&[]), Some("%5Fmethod=patch"), &[]).unwrap();
        assert_eq!(o.unseen, vec![Some(Method::PATCH)]);
        let o = read(&post, &headers(&[("x-method-override", "")]), None, &[]).unwrap();
        assert_eq!(o.unseen, vec![None]);
    }

    #[test]
    fn a_declared_header_is_the_method() {
        let declared = [HeaderName::from_static("x-http-method-override")];
        let h = headers(&[("x-http-method-override", "DELETE")]);
        let o = read(&Method::POST, &h, None, &declared).unwrap();
        assert_eq!(o.declared, Some(Method::DELETE));
        assert_eq!(o.effective(&Method::POST), &Method::DELETE);
        assert!(o.unseen.is_empty());
        // Another, undeclared, signal naming a third method is unseen.
        let h = headers(&[
            ("x-http-method-override", "DELETE"),
            ("x-http-method", "PUT"),
        ]);
        let o = read(&Method::POST, &h, None, &declared).unwrap();
        assert_eq!(o.unseen, vec![Some(Method::PUT)]);
        let h = headers(&[
            ("x-http-method-override", "DELETE"),
            ("x-http-method-override", "PUT"),
        ]);
        assert!(read(&Method::POST, &h, None, &declared).is_err());
        let h = headers(&[("x-http-method-override", "DE LETE")]);
        assert!(read(&Method::POST, &h, None, &declared).is_err());
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
