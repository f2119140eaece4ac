//! Who may do what on the admin listener, and from where.
//!
//! Every write there changes what a payment's retry receives, so the listener answers only
//! under a host it knows (an IP literal, `localhost`, an `admin_hosts` name: a DNS-rebinding
//! page can send none of them), takes writes only from the operator's own tools (no
//! `Origin` or `Sec-Fetch-Site` of another origin: another port is another origin), reads
//! bodies only as `application/json` (a page's "simple request" cannot send that type
//! without asking), knows each caller by name and role, and writes an audit line, under the
//! log target [`AUDIT_TARGET`], for every decision and every refused attempt by a known
//! operator.

use std::net::{IpAddr, SocketAddr};

use hyper::header::{HeaderName, HeaderValue, AUTHORIZATION, CONTENT_TYPE, HOST, ORIGIN};
use hyper::{Method, Request, Response};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::body::Body;
use crate::config::{parse_host_entry, Config, Role, ADMIN_TOKEN_NAME};
use crate::problem::Problem;

/// The log target of the audit lines: a filter that silences the rest (`RUST_LOG=warn`)
/// keeps them unless it names this target.
pub const AUDIT_TARGET: &str = "idemgate::audit";

/// Who is calling: their name, their role, and whether a `read` role may see bodies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Operator {
    /// `anonymous` on an open listener, `admin` for `admin_token`, else the entry's name.
    pub name: String,
    /// What they may do.
    pub role: Role,
    /// `read_bodies` (always true above `read`).
    pub read_bodies: bool,
}

impl Operator {
    /// Whether the listener is open (no token configured): anyone is `anonymous`.
    pub fn anonymous(&self) -> bool {
        self.name == "anonymous"
    }
}

/// The caller of `headers`: `None` when operators are configured and the request carries
/// none of their tokens. Every configured digest is compared, in constant time each.
pub fn identify(config: &Config, headers: &hyper::HeaderMap) -> Option<Operator> {
    if config.admin_token.is_none() && config.admin_operators.is_empty() {
        return Some(Operator {
            name: "anonymous".into(),
            role: Role::Admin,
            read_bodies: true,
        });
    }
    // The scheme is case-insensitive (RFC 9110 11.1).
    let given = headers
        .get(AUTHORIZATION)
        .map(HeaderValue::as_bytes)
        .filter(|v| v.len() > 7 && v[..7].eq_ignore_ascii_case(b"bearer "))
        .map(|v| &v[7..])?;
    let given: [u8; 32] = Sha256::digest(given).into();
    let mut found = None;
    if let Some(token) = &config.admin_token {
        let want: [u8; 32] = Sha256::digest(token.expose().as_bytes()).into();
        if bool::from(given.ct_eq(&want)) {
            found = Some(Operator {
                name: ADMIN_TOKEN_NAME.into(),
                role: Role::Admin,
                read_bodies: true,
            });
        }
    }
    for op in &config.admin_operators {
        let Some(want) = op.digest() else { continue };
        if bool::from(given.ct_eq(&want)) && found.is_none() {
            found = Some(Operator {
                name: op.name.trim().to_string(),
                role: op.role,
                read_bodies: op.read_bodies || op.role > Role::Read,
            });
        }
    }
    found
}

/// The request's authority: an absolute-form target's (and h2's `:authority`, which hyper
/// puts there), else `Host`.
pub fn authority<B>(req: &Request<B>) -> Option<String> {
    if let Some(a) = req.uri().authority() {
        return Some(a.as_str().to_string());
    }
    let mut hosts = req.headers().get_all(HOST).iter();
    let host = hosts.next()?;
    if hosts.next().is_some() {
        return None;
    }
    host.to_str().ok().map(str::to_string)
}

/// Whether the admin listener answers under `authority`: an IP literal (IPv4, bracketed
/// IPv6) or `localhost`, any port, or an `admin_hosts` name (with its port, if it gives
/// one).
pub fn host_allowed(authority: &str, admin_hosts: &[String]) -> bool {
    let (host, port) = match split_authority(authority) {
        Some(hp) => hp,
        None => return false,
    };
    if let Some(v6) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        return v6.parse::<std::net::Ipv6Addr>().is_ok();
    }
    if host.parse::<std::net::Ipv4Addr>().is_ok() || host.eq_ignore_ascii_case("localhost") {
        return true;
    }
    let host = host.to_ascii_lowercase();
    admin_hosts
        .iter()
        .filter_map(|e| parse_host_entry(e))
        .any(|(name, p)| name == host && p.is_none_or(|p| Some(p) == port))
}

