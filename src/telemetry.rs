//! Tracing to OpenTelemetry: with `otlp_endpoint` set (or the standard
//! `OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`), every protected
//! request becomes a span exported over OTLP/HTTP with protobuf, with child spans for the
//! claim, the upstream exchange and the record. An incoming W3C `traceparent` is continued,
//! and the upstream receives the trace with the upstream span as its parent.
//!
//! Attributes: `idemgate.outcome`, `http.route`, `idemgate.record_id`,
//! `http.request.method`, `http.response.status_code`, `idemgate.request_id`. Never the
//! key's raw value, a body or a credential: the record id is a hash.
//!
//! Off (the default), nothing here runs on the request path but one relaxed atomic load:
//! the spans are [`Span::none`], which are never entered, and headers are not read.
//!
//! The standard variables are read by the OpenTelemetry crates themselves:
//! `OTEL_SERVICE_NAME` (default here: `idemgate`), `OTEL_RESOURCE_ATTRIBUTES`,
//! `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_EXPORTER_OTLP_TIMEOUT`, `OTEL_TRACES_SAMPLER(_ARG)`,
//! `OTEL_BSP_*`; `OTEL_SDK_DISABLED=true` turns tracing off.
//!
//! The exporter runs on a thread of the SDK's batch processor; its HTTP requests go through
//! idemgate's own hyper client on a one-thread runtime of their own, so exporting never
//! competes with the serving runtime and needs no second HTTP stack.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::header::HeaderMap;
use hyper::{Method, Request, Response};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_http::{HeaderExtractor, HeaderInjector, HttpClient, HttpError};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};
use opentelemetry_sdk::Resource;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The `tracing` target of idemgate's spans: only the OpenTelemetry layer listens to it.
pub const TARGET: &str = "idemgate::otel";

static ON: AtomicBool = AtomicBool::new(false);

/// Whether spans are being exported.
pub fn enabled() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Whether tracing should be on: an endpoint is configured, here or in the standard
/// variables, and `OTEL_SDK_DISABLED` is not `true`.
pub fn wanted(otlp_endpoint: Option<&str>) -> bool {
    let set = |name: &str| std::env::var(name).is_ok_and(|v| !v.trim().is_empty());
    let disabled =
        std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.trim().eq_ignore_ascii_case("true"));
    !disabled
        && (otlp_endpoint.is_some()
            || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            || set("OTEL_EXPORTER_OTLP_ENDPOINT"))
}

/// The running exporter; [`Telemetry::shutdown`] sends what is still buffered.
pub struct Telemetry {
    provider: SdkTracerProvider,
}

impl Telemetry {
    /// Starts exporting to `otlp_endpoint` (a base URL such as `http://collector:4318`;
    /// `/v1/traces` is added), or, without one, where the standard variables say. Returns
    /// the tracer for [`layer`].
    pub fn start(otlp_endpoint: Option<&str>) -> Result<(Telemetry, SdkTracer), String> {
        let mut exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_http_client(ExportClient::new()?);
        if let Some(base) = otlp_endpoint {
            exporter = exporter.with_endpoint(traces_url(base));
        }
        let exporter = exporter
            .build()
            .map_err(|e| format!("cannot set up the OTLP exporter: {e}"))?;
        let mut resource = Resource::builder();
        if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
            resource = resource.with_service_name("idemgate");
        }
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource.build())
            .build();
        let tracer = provider.tracer("idemgate");
        ON.store(true, Ordering::Relaxed);
        Ok((Telemetry { provider }, tracer))
    }

    /// Exports what is buffered and stops, within `limit` (what is left of
    /// `shutdown_grace`, never more). Blocks: call it outside the serving runtime.
    pub fn shutdown(self, limit: Duration) {
        ON.store(false, Ordering::Relaxed);
        if let Err(e) = self.provider.shutdown_with_timeout(limit) {
            tracing::warn!(error = %e, "could not export the last spans");
        }
    }
}

/// `http://host:4318` → `http://host:4318/v1/traces`, as the OTLP specification builds a
/// signal's URL from a base endpoint.
fn traces_url(base: &str) -> String {
    format!("{}/v1/traces", base.trim_end_matches('/'))
}

/// The `tracing` layer that turns idemgate's spans (and nothing else) into OpenTelemetry
/// spans.
pub fn layer<S>(tracer: SdkTracer) -> impl tracing_subscriber::Layer<S>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    use tracing_subscriber::Layer as _;
    let only_ours =
        tracing_subscriber::filter::Targets::new().with_target(TARGET, tracing::Level::TRACE);
    tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_tracked_inactivity(false)
        .with_threads(false)
        .with_filter(only_ours)
}

