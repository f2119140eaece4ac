//! An identity provider of the tests' own: an RSA key made with `openssl`, published in a
//! JWKS file, that signs RS256 tokens.
#![allow(clippy::unwrap_used)]

use jsonwebtoken::jwk::{Jwk, JwkSet};
use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};

/// `Authorization: Bearer` with an HS256 token of `claims` signed with `secret`.
pub fn hs256_bearer(secret: &str, claims: &serde_json::Value) -> String {
    let t = encode(
        &Header::new(Algorithm::HS256),
        claims,
        &EncodingKey::from_secret(secret.as_bytes()),
    )
    .unwrap();
    format!("Bearer {t}")
}

/// An RSA key in a JWKS file (kid `idp-1`), and its signing key.
pub struct Idp {
    dir: tempfile::TempDir,
    key: EncodingKey,
}

impl Idp {
    pub fn new() -> Idp {
        let dir = tempfile::tempdir().unwrap();
        let pem = dir.path().join("rsa.pem");
        let st = std::process::Command::new("openssl")
            .args([
                "genpkey",
                "-algorithm",
                "RSA",
                "-pkeyopt",
                "rsa_keygen_bits:2048",
            ])
            .arg("-out")
            .arg(&pem)
            .stderr(std::process::Stdio::null())
            .status()
            .unwrap();
        assert!(st.success());
        let key = EncodingKey::from_rsa_pem(&std::fs::read(&pem).unwrap()).unwrap();
        let mut jwk = Jwk::from_encoding_key(&key, Algorithm::RS256).unwrap();
        jwk.common.key_id = Some("idp-1".into());
        let jwks = JwkSet { keys: vec![jwk] };
        std::fs::write(
            dir.path().join("jwks.json"),
            serde_json::to_string(&jwks).unwrap(),
        )
        .unwrap();
        Idp { dir, key }
    }

    pub fn jwks(&self) -> String {
        self.dir.path().join("jwks.json").to_str().unwrap().into()
    }

    pub fn token(&self, claims: serde_json::Value) -> String {
        let mut h = Header::new(Algorithm::RS256);
        h.kid = Some("idp-1".into());
        format!("Bearer {}", encode(&h, &claims, &self.key).unwrap())
    }
}
