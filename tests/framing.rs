//! Every answer idemgate writes is framed by idemgate: an upstream that sends both
//! framing headers, a length that disagrees with its body, a length spelt oddly or an
//! interim status as its answer never makes a client read two answers as one, or one as
//! two (RFC 9112 6.3). Upstreams here write raw bytes; clients read raw bytes off one
//! kept-alive connection.

use std::time::Duration;

use idemgate::config::Config;

use crate::common::wire::{get, post, Conn, Script, ScriptedUpstream};

/// 106 bytes, sent chunked under `Content-Length: 8` by Node's `http` and uvicorn with
/// httptools when the app sets both.
fn long_body() -> String {
    let mut b = String::from("{\"id\":\"tr_1\",\"note\":\"");
    while b.len() < 104 {
        b.push('x');
    }
    b.push_str("\"}");
    assert_eq!(b.len(), 106);
    b
}

const BALANCE: &str = "{\"balance\":\"B-own\"}";

fn answer(head: &str) -> Script {
    let line = head.lines().next().unwrap_or_default().to_string();
    let path = line.split(' ').nth(1).unwrap_or_default();
    match path {
        "/both" => {
            let b = long_body();
            Script::open(format!(
                "HTTP/1.1 201 Created\r\ncontent-length: 8\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{b}\r\n0\r\n\r\n",
                b.len()
            ))
        }
        "/identity" => Script::closing(format!(
            "HTTP/1.1 201 Created\r\ncontent-type: application/json\r\ntransfer-encoding: identity\r\ncontent-length: 5\r\n\r\n{}",
            long_body()
        )),
        "/long" => Script::closing("HTTP/1.1 201 Created\r\ncontent-length: 50\r\n\r\n{\"id\":1}"),
        "/short" => Script::open(
            "HTTP/1.1 201 Created\r\ncontent-length: 8\r\n\r\n{\"id\":1}{\"balance\":\"POISONED-9999\"}",
        ),
        "/zeros" => Script::open("HTTP/1.1 201 Created\r\ncontent-length: 008\r\n\r\n{\"id\":1}"),
        "/listed" => Script::open(
            "HTTP/1.1 201 Created\r\ncontent-length: 8, 8\r\n\r\n{\"id\":1}",
        ),
        "/upgrade" => Script::open(
            "HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n",
        ),
        "/head" => Script::open("HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n"),
        _ => Script::open(format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{BALANCE}",
            BALANCE.len()
        )),
    }
}

async fn rig() -> (ScriptedUpstream, idemgate::Running) {
    let up = ScriptedUpstream::start(answer).await;
    let mut cfg = Config::for_upstream(&up.url());
    cfg.admin_listen = Some("127.0.0.1:0".parse().expect("addr"));
    cfg.defaults.anonymous = idemgate::config::Anonymous::Shared;
    cfg.scope_secret_create_delay = Duration::ZERO;
    cfg.defaults.upstream_timeout = Duration::from_secs(5);
    let app = idemgate::start(cfg).await.expect("idemgate starts");
    (up, app)
}

/// Runs blocking client I/O off the runtime's workers.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.expect("client")
}

