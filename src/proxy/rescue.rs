//! What idemgate answers itself, decided in one place: every refusal, every claim result
//! other than a won claim, and every upstream failure is a [`Reason`] here, and each reason
//! becomes one answer (its problem type, detail, record id and `Retry-After`; the title and
//! status are [`Problem`]'s), one outcome label and, on an observed route, one `would`
//! label. The rest of the proxy names a reason, never a problem.

use std::time::Duration;

use hyper::header::{HeaderValue, ACCEPT_ENCODING, ALLOW, WWW_AUTHENTICATE};
use hyper::Response;

use crate::admission::Refusal as NotAdmitted;
use crate::body::Body;
use crate::config::{OnAmbiguous, OnStoreError, Policy};
use crate::key::RecordId;
use crate::outcome::Outcome;
use crate::problem::Problem;
use crate::store::{Claim, StoreError, StoredResponse};
use crate::upstream;

use super::claim::Found;
use super::decision::{Pass, Refusal};
use super::exchange::ExchangeError;
use super::pipeline::Stop;

/// The `would` label of a won claim on an observed route: enforcing would forward it.
pub(super) const EXECUTE: &str = "execute";

/// The codings idemgate decodes for a fingerprint: `Accept-Encoding` of a 415
/// `too-many-codings`.
const DECODED: &str = "gzip, deflate, br";

/// The `would` label of a request enforcing would forward unprotected.
pub(super) const UNPROTECTED: &str = "unprotected";

/// Why idemgate answers a request itself (or on behalf of an upstream that did not answer
/// one): each is one problem, with the detail, record id and `Retry-After` it carries.
pub(super) enum Reason {
    /// Handling the request panicked.
    Panicked,
    /// A claimed request's exchange panicked: `record` is named when the client's retries
    /// are told about it (enforcing), where it reads as in progress, then unknown.
    ExchangePanicked { record: Option<RecordId> },
    /// A `CONNECT`: idemgate forwards no tunnels.
    Tunnel,
    /// Not admitted; retry after `wait` seconds.
    Overloaded { why: NotAdmitted, wait: u64 },
    /// An upstream that did not answer a request forwarded as sent (pass-through, or a
    /// claimed request on an observed route, which is answered as pass-through would be).
    Upstream(Unanswered),
    /// A claimed request the upstream could not be reached for: nothing was executed.
    NotExecuted { id: RecordId },
    /// A claimed request whose outcome is unknown: `why` (see [`exchange_failure`]), and
    /// what became of its record when the client is told of it.
    Ambiguous {
        problem: Problem,
        why: String,
        record: Option<(RecordId, OnAmbiguous)>,
    },
    /// An observed duplicate's answer broke off while it was read.
    DuplicateBrokeOff { id: RecordId },
    /// An observed duplicate's exchange ended without an answer.
    DuplicateLost { id: RecordId },
    /// The claim of record `id` found what keeps this request from being forwarded.
    Claim { id: RecordId, found: Barred },
}

/// What a claim found that keeps its request from being forwarded (a replay aside).
pub(super) enum Barred {
    /// A record made by an unknown fingerprint version.
    OtherVersion(u16),
    /// The key's request is being executed; retry after `wait` seconds.
    InFlight { wait: u64 },
    /// The key's request was executed, its answer (`status`) not kept.
    NotKept { status: u16 },
    /// The key was used with another request.
    Mismatch,
    /// The store answered this claim after its own release.
    Withdrawn { wait: u64 },
    /// This instance is still taking back a claim of the key.
    ReleasePending { wait: u64 },
    /// The key's request ran and was answered; this instance is still writing its record.
    WritePending,
    /// The key's request ran and its outcome is unknown.
    Unknown,
    /// The key's recorded answer cannot be decrypted.
    Unreadable,
    /// The store has no room for the claim.
    StoreFull { why: String, wait: u64 },
    /// The store did not answer the claim.
    StoreDown { wait: u64 },
}

/// How an upstream left a request forwarded as sent without an answer.
pub(super) enum Unanswered {
    /// Its final answer was an interim status.
    Interim,
    /// It could not be connected to.
    NotSent,
    /// Its answer's head could not be read.
    BrokenHead,
    /// It closed the connection without a complete answer.
    Closed,
    /// It did not answer within `upstream_timeout`.
    Timeout,
}

