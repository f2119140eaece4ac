//! Bodies that idemgate forwards from where its own reading stopped, through the binary.
//!
//! In observe mode a keyed POST whose body arrives slower than `body_read_timeout` goes
//! on to the upstream as it came, the part already read first: the client gets what it
//! would without idemgate (here 201), never a 504 from a panic of the body's size hint
//! (a prefix added to the exact length of the part still to come).

#![allow(clippy::unwrap_used)]

use crate::common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::{Idemgate, Upstream};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_body_in_observe_mode_reaches_the_upstream_whole() {
    let up = Upstream::start().await;
    let g = Idemgate::new(&up.url())
        .set(|c| {
            c.defaults.mode = idemgate::config::Mode::Observe;
            c.body_read_timeout = Duration::from_millis(300);
        })
        .binary();
    let addr = g.addr;
    let answer = tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let body = b"{\"amount\":12345678}";
        write!(
            s,
            "POST /pay HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             idempotency-key: slow-observed\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        )
        .unwrap();
        s.write_all(&body[..8]).unwrap();
        // Past body_read_timeout before the rest comes.
        std::thread::sleep(Duration::from_millis(800));
        s.write_all(&body[8..]).unwrap();
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out
    })
    .await
    .unwrap();
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}\n{}", g.log());
    assert_eq!(up.hits(), 1);
    let seen = up.seen();
    assert_eq!(seen[0].body.as_ref(), b"{\"amount\":12345678}");
    assert!(!g.log().contains("panicked"), "{}", g.log());
}
