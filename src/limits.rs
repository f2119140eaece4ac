//! Bounds that configuration validation and the runtime both need, kept below both so that
//! `config` imports neither the proxy nor the admin listener.

/// Room for a recorded answer's head beyond its body, reserved with every claim: its
/// headers, as [`recorded_header_size`] counts them, and an envelope's own bytes. An answer
/// whose headers need more (hyper's client reads up to 400 KiB of them) is recorded
/// without those beyond [`RECORDED_HEADERS_ROOM`], and its replay says how many were left
/// out ([`HEADERS_OMITTED`]): an executed request's answer always fits its reservation.
pub const ANSWER_HEAD_ROOM: usize = 64 * 1024;

/// What a record's headers may take of [`ANSWER_HEAD_ROOM`]: the rest (1 KiB) is for the
/// envelope of a sealed or compressed record (version, flags, key id, nonce, tag, lengths)
/// and the [`HEADERS_OMITTED`] header itself.
pub const RECORDED_HEADERS_ROOM: usize = ANSWER_HEAD_ROOM - 1024;

/// The header a replay carries when its record left some of the answer's headers out:
/// how many.
pub const HEADERS_OMITTED: &str = "idemgate-headers-omitted";

/// What one recorded header counts against the embedded store's byte cap (and against
/// [`RECORDED_HEADERS_ROOM`]): its name and value, and the pair that holds them.
pub fn recorded_header_size(name: &str, value: &[u8]) -> usize {
    std::mem::size_of::<(String, bytes::Bytes)>() + name.len() + value.len()
}

/// Room taken for a replay's body before its claim goes to the store (at most the route's
/// `max_response_bytes`), given back as soon as the claim answers: a recorded body up to
/// this size comes back with the claim's own reply, and a longer one is asked for by its
/// length before the store reads it (one more round trip on Redis and PostgreSQL).
pub const REPLAY_INLINE: usize = 16 * 1024;

/// The largest request body the admin API takes (a `complete` with its answer).
pub const ADMIN_MAX_BODY: usize = 16 * 1024 * 1024;
