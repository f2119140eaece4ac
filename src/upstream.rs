//! The client side: one pooled HTTP/1.1 client to the upstream, how requests are rewritten
//! on their way there (hop-by-hop headers out, `X-Forwarded-*` in), and how a failure is
//! classified, because that decides between "release the claim" and "hold it as unknown".

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use hyper::header::{
    HeaderMap, HeaderName, HeaderValue, CONNECTION, HOST, PROXY_AUTHORIZATION, TE, TRAILER,
    TRANSFER_ENCODING, UPGRADE,
};
use hyper::http::uri::PathAndQuery;
use hyper::{Request, Uri, Version};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::body::Body;
use crate::config::Upstream;

/// The pooled client to the upstream.
pub type UpstreamClient = Client<HttpConnector, Body>;

/// How long connecting to the upstream may take. It runs beside idemgate, so a connection
/// that takes longer than this is not coming; and a connect failure is the one failure that
/// proves the request was not sent (502, the claim released), so it must not wait for
/// `upstream_timeout`.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Builds the client. Connecting has its own timeout, so a black-holed upstream is reported
/// as unreachable (provably not sent) rather than as a timeout.
///
/// An idle connection is reused for at most `idle_timeout` (`upstream_idle_timeout`). An
/// upstream closes idle connections on a timer of its own, and a request written onto a
/// connection at the moment the upstream closes it fails in a way that cannot be told from
/// a request the upstream read (see [`classify`]): its outcome is unknown, and the key is
/// held for an operator although nothing ran. So idemgate must give up an idle connection
/// before the upstream does. hyper-util's pool enforces the timeout at checkout (an idle
/// connection older than it is dropped there, not only by the periodic reaper), and a
/// connection goes idle only once its answer has been read, after the upstream started its
/// own timer: a connection idemgate reuses has been idle for less than `idle_timeout` on the
/// upstream's clock too, plus the time the answer took to arrive.
///
/// Requests that hyper hands back unwritten, because the pooled connection turned out to be
/// closed before any byte of the request went out, are retried on another connection by
/// hyper-util (`retry_canceled_requests`, on by default, and left on: those are provably
/// unsent).
pub fn client(connect_timeout: Duration, idle_timeout: Duration) -> UpstreamClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(connect_timeout));
    connector.enforce_http(true);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(idle_timeout)
        .retry_canceled_requests(true)
        .build(connector)
}

/// Header names that are hop-by-hop by definition (RFC 9110 7.6.1, plus the legacy
/// `Keep-Alive` and `Proxy-Connection`). `Connection` may name more.
///
/// Names, not strings: removing by `&str` parsed and validated each of the eight names
/// again on every call, twice per request (about 5,000 instructions per request in
/// callgrind, a tenth of a pass-through's user-space work).
static HOP_BY_HOP: [HeaderName; 8] = [
    CONNECTION,
    HeaderName::from_static("proxy-connection"),
    HeaderName::from_static("keep-alive"),
    TE,
    TRAILER,
    TRANSFER_ENCODING,
    UPGRADE,
    PROXY_AUTHORIZATION,
];

/// Removes hop-by-hop headers, including every header that `Connection` names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most messages carry none of them: one pass over the names present is cheaper than a
    // hashed lookup for each of the eight.
    if !headers.keys().any(|k| HOP_BY_HOP.contains(k)) {
        return;
    }
    let named: Vec<HeaderName> = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in &HOP_BY_HOP {
        headers.remove(name);
    }
}

/// Whether a header is hop-by-hop (static list only; call after [`strip_hop_by_hop`]).
pub fn is_hop_by_hop(name: &HeaderName) -> bool {
    HOP_BY_HOP.contains(name)
}

/// Rewrites a client request into the upstream's: absolute URI on the upstream origin,
/// HTTP/1.1, hop-by-hop headers removed, `Host` set to the upstream, `X-Forwarded-*` added.
pub fn prepare(req: &mut Request<Body>, upstream: &Upstream, client: SocketAddr) {
    let original_host = req.headers().get(HOST).cloned().or_else(|| {
        // HTTP/2 clients send :authority (in the URI) instead of Host; read it before the
        // URI is rewritten to the upstream's.
        req.uri()
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
    });
    // The request's own path and query, as parsed already: only the origin changes.
    let mut parts = req.uri().clone().into_parts();
    parts.scheme = Some(upstream.scheme.clone());
    parts.authority = Some(upstream.authority.clone());
    if parts.path_and_query.is_none() {
        parts.path_and_query = Some(PathAndQuery::from_static("/"));
    }
    // Scheme, authority and path are all set, so this cannot fail.
    if let Ok(uri) = Uri::from_parts(parts) {
        *req.uri_mut() = uri;
    }
    *req.version_mut() = Version::HTTP_11;
    let h = req.headers_mut();
    strip_hop_by_hop(h);
    h.insert(HOST, upstream.host.clone());
    let xff = HeaderName::from_static("x-forwarded-for");
    let forwarded_for = match h.get(&xff).and_then(|v| v.to_str().ok()) {
        Some(prev) => HeaderValue::from_str(&format!("{prev}, {}", client.ip())).ok(),
        None => ip_value(client.ip()),
    };
    if let Some(v) = forwarded_for {
        h.insert(xff, v);
    }
    h.insert(
        HeaderName::from_static("x-forwarded-proto"),
        HeaderValue::from_static("http"),
    );
    if let Some(host) = original_host {
        h.insert(HeaderName::from_static("x-forwarded-host"), host);
    }
}

