//! TLS alerts from an `https://` upstream after idemgate wrote its request, through the
//! binary: a rustls upstream run here reads the whole request, then ends the session with
//! an alert of the test's choosing (encrypted under the session's own traffic keys, which
//! rustls hands this test through its key log) or a `close_notify`.
//!
//! A refusal alert of the handshake before the upstream sent anything is what a TLS 1.3
//! server refusing idemgate's client certificate sends: its HTTP server never saw the
//! request, so it is "not sent" (502, the claim released). Any other alert or close after
//! the request was written is ambiguous (504, `unknown`, 409 for retries), and so is a
//! refusal alert once the upstream has sent data (here a `100 Continue`): a server sends
//! data only once it has accepted the handshake.

#![allow(clippy::unwrap_used)]

use crate::common;
use common::Probes;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use common::certs::{Ca, Dir};
use common::{post_url, Gate, Idemgate};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How the upstream ends a session once it has read the request.
#[derive(Clone, Copy)]
enum End {
    /// A fatal alert with this description code, right away.
    Alert(u8),
    /// A `100 Continue`, then a fatal alert with this description code.
    ContinueThenAlert(u8),
    /// `close_notify`, and the connection closed.
    CloseNotify,
}

const ACCESS_DENIED: u8 = 49;
const INTERNAL_ERROR: u8 = 80;

/// The server's application traffic secret of the last handshake, from rustls' key log.
#[derive(Debug, Default)]
struct ServerSecret(Mutex<Option<Vec<u8>>>);

impl rustls::KeyLog for ServerSecret {
    fn log(&self, label: &str, _client_random: &[u8], secret: &[u8]) {
        if label == "SERVER_TRAFFIC_SECRET_0" {
            *self.0.lock().unwrap() = Some(secret.to_vec());
        }
    }
}

struct Len(usize);

impl ring::hkdf::KeyType for Len {
    fn len(&self) -> usize {
        self.0
    }
}

/// HKDF-Expand-Label of TLS 1.3 (RFC 8446 7.1), with an empty context.
fn expand_label(secret: &[u8], label: &str, len: usize) -> Vec<u8> {
    let label = format!("tls13 {label}");
    let mut info = (len as u16).to_be_bytes().to_vec();
    info.push(label.len() as u8);
    info.extend_from_slice(label.as_bytes());
    info.push(0);
    let prk = ring::hkdf::Prk::new_less_safe(ring::hkdf::HKDF_SHA256, secret);
    let mut out = vec![0; len];
    prk.expand(&[&info], Len(len))
        .unwrap()
        .fill(&mut out)
        .unwrap();
    out
}

/// A fatal alert as the `seq`th record under the server's application traffic secret
/// (TLS_AES_128_GCM_SHA256, RFC 8446 5.2).
fn alert_record(secret: &[u8], seq: u64, description: u8) -> Vec<u8> {
    use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_128_GCM};
    let key = expand_label(secret, "key", 16);
    let iv = expand_label(secret, "iv", 12);
    let mut nonce = [0u8; 12];
    nonce.copy_from_slice(&iv);
    for (n, s) in nonce[4..].iter_mut().zip(seq.to_be_bytes()) {
        *n ^= s;
    }
    // Level fatal, the description, then the inner content type: alert.
    let mut record = vec![2, description, 21];
    let head = [23, 3, 3, 0, (record.len() + 16) as u8];
    let key = LessSafeKey::new(UnboundKey::new(&AES_128_GCM, &key).unwrap());
    key.seal_in_place_append_tag(
        Nonce::assume_unique_for_key(nonce),
        Aad::from(head),
        &mut record,
    )
    .unwrap();
    [head.to_vec(), record].concat()
}

/// A TLS 1.3 upstream that reads each request whole (counting it) and ends the session
/// as `end` says, never answering.
struct AlertingUpstream {
    port: u16,
    reads: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
    ca: String,
}

