//! The listening sockets: the accept queue the kernel keeps for each, and what start-up
//! says when the kernel allows less than idemgate asks for.

use std::net::SocketAddr;

use tokio::net::TcpListener;

/// Connections the kernel may queue on a listener before idemgate accepts them. Beyond
/// it a client's SYN is dropped and retried a second later, then three: `bind` as tokio
/// does it queued 128, which a burst of reconnecting clients (a fleet after a deploy, a
/// load balancer's health checks beside them) fills at once; `tests/admin_probes.rs`
/// saw probes of the admin listener wait 1.2 to 2.6 s for it, with the kernel's
/// `ListenOverflows` counting the drops. The kernel caps it at `net.core.somaxconn` (4096
/// by default since Linux 5.4), as nginx's `backlog` and Go's listeners are.
pub const LISTEN_BACKLOG: u32 = 4096;

/// A listening socket on `addr` with [`LISTEN_BACKLOG`], and `SO_REUSEADDR` as tokio's
/// `bind` sets it (a restart listens again at once, whatever connections of the previous
/// process are in `TIME_WAIT`).
pub fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Warns when the kernel caps the listeners' accept queue far below [`LISTEN_BACKLOG`]:
/// `net.core.somaxconn` was 128 before Linux 5.4, and a network namespace (a container)
/// may still set it so. A burst of new connections beyond it has SYNs dropped and retried
/// a second later. Where the file cannot be read (not Linux), nothing is said.
pub fn check_accept_queue() {
    let Ok(text) = std::fs::read_to_string("/proc/sys/net/core/somaxconn") else {
        return;
    };
    let Ok(somaxconn) = text.trim().parse::<u32>() else {
        return;
    };
    if somaxconn < ACCEPT_QUEUE_WARNING {
        tracing::warn!(
            somaxconn,
            asked = LISTEN_BACKLOG,
            "the kernel queues at most net.core.somaxconn connections not yet accepted; beyond, new connections wait a second or more for their SYN to be sent again; raise net.core.somaxconn (a namespaced sysctl, settable per pod)"
        );
    }
}

/// Below this `net.core.somaxconn`, [`check_accept_queue`] warns.
const ACCEPT_QUEUE_WARNING: u32 = 1024;
