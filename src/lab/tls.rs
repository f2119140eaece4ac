//! `idemgate lab --tls`: the whole day over TLS, with certificates made for the run.
//!
//! One CA of the run's own signs one certificate for `127.0.0.1` and `localhost`, which the
//! bank and idemgate's listener both serve; the clients trust that CA and nothing else, and
//! so does idemgate as the bank's client (`upstream_tls_ca_file`). Nothing falls back to
//! plain HTTP: the bank speaks TLS only, so a client that did not would get no answer.
//! The files live in a directory of the run's own under the system's temporary directory,
//! removed when the run ends.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// The run's CA, its server certificate, and the files idemgate reads them from.
pub struct LabPki {
    dir: PathBuf,
    /// The bank's TLS acceptor (HTTP/1.1: the legacy bank speaks nothing else).
    pub acceptor: tokio_rustls::TlsAcceptor,
    /// What the lab's clients connect with: the run's CA as their only root.
    pub client: Arc<rustls::ClientConfig>,
}

impl Drop for LabPki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl LabPki {
    /// Makes the CA and the certificate, and writes `ca.pem`, `server.pem` and
    /// `server.key` (owner-only) into a new directory.
    pub fn new() -> Result<LabPki, String> {
        let e = |e: rcgen::Error| format!("making the lab's certificates: {e}");
        let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(e)?;
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "idemgate lab CA");
        let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().map_err(e)?).map_err(e)?;
        let key = KeyPair::generate().map_err(e)?;
        let mut leaf =
            CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])
                .map_err(e)?;
        leaf.distinguished_name
            .push(DnType::CommonName, "idemgate lab");
        let leaf = leaf.signed_by(&key, &ca).map_err(e)?;

        let dir = std::env::temp_dir().join(format!(
            "idemgate-lab-tls-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        let io = |err: std::io::Error| format!("writing the lab's certificates: {err}");
        std::fs::create_dir_all(&dir).map_err(io)?;
        let pki_files = |dir: &Path| -> std::io::Result<()> {
            std::fs::write(dir.join("ca.pem"), ca.pem())?;
            std::fs::write(dir.join("server.pem"), leaf.pem())?;
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(dir.join("server.key"))?;
            f.write_all(key.serialize_pem().as_bytes())
        };
        pki_files(&dir).map_err(io)?;

        let chain = vec![CertificateDer::from(leaf.der().to_vec())];
        let private = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let tls = |err: rustls::Error| format!("the lab's TLS configuration: {err}");
        let mut server = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(tls)?
            .with_no_client_auth()
            .with_single_cert(chain, private)
            .map_err(tls)?;
        server.alpn_protocols = vec![b"http/1.1".to_vec()];
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from(ca.der().to_vec()))
            .map_err(tls)?;
        let client = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(tls)?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(LabPki {
            dir,
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(server)),
            client: Arc::new(client),
        })
    }

    /// The CA's certificate, PEM: `upstream_tls_ca_file`.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// The server certificate, PEM: `tls_cert_file`.
    pub fn cert_file(&self) -> PathBuf {
        self.dir.join("server.pem")
    }

    /// Its key, PEM: `tls_key_file`.
    pub fn key_file(&self) -> PathBuf {
        self.dir.join("server.key")
    }
}
