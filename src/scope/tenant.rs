//! The tenant of a request: the principal whose records these are.
//!
//! Four sources, chosen per route:
//!
//! - [`TenantSource::Credentials`] (a route with no tenant setting: `tenant_headers` at its
//!   built-in `["Authorization", "X-Api-Key"]`): the raw credential an API authenticates
//!   with, in `Authorization`, `X-Api-Key` or both. A request with `Authorization` alone
//!   hashes exactly as `tenant_headers = ["Authorization"]` does, so records made before
//!   `X-Api-Key` was read still match.
//! - [`TenantSource::Headers`] (`tenant_headers`): the values of headers. With a trusted
//!   header that a gateway sets (`X-Account-Id`), that is the principal. With
//!   `Authorization` it is the raw credential: the scheme is compared case-insensitively
//!   (`bearer x` and `Bearer x` are one tenant), but a refreshed token is another tenant, so
//!   a retry made with a new token is a new operation.
//! - [`TenantSource::JwtClaim`] (`tenant_jwt_claim`): a claim of the bearer token, which must
//!   pass verification; a token that does not never reaches a record. The principal is
//!   (the key that verified it, its `iss`, the claim's JSON value): see [`super::jwt`].
//! - [`TenantSource::ClientCert`] (`tenant_client_cert`): the verified client certificate
//!   of the TLS connection, with the CA that verified it: see [`super::client_cert`].
//!
//! Whichever the source, [`qualify`] adds the values of the route's
//! `tenant_qualifier_headers` (on-behalf-of headers) to the principal.
//!
//! A request from which no tenant can be read resolves to `None`; the proxy refuses it
//! unless its route shares one anonymous scope (`anonymous = "shared"`).

use std::borrow::Cow;

use hyper::header::{HeaderMap, HeaderName, AUTHORIZATION, COOKIE};
use sha2::{Digest, Sha256};

use super::client_cert::{CertField, ClientCert};
use super::jwt::{JwtError, JwtVerifier};

/// Where a route reads its tenant from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TenantSource {
    /// The credential in `Authorization` and `X-Api-Key`: either alone, or both as one
    /// tenant made of the two.
    Credentials,
    /// The values of these headers (absent headers and empty values do not count).
    Headers(Vec<HeaderName>),
    /// This claim of a verified `Authorization: Bearer` JWT.
    JwtClaim(String),
    /// This field of the connection's verified client certificate.
    ClientCert(CertField),
}

/// A resolved tenant: a hash of the principal (credentials only ever exist as a hash, and
/// the record id keys that hash again under the store's secret).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Tenant([u8; 32]);

impl Tenant {
    /// The one tenant of every request on a route with `anonymous = "shared"`.
    pub fn anonymous() -> Tenant {
        // Hashed once: every request on a shared anonymous route asks for it.
        static ANONYMOUS: std::sync::LazyLock<Tenant> = std::sync::LazyLock::new(|| {
            Tenant(Sha256::digest(b"idemgate-tenant\x00\x02anonymous").into())
        });
        *ANONYMOUS
    }

    /// The hash's bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl std::fmt::Debug for Tenant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tenant(..)")
    }
}

/// Why a request's tenant could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TenantError {
    /// The bearer token failed verification.
    #[error("the bearer token was refused: {0}")]
    InvalidToken(#[from] JwtError),
    /// `tenant_jwt_claim` is set but idemgate has no keys to verify tokens with (a
    /// configuration that validation refuses; kept as an error rather than a panic).
    #[error("no JWT keys are configured")]
    NoKeys,
    /// The client certificate names no tenant the route can read.
    #[error("{0}")]
    Certificate(String),
}

fn part(h: &mut Sha256, b: &[u8]) {
    h.update((b.len() as u64).to_be_bytes());
    h.update(b);
}

