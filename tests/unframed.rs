//! Answers an upstream ends by closing its connection (no `Content-Length`, no chunked
//! framing), through the binary: such a body reads the same whether the upstream finished
//! it or stopped halfway, so it is recorded only when its own format says it is whole (JSON
//! that parses, a gzip or br stream that ends), or on a route that sets
//! `close_delimited = "trust"`. A known cut is 502 `upstream-broken-answer`; any other is
//! passed on as received, without a length, and its record held `unknown`.

use std::net::SocketAddr;
use std::time::Duration;

use idemgate::config::{CloseDelimited, Mode, Route};

use crate::common::wire::{post, Conn, Read1, Script, ScriptedUpstream};
use crate::common::{Idemgate, Probes};

const CUT_JSON: &str = "{\"id\":\"tr_1\",\"amount\":25";
const WHOLE_JSON: &str = "{\"id\":\"tr_2\",\"amount\":2500}";
const TEXT: &str = "receipt 3: 2500 from alice to b";

/// `XML` gzipped, whole or without its last 6 bytes (its trailer cut).
fn gzipped(cut: bool) -> Vec<u8> {
    use std::io::Write;
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(XML.as_bytes()).unwrap();
    let mut gz = e.finish().unwrap();
    if cut {
        gz.truncate(gz.len() - 6);
    }
    let mut out =
        b"HTTP/1.1 201 Created\r\ncontent-type: text/xml\r\ncontent-encoding: gzip\r\n\r\n"
            .to_vec();
    out.extend(gz);
    out
}

const XML: &str = "<receipt id='4' amount='2500'/>";

fn answer(head: &str) -> Script {
    let line = head.lines().next().unwrap_or_default().to_string();
    let path = line.split(' ').nth(1).unwrap_or_default();
    match path {
        "/v1/json-cut" => Script::closing(format!(
            "HTTP/1.1 201 Created\r\ncontent-type: application/json\r\n\r\n{CUT_JSON}"
        )),
        "/v1/json-whole" => Script::closing(format!(
            "HTTP/1.0 201 Created\r\ncontent-type: application/json\r\n\r\n{WHOLE_JSON}"
        )),
        "/v1/gzip-whole" => Script::closing(gzipped(false)),
        "/v1/gzip-cut" => Script::closing(gzipped(true)),
        _ => Script::closing(format!(
            "HTTP/1.1 201 Created\r\ncontent-type: text/plain\r\n\r\n{TEXT}"
        )),
    }
}

/// The binary in front of a scripted upstream, with `/trusted` trusting its closes,
/// `/small` keeping answers of at most 8 bytes and `/observed` in observe mode.
async fn rig() -> (ScriptedUpstream, crate::common::Gate) {
    let up = ScriptedUpstream::start(answer).await;
    let gate = Idemgate::new(&up.url())
        .set(|c| {
            c.defaults.upstream_timeout = Duration::from_secs(5);
            c.routes.push(Route {
                path: "/trusted".into(),
                close_delimited: Some(CloseDelimited::Trust),
                ..Route::default()
            });
            c.routes.push(Route {
                path: "/small".into(),
                max_response_bytes: Some(8),
                ..Route::default()
            });
            c.routes.push(Route {
                path: "/observed".into(),
                mode: Some(Mode::Observe),
                ..Route::default()
            });
        })
        .binary();
    (up, gate)
}

/// POSTs `path` with `key` on a connection of its own.
async fn send(addr: SocketAddr, path: &str, key: &str) -> Read1 {
    let bytes = post(path, key, "{\"amount\":2500}", "");
    tokio::task::spawn_blocking(move || {
        let mut c = Conn::open(addr);
        c.send(&bytes);
        c.read(false).expect("an answer")
    })
    .await
    .expect("client")
}

