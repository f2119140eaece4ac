//! What one protected request holds of the buffer budget while its answer waits for its
//! client, and the shares that bound it: the budget itself (`max_buffered_bytes`), its
//! connection's share (`max_buffered_bytes_per_connection`) and its tenant's
//! (`max_buffered_bytes_per_tenant`).
//!
//! A replay's body is admitted by its size before the store is asked for it (the store
//! calls [`Room::reserve`] once it knows the length, see [`crate::store::BodyRoom`]), so
//! that clients that never read their replays hold at most the budget whatever the record's
//! size. An answer of a request that ran is always sent: it is taken beyond every bound
//! ([`Room::answer`]), and while it waits for its client, further protected requests of its
//! connection and its tenant, and new work once the budget is all taken, are refused
//! ([`Room::refusal`]) instead of memory growing.

use std::sync::{Arc, Mutex};

use crate::admission::{Buffered, Buffers, Refusal};
use crate::connection::{Held, Holdings};
use crate::store::{BodyRoom, ReplayRoom};

/// One protected request's room; what it took is given back when the last of it (the
/// claim's copy, the answer's body) is dropped.
pub(super) struct Room {
    buffers: Arc<Buffers>,
    // The connection's and the tenant's holdings, with the share each may hold.
    connection: Option<(Holdings, usize)>,
    tenant: (Holdings, usize),
    taken: Mutex<Taken>,
}

struct Taken {
    bytes: usize,
    // Why the last reservation was refused.
    refused: Option<Refusal>,
    budget: Buffered,
    connection: Option<Held>,
    tenant: Held,
}

impl Room {
    pub(super) fn new(
        buffers: &Arc<Buffers>,
        connection: Option<(Holdings, usize)>,
        tenant: (Holdings, usize),
    ) -> Arc<Room> {
        let taken = Taken {
            bytes: 0,
            refused: None,
            budget: buffers.hold(),
            connection: connection.as_ref().map(|(h, _)| h.hold()),
            tenant: tenant.0.hold(),
        };
        Arc::new(Room {
            buffers: buffers.clone(),
            connection,
            tenant,
            taken: Mutex::new(taken),
        })
    }

    /// Why new work of this request's connection or tenant must wait, if it must: the
    /// budget is all taken (counted here), or the connection or tenant holds its share.
    pub(super) fn refusal(&self) -> Option<Refusal> {
        if self.buffers.is_full() {
            self.buffers.refuse();
            return Some(Refusal::BuffersFull);
        }
        let over = |(h, share): &(Holdings, usize)| h.held() >= *share;
        (self.connection.as_ref().is_some_and(over) || over(&self.tenant))
            .then_some(Refusal::ShareFull)
    }

    /// Why the last [`reserve`](BodyRoom::reserve) was refused.
    pub(super) fn refused(&self) -> Refusal {
        self.lock().refused.unwrap_or(Refusal::BuffersFull)
    }

    /// Takes `n` bytes more, beyond every bound: an answer of a request that ran.
    pub(super) fn answer(&self, n: usize) {
        let mut t = self.lock();
        t.budget.force(n);
        if let Some(c) = &mut t.connection {
            c.force(n);
        }
        t.tenant.force(n);
        t.bytes += n;
    }

    /// A handle to give the store with the claim.
    pub(super) fn for_claim(self: &Arc<Self>) -> ReplayRoom {
        ReplayRoom(self.clone())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Taken> {
        self.taken.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl BodyRoom for Room {
    fn reserve(&self, len: usize) -> bool {
        let mut t = self.lock();
        let Some(n) = len.checked_sub(t.bytes).filter(|n| *n > 0) else {
            return true;
        };
        let t = &mut *t;
        // The shares first, the budget last; what a later step refuses, the earlier give
        // back.
        if let (Some(c), Some((_, share))) = (&mut t.connection, &self.connection) {
            if !c.grow(n, *share) {
                t.refused = Some(Refusal::ShareFull);
                return false;
            }
        }
        let tenant = t.tenant.grow(n, self.tenant.1);
        if !tenant || t.budget.grow(n).is_err() {
            if let Some(c) = &mut t.connection {
                c.shrink(n);
            }
            if tenant {
                t.tenant.shrink(n);
            }
            t.refused = Some(if tenant {
                Refusal::BuffersFull
            } else {
                Refusal::ShareFull
            });
            return false;
        }
        t.bytes += n;
        true
    }
}
