//! Tenants from verified client certificates (`tenant_client_cert`).
//!
//! On a route with `tenant_client_cert`, the tenant is the identity in the certificate that
//! the client presented on idemgate's TLS listener and that rustls verified against
//! `tls_client_ca_file`: its one URI SAN (`san_uri`, e.g. a SPIFFE ID) or its subject as
//! RFC 4514 text (`subject`). The principal is (the CA that issued it, that identity): the
//! CA is a certificate of `tls_client_ca_file`, by the SHA-256 of its DER, so two CAs in one
//! bundle that both issue `spiffe://pay/merchant-1` name two tenants, never one.
//!
//! Which CA that is, rustls does not say. idemgate keeps one verifier per CA of the bundle.
//! The CA of a principal is the bundle's certificate closest to the leaf on a verified path:
//! the one that issued the leaf when the bundle holds it, else the one that issued the
//! nearest intermediate the client sent. So a bundle that holds a root and its intermediate
//! names a leaf of the intermediate by the intermediate, whether the client sends the chain
//! or not, and whatever the bundle's order: one certificate, one tenant.
//!
//! Subject values are read as text from every ASN.1 string type a subject uses (UTF8String,
//! PrintableString, IA5String, BMPString as UTF-16BE, UniversalString as UTF-32BE,
//! T61String byte for byte as Latin-1...), so a CA that renews a certificate with its CN in
//! another string type names the same tenant, and two different CNs never read alike. A
//! value that is not a string is written `#` and the hex of its whole DER (RFC 4514 2.4).

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
    cas: Vec<Authority>,
}

