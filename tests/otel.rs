//! OpenTelemetry: the real binary exports its spans over OTLP/HTTP (protobuf) to a small
//! receiver here, which decodes them with the OpenTelemetry project's own message types.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;

const TRACE_ID: &str = "0af7651916cd43dd8448eb211c80319c";
const CALLER_SPAN: &str = "b7ad6b7169203331";
const KEY: &str = "key-otel-5521";
const SECRET: &str = "sk_live_otel_93c1d7";

/// Accepts OTLP/HTTP trace exports and keeps every span, with the service name.
#[derive(Clone, Default)]
struct Receiver {
    spans: Arc<Mutex<Vec<Span>>>,
    services: Arc<Mutex<Vec<String>>>,
    content_types: Arc<Mutex<Vec<String>>>,
}

impl Receiver {
    async fn start(&self) -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let me = self.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let me = me.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                        let me = me.clone();
                        async move {
                            let path = req.uri().path().to_string();
                            let ct = req
                                .headers()
                                .get("content-type")
                                .and_then(|v| v.to_str().ok())
                                .unwrap_or_default()
                                .to_string();
                            let body = req.into_body().collect().await.unwrap().to_bytes();
                            assert_eq!(path, "/v1/traces");
                            me.content_types.lock().unwrap().push(ct);
                            let export = ExportTraceServiceRequest::decode(body).unwrap();
                            for rs in export.resource_spans {
                                if let Some(r) = &rs.resource {
                                    for kv in &r.attributes {
                                        if kv.key == "service.name" {
                                            me.services.lock().unwrap().push(text(&kv.value));
                                        }
                                    }
                                }
                                for ss in rs.scope_spans {
                                    me.spans.lock().unwrap().extend(ss.spans);
                                }
                            }
                            Ok::<_, Infallible>(hyper::Response::new(
                                Full::new(bytes::Bytes::new()),
                            ))
                        }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        addr
    }

    fn spans(&self) -> Vec<Span> {
        self.spans.lock().unwrap().clone()
    }
}

fn text(v: &Option<opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match v.as_ref().and_then(|v| v.value.as_ref()) {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}

fn attr(span: &Span, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .map(|kv| text(&kv.value))
}

/// The binary, on the embedded store, exporting to `otlp`; stopped with SIGTERM.
struct Binary {
    child: std::process::Child,
    addr: SocketAddr,
    log: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Binary {
    fn start(upstream: &str, otlp: SocketAddr) -> Binary {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("stderr.log");
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_idemgate"))
            .env_clear()
            .env("RUST_LOG", "info")
            .env("IDEMGATE_LISTEN", addr.to_string())
            .env("IDEMGATE_ADMIN_LISTEN", admin.to_string())
            .env("IDEMGATE_UPSTREAM", upstream)
            .env("IDEMGATE_OTLP_ENDPOINT", format!("http://{otlp}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let b = Binary {
            child,
            addr,
            log,
            _dir: dir,
        };
        assert!(
            common::held_within(Duration::from_secs(15), || started(admin)),
            "idemgate did not start:\n{}",
            b.output()
        );
        b
    }

    fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM and wait: the buffered spans are exported before the process exits.
    fn stop(mut self) -> String {
        signal(self.child.id(), "TERM");
        assert!(
            common::exit_within(&mut self.child, Duration::from_secs(15)).is_some(),
            "no exit after SIGTERM"
        );
        self.output()
    }
}

impl Drop for Binary {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protected_requests_are_exported_as_spans_that_continue_the_callers_trace() {
    let receiver = Receiver::default();
    let otlp = receiver.start().await;
    let up = Upstream::start().await;
    let b = Binary::start(&up.url(), otlp);
    let c = client();
    let url = format!("http://{}/v1/transfers", b.addr);
    let traceparent = format!("00-{TRACE_ID}-{CALLER_SPAN}-01");
    let auth = format!("Bearer {SECRET}");
    let headers = [
        ("traceparent", traceparent.as_str()),
        ("authorization", auth.as_str()),
    ];
    let body = r#"{"amount":1250}"#;
    let first = post_url(&c, &url, Some(KEY), body, &headers).await;
    assert_eq!(first.status, 201);
    let replay = post_url(&c, &url, Some(KEY), body, &[("authorization", &auth)]).await;
    assert!(replay.replayed());
    let out = b.stop();
    let spans = receiver.spans();
    assert!(!spans.is_empty(), "nothing exported:\n{out}");
    assert!(receiver
        .content_types
        .lock()
        .unwrap()
        .iter()
        .all(|ct| ct == "application/x-protobuf"));
    assert!(receiver
        .services
        .lock()
        .unwrap()
        .iter()
        .all(|s| s == "idemgate"));

    let hex = |b: &[u8]| hex::encode(b);
    let requests: Vec<&Span> = spans
        .iter()
        .filter(|s| attr(s, "idemgate.outcome").is_some())
        .collect();
    assert_eq!(requests.len(), 2, "{spans:#?}");
    let fwd = requests
        .iter()
        .find(|s| attr(s, "idemgate.outcome").as_deref() == Some("forwarded"))
        .unwrap();
    // The caller's trace, continued under the caller's span.
    assert_eq!(hex(&fwd.trace_id), TRACE_ID);
    assert_eq!(hex(&fwd.parent_span_id), CALLER_SPAN);
    assert_eq!(fwd.name, "POST");
    assert_eq!(attr(fwd, "http.request.method").as_deref(), Some("POST"));
    assert_eq!(
        attr(fwd, "http.response.status_code").as_deref(),
        Some("201")
    );
    let record = attr(fwd, "idemgate.record_id").unwrap();
    assert_eq!(record.len(), 64, "{record}");
    // Children: claim, upstream, record, each under the request's span.
    let children: Vec<&str> = spans
        .iter()
        .filter(|s| s.parent_span_id == fwd.span_id)
        .map(|s| s.name.as_str())
        .collect();
    for step in ["claim", "upstream", "record"] {
        assert!(children.contains(&step), "no {step} span: {children:?}");
    }
    // The upstream continued the same trace, under idemgate's upstream span.
    let upstream_span = spans
        .iter()
        .find(|s| s.parent_span_id == fwd.span_id && s.name == "upstream")
        .unwrap();
    let seen = &up.seen()[0];
    let sent = &seen.headers["traceparent"][0];
    assert_eq!(
        sent,
        &format!("00-{TRACE_ID}-{}-01", hex(&upstream_span.span_id))
    );
    // The replay: the same record, its own trace, a claim and no upstream call.
    let rep = requests
        .iter()
        .find(|s| attr(s, "idemgate.outcome").as_deref() == Some("replayed"))
        .unwrap();
    assert_eq!(attr(rep, "idemgate.record_id"), Some(record));
    assert_ne!(hex(&rep.trace_id), TRACE_ID);
    let rep_children: Vec<&str> = spans
        .iter()
        .filter(|s| s.parent_span_id == rep.span_id)
        .map(|s| s.name.as_str())
        .collect();
    assert_eq!(rep_children, ["claim"]);
    // Never the key or a credential, in any span.
    let everything = format!("{spans:?}");
    assert!(!everything.contains(KEY), "the key was exported");
    assert!(!everything.contains(SECRET), "a credential was exported");
    assert_eq!(up.hits(), 1);
}
