//! `idemgate probe URL`: one HTTP/1.1 GET with a deadline, for container health checks. The
//! runtime image has no curl, and a health check should not need a shell or another binary.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Why a probe got no status.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// The URL is not `http://host:port/path`.
    #[error("not an http:// URL with a host: {0}")]
    Url(String),
    /// Connecting, writing or reading failed or took too long.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The answer did not start with an HTTP status line.
    #[error("not an HTTP answer")]
    NotHttp,
}

/// GETs `url` (plain http) within `timeout`, with `Authorization: Bearer <token>` if given,
/// and returns the status code.
pub fn get(url: &str, token: Option<&str>, timeout: Duration) -> Result<u16, ProbeError> {
    let uri: hyper::Uri = url.parse().map_err(|_| ProbeError::Url(url.into()))?;
    let (Some("http"), Some(authority)) = (uri.scheme_str(), uri.authority()) else {
        return Err(ProbeError::Url(url.into()));
    };
    let host = authority.host();
    let port = authority.port_u16().unwrap_or(80);
    let until = Instant::now() + timeout;
    let left = || {
        until
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    };
    let addr = (host, port)
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| ProbeError::Url(url.into()))?;
    let mut s = TcpStream::connect_timeout(&addr, left())?;
    s.set_write_timeout(Some(left()))?;
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let mut req = format!("GET {path} HTTP/1.1\r\nhost: {authority}\r\nconnection: close\r\n");
    if let Some(t) = token {
        req.push_str(&format!("authorization: Bearer {t}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes())?;
    // The status line is all we need: "HTTP/1.1 200 OK".
    let mut head = [0u8; 64];
    let mut n = 0;
    while n < 12 {
        s.set_read_timeout(Some(left()))?;
        match s.read(&mut head[n..])? {
            0 => break,
            k => n += k,
        }
    }
    let line = std::str::from_utf8(&head[..n]).map_err(|_| ProbeError::NotHttp)?;
    line.strip_prefix("HTTP/1.")
        .and_then(|rest| rest.get(2..5))
        .and_then(|code| code.parse().ok())
        .ok_or(ProbeError::NotHttp)
}
