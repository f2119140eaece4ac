//! An answer whose headers need more than the room a claim reserves for them (64 KiB beside
//! `max_response_bytes`), through the binary: on an embedded store with room for exactly
//! one reservation it is recorded without the excess headers, its retry is a replay that
//! says how many were left out (`idemgate-headers-omitted`), never 409
//! `response-not-stored`.

#![allow(clippy::unwrap_used)]

use crate::common;
use common::Probes;

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use common::{client, post_url, Idemgate};

/// An upstream that answers every request 201 with `count` headers of `size` bytes each
/// (`x-h-0` ... in order) and a body of `body` bytes, then closes.
async fn many_headers_upstream(count: usize, size: usize, body: usize) -> String {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                // The head, then the body its content-length declares.
                loop {
                    let n = s.read(&mut buf).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    got.extend_from_slice(&buf[..n]);
                    if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&got[..end]).to_lowercase();
                        let len: usize = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .map_or(0, |v| v.trim().parse().unwrap());
                        if got.len() >= end + 4 + len {
                            break;
                        }
                    }
                }
                let mut res =
                    String::from("HTTP/1.1 201 Created\r\ncontent-type: application/json\r\n");
                for i in 0..count {
                    res.push_str(&format!("x-h-{i}: {}\r\n", "v".repeat(size)));
                }
                res.push_str(&format!(
                    "content-length: {body}\r\nconnection: close\r\n\r\n{}",
                    "b".repeat(body)
                ));
                let _ = s.write_all(res.as_bytes()).await;
            });
        }
    });
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_with_headers_beyond_the_head_room_is_replayed_without_the_excess() {
    // A body near max_response_bytes: its headers cannot borrow the body's unused room.
    let body = 99_000;
    let up = many_headers_upstream(90, 1000, body).await;
    // Room for one claim's reservation (max_response_bytes + 64 KiB, and the record's
    // upkeep) and little more: the record must fit in what its claim reserved.
    let max_response = 100_000u64;
    let memory = max_response + 65_536 + 2_048;
    let gate = Idemgate::new(&up)
        .set(|c| {
            c.defaults.max_response_bytes = max_response;
            c.memory_max_bytes = memory as usize;
        })
        .binary();
    let c = client();
    let url = gate.url("/v1/payments");
    let first = post_url(&c, &url, Some("many-headers"), r#"{"a":1}"#, &[]).await;
    assert_eq!(first.status, 201, "{:?}\n{}", first.body, gate.log());
    // The client that made it gets every header.
    assert!(first.header("x-h-89").is_some());
    assert!(first.header("idemgate-headers-omitted").is_none());
    tokio::time::sleep(Duration::from_millis(100)).await;
    let retry = post_url(&c, &url, Some("many-headers"), r#"{"a":1}"#, &[]).await;
    assert_eq!(retry.status, 201, "{:?}\n{}", retry.body, gate.log());
    assert!(retry.replayed());
    assert_eq!(retry.body.len(), body);
    let omitted: usize = retry
        .header("idemgate-headers-omitted")
        .expect("the replay says headers were left out")
        .parse()
        .unwrap();
    let kept = (0..90)
        .filter(|i| retry.header(&format!("x-h-{i}")).is_some())
        .count();
    assert_eq!(kept + omitted, 90, "kept {kept}, omitted {omitted}");
    assert!(kept >= 50, "as many as fit are kept: {kept}");
    // The first headers are the ones kept.
    assert!(retry.header("x-h-0").is_some());
    assert_eq!(retry.header("content-type"), Some("application/json"));
}
