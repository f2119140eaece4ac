//! What happened to a request, as logs and metrics name it: a value below both the proxy
//! that decides it and the metrics that count it.

/// What happened to a request: the `outcome` of logs and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Claimed and sent upstream; the answer was recorded.
    Forwarded,
    /// A stored answer was replayed.
    Replayed,
    /// 409: another request with the key is running.
    InProgress,
    /// 422: the key was used with a different request.
    Mismatch,
    /// A protected method without a key, on a route that does not require one.
    Unprotected,
    /// A method or route that idemgate does not protect.
    Passthrough,
    /// The client's request was refused (bad key, missing key, body too large or too slow).
    Rejected,
    /// The store failed (503, or forwarded unprotected by `on_store_error = "forward"`).
    StoreError,
    /// The upstream could not be reached; the claim was released.
    UpstreamError,
    /// Sent, outcome unknown (504), or a retry of such a request (409 outcome-unknown).
    Ambiguous,
    /// A retry of a request whose answer was too large to keep (409 response-not-stored).
    NotStored,
    /// Refused, nothing claimed: every slot busy and the queue full or waited out, or the
    /// budget of bodies being buffered and written (`max_buffered_bytes`) spent.
    Overloaded,
    /// Sent; the upstream's answer has a `release_on_status` status: passed on, not
    /// recorded, the claim released.
    Released,
    /// On a route in `mode = "observe"`: forwarded whatever enforcing would have done
    /// (what that was is counted in `idemgate_observed_total`).
    Observed,
}

impl Outcome {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Forwarded => "forwarded",
            Outcome::Replayed => "replayed",
            Outcome::InProgress => "in_progress",
            Outcome::Mismatch => "mismatch",
            Outcome::Unprotected => "unprotected",
            Outcome::Passthrough => "passthrough",
            Outcome::Rejected => "rejected",
            Outcome::StoreError => "store_error",
            Outcome::UpstreamError => "upstream_error",
            Outcome::Ambiguous => "ambiguous",
            Outcome::NotStored => "not_stored",
            Outcome::Overloaded => "overloaded",
            Outcome::Released => "released",
            Outcome::Observed => "observed",
        }
    }
}
