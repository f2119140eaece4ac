//! TLS handshakes that never come, through the binary: silent sockets on the TLS listener
//! cost a file descriptor each and no handshake permit, so a real client beside 400 of them
//! is served at once; an `https://` upstream that accepts TCP and never answers the
//! ClientHello is unreachable within the connect timeout (502, the claim released), never
//! an `unknown` key.

#![allow(clippy::unwrap_used)]

use crate::common;
use common::Probes;

use std::time::{Duration, Instant};

use common::certs::{Ca, Dir};
use common::{post_url, Idemgate, Upstream};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_tls_sockets_do_not_delay_a_real_client() {
    let ca = Ca::new("listener ca");
    let leaf = ca.leaf(&["127.0.0.1"]);
    let dir = Dir::new();
    let (cert, key) = (
        dir.write("tls.crt", &leaf.cert),
        dir.write("tls.key", &leaf.key),
    );
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url())
        .set(|c| {
            c.tls_cert_file = Some(cert.into());
            c.tls_key_file = Some(key.into());
        })
        .binary();
    // More silent sockets than there are handshake permits (256), each reopened when closed.
    let addr = gate.addr;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut silent = Vec::new();
    for _ in 0..400 {
        let stop = stop.clone();
        silent.push(tokio::spawn(async move {
            use tokio::io::AsyncReadExt;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                };
                let mut buf = [0u8; 16];
                let _ = tokio::time::timeout(Duration::from_secs(20), s.read(&mut buf)).await;
            }
        }));
    }
    common::eventually(
        Duration::from_secs(10),
        "silent sockets awaiting their hello",
        || gate.metric("idemgate_tls_handshakes{state=\"awaiting_hello\"}") >= 300.0,
    )
    .await;
    let client = reqwest::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(ca.pem().as_bytes()).unwrap())
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    let url = format!("https://{addr}/pay");
    let mut slowest = Duration::ZERO;
    for i in 0..6 {
        let started = Instant::now();
        let a = post_url(&client, &url, Some(&format!("real-{i}")), "{}", &[]).await;
        assert_eq!(a.status, 201);
        slowest = slowest.max(started.elapsed());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    eprintln!("slowest of 6 real TLS clients beside 400 silent sockets: {slowest:?}");
    assert!(slowest < Duration::from_secs(1), "{slowest:?}");
    assert_eq!(
        gate.metric("idemgate_tls_handshakes{state=\"waiting\"}"),
        0.0
    );
    // A silent socket is closed once its ClientHello is overdue (3 s), well before the
    // head deadline (10 s).
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let started = Instant::now();
    let mut buf = [0u8; 16];
    use tokio::io::AsyncReadExt;
    let read = tokio::time::timeout(Duration::from_secs(8), s.read(&mut buf)).await;
    assert!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), "{read:?}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for t in silent {
        t.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_never_answers_the_client_hello_is_unreachable_and_released() {
    // Accepts TCP and never says a word.
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = l.accept().await {
            held.push(s);
        }
    });
    let ca = Ca::new("upstream ca");
    let dir = Dir::new();
    let ca_file = dir.write("ca.pem", &ca.pem());
    let gate = Idemgate::new(&format!("https://127.0.0.1:{port}"))
        .set(|c| {
            c.upstream_tls_ca_file = Some(ca_file.into());
            c.defaults.upstream_timeout = Duration::from_secs(10);
        })
        .binary();
    let c = common::client();
    for _ in 0..2 {
        let started = Instant::now();
        let a = post_url(&c, &gate.url("/pay"), Some("stalled-handshake"), "{}", &[]).await;
        assert_eq!(a.status, 502, "{:?}", a.body);
        assert!(a.problem_type().ends_with("/upstream-unreachable"));
        // The connect timeout (2 s), not upstream_timeout.
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "{:?}",
            started.elapsed()
        );
    }
}
