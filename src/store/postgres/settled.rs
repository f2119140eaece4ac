//! Notifications that a record settled, for the duplicates waiting for it on other
//! instances (`in_progress_wait`): the statements that settle a record (its answer
//! recorded, kept or not, marked unknown, released by its owner, an operator's release or
//! completion) call `pg_notify` on [`CHANNEL`] with its id in the same statement, delivered
//! when it commits; each instance `LISTEN`s on a connection of its own beside the shared
//! one. A lost connection wakes every waiting duplicate once it is made again, and they
//! ask again every `wait_poll_interval` meanwhile.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::{AsyncMessage, NoTls, Socket};

use super::tls::PostgresSetup;
use crate::key::RecordId;
use crate::store::waiters::Waiters;

/// The channel a settled record's id (hex) is notified on.
pub const CHANNEL: &str = "idemgate_settled";

/// The pause before a lost listening connection is made again.
const RECONNECT_PAUSE: Duration = Duration::from_secs(1);

/// Listens on [`CHANNEL`] for as long as the instance runs, from the first duplicate that
/// waits on it (until then it holds no connection), waking the duplicates that wait for
/// each record notified.
pub fn listen(
    url: &str,
    connect_timeout: Duration,
    waiters: Arc<Waiters>,
) -> Option<impl std::future::Future<Output = ()> + Send + 'static> {
    let setup = match PostgresSetup::from_url(url) {
        Ok(setup) => setup,
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for settled records; duplicates waiting for their first request ask again every wait_poll_interval");
            return None;
        }
    };
    Some(async move {
        waiters.wanted().await;
        let mut first = true;
        loop {
            let mut config = setup.config.clone();
            config.connect_timeout(connect_timeout);
            config.application_name("idemgate-listen");
            let ended = match &setup.tls {
                Some(tls) => {
                    config.ssl_mode(tokio_postgres::config::SslMode::Require);
                    let tls = tokio_postgres_rustls::MakeRustlsConnect::new((**tls).clone());
                    listen_on(&config, tls, &waiters, first).await
                }
                None => {
                    config.ssl_mode(tokio_postgres::config::SslMode::Disable);
                    listen_on(&config, NoTls, &waiters, first).await
                }
            };
            if let Err(e) = ended {
                tracing::warn!(error = %e, "connection listening for settled records lost; reconnecting (meanwhile waiting duplicates ask again every wait_poll_interval)");
            }
            first = false;
            tokio::time::sleep(RECONNECT_PAUSE).await;
        }
    })
}

/// One listening connection, until it breaks.
async fn listen_on<T>(
    config: &tokio_postgres::Config,
    tls: T,
    waiters: &Waiters,
    first: bool,
) -> Result<(), tokio_postgres::Error>
where
    T: MakeTlsConnect<Socket>,
    T::Stream: Send + 'static,
    T::TlsConnect: Send,
    <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
{
    let (client, mut connection) = config.connect(tls).await?;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let driven = tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(message) = messages.next().await {
            match message {
                Ok(AsyncMessage::Notification(n)) => {
                    if tx.send(n.payload().to_string()).is_err() {
                        return Ok(());
                    }
                }
                Ok(_) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    });
    client.batch_execute(&format!("LISTEN {CHANNEL}")).await?;
    if !first {
        tracing::info!("listening for settled records again");
    }
    // Notifications may have been lost meanwhile: every waiting one asks again.
    waiters.wake_all();
    while let Some(payload) = rx.recv().await {
        if let Some(id) = RecordId::from_hex(&payload) {
            waiters.wake(&id);
        }
    }
    drop(client);
    match driven.await {
        Ok(ended) => ended,
        Err(_) => Ok(()),
    }
}
