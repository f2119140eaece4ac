//! Which route a path leads to: the longest matching route (a prefix, or a template that
//! names its parameters, [`crate::scope::template`]) in the path's normal form, and how the
//! path is forwarded.

use std::borrow::Cow;
use std::sync::Arc;

use hyper::Method;

use super::{Anonymous, PathParams, Policy, Settings};
use crate::scope::client_cert::ClientCert;
use crate::scope::template::Matched;
use crate::scope::{path, PathError, PathRules, TenantSource};

/// Where a request's path led: its policy, and the path's normal form when it differs from
/// the spelling the client sent.
#[derive(Debug)]
pub struct Routed<'a> {
    /// The policy of the longest matching route, or the defaults.
    pub policy: &'a Arc<Policy>,
    /// The path in the normal form of that policy's rules (what scope and fingerprint
    /// use); `None` when that is the path as sent.
    pub normalized: Option<String>,
    /// What the upstream gets instead of `normalized`, where the two differ: the client's
    /// letter case on a case-insensitive route, the `;` parameters a `strip` route leaves out
    /// of the scope, a folded format suffix.
    pub forward: Forward,
    /// A spelling this route refuses on the methods it protects (`;` parameters where
    /// `path_params = "refuse"`, a format suffix it does not list). The path was routed
    /// as if it had none: a request on an unprotected method passes through as sent.
    pub refused: Option<PathError>,
}

/// The path a protected request is forwarded with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Forward {
    /// `Routed::normalized` (or the path as sent when that is `None`).
    Normalized,
    /// The path as sent: it already is the form to forward.
    AsSent,
    /// This path.
    Path(String),
}