fn unframed(gate: &crate::common::Gate, route: &str) -> f64 {
    gate.metric_or_zero(&format!(
        "idemgate_unframed_answers_total{{route=\"{route}\"}}"
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_cut_by_the_close_is_a_broken_answer_and_never_replayed() {
    let (up, gate) = rig().await;
    let first = send(gate.proxy(), "/v1/json-cut", "k-cut").await;
    assert_eq!(first.status, 502, "{}", first.text());
    assert!(
        first.problem().ends_with("/upstream-broken-answer"),
        "{}",
        first.text()
    );
    assert!(!first.text().contains(CUT_JSON), "the half is not sent");
    let retry = send(gate.proxy(), "/v1/json-cut", "k-cut").await;
    assert_eq!(retry.status, 409, "{}", retry.text());
    assert!(
        retry.problem().ends_with("/outcome-unknown"),
        "{}",
        retry.text()
    );
    // A gzip stream that does not end is a known cut too.
    let first = send(gate.proxy(), "/v1/gzip-cut", "k-gz-cut").await;
    assert_eq!(first.status, 502, "{}", first.text());
    let retry = send(gate.proxy(), "/v1/gzip-cut", "k-gz-cut").await;
    assert!(
        retry.problem().ends_with("/outcome-unknown"),
        "{}",
        retry.text()
    );
    assert_eq!(up.hits(), 2, "executed once each");
    assert_eq!(unframed(&gate, "default"), 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_json_ended_by_the_close_is_recorded_and_replayed() {
    let (up, gate) = rig().await;
    let first = send(gate.proxy(), "/v1/json-whole", "k-whole").await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert_eq!(first.text(), WHOLE_JSON);
    let retry = send(gate.proxy(), "/v1/json-whole", "k-whole").await;
    assert_eq!(
        retry.header("idempotent-replayed"),
        Some("true"),
        "{retry:?}"
    );
    assert_eq!(retry.text(), WHOLE_JSON);
    assert_eq!(up.hits(), 1, "executed once");
    // XML in a gzip stream that ends: whole, whatever its type.
    let first = send(gate.proxy(), "/v1/gzip-whole", "k-gz").await;
    assert_eq!(first.status, 201, "{}", first.text());
    let retry = send(gate.proxy(), "/v1/gzip-whole", "k-gz").await;
    assert_eq!(
        retry.header("idempotent-replayed"),
        Some("true"),
        "{retry:?}"
    );
    assert_eq!(retry.body, first.body);
    assert_eq!(up.hits(), 2, "executed once each");
    assert_eq!(unframed(&gate, "default"), 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_ended_by_the_close_is_passed_on_unframed_and_held_unknown() {
    let (up, gate) = rig().await;
    let first = send(gate.proxy(), "/v1/receipts", "k-text").await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert_eq!(first.text(), TEXT, "the bytes as received");
    assert_eq!(
        first.header("content-length"),
        None,
        "no length vouches for them"
    );
    let retry = send(gate.proxy(), "/v1/receipts", "k-text").await;
    assert_eq!(retry.status, 409, "{}", retry.text());
    assert!(
        retry.problem().ends_with("/outcome-unknown"),
        "{}",
        retry.text()
    );
    assert_eq!(up.hits(), 1, "executed once");

    // A route that trusts its upstream's closes records the same answer.
    let trusted = send(gate.proxy(), "/trusted/receipts", "k-trusted").await;
    assert_eq!(trusted.status, 201);
    let replay = send(gate.proxy(), "/trusted/receipts", "k-trusted").await;
    assert_eq!(
        replay.header("idempotent-replayed"),
        Some("true"),
        "{replay:?}"
    );
    assert_eq!(replay.text(), TEXT);
    assert_eq!(up.hits(), 2);

    // Larger than max_response_bytes: streamed on, and not even its status is vouched for.
    let large = send(gate.proxy(), "/small/receipts", "k-small").await;
    assert_eq!(large.text(), TEXT);
    let retry = send(gate.proxy(), "/small/receipts", "k-small").await;
    assert!(
        retry.problem().ends_with("/outcome-unknown"),
        "{}",
        retry.text()
    );
    assert_eq!(up.hits(), 3);

    // Observe mode counts such answers too, so a rollout finds them before enforcing.
    let observed = send(gate.proxy(), "/observed/receipts", "k-observed").await;
    assert_eq!(observed.text(), TEXT);
    assert_eq!(unframed(&gate, "default"), 1.0);
    assert_eq!(unframed(&gate, "/trusted"), 1.0);
    assert_eq!(unframed(&gate, "/observed"), 1.0);
}

/// An upstream process that answers its first request with the head and half of a JSON
/// body, then kills itself (SIGKILL): the kernel ends its connection, with a FIN or a
/// reset. Its port is its first line.
const CRASHING: &str = r#"
import os, socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 0))
s.listen(8)
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
data = b""
while b"\r\n\r\n" not in data:
    data += c.recv(65536)
head, _, body = data.partition(b"\r\n\r\n")
n = [int(l.split(b":")[1]) for l in head.split(b"\r\n") if l.lower().startswith(b"content-length:")][0]
while len(body) < n:
    body += c.recv(65536)
c.sendall(b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\n\r\n{\"id\":\"tr_9\",\"amo")
os.kill(os.getpid(), 9)
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_crashes_mid_answer_is_never_replayed() {
    use std::io::BufRead;
    let mut child = std::process::Command::new("python3")
        .args(["-c", CRASHING])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3 runs");
    let mut port = String::new();
    std::io::BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut port)
        .expect("the upstream's port");
    let url = format!("http://127.0.0.1:{}", port.trim());
    let gate = Idemgate::new(&url).binary();
    let first = send(gate.proxy(), "/v1/transfers", "k-crash").await;
    assert!(
        [502, 504].contains(&first.status),
        "a broken answer or one that broke off: {} {}",
        first.status,
        first.text()
    );
    let retry = send(gate.proxy(), "/v1/transfers", "k-crash").await;
    assert_eq!(retry.status, 409, "{}", retry.text());
    assert!(
        retry.problem().ends_with("/outcome-unknown"),
        "{}",
        retry.text()
    );
    let status = child.wait().expect("the upstream ended");
    assert!(!status.success(), "it died mid-answer");
}
