//! Stripe's own SDKs through the binary, on a route with `error_format = "stripe"`, in front
//! of a Stripe-shaped upstream (`POST /v1/payment_intents`, form-encoded, answering a
//! PaymentIntent). The SDKs (stripe-node 18.5.0 and stripe-python 16.1.0, pinned, installed
//! by `tests/sdks/install.sh`) decide errors by the body's `error` member and retry by
//! `Stripe-Should-Retry`, so:
//! - a reused key with another amount raises the SDK's idempotency error, and runs nothing;
//! - a concurrent call with the key (409 in-progress) is retried by the SDK and ends with
//!   the first call's PaymentIntent, executed once;
//! - an outcome that stays unknown (504, then 409 outcome-unknown) raises, twice;
//! - none of them resolves as a success it is not.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::Gate;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};

/// A Stripe-shaped upstream: each `POST /v1/payment_intents` executes (a new `pi_N`); an
/// amount of 4242 takes 0.6 s, 9999 never answers in time (the route's upstream_timeout is 1 s).
struct FakeStripe {
    addr: SocketAddr,
    executions: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeStripe {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FakeStripe {
    async fn start() -> FakeStripe {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let executions = Arc::new(AtomicUsize::new(0));
        let n = executions.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let n = n.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
                        let n = n.clone();
                        async move {
                            let body = req.into_body().collect().await.unwrap().to_bytes();
                            let amount: u64 = form_urlencoded::parse(&body)
                                .find(|(k, _)| k == "amount")
                                .and_then(|(_, v)| v.parse().ok())
                                .unwrap_or(0);
                            let id = n.fetch_add(1, Ordering::SeqCst) + 1;
                            match amount {
                                4242 => tokio::time::sleep(Duration::from_millis(600)).await,
                                9999 => tokio::time::sleep(Duration::from_secs(30)).await,
                                _ => {}
                            }
                            let pi = serde_json::json!({"id": format!("pi_{id}"),
                                "object": "payment_intent", "amount": amount, "currency": "usd",
                                "status": "requires_payment_method"});
                            Ok::<_, Infallible>(
                                Response::builder()
                                    .status(200)
                                    .header("content-type", "application/json")
                                    .body(Full::new(Bytes::from(pi.to_string())))
                                    .unwrap(),
                            )
                        }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(tcp), svc)
                        .await;
                });
            }
        });
        FakeStripe {
            addr,
            executions,
            task,
        }
    }

    fn executions(&self) -> usize {
        self.executions.load(Ordering::SeqCst)
    }
}

/// Where the SDKs are installed: in the tests' shared cache (tests/setup/install.sh).
fn install_dir() -> PathBuf {
    common::setup::tools().join("sdks")
}

#[derive(Clone, Copy, Debug)]
enum Sdk {
    Node,
    Python,
}

/// Runs one scenario of the SDK's script against the gate: one JSON object per call.
fn run(sdk: Sdk, g: &Gate, scenario: &str, key: &str) -> Vec<serde_json::Value> {
    let dir = install_dir();
    let mut cmd = match sdk {
        Sdk::Node => {
            let mut c = Command::new("node");
            c.arg(dir.join("node/run.js"));
            c
        }
        Sdk::Python => {
            let mut c = Command::new("python3");
            c.arg(dir.join("python/run.py"))
                .env("PYTHONPATH", dir.join("python/site"));
            c
        }
    };
    let out = cmd
        .arg(scenario)
        .env("IDEMGATE_PORT", g.addr.port().to_string())
        .env("KEY", key)
        .env("MAX_RETRIES", "4")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{sdk:?} {scenario}: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        g.log()
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn gate(up: &FakeStripe) -> Gate {
    Gate::start(
        &format!("http://{}", up.addr),
        "",
        &[(
            "IDEMGATE_ROUTES",
            r#"[{path="/v1/payment_intents", require_key=true, error_format="stripe", upstream_timeout="1s"}]"#,
        )],
    )
}

async fn the_sdk_sees_errors_as_errors(sdk: Sdk) {
    let up = FakeStripe::start().await;
    let g = gate(&up);
    let tag = format!("{sdk:?}").to_lowercase();

    // A reused key with another amount: the SDK's idempotency error, nothing executed.
    let calls = tokio::task::block_in_place(|| run(sdk, &g, "mismatch", &format!("{tag}-m")));
    assert_eq!(calls[0]["ok"], true, "{calls:?}");
    let second = &calls[1];
    assert_eq!(
        second["ok"], false,
        "{sdk:?}: resolved as success: {calls:?}"
    );
    assert_eq!(second["type"], "idempotency_error", "{calls:?}");
    let want = match sdk {
        Sdk::Node => "StripeIdempotencyError",
        Sdk::Python => "IdempotencyError",
    };
    assert_eq!(second["class"], want, "{calls:?}");
    assert_eq!(up.executions(), 1);

    // A concurrent call with the key: retried by the SDK, which gets the first's answer.
    let calls = tokio::task::block_in_place(|| run(sdk, &g, "in_progress", &format!("{tag}-p")));
    assert!(
        calls.iter().all(|c| c["ok"] == true),
        "{calls:?}\n{}",
        g.log()
    );
    assert_eq!(calls[0]["id"], calls[1]["id"], "{calls:?}");
    assert_eq!(up.executions(), 2);

    // An outcome that stays unknown: raised, first as the 504, then as 409 outcome-unknown.
    let calls = tokio::task::block_in_place(|| run(sdk, &g, "unknown", &format!("{tag}-u")));
    assert!(calls.iter().all(|c| c["ok"] == false), "{calls:?}");
    assert_eq!(calls[0]["status"], 504, "{calls:?}");
    assert_eq!(calls[1]["status"], 409, "{calls:?}");
    assert_eq!(calls[1]["code"], "outcome_unknown", "{calls:?}");
    assert!(calls.iter().all(|c| c["type"] == "api_error"), "{calls:?}");
    // Executed once: the SDK retried neither (Stripe-Should-Retry: false).
    assert_eq!(up.executions(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stripe_node_sees_idemgate_s_errors_as_errors() {
    the_sdk_sees_errors_as_errors(Sdk::Node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stripe_python_sees_idemgate_s_errors_as_errors() {
    the_sdk_sees_errors_as_errors(Sdk::Python).await;
}
