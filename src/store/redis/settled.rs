//! Messages that a record settled, for the duplicates waiting for it on other instances
//! (`in_progress_wait`): the scripts that settle a record (its answer recorded, kept or
//! not, marked unknown, released by its owner, an operator's release or completion)
//! `PUBLISH` its key on [`CHANNEL`] in the same round trip, and each instance listens on a
//! connection of its own beside the shared one. The publish is a `redis.pcall`: a user
//! without the channel writes its records all the same, and its messages are lost.
//!
//! One server (`redis_url`) only, and only when some route waits (`in_progress_wait`
//! above zero at start-up: otherwise the publish would cost every record for nothing):
//! with Sentinel or a cluster, or after a reload that makes a route wait, nothing is
//! published and a waiting duplicate asks again every `wait_poll_interval`. So does one whose message was
//! lost (a broken subscriber connection: on each reconnection every waiting one is woken).

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;

use super::link::{certificates, install_crypto, single_client};
use super::parse::KEY_PREFIX;
use super::setup::{RedisSetup, Topology};
use crate::key::RecordId;
use crate::store::waiters::Waiters;

/// The channel a settled record's key is published on.
pub const CHANNEL: &str = "idemgate:settled";

/// The pause before a lost subscriber connection is made again.
const RECONNECT_PAUSE: Duration = Duration::from_secs(1);

/// Whether the scripts of `setup` publish: on one server, when some route waits.
pub(super) fn publishes(setup: &RedisSetup) -> bool {
    matches!(setup.topology, Topology::Single(_)) && setup.publish_settled
}

/// `script`, publishing its key on [`CHANNEL`] when it answers 1 or 4 (the record settled,
/// or was deleted).
pub(super) fn publishing(script: &str) -> String {
    format!(
        "local function settle()\n{script}\nend\nlocal r = settle()\nif r == 1 or r == 4 then redis.pcall('PUBLISH', '{CHANNEL}', KEYS[1]) end\nreturn r\n"
    )
}

/// Says that the user may not listen.
fn denied() {
    tracing::warn!(channel = CHANNEL, "the Redis user may not subscribe to {CHANNEL} (its ACL needs +publish +subscribe &{CHANNEL}): duplicates waiting for their first request ask again every wait_poll_interval");
}

/// The record id of a published key (`idemgate:{<id>}`).
fn record_of(key: &[u8]) -> Option<RecordId> {
    let hex = key.strip_prefix(KEY_PREFIX)?.strip_suffix(b"}")?;
    RecordId::from_hex(std::str::from_utf8(hex).ok()?)
}

/// Listens on [`CHANNEL`] for as long as the instance runs, from the first duplicate that
/// waits on it, waking the duplicates that wait for each record named; `None` for a
/// topology that publishes nothing. Whether the user may subscribe is tried at start: one
/// that may not is said then, and its waiting duplicates ask again every
/// `wait_poll_interval`.
pub fn listen(
    setup: &RedisSetup,
    connect_timeout: Duration,
    waiters: Arc<Waiters>,
) -> Option<impl std::future::Future<Output = ()> + Send + 'static> {
    let Topology::Single(url) = &setup.topology else {
        tracing::info!("Redis Sentinel or Cluster: duplicates waiting for their first request (in_progress_wait) ask again every wait_poll_interval");
        return None;
    };
    // No route waits: nothing to listen for (a reload that makes one wait has its
    // duplicates ask again every wait_poll_interval until a restart).
    if !setup.publish_settled {
        return None;
    }
    install_crypto();
    let certs = setup.tls.as_ref().map(certificates);
    let client = match single_client(setup, url, certs) {
        Ok(client) => client,
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for settled records; duplicates waiting for their first request ask again every wait_poll_interval");
            return None;
        }
    };
    let subscribe = move || {
        let client = client.clone();
        tokio::time::timeout(connect_timeout * 2, async move {
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(CHANNEL).await?;
            Ok::<_, redis::RedisError>(pubsub)
        })
    };
    Some(async move {
        if let Ok(Err(e)) = subscribe().await {
            if e.code() == Some("NOPERM") {
                denied();
                return;
            }
        }
        // No listening connection, and no message, until a duplicate waits here.
        waiters.wanted().await;
        let mut first = true;
        loop {
            match subscribe().await {
                Ok(Ok(mut pubsub)) => {
                    if !first {
                        tracing::info!("listening for settled records again");
                    }
                    first = false;
                    // Messages may have been lost meanwhile: every waiting one asks again.
                    waiters.wake_all();
                    let mut messages = pubsub.on_message();
                    while let Some(msg) = messages.next().await {
                        if let Some(id) = record_of(msg.get_payload_bytes()) {
                            waiters.wake(&id);
                        }
                    }
                    tracing::warn!("connection listening for settled records lost; reconnecting (meanwhile waiting duplicates ask again every wait_poll_interval)");
                }
                Ok(Err(e)) if e.code() == Some("NOPERM") => {
                    denied();
                    return;
                }
                Ok(Err(e)) => {
                    if first {
                        tracing::warn!(error = %e, "cannot listen for settled records yet; trying again");
                    }
                    first = false;
                }
                Err(_) => first = false,
            }
            tokio::time::sleep(RECONNECT_PAUSE).await;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_fleet_whose_routes_wait_publishes() {
        let setup = |change: fn(&mut crate::config::Config)| {
            let mut c = crate::config::Config::for_upstream("http://127.0.0.1:9");
            c.redis_url = Some("redis://127.0.0.1:6379/0".into());
            change(&mut c);
            RedisSetup::from_config(&c).unwrap().unwrap()
        };
        assert!(!publishes(&setup(|_| {})));
        assert!(publishes(&setup(|c| {
            c.defaults.in_progress_wait = Duration::from_secs(5);
        })));
        assert!(publishes(&setup(|c| {
            c.routes.push(crate::config::Route {
                path: "/pay".into(),
                in_progress_wait: Some(Duration::from_secs(5)),
                ..Default::default()
            });
        })));
        assert!(!publishes(&setup(|c| {
            c.defaults.in_progress_wait = Duration::from_secs(5);
            c.redis_url = None;
            c.redis_cluster_nodes = vec!["127.0.0.1:7000".into()];
        })));
    }

    #[test]
    fn a_published_key_names_its_record() {
        let id = RecordId::from_bytes([7; 32]);
        let key = super::super::RedisStore::key(&id);
        assert_eq!(record_of(&key), Some(id));
        assert_eq!(record_of(b"idemgate:{zz}"), None);
        assert_eq!(record_of(b"other"), None);
    }
}
