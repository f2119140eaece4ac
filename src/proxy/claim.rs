//! The claim, shared by both modes: a protected request's body step (decoded content,
//! fingerprint, record id), the claim itself with the guard that takes it back when its
//! client hangs up, and the background release of claims that were never forwarded.

use std::time::Duration;

use bytes::Bytes;
use hyper::header::{HeaderName, CONTENT_ENCODING};
use hyper::{Method, Request};
use tracing::Span;

use crate::body::Body;
use crate::config::Policy;
use crate::fingerprint::{self, FINGERPRINT_VERSION};
use crate::key::RecordId;
use crate::limits::ANSWER_HEAD_ROOM;
use crate::store::{deadline, Claim, ClaimRequest, OwnerToken, StoreError};
use crate::telemetry::{self, Step};

use super::decision::{self, Content, Operation, Refusal};
use super::{Proxy, Shared};

impl Proxy {
    /// The body step both modes share once a body is read: its content decoded (under
    /// `max_body_bytes`), its fingerprint and its record id.
    pub(super) async fn identify(
        &self,
        policy: &Policy,
        method: &Method,
        operation: &Operation,
        parts: &hyper::http::request::Parts,
        body: &Bytes,
    ) -> Result<Identified, Refusal> {
        let encoding = joined(&parts.headers, CONTENT_ENCODING);
        let decoded = decode_body(encoding.as_deref(), body, policy.max_body_bytes).await?;
        let content = Content {
            encoding: encoding.as_deref(),
            body,
            decoded: decoded.as_deref(),
        };
        // A `_method` in a form body may name the method the upstream runs.
        let method =
            &decision::body_method(policy, method, parts, decoded.as_deref().unwrap_or(body))?;
        let fingerprint = decision::fingerprint(
            policy,
            method,
            operation,
            &parts.uri,
            &parts.headers,
            content,
        );
        let key = match &policy.key_json_pointer {
            None => operation.key.clone(),
            Some(pointer) => {
                let text = decoded.as_deref().unwrap_or(body);
                let in_body = key_in_body(text, pointer, policy.max_key_length)?;
                match (&operation.key, in_body) {
                    (Some(h), Some(b)) if h.as_str() != b.as_str() => {
                        return Err(Refusal::InvalidKey(format!(
                            "the Idempotency-Key header and the body's {pointer} differ"
                        )))
                    }
                    (Some(h), _) => Some(h.clone()),
                    (None, b) => b,
                }
            }
        };
        // The route requires a key (key_json_pointer says so): neither place had one.
        let Some(key) = key else {
            return Err(Refusal::MissingKey);
        };
        let id = self.shared.scoper.record_id(
            &operation.tenant,
            method.as_str(),
            &operation.scope_path,
            &key,
        );
        Ok(Identified {
            method: method.clone(),
            id,
            fingerprint,
            encoding,
            decoded,
            replay_room: None,
        })
    }

