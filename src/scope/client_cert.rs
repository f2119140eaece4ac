//! Tenants from verified client certificates (`tenant_client_cert`).
//!
//! On a route with `tenant_client_cert`, the tenant is the identity in the certificate that
//! the client presented on idemgate's TLS listener and that rustls verified against
//! `tls_client_ca_file`: its one URI SAN (`san_uri`, e.g. a SPIFFE ID) or its subject as
//! RFC 4514 text (`subject`). The principal is (the CA that verified it, that identity):
//! the CA is the certificate in `tls_client_ca_file` under which the chain verifies, by the
//! SHA-256 of its DER, so two CAs in one bundle that both issue `spiffe://pay/merchant-1`
//! name two tenants, never one.
//!
//! Which CA that is, rustls does not say; idemgate keeps one verifier per CA of the bundle
//! and asks them in the bundle's order (the first that verifies the chain wins, so a chain
//! that two of them accept, cross-signed, has one stable answer). That costs one chain
//! verification per CA, once per connection, and only when a route reads the tenant from
//! the certificate.

use std::sync::Arc;

use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::danger::ClientCertVerifier;
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Which part of the client certificate names the tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CertField {
    /// The certificate's one URI subject alternative name (a SPIFFE ID, for example).
    SanUri,
    /// The certificate's subject, as RFC 4514 text (`CN=merchant-1,O=Pay`).
    Subject,
}

impl CertField {
    fn as_str(self) -> &'static str {
        match self {
            CertField::SanUri => "san_uri",
            CertField::Subject => "subject",
        }
    }
}

/// What a verified client certificate says, read once per connection.
#[derive(Clone, PartialEq, Eq)]
pub struct ClientCert {
    /// SHA-256 of the DER of the CA (in `tls_client_ca_file`) that verified the chain.
    ca: [u8; 32],
    /// The URI subject alternative names, in order.
    san_uris: Vec<String>,
    /// The subject, RFC 4514.
    subject: String,
}

impl std::fmt::Debug for ClientCert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientCert")
            .field("ca", &hex::encode(&self.ca[..8]))
            .field("san_uris", &self.san_uris)
            .field("subject", &self.subject)
            .finish()
    }
}

impl ClientCert {
    /// The principal that `field` names, hashed with the CA, or why there is none.
    pub fn principal(&self, field: CertField) -> Result<[u8; 32], String> {
        let value = match field {
            CertField::SanUri => match self.san_uris.as_slice() {
                [one] => one.as_str(),
                [] => return Err("the client certificate has no URI subject alternative name; this route reads the tenant from exactly one".into()),
                more => return Err(format!("the client certificate has {} URI subject alternative names; this route reads the tenant from exactly one", more.len())),
            },
            CertField::Subject if self.subject.is_empty() => {
                return Err("the client certificate's subject is empty".into())
            }
            CertField::Subject => self.subject.as_str(),
        };
        let mut h = Sha256::new();
        h.update(b"idemgate-tenant\x00\x02client-cert");
        for part in [&self.ca[..], field.as_str().as_bytes(), value.as_bytes()] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part);
        }
        Ok(h.finalize().into())
    }
}

/// The CAs of `tls_client_ca_file`, each with a verifier of its own.
pub struct Authorities {
    cas: Vec<([u8; 32], Arc<dyn ClientCertVerifier>)>,
}

impl std::fmt::Debug for Authorities {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Authorities({} CAs)", self.cas.len())
    }
}

impl Authorities {
    /// One verifier per certificate of `cas` (the parsed `tls_client_ca_file`).
    pub fn new(
        cas: &[CertificateDer<'static>],
        provider: Arc<rustls::crypto::CryptoProvider>,
    ) -> Result<Authorities, String> {
        let mut out = Vec::with_capacity(cas.len());
        for ca in cas {
            let mut roots = RootCertStore::empty();
            roots
                .add(ca.clone())
                .map_err(|e| format!("a CA certificate cannot be used: {e}"))?;
            let verifier =
                WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                    .build()
                    .map_err(|e| e.to_string())?;
            out.push((Sha256::digest(ca.as_ref()).into(), verifier));
        }
        Ok(Authorities { cas: out })
    }

    /// What `chain` (leaf first, as the client sent it) says, with the CA that verifies
    /// it; an error when none does or the leaf cannot be read.
    pub fn identify(&self, chain: &[CertificateDer<'_>]) -> Result<ClientCert, String> {
        let (leaf, intermediates) = chain
            .split_first()
            .ok_or_else(|| "no client certificate".to_string())?;
        let now = UnixTime::now();
        let ca = self
            .cas
            .iter()
            .find(|(_, v)| v.verify_client_cert(leaf, intermediates, now).is_ok())
            .map(|(ca, _)| *ca)
            .ok_or_else(|| {
                "no CA of tls_client_ca_file verifies the client certificate".to_string()
            })?;
        let (san_uris, subject) = read_leaf(leaf.as_ref())?;
        Ok(ClientCert {
            ca,
            san_uris,
            subject,
        })
    }
}

/// The URI SANs and the RFC 4514 subject of a certificate.
fn read_leaf(der: &[u8]) -> Result<(Vec<String>, String), String> {
    use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};
    let (_, cert) = X509Certificate::from_der(der)
        .map_err(|e| format!("the client certificate cannot be read: {e}"))?;
    let mut uris = Vec::new();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for name in &san.value.general_names {
            if let GeneralName::URI(uri) = name {
                uris.push((*uri).to_string());
            }
        }
    }
    Ok((uris, rfc4514(cert.subject())))
}