impl Drop for AlertingUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl AlertingUpstream {
    async fn start(end: End) -> AlertingUpstream {
        let ca = Ca::new("upstream ca");
        let leaf = ca.leaf(&["127.0.0.1"]);
        let mut provider = rustls::crypto::ring::default_provider();
        provider.cipher_suites = vec![rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256];
        let chain = CertificateDer::pem_slice_iter(leaf.cert.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .unwrap();
        let key = PrivateKeyDer::from_pem_slice(leaf.key.as_bytes()).unwrap();
        let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(provider))
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .unwrap();
        // No tickets: the first record under the traffic keys is the test's.
        config.send_tls13_tickets = 0;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let secret = Arc::new(ServerSecret::default());
        config.key_log = secret.clone();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let reads = Arc::new(AtomicUsize::new(0));
        let counted = reads.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                // One connection at a time: the key log holds the last handshake's secret.
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    continue;
                };
                let mut request = Vec::new();
                let mut buf = [0u8; 4096];
                let whole = loop {
                    let Ok(n) = tls.read(&mut buf).await else {
                        break false;
                    };
                    if n == 0 {
                        break false;
                    }
                    request.extend_from_slice(&buf[..n]);
                    if let Some(at) = request.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&request[..at]).to_lowercase();
                        let length: usize = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .map_or(0, |v| v.trim().parse().unwrap());
                        if request.len() >= at + 4 + length {
                            break true;
                        }
                    }
                };
                if !whole {
                    continue;
                }
                counted.fetch_add(1, Ordering::SeqCst);
                let secret = secret.0.lock().unwrap().clone().unwrap();
                let record = match end {
                    End::Alert(code) => Some(alert_record(&secret, 0, code)),
                    End::ContinueThenAlert(code) => {
                        tls.write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
                            .await
                            .unwrap();
                        tls.flush().await.unwrap();
                        Some(alert_record(&secret, 1, code))
                    }
                    End::CloseNotify => None,
                };
                match record {
                    Some(record) => {
                        let tcp = tls.get_mut().0;
                        let _ = tcp.write_all(&record).await;
                        let _ = tcp.flush().await;
                    }
                    None => {
                        let _ = tls.shutdown().await;
                    }
                }
                // Let idemgate read it before the connection goes.
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
        });
        AlertingUpstream {
            port,
            reads,
            task,
            ca: ca.pem(),
        }
    }

    /// Starts the binary in front of this upstream, trusting its CA.
    fn gate(&self, dir: &Dir) -> Gate {
        let ca_file = dir.write("ca.pem", &self.ca);
        Idemgate::new(&format!("https://127.0.0.1:{}", self.port))
            .set(|c| c.upstream_tls_ca_file = Some(ca_file.into()))
            .binary()
    }
}

/// A keyed POST, and its retry: both answers.
async fn twice(gate: &Gate, key: &str) -> (common::Answer, common::Answer) {
    let c = common::client();
    let url = gate.url("/pay");
    let first = post_url(&c, &url, Some(key), "{\"amount\":1}", &[]).await;
    let retry = post_url(&c, &url, Some(key), "{\"amount\":1}", &[]).await;
    (first, retry)
}

/// The upstream read the request and ended the session as `end` says: idemgate cannot know
/// whether it ran, so the key is held (504, then 409 `outcome-unknown`).
async fn ambiguous(end: End, key: &str) {
    let up = AlertingUpstream::start(end).await;
    let dir = Dir::new();
    let gate = up.gate(&dir);
    let (first, retry) = twice(&gate, key).await;
    assert_eq!(first.status, 504, "{:?}\n{}", first.body, gate.log());
    assert!(
        first.problem_type().ends_with("/upstream-timeout"),
        "{:?}",
        first.body
    );
    assert_eq!(retry.status, 409, "{:?}", retry.body);
    assert!(
        retry.problem_type().ends_with("/outcome-unknown"),
        "{:?}",
        retry.body
    );
    assert_eq!(up.reads.load(Ordering::SeqCst), 1, "the retry was not sent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_alert_before_the_upstream_sent_anything_is_not_sent() {
    let up = AlertingUpstream::start(End::Alert(ACCESS_DENIED)).await;
    let dir = Dir::new();
    let gate = up.gate(&dir);
    let (first, retry) = twice(&gate, "refused-1").await;
    // Released: the retry is sent again, and refused again.
    for a in [&first, &retry] {
        assert_eq!(a.status, 502, "{:?}\n{}", a.body, gate.log());
        assert!(
            a.problem_type().ends_with("/upstream-unreachable"),
            "{:?}",
            a.body
        );
    }
    assert_eq!(up.reads.load(Ordering::SeqCst), 2);
    assert!(gate.log().contains("AccessDenied"), "{}", gate.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_alert_after_the_upstream_sent_data_is_ambiguous() {
    ambiguous(End::ContinueThenAlert(ACCESS_DENIED), "refused-late-1").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_alert_after_the_request_was_written_is_ambiguous() {
    ambiguous(End::Alert(INTERNAL_ERROR), "internal-1").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_close_notify_after_the_request_was_written_is_ambiguous() {
    ambiguous(End::CloseNotify, "closed-1").await;
}
