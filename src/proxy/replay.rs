//! The replay of a recorded answer: its status, headers and body as stored, marked
//! `Idempotent-Replayed: true`.

use hyper::header::{HeaderName, HeaderValue, CONTENT_LENGTH, DATE, SET_COOKIE};
use hyper::{Response, StatusCode};

use crate::body::{self, Body};
use crate::store::StoredResponse;
use crate::upstream;

use super::REPLAYED;

/// Builds the replay of a stored response.
pub(super) fn replay(stored: StoredResponse) -> Response<Body> {
    let mut res = Response::new(body::chunked(stored.body));
    *res.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::BAD_GATEWAY);
    let h = res.headers_mut();
    for (name, value) in stored.headers {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_maybe_shared(value),
        ) {
            // Framing is the replay's own: a stored `Content-Length` (from any version or
            // any way in) could contradict the body.
            if !upstream::is_hop_by_hop(&n) && n != SET_COOKIE && n != DATE && n != CONTENT_LENGTH {
                h.append(n, v);
            }
        }
    }
    h.insert(REPLAYED, HeaderValue::from_static("true"));
    res
}