/// One CA of the bundle.
struct Authority {
    /// SHA-256 of its DER: the principal's CA.
    digest: [u8; 32],
    /// Its subject's DER, matched against the issuer names of a chain.
    subject: Vec<u8>,
    /// A verifier that trusts this CA alone.
    verifier: Arc<dyn ClientCertVerifier>,
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
            let (subject, _) =
                names(ca.as_ref()).map_err(|e| format!("a CA certificate cannot be read: {e}"))?;
            out.push(Authority {
                digest: Sha256::digest(ca.as_ref()).into(),
                subject,
                verifier,
            });
        }
        Ok(Authorities { cas: out })
    }

    /// What `chain` (leaf first, as the client sent it) says, with the CA that issued it
    /// (see the module's doc); an error when no CA verifies it or the leaf cannot be read.
    pub fn identify(&self, chain: &[CertificateDer<'_>]) -> Result<ClientCert, String> {
        self.identify_at(chain, UnixTime::now())
    }

    /// As [`identify`](Self::identify), for finding records rather than serving: the chain
    /// is checked as of the leaf's own `notBefore`, so an operator can look up the records
    /// of a certificate that has expired since (looking up is not authenticating).
    pub fn identify_for_lookup(&self, chain: &[CertificateDer<'_>]) -> Result<ClientCert, String> {
        let leaf = chain
            .first()
            .ok_or_else(|| "no client certificate".to_string())?;
        let issued = parse(leaf.as_ref())?.validity().not_before.timestamp();
        let at = UnixTime::since_unix_epoch(std::time::Duration::from_secs(
            u64::try_from(issued).unwrap_or(0).saturating_add(1),
        ));
        self.identify_at(chain, at)
    }

    fn identify_at(
        &self,
        chain: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCert, String> {
        let (leaf, intermediates) = chain
            .split_first()
            .ok_or_else(|| "no client certificate".to_string())?;
        let ca = self.issuer_of(leaf, intermediates, now).ok_or_else(|| {
            "no CA of tls_client_ca_file verifies the client certificate".to_string()
        })?;
        let (san_uris, subject) = read_leaf(leaf.as_ref())?;
        Ok(ClientCert {
            ca,
            san_uris,
            subject,
        })
    }

    /// The bundle's CA closest to `leaf` on a path that verifies: walking up from the leaf
    /// by issuer name through the certificates the client sent, the first bundle CA named
    /// as an issuer under which the path so far verifies. A path no walk finds (names that
    /// match only as webpki compares them) falls back to the first CA of the bundle that
    /// verifies the chain as sent.
    fn issuer_of(
        &self,
        leaf: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Option<[u8; 32]> {
        let verifies = |v: &Arc<dyn ClientCertVerifier>, path: &[CertificateDer<'_>]| {
            v.verify_client_cert(leaf, path, now).is_ok()
        };
        // Aligned with `intermediates`: `None` for one that cannot be read.
        let sent: Vec<Option<(Vec<u8>, Vec<u8>)>> = intermediates
            .iter()
            .map(|c| names(c.as_ref()).ok())
            .collect();
        if let Ok((_, mut issuer)) = names(leaf.as_ref()) {
            let mut path: Vec<CertificateDer<'_>> = Vec::new();
            let mut used = vec![false; intermediates.len()];
            loop {
                if let Some((ca, _)) = self
                    .cas
                    .iter()
                    .filter(|c| c.subject == issuer)
                    .map(|c| (c.digest, &c.verifier))
                    .find(|(_, v)| verifies(v, &path))
                {
                    return Some(ca);
                }
                // Up one: a certificate the client sent that is named as this issuer.
                let Some((i, next)) = sent.iter().enumerate().find_map(|(i, n)| match n {
                    Some((subject, up)) if !used[i] && *subject == issuer => Some((i, up)),
                    _ => None,
                }) else {
                    break;
                };
                used[i] = true;
                path.push(intermediates[i].clone());
                issuer = next.clone();
            }
        }
        self.cas
            .iter()
            .find(|c| verifies(&c.verifier, intermediates))
            .map(|c| c.digest)
    }
}

/// A certificate's subject and issuer, as the DER of each name.
fn names(der: &[u8]) -> Result<(Vec<u8>, Vec<u8>), String> {
    let cert = parse(der)?;
    Ok((
        cert.subject().as_raw().to_vec(),
        cert.issuer().as_raw().to_vec(),
    ))
}

fn parse(der: &[u8]) -> Result<x509_parser::certificate::X509Certificate<'_>, String> {
    use x509_parser::prelude::FromDer;
    x509_parser::certificate::X509Certificate::from_der(der)
        .map(|(_, c)| c)
        .map_err(|e| format!("the client certificate cannot be read: {e}"))
}

/// The URI SANs and the RFC 4514 subject of a certificate.
fn read_leaf(der: &[u8]) -> Result<(Vec<String>, String), String> {
    use x509_parser::prelude::GeneralName;
    let cert = parse(der)?;
    let mut uris = Vec::new();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for name in &san.value.general_names {
            if let GeneralName::URI(uri) = name {
                uris.push((*uri).to_string());
            }
        }
    }
    Ok((uris, rfc4514(cert.subject())?))
}

/// RFC 4514 text of a distinguished name: the RDNs last to first, separated by `,`,
/// multi-valued ones joined by `+`; the standard short names (RFC 4514 3), other
/// attributes by their dotted OID. String values as their text (see [`text`]), others `#`
/// and the hex of their DER.
fn rfc4514(name: &x509_parser::x509::X509Name<'_>) -> Result<String, String> {
    let mut rdns = Vec::new();
    for rdn in name.iter_rdn() {
        let mut values = Vec::new();
        for atv in rdn.iter() {
            let oid = atv.attr_type().to_id_string();
            let short = match oid.as_str() {
                "2.5.4.3" => "CN",
                "2.5.4.7" => "L",
                "2.5.4.8" => "ST",
                "2.5.4.10" => "O",
                "2.5.4.11" => "OU",
                "2.5.4.6" => "C",
                "2.5.4.9" => "STREET",
                "0.9.2342.19200300.100.1.25" => "DC",
                "0.9.2342.19200300.100.1.1" => "UID",
                _ => oid.as_str(),
            };
            values.push(format!("{short}={}", value(atv.attr_value())?));
        }
        rdns.push(values.join("+"));
    }
    Ok(rdns.into_iter().rev().collect::<Vec<_>>().join(","))
}

/// An attribute's value in RFC 4514 text: a string's text, escaped; anything else `#` and
/// the hex of its whole DER, tag and length included (RFC 4514 2.4), so that two values of
/// different types never read alike.
fn value(any: &x509_parser::asn1_rs::Any<'_>) -> Result<String, String> {
    use x509_parser::asn1_rs::ToDer;
    Ok(match text(any)? {
        Some(v) => escape(&v),
        None => {
            let der = any
                .to_der_vec()
                .map_err(|e| format!("a subject value cannot be encoded: {e}"))?;
            format!("#{}", hex::encode(der))
        }
    })
}

/// The text of a string value, decoded by its type; `None` for a value that is not a
/// string. A string that its type cannot hold (invalid UTF-8, UTF-16 or UTF-32, or a byte
/// above ASCII in an ASCII type) is refused: read any other way, two subjects could meet.
/// T61String (TeletexString) is read byte for byte as Latin-1, which is what CAs that still
/// write it put there; its escape sequences for other character sets are not interpreted,
/// so two such values are one tenant only when their bytes are equal.
fn text(value: &x509_parser::asn1_rs::Any<'_>) -> Result<Option<String>, String> {
    use x509_parser::asn1_rs::{Class, Tag};
    let bad = |kind: &str| format!("a subject value is not a valid {kind}");
    if value.class() != Class::Universal || value.header.is_constructed() {
        return Ok(None);
    }
    let data = value.data;
    let ascii = |kind: &str| {
        if data.is_ascii() {
            Ok(Some(String::from_utf8_lossy(data).into_owned()))
        } else {
            Err(bad(kind))
        }
    };
    match value.tag() {
        Tag::Utf8String => String::from_utf8(data.to_vec())
            .map(Some)
            .map_err(|_| bad("UTF8String")),
        Tag::PrintableString => ascii("PrintableString"),
        Tag::Ia5String => ascii("IA5String"),
        Tag::NumericString => ascii("NumericString"),
        Tag::VisibleString => ascii("VisibleString"),
        Tag::T61String => Ok(Some(data.iter().map(|&b| char::from(b)).collect())),
        Tag::BmpString => {
            if !data.len().is_multiple_of(2) {
                return Err(bad("BMPString"));
            }
            let units = data
                .chunks_exact(2)
                .map(|c| u16::from_be_bytes([c[0], c[1]]));
            char::decode_utf16(units)
                .collect::<Result<String, _>>()
                .map(Some)
                .map_err(|_| bad("BMPString"))
        }
        Tag::UniversalString => {
            if !data.len().is_multiple_of(4) {
                return Err(bad("UniversalString"));
            }
            data.chunks_exact(4)
                .map(|c| char::from_u32(u32::from_be_bytes([c[0], c[1], c[2], c[3]])))
                .collect::<Option<String>>()
                .map(Some)
                .ok_or_else(|| bad("UniversalString"))
        }
        _ => Ok(None),
    }
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

    use x509_parser::asn1_rs::{Any, Tag};

    #[test]
    fn subject_values_are_their_text_in_every_string_type() {
        let v = |tag, data: &[u8]| value(&Any::from_tag_and_data(tag, data));
        for (tag, data) in [
            (Tag::Utf8String, &b"m1"[..]),
            (Tag::PrintableString, b"m1"),
            (Tag::Ia5String, b"m1"),
            (Tag::VisibleString, b"m1"),
            (Tag::T61String, b"m1"),
            (Tag::BmpString, &[0, b'm', 0, b'1']),
            (Tag::UniversalString, &[0, 0, 0, b'm', 0, 0, 0, b'1']),
        ] {
            assert_eq!(v(tag, data).unwrap(), "m1", "{tag:?}");
        }
        // Beyond ASCII: BMP and UTF-32 decode to the UTF-8 text, T61 as Latin-1.
        let jurgen = "J\u{fc}rgen";
        assert_eq!(v(Tag::Utf8String, jurgen.as_bytes()).unwrap(), jurgen);
        let utf16: Vec<u8> = jurgen.encode_utf16().flat_map(u16::to_be_bytes).collect();
        assert_eq!(v(Tag::BmpString, &utf16).unwrap(), jurgen);
        let utf32: Vec<u8> = jurgen
            .chars()
            .flat_map(|c| (c as u32).to_be_bytes())
            .collect();
        assert_eq!(v(Tag::UniversalString, &utf32).unwrap(), jurgen);
        assert_eq!(v(Tag::T61String, b"J\xfcrgen").unwrap(), jurgen);
        // Equal content octets of two types are two values, not one (they were one when
        // both were written as the hex of their content).
        assert_ne!(
            v(Tag::T61String, &[0, b'A', 0, b'B']).unwrap(),
            v(Tag::BmpString, &[0, b'A', 0, b'B']).unwrap()
        );
        assert_eq!(v(Tag::BmpString, &[0, b'A', 0, b'B']).unwrap(), "AB");
    }

    #[test]
    fn values_their_type_cannot_hold_are_refused_and_others_are_whole_der_hex() {
        let v = |tag, data: &[u8]| value(&Any::from_tag_and_data(tag, data));
        assert!(v(Tag::Utf8String, &[0xff]).is_err());
        assert!(v(Tag::PrintableString, "\u{e9}".as_bytes()).is_err());
        assert!(v(Tag::BmpString, &[0, b'a', 0]).is_err());
        assert!(
            v(Tag::BmpString, &[0xd8, 0x00]).is_err(),
            "a lone surrogate"
        );
        assert!(
            v(Tag::UniversalString, &[0, 0x11, 0, 0]).is_err(),
            "beyond U+10FFFF"
        );
        // Not a string: the whole DER, tag and length included.
        assert_eq!(v(Tag::Integer, &[7]).unwrap(), "#020107");
        assert_eq!(v(Tag::OctetString, b"ab").unwrap(), "#04026162");
    }

    /// A CA, an intermediate it issues, and leaves of each, made with rcgen.
    struct Pki {
        root: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
        inter: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
    }

    fn ca_params(name: &str) -> rcgen::CertificateParams {
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        p.distinguished_name.push(rcgen::DnType::CommonName, name);
        p.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
        ];
        p
    }

    impl Pki {
        fn new() -> Pki {
            let key = || rcgen::KeyPair::generate().expect("key");
            let root = rcgen::CertifiedIssuer::self_signed(ca_params("root"), key()).expect("root");
            let inter = rcgen::CertifiedIssuer::signed_by(ca_params("intermediate"), key(), &root)
                .expect("intermediate");
            Pki { root, inter }
        }

        fn leaf(
            issuer: &rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
            cn: rcgen::DnValue,
            edit: impl FnOnce(&mut rcgen::CertificateParams),
        ) -> CertificateDer<'static> {
            let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
            p.distinguished_name = rcgen::DistinguishedName::new();
            p.distinguished_name.push(rcgen::DnType::CommonName, cn);
            p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
            edit(&mut p);
            let key = rcgen::KeyPair::generate().expect("key");
            p.signed_by(&key, issuer).expect("leaf").der().clone()
        }

        fn bundle(
            &self,
            order: &[&rcgen::CertifiedIssuer<'static, rcgen::KeyPair>],
        ) -> Authorities {
            let cas: Vec<_> = order.iter().map(|c| c.der().clone()).collect();
            Authorities::new(&cas, Arc::new(rustls::crypto::ring::default_provider()))
                .expect("authorities")
        }
    }

    fn digest(c: &rcgen::CertifiedIssuer<'static, rcgen::KeyPair>) -> [u8; 32] {
        Sha256::digest(c.der().as_ref()).into()
    }

    #[test]
    fn a_leaf_of_an_intermediate_is_the_intermediates_whatever_the_chain_and_the_order() {
        let pki = Pki::new();
        let leaf = Pki::leaf(&pki.inter, "m1".into(), |_| {});
        let inter = pki.inter.der().clone();
        for order in [[&pki.root, &pki.inter], [&pki.inter, &pki.root]] {
            let bundle = pki.bundle(&order);
            for chain in [vec![leaf.clone(), inter.clone()], vec![leaf.clone()]] {
                let who = bundle.identify(&chain).expect("verifies");
                assert_eq!(
                    who.ca,
                    digest(&pki.inter),
                    "bundle root first: {}, chain of {}",
                    std::ptr::eq(order[0], &pki.root),
                    chain.len()
                );
            }
            // A leaf the root issues itself is the root's.
            let direct = Pki::leaf(&pki.root, "m1".into(), |_| {});
            assert_eq!(
                bundle.identify(&[direct]).expect("verifies").ca,
                digest(&pki.root)
            );
        }
        // The intermediate not in the bundle: the root, the closest CA the bundle holds,
        // and only with the chain sent.
        let root_only = pki.bundle(&[&pki.root]);
        assert_eq!(
            root_only
                .identify(&[leaf.clone(), inter])
                .expect("verifies")
                .ca,
            digest(&pki.root)
        );
        assert!(root_only.identify(&[leaf]).is_err());
    }

    #[test]
    fn a_cn_in_any_string_type_is_one_subject_and_two_cns_are_two() {
        let pki = Pki::new();
        let bundle = pki.bundle(&[&pki.inter]);
        let subject = |cn: rcgen::DnValue| {
            let leaf = Pki::leaf(&pki.inter, cn, |_| {});
            let who = bundle.identify(&[leaf]).expect("verifies");
            (
                who.subject.clone(),
                who.principal(CertField::Subject).expect("principal"),
            )
        };
        let utf8 = subject(rcgen::DnValue::Utf8String("merchant-1".into()));
        assert_eq!(utf8.0, "CN=merchant-1");
        for other in [
            rcgen::DnValue::PrintableString("merchant-1".try_into().expect("printable")),
            rcgen::DnValue::BmpString("merchant-1".try_into().expect("bmp")),
            rcgen::DnValue::UniversalString("merchant-1".try_into().expect("universal")),
            rcgen::DnValue::TeletexString("merchant-1".try_into().expect("t61")),
        ] {
            assert_eq!(subject(other), utf8);
        }
        let two = subject(rcgen::DnValue::BmpString(
            "merchant-2".try_into().expect("bmp"),
        ));
        assert_ne!(two.1, utf8.1);
        let m2_universal = subject(rcgen::DnValue::UniversalString(
            "merchant-2".try_into().expect("universal"),
        ));
        assert_eq!(m2_universal, two);
    }

    #[test]
    fn an_expired_certificate_is_refused_to_serve_and_found_to_look_up() {
        let pki = Pki::new();
        let bundle = pki.bundle(&[&pki.root, &pki.inter]);
        let expired = Pki::leaf(&pki.inter, "m1".into(), |p| {
            p.not_before = rcgen::date_time_ymd(2020, 1, 1);
            p.not_after = rcgen::date_time_ymd(2021, 1, 1);
        });
        assert!(bundle.identify(std::slice::from_ref(&expired)).is_err());
        let found = bundle.identify_for_lookup(&[expired]).expect("lookup");
        assert_eq!(found.ca, digest(&pki.inter));
        // Looking up still needs a CA of the bundle.
        let stranger = Pki::new();
        let theirs = Pki::leaf(&stranger.inter, "m1".into(), |_| {});
        assert!(bundle.identify_for_lookup(&[theirs]).is_err());
    }
}