/// An IP address as a header value. IPv4, nearly every client of a sidecar, is written by
/// hand: `Display` for addresses goes through the formatting machinery, about a tenth of a
/// pass-through's instructions.
fn ip_value(ip: IpAddr) -> Option<HeaderValue> {
    match ip {
        IpAddr::V4(v4) => {
            let mut buf = [0u8; 15];
            let mut n = 0;
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    buf[n] = b'.';
                    n += 1;
                }
                if octet >= 100 {
                    buf[n] = b'0' + octet / 100;
                    n += 1;
                }
                if octet >= 10 {
                    buf[n] = b'0' + (octet / 10) % 10;
                    n += 1;
                }
                buf[n] = b'0' + octet % 10;
                n += 1;
            }
            HeaderValue::from_bytes(&buf[..n]).ok()
        }
        IpAddr::V6(_) => HeaderValue::from_str(&ip.to_string()).ok(),
    }
}

/// How an upstream exchange failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// Nothing was sent: connection refused, DNS, connect timeout.
    NotSent,
    /// Something may have been sent and no complete answer came back.
    Ambiguous,
}

/// Classifies a client error: [`Failure::NotSent`] only when the error proves that not one
/// byte of the request reached the upstream, because that releases the key and lets a
/// retry execute; anything else may have been read and executed.
///
/// What hyper and hyper-util document, and what follows:
///
/// - `legacy::Error::is_connect()`: "an error from `Connect`": the connector failed
///   (refused, DNS, connect timeout), so there was no connection to write on. Not sent.
/// - `hyper::Error::is_canceled()`: "a `Request` that was canceled ... dropped before it
///   can be dispatched to the connection, for example because the connection was not
///   ready". In hyper's client every such error is made where the request is handed back
///   to the caller unwritten (hyper's `TrySendError` carries the message back: a request
///   still queued when the connection closed, or a connection that was not ready), and
///   hyper-util then reports kind `Canceled`, or, on a reused connection, retries it on
///   another one (`retry_canceled_requests`). Not sent.
/// - `hyper::Error::is_incomplete_message()`: "the connection reported EOF while hyper's
///   HTTP state indicates more of the message needed to be transmitted", documented with
///   "a request is written on a connection, and the next `read` reports EOF (perhaps a
///   server just closed an 'idle' connection)". The request was written: the upstream may
///   have read it and executed it, then closed without answering. Ambiguous, even when the
///   connection was idle a moment before: that race is avoided by
///   `upstream_idle_timeout` (see [`client`]), not explained away here.
/// - I/O errors while writing (reset, broken pipe), errors reading the answer, timeouts:
///   part or all of the request may have been read. Ambiguous.
pub fn classify(e: &hyper_util::client::legacy::Error) -> Failure {
    use std::error::Error as _;
    let canceled = e
        .source()
        .and_then(|s| s.downcast_ref::<hyper::Error>())
        .is_some_and(hyper::Error::is_canceled);
    if e.is_connect() || canceled {
        Failure::NotSent
    } else {
        Failure::Ambiguous
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn ip_values_read_as_display_writes_them() {
        for ip in [
            "0.0.0.0",
            "127.0.0.1",
            "10.20.30.40",
            "192.168.100.255",
            "1.2.3.4",
            "99.100.9.10",
            "::1",
            "2001:db8::8a2e:370:7334",
            "::ffff:10.0.0.1",
        ] {
            let addr: IpAddr = ip.parse().unwrap();
            assert_eq!(ip_value(addr).unwrap(), addr.to_string().as_str(), "{ip}");
        }
    }

    use super::*;

    #[test]
    fn strips_hop_by_hop_and_connection_named_headers() {
        let mut h = HeaderMap::new();
        h.insert(CONNECTION, HeaderValue::from_static("close, X-Secret-Hop"));
        h.insert("x-secret-hop", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("te", HeaderValue::from_static("trailers"));
        h.insert("upgrade", HeaderValue::from_static("h2c"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-kept"));
    }
}