/// `host[:port]` (the host with its brackets, if IPv6), or `None` when malformed.
fn split_authority(authority: &str) -> Option<(&str, Option<u16>)> {
    if authority.is_empty() || authority.contains('@') {
        return None;
    }
    let (host, port) = if authority.starts_with('[') {
        let close = authority.find(']')?;
        let (h, rest) = authority.split_at(close + 1);
        match rest {
            "" => (h, None),
            r => (h, Some(r.strip_prefix(':')?)),
        }
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        }
    };
    let port = match port {
        None => None,
        Some(p) => Some(p.parse::<u16>().ok()?),
    };
    (!host.is_empty()).then_some((host, port))
}

/// The 421 for an authority the listener does not answer to.
pub fn host_refused(authority: Option<&str>) -> Response<Body> {
    let detail = match authority {
        Some(a) => format!(
            "the admin listener answers only under an IP address, localhost or a name in admin_hosts; `{}` is none of them: add it to admin_hosts if it is yours",
            a.chars().take(100).collect::<String>()
        ),
        None => "the request names no host (Host, :authority): the admin listener answers only under an IP address, localhost or a name in admin_hosts".into(),
    };
    Problem::AdminHostRefused.response(detail, None, None)
}

/// Whether a method writes.
pub fn unsafe_method(m: &Method) -> bool {
    matches!(
        *m,
        Method::POST | Method::PUT | Method::PATCH | Method::DELETE
    )
}

const SEC_FETCH_SITE: HeaderName = HeaderName::from_static("sec-fetch-site");

/// Why a write comes from another origin, if it does: `Sec-Fetch-Site` other than
/// `same-origin`, or an `Origin` that is not `http://` and the request's own authority.
pub fn cross_origin<B>(req: &Request<B>, authority: &str) -> Option<String> {
    if let Some(site) = req.headers().get(SEC_FETCH_SITE) {
        if site.as_bytes() != b"same-origin" {
            return Some(format!(
                "Sec-Fetch-Site is `{}`: a write is taken only from the operator's own tools (curl, idemgate records), or a page of this very origin",
                String::from_utf8_lossy(site.as_bytes()).chars().take(40).collect::<String>()
            ));
        }
    }
    if let Some(origin) = req.headers().get(ORIGIN) {
        let own = format!("http://{authority}");
        if !origin.as_bytes().eq_ignore_ascii_case(own.as_bytes()) {
            return Some(format!(
                "Origin is `{}`, not this listener's own ({own}): a web page on another origin cannot write here",
                String::from_utf8_lossy(origin.as_bytes()).chars().take(100).collect::<String>()
            ));
        }
    }
    None
}

/// Whether `Content-Type` is `application/json` by its essence (parameters allowed).
pub fn is_json<B>(req: &Request<B>) -> bool {
    req.headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|essence| essence.trim().eq_ignore_ascii_case("application/json"))
}

/// The 415 for a body of another type.
pub fn not_json() -> Response<Body> {
    Problem::UnsupportedMediaType.response(
        "the admin API reads a body only as JSON: add the header `Content-Type: application/json`",
        None,
        None,
    )
}

/// The longest reason taken, in characters.
pub const MAX_REASON: usize = 500;

/// A decision's reason, checked: 1 to [`MAX_REASON`] characters, no control characters.
/// The error is what [`reason_refused`] says.
pub fn reason(given: Option<&str>) -> Result<String, &'static str> {
    match given {
        None => Err("no reason"),
        Some(r) if r.trim().is_empty() => Err("the reason is empty"),
        Some(r) if r.chars().count() > MAX_REASON => Err("the reason is too long"),
        Some(r) if r.chars().any(char::is_control) => Err("the reason holds a control character"),
        Some(r) => Ok(r.to_string()),
    }
}

/// The 400 `reason-required` for what [`reason`] found.
pub fn reason_refused(why: &str) -> Response<Body> {
    Problem::ReasonRequired.response(
        format!("{why}: every complete and release says why, as `?reason=...` (1 to {MAX_REASON} characters, no control characters), which the audit log keeps with the operator's name"),
        None,
        None,
    )
}

