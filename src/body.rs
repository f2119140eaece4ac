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
        hint.set_lower(hint.lower() + n);
        if let Some(upper) = hint.upper() {
            hint.set_upper(upper + n);
        }
        hint
    }
}
