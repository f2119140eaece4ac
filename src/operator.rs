//! Operator resolution on the admin listener: walking the records by state
//! (`GET /records?state=unknown`), finding a request's record without computing its id by
//! hand (`POST /records/lookup`), and resolving an `unknown` record with the outcome an
//! operator found (`POST /records/{id}/complete`), after which its retries get that answer
//! replayed.
//!
//! A lookup computes the id exactly as the proxy does, with the proxy's own pieces: the
//! route's policy ([`Settings::route`](crate::config::Settings::route)), its tenant source ([`tenant::resolve`]), its key
//! headers ([`key::parse_any`]) and the proxy's [`Scoper`].

use std::sync::Arc;

use base64::Engine as _;
use bytes::Bytes;
use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use serde::Deserialize;

use crate::config::Live;
use crate::key::{self, RecordId};
use crate::scope::client_cert::Authorities;
use crate::scope::Scoper;
use crate::store::{RecordState, StoredResponse};
use rustls::pki_types::pem::PemObject;

/// What a lookup needs: the proxy's settings (those in force, as a reload leaves them) and
/// record-id scoper.
#[derive(Clone)]
pub struct Resolver {
    settings: Arc<Live>,
    scoper: Scoper,
    // The TLS listener's client CAs (`tls_client_ca_file`), to verify a certificate that a
    // lookup names; `None` without them.
    authorities: Option<Arc<Authorities>>,
}

/// `POST /records/lookup`: a request as the client sent it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Lookup {
    /// As the client sent it (methods are case-sensitive).
    pub method: String,
    /// The request path as sent (a query is ignored, as the proxy ignores it for scope).
    pub path: String,
    /// The key, as the client sent it in its key header.
    pub key: String,
    /// The headers that name the tenant (`Authorization`, the route's `tenant_headers`).
    #[serde(default)]
    pub headers: std::collections::BTreeMap<String, String>,
    /// On a `tenant_client_cert` route: the client's certificate, PEM (its chain after it
    /// when the client sent one), verified as the listener verifies it.
    #[serde(default)]
    pub client_certificate: Option<String>,
}

/// `POST /records/{id}/complete`: the outcome an operator found.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Outcome {
    /// The status retries will get.
    pub status: u16,
    /// Their headers.
    #[serde(default)]
    pub headers: std::collections::BTreeMap<String, String>,
    /// Their body, as text...
    pub body: Option<String>,
    /// ... or as base64 bytes.
    pub body_base64: Option<String>,
    /// Why (also `?reason=`, which wins): the audit log keeps it.
    #[serde(default)]
    pub reason: Option<String>,
}

impl Resolver {
    /// Over the proxy's settings and scoper.
    pub fn new(
        settings: Arc<Live>,
        scoper: Scoper,
        authorities: Option<Arc<Authorities>>,
    ) -> Resolver {
        Resolver {
            settings,
            scoper,
            authorities,
        }
    }

