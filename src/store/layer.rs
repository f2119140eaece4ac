//! Stores that wrap a store: a [`Layer`] names the store it wraps and states only the calls
//! it changes; every other call passes through to [`Layer::inner`], as tower's layers pass
//! a request on. The metrics' timing, sealing at rest and the lab's tracking are layers.
//!
//! Each [`Store`] method is listed once below, which makes both its pass-through default
//! here and the [`Store`] implementation of every layer: a new method of the trait is added
//! to the trait and to this list, and no layer changes unless it means to.

use std::time::Duration;

use super::{
    BoxFuture, Claim, ClaimRequest, Completed, Deleted, Heartbeat, Meta, OwnerToken, Page,
    RecordState, RecordView, ScopeSecret, ServerStats, Store, StoreError, StoreKind,
    StoredResponse,
};
use crate::fingerprint::Fingerprint;
use crate::key::RecordId;

macro_rules! layer {
    (
        calls { $( $call:ident => fn $name:ident<$lt:lifetime>(&$slt:lifetime self $(, $arg:ident: $ty:ty)*) -> BoxFuture<$rlt:lifetime, Result<$out:ty, StoreError>>; )* }
        plain { $( fn $plain:ident(&self) -> $plain_ret:ty; )* }
    ) => {
        /// Which [`Store`] call a future is (see [`Layer::around`]).
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum Call {
            $(
                #[doc = concat!("[`Store::", stringify!($name), "`].")]
                $call,
            )*
        }

        /// A store around another ([`Layer::inner`]): each [`Store`] call passes through
        /// unless the layer states it.
        pub trait Layer: Send + Sync + 'static {
            /// The store this one wraps.
            fn inner(&self) -> &dyn Store;

            /// Every call that passes through (a call the layer states does not, unless it
            /// calls this itself): the inner store's future for `call`, as it is unless the
            /// layer wraps it (timing, a deadline).
            fn around<'a, T: Send + 'a>(
                &'a self,
                call: Call,
                future: BoxFuture<'a, Result<T, StoreError>>,
            ) -> BoxFuture<'a, Result<T, StoreError>> {
                let _ = call;
                future
            }
            $(
                #[doc = concat!("[`Store::", stringify!($name), "`], passed to the inner store unless stated.")]
                fn $name<$lt>(&$slt self $(, $arg: $ty)*) -> BoxFuture<$rlt, Result<$out, StoreError>> {
                    self.around(Call::$call, self.inner().$name($($arg),*))
                }
            )*
            $(
                #[doc = concat!("[`Store::", stringify!($plain), "`], passed to the inner store unless stated.")]
                fn $plain(&self) -> $plain_ret {
                    self.inner().$plain()
                }
            )*
        }

        impl<L: Layer> Store for L {
            $(
                fn $name<$lt>(&$slt self $(, $arg: $ty)*) -> BoxFuture<$rlt, Result<$out, StoreError>> {
                    Layer::$name(self $(, $arg)*)
                }
            )*
            $(
                fn $plain(&self) -> $plain_ret {
                    Layer::$plain(self)
                }
            )*
        }
    };
}

layer! {
    calls {
    Claim => fn claim<'a>(&'a self, req: &'a ClaimRequest) -> BoxFuture<'a, Result<Claim, StoreError>>;
    Record => fn record<'a>(&'a self, id: &'a RecordId, owner: &'a OwnerToken, response: &'a StoredResponse) -> BoxFuture<'a, Result<bool, StoreError>>;
    Shorten => fn shorten<'a>(&'a self, id: &'a RecordId, owner: &'a OwnerToken, retain: Duration) -> BoxFuture<'a, Result<bool, StoreError>>;
    RecordNotKept => fn record_not_kept<'a>(&'a self, id: &'a RecordId, owner: &'a OwnerToken, status: u16) -> BoxFuture<'a, Result<bool, StoreError>>;
    Renew => fn renew<'a>(&'a self, id: &'a RecordId, owner: &'a OwnerToken, lease: Duration) -> BoxFuture<'a, Result<bool, StoreError>>;
    MarkUnknown => fn mark_unknown<'a>(&'a self, id: &'a RecordId, owner: &'a OwnerToken) -> BoxFuture<'a, Result<bool, StoreError>>;
    Release => fn release<'a>(&'a self, id: &'a RecordId, owner: &'a OwnerToken, linger: Duration) -> BoxFuture<'a, Result<bool, StoreError>>;
    Inspect => fn inspect<'a>(&'a self, id: &'a RecordId, with_body: bool) -> BoxFuture<'a, Result<Option<RecordView>, StoreError>>;
    Delete => fn delete<'a>(&'a self, id: &'a RecordId, force: bool, any_namespace: bool) -> BoxFuture<'a, Result<Deleted, StoreError>>;
    Complete => fn complete<'a>(&'a self, id: &'a RecordId, response: &'a StoredResponse, force: bool, any_namespace: bool) -> BoxFuture<'a, Result<Completed, StoreError>>;
    Supersede => fn supersede<'a>(&'a self, id: &'a RecordId, fingerprint: &'a Fingerprint, response: &'a StoredResponse) -> BoxFuture<'a, Result<bool, StoreError>>;
    List => fn list<'a>(&'a self, state: Option<RecordState>, cursor: &'a str, count: usize) -> BoxFuture<'a, Result<Page, StoreError>>;
    Meta => fn meta<'a>(&'a self, name: &'a str, offer: Option<&'a str>) -> BoxFuture<'a, Result<Meta, StoreError>>;
    Ping => fn ping<'a>(&'a self) -> BoxFuture<'a, Result<(), StoreError>>;
    ScopeSecret => fn scope_secret<'a>(&'a self) -> BoxFuture<'a, Result<ScopeSecret, StoreError>>;
    Heartbeat => fn heartbeat<'a>(&'a self) -> BoxFuture<'a, Result<Option<Heartbeat>, StoreError>>;
    ServerStats => fn server_stats<'a>(&'a self) -> BoxFuture<'a, Result<Option<ServerStats>, StoreError>>;
    }
    plain {
    fn can_list(&self) -> bool;
    fn kind(&self) -> StoreKind;
    fn room_after(&self) -> Option<Duration>;
    }
}
