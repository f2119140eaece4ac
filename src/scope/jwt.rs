//! Verifying the bearer tokens whose claim names the tenant (`tenant_jwt_claim`).
//!
//! Keys: an HS256 secret (`jwt_hs256_secret`) and/or RS256 and ES256 public keys from a JWKS
//! file (`jwks_file`). The algorithm a token may use is decided by the keys configured, never
//! by the token alone: an HS256 token is checked only against the secret, an RS256 or ES256
//! one only against JWKS keys of that algorithm (and of its `kid`, when it names one), so a
//! public key can never be used as an HMAC secret. `exp` is required and checked (60 s of
//! leeway for clock skew), `nbf` when present.

use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, JwkSet};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};

/// Why a token was refused. The text never contains the token.
#[derive(Debug, thiserror::Error)]
pub enum JwtError {
    /// Not a JWT, a bad signature, expired, or not yet valid.
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
}

/// The keys that bearer tokens are verified with.
pub struct JwtVerifier {
    hs256: Option<DecodingKey>,
    public: Vec<PublicKey>,
}

impl std::fmt::Debug for JwtVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JwtVerifier")
            .field("hs256", &self.hs256.is_some())
            .field("public_keys", &self.public.len())
            .finish()
    }
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
                public.push(PublicKey {
                    kid: jwk.common.key_id.clone(),
                    alg,
                    key,
                });
            }
            if public.is_empty() {
                return Err("the JWKS holds no keys".into());
            }
        }
        Ok(JwtVerifier {
            hs256: hs256_secret.map(DecodingKey::from_secret),
            public,
        })
    }

    /// Verifies `token` and returns its `claim` as text; `Ok(None)` when the token is valid
    /// but lacks the claim.
    pub fn verify(&self, token: &str, claim: &str) -> Result<Option<String>, JwtError> {
        let header =
            jsonwebtoken::decode_header(token).map_err(|e| JwtError::Invalid(e.to_string()))?;
        let alg = header.alg;
        let kid_note = || {
            header
                .kid
                .as_ref()
                .map(|_| " with that key id".to_string())
                .unwrap_or_default()
        };
        let candidates: Vec<&DecodingKey> = match alg {
            Algorithm::HS256 => self.hs256.iter().collect(),
            Algorithm::RS256 | Algorithm::ES256 => self
                .public
                .iter()
                .filter(|k| k.alg == alg)
                .filter(|k| match (&header.kid, &k.kid) {
                    (Some(want), Some(have)) => want == have,
                    (Some(_), None) => false,
                    (None, _) => true,
                })
                .map(|k| &k.key)
                .collect(),
            other => return Err(JwtError::NoKey(format!("{other:?}"), String::new())),
        };
        if candidates.is_empty() {
            return Err(JwtError::NoKey(format!("{alg:?}"), kid_note()));
        }
        let mut validation = Validation::new(alg);
        // No audience is configured, so an `aud` in the token is not a reason to refuse it.
        validation.validate_aud = false;
        validation.validate_nbf = true;
        let mut last = None;
        for key in candidates {
            match jsonwebtoken::decode::<serde_json::Map<String, serde_json::Value>>(
                token,
                key,
                &validation,
            ) {
                Ok(data) => {
                    return match data.claims.get(claim) {
                        None | Some(serde_json::Value::Null) => Ok(None),
                        Some(serde_json::Value::String(s)) if s.is_empty() => Ok(None),
                        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
                        Some(serde_json::Value::Number(n)) => Ok(Some(n.to_string())),
                        Some(_) => Err(JwtError::ClaimType(claim.to_string())),
                    }
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
        assert_eq!(v.verify(&ok, "sub").unwrap().as_deref(), Some("merchant-7"));
        let num = hs(
            b"s3cret-s3cret-s3cret-s3cret-1234",
            serde_json::json!({"acct": 42, "exp": exp}),
        );
        assert_eq!(v.verify(&num, "acct").unwrap().as_deref(), Some("42"));
        assert_eq!(v.verify(&ok, "acct").unwrap(), None);
        let forged = hs(
            b"another-secret-another-secret-12",
            serde_json::json!({"sub": "merchant-7", "exp": exp}),
        );
        assert!(matches!(
            v.verify(&forged, "sub"),
            Err(JwtError::Invalid(_))
        ));
        let expired = hs(
            b"s3cret-s3cret-s3cret-s3cret-1234",
            serde_json::json!({"sub": "merchant-7", "exp": now() - 3600}),
        );
        assert!(v.verify(&expired, "sub").is_err());
        let no_exp = hs(
            b"s3cret-s3cret-s3cret-s3cret-1234",
            serde_json::json!({"sub": "merchant-7"}),
        );
        assert!(v.verify(&no_exp, "sub").is_err());
        assert!(v.verify("not.a.token", "sub").is_err());
        let obj = hs(
            b"s3cret-s3cret-s3cret-s3cret-1234",
            serde_json::json!({"acct": {"a": 1}, "exp": exp}),
        );
        assert!(matches!(
            v.verify(&obj, "acct"),
            Err(JwtError::ClaimType(_))
        ));
    }

    #[test]
    fn an_hs256_token_is_refused_without_a_secret() {
        let v = JwtVerifier::new(None, None).unwrap();
        let t = hs(b"x", serde_json::json!({"sub": "a", "exp": now() + 60}));
        assert!(matches!(v.verify(&t, "sub"), Err(JwtError::NoKey(..))));
    }

    #[test]
    fn bad_jwks_documents_are_refused() {
        assert!(JwtVerifier::new(None, Some("{")).is_err());
        assert!(JwtVerifier::new(None, Some(r#"{"keys":[]}"#)).is_err());
        let oct = r#"{"keys":[{"kty":"oct","k":"c2VjcmV0","alg":"HS256"}]}"#;
        assert!(JwtVerifier::new(None, Some(oct)).is_err());
    }
}