    /// Claims an identified request's key under a fresh owner: the claim made, and what it
    /// found. The claim runs on the connection's own task: a replay, a 409 or a 422 costs no
    /// task of its own. A client that hangs up while the claim is in flight drops this
    /// future; the guard then takes the claim back (owner-checked, so nothing else is
    /// touched), and a retry is not left behind a record that was never forwarded.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn claim_guarded(
        &self,
        identified: Identified,
        request: &Request<Body>,
        body: &[u8],
        method: &Method,
        operation: &Operation,
        policy: &Policy,
        span: &Span,
    ) -> (ClaimRequest, Found) {
        let store_timeout = self.shared.settings.config.store_timeout;
        let mut claim = new_claim(identified.id, identified.fingerprint, policy, store_timeout);
        claim.room = identified.replay_room.clone();
        let pending = PendingClaim {
            shared: &self.shared,
            id: claim.id,
            owner: claim.owner.clone(),
            linger: claim.retention,
            armed: true,
        };
        let claim_span = telemetry::child(span, Step::Claim);
        let (scope_path, content) = (&operation.scope_path, identified.content(body));
        let found = self
            .claim(&mut claim, request, method, scope_path, content, policy)
            .await;
        drop(claim_span);
        pending.disarm();
        let found = match found {
            // The request ran and was answered; its record is still being written here.
            Ok(Claim::Unknown) if self.shared.late.is_pending(&claim.id) => Found::WritePending,
            Ok(Claim::Unknown) if self.shared.releases.is_pending(&claim.id) => {
                Found::ReleasePending
            }
            Ok(answer) => Found::Store(answer),
            Err(e) => {
                // The claim may have landed even though its answer did not, or may still
                // land: take it back (owner-checked, so nothing else is touched) so that a
                // retry is not stuck behind a record that was never forwarded. A full store
                // refused it outright, and an unreadable record is an execution's, not this
                // claim's: nothing is left to take back.
                if !matches!(e, StoreError::Full(_) | StoreError::Unreadable(_)) {
                    let (id, owner) = (claim.id, claim.owner.clone());
                    release_in_background(&self.shared, id, owner, claim.retention);
                }
                Found::Failed(e)
            }
        };
        (claim, found)
    }

    /// Claims the key; a record made under another fingerprint version is compared in
    /// that version (one more round trip, only in the upgrade window).
    pub(super) async fn claim(
        &self,
        claim: &mut ClaimRequest,
        request: &Request<Body>,
        method: &hyper::Method,
        scope_path: &str,
        content: Content<'_>,
        policy: &Policy,
    ) -> Result<Claim, StoreError> {
        let store_timeout = self.shared.settings.config.store_timeout;
        let found = deadline(store_timeout, self.shared.store.claim(claim)).await;
        let Ok(Claim::OtherVersion(version)) = found else {
            return found;
        };
        let parts = decision::request_parts(
            method,
            scope_path,
            request.uri(),
            request.headers(),
            content,
        );
        match fingerprint::fingerprint_as(version, &parts, &policy.fingerprint_rules()) {
            Some(fp) => {
                claim.fingerprint = fp;
                claim.fingerprint_version = version;
                deadline(store_timeout, self.shared.store.claim(claim)).await
            }
            None => found,
        }
    }
}

/// A protected request's body step: its record id and fingerprint, and the decoded
/// content a claim under an older fingerprint version is compared over.
pub(super) struct Identified {
    /// The method scoped and fingerprinted: the head's, or a declared body `_method`'s.
    pub(super) method: Method,
    pub(super) id: RecordId,
    pub(super) fingerprint: fingerprint::Fingerprint,
    pub(super) encoding: Option<String>,
    pub(super) decoded: Option<Vec<u8>>,
    // Enforcing: where a replay's body must find room before it is read.
    pub(super) replay_room: Option<crate::store::ReplayRoom>,
}

impl Identified {
    fn content<'a>(&'a self, body: &'a [u8]) -> Content<'a> {
        Content {
            encoding: self.encoding.as_deref(),
            body,
            decoded: self.decoded.as_deref(),
        }
    }
}

/// What a claim found, read once for both modes: enforcing answers it
/// ([`Found::reply`]), observing counts it as what enforcing would have done
/// ([`Found::would`]); both are `rescue.rs`'s.
pub(super) enum Found {
    /// The store's answer (`Claim::Unknown` only for an outcome that is really unknown).
    Store(Claim),
    /// This instance's own claim, never forwarded, not yet taken back: its lease ran out
    /// while the store was away. Not unknown: it is about to be free.
    ReleasePending,
    /// The key's request ran and was answered; this instance is still writing its record
    /// (its lease ran out meanwhile). Not unknown: it is about to be replayable.
    WritePending,
    /// The claim failed (taken back in the background where it may have landed).
    Failed(StoreError),
}