/// Trims optional whitespace (RFC 9110 OWS) from both ends.
fn trim(mut b: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = b {
        b = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = b {
        b = rest;
    }
    b
}

/// Resolves the tenant of a request. `Ok(None)`: the request carries no tenant.
pub fn resolve(
    headers: &HeaderMap,
    cert: Option<&ClientCert>,
    source: &TenantSource,
    jwt: Option<&JwtVerifier>,
) -> Result<Option<Tenant>, TenantError> {
    match source {
        TenantSource::Credentials => Ok(credentials(headers)),
        TenantSource::Headers(names) => Ok(from_headers(headers, names)),
        TenantSource::ClientCert(field) => match cert {
            None => Ok(None),
            Some(cert) => cert
                .principal(*field)
                .map(|p| Some(Tenant(p)))
                .map_err(TenantError::Certificate),
        },
        TenantSource::JwtClaim(claim) => {
            let Some(token) = bearer_token(headers) else {
                return Ok(None);
            };
            let verifier = jwt.ok_or(TenantError::NoKeys)?;
            // (key source, issuer, the claim's JSON value), hashed by the verifier.
            Ok(verifier.principal(token, claim)?.map(Tenant))
        }
    }
}

/// The tenant that an unprotected (pass-through) request counts against, for its share of
/// the pass-through slots: as [`resolve`], except that a bearer token is not verified (a
/// signature check on every read would cost more than the read), so each distinct token
/// counts as a tenant of its own, as raw credentials do. `None`: no tenant (a request
/// without a credential, or whose certificate names none), counted per connection only.
pub fn unverified(
    headers: &HeaderMap,
    cert: Option<&ClientCert>,
    source: &TenantSource,
) -> Option<Tenant> {
    match source {
        TenantSource::Credentials
            if !headers.contains_key(AUTHORIZATION) && !headers.contains_key(X_API_KEY) =>
        {
            None
        }
        TenantSource::Credentials => credentials(headers),
        // Most reads carry none of the headers: nothing to hash (every pass-through asks).
        TenantSource::Headers(names) if !names.iter().any(|n| headers.contains_key(n)) => None,
        TenantSource::Headers(names) => from_headers(headers, names),
        TenantSource::JwtClaim(_) if !headers.contains_key(AUTHORIZATION) => None,
        TenantSource::JwtClaim(_) => from_headers(headers, &[AUTHORIZATION]),
        TenantSource::ClientCert(field) => cert?.principal(*field).ok().map(Tenant),
    }
}

/// The principal refined by the values of `qualifiers` (`tenant_qualifier_headers`): a
/// platform acting for several sellers with one credential names the seller in a header,
/// and each seller is a tenant of its own. Each header counts as its values, so two values
/// are two tenants and an absent header is one more; no qualifiers leave the principal as
/// it is.
pub fn qualify(principal: Tenant, headers: &HeaderMap, qualifiers: &[HeaderName]) -> Tenant {
    if qualifiers.is_empty() {
        return principal;
    }
    let mut h = Sha256::new();
    h.update(b"idemgate-tenant\x00\x02qualified");
    h.update(principal.as_bytes());
    for name in qualifiers {
        part(&mut h, name.as_str().as_bytes());
        let value = field_value(headers, name);
        h.update((value.is_some() as u64).to_be_bytes());
        if let Some(v) = value {
            part(&mut h, &v);
        }
    }
    Tenant(h.finalize().into())
}

/// `X-Api-Key`, where many APIs (Adyen, API gateways) take their key.
pub const X_API_KEY: HeaderName = HeaderName::from_static("x-api-key");

/// [`TenantSource::Credentials`]: a request without an `X-Api-Key` value is the tenant of
/// `tenant_headers = ["Authorization"]`, byte for byte (the tenant of every default route
/// before `X-Api-Key` was read); one with it is the tenant of both headers, in that order.
fn credentials(headers: &HeaderMap) -> Option<Tenant> {
    let keyed = headers
        .get_all(X_API_KEY)
        .iter()
        .any(|v| !trim(v.as_bytes()).is_empty());
    if keyed {
        from_headers(headers, &[AUTHORIZATION, X_API_KEY])
    } else {
        from_headers(headers, &[AUTHORIZATION])
    }
}

/// The one value of header `name` however its field lines arrived: `Cookie`'s lines joined
/// with "; " (HTTP/2 clients send one field per cookie, RFC 9113 8.2.3), any other
/// header's with ", " (RFC 9110 5.3), each trimmed, empty ones left out. A header that
/// arrives as one line is that line, trimmed. `None`: absent, or only empty lines.
pub fn field_value<'h>(headers: &'h HeaderMap, name: &HeaderName) -> Option<Cow<'h, [u8]>> {
    let mut lines = headers
        .get_all(name)
        .iter()
        .map(|v| trim(v.as_bytes()))
        .filter(|v| !v.is_empty());
    let first = lines.next()?;
    let Some(second) = lines.next() else {
        return Some(Cow::Borrowed(first));
    };
    let separator: &[u8] = if *name == COOKIE { b"; " } else { b", " };
    let mut joined = first.to_vec();
    for line in std::iter::once(second).chain(lines) {
        joined.extend_from_slice(separator);
        joined.extend_from_slice(line);
    }
    Some(Cow::Owned(joined))
}