impl Settings {
    /// The policy for a request path: the longest route prefix that matches at a segment
    /// boundary, else the defaults. Each route is matched against the path in the normal
    /// form of that route's own rules. An error: the path cannot be normalized safely.
    pub fn route<'a>(&'a self, raw: &str) -> Result<Routed<'a>, PathError> {
        let mut forms = Forms::new(raw);
        let (mut chosen, mut templated) = self.longest_match(&mut forms)?;
        let trailing = self.trailing_spelling(&mut forms, chosen.map(|(p, _, _)| p))?;
        if let Some((policy, i)) = trailing {
            chosen = Some((policy, i, None));
            templated = None;
        }
        let cased = match trailing {
            None => self.letter_case(&mut forms, chosen.map(|(p, _, _)| p))?,
            Some(_) => None,
        };
        if let Some((policy, i)) = cased {
            chosen = Some((policy, i, None));
            templated = None;
        }
        let (policy, i, suffix) = match chosen {
            Some(c) => c,
            None => (
                &self.default_policy,
                forms.form_for(self.default_policy.path_rules)?,
                None,
            ),
        };
        let refused = trailing
            .map(|_| PathError::TrailingSpelling)
            .or(cased.map(|_| PathError::LetterCase));
        let normalized = match forms.slots[i].take() {
            Some((_, Cow::Owned(s))) => Some(s),
            _ => None,
        };
        finish(raw, policy, normalized, refused, templated, suffix)
    }

    /// The longest route whose path matches the path's normal form under that route's
    /// rules (a route also takes its own path plus a format suffix), with its form's slot,
    /// the suffix, and what a template made of the path.
    fn longest_match<'a>(
        &'a self,
        forms: &mut Forms<'_>,
    ) -> Result<(Option<Chosen<'a>>, Option<Matched>), PathError> {
        // Longest prefix first; a route also takes its own path plus a format suffix
        // (`/v1/transfers.json`), which frameworks such as Rails route to the same
        // handler: it must not fall through to a shorter route or the defaults.
        for (prefix, policy) in &self.routes {
            // A template compares the form that keeps letter case: its parameters keep
            // theirs, its literal segments fold as the route's rules say.
            if let Some(t) = &policy.template {
                let rules = policy.path_rules;
                let kept = PathRules {
                    case_insensitive: false,
                    ..rules
                };
                let i = forms.form_for(kept)?;
                let Some(form) = forms.get(i) else {
                    continue;
                };
                if let Some(m) = t.matches(form, rules.case_insensitive, &policy.format_suffixes) {
                    return Ok((Some((policy, i, None)), Some(m)));
                }
                continue;
            }
            let i = forms.form_for(policy.path_rules)?;
            let Some(form) = forms.get(i) else {
                continue;
            };
            if prefix_matches(prefix, form) {
                return Ok((Some((policy, i, None)), None));
            }
            if let Some(ext) = format_suffix(prefix, form) {
                return Ok((Some((policy, i, Some(ext))), None));
            }
        }
        Ok((None, None))
    }

    /// How many routes are longer than the one chosen (all of them when none was): the
    /// ones a folded spelling of the path may belong to instead.
    fn longer(&self, chosen: Option<&Arc<Policy>>) -> usize {
        match chosen {
            Some(p) => self
                .routes
                .iter()
                .take_while(|(_, q)| !Arc::ptr_eq(q, p))
                .count(),
            None => self.routes.len(),
        }
    }

    /// A path that would be a longer route's but for trailing dots or spaces on a
    /// segment (`/v1/transfers.`, `/v1/transfers%20/7`) belongs to that route, refused:
    /// IIS and ASP.NET drop them, so it may be that route's operation; matched against a
    /// shorter route or the defaults it would be another. Looked for only when a spelling
    /// may fold.
    fn trailing_spelling<'a>(
        &'a self,
        forms: &mut Forms<'_>,
        chosen: Option<&Arc<Policy>>,
    ) -> Result<Option<(&'a Arc<Policy>, usize)>, PathError> {
        let raw = forms.raw;
        if !(raw.contains('.') || raw.contains('%')) {
            return Ok(None);
        }
        // (Templates say what they fold themselves.)
        for (prefix, policy) in self.routes[..self.longer(chosen)]
            .iter()
            .filter(|(_, p)| p.template.is_none())
        {
            let i = forms.form_for(policy.path_rules)?;
            let Some(form) = forms.get(i) else {
                continue;
            };
            let Some(trimmed) = path::without_trailing_dots(form) else {
                continue;
            };
            if prefix_matches(prefix, &trimmed) || format_suffix(prefix, &trimmed).is_some() {
                return Ok(Some((policy, i)));
            }
        }
        Ok(None)
    }

    /// A path that would be a longer route's if letter case were ignored
    /// (`/V1/Transfers`, `/v1/transfer%53`) belongs to that route, refused, unless the
    /// route says how its upstream compares letters: Express and Koa fold case by
    /// default, so it may be that route's operation.
    fn letter_case<'a>(
        &'a self,
        forms: &mut Forms<'_>,
        chosen: Option<&Arc<Policy>>,
    ) -> Result<Option<(&'a Arc<Policy>, usize)>, PathError> {
        if !forms
            .raw
            .bytes()
            .any(|b| b.is_ascii_uppercase() || b == b'%')
        {
            return Ok(None);
        }
        for (prefix, policy) in self.routes[..self.longer(chosen)]
            .iter()
            .filter(|(_, p)| !p.spellings.case_known)
        {
            let hit = match &policy.template {
                // A template compares the form that keeps case, folding its literals.
                Some(t) => {
                    let i = forms.form_for(policy.path_rules)?;
                    forms.get(i).is_some_and(|form| {
                        t.matches(form, true, &policy.format_suffixes).is_some()
                    })
                }
                None => {
                    let folded = PathRules {
                        case_insensitive: true,
                        ..policy.path_rules
                    };
                    let i = forms.form_for(folded)?;
                    let lower = prefix.to_ascii_lowercase();
                    forms.get(i).is_some_and(|form| {
                        prefix_matches(&lower, form) || format_suffix(&lower, form).is_some()
                    })
                }
            };
            if hit {
                return Ok(Some((policy, forms.form_for(policy.path_rules)?)));
            }
        }
        Ok(None)
    }

    /// The policy for a path, for callers that need no normal form (a path that cannot be
    /// normalized gets the defaults).
    pub fn policy_for(&self, raw: &str) -> &Arc<Policy> {
        self.route(raw)
            .map(|r| r.policy)
            .unwrap_or(&self.default_policy)
    }

    /// The tenant of a request on `policy`'s route: its own principal, or the shared
    /// anonymous one where the route allows it. `Ok(None)`: refused for want of a tenant.
    /// The proxy and the operator's lookup both use this, so they compute the same ids.
    pub fn tenant(
        &self,
        headers: &hyper::HeaderMap,
        cert: Option<&ClientCert>,
        policy: &Policy,
    ) -> Result<Option<crate::scope::Tenant>, crate::scope::TenantError> {
        let principal = match crate::scope::tenant::resolve(
            headers,
            cert,
            &policy.tenant,
            self.jwt.as_deref(),
        )? {
            Some(tenant) => tenant,
            None if policy.anonymous == Anonymous::Shared => crate::scope::Tenant::anonymous(),
            None => return Ok(None),
        };
        Ok(Some(crate::scope::tenant::qualify(
            principal,
            headers,
            &policy.tenant_qualifiers,
        )))
    }

    /// Whether any route (or the defaults) reads its tenant from client certificates.
    pub fn reads_client_certs(&self) -> bool {
        std::iter::once(&self.default_policy)
            .chain(self.routes.iter().map(|(_, p)| p))
            .any(|p| matches!(p.tenant, TenantSource::ClientCert(_)))
    }

    /// Whether any route (or the defaults) protects this method.
    pub fn protects_anywhere(&self, method: &Method) -> bool {
        self.protected_methods.contains(method)
    }

    /// Whether a route that enforces (not `mode = "observe"`) protects `method`.
    pub fn enforces_anywhere(&self, method: &Method) -> bool {
        self.enforced_methods.contains(method)
    }
}