/// The key at `pointer` in a JSON body: `None` when the body is not JSON or has no such
/// member; a member that is not a string, or breaks the key's rules, is refused.
fn key_in_body(
    body: &[u8],
    pointer: &str,
    max_len: usize,
) -> Result<Option<crate::key::IdempotencyKey>, Refusal> {
    let Ok(doc) = serde_json::from_slice::<serde_json::Value>(body) else {
        return Ok(None);
    };
    match doc.pointer(pointer) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => crate::key::from_body(s, max_len)
            .map(Some)
            .map_err(|e| Refusal::InvalidKey(format!("the body's {pointer}: {e}"))),
        Some(_) => Err(Refusal::InvalidKey(format!(
            "the body's {pointer} is not a string"
        ))),
    }
}

/// A new claim on record `id` under `policy`, with a fresh owner.
fn new_claim(
    id: RecordId,
    fingerprint: fingerprint::Fingerprint,
    policy: &Policy,
    store_timeout: Duration,
) -> ClaimRequest {
    ClaimRequest {
        id,
        fingerprint,
        fingerprint_version: FINGERPRINT_VERSION,
        owner: OwnerToken::random(),
        lease: policy.lease,
        retention: policy.retention,
        busy_for: busy_for(policy, store_timeout),
        answer_room: store_answer_bytes(policy),
        room: None,
    }
}

/// The values of every `name` header line as one list (`None` without any).
pub(super) fn joined(headers: &hyper::HeaderMap, name: HeaderName) -> Option<String> {
    let mut values = headers.get_all(name).iter().peekable();
    values.peek()?;
    let all: Vec<_> = values
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .collect();
    Some(all.join(","))
}

/// A coded body's content for its fingerprint (`None` when it has no codings, or is
/// fingerprinted raw), decoded under `max` bytes: beyond it, 413, having held at most `max`.
/// Decoding that may take long runs off the serving thread; it runs with a slot held, so at
/// most `max_in_flight` bodies are being decoded at once.
pub(super) async fn decode_body(
    encoding: Option<&str>,
    body: &Bytes,
    max: u64,
) -> Result<Option<Vec<u8>>, Refusal> {
    let limit = usize::try_from(max).unwrap_or(usize::MAX);
    let decoded = if fingerprint::decoding_is_heavy(encoding, body, limit) {
        let (owned, body) = (encoding.map(str::to_owned), body.clone());
        tokio::task::spawn_blocking(move || {
            fingerprint::decode_content(owned.as_deref(), &body, limit)
        })
        .await
        // A decoder that panicked: the body is fingerprinted as sent.
        .unwrap_or(Ok(fingerprint::Decoded::Raw))
    } else {
        fingerprint::decode_content(encoding, body, limit)
    };
    match decoded {
        Ok(fingerprint::Decoded::Content(content)) => Ok(Some(content)),
        Ok(fingerprint::Decoded::Identity | fingerprint::Decoded::Raw) => Ok(None),
        Err(fingerprint::TooLarge) => Err(Refusal::BodyTooLarge { max, decoded: true }),
    }
}

/// A claim on its way to the store. Dropped armed (its request's future was dropped: the
/// client hung up), it takes the claim back in the background.
pub(super) struct PendingClaim<'a> {
    pub(super) shared: &'a Shared,
    pub(super) id: RecordId,
    pub(super) owner: OwnerToken,
    // The claim's retention: how long a claim still on its way could arrive and matter.
    pub(super) linger: Duration,
    pub(super) armed: bool,
}

impl PendingClaim<'_> {
    /// The claim's answer arrived: from here on its owner settles it.
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for PendingClaim<'_> {
    fn drop(&mut self) {
        if self.armed {
            release_in_background(self.shared, self.id, self.owner.clone(), self.linger);
        }
    }
}

/// What a claim reserves in a store with a byte cap: the largest answer the route records.
pub(super) fn store_answer_bytes(policy: &Policy) -> usize {
    usize::try_from(policy.max_response_bytes)
        .unwrap_or(usize::MAX)
        .saturating_add(ANSWER_HEAD_ROOM)
}

