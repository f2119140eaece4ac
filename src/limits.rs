//! Bounds that configuration validation and the runtime both need, kept below both so that
//! `config` imports neither the proxy nor the admin listener.

/// Room for a recorded answer's head: its status, and headers as hyper's client reads them
/// at most (its read buffer is 400 KiB; answers with more than 64 KiB of headers are rare
/// enough to be recorded without their body).
pub const ANSWER_HEAD_ROOM: usize = 64 * 1024;

/// The largest request body the admin API takes (a `complete` with its answer).
pub const ADMIN_MAX_BODY: usize = 16 * 1024 * 1024;