impl Reason {
    /// The answer.
    pub(super) fn answer(self) -> Response<Body> {
        match self {
            Reason::Panicked => Problem::Internal.response(
                "idemgate failed while handling this request; if it was forwarded, its outcome is unknown",
                None,
                None,
            ),
            Reason::ExchangePanicked { record: None } => Problem::Internal.response(
                "idemgate failed while handling this request",
                None,
                None,
            ),
            Reason::ExchangePanicked { record: Some(id) } => Problem::Internal.response(
                "idemgate failed while handling this request; it may have been executed, and retries with this key get 409 until an operator releases the record",
                Some(&id),
                None,
            ),
            Reason::Tunnel => {
                let mut res = Problem::MethodNotAllowed.response(
                    "idemgate does not forward CONNECT; it is a reverse proxy, not a tunnel",
                    None,
                    None,
                );
                res.headers_mut().insert(
                    ALLOW,
                    HeaderValue::from_static("GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS"),
                );
                res
            }
            Reason::Overloaded { why, wait } => {
                Problem::Overloaded.response(overloaded_detail(why), None, Some(wait))
            }
            Reason::Upstream(how) => unanswered(how),
            Reason::NotExecuted { id } => Problem::UpstreamUnreachable.response(
                "the upstream could not be reached, or refused the request before processing it; nothing was executed and the request may be retried",
                Some(&id),
                Some(1),
            ),
            Reason::Ambiguous {
                problem,
                why,
                record: None,
            } => problem.response(why, None, None),
            Reason::Ambiguous {
                problem,
                why,
                record: Some((id, on_ambiguous)),
            } => {
                let detail = match on_ambiguous {
                    OnAmbiguous::Hold => format!("{why}; the request may have been executed, and retries with this key get 409 until an operator releases the record"),
                    OnAmbiguous::Release => format!("{why}; the request may have been executed, and the key was released"),
                };
                problem.response(detail, Some(&id), None)
            }
            Reason::DuplicateBrokeOff { id } => Problem::UpstreamTimeout.response(
                "the upstream's answer broke off",
                Some(&id),
                None,
            ),
            Reason::DuplicateLost { id } => Problem::UpstreamTimeout.response(
                "internal error; the outcome is unknown",
                Some(&id),
                None,
            ),
            Reason::Claim { id, found } => barred(&id, found),
        }
    }
}

/// The answers to what a claim found.
fn barred(id: &RecordId, found: Barred) -> Response<Body> {
    let id = Some(id);
    match found {
        Barred::OtherVersion(version) => Problem::InProgress.response(
            format!("this key's record was made by an idemgate with fingerprint version {version}, which this instance does not know; retry (an up-to-date instance will answer)"),
            id,
            Some(1),
        ),
        Barred::InFlight { wait } => Problem::InProgress.response(
            "a request with this key is being executed; retry after it finishes",
            id,
            Some(wait),
        ),
        Barred::NotKept { status } => Problem::ResponseNotStored.response(
            format!("this request was executed once and answered with status {status}, but the answer was larger than max_response_bytes (or did not fit in the store) and was not kept, so it cannot be replayed; it will not be sent again"),
            id,
            None,
        ),
        Barred::Mismatch => Problem::FingerprintMismatch.response(
            "this key was used with a different request (method, path, query, content type or body); use a new key for a new operation",
            id,
            None,
        ),
        Barred::Withdrawn { wait } => Problem::StoreUnavailable.response(
            "the idempotency store answered too late; the request was not forwarded",
            id,
            Some(wait),
        ),
        Barred::ReleasePending { wait } => Problem::StoreUnavailable.response(
            "a claim of this key that was never forwarded is still being taken back; retry",
            id,
            Some(wait),
        ),
        Barred::WritePending => Problem::InProgress.response(
            "a request with this key was executed and answered; its record is still being written, retry to get its answer",
            id,
            Some(1),
        ),
        Barred::Unknown => Problem::OutcomeUnknown.response(
            "this request was sent to the upstream once and its outcome is unknown; it will not be sent again until an operator releases the record",
            id,
            None,
        ),
        Barred::Unreadable => Problem::RecordUnreadable.response(
            "this request was executed once and its recorded answer cannot be read (its encryption key is no longer configured); it will not be executed again",
            id,
            None,
        ),
        Barred::StoreFull { why, wait } => Problem::StoreUnavailable.response(
            format!("the idempotency store is full ({why}); the request was not forwarded, retry after the Retry-After"),
            id,
            Some(wait),
        ),
        Barred::StoreDown { wait } => Problem::StoreUnavailable.response(
            "the idempotency store did not answer; the request was not forwarded",
            id,
            Some(wait),
        ),
    }
}