/// The span of one protected request, continuing the caller's trace when the request
/// carries a `traceparent`. [`Span::none`] when tracing is off.
pub fn request_span(
    headers: &HeaderMap,
    method: &Method,
    route: Option<&str>,
    request_id: &str,
) -> Span {
    if !enabled() {
        return Span::none();
    }
    let name = match route {
        Some(route) => format!("{method} {route}"),
        None => method.to_string(),
    };
    let span = tracing::trace_span!(
        target: TARGET,
        "request",
        otel.name = name,
        otel.kind = "server",
        http.request.method = %method,
        http.route = route,
        idemgate.request_id = request_id,
        idemgate.outcome = tracing::field::Empty,
        idemgate.record_id = tracing::field::Empty,
        http.response.status_code = tracing::field::Empty,
    );
    let parent = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
    // A request without a valid traceparent starts a trace of its own.
    let _ = span.set_parent(parent);
    span
}

/// A child span of `parent`: `claim`, `upstream` or `record`. [`Span::none`] when the
/// parent is.
pub fn child(parent: &Span, step: Step) -> Span {
    if parent.is_none() {
        return Span::none();
    }
    match step {
        Step::Claim => tracing::trace_span!(target: TARGET, parent: parent, "claim"),
        Step::Upstream => {
            tracing::trace_span!(target: TARGET, parent: parent, "upstream", otel.kind = "client")
        }
        Step::Record => tracing::trace_span!(target: TARGET, parent: parent, "record"),
    }
}

/// The steps of a protected request that get a span of their own.
#[derive(Clone, Copy, Debug)]
pub enum Step {
    /// The store round trip that claims the key.
    Claim,
    /// Sending the request upstream and reading the whole answer.
    Upstream,
    /// Writing the answer into the record.
    Record,
}

/// Puts `span`'s context into the upstream request's `traceparent` (and `tracestate`), so
/// the upstream continues the same trace under idemgate's span.
pub fn inject(span: &Span, headers: &mut HeaderMap) {
    if span.is_none() {
        return;
    }
    TraceContextPropagator::new().inject_context(&span.context(), &mut HeaderInjector(headers));
}

/// What the request came to, on its span.
pub fn finish(span: &Span, outcome: &str, record_id: Option<&str>, status: u16) {
    if span.is_none() {
        return;
    }
    span.record("idemgate.outcome", outcome);
    if let Some(id) = record_id {
        span.record("idemgate.record_id", id);
    }
    span.record("http.response.status_code", status);
}

/// The exporter's HTTP client: idemgate's hyper client (plain HTTP: a collector runs beside
/// idemgate), driven by a runtime with one thread of its own, so the SDK's export thread can
/// wait for it without a runtime of its own.
#[derive(Debug)]
struct ExportClient {
    client: Client<HttpConnector, Full<Bytes>>,
    // `Option` so that `Drop` can take it: dropping a runtime inside another one panics,
    // shutting it down in the background does not.
    runtime: Option<tokio::runtime::Runtime>,
}

/// Longest export call, connect to answer, unless `OTEL_EXPORTER_OTLP_TIMEOUT` is shorter.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);
/// A collector's answer is a small protobuf; anything larger is not read.
const MAX_ANSWER_BYTES: usize = 64 * 1024;

impl ExportClient {
    fn new() -> Result<ExportClient, String> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("idemgate-otlp")
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start the OTLP exporter's thread: {e}"))?;
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(Duration::from_secs(2)));
        let client = Client::builder(TokioExecutor::new()).build(connector);
        Ok(ExportClient {
            client,
            runtime: Some(runtime),
        })
    }
}

impl Drop for ExportClient {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

#[async_trait::async_trait]
impl HttpClient for ExportClient {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let Some(runtime) = &self.runtime else {
            return Err("the OTLP exporter is shut down".into());
        };
        let client = self.client.clone();
        let call = async move {
            let res = client.request(request.map(Full::new)).await?;
            let (parts, body) = res.into_parts();
            let body = Limited::new(body, MAX_ANSWER_BYTES).collect().await?;
            Ok::<_, HttpError>(Response::from_parts(parts, body.to_bytes()))
        };
        let timed = async move {
            match tokio::time::timeout(EXPORT_TIMEOUT, call).await {
                Ok(r) => r,
                Err(_) => Err("the OTLP collector did not answer in time".into()),
            }
        };
        runtime.spawn(timed).await?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_traces_url_is_built_from_a_base_endpoint() {
        assert_eq!(traces_url("http://c:4318"), "http://c:4318/v1/traces");
        assert_eq!(traces_url("http://c:4318/"), "http://c:4318/v1/traces");
    }

    #[test]
    fn off_costs_nothing_but_a_flag() {
        assert!(!enabled());
        let headers = HeaderMap::new();
        let span = request_span(&headers, &Method::POST, Some("/t"), "r");
        assert!(span.is_none());
        assert!(child(&span, Step::Claim).is_none());
        let mut out = HeaderMap::new();
        inject(&span, &mut out);
        assert!(out.is_empty());
    }
}
