//! Who owns a record: (namespace, tenant, method, normalized path, key), turned into a
//! record id by a keyed hash.
//!
//! - [`path`]: the one spelling of a path that route matching, scope and fingerprint use.
//! - [`tenant`]: the principal behind a request (a trusted header, a verified JWT claim, a
//!   verified client certificate, or by default the credential itself).
//! - [`client_cert`]: client certificates' identities, with the CA that verified them.
//! - [`jwt`]: verifying bearer tokens for `tenant_jwt_claim`.
//! - [`method`]: the method the upstream will run (method-override headers, `_method`).
//! - [`template`]: route templates that name their parameters (`/v1/accounts/{id}`).
//!
//! The record id is HMAC-SHA-256 under a [`ScopeSecret`] that every instance on one store
//! shares (the store creates it once and keeps it), so an id shown in a 409, a 422 or a log
//! line cannot be tested offline against a guessed credential, and two stores give the same
//! request two unrelated ids.

use std::fmt;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::key::{IdempotencyKey, RecordId};

pub mod client_cert;
pub mod jwt;
pub mod method;
pub mod path;
pub mod template;
pub mod tenant;

pub use self::path::{PathError, PathRules};
pub use self::tenant::{Tenant, TenantError, TenantSource};

/// The key of the record-id HMAC: 32 random bytes, created once per store.
#[derive(Clone, PartialEq, Eq)]
pub struct ScopeSecret([u8; 32]);

impl ScopeSecret {
    /// A fresh random secret.
    pub fn random() -> ScopeSecret {
        ScopeSecret(rand::random())
    }

    /// The secret as stored (lowercase hex).
    pub fn to_hex(&self) -> String {
        crate::key::to_hex(&self.0)
    }

    /// What a namespace's instances store beside the secret to check that they agree on it
    /// (`scope_verifier:<namespace>`): an HMAC of a constant under it, so the verifier
    /// tells nothing about the secret itself.
    pub fn verifier(&self, namespace: &str) -> String {
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.0)
            .unwrap_or_else(|_| unreachable!("HMAC accepts keys of any length"));
        mac.update(b"idemgate-scope-verifier\x00\x01");
        update_part(&mut mac, namespace.as_bytes());
        crate::key::to_hex(&mac.finalize().into_bytes())
    }

    /// Reads the stored form; `None` unless it is exactly 64 hex digits.
    pub fn from_hex(s: &str) -> Option<ScopeSecret> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).ok()?;
        Some(ScopeSecret(out))
    }
}

impl fmt::Debug for ScopeSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ScopeSecret(..)")
    }
}

/// Computes record ids for one namespace under one store's secret.
#[derive(Clone)]
pub struct Scoper {
    // Keyed once: cloning the keyed state per request skips the two key-block compressions
    // that keying costs.
    mac: Hmac<Sha256>,
    // What it was keyed with: checked against the store while the instance runs.
    secret: ScopeSecret,
}

impl Scoper {
    /// The secret these ids are keyed with.
    pub fn secret(&self) -> &ScopeSecret {
        &self.secret
    }

    /// Record ids of `namespace`, keyed by `secret`.
    pub fn new(secret: &ScopeSecret, namespace: &str) -> Scoper {
        // HMAC takes keys of any length; a 32-byte key cannot be refused.
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&secret.0)
            .unwrap_or_else(|_| unreachable!("HMAC accepts keys of any length"));
        mac.update(b"idemgate-scope\x00\x02");
        update_part(&mut mac, namespace.as_bytes());
        Scoper {
            mac,
            secret: secret.clone(),
        }
    }

    /// The id of the record that a request belongs to. `path` must be normalized
    /// ([`path::normalize`]) and `method` as received (methods are case-sensitive).
    pub fn record_id(
        &self,
        tenant: &Tenant,
        method: &str,
        path: &str,
        key: &IdempotencyKey,
    ) -> RecordId {
        let mut mac = self.mac.clone();
        mac.update(tenant.as_bytes());
        for part in [method.as_bytes(), path.as_bytes(), key.as_str().as_bytes()] {
            update_part(&mut mac, part);
        }
        RecordId::from_bytes(mac.finalize().into_bytes().into())
    }
}

fn update_part(mac: &mut Hmac<Sha256>, part: &[u8]) {
    mac.update(&(part.len() as u64).to_be_bytes());
    mac.update(part);
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::header::{HeaderMap, HeaderName, HeaderValue};

    fn key(k: &str) -> IdempotencyKey {
        let mut h = HeaderMap::new();
        h.insert(
            crate::key::HEADER,
            HeaderValue::from_str(k).expect("test key"),
        );
        crate::key::parse(&h, 255).expect("valid").expect("present")
    }

    fn tenant(auth: &str) -> Tenant {
        let mut h = HeaderMap::new();
        h.insert("authorization", HeaderValue::from_str(auth).expect("value"));
        let source = TenantSource::Headers(vec![HeaderName::from_static("authorization")]);
        tenant::resolve(&h, None, &source, None)
            .expect("resolves")
            .expect("present")
    }

    #[test]
    fn record_ids_separate_every_part_of_the_scope() {
        let secret = ScopeSecret::random();
        let s = Scoper::new(&secret, "payments");
        let (ta, tb) = (tenant("Bearer a"), tenant("Bearer b"));
        let base = s.record_id(&ta, "POST", "/t", &key("k1"));
        assert_eq!(base, s.record_id(&ta, "POST", "/t", &key("k1")));
        for other in [
            s.record_id(&tb, "POST", "/t", &key("k1")),
            s.record_id(&ta, "PATCH", "/t", &key("k1")),
            s.record_id(&ta, "POST", "/u", &key("k1")),
            s.record_id(&ta, "POST", "/t", &key("k2")),
            Scoper::new(&secret, "ledger").record_id(&ta, "POST", "/t", &key("k1")),
            Scoper::new(&ScopeSecret::random(), "payments").record_id(
                &ta,
                "POST",
                "/t",
                &key("k1"),
            ),
        ] {
            assert_ne!(base, other);
        }
        // Length prefixes: moving a character from one part to the next is another id.
        assert_ne!(
            s.record_id(&ta, "POST", "/t", &key("ab")),
            s.record_id(&ta, "POS", "T/t", &key("ab"))
        );
    }

    #[test]
    fn secrets_round_trip_through_their_stored_form() {
        let secret = ScopeSecret::random();
        assert_eq!(
            ScopeSecret::from_hex(&secret.to_hex()),
            Some(secret.clone())
        );
        assert_eq!(ScopeSecret::from_hex("abc"), None);
        assert_eq!(format!("{secret:?}"), "ScopeSecret(..)");
    }
}