/// The detail of a 503 `overloaded`: what was full.
fn overloaded_detail(why: NotAdmitted) -> &'static str {
    match why {
        NotAdmitted::QueueFull => "too many requests are in progress and waiting; nothing was done, retry later",
        NotAdmitted::QueueTimeout => "too many requests are in progress; this one waited queue_timeout for its turn; nothing was done, retry later",
        NotAdmitted::BuffersFull => "too many request and answer bodies are held in memory (max_buffered_bytes); nothing was done, retry later",
        NotAdmitted::ShareFull => "this client connection or tenant holds its share of idemgate's memory for answers not yet read, or of the pass-through connections (max_buffered_bytes_per_connection, max_buffered_bytes_per_tenant, max_pass_through_per_connection, max_pass_through_per_tenant); nothing was done, retry later",
        NotAdmitted::ClientGone => "the client closed its connection while this request waited for its turn; nothing was done",
    }
}

/// The answer of an upstream that left a request forwarded as sent without one.
fn unanswered(how: Unanswered) -> Response<Body> {
    let (problem, detail) = match how {
        Unanswered::Interim => (
            Problem::UpstreamBrokenAnswer,
            "the upstream's final answer was an interim status",
        ),
        Unanswered::NotSent => (
            Problem::UpstreamUnreachable,
            "could not connect to the upstream",
        ),
        Unanswered::BrokenHead => (
            Problem::UpstreamBrokenAnswer,
            "the upstream's answer could not be read",
        ),
        Unanswered::Closed => (
            Problem::UpstreamTimeout,
            "the upstream closed the connection without a complete answer",
        ),
        Unanswered::Timeout => (
            Problem::UpstreamTimeout,
            "the upstream did not answer within upstream_timeout",
        ),
    };
    problem.response(detail, None, None)
}

/// The problem of a claimed exchange that ended without a complete answer, and why, in
/// words that name the upstream's failure (logged, and the start of the answer's detail).
pub(super) fn exchange_failure(e: &ExchangeError) -> (Problem, String) {
    match e {
        ExchangeError::Timeout => (
            Problem::UpstreamTimeout,
            "the upstream did not answer within upstream_timeout".to_string(),
        ),
        ExchangeError::Request(e) if upstream::framing::broken_head(e) => (
            Problem::UpstreamBrokenAnswer,
            format!(
                "the upstream's answer could not be read: {}",
                upstream::describe(e)
            ),
        ),
        ExchangeError::Request(e) => (
            Problem::UpstreamTimeout,
            format!(
                "the upstream connection failed after sending: {}",
                upstream::describe(e)
            ),
        ),
        ExchangeError::Body(e) if upstream::framing::broken_body(e) => (
            Problem::UpstreamBrokenAnswer,
            format!("the upstream's answer was broken: {e}"),
        ),
        ExchangeError::Body(e) => (
            Problem::UpstreamTimeout,
            format!("the upstream's answer broke off: {e}"),
        ),
        ExchangeError::Broken(why) => (Problem::UpstreamBrokenAnswer, why.clone()),
    }
}

/// Which wait a claim's answer gives in its `Retry-After`, for the proxy to measure.
pub(super) enum Wait {
    /// Since when the store has failed claims.
    Outage,
    /// Until a full store should have room.
    StoreRoom,
}

/// What enforcing does with what a claim found.
pub(super) enum Reply {
    /// The claim is this request's: forward it.
    Forward,
    /// Replay the recorded answer, once its body finds room.
    Replay(StoredResponse),
    /// The recorded answer's body found no room: 503 `overloaded`.
    NoRoom,
    /// The store failed and the route says `on_store_error = "forward"`: forward it
    /// unprotected.
    Unprotected,
    /// idemgate's own answer.
    Answer(Reason),
}

