//! The bank's outages on a bad day: its server restarts gracefully or crashes, and comes
//! back on the same port, as a deployment or an OOM kill of a real one would.
//!
//! - A **graceful restart** stops accepting, lets every connection finish the request it has
//!   read (idle ones close at once), then listens again.
//! - A **crash** drops every connection at once, including requests the bank has executed
//!   and not yet answered (it commits before its latency): their clients never learn the
//!   outcome. It listens again after [`CRASH_DOWN_TIME`].
//!
//! Crates: `tokio` for the server task, its abort and the listener.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::{oneshot, Mutex};
use tokio::task::JoinHandle;

use super::bank::{self, Bank};

/// How long a crashed bank refuses connections before it is back.
pub const CRASH_DOWN_TIME: Duration = Duration::from_millis(300);

/// A running server: its task, and the sender that stops it gracefully.
type Serving = (JoinHandle<std::io::Result<()>>, oneshot::Sender<()>);

/// The bank's server on one port, which can be restarted and crashed.
pub struct BankServer {
    addr: SocketAddr,
    bank: Bank,
    tls: Option<tokio_rustls::TlsAcceptor>,
    running: Mutex<Option<Serving>>,
}

impl BankServer {
    /// Serves `bank` on a free loopback port.
    pub async fn start(
        bank: Bank,
        tls: Option<tokio_rustls::TlsAcceptor>,
    ) -> std::io::Result<BankServer> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let server = BankServer {
            addr,
            bank,
            tls,
            running: Mutex::new(None),
        };
        *server.running.lock().await = Some(server.spawn(listener));
        Ok(server)
    }

    /// Where the bank listens, across its restarts.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn spawn(&self, listener: TcpListener) -> Serving {
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(bank::serve_tls(
            listener,
            self.bank.clone(),
            self.tls.clone(),
            async {
                let _ = stopped.await;
            },
        ));
        (task, stop)
    }

    /// Stops accepting, lets connections finish what they have read, and listens again.
    pub async fn restart_gracefully(&self) -> std::io::Result<()> {
        let mut running = self.running.lock().await;
        if let Some((task, stop)) = running.take() {
            let _ = stop.send(());
            let _ = task.await;
        }
        *running = Some(self.spawn(self.rebind().await?));
        Ok(())
    }

    /// Drops every connection at once, answered or not, and listens again after
    /// [`CRASH_DOWN_TIME`].
    pub async fn crash(&self) -> std::io::Result<()> {
        let mut running = self.running.lock().await;
        if let Some((task, _stop)) = running.take() {
            // Aborting the task drops its connections: their sockets close unanswered.
            task.abort();
            let _ = task.await;
        }
        tokio::time::sleep(CRASH_DOWN_TIME).await;
        *running = Some(self.spawn(self.rebind().await?));
        Ok(())
    }

    /// Stops the server for good (gracefully).
    pub async fn stop(&self) {
        if let Some((task, stop)) = self.running.lock().await.take() {
            let _ = stop.send(());
            let _ = task.await;
        }
    }

    /// The same port again; a socket of the old listener may linger for a moment.
    async fn rebind(&self) -> std::io::Result<TcpListener> {
        let mut last = None;
        for _ in 0..50 {
            match TcpListener::bind(self.addr).await {
                Ok(listener) => return Ok(listener),
                Err(err) => last = Some(err),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Err(last.unwrap_or_else(|| std::io::Error::other("could not listen again")))
    }
}