/// RFC 4514 text of a distinguished name: the RDNs last to first, separated by `,`,
/// multi-valued ones joined by `+`; the standard short names (RFC 4514 3), other
/// attributes by their dotted OID with their value's content octets as `#` and hex.
fn rfc4514(name: &x509_parser::x509::X509Name<'_>) -> String {
    let rdns: Vec<String> = name
        .iter_rdn()
        .map(|rdn| {
            rdn.iter()
                .map(|atv| {
                    let oid = atv.attr_type().to_id_string();
                    let short = match oid.as_str() {
                        "2.5.4.3" => Some("CN"),
                        "2.5.4.7" => Some("L"),
                        "2.5.4.8" => Some("ST"),
                        "2.5.4.10" => Some("O"),
                        "2.5.4.11" => Some("OU"),
                        "2.5.4.6" => Some("C"),
                        "2.5.4.9" => Some("STREET"),
                        "0.9.2342.19200300.100.1.25" => Some("DC"),
                        "0.9.2342.19200300.100.1.1" => Some("UID"),
                        _ => None,
                    };
                    match (short, atv.as_str()) {
                        (Some(short), Ok(v)) => format!("{short}={}", escape(v)),
                        (Some(short), Err(_)) => {
                            format!("{short}=#{}", hex::encode(atv.attr_value().data))
                        }
                        (None, _) => format!("{oid}=#{}", hex::encode(atv.attr_value().data)),
                    }
                })
                .collect::<Vec<_>>()
                .join("+")
        })
        .collect();
    rdns.into_iter().rev().collect::<Vec<_>>().join(",")
}

/// RFC 4514 2.4: `"+,;<>\` and NUL anywhere, `#` or a space first, a space last.
fn escape(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    let last = v.chars().count().saturating_sub(1);
    for (i, c) in v.chars().enumerate() {
        match c {
            '"' | '+' | ',' | ';' | '<' | '>' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            '\0' => out.push_str("\\00"),
            '#' if i == 0 => out.push_str("\\#"),
            ' ' if i == 0 || i == last => out.push_str("\\ "),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_escaped_as_rfc_4514_says() {
        assert_eq!(escape("merchant-1"), "merchant-1");
        assert_eq!(escape("Pay, Inc."), "Pay\\, Inc.");
        assert_eq!(escape("#1"), "\\#1");
        assert_eq!(escape(" a "), "\\ a\\ ");
        assert_eq!(escape("a+b;c<d>e\"f\\"), "a\\+b\\;c\\<d\\>e\\\"f\\\\");
    }

    #[test]
    fn a_leaf_is_read_as_its_uris_and_its_subject_last_rdn_first() {
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        p.subject_alt_names = vec![
            rcgen::SanType::DnsName("pay.example".try_into().expect("dns")),
            rcgen::SanType::URI("spiffe://pay/m1".try_into().expect("uri")),
        ];
        p.distinguished_name = rcgen::DistinguishedName::new();
        p.distinguished_name.push(rcgen::DnType::CommonName, "m1");
        p.distinguished_name
            .push(rcgen::DnType::OrganizationName, "Pay, Inc.");
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = p.self_signed(&key).expect("cert");
        let (uris, subject) = read_leaf(cert.der()).expect("read");
        assert_eq!(uris, ["spiffe://pay/m1"]);
        assert_eq!(subject, "O=Pay\\, Inc.,CN=m1");
    }

    fn cert(ca: u8, uris: &[&str], subject: &str) -> ClientCert {
        ClientCert {
            ca: [ca; 32],
            san_uris: uris.iter().map(|u| u.to_string()).collect(),
            subject: subject.into(),
        }
    }

    #[test]
    fn the_principal_is_the_ca_with_the_identity() {
        let a = cert(1, &["spiffe://pay/m1"], "CN=m1");
        let same = cert(1, &["spiffe://pay/m1"], "CN=other");
        let other_ca = cert(2, &["spiffe://pay/m1"], "CN=m1");
        let p = |c: &ClientCert, f| c.principal(f).unwrap();
        assert_eq!(p(&a, CertField::SanUri), p(&same, CertField::SanUri));
        assert_ne!(p(&a, CertField::SanUri), p(&other_ca, CertField::SanUri));
        assert_ne!(p(&a, CertField::Subject), p(&same, CertField::Subject));
        assert_ne!(p(&a, CertField::Subject), p(&other_ca, CertField::Subject));
        // The field is part of it: a subject that reads like a URI is another principal.
        let uri_subject = cert(1, &["spiffe://pay/m1"], "spiffe://pay/m1");
        assert_ne!(
            p(&a, CertField::SanUri),
            p(&uri_subject, CertField::Subject)
        );
    }

    #[test]
    fn san_uri_needs_exactly_one() {
        assert!(cert(1, &[], "CN=a").principal(CertField::SanUri).is_err());
        let two = cert(1, &["spiffe://a", "spiffe://b"], "CN=a");
        let e = two.principal(CertField::SanUri).unwrap_err();
        assert!(e.contains("2 URI"), "{e}");
        assert!(cert(1, &[], "").principal(CertField::Subject).is_err());
    }
}
