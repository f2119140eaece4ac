//! Verifying the bearer tokens whose claim names the tenant (`tenant_jwt_claim`).
//!
//! Keys: an HS256 secret (`jwt_hs256_secret`) and/or RS256 and ES256 public keys from a JWKS
//! file (`jwks_file`). The algorithm a token may use is decided by the keys configured, never
//! by the token alone: an HS256 token is checked only against the secret, an RS256 or ES256
//! one only against JWKS keys of that algorithm (and of its `kid`, when it names one), so a
//! public key can never be used as an HMAC secret. `exp` is required and checked (60 s of
//! leeway for clock skew), `nbf` when present, `aud` when `jwt_audience` is set. A token
//! with a `crit` header is refused: idemgate understands no critical extension.
//!
//! The principal is (key source, issuer, claim): the key that verified the token (the HS256
//! secret, or one JWKS key by its RFC 7638 thumbprint), its `iss` and the claim's JSON value
//! (`42` and `"42"` are two principals). Whoever holds one key can sign any `iss` and `sub`,
//! so a principal is never shared between keys: a token signed with the HS256 secret cannot
//! speak for a user of the identity provider whose keys are in the JWKS. With more than one
//! key source, a token without `iss` is refused.
//!
//! Verified tokens are kept (`jwt_cache_entries`, until their `exp`), looked up by the whole
//! token string, so that the retry of a client with the same token costs a map lookup, not
//! a signature check.

use std::collections::HashMap;
use std::sync::Mutex;

use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, JwkSet, ThumbprintHash};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use sha2::{Digest, Sha256};

/// Tokens longer than this are verified every time, never kept: the cache holds at most
/// `jwt_cache_entries` times this many bytes of tokens.
pub const CACHE_MAX_TOKEN_BYTES: usize = 4096;

/// Why a token was refused. The text never contains the token.
#[derive(Debug, thiserror::Error)]
pub enum JwtError {
    /// Not a JWT, a bad signature, expired, not yet valid, another audience, a `crit`
    /// header, or no `iss` where one is required.
    #[error("{0}")]
    Invalid(String),
    /// The token's algorithm or key id matches no configured key.
    #[error("no configured key verifies {0} tokens{1}")]
    NoKey(String, String),
    /// The claim is there but is neither a string nor a number.
    #[error("the `{0}` claim is not a string or a number")]
    ClaimType(String),
}

struct PublicKey {
    kid: Option<String>,
    alg: Algorithm,
    key: DecodingKey,
    // `jwk:<RFC 7638 SHA-256 thumbprint>`.
    source: String,
}

/// The source label of the HS256 secret.
const HS256_SOURCE: &str = "hs256";

/// A verified token, as kept: which key verified it, its `iss` (JSON text) and its claims.
struct Verified {
    source: usize,
    iss: Option<String>,
    claims: serde_json::Map<String, serde_json::Value>,
    exp: u64,
}

/// A kept token: what was verified, and the principals already computed from it, per claim
/// name (a hit then costs no hashing).
struct Entry {
    verified: Verified,
    principals: Vec<(Box<str>, Option<[u8; 32]>)>,
}

struct Cache {
    capacity: usize,
    entries: HashMap<Box<str>, Entry>,
    // No sweep of expired entries before this (seconds since the epoch): a full cache of
    // live tokens is not scanned on every new one.
    next_sweep: u64,
}

/// The keys that bearer tokens are verified with.
pub struct JwtVerifier {
    hs256: Option<DecodingKey>,
    public: Vec<PublicKey>,
    audience: Option<Vec<String>>,
    cache: Option<Mutex<Cache>>,
}

impl std::fmt::Debug for JwtVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JwtVerifier")
            .field("hs256", &self.hs256.is_some())
            .field("public_keys", &self.public.len())
            .field("audience", &self.audience)
            .finish()
    }
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn part(h: &mut Sha256, b: &[u8]) {
    h.update((b.len() as u64).to_be_bytes());
    h.update(b);
}