fn from_headers(headers: &HeaderMap, names: &[HeaderName]) -> Option<Tenant> {
    let mut h = Sha256::new();
    h.update(b"idemgate-tenant\x00\x02headers");
    let mut any = false;
    for name in names {
        part(&mut h, name.as_str().as_bytes());
        // A count of values, then each: one field value, or none. (A header in one line
        // hashes as it always has; split or repeated lines are that one value too.)
        let value = field_value(headers, name);
        h.update((value.is_some() as u64).to_be_bytes());
        if let Some(v) = value {
            let v = &*v;
            any = true;
            if *name == AUTHORIZATION {
                // `<scheme> <credentials>`: the scheme is case-insensitive (RFC 9110
                // 11.1), the credentials are not.
                let (scheme, rest) = match v.iter().position(|b| *b == b' ' || *b == b'\t') {
                    Some(i) => (&v[..i], trim(&v[i..])),
                    None => (v, &[][..]),
                };
                part(&mut h, &scheme.to_ascii_lowercase());
                part(&mut h, rest);
            } else {
                part(&mut h, v);
            }
        }
    }
    any.then(|| Tenant(h.finalize().into()))
}

/// The token of `Authorization: Bearer <token>` (scheme in any case), if there is exactly
/// one such header.
pub fn bearer_token(headers: &HeaderMap) -> Option<&str> {
    let mut values = headers.get_all(AUTHORIZATION).iter();
    let value = values.next()?;
    if values.next().is_some() {
        return None;
    }
    let v = value.to_str().ok()?.trim();
    let (scheme, token) = v.split_once([' ', '\t'])?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::header::HeaderValue;

    fn tenant_of(pairs: &[(&'static str, &str)], names: &[&'static str]) -> Option<Tenant> {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.append(*n, HeaderValue::from_str(v).expect("value"));
        }
        let names = names.iter().map(|n| HeaderName::from_static(n)).collect();
        resolve(&h, None, &TenantSource::Headers(names), None).expect("headers never fail")
    }

    #[test]
    fn the_auth_scheme_is_case_insensitive_and_the_credential_is_not() {
        let auth = ["authorization"];
        let a = tenant_of(&[("authorization", "Bearer NEW")], &auth);
        assert!(a.is_some());
        assert_eq!(a, tenant_of(&[("authorization", "bearer NEW")], &auth));
        assert_eq!(a, tenant_of(&[("authorization", "BEARER   NEW ")], &auth));
        assert_ne!(a, tenant_of(&[("authorization", "Bearer new")], &auth));
        assert_ne!(a, tenant_of(&[("authorization", "Bearer OLD")], &auth));
    }

    #[test]
    fn a_pass_through_tenant_is_the_credential_unverified() {
        let mut h = HeaderMap::new();
        h.insert(AUTHORIZATION, HeaderValue::from_static("Bearer not.a.jwt"));
        let auth = TenantSource::Headers(vec![AUTHORIZATION]);
        let jwt = TenantSource::JwtClaim("sub".into());
        let raw = unverified(&h, None, &auth);
        assert!(raw.is_some());
        // No verifier, no verification: the token's bytes name the tenant.
        assert_eq!(unverified(&h, None, &jwt), raw);
        h.insert(AUTHORIZATION, HeaderValue::from_static("Bearer other"));
        assert_ne!(unverified(&h, None, &jwt), raw);
        assert_eq!(unverified(&HeaderMap::new(), None, &jwt), None);
        let cert = TenantSource::ClientCert(CertField::Subject);
        assert_eq!(unverified(&h, None, &cert), None);
    }

    #[test]
    fn no_header_or_an_empty_one_is_no_tenant() {
        let auth = ["authorization"];
        assert_eq!(tenant_of(&[], &auth), None);
        assert_eq!(tenant_of(&[("authorization", "")], &auth), None);
        assert_eq!(tenant_of(&[("x-api-key", "k")], &auth), None);
        assert_eq!(tenant_of(&[("x-api-key", "k")], &[]), None);
    }

    #[test]
    fn header_tenants_are_told_apart_by_name_and_value() {
        let names = ["x-api-key", "x-account-id"];
        let a = tenant_of(&[("x-api-key", "m1")], &names);
        assert!(a.is_some());
        assert_ne!(a, tenant_of(&[("x-api-key", "m2")], &names));
        assert_ne!(a, tenant_of(&[("x-account-id", "m1")], &names));
        assert_ne!(a, Some(Tenant::anonymous()));
        // The scheme rule is for Authorization only.
        assert_ne!(
            tenant_of(&[("x-api-key", "Key A")], &names),
            tenant_of(&[("x-api-key", "key A")], &names)
        );
    }

    fn credentials_of(pairs: &[(&'static str, &str)]) -> Option<Tenant> {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.append(*n, HeaderValue::from_str(v).expect("value"));
        }
        let t = resolve(&h, None, &TenantSource::Credentials, None).expect("never fails");
        assert_eq!(unverified(&h, None, &TenantSource::Credentials), t);
        t
    }

    #[test]
    fn an_authorization_alone_keeps_the_tenant_it_had_before_api_keys_were_read() {
        // The bytes every version before `X-Api-Key` was read computed for
        // `Authorization: Bearer abc`: records made then must still be found.
        let pinned = "32d7323278e38d64b658079085efe509dd006393be2919d403d5426ad0f5c763";
        let auth = credentials_of(&[("authorization", "Bearer abc")]).expect("a tenant");
        assert_eq!(crate::key::to_hex(auth.as_bytes()), pinned);
        assert_eq!(
            Some(auth),
            tenant_of(&[("authorization", "Bearer abc")], &["authorization"])
        );
        // An empty key is no key.
        assert_eq!(
            Some(auth),
            credentials_of(&[("authorization", "Bearer abc"), ("x-api-key", " ")])
        );
    }

    #[test]
    fn an_api_key_alone_or_beside_authorization_is_a_tenant_of_its_own() {
        let key = credentials_of(&[("x-api-key", "k1")]).expect("a key alone is a tenant");
        let auth = credentials_of(&[("authorization", "Bearer abc")]);
        let both = credentials_of(&[("authorization", "Bearer abc"), ("x-api-key", "k1")]);
        assert!(both.is_some());
        assert_ne!(Some(key), auth);
        assert_ne!(both, auth);
        assert_ne!(both, Some(key));
        assert_ne!(Some(key), credentials_of(&[("x-api-key", "k2")]));
        // The value is raw: no scheme rule for a key.
        assert_ne!(Some(key), credentials_of(&[("x-api-key", "K1")]));
        assert_eq!(credentials_of(&[]), None);
        assert_eq!(credentials_of(&[("x-api-key", "")]), None);
    }

    #[test]
    fn qualifiers_tell_apart_what_one_principal_does_for_others() {
        let principal = tenant_of(&[("authorization", "Bearer t")], &["authorization"]).unwrap();
        let names = [HeaderName::from_static("paypal-auth-assertion")];
        let with = |pairs: &[(&'static str, &str)]| {
            let mut h = HeaderMap::new();
            for (n, v) in pairs {
                h.append(*n, HeaderValue::from_str(v).expect("value"));
            }
            qualify(principal, &h, &names)
        };
        let a = with(&[("paypal-auth-assertion", "seller-a")]);
        assert_eq!(a, with(&[("paypal-auth-assertion", "seller-a")]));
        assert_ne!(a, with(&[("paypal-auth-assertion", "seller-b")]));
        assert_ne!(a, principal);
        // An absent header is a value of its own, and not an empty one's.
        let absent = with(&[]);
        assert_ne!(absent, a);
        assert_ne!(absent, principal);
        // No qualifiers: the principal as it was.
        assert_eq!(qualify(principal, &HeaderMap::new(), &[]), principal);
    }

    #[test]
    fn split_lines_are_one_value_and_one_line_is_read_as_ever() {
        let cookie = ["cookie"];
        let one = tenant_of(&[("cookie", "a=1; b=2")], &cookie);
        assert!(one.is_some());
        assert_eq!(
            one,
            tenant_of(&[("cookie", "a=1"), ("cookie", " b=2")], &cookie)
        );
        let names = ["x-account-id"];
        assert_eq!(
            tenant_of(&[("x-account-id", "a, b")], &names),
            tenant_of(&[("x-account-id", "a"), ("x-account-id", "b")], &names)
        );
        // One line hashes as a count of one and its trimmed bytes, as before.
        let mut h = Sha256::new();
        h.update(b"idemgate-tenant\x00\x02headers");
        part(&mut h, b"cookie");
        h.update(1u64.to_be_bytes());
        part(&mut h, b"a=1; b=2");
        assert_eq!(one, Some(Tenant(h.finalize().into())));
    }

    #[test]
    fn bearer_tokens_are_read_in_any_scheme_case() {
        let mut h = HeaderMap::new();
        h.insert(AUTHORIZATION, HeaderValue::from_static("bEaReR  abc "));
        assert_eq!(bearer_token(&h), Some("abc"));
        h.insert(AUTHORIZATION, HeaderValue::from_static("Basic abc"));
        assert_eq!(bearer_token(&h), None);
        h.insert(AUTHORIZATION, HeaderValue::from_static("Bearer"));
        assert_eq!(bearer_token(&h), None);
    }
}
