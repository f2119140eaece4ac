//! Route templates: a route path that names its parameters, as the upstream's router does
//! (`/v1/accounts/{id}/transfers`, `/files/{*rest}`).
//!
//! A prefix route can only fold a spelling for the whole path: `case_insensitive_paths`
//! lowercases an account id as well as `transfers` (so `ALICE` got `alice`'s recorded
//! answer, another account's payment), and a format suffix can only follow the route's own
//! last segment. A template says which segments are the route's own words and which are the
//! handler's parameters: letter case, trailing dots and spaces and format suffixes are
//! folded (or refused) on the literal segments and at the end of the path, where routers put
//! the suffix, and a parameter's value is kept as the client sent it (decoded as every
//! path is, see [`super::path`]).
//!
//! `{name}` is one non-empty segment; `{*name}`, only last, is the rest of the path (zero
//! or more segments). Without a tail, a template matches its number of segments exactly.

use super::path::{trim_dots_and_spaces, FormatExt, PathError};

/// One segment of a template.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    /// The route's own word, in the normal form (lower case on a case-insensitive route).
    Literal(String),
    /// `{name}`: one segment, the handler's parameter.
    Param,
    /// `{*name}`: the rest of the path.
    Tail,
}

/// A parsed route template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    segments: Vec<Segment>,
}

/// Why a route path is not a valid template.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    /// `{` or `}` that does not enclose a whole segment (`/v1/a{id}`, `/v1/{id`).
    #[error("'{{' and '}}' must enclose a whole segment, as in /v1/accounts/{{id}}/transfers")]
    PartialSegment,
    /// A parameter name that is empty or not letters, digits and `_`.
    #[error("the parameter name `{0}` must be letters, digits or '_', not starting with a digit")]
    BadName(String),
    /// Two parameters with one name.
    #[error("the parameter name `{0}` is used twice")]
    Duplicate(String),
    /// `{*rest}` before the last segment.
    #[error("a tail wildcard `{{*{0}}}` can only be the last segment")]
    TailNotLast(String),
    /// An empty segment (`//`, or a trailing `/`) in a template.
    #[error("a template has no empty segments (no '//' and no trailing '/')")]
    EmptySegment,
}

/// What a path that matches a template is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Matched {
    /// The scope's form: the literal segments as the template has them, the parameters as
    /// sent, a listed format suffix left out.
    pub scope: String,
    /// A listed format suffix was left out of the scope.
    pub folded_suffix: bool,
    /// A spelling this route refuses on its protected methods: an unlisted format suffix,
    /// or (on a case-sensitive route) a literal segment's trailing dots or spaces, or (on a
    /// case-insensitive one, which drops them) a parameter's.
    pub refused: Option<PathError>,
}

/// Whether `path` (as configured) is a template rather than a prefix.
pub fn is_template(path: &str) -> bool {
    path.contains('{') || path.contains('}')
}

fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

impl Template {
    /// Parses a template whose literal segments are already in the route's normal form
    /// (`normal`), lower case where `case_insensitive`.
    pub fn parse(normal: &str, case_insensitive: bool) -> Result<Template, TemplateError> {
        let mut segments = Vec::new();
        let mut names: Vec<&str> = Vec::new();
        let parts: Vec<&str> = normal
            .strip_prefix('/')
            .unwrap_or(normal)
            .split('/')
            .collect();
        for (i, seg) in parts.iter().enumerate() {
            if seg.is_empty() {
                return Err(TemplateError::EmptySegment);
            }
            let inner = seg.strip_prefix('{').and_then(|s| s.strip_suffix('}'));
            match inner {
                Some(inner) if !inner.contains(['{', '}']) => {
                    let (tail, name) = match inner.strip_prefix('*') {
                        Some(name) => (true, name),
                        None => (false, inner),
                    };
                    if !valid_name(name) {
                        return Err(TemplateError::BadName(name.to_string()));
                    }
                    if names.contains(&name) {
                        return Err(TemplateError::Duplicate(name.to_string()));
                    }
                    if tail && i + 1 != parts.len() {
                        return Err(TemplateError::TailNotLast(name.to_string()));
                    }
                    names.push(name);
                    segments.push(if tail { Segment::Tail } else { Segment::Param });
                }
                _ if seg.contains(['{', '}']) => return Err(TemplateError::PartialSegment),
                _ => {
                    let lit = if case_insensitive {
                        seg.to_ascii_lowercase()
                    } else {
                        seg.to_string()
                    };
                    segments.push(Segment::Literal(lit));
                }
            }
        }
        Ok(Template { segments })
    }

