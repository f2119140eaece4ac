//! Reading an upstream's answer to a protected request: into memory up to the route's
//! `max_response_bytes`, so that it can be recorded, and no further. A larger answer is
//! handed on as what was read plus the rest of the stream: it still reaches its client in
//! full, and idemgate holds no more than the limit of it at any moment. Room for what is
//! read is asked for before it is read (see [`read`]).

use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::header::CONTENT_LENGTH;
use hyper::HeaderMap;

/// An upstream answer's body, as far as it was read.
pub enum Answer<B = Incoming> {
    /// The whole body, within the limit: it can be recorded.
    Whole(Bytes),
    /// More than the limit: the frames read (the limit, and the frame that passed it), and
    /// the rest still to be streamed.
    TooLarge {
        /// What was read, in the frames it came in (not copied into one buffer).
        read: Vec<Bytes>,
        /// The rest of the body.
        rest: B,
    },
}

/// Reads `body` up to `max` bytes. An answer that declares a larger `Content-Length` is
/// not read at all. Before anything is read, `room` is awaited with the bytes the answer
/// may hold: its declared length, or without one the limit; and again, should a frame
/// take it beyond that (an answer found too large).
pub async fn read<B, R, F>(
    headers: &HeaderMap,
    mut body: B,
    max: u64,
    mut room: R,
) -> Result<Answer<B>, B::Error>
where
    B: hyper::body::Body<Data = Bytes> + Unpin,
    R: FnMut(usize) -> F,
    F: std::future::Future<Output = ()>,
{
    let declared = headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max) {
        return Ok(Answer::TooLarge {
            read: Vec::new(),
            rest: body,
        });
    }
    let max = usize::try_from(max).unwrap_or(usize::MAX);
    let first = declared
        .and_then(|n| usize::try_from(n).ok())
        .map_or(max, |n| n.min(max));
    let mut read: Vec<Bytes> = Vec::new();
    let mut held = 0usize;
    room(first).await;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            // Trailers are not forwarded on protected answers (nor recorded).
            continue;
        };
        held += data.len();
        read.push(data);
        if held > first {
            room(held).await;
        }
        if held > max {
            return Ok(Answer::TooLarge { read, rest: body });
        }
    }
    // The usual answer is one frame: it is kept as is, without a copy.
    Ok(Answer::Whole(match read.len() {
        0 => Bytes::new(),
        1 => read.swap_remove(0),
        _ => {
            let mut buf = BytesMut::with_capacity(held);
            for chunk in read {
                buf.extend_from_slice(&chunk);
            }
            buf.freeze()
        }
    }))
}