    /// The id of the record that `req` belongs to, or why it has none.
    pub fn record_id(&self, req: &Lookup) -> Result<RecordId, String> {
        let path = req.path.split('?').next().unwrap_or_default();
        let settings = self.settings.get();
        let routed = settings.route(path).map_err(|e| format!("path: {e}"))?;
        if let Some(e) = &routed.refused {
            return Err(format!("path: {e}"));
        }
        let policy = routed.policy;
        let mut headers = HeaderMap::new();
        for (name, value) in &req.headers {
            let name = HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| format!("`{name}` is not a header name"))?;
            let value = HeaderValue::from_str(value)
                .map_err(|_| format!("the value of `{name}` is not a header value"))?;
            headers.append(name, value);
        }
        let cert = match &req.client_certificate {
            None => None,
            Some(pem) => {
                let authorities = self
                    .authorities
                    .as_ref()
                    .ok_or("`client_certificate`: the listener verifies no client certificates (no tls_client_ca_file)")?;
                let chain = rustls::pki_types::CertificateDer::pem_slice_iter(pem.as_bytes())
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| format!("`client_certificate` is not PEM: {e}"))?;
                Some(
                    authorities
                        .identify_for_lookup(&chain)
                        .map_err(|e| format!("`client_certificate`: {e}"))?,
                )
            }
        };
        let tenant = match settings.tenant(&headers, cert.as_ref(), policy) {
            Ok(Some(t)) => t,
            Ok(None) => {
                return Err(
                    "no tenant in `headers`, and the route does not share an anonymous scope"
                        .into(),
                )
            }
            Err(e) => return Err(format!("tenant: {e}")),
        };
        // The key is read as the proxy reads it from the route's first key header.
        let mut key_headers = HeaderMap::new();
        let first = policy
            .key_headers
            .first()
            .cloned()
            .unwrap_or_else(|| HeaderName::from_static(key::HEADER));
        let value = HeaderValue::from_str(&req.key)
            .map_err(|_| "`key` is not a header value".to_string())?;
        key_headers.insert(first.clone(), value);
        let key = key::parse_any(&key_headers, &[first], policy.max_key_length)
            .map_err(|e| format!("key: {e}"))?
            .ok_or_else(|| "`key` is empty".to_string())?;
        let scope_path = routed.normalized.as_deref().unwrap_or(path);
        Ok(self
            .scoper
            .record_id(&tenant, &req.method, scope_path, &key))
    }
}

impl Outcome {
    /// The answer to record, or what is wrong with it.
    pub fn response(&self) -> Result<StoredResponse, String> {
        if !(100..=599).contains(&self.status) {
            return Err("`status` must be between 100 and 599".into());
        }
        let mut headers = Vec::new();
        for (name, value) in &self.headers {
            let n = HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| format!("`{name}` is not a header name"))?;
            // Framing belongs to each replay's own connection: a stored Content-Length
            // declared 999 bytes for an 8-byte body.
            if n == hyper::header::CONTENT_LENGTH || crate::upstream::is_hop_by_hop(&n) {
                return Err(format!(
                    "`{name}` is a framing or hop-by-hop header, which each replay sets for itself; leave it out"
                ));
            }
            HeaderValue::from_str(value)
                .map_err(|_| format!("the value of `{name}` is not a header value"))?;
            headers.push((n.as_str().to_string(), Bytes::from(value.clone())));
        }
        let body = match (&self.body, &self.body_base64) {
            (Some(_), Some(_)) => return Err("send `body` or `body_base64`, not both".into()),
            (Some(text), None) => Bytes::from(text.clone()),
            (None, Some(b64)) => base64::engine::general_purpose::STANDARD
                .decode(b64)
                .map(Bytes::from)
                .map_err(|_| "`body_base64` is not base64".to_string())?,
            (None, None) => Bytes::new(),
        };
        Ok(StoredResponse {
            status: self.status,
            headers,
            body,
        })
    }
}

/// Reads `state=` of a listing's query.
pub fn parse_state(v: &str) -> Option<RecordState> {
    match v {
        "unknown" => Some(RecordState::Unknown),
        "in_progress" => Some(RecordState::InProgress),
        "completed" => Some(RecordState::Completed),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(headers: &[(&str, &str)]) -> Outcome {
        Outcome {
            status: 201,
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            body: Some("{\"ok\":1}".into()),
            body_base64: None,
            reason: None,
        }
    }

    #[test]
    fn framing_and_hop_by_hop_headers_are_refused_by_name() {
        for name in [
            "content-length",
            "Content-Length",
            "transfer-encoding",
            "connection",
            "keep-alive",
            "upgrade",
            "te",
            "trailer",
        ] {
            let err = outcome(&[(name, "999")]).response().unwrap_err();
            assert!(err.contains(name), "{name}: {err}");
        }
        let ok = outcome(&[("content-type", "application/json")])
            .response()
            .unwrap();
        assert_eq!(ok.headers.len(), 1);
    }
}
