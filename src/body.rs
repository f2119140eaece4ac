//! The one body type that flows through idemgate in both directions: streamed bodies for
//! pass-through, buffered ones for protected requests and synthetic responses.

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};

/// Any error a body can fail with.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A boxed body, streamed or buffered.
pub type Body = BoxBody<Bytes, BoxError>;

/// A body that is already in memory.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into()).map_err(|e| match e {}).boxed()
}

/// Boxes any body whose error converts into [`BoxError`].
pub fn boxed<B>(body: B) -> Body
where
    B: hyper::body::Body<Data = Bytes> + Send + Sync + 'static,
    B::Error: Into<BoxError>,
{
    body.map_err(Into::into).boxed()
}

/// A body that yields the frames of `prefix` first, then what is left of `rest`: an answer
/// read into memory up to a limit and streamed on from where the reading stopped.
pub fn prefixed<B>(prefix: Vec<Bytes>, rest: B) -> Body
where
    B: hyper::body::Body<Data = Bytes> + Unpin + Send + Sync + 'static,
    B::Error: Into<BoxError>,
{
    Prefixed {
        prefix: prefix.into(),
        rest,
    }
    .map_err(Into::into)
    .boxed()
}

struct Prefixed<B> {
    prefix: std::collections::VecDeque<Bytes>,
    rest: B,
}

impl<B> hyper::body::Body for Prefixed<B>
where
    B: hyper::body::Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, B::Error>>> {
        if let Some(chunk) = self.prefix.pop_front() {
            return std::task::Poll::Ready(Some(Ok(hyper::body::Frame::data(chunk))));
        }
        std::pin::Pin::new(&mut self.rest).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_empty() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        let mut hint = self.rest.size_hint();
        let n: u64 = self.prefix.iter().map(|p| p.len() as u64).sum();
        // The upper bound first: `set_lower` panics on a lower bound above the upper one,
        // which raising the lower first would make of any exact hint (a body read in part,
        // whose rest knows its remaining length).
        if let Some(upper) = hint.upper() {
            hint.set_upper(upper.saturating_add(n));
        }
        hint.set_lower(hint.lower().saturating_add(n));
        hint
    }
}

/// `body`, holding `held` (a slot, bytes of a budget) until the body is dropped: after its
/// last frame was taken, or with its connection.
pub fn holding<T: Send + Sync + Unpin + 'static>(body: Body, held: T) -> Body {
    Holding { body, _held: held }.boxed()
}

struct Holding<T> {
    body: Body,
    _held: T,
}

impl<T> hyper::body::Body for Holding<T>
where
    T: Unpin,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, BoxError>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// How much of an in-memory answer is handed to hyper at a time. hyper takes the next
/// frame only once its write buffer has room, so a body held in our hands until its last
/// frame is a body not yet written: what [`holding`] counts stays counted while a client
/// is slow to read. The frames are slices of one buffer: nothing is copied.
pub const FRAME: usize = 64 * 1024;

/// A body already in memory, handed out [`FRAME`] bytes at a time.
pub fn chunked(bytes: Bytes) -> Body {
    if bytes.len() <= FRAME {
        return full(bytes);
    }
    Chunked {
        rest: bytes,
        length: true,
    }
    .boxed()
}

/// A body in memory whose length its client is not told (chunked on HTTP/1.1): the bytes
/// of an answer that nothing said was whole go on as they came, without a `Content-Length`
/// that would vouch for them.
pub fn without_length(bytes: Bytes) -> Body {
    Chunked {
        rest: bytes,
        length: false,
    }
    .boxed()
}

struct Chunked {
    rest: Bytes,
    // Whether its size hint is exact (hyper then writes it as the `Content-Length`).
    length: bool,
}

impl hyper::body::Body for Chunked {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, BoxError>>> {
        if self.rest.is_empty() {
            return std::task::Poll::Ready(None);
        }
        let n = self.rest.len().min(FRAME);
        let frame = self.rest.split_to(n);
        std::task::Poll::Ready(Some(Ok(hyper::body::Frame::data(frame))))
    }

    fn is_end_stream(&self) -> bool {
        self.rest.is_empty()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        let n = self.rest.len() as u64;
        if self.length {
            return hyper::body::SizeHint::with_exact(n);
        }
        let mut hint = hyper::body::SizeHint::new();
        hint.set_lower(n);
        hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::body::Body as _;

    #[test]
    fn a_prefixed_body_adds_its_prefix_to_an_exact_hint_without_panicking() {
        // The rest of a body read in part: exactly 5 bytes left, 7 already read.
        let rest = Full::new(Bytes::from_static(b"world"));
        let body = prefixed(vec![Bytes::from_static(b"hello, ")], rest);
        let hint = body.size_hint();
        assert_eq!((hint.lower(), hint.upper()), (12, Some(12)));
        // A rest of unknown length stays unbounded above.
        let hint = prefixed(vec![Bytes::from_static(b"ab")], Unknown).size_hint();
        assert_eq!((hint.lower(), hint.upper()), (2, None));
    }

    /// A body that says nothing of its length.
    struct Unknown;

    impl hyper::body::Body for Unknown {
        type Data = Bytes;
        type Error = BoxError;

        fn poll_frame(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, BoxError>>> {
            std::task::Poll::Pending
        }
    }
}
