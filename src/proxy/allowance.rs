//! What one protected request holds of the buffer budget while its answer waits for its
//! client, and the shares that bound it: the budget itself (`max_buffered_bytes`), its
//! connection's share (`max_buffered_bytes_per_connection`) and its tenant's
//! (`max_buffered_bytes_per_tenant`).
//!
//! A replay's body is admitted by its size before the store reads it: room for a small
//! one ([`REPLAY_INLINE`](crate::limits::REPLAY_INLINE)) is taken before the claim, and
//! what the record does not use is given back; a larger one the store asks for by its
//! length ([`Allowance::reserve`], see [`crate::store::BodyRoom`]) before reading it, so
//! that clients that never read their replays hold at most the budget whatever the
//! record's size and whatever the store.
//!
//! An answer of a request that ran is always recorded and sent. Room for it is taken from
//! its connection's and tenant's shares before it is read from the upstream
//! ([`Allowance::for_answer`]; the exchange waits for them, at most `send_timeout`, and
//! then takes it beyond them with [`Allowance::answer`]), and while it waits for its
//! client, further protected requests of its connection and its tenant, and new work once
//! the budget is all taken, are refused ([`Allowance::refusal`]) instead of memory growing.

use std::sync::{Arc, Mutex};

use crate::admission::{Buffered, Buffers, Refusal};
use crate::connection::{Held, Holdings};
use crate::store::{BodyRoom, ReplayRoom};

/// One protected request's allowance of the buffer budget; what it took is given back
/// when the last of it (the claim's copy, the answer's body) is dropped.
pub(super) struct Allowance {
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

impl Allowance {
    pub(super) fn new(
        buffers: &Arc<Buffers>,
        connection: Option<(Holdings, usize)>,
        tenant: (Holdings, usize),
    ) -> Arc<Allowance> {
        let taken = Taken {
            bytes: 0,
            refused: None,
            budget: buffers.hold(),
            connection: connection.as_ref().map(|(h, _)| h.hold()),
            tenant: tenant.0.hold(),
        };
        Arc::new(Allowance {
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

    /// Holds `n` bytes in all for the answer of a request that ran, beyond every bound for
    /// what was not taken already ([`Allowance::for_answer`]), giving back what it held
    /// beyond.
    pub(super) fn answer(&self, n: usize) {
        let mut t = self.lock();
        let t = &mut *t;
        if n <= t.bytes {
            let spare = t.bytes - n;
            t.budget.shrink(spare);
            if let Some(c) = &mut t.connection {
                c.shrink(spare);
            }
            t.tenant.shrink(spare);
            t.bytes = n;
            return;
        }
        let more = n - t.bytes;
        t.budget.force(more);
        if let Some(c) = &mut t.connection {
            c.force(more);
        }
        t.tenant.force(more);
        t.bytes = n;
    }

    /// Takes room for an answer of `total` bytes in all (as it is read from the upstream)
    /// from its connection's share and its tenant's, if they have it; the budget counts it
    /// whatever it says, so that only this request's own connection and tenant can keep its
    /// answer waiting. `false`: a share has no room now, and nothing more is taken.
    pub(super) fn for_answer(&self, total: usize) -> bool {
        let mut t = self.lock();
        let t = &mut *t;
        let Some(n) = total.checked_sub(t.bytes).filter(|n| *n > 0) else {
            return true;
        };
        if let (Some(c), Some((_, share))) = (&mut t.connection, &self.connection) {
            if !c.grow(n, *share) {
                return false;
            }
        }
        if !t.tenant.grow(n, self.tenant.1) {
            if let Some(c) = &mut t.connection {
                c.shrink(n);
            }
            return false;
        }
        t.budget.force(n);
        t.bytes += n;
        true
    }

    /// A handle to give the store with the claim, holding room for a replay's body of up
    /// to `inline` bytes if there is room for it now: a store brings a body that fits it
    /// with the claim's own reply, and asks for a longer one by its length before it reads
    /// it. Without room now, nothing is held, and every body is asked for.
    pub(super) fn for_claim(self: &Arc<Self>, inline: usize) -> ReplayRoom {
        if !self.reserve(inline) {
            self.reserve(0);
        }
        ReplayRoom(self.clone())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Taken> {
        self.taken.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl BodyRoom for Allowance {
    fn reserve(&self, len: usize) -> bool {
        let mut t = self.lock();
        let t = &mut *t;
        if len <= t.bytes {
            // What the body does not use of the room taken before (see `Allowance::for_claim`).
            let spare = t.bytes - len;
            t.budget.shrink(spare);
            if let Some(c) = &mut t.connection {
                c.shrink(spare);
            }
            t.tenant.shrink(spare);
            t.bytes = len;
            return true;
        }
        let n = len - t.bytes;
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

    fn held(&self) -> usize {
        self.lock().bytes
    }
}