    /// The shape of the template, names left out: two routes with one shape are one route.
    pub fn shape(&self) -> String {
        let mut out = String::new();
        for s in &self.segments {
            out.push('/');
            match s {
                Segment::Literal(l) => out.push_str(l),
                Segment::Param => out.push_str("{}"),
                Segment::Tail => out.push_str("{*}"),
            }
        }
        out
    }

    /// Matches a path in the normal form that keeps letter case (parameters are compared
    /// as sent); `suffixes`: the route's `format_suffixes`, without dots, lower case on a
    /// case-insensitive route.
    pub fn matches(
        &self,
        normal: &str,
        case_insensitive: bool,
        suffixes: &[String],
    ) -> Option<Matched> {
        let body = normal.strip_prefix('/').unwrap_or(normal);
        let segs: Vec<&str> = if body.is_empty() {
            Vec::new()
        } else {
            body.split('/').collect()
        };
        let has_tail = self.segments.last() == Some(&Segment::Tail);
        let fixed = self.segments.len() - usize::from(has_tail);
        if segs.len() < fixed || (!has_tail && segs.len() != fixed) {
            return None;
        }
        let eq = |a: &str, b: &str| {
            if case_insensitive {
                a.eq_ignore_ascii_case(b)
            } else {
                a == b
            }
        };
        let listed = |ext: &FormatExt| {
            let e = ext.as_str();
            suffixes.iter().any(|s| eq(s, e))
        };
        let mut out = Matched {
            scope: String::with_capacity(normal.len()),
            folded_suffix: false,
            refused: None,
        };
        for (k, t) in self.segments.iter().enumerate() {
            // The suffix position: the path's last segment, where routers put `.json`.
            let last = !has_tail && k + 1 == fixed;
            match t {
                Segment::Tail => {
                    for seg in &segs[k..] {
                        out.scope.push('/');
                        out.scope.push_str(seg);
                    }
                    break;
                }
                Segment::Literal(lit) => {
                    let seg = segs[k];
                    out.scope.push('/');
                    out.scope.push_str(lit);
                    if eq(seg, lit) {
                        continue;
                    }
                    if last {
                        if let Some(ext) = suffix_of(seg).filter(|(stem, _)| eq(stem, lit)) {
                            let (_, ext) = ext;
                            if listed(&ext) {
                                out.folded_suffix = true;
                            } else {
                                out.refused = out.refused.or(Some(PathError::FormatSuffix(ext)));
                            }
                            continue;
                        }
                    }
                    if eq(trim_dots_and_spaces(seg), lit) {
                        if !case_insensitive {
                            out.refused = out.refused.or(Some(PathError::TrailingSpelling));
                        }
                        continue;
                    }
                    return None;
                }
                Segment::Param => {
                    let mut seg = segs[k];
                    if seg.is_empty() {
                        return None;
                    }
                    if last {
                        if let Some((stem, ext)) = suffix_of(seg) {
                            if listed(&ext) && !stem.is_empty() {
                                out.folded_suffix = true;
                                seg = stem;
                            }
                        }
                    }
                    // A case-insensitive route's upstream (IIS, ASP.NET) drops them: the
                    // value it hands its handler is not the one sent.
                    if case_insensitive && trim_dots_and_spaces(seg).len() != seg.len() {
                        out.refused = out.refused.or(Some(PathError::TrailingSpelling));
                    }
                    out.scope.push('/');
                    out.scope.push_str(seg);
                }
            }
        }
        if out.scope.is_empty() {
            out.scope.push('/');
        }
        Some(out)
    }
}