/// The 403 for a role that does not allow `what`.
pub fn role_forbidden(op: &Operator, what: &str, needs: Role) -> Response<Body> {
    Problem::RoleForbidden.response(
        format!(
            "operator `{}` has role `{}`; {what} needs role `{}`",
            op.name,
            op.role.as_str(),
            needs.as_str()
        ),
        None,
        None,
    )
}

/// Adds the headers every admin answer carries: nothing on it runs, frames or is kept.
pub fn secure(res: &mut Response<Body>) {
    let h = res.headers_mut();
    for (name, value) in [
        (
            "content-security-policy",
            "default-src 'none'; frame-ancestors 'none'",
        ),
        ("x-frame-options", "DENY"),
        ("x-content-type-options", "nosniff"),
        ("cache-control", "no-store"),
        ("referrer-policy", "no-referrer"),
    ] {
        h.insert(
            HeaderName::from_static(name),
            HeaderValue::from_static(value),
        );
    }
}

/// One audit line's facts.
pub struct Audit<'a> {
    /// Who.
    pub operator: &'a Operator,
    /// `complete`, `release`, `reload`, `scope_secret`.
    pub action: &'static str,
    /// Why, as they said.
    pub reason: Option<&'a str>,
    /// The record.
    pub record: Option<String>,
    /// Its state before (`unknown`, `in_progress`, `completed`, `absent`).
    pub before: Option<String>,
    /// `?force=true`.
    pub forced: bool,
    /// The status `complete` wrote.
    pub status_written: Option<u16>,
    /// The status of the admin API's answer.
    pub answered: u16,
    /// Where the request came from.
    pub peer: SocketAddr,
}

impl Audit<'_> {
    /// Writes the audit line and counts it; `result` is `done`, `refused` or `failed`.
    pub fn write(&self, metrics: &crate::metrics::Metrics) {
        let result = match self.answered {
            200..=299 => "done",
            500..=599 => "failed",
            _ => "refused",
        };
        metrics.operator_decision(self.action, result);
        let at = humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string();
        let peer: IpAddr = self.peer.ip();
        tracing::warn!(
            target: AUDIT_TARGET,
            actor = %self.operator.name,
            role = self.operator.role.as_str(),
            reason = ?self.reason.unwrap_or(""),
            record = self.record.as_deref().unwrap_or("-"),
            before = self.before.as_deref().unwrap_or("-"),
            action = self.action,
            forced = self.forced,
            status_written = ?self.status_written,
            answered = self.answered,
            result,
            peer = %peer,
            peer_port = self.peer.port(),
            at = %at,
            "operator {result}: {}",
            self.action
        );
    }
}

/// The log filter with the audit target kept at `info` unless the filter names it.
pub fn with_audit(filter: &str) -> String {
    if filter.contains(AUDIT_TARGET) {
        return filter.to_string();
    }
    let filter = filter.trim();
    if filter.is_empty() {
        format!("info,{AUDIT_TARGET}=info")
    } else {
        format!("{filter},{AUDIT_TARGET}=info")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_ip_literals_localhost_or_listed_names() {
        let listed = vec!["Gate.Internal".to_string(), "prom:9901".to_string()];
        for ok in [
            "127.0.0.1:9901",
            "10.1.2.3",
            "[::1]:9901",
            "[fe80::1]",
            "localhost:1234",
            "LOCALHOST",
            "gate.internal:80",
            "GATE.INTERNAL",
            "prom:9901",
        ] {
            assert!(host_allowed(ok, &listed), "{ok}");
        }
        for refused in [
            "evil.example:9901",
            "prom:9902",
            "prom",
            "",
            "127.0.0.1.evil.example",
            "[::1",
            "user@127.0.0.1",
            "localhost.evil.example",
            "127.0.0.1:99999",
        ] {
            assert!(!host_allowed(refused, &listed), "{refused}");
        }
    }

    #[test]
    fn reasons_are_short_printable_text() {
        assert!(reason(Some("ledger shows it paid")).is_ok());
        assert!(reason(None).is_err());
        assert!(reason(Some("")).is_err());
        assert!(reason(Some("a\nb")).is_err());
        assert!(reason(Some(&"x".repeat(500))).is_ok());
        assert!(reason(Some(&"x".repeat(501))).is_err());
    }

    #[test]
    fn the_audit_target_is_kept_unless_named() {
        assert_eq!(with_audit("warn"), "warn,idemgate::audit=info");
        assert_eq!(with_audit("idemgate::audit=off"), "idemgate::audit=off");
    }
}