/// The route chosen for a path: its policy, the slot of the path's form under its
/// rules, and a format suffix the path has beyond the route's path.
type Chosen<'a> = (&'a Arc<Policy>, usize, Option<path::FormatExt>);

/// Normal forms of one path already computed, per rules: a path is normalized at most
/// once per distinct rule set, and a path in normal form costs no copy. No allocation for
/// the bookkeeping: three booleans make eight rule sets at most.
struct Forms<'p> {
    raw: &'p str,
    slots: [Option<(PathRules, Cow<'p, str>)>; 8],
}

impl<'p> Forms<'p> {
    fn new(raw: &'p str) -> Forms<'p> {
        Forms {
            raw,
            slots: Default::default(),
        }
    }

    /// The slot of the path's form under `rules`, normalized now if it is the first time.
    fn form_for(&mut self, rules: PathRules) -> Result<usize, PathError> {
        for (i, slot) in self.slots.iter_mut().enumerate() {
            match slot {
                Some((r, _)) if *r == rules => return Ok(i),
                Some(_) => {}
                None => {
                    *slot = Some((rules, path::normalize(self.raw, rules)?));
                    return Ok(i);
                }
            }
        }
        // Three booleans make eight rule sets, so a slot was free or matched above.
        Err(PathError::NotAbsolute)
    }

    /// The form in slot `i`.
    fn get(&self, i: usize) -> Option<&str> {
        self.slots[i].as_ref().map(|(_, form)| &**form)
    }
}

/// What the route's policy refuses of the path's spelling, its normal form, and the path
/// it is forwarded with.
fn finish<'a>(
    raw: &str,
    policy: &'a Arc<Policy>,
    mut normalized: Option<String>,
    mut refused: Option<PathError>,
    templated: Option<Matched>,
    suffix: Option<path::FormatExt>,
) -> Result<Routed<'a>, PathError> {
    let rules = policy.path_rules;
    // Spellings the route does not say how its upstream reads.
    if raw.contains('+') && !policy.spellings.plus_known {
        refused = refused.or(Some(PathError::RawPlus));
    }
    if !raw.is_ascii() && !policy.spellings.raw_utf8 {
        refused = refused.or(Some(PathError::RawNonAscii));
    }
    // `;` is never in a normal form: a raw one is a parameter, left out above.
    let params = raw.contains(';');
    if params && policy.path_params == PathParams::Refuse {
        refused = Some(PathError::PathParams);
    }
    let mut fold_suffix = false;
    if let Some(m) = templated {
        refused = refused.or(m.refused);
        fold_suffix = m.folded_suffix;
        normalized = (m.scope != raw).then_some(m.scope);
    }
    if let Some(ext) = suffix {
        if policy.format_suffixes.iter().any(|f| f == ext.as_str()) {
            fold_suffix = true;
            let form = normalized.as_deref().unwrap_or(raw);
            normalized = Some(form[..form.len() - ext.as_str().len() - 1].to_string());
        } else {
            refused = refused.or(Some(PathError::FormatSuffix(ext)));
        }
    }
    // The scope's form decodes every escape, so it is not a path to send: a path that
    // was not already normal goes in its RFC 3986 form (path::forward_form).
    let forward = if rules.case_insensitive
        || (params && refused.is_none())
        || fold_suffix
        || normalized.is_some()
    {
        match path::forward_form(raw, rules)? {
            Cow::Borrowed(_) => Forward::AsSent,
            Cow::Owned(p) => Forward::Path(p),
        }
    } else {
        Forward::Normalized
    };
    Ok(Routed {
        policy,
        normalized,
        forward,
        refused,
    })
}

/// The format suffix of `path` when it is `prefix` (a route's path, ending in a segment)
/// plus `.` and 1 to 5 letters or digits.
fn format_suffix(prefix: &str, path: &str) -> Option<path::FormatExt> {
    if prefix.ends_with('/') {
        return None;
    }
    path::FormatExt::of(path.strip_prefix(prefix)?)
}