impl Found {
    /// What enforcing does with what the claim of record `id` found under `policy`, and the
    /// outcome it counts; `wait` measures a `Retry-After` the proxy knows. A failure is
    /// logged here, where it becomes an answer.
    pub(super) fn reply(
        self,
        id: RecordId,
        policy: &Policy,
        wait: impl FnOnce(Wait) -> u64,
    ) -> (Reply, Outcome) {
        let answer = |found| Reply::Answer(Reason::Claim { id, found });
        match self {
            Found::Store(Claim::Claimed) => (Reply::Forward, Outcome::Forwarded),
            Found::Store(Claim::OtherVersion(version)) => {
                (answer(Barred::OtherVersion(version)), Outcome::InProgress)
            }
            Found::Store(Claim::Replay(stored)) => (Reply::Replay(stored), Outcome::Replayed),
            Found::Store(Claim::NoRoom { .. }) => (Reply::NoRoom, Outcome::Overloaded),
            Found::Store(Claim::NotKept { status }) => {
                (answer(Barred::NotKept { status }), Outcome::NotStored)
            }
            Found::Store(Claim::InFlight { lease_left }) => {
                let wait = in_progress_wait(policy, lease_left);
                (answer(Barred::InFlight { wait }), Outcome::InProgress)
            }
            Found::Store(Claim::Mismatch) => (answer(Barred::Mismatch), Outcome::Mismatch),
            // Only a claim that reached the store after its own release can find this, and
            // nobody waits for that one; it was not forwarded either way.
            Found::Store(Claim::Withdrawn) => {
                let wait = wait(Wait::Outage);
                (answer(Barred::Withdrawn { wait }), Outcome::StoreError)
            }
            Found::ReleasePending => {
                let wait = wait(Wait::Outage);
                (answer(Barred::ReleasePending { wait }), Outcome::StoreError)
            }
            // Never `outcome-unknown` (which tells clients not to retry): the write is
            // tried again every half second at most.
            Found::WritePending => (answer(Barred::WritePending), Outcome::InProgress),
            Found::Store(Claim::Unknown) => (answer(Barred::Unknown), Outcome::Ambiguous),
            // The request was executed once and its answer was kept, sealed under a key
            // that is gone: a second execution is the one thing this must not become, so
            // not even `on_store_error = "forward"` forwards it.
            Found::Failed(StoreError::Unreadable(why)) => {
                tracing::error!(record = %id, error = %why, "recorded answer cannot be read");
                (answer(Barred::Unreadable), Outcome::StoreError)
            }
            // Taken back already, where it may have landed (see `claim_guarded`).
            Found::Failed(e) => {
                tracing::warn!(record = %id, error = %e, "claim failed");
                let reply = if let StoreError::Full(why) = &e {
                    let wait = wait(Wait::StoreRoom);
                    let why = why.to_string();
                    answer(Barred::StoreFull { why, wait })
                } else if policy.on_store_error == OnStoreError::Reject {
                    let wait = wait(Wait::Outage);
                    answer(Barred::StoreDown { wait })
                } else {
                    Reply::Unprotected
                };
                (reply, Outcome::StoreError)
            }
        }
    }

    /// The `would` label of observe mode, and whether forwarding the request anyway may
    /// run an existing record a second time.
    pub(super) fn would(&self) -> (&'static str, bool) {
        match self {
            Found::Store(Claim::Claimed) => (EXECUTE, false),
            Found::Store(Claim::Replay(_) | Claim::NoRoom { .. }) => ("replay", true),
            Found::Store(Claim::InFlight { .. } | Claim::OtherVersion(_)) => ("in_progress", true),
            // The same record (same key, tenant, method and path) with another request: if
            // it runs, it is that record's second execution too.
            Found::Store(Claim::Mismatch) => ("mismatch", true),
            Found::Store(Claim::Unknown) => ("unknown", true),
            Found::Store(Claim::NotKept { .. }) => ("response_not_stored", true),
            // Nothing was created (a claim of this very owner was taken back): as a store
            // failure would be, nothing is known of the key.
            Found::Store(Claim::Withdrawn) => ("store_unavailable", false),
            // Enforcing answers 503 `store-unavailable` (retry), not `outcome-unknown`.
            Found::ReleasePending => ("store_unavailable", true),
            // Enforcing answers 409 `in-progress`, not `outcome-unknown`.
            Found::WritePending => ("in_progress", true),
            Found::Failed(StoreError::Unreadable(_)) => ("record_unreadable", true),
            Found::Failed(_) => ("store_unavailable", false),
        }
    }
}

/// The `Retry-After` of a 409 for a key whose request is being executed, `lease_left` on
/// its lease.
fn in_progress_wait(policy: &Policy, lease_left: Duration) -> u64 {
    let typical = policy.upstream_time.get();
    crate::retry_after::in_progress(policy.lease, lease_left, typical)
}

impl Stop {
    /// The `would` label observe mode counts it under, and whether forwarding the request
    /// anyway may run an existing record a second time.
    pub(super) fn would(&self) -> (&'static str, bool) {
        match self {
            Stop::Refused(refusal) => (refusal.would(), false),
            Stop::StoreSkipped { .. } => ("store_unavailable", false),
            Stop::Found { found, .. } => found.would(),
        }
    }
}

impl Pass {
    /// The outcome enforcing counts.
    pub fn outcome(self) -> Outcome {
        match self {
            Pass::Plain => Outcome::Passthrough,
            Pass::KeyIgnored | Pass::NoKey => Outcome::Unprotected,
        }
    }

