//! Reading a protected request's body: up to `max_body_bytes`, within
//! `body_read_timeout`, every byte taken from the budget of held bodies as it arrives.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;

use crate::admission::{Buffered, Refusal as NotAdmitted};

use super::decision::Refusal;

/// Why a protected body was not read whole.
#[derive(Clone, Copy, Debug)]
pub(super) enum BodyEnd {
    /// Bodies held for clients reached `max_buffered_bytes`.
    BuffersFull,
    /// It carries trailer fields. A trailer (a checksum, a signature) is part of what the
    /// upstream acts on but not of the fingerprint: forwarded, a retry with another would
    /// replay the first; dropped, the upstream would act on a request the client did not
    /// send.
    Trailers,
    /// Longer than the limit.
    TooLarge,
    /// It ended early or was malformed.
    Broken,
    /// Not complete within `body_read_timeout`.
    Timeout,
}

impl BodyEnd {
    /// What enforcing answers a body that ended so (`max`: `max_body_bytes`).
    pub(super) fn refusal(self, max: u64) -> Refusal {
        match self {
            BodyEnd::BuffersFull => Refusal::Overloaded(NotAdmitted::BuffersFull),
            BodyEnd::Trailers => Refusal::TrailersNotSupported,
            BodyEnd::TooLarge => Refusal::BodyTooLarge {
                max,
                decoded: false,
            },
            BodyEnd::Broken => Refusal::BodyUnreadable,
            BodyEnd::Timeout => Refusal::BodyTimeout,
        }
    }
}

/// What was read of a body: all of it, or its chunks up to where reading stopped (every
/// chunk that arrived, so that observe mode can forward them with the rest).
pub(super) struct ReadBody {
    pub(super) chunks: Vec<Bytes>,
    pub(super) received: usize,
}

impl ReadBody {
    pub(super) fn into_bytes(mut self) -> Bytes {
        match self.chunks.len() {
            0 => Bytes::new(),
            1 => self.chunks.pop().unwrap_or_default(),
            _ => {
                let mut all = bytes::BytesMut::with_capacity(self.received);
                for c in &self.chunks {
                    all.extend_from_slice(c);
                }
                all.freeze()
            }
        }
    }
}

/// Reads `incoming` up to `max` bytes within `timeout`, taking what arrives beyond
/// `reserved` bytes from `held` (the budget of bodies held for clients).
pub(super) async fn read_up_to(
    incoming: &mut Incoming,
    max: usize,
    held: &mut Buffered,
    mut reserved: usize,
    timeout: Duration,
) -> (ReadBody, Result<(), BodyEnd>) {
    let mut read = ReadBody {
        chunks: Vec::new(),
        received: 0,
    };
    let frames = async {
        while let Some(frame) = incoming.frame().await {
            let Ok(frame) = frame else {
                return Err(BodyEnd::Broken);
            };
            match frame.into_data() {
                Ok(data) => {
                    read.received += data.len();
                    read.chunks.push(data);
                    if read.received > reserved {
                        if held.grow(read.received - reserved).is_err() {
                            return Err(BodyEnd::BuffersFull);
                        }
                        reserved = read.received;
                    }
                    if read.received > max {
                        return Err(BodyEnd::TooLarge);
                    }
                }
                Err(frame) => {
                    if frame.trailers_ref().is_some_and(|t| !t.is_empty()) {
                        return Err(BodyEnd::Trailers);
                    }
                }
            }
        }
        Ok(())
    };
    let ended = tokio::time::timeout(timeout, frames)
        .await
        .unwrap_or(Err(BodyEnd::Timeout));
    (read, ended)
}