fn prefix_matches(prefix: &str, path: &str) -> bool {
    match path.strip_prefix(prefix) {
        Some(rest) => rest.is_empty() || prefix.ends_with('/') || rest.starts_with('/'),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use hyper::header::HeaderName;

    use super::*;
    use crate::config::tests::settings;

    #[test]
    fn longest_prefix_wins_at_segment_boundaries() {
        let s = settings(
            r#"
            [[routes]]
            path = "/v1"
            require_key = true
            [[routes]]
            path = "/v1/transfers"
            methods = ["post"]
            retention = "48h"
            fingerprint_ignore = ["/client_time"]
            "#,
        )
        .unwrap();
        assert_eq!(
            s.policy_for("/v1/transfers").retention,
            Duration::from_secs(48 * 3600)
        );
        assert_eq!(
            s.policy_for("/v1/transfers/7").route.as_deref(),
            Some("/v1/transfers")
        );
        assert_eq!(s.policy_for("/v1/transfersx").route.as_deref(), Some("/v1"));
        assert!(s.policy_for("/v1/x").require_key);
        assert_eq!(s.policy_for("/v2").route, None);
        assert_eq!(s.policy_for("/v1/transfers").methods, vec![Method::POST]);
    }

    #[test]
    fn routes_match_the_normal_form_of_the_path() {
        let s = settings(
            r#"
            [defaults]
            tenant_jwt_claim = "sub"
            [[routes]]
            path = "/v1/transfers/"
            tenant_headers = ["X-Account-Id"]
            [[routes]]
            path = "/IIS"
            case_insensitive_paths = true
            [[routes]]
            path = "/strict"
            path_match = "strict"
            "#
            .replace(
                "[defaults]",
                "jwt_hs256_secret = \"0123456789abcdef0123456789abcdef\"\n[defaults]",
            )
            .as_str(),
        )
        .unwrap();
        let r = s.route("/v1//%74ransfers/7/").unwrap();
        assert_eq!(r.policy.route.as_deref(), Some("/v1/transfers/"));
        assert_eq!(r.normalized.as_deref(), Some("/v1/transfers/7"));
        assert_eq!(
            r.policy.tenant,
            TenantSource::Headers(vec![HeaderName::from_static("x-account-id")])
        );
        let r = s.route("/v1/transfers").unwrap();
        assert_eq!(r.normalized, None);
        assert_eq!(r.policy.route.as_deref(), Some("/v1/transfers/"));
        let r = s.route("/iis/Pay").unwrap();
        assert_eq!(r.policy.route.as_deref(), Some("/IIS"));
        assert_eq!(r.normalized.as_deref(), Some("/iis/pay"));
        assert_eq!(s.route("/strict//x").unwrap().normalized, None);
        let d = s.route("/other").unwrap().policy;
        assert_eq!(d.tenant, TenantSource::JwtClaim("sub".into()));
        assert!(s.route("/a%2fb").is_err());
    }

    #[test]
    fn a_route_without_a_tenant_setting_reads_authorization_and_x_api_key() {
        let s = settings(
            r#"
            [[routes]]
            path = "/auth-only"
            tenant_headers = ["Authorization"]
            [[routes]]
            path = "/open"
            anonymous = "shared"
            [[routes]]
            path = "/both-named"
            tenant_headers = ["authorization", "X-API-KEY"]
            "#,
        )
        .unwrap();
        let auth = TenantSource::Headers(vec![hyper::header::AUTHORIZATION]);
        assert_eq!(s.policy_for("/pay").tenant, TenantSource::Credentials);
        assert_eq!(s.policy_for("/auth-only").tenant, auth);
        // A shared anonymous scope keeps reading `Authorization` alone.
        assert_eq!(s.policy_for("/open").tenant, auth);
        // Named on the route, the two headers are read as any list is.
        assert!(matches!(
            s.policy_for("/both-named").tenant,
            TenantSource::Headers(_)
        ));
        // The same request on a default route and on `tenant_headers = ["Authorization"]`
        // is one tenant: records made before `X-Api-Key` was read still match.
        let mut h = hyper::HeaderMap::new();
        h.insert("authorization", "Bearer abc".parse().unwrap());
        let default = s.tenant(&h, None, s.policy_for("/pay")).unwrap();
        assert!(default.is_some());
        assert_eq!(
            default,
            s.tenant(&h, None, s.policy_for("/auth-only")).unwrap()
        );
        h.insert("x-api-key", "k1".parse().unwrap());
        assert_ne!(default, s.tenant(&h, None, s.policy_for("/pay")).unwrap());
    }

    #[test]
    fn path_parameters_and_format_suffixes_are_routed_then_refused_or_folded() {
        let s = settings(
            r#"
            [[routes]]
            path = "/v1/transfers"
            [[routes]]
            path = "/v1/payees"
            path_params = "strip"
            format_suffixes = [".json", ".XML"]
            [[routes]]
            path = "/v1"
            methods = []
            [[routes]]
            path = "/IIS/Pay"
            case_insensitive_paths = true
            format_suffixes = [".JSON"]
            "#,
        )
        .unwrap();
        // Refused where the route does not accept them, after routing as if absent: never
        // the shorter, unprotected `/v1`.
        for p in ["/v1/transfers;jsessionid=A", "/v1;v=2/transfers"] {
            let r = s.route(p).unwrap();
            assert_eq!(r.policy.route.as_deref(), Some("/v1/transfers"), "{p}");
            assert_eq!(r.refused, Some(PathError::PathParams), "{p}");
        }
        let r = s.route("/v1/transfers.json").unwrap();
        assert_eq!(r.policy.route.as_deref(), Some("/v1/transfers"));
        assert!(matches!(r.refused, Some(PathError::FormatSuffix(e)) if e.as_str() == "json"));
        // Not a format suffix: another path under `/v1`.
        let r = s.route("/v1/transfers.toolong").unwrap();
        assert_eq!(r.policy.route.as_deref(), Some("/v1"));
        assert_eq!(r.refused, None);
        // Stripped: the scope leaves them out, the upstream gets them as sent.
        let r = s.route("/v1//payees;jsessionid=A/7").unwrap();
        assert_eq!(r.policy.route.as_deref(), Some("/v1/payees"));
        assert_eq!(r.refused, None);
        assert_eq!(r.normalized.as_deref(), Some("/v1/payees/7"));
        assert_eq!(r.forward, Forward::Path("/v1/payees;jsessionid=A/7".into()));
        // A listed suffix is the route's own path.
        let r = s.route("/v1/payees.json").unwrap();
        assert_eq!(r.refused, None);
        assert_eq!(r.normalized.as_deref(), Some("/v1/payees"));
        assert_eq!(r.forward, Forward::AsSent);
        let r = s.route("/v1/payees.XML").unwrap();
        assert_eq!(r.normalized.as_deref(), Some("/v1/payees"));
        assert!(s.route("/v1/payees.csv").unwrap().refused.is_some());
        // Case-insensitive: suffixes compared in lower case, trailing dots folded.
        let r = s.route("/iis/pay.Json").unwrap();
        assert_eq!(r.policy.route.as_deref(), Some("/IIS/Pay"));
        assert_eq!(r.refused, None);
        assert_eq!(r.normalized.as_deref(), Some("/iis/pay"));
        assert_eq!(r.forward, Forward::AsSent);
        let r = s.route("/IIS/Pay.").unwrap();
        assert_eq!(r.normalized.as_deref(), Some("/iis/pay"));
        assert_eq!(r.forward, Forward::Path("/IIS/Pay".into()));
        assert!(settings("[defaults]\nformat_suffixes = [\"json\"]").is_err());
        assert!(settings("[defaults]\nformat_suffixes = [\".toolong\"]").is_err());
        assert!(settings("[defaults]\npath_params = \"keep\"").is_err());
    }

    #[test]
    fn a_trailing_dot_or_space_never_falls_through_to_a_shorter_route() {
        let s = settings(
            r#"
            [[routes]]
            path = "/v1/transfers"
            [[routes]]
            path = "/v1"
            methods = []
            "#,
        )
        .unwrap();
        for p in [
            "/v1/transfers.",
            "/v1/transfers..",
            "/v1/transfers%20",
            "/v1/transfers.%20",
            "/v1/transfers./7",
            "/v1%20/transfers",
            "/v1/transfers%2e",
        ] {
            let r = s.route(p).unwrap();
            assert_eq!(r.policy.route.as_deref(), Some("/v1/transfers"), "{p}");
            assert_eq!(r.refused, Some(PathError::TrailingSpelling), "{p}");
        }
        // Off the defaults too, and only where the longer route is what it would be.
        let only = settings("[[routes]]\npath = \"/v1/transfers\"").unwrap();
        assert_eq!(
            only.route("/v1/transfers.").unwrap().refused,
            Some(PathError::TrailingSpelling)
        );
        for p in ["/v1/transfers/7.", "/v1/other.", "/v1/transfersx."] {
            let r = s.route(p).unwrap();
            assert_eq!(r.refused, None, "{p}");
        }
        assert_eq!(
            s.route("/v1/transfers/7.").unwrap().policy.route.as_deref(),
            Some("/v1/transfers")
        );
    }
}
