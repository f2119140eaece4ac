//! The admin listener's probes under a flood of other admin connections, in a test binary
//! of their own: what is measured is the probes' latency, which other tests running beside
//! it on two cores would move.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::*;

/// One admin probe over a new connection: its status line, how long the answer took, and
/// how long of that the connection took to be established.
async fn probe(admin: SocketAddr, path: &str) -> (String, Duration, Duration) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let started = Instant::now();
    let mut connected = Duration::ZERO;
    let answer = async {
        let mut s = tokio::net::TcpStream::connect(admin).await.ok()?;
        connected = started.elapsed();
        let head = format!("GET {path} HTTP/1.1\r\nhost: {admin}\r\nconnection: close\r\n\r\n");
        s.write_all(head.as_bytes()).await.ok()?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.ok()?;
        Some(String::from_utf8_lossy(&out).lines().next()?.to_string())
    };
    let line = tokio::time::timeout(Duration::from_secs(5), answer)
        .await
        .ok()
        .flatten()
        .unwrap_or_default();
    (line, started.elapsed(), connected)
}

/// 200 silent connections that reopen as soon as they are closed, and 200 keep-alive ones
/// that each made one `/healthz` and then stay idle (reopening too), against the admin
/// listener's 64 connections: every `/healthz` and `/readyz` is answered within 3 s. At
/// the cap, the oldest admin connection that serves nothing is closed to make room; before,
/// a new connection was the one closed, and the idle ones held their places for the
/// proxy's `idle_timeout` (75 s), so a probe got a reset throughout.
///
/// And no probe's connection waits for a SYN to be sent again: the kernel drops a SYN
/// when the listener's accept queue is full, and the client sends it again after a second
/// (then three). With the 128 that tokio's `bind` queued, the flood kept it full: probes
/// took 1.2 to 2.6 s in a debug build, each time with the connection's 1.0 or 2.0 s in it,
/// against 160 ms otherwise. With [`LISTEN_BACKLOG`](idemgate::listener::LISTEN_BACKLOG)
/// every probe read 390-420 ms, waiting behind the queued flood instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn probes_are_answered_whatever_other_admin_connections_do() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let up = Upstream::start().await;
    let gate = Gate::start(&up.url(), "", &[]);
    let admin = gate.admin;
    let stop = tokio_util::sync::CancellationToken::new();
    let mut flood = Vec::new();
    for i in 0..400 {
        let stop = stop.clone();
        flood.push(tokio::spawn(async move {
            let idle = i % 2 == 0;
            while !stop.is_cancelled() {
                let Ok(mut s) = tokio::net::TcpStream::connect(admin).await else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                if idle {
                    let _ = s
                        .write_all(
                            format!("GET /healthz HTTP/1.1\r\nhost: {admin}\r\n\r\n").as_bytes(),
                        )
                        .await;
                }
                // Until idemgate closes it (the first read is the answer, if one comes).
                let mut buf = [0u8; 1024];
                loop {
                    tokio::select! {
                        r = s.read(&mut buf) => if !matches!(r, Ok(n) if n > 0) { break },
                        _ = stop.cancelled() => return,
                    }
                }
                // Back at once but for a breath: 400 loops reconnecting with no pause at
                // all take this process's CPU from the probe itself, whose own latency is
                // what is measured.
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    for round in 0..10 {
        for path in ["/healthz", "/readyz"] {
            let (line, took, connected) = probe(admin, path).await;
            assert!(
                line.starts_with("HTTP/1.1 200"),
                "{path} (round {round}): {line:?} after {took:?}"
            );
            assert!(took < common::HANG_GUARD, "{path}: {took:?}");
            // A SYN sent again costs a whole second; a loopback connect otherwise takes
            // well under a millisecond, however loaded the machine.
            assert!(
                connected < Duration::from_millis(900),
                "{path} (round {round}): connected after {connected:?}, a SYN was dropped"
            );
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    stop.cancel();
    for f in flood {
        let _ = f.await;
    }
}