impl JwtVerifier {
    /// Builds a verifier from an HS256 secret and/or the text of a JWKS document. The error
    /// says what is wrong with the JWKS.
    pub fn new(hs256_secret: Option<&[u8]>, jwks: Option<&str>) -> Result<JwtVerifier, String> {
        let mut public = Vec::new();
        if let Some(text) = jwks {
            let set: JwkSet =
                serde_json::from_str(text).map_err(|e| format!("not a JWKS document: {e}"))?;
            for (i, jwk) in set.keys.iter().enumerate() {
                let alg = match (&jwk.algorithm, jwk.common.key_algorithm) {
                    (AlgorithmParameters::RSA(_), None) => Algorithm::RS256,
                    (AlgorithmParameters::EllipticCurve(ec), None)
                        if ec.curve == EllipticCurve::P256 =>
                    {
                        Algorithm::ES256
                    }
                    (_, Some(a)) => a.to_string().parse::<Algorithm>().map_err(|_| {
                        format!("keys[{i}]: {a} is not supported (RS256 and ES256 are)")
                    })?,
                    _ => {
                        return Err(format!(
                            "keys[{i}]: only RS256 and ES256 keys are supported"
                        ))
                    }
                };
                if !matches!(alg, Algorithm::RS256 | Algorithm::ES256) {
                    return Err(format!(
                        "keys[{i}]: {alg:?} is not supported (RS256 and ES256 are)"
                    ));
                }
                let key = DecodingKey::from_jwk(jwk).map_err(|e| format!("keys[{i}]: {e}"))?;
                let source = format!("jwk:{}", jwk.thumbprint(ThumbprintHash::SHA256));
                if public.iter().any(|k: &PublicKey| k.source == source) {
                    return Err(format!("keys[{i}]: the same key is listed twice"));
                }
                public.push(PublicKey {
                    kid: jwk.common.key_id.clone(),
                    alg,
                    key,
                    source,
                });
            }
            if public.is_empty() {
                return Err("the JWKS holds no keys".into());
            }
        }
        Ok(JwtVerifier {
            hs256: hs256_secret.map(DecodingKey::from_secret),
            public,
            audience: None,
            cache: None,
        })
    }

    /// Checks `aud` against these audiences (a token must name one of them).
    pub fn with_audience(mut self, audience: Vec<String>) -> JwtVerifier {
        self.audience = Some(audience);
        self
    }

    /// Keeps up to `entries` verified tokens until their `exp` (0: none).
    pub fn with_cache(mut self, entries: usize) -> JwtVerifier {
        self.cache = (entries > 0).then(|| {
            Mutex::new(Cache {
                capacity: entries,
                entries: HashMap::new(),
                next_sweep: 0,
            })
        });
        self
    }

    /// How many key sources there are (the HS256 secret, each JWKS key).
    fn sources(&self) -> usize {
        usize::from(self.hs256.is_some()) + self.public.len()
    }

    fn source_name(&self, i: usize) -> &str {
        match (self.hs256.is_some(), i) {
            (true, 0) => HS256_SOURCE,
            (true, i) => &self.public[i - 1].source,
            (false, i) => &self.public[i].source,
        }
    }

    /// Verifies `token` and returns the hash of its principal for `claim`: (key source,
    /// `iss`, the claim's JSON value). `Ok(None)` when the token is valid but lacks the
    /// claim (or it is null or an empty string).
    pub fn principal(&self, token: &str, claim: &str) -> Result<Option<[u8; 32]>, JwtError> {
        let at = now();
        if let Some(mut cache) = self.cache.as_ref().and_then(|c| c.lock().ok()) {
            // A map lookup compares the whole token string, not only its hash.
            if let Some(e) = cache.entries.get_mut(token).filter(|e| at < e.verified.exp) {
                if let Some((_, p)) = e.principals.iter().find(|(n, _)| &**n == claim) {
                    return Ok(*p);
                }
                let p = self.principal_of(&e.verified, claim)?;
                e.principals.push((claim.into(), p));
                return Ok(p);
            }
        }
        let verified = self.verify_signed(token)?;
        let p = self.principal_of(&verified, claim)?;
        self.keep(token, verified, claim, p, at);
        Ok(p)
    }

    /// The principal of a verified token for `claim`.
    fn principal_of(&self, verified: &Verified, claim: &str) -> Result<Option<[u8; 32]>, JwtError> {
        let value = match verified.claims.get(claim) {
            None | Some(serde_json::Value::Null) => return Ok(None),
            Some(serde_json::Value::String(s)) if s.is_empty() => return Ok(None),
            Some(v @ (serde_json::Value::String(_) | serde_json::Value::Number(_))) => v,
            Some(_) => return Err(JwtError::ClaimType(claim.to_string())),
        };
        // The JSON text of the value: `42` and `"42"` differ.
        let value = serde_json::to_string(value).unwrap_or_default();
        let mut h = Sha256::new();
        h.update(b"idemgate-tenant\x00\x03jwt");
        part(&mut h, claim.as_bytes());
        part(&mut h, self.source_name(verified.source).as_bytes());
        match &verified.iss {
            Some(iss) => {
                h.update([1]);
                part(&mut h, iss.as_bytes());
            }
            None => h.update([0]),
        }
        part(&mut h, value.as_bytes());
        Ok(Some(h.finalize().into()))
    }