    /// What observing counts (`idemgate_observed_total{would}`); `None`: not counted.
    pub fn would(self) -> Option<&'static str> {
        match self {
            Pass::Plain => None,
            Pass::KeyIgnored | Pass::NoKey => Some(UNPROTECTED),
        }
    }
}

impl Refusal {
    /// The `would` label observe mode counts it under.
    pub fn would(&self) -> &'static str {
        match self {
            Refusal::InvalidPath(_) => "invalid_path",
            Refusal::InvalidMethodOverride(_) => "invalid_method_override",
            Refusal::InvalidHeader(_) => "invalid_header",
            Refusal::InvalidMethod(_) => "invalid_method",
            Refusal::MissingKey => "missing_key",
            Refusal::InvalidKey(_) => "invalid_key",
            Refusal::MissingTenant(_) => "missing_tenant",
            Refusal::InvalidToken(_) => "invalid_token",
            Refusal::BodyTooLarge { .. } => "body_too_large",
            Refusal::TooManyCodings { .. } => "too_many_codings",
            Refusal::TrailersNotSupported => "trailers_not_supported",
            Refusal::BodyUnreadable => "body_unreadable",
            Refusal::BodyTimeout => "body_timeout",
            Refusal::Overloaded(NotAdmitted::BuffersFull) => "buffers_full",
            Refusal::Overloaded(_) => "overloaded",
            Refusal::SecretDisagrees => "store_unavailable",
        }
    }

    /// The outcome enforcing counts.
    pub fn outcome(&self) -> Outcome {
        match self {
            Refusal::Overloaded(_) => Outcome::Overloaded,
            Refusal::SecretDisagrees => Outcome::StoreError,
            _ => Outcome::Rejected,
        }
    }

    /// The problem enforcing answers with; `overloaded` makes the one of
    /// [`Refusal::Overloaded`], whose `Retry-After` the proxy's slots know.
    pub fn response(
        &self,
        overloaded: impl FnOnce(NotAdmitted) -> Response<Body>,
    ) -> Response<Body> {
        let res = match self {
            Refusal::InvalidPath(detail) => Problem::InvalidPath.response(detail, None, None),
            Refusal::InvalidMethodOverride(detail) => {
                Problem::InvalidMethodOverride.response(detail, None, None)
            }
            Refusal::InvalidMethod(detail) => Problem::InvalidMethod.response(detail, None, None),
            Refusal::InvalidHeader(detail) => Problem::InvalidHeader.response(detail, None, None),
            Refusal::MissingKey => Problem::MissingKey.response(
                "send an Idempotency-Key header with a unique value per operation",
                None,
                None,
            ),
            Refusal::InvalidKey(detail) => Problem::InvalidKey.response(detail, None, None),
            Refusal::MissingTenant(detail) => Problem::MissingTenant.response(detail, None, None),
            Refusal::InvalidToken(detail) => {
                let mut res = Problem::InvalidToken.response(detail, None, None);
                res.headers_mut().insert(
                    WWW_AUTHENTICATE,
                    HeaderValue::from_static("Bearer error=\"invalid_token\""),
                );
                res
            }
            Refusal::BodyTooLarge { max, decoded } => {
                let decoded = if *decoded { ", decoded (Content-Encoding)" } else { "" };
                let detail = format!("protected request bodies are limited to {max} bytes{decoded}");
                Problem::BodyTooLarge.response(detail, None, None)
            }
            Refusal::TooManyCodings { max } => {
                let detail = format!("protected request bodies may have at most {max} content codings (max_content_codings); nothing was decoded or forwarded");
                let mut res = Problem::TooManyCodings.response(detail, None, None);
                // RFC 9110 section 12.5.3: a 415 for a coding says which codings are
                // accepted; these are the ones idemgate decodes for the fingerprint.
                res.headers_mut().insert(ACCEPT_ENCODING, HeaderValue::from_static(DECODED));
                res
            }
            Refusal::TrailersNotSupported => Problem::TrailersNotSupported.response(
                "protected requests cannot carry trailer fields; send them as headers",
                None,
                None,
            ),
            Refusal::BodyUnreadable => Problem::BodyUnreadable.response(
                "the request body ended early or was malformed",
                None,
                None,
            ),
            Refusal::BodyTimeout => Problem::BodyTimeout.response(
                "the request body did not arrive within body_read_timeout",
                None,
                None,
            ),
            Refusal::Overloaded(why) => overloaded(*why),
            Refusal::SecretDisagrees => Problem::StoreUnavailable.response(
                "this instance's scope secret differs from the store's, so its record ids are not the fleet's; nothing was done, retry (another instance will answer)",
                None,
                Some(1),
            ),
        };
        res
    }
}
