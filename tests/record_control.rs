//! `record_control_header`: the upstream may decline to have an answer kept. Through the
//! binary, in front of an upstream that answers `Idemgate-Record: no-store` when asked to
//! (by a test header): the answer reaches the client without that header, the claim is
//! released and the retry executes again; any other value, or the header sent by the
//! client, changes nothing (the answer is recorded and replayed, the header never shown).

#![allow(clippy::unwrap_used)]

use crate::common;
use common::Probes;

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};

/// Answers 201 with its execution number; with `x-say: V` it adds `Idemgate-Record: V`.
async fn upstream() -> (String, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            let h = h.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
                    let n = h.fetch_add(1, Ordering::SeqCst) + 1;
                    let say = req.headers().get("x-say").cloned();
                    async move {
                        let mut res = Response::builder().status(201);
                        if let Some(v) = say {
                            res = res.header("idemgate-record", v);
                        }
                        Ok::<_, Infallible>(
                            res.body(Full::new(Bytes::from(format!("{{\"execution\":{n}}}"))))
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
    (format!("http://{addr}"), hits)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upstream_declines_a_record_and_only_the_upstream() {
    let (url, hits) = upstream().await;
    let g = common::Idemgate::new(&url)
        .set(|c| c.defaults.record_control_header = Some("Idemgate-Record".into()))
        .binary();
    let c = common::client();
    let pay = |key: &'static str, extra: Vec<(&'static str, &'static str)>| {
        let c = c.clone();
        let url = g.url("/pay");
        async move { common::post_url(&c, &url, Some(key), "{\"amount\":1}", &extra).await }
    };
    // Declined: passed on without the header, the claim released, the retry executes.
    let a = pay("declined", vec![("x-say", "no-store")]).await;
    assert_eq!(a.status, 201);
    assert!(a.header("idemgate-record").is_none(), "{:?}", a.headers);
    let b = pay("declined", vec![("x-say", "No-Store")]).await;
    assert!(!b.replayed(), "a declined answer was replayed");
    assert_eq!(hits.load(Ordering::SeqCst), 2);

    // Another value: recorded, replayed, the header never shown.
    let a = pay("kept", vec![("x-say", "store")]).await;
    assert!(a.header("idemgate-record").is_none());
    let b = pay("kept", vec![]).await;
    assert!(b.replayed());
    assert_eq!(b.body, a.body);
    assert!(b.header("idemgate-record").is_none());
    assert_eq!(hits.load(Ordering::SeqCst), 3);

    // The client saying it: nothing changes.
    let a = pay("client-says", vec![("idemgate-record", "no-store")]).await;
    assert_eq!(a.status, 201);
    let b = pay("client-says", vec![("idemgate-record", "no-store")]).await;
    assert!(b.replayed());
    assert_eq!(hits.load(Ordering::SeqCst), 4);
    let metrics = common::http_get(g.admin, "/metrics").unwrap();
    assert!(
        metrics.contains("idemgate_requests_total{route=\"default\",outcome=\"released\"} 2"),
        "{metrics}"
    );
}