    fn keep(
        &self,
        token: &str,
        verified: Verified,
        claim: &str,
        principal: Option<[u8; 32]>,
        at: u64,
    ) {
        let Some(cache) = &self.cache else { return };
        if token.len() > CACHE_MAX_TOKEN_BYTES || verified.exp <= at {
            return;
        }
        let Ok(mut cache) = cache.lock() else { return };
        if cache.entries.len() >= cache.capacity {
            if at >= cache.next_sweep {
                cache.entries.retain(|_, e| e.verified.exp > at);
                cache.next_sweep = at + 1;
            }
            while cache.entries.len() >= cache.capacity {
                let Some(k) = cache.entries.keys().next().cloned() else {
                    break;
                };
                cache.entries.remove(&k);
            }
        }
        let entry = Entry {
            verified,
            principals: vec![(claim.into(), principal)],
        };
        cache.entries.insert(token.into(), entry);
    }

    /// The signature and claim checks, without the cache.
    fn verify_signed(&self, token: &str) -> Result<Verified, JwtError> {
        let header =
            jsonwebtoken::decode_header(token).map_err(|e| JwtError::Invalid(e.to_string()))?;
        if header.crit.is_some() {
            return Err(JwtError::Invalid(
                "the token has a `crit` header: idemgate understands no critical extension".into(),
            ));
        }
        let alg = header.alg;
        let kid_note = || {
            header
                .kid
                .as_ref()
                .map(|_| " with that key id".to_string())
                .unwrap_or_default()
        };
        let offset = usize::from(self.hs256.is_some());
        let candidates: Vec<(usize, &DecodingKey)> = match alg {
            Algorithm::HS256 => self.hs256.iter().map(|k| (0, k)).collect(),
            Algorithm::RS256 | Algorithm::ES256 => self
                .public
                .iter()
                .enumerate()
                .filter(|(_, k)| k.alg == alg)
                .filter(|(_, k)| match (&header.kid, &k.kid) {
                    (Some(want), Some(have)) => want == have,
                    (Some(_), None) => false,
                    (None, _) => true,
                })
                .map(|(i, k)| (offset + i, &k.key))
                .collect(),
            other => return Err(JwtError::NoKey(format!("{other:?}"), String::new())),
        };
        if candidates.is_empty() {
            return Err(JwtError::NoKey(format!("{alg:?}"), kid_note()));
        }
        let mut validation = Validation::new(alg);
        match &self.audience {
            Some(aud) => {
                validation.set_audience(aud);
                validation.required_spec_claims.insert("aud".into());
            }
            // No audience is configured, so an `aud` in the token is not a reason to refuse
            // it.
            None => validation.validate_aud = false,
        }
        validation.validate_nbf = true;
        let mut last = None;
        for (source, key) in candidates {
            match jsonwebtoken::decode::<serde_json::Map<String, serde_json::Value>>(
                token,
                key,
                &validation,
            ) {
                Ok(data) => {
                    let claims = data.claims;
                    let iss = match claims.get("iss") {
                        None | Some(serde_json::Value::Null) => None,
                        Some(v) => Some(serde_json::to_string(v).unwrap_or_default()),
                    };
                    if iss.is_none() && self.sources() > 1 {
                        return Err(JwtError::Invalid(
                            "the token has no `iss` claim; with more than one key configured, the issuer is part of the principal".into(),
                        ));
                    }
                    // `exp` is required and was checked; as a number of seconds.
                    let exp = claims
                        .get("exp")
                        .and_then(|e| e.as_f64())
                        .map(|e| e.max(0.0) as u64)
                        .unwrap_or(0);
                    return Ok(Verified {
                        source,
                        iss,
                        claims,
                        exp,
                    });
                }
                Err(e) => last = Some(e),
            }
        }
        Err(JwtError::Invalid(
            last.map(|e| e.to_string()).unwrap_or_default(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use jsonwebtoken::{encode, EncodingKey, Header};

    fn now() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0)
    }

    fn hs(secret: &[u8], claims: serde_json::Value) -> String {
        encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &EncodingKey::from_secret(secret),
        )
        .expect("encode")
    }

    #[test]
    fn hs256_tokens_give_their_claim_and_bad_ones_are_refused() {
        let v = JwtVerifier::new(Some(b"s3cret-s3cret-s3cret-s3cret-1234"), None).unwrap();
        let exp = now() + 600;
        let ok = hs(
            b"s3cret-s3cret-s3cret-s3cret-1234",
            serde_json::json!({"sub": "merchant-7", "exp": exp}),
        );
        assert!(v.principal(&ok, "sub").unwrap().is_some());
        let num = hs(
            b"s3cret-s3cret-s3cret-s3cret-1234",
            serde_json::json!({"acct": 42, "exp": exp}),
        );
        assert!(v.principal(&num, "acct").unwrap().is_some());
        let text = hs(
            b"s3cret-s3cret-s3cret-s3cret-1234",
            serde_json::json!({"acct": "42", "exp": exp}),
        );
        assert_ne!(
            v.principal(&num, "acct").unwrap(),
            v.principal(&text, "acct").unwrap(),
            "42 and \"42\" are two principals"
        );
        assert_eq!(v.principal(&ok, "acct").unwrap(), None);
        let forged = hs(
            b"another-secret-another-secret-12",
            serde_json::json!({"sub": "merchant-7", "exp": exp}),
        );
        assert!(matches!(
            v.principal(&forged, "sub"),
            Err(JwtError::Invalid(_))
        ));
        let expired = hs(
            b"s3cret-s3cret-s3cret-s3cret-1234",
            serde_json::json!({"sub": "merchant-7", "exp": now() - 3600}),
        );
        assert!(v.principal(&expired, "sub").is_err());
        let no_exp = hs(
            b"s3cret-s3cret-s3cret-s3cret-1234",
            serde_json::json!({"sub": "merchant-7"}),
        );
        assert!(v.principal(&no_exp, "sub").is_err());
        assert!(v.principal("not.a.token", "sub").is_err());
        let obj = hs(
            b"s3cret-s3cret-s3cret-s3cret-1234",
            serde_json::json!({"acct": {"a": 1}, "exp": exp}),
        );
        assert!(matches!(
            v.principal(&obj, "acct"),
            Err(JwtError::ClaimType(_))
        ));
    }

    #[test]
    fn crit_headers_audiences_and_missing_issuers_are_refused() {
        let secret = b"s3cret-s3cret-s3cret-s3cret-1234";
        let v = JwtVerifier::new(Some(secret), None)
            .unwrap()
            .with_audience(vec!["payments".into()])
            .with_cache(10);
        let exp = now() + 600;
        let mut h = Header::new(Algorithm::HS256);
        h.crit = Some(vec!["exp".into()]);
        let crit = encode(
            &h,
            &serde_json::json!({"sub": "a", "aud": "payments", "exp": exp}),
            &EncodingKey::from_secret(secret),
        )
        .unwrap();
        assert!(matches!(
            v.principal(&crit, "sub"),
            Err(JwtError::Invalid(_))
        ));
        let ok = hs(
            secret,
            serde_json::json!({"sub": "a", "aud": "payments", "exp": exp}),
        );
        assert!(v.principal(&ok, "sub").unwrap().is_some());
        // A hit of the cache gives the same principal.
        assert_eq!(
            v.principal(&ok, "sub").unwrap(),
            v.principal(&ok, "sub").unwrap()
        );
        let other = hs(
            secret,
            serde_json::json!({"sub": "a", "aud": "other", "exp": exp}),
        );
        assert!(v.principal(&other, "sub").is_err());
        let none = hs(secret, serde_json::json!({"sub": "a", "exp": exp}));
        assert!(v.principal(&none, "sub").is_err());
        // The issuer is part of the principal.
        let i1 = hs(
            secret,
            serde_json::json!({"sub": "a", "aud": "payments", "iss": "x", "exp": exp}),
        );
        let i2 = hs(
            secret,
            serde_json::json!({"sub": "a", "aud": "payments", "iss": "y", "exp": exp}),
        );
        assert_ne!(
            v.principal(&i1, "sub").unwrap(),
            v.principal(&i2, "sub").unwrap()
        );
    }

    #[test]
    fn the_cache_is_bounded() {
        let secret = b"s3cret-s3cret-s3cret-s3cret-1234";
        let v = JwtVerifier::new(Some(secret), None).unwrap().with_cache(3);
        let exp = now() + 600;
        for i in 0..10 {
            let t = hs(secret, serde_json::json!({"sub": i, "exp": exp}));
            assert!(v.principal(&t, "sub").unwrap().is_some());
        }
        let len = v.cache.as_ref().unwrap().lock().unwrap().entries.len();
        assert!(len <= 3, "{len}");
    }

    #[test]
    fn an_hs256_token_is_refused_without_a_secret() {
        let v = JwtVerifier::new(None, None).unwrap();
        let t = hs(b"x", serde_json::json!({"sub": "a", "exp": now() + 60}));
        assert!(matches!(v.principal(&t, "sub"), Err(JwtError::NoKey(..))));
    }

    #[test]
    fn bad_jwks_documents_are_refused() {
        assert!(JwtVerifier::new(None, Some("{")).is_err());
        assert!(JwtVerifier::new(None, Some(r#"{"keys":[]}"#)).is_err());
        let oct = r#"{"keys":[{"kty":"oct","k":"c2VjcmV0","alg":"HS256"}]}"#;
        assert!(JwtVerifier::new(None, Some(oct)).is_err());
    }
}