/// How long after a claim its owner may still be working on it: the claim's answer (at
/// most `store_timeout`), the whole upstream exchange (`upstream_timeout`), then the record
/// (`store_timeout`). An operator's release is refused within this time unless forced.
pub(super) fn busy_for(policy: &Policy, store_timeout: Duration) -> Duration {
    policy.upstream_timeout + store_timeout * 2
}

/// The first pause between two tries of a release; it doubles up to
/// [`RELEASE_RETRY_PAUSE_MAX`].
pub(super) const RELEASE_RETRY_PAUSE: Duration = Duration::from_millis(50);

/// The longest pause between two tries: once the store is back, a pending release lands
/// within this (plus one `store_timeout`), well within a lease.
pub(super) const RELEASE_RETRY_PAUSE_MAX: Duration = Duration::from_millis(500);

/// Releases a claim that was never forwarded, whether or not it landed, in a task of its
/// own: owner-checked (a record this owner does not hold is left alone), and noted by the
/// store for `linger` so that the claim, if it is still on its way, creates nothing when it
/// arrives. That matters because the release need not follow the claim down the same
/// connection: when the connection that carried the claim is cut, the release goes down a
/// new one and can overtake a claim still in flight on the old. A release that fails is
/// tried again with growing pauses for as long as the instance lives, so a store that comes
/// back after any outage frees the key, rather than leaving it to read as `unknown` once
/// its lease runs out; meanwhile the key is in [`Releases`], and a retry of it is told to
/// wait. Shutdown logs those still pending by record id.
pub(super) fn release_in_background(
    shared: &Shared,
    id: RecordId,
    owner: OwnerToken,
    linger: Duration,
) {
    // Outside a runtime (the process is going away) there is nothing to spawn on: the
    // claim, if it landed, reads as unknown once its lease runs out, never twice executed.
    if tokio::runtime::Handle::try_current().is_err() {
        tracing::error!(record = %id, "could not take back a claim that was never forwarded (shutting down); it is safe to release");
        return;
    }
    if !shared.releases.add(id) {
        tracing::error!(record = %id, pending = shared.releases.len(), "too many releases pending; this claim was never forwarded and is safe to release (if it landed, it reads as unknown once its lease runs out)");
        return;
    }
    let store = shared.store.clone();
    let releases = shared.releases.clone();
    let store_timeout = shared.settings.config.store_timeout;
    shared.tasks.spawn(async move {
        let mut pause = RELEASE_RETRY_PAUSE;
        let mut tries = 0u32;
        loop {
            match deadline(store_timeout, store.release(&id, &owner, linger)).await {
                Ok(_) => {
                    releases.remove(&id);
                    if tries > 0 {
                        tracing::info!(record = %id, tries = tries + 1, "claim that was never forwarded taken back");
                    }
                    return;
                }
                Err(e) => {
                    tries += 1;
                    // Once, and then every so often, so that a long outage shows without
                    // flooding the log.
                    if tries == 1 || tries.is_multiple_of(100) {
                        tracing::warn!(record = %id, tries, error = %e, "release of a claim that was never forwarded failed; trying again until it lands");
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(RELEASE_RETRY_PAUSE_MAX);
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_claim_found_is_counted_as_what_enforcing_would_answer() {
        let table = [
            (Found::Store(Claim::Claimed), ("execute", false)),
            (Found::Store(Claim::Mismatch), ("mismatch", true)),
            (Found::Store(Claim::OtherVersion(9)), ("in_progress", true)),
            (Found::Store(Claim::Unknown), ("unknown", true)),
            (Found::ReleasePending, ("store_unavailable", true)),
            (Found::WritePending, ("in_progress", true)),
            (Found::Store(Claim::Withdrawn), ("store_unavailable", false)),
        ];
        for (found, want) in table {
            assert_eq!(found.would(), want);
        }
    }
}
