//! Replica acknowledgement (`min_replicas_ack`): the connections that carry a `WAIT`.

use super::*;

/// Connections of their own for the writes that wait for replicas, each carrying one such
/// write (and its `WAIT`) at a time.
///
/// Redis serves a connection's calls in order and holds all of them while that
/// connection's `WAIT` waits. On the shared connection, a claim waiting out
/// `replica_ack_timeout` for a missing replica held up every call queued behind it
/// (replays, releases, a cluster's slot-map reload) and let through at most one claim per
/// `replica_ack_timeout`; claims arriving faster piled up on the wire beyond
/// `store_timeout`, still waiting there after the replica came back. Here a write waits
/// for a free connection in idemgate, where its caller's deadline can still withdraw it
/// unsent, and nothing else ever waits behind a `WAIT`.
///
/// Connections are opened as needed, up to `replica_ack_connections`. One is closed, not
/// reused, when its caller gave up while a write was on it: a late answer must not reach
/// the next write.
pub(super) struct AckLinks {
    pub(super) setup: RedisSetup,
    pub(super) connect_timeout: Duration,
    pub(super) response_timeout: Duration,
    pub(super) idle: std::sync::Mutex<Vec<Link>>,
    pub(super) free: tokio::sync::Semaphore,
    /// With Sentinel, the shared link's primary epoch (see `Link::primary_epoch`).
    pub(super) leader: Option<std::sync::Arc<std::sync::atomic::AtomicU64>>,
}

/// One of [`AckLinks`], held for one write.
pub(super) struct AckLink<'a> {
    pub(super) links: &'a AckLinks,
    pub(super) link: Link,
    /// Set once the write's answer has been read: the connection carries nothing then.
    pub(super) done: bool,
    pub(super) _free: tokio::sync::SemaphorePermit<'a>,
}

impl AckLinks {
    pub(super) fn new(
        setup: &RedisSetup,
        ack: ReplicaAck,
        connect_timeout: Duration,
        response_timeout: Duration,
    ) -> AckLinks {
        AckLinks {
            setup: setup.clone(),
            connect_timeout,
            response_timeout,
            idle: std::sync::Mutex::new(Vec::new()),
            free: tokio::sync::Semaphore::new(ack.connections),
            leader: None,
        }
    }

    /// A connection for one write: an idle one, or a new one once one is free.
    pub(super) async fn take(&self) -> Result<AckLink<'_>, StoreError> {
        let free = self
            .free
            .acquire()
            .await
            .map_err(|_| StoreError::Backend("the store is closing".into()))?;
        let idle = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let link = match idle {
            Some(link) => link,
            None => Link::open_following(
                &self.setup,
                self.connect_timeout,
                self.response_timeout,
                self.leader.clone(),
            )
            .await
            .map_err(|e| StoreError::Backend(describe_failure(&self.setup, &e)))?,
        };
        Ok(AckLink {
            links: self,
            link,
            done: false,
            _free: free,
        })
    }
}

impl Drop for AckLink<'_> {
    fn drop(&mut self) {
        if self.done {
            self.links
                .idle
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(self.link.clone());
        }
    }
}