/// The length a client reads, if it is one, equals the bytes written.
fn framed_by_its_bytes(a: &crate::common::wire::Read1) {
    if let Some(n) = a.header("content-length") {
        assert_eq!(a.all("content-length").len(), 1, "{a:?}");
        assert_eq!(n, a.body.len().to_string(), "{a:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_framing_headers_reach_the_client_as_one_answer_and_replay_the_same() {
    let (_up, app) = rig().await;
    let addr = app.addr();
    let (first, next, replay) = blocking(move || {
        let mut c = Conn::open(addr);
        // The answer and the next request's, pipelined on one connection.
        let mut bytes = post("/both", "k-both", "{}", "");
        bytes.extend(get("/balance"));
        c.send(&bytes);
        let first = c.read(false).expect("first answer");
        let next = c.read(false).expect("the next answer");
        c.send(&post("/both", "k-both", "{}", ""));
        let replay = c.read(false).expect("replay");
        (first, next, replay)
    })
    .await;
    assert_eq!(first.status, 201);
    assert_eq!(first.text(), long_body());
    framed_by_its_bytes(&first);
    assert_eq!(next.text(), BALANCE, "the next answer is its own");
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(first.as_replayed(), replay.as_replayed());
    app.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_framing_headers_on_pass_through_are_one_answer() {
    let (_up, app) = rig().await;
    let addr = app.addr();
    let (first, next) = blocking(move || {
        let mut c = Conn::open(addr);
        let mut bytes = get("/both");
        bytes.extend(get("/balance"));
        c.send(&bytes);
        (c.read(false), c.read(false))
    })
    .await;
    let first = first.expect("first answer");
    assert_eq!(first.text(), long_body());
    framed_by_its_bytes(&first);
    assert_eq!(next.expect("next").text(), BALANCE);
    app.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identity_with_a_length_is_read_to_its_end_and_framed_anew() {
    let (_up, app) = rig().await;
    let addr = app.addr();
    let (first, next, replay) = blocking(move || {
        let mut c = Conn::open(addr);
        let mut bytes = post("/identity", "k-id", "{}", "");
        bytes.extend(get("/balance"));
        c.send(&bytes);
        let (first, next) = (c.read(false), c.read(false));
        c.send(&post("/identity", "k-id", "{}", ""));
        (first, next, c.read(false))
    })
    .await;
    let first = first.expect("first");
    assert_eq!(first.text(), long_body());
    framed_by_its_bytes(&first);
    assert_eq!(next.expect("next").text(), BALANCE);
    assert_eq!(first.as_replayed(), replay.expect("replay").as_replayed());
    app.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_length_longer_than_the_body_is_a_broken_answer_held_unknown() {
    let (up, app) = rig().await;
    let addr = app.addr();
    let (first, retry) = blocking(move || {
        let mut c = Conn::open(addr);
        c.send(&post("/long", "k-long", "{}", ""));
        let first = c.read(false);
        c.send(&post("/long", "k-long", "{}", ""));
        (first, c.read(false))
    })
    .await;
    let first = first.expect("an answer");
    assert_eq!(first.status, 502, "{}", first.text());
    assert!(
        first.problem().ends_with("/upstream-broken-answer"),
        "{}",
        first.text()
    );
    framed_by_its_bytes(&first);
    let retry = retry.expect("retry");
    assert_eq!(retry.status, 409, "{}", retry.text());
    assert!(retry.problem().ends_with("/outcome-unknown"));
    assert_eq!(up.hits(), 1, "never executed again");
    app.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_answer_shorter_than_its_length_closes_the_connection() {
    let (_up, app) = rig().await;
    let addr = app.addr();
    let (first, next) = blocking(move || {
        let mut c = Conn::open(addr);
        let mut bytes = get("/long");
        bytes.extend(get("/balance"));
        c.send(&bytes);
        let first = c.read(false);
        (first, c.read(false))
    })
    .await;
    // The head went out with the length; the body never reached it, and the connection
    // ended there: no short answer followed by the next.
    assert!(first.is_none(), "{first:?}");
    assert!(next.is_none(), "{next:?}");
    app.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_a_streamed_answer_shorter_than_its_length_resets_its_stream() {
    let (_up, app) = rig().await;
    let c = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .expect("client");
    let url = format!("http://{}/long", app.addr());
    let broken = match c.get(&url).send().await {
        Ok(res) => res.bytes().await.is_err(),
        Err(_) => true,
    };
    assert!(broken, "a short body reached an h2 client as whole");
    // The connection carries on for other streams.
    let ok = c
        .get(format!("http://{}/balance", app.addr()))
        .send()
        .await
        .expect("next");
    assert_eq!(ok.text().await.expect("body"), BALANCE);
    app.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_length_shorter_than_the_body_leaves_the_next_answer_its_own() {
    let (_up, app) = rig().await;
    let addr = app.addr();
    for request in [post("/short", "k-short", "{}", ""), get("/short")] {
        let (first, next) = blocking(move || {
            let mut c = Conn::open(addr);
            let mut bytes = request;
            bytes.extend(get("/balance"));
            c.send(&bytes);
            (c.read(false), c.read(false))
        })
        .await;
        let first = first.expect("first");
        assert_eq!(first.text(), "{\"id\":1}");
        framed_by_its_bytes(&first);
        assert_eq!(next.expect("next").text(), BALANCE);
    }
    app.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lengths_are_written_in_one_canonical_form() {
    let (_up, app) = rig().await;
    let addr = app.addr();
    let answers = blocking(move || {
        let mut out = Vec::new();
        for (i, path) in ["/zeros", "/listed"].into_iter().enumerate() {
            let mut c = Conn::open(addr);
            c.send(&post(path, &format!("k-canon-{i}"), "{}", ""));
            out.push(c.read(false).expect("protected"));
            c.send(&post(path, &format!("k-canon-{i}"), "{}", ""));
            out.push(c.read(false).expect("replay"));
            c.send(&get(path));
            out.push(c.read(false).expect("pass-through"));
        }
        out
    })
    .await;
    for a in &answers {
        assert_eq!(a.all("content-length"), vec!["8"], "{a:?}");
        assert_eq!(a.text(), "{\"id\":1}");
    }
    assert_eq!(answers[0].as_replayed(), answers[1].as_replayed());
    app.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_101_to_a_protected_request_is_a_broken_answer_never_recorded() {
    let (up, app) = rig().await;
    let addr = app.addr();
    let (first, retry, passing) = blocking(move || {
        let mut c = Conn::open(addr);
        c.send(&post("/upgrade", "k-101", "{}", ""));
        let first = c.read(false);
        c.send(&post("/upgrade", "k-101", "{}", ""));
        let retry = c.read(false);
        c.send(&get("/upgrade"));
        (first, retry, c.read(false))
    })
    .await;
    let first = first.expect("first");
    assert_eq!(first.status, 502, "{first:?}");
    assert!(first.problem().ends_with("/upstream-broken-answer"));
    let retry = retry.expect("retry");
    assert_eq!(retry.status, 409, "{retry:?}");
    assert!(retry.problem().ends_with("/outcome-unknown"));
    let passing = passing.expect("pass-through");
    assert_eq!(passing.status, 502, "{passing:?}");
    assert_eq!(
        up.hits(),
        2,
        "the protected one once, the pass-through once"
    );
    app.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_answer_keeps_its_length_and_sends_no_body() {
    let (_up, app) = rig().await;
    let addr = app.addr();
    let (head, next) = blocking(move || {
        let mut c = Conn::open(addr);
        let mut bytes = b"HEAD /head HTTP/1.1\r\nhost: x\r\n\r\n".to_vec();
        bytes.extend(get("/balance"));
        c.send(&bytes);
        (c.read(true), c.read(false))
    })
    .await;
    let head = head.expect("head");
    assert_eq!(head.header("content-length"), Some("100"));
    assert_eq!(next.expect("next").text(), BALANCE);
    app.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_both_framing_headers_reach_the_client_as_their_replay() {
    let (_up, app) = rig().await;
    let c = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .expect("client");
    let url = format!("http://{}/both", app.addr());
    let mut answers = Vec::new();
    for _ in 0..2 {
        let res = c
            .post(&url)
            .header("idempotency-key", "k-h2-both")
            .header("content-type", "application/json")
            .body("{}")
            .send()
            .await
            .expect("answer");
        let status = res.status().as_u16();
        let mut headers: Vec<(String, String)> = res
            .headers()
            .iter()
            .filter(|(n, _)| !["date", "idempotent-replayed", "x-request-id"].contains(&n.as_str()))
            .map(|(n, v)| (n.to_string(), v.to_str().unwrap_or_default().to_string()))
            .collect();
        headers.sort();
        let replayed = res.headers().contains_key("idempotent-replayed");
        let body = res.bytes().await.expect("body");
        answers.push((status, headers, body, replayed));
    }
    assert_eq!(answers[0].2, long_body().as_bytes());
    assert!(!answers[0].3 && answers[1].3, "the second is the replay");
    let len = answers[0]
        .1
        .iter()
        .find(|(n, _)| n == "content-length")
        .map(|(_, v)| v.clone());
    assert!(len.is_none() || len == Some("106".into()), "{len:?}");
    assert_eq!(
        (&answers[0].0, &answers[0].1, &answers[0].2),
        (&answers[1].0, &answers[1].1, &answers[1].2)
    );
    app.shutdown().await;
}
