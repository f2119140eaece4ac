//! The listeners' accept queue: how many connections the kernel holds for idemgate before
//! it accepts them. Beyond it the kernel drops a client's SYN and the client sends it again
//! a second later (then three): a burst of new connections waits whole seconds for no
//! reason of idemgate's. tokio's `bind` asked for 128; `tests/admin_probes.rs` shows what
//! that cost under a flood of connections.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::process::Command;

use common::*;

/// The accept queue the kernel gave the socket listening on `port` (`ss`'s `Send-Q` for a
/// listening socket), if one is listening there.
fn accept_queue(port: u16) -> Option<u32> {
    common::setup::tools();
    let out = Command::new("ss")
        .args(["-ltnH", &format!("sport = :{port}")])
        .output()
        .expect("ss (iproute2) runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.lines()
        .next()
        .and_then(|l| l.split_whitespace().nth(2))
        .and_then(|q| q.parse().ok())
}

#[tokio::test]
async fn both_listeners_ask_for_an_accept_queue_of_4096() {
    let up = Upstream::start().await;
    let gate = Idemgate::new(&up.url()).binary();
    let somaxconn: u32 = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // The kernel caps what is asked at net.core.somaxconn.
    let expected = somaxconn.min(idemgate::listener::LISTEN_BACKLOG);
    assert!(expected > 128, "net.core.somaxconn is {somaxconn} here");
    assert_eq!(
        accept_queue(gate.addr.port()),
        Some(expected),
        "proxy listener"
    );
    assert_eq!(
        accept_queue(gate.admin.port()),
        Some(expected),
        "admin listener"
    );
    assert!(
        !gate.log().contains("somaxconn"),
        "no warning where the kernel allows the queue: {}",
        gate.log()
    );
}

/// In a network namespace of its own whose `net.core.somaxconn` is 128 (Linux before 5.4,
/// or a container set so), the binary says at start that bursts of connections will wait.
/// Needs `unshare -n` (root, or a user namespace), as this project's test machine has.
#[test]
fn a_kernel_that_caps_the_queue_low_is_named_at_start() {
    let port = free_port();
    let admin = free_port();
    let script = format!(
        "echo 128 > /proc/sys/net/core/somaxconn && ip link set lo up && \
         IDEMGATE_LISTEN=127.0.0.1:{port} IDEMGATE_ADMIN_LISTEN=127.0.0.1:{admin} \
         IDEMGATE_UPSTREAM=http://127.0.0.1:9 timeout 3 {} ; true",
        env!("CARGO_BIN_EXE_idemgate")
    );
    let out = Command::new("unshare")
        .args(["-n", "sh", "-c", &script])
        .output()
        .expect("unshare runs");
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && log.contains("idemgate starting"),
        "the binary did not start in a namespace of its own (unshare -n needs root): {log}"
    );
    assert!(
        log.contains("net.core.somaxconn") && log.contains("somaxconn=128"),
        "no warning about the accept queue: {log}"
    );
}
