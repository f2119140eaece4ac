//! Certificates made in process with rcgen (ring): a CA per test, and certificates it
//! signs for servers and clients; the files a test writes them to.

use std::path::PathBuf;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;

/// A test CA.
pub struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// A certificate and its key, PEM.
#[derive(Clone)]
pub struct Leaf {
    pub cert: String,
    pub key: String,
}

impl Leaf {
    pub fn der(&self) -> Vec<u8> {
        CertificateDer::from_pem_slice(self.cert.as_bytes())
            .expect("rcgen")
            .to_vec()
    }
}

impl Ca {
    pub fn new(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("rcgen");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().expect("rcgen"))
            .expect("rcgen");
        Ca { issuer }
    }

    /// An intermediate CA that this one signs.
    pub fn intermediate(&self, name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("rcgen");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let issuer =
            CertifiedIssuer::signed_by(params, KeyPair::generate().expect("rcgen"), &self.issuer)
                .expect("rcgen");
        Ca { issuer }
    }

    pub fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// A certificate for `names` (DNS names or IP addresses), for servers and clients.
    pub fn leaf(&self, names: &[&str]) -> Leaf {
        self.leaf_with(names, |_| {})
    }

    pub fn leaf_with(&self, names: &[&str], edit: impl FnOnce(&mut CertificateParams)) -> Leaf {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut params = CertificateParams::new(names).expect("rcgen");
        params
            .distinguished_name
            .push(DnType::CommonName, "idemgate test");
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        edit(&mut params);
        let key = KeyPair::generate().expect("rcgen");
        let cert = params.signed_by(&key, &self.issuer).expect("rcgen");
        Leaf {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }
}

/// Files for one test.
pub struct Dir(tempfile::TempDir);

impl Default for Dir {
    fn default() -> Dir {
        Dir::new()
    }
}

impl Dir {
    pub fn new() -> Dir {
        Dir(tempfile::tempdir().expect("tempdir"))
    }

    /// Writes `content` to `name` whole: written beside it, then renamed over it.
    pub fn write(&self, name: &str, content: &str) -> String {
        let path = self.0.path().join(name);
        let tmp = self.0.path().join(format!(".{name}.tmp"));
        std::fs::write(&tmp, content).expect("write");
        std::fs::rename(&tmp, &path).expect("rename");
        path.to_str().expect("UTF-8 path").to_string()
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.path().join(name)
    }
}