/// A segment's stem and format suffix (`alice.json`: `alice`, `json`).
fn suffix_of(seg: &str) -> Option<(&str, FormatExt)> {
    let dot = seg.rfind('.')?;
    let ext = FormatExt::of(&seg[dot..])?;
    Some((&seg[..dot], ext))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(path: &str, ci: bool) -> Template {
        Template::parse(path, ci).expect("a template")
    }

    #[test]
    fn templates_parse_or_say_why_not() {
        assert_eq!(t("/v1/{id}/x", false).shape(), "/v1/{}/x");
        assert_eq!(t("/V1/{id}/{*rest}", true).shape(), "/v1/{}/{*}");
        for (bad, want) in [
            ("/v1/a{id}", TemplateError::PartialSegment),
            ("/v1/{id", TemplateError::PartialSegment),
            ("/v1/{}", TemplateError::BadName(String::new())),
            ("/v1/{9x}", TemplateError::BadName("9x".into())),
            ("/v1/{a-b}", TemplateError::BadName("a-b".into())),
            ("/{id}/{id}", TemplateError::Duplicate("id".into())),
            ("/{*rest}/x", TemplateError::TailNotLast("rest".into())),
            ("/v1//{id}", TemplateError::EmptySegment),
            ("/v1/{id}/", TemplateError::EmptySegment),
        ] {
            assert_eq!(Template::parse(bad, false), Err(want), "{bad}");
        }
    }

    #[test]
    fn literals_fold_and_parameters_keep_their_case() {
        let tpl = t("/v1/accounts/{id}/transfers", true);
        let m = tpl
            .matches("/V1/Accounts/ALICE/Transfers", true, &[])
            .unwrap();
        assert_eq!(m.scope, "/v1/accounts/ALICE/transfers");
        assert_eq!(m.refused, None);
        let m = tpl
            .matches("/v1/accounts/alice/transfers", true, &[])
            .unwrap();
        assert_eq!(m.scope, "/v1/accounts/alice/transfers");
        // Trailing dots on a literal are folded where the upstream drops them, refused on
        // a parameter (the handler would get another value than the one scoped).
        let m = tpl
            .matches("/v1/accounts/alice/transfers.", true, &[])
            .unwrap();
        assert_eq!(
            (m.scope.as_str(), m.refused),
            ("/v1/accounts/alice/transfers", None)
        );
        let m = tpl
            .matches("/v1/accounts/alice./transfers", true, &[])
            .unwrap();
        assert_eq!(m.refused, Some(PathError::TrailingSpelling));
        assert!(tpl
            .matches("/v1/accounts/alice/transfers/7", true, &[])
            .is_none());
        assert!(tpl.matches("/v1/accounts/transfers", true, &[]).is_none());
        // Case-sensitive: another case is another path; a trailing dot is refused.
        let cs = t("/v1/accounts/{id}/transfers", false);
        assert!(cs
            .matches("/v1/Accounts/alice/transfers", false, &[])
            .is_none());
        let m = cs
            .matches("/v1/accounts/alice/transfers%20", false, &[])
            .unwrap();
        assert_eq!(m.refused, Some(PathError::TrailingSpelling));
    }

    #[test]
    fn suffixes_are_read_at_the_end_of_the_path() {
        let json = ["json".to_string()];
        let tpl = t("/v2/accounts/{id}/transfers", false);
        let m = tpl
            .matches("/v2/accounts/alice/transfers.json", false, &json)
            .unwrap();
        assert_eq!(m.scope, "/v2/accounts/alice/transfers");
        assert!(m.folded_suffix && m.refused.is_none());
        let m = tpl
            .matches("/v2/accounts/alice/transfers.xml", false, &json)
            .unwrap();
        assert!(matches!(m.refused, Some(PathError::FormatSuffix(e)) if e.as_str() == "xml"));
        // On a parameter: a listed suffix is folded, anything else is the value.
        let tpl = t("/v2/accounts/{id}", false);
        let m = tpl
            .matches("/v2/accounts/alice.json", false, &json)
            .unwrap();
        assert_eq!(m.scope, "/v2/accounts/alice");
        let m = tpl
            .matches("/v2/accounts/alice@example.com", false, &json)
            .unwrap();
        assert_eq!(
            (m.scope.as_str(), m.refused),
            ("/v2/accounts/alice@example.com", None)
        );
    }

    #[test]
    fn a_tail_takes_the_rest() {
        let tpl = t("/files/{*rest}", false);
        assert_eq!(tpl.matches("/files", false, &[]).unwrap().scope, "/files");
        assert_eq!(
            tpl.matches("/files/A/b.txt", false, &[]).unwrap().scope,
            "/files/A/b.txt"
        );
        assert!(tpl.matches("/filesx/a", false, &[]).is_none());
    }
}
