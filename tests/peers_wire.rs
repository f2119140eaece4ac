//! Servers no one here wrote, behind the binary, on the wire: Puma with Rack's
//! `MethodOverride` (a decided header removed by `Connection`, doubled, spelt with `_`);
//! Node's own `http` and uvicorn with httptools answering with both framing headers (a
//! pipelined request reads its own answer, first-hand equals replay), a length longer and
//! shorter than the body, `HEAD`, `101`, and `CONNECT` refused before any of them; Koa 2 with
//! @koa/router 13, Express and Tornado with their default routing for the path spellings they
//! disagree on (letter case, a raw `+`, raw UTF-8). Each server's own count of what it ran is
//! the oracle.
//!
//! Installed by `tests/frameworks/install.sh` and `tests/setup/install.sh` (Debian's `puma`
//! and `ruby-rack`), once per machine.

#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::common;
use common::wire::{get, post, Conn, Read1};
use common::Gate;

/// A server process, killed on drop.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn dir() -> PathBuf {
    common::setup::tools().join("frameworks")
}

/// `GET /count` answered directly: the server's own count of what it ran, as JSON.
fn count(addr: SocketAddr) -> Option<serde_json::Value> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(b"GET /count HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let body = out.split("\r\n\r\n").nth(1)?;
    let body = body.trim_start_matches(|c: char| c != '{');
    serde_json::from_str(body.split('\n').next()?.trim()).ok()
}

fn ran(addr: SocketAddr) -> u64 {
    count(addr).expect("the server's count")["n"]
        .as_u64()
        .unwrap()
}

/// Starts `program args... PORT` and waits until it answers `/count`.
fn start(program: &str, args: &[&str], env: &[(&str, PathBuf)]) -> (Server, SocketAddr) {
    let port = common::free_port();
    let mut cmd = Command::new(program);
    cmd.args(args).arg(port.to_string());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("start {program}: {e}"));
    let server = Server(child);
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    common::wait_until(
        Duration::from_secs(60),
        &format!("{program} did not become ready"),
        || count(addr).is_some(),
    );
    (server, addr)
}

fn puma() -> (Server, SocketAddr) {
    let port = common::free_port();
    let ru = dir().join("wire/config.ru");
    let child = Command::new("puma")
        .args(["-q", "-t", "1:1", "-b"])
        .arg(format!("tcp://127.0.0.1:{port}"))
        .arg(&ru)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start puma");
    let server = Server(child);
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    common::wait_until(Duration::from_secs(60), "puma did not become ready", || {
        count(addr).is_some()
    });
    (server, addr)
}

/// The binary in front of `upstream` with `config` (TOML, after `upstream`).
fn gate(upstream: SocketAddr, config: &str) -> (Gate, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("idemgate.toml");
    std::fs::write(&file, config).unwrap();
    let g = Gate::start(
        &format!("http://{upstream}"),
        "",
        &[
            ("IDEMGATE_CONFIG", file.to_str().unwrap()),
            ("IDEMGATE_DEFAULTS__ANONYMOUS", "shared"),
        ],
    );
    (g, dir)
}

/// Each request on a connection of its own: its answer.
fn each(addr: SocketAddr, requests: Vec<Vec<u8>>) -> Vec<Read1> {
    requests
        .into_iter()
        .map(|r| {
            let mut c = Conn::open(addr);
            c.send(&r);
            c.read(false).expect("an answer")
        })
        .collect()
}

// Puma and Rack::MethodOverride behind `framework = "rails"`.

#[test]
fn puma_never_runs_a_post_that_idemgate_decided_was_another_method() {
    let (_puma, up) = puma();
    let (g, _dir) = gate(
        up,
        "[[routes]]\npath = \"/transfers\"\nframework = \"rails\"\nrequire_key = true\n",
    );
    let posts = || count(up).unwrap()["POST"].as_u64().unwrap_or(0);
    let deletes = || count(up).unwrap()["DELETE"].as_u64().unwrap_or(0);
    // Puma and Rack do what the issue says when reached directly: the underscore spelling
    // and the override both run a DELETE.
    let direct = each(
        up,
        vec![post(
            "/transfers",
            "d",
            "{}",
            "X_HTTP_METHOD_OVERRIDE: DELETE\r\n",
        )],
    );
    assert_eq!(direct[0].status, 200, "{}", direct[0].text());
    assert_eq!(
        deletes(),
        1,
        "Puma reads X_HTTP_METHOD_OVERRIDE as the override"
    );
    let tricks = [
        "x-http-method-override: DELETE\r\nconnection: X-HTTP-Method-Override\r\n",
        "x-http-method-override: DELETE\r\nconnection: close, X-HTTP-Method-Override\r\n",
        "x-http-method-override: DELETE\r\nx-http-method-override: DELETE\r\n",
        "X_HTTP_METHOD_OVERRIDE: DELETE\r\n",
        "connection: Idempotency-Key\r\n",
    ];
    for (i, t) in tricks.iter().enumerate() {
        // Three sends under one key: never one execution, let alone three.
        for _ in 0..3 {
            let a = &each(g.addr, vec![post("/transfers", &format!("k-{i}"), "{}", t)])[0];
            assert_eq!(a.status, 400, "{t:?}: {}", a.text());
        }
    }
    assert_eq!((posts(), deletes()), (0, 1), "nothing ran through idemgate");
    // The override as Rack reads it passes as the DELETE it is; a POST runs once.
    let a = &each(
        g.addr,
        vec![post(
            "/transfers",
            "k-del",
            "{}",
            "x-http-method-override: DELETE\r\n",
        )],
    )[0];
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(deletes(), 2);
    for _ in 0..3 {
        let a = &each(g.addr, vec![post("/transfers", "k-post", "{}", "")])[0];
        assert_eq!(a.status, 201, "{}", a.text());
    }
    assert_eq!(posts(), 1);
}

// Node's `http` and uvicorn with httptools: framing.

/// On one connection: the POST under `key` to `path` with a GET pipelined behind it, then
/// the same POST again (its replay). The three answers.
fn framed(addr: SocketAddr, path: &str, key: &str) -> (Read1, Option<Read1>, Read1) {
    let mut c = Conn::open(addr);
    let mut bytes = post(path, key, "{}", "");
    bytes.extend(get("/balance"));
    c.send(&bytes);
    let first = c.read(false).expect("first");
    let next = c.read(false);
    c.send(&post(path, key, "{}", ""));
    let replay = c.read(false).expect("replay");
    (first, next, replay)
}

fn one_answer_framed_by_its_bytes(a: &Read1) {
    if let Some(n) = a.header("content-length") {
        assert_eq!(a.all("content-length"), vec![n]);
        assert_eq!(n, a.body.len().to_string(), "{a:?}");
    }
}

fn both_framing_headers(upstream: SocketAddr) {
    let (g, _dir) = gate(upstream, "");
    let (first, next, replay) = framed(g.addr, "/both", "k-both");
    assert_eq!(first.status, 201);
    assert_eq!(first.body.len(), 106, "{}", first.text());
    one_answer_framed_by_its_bytes(&first);
    assert_eq!(next.expect("next").text(), "{\"balance\":\"B-own\"}");
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(first.as_replayed(), replay.as_replayed());
    assert_eq!(ran(upstream), 1);
}

#[test]
fn node_http_with_both_framing_headers_is_one_answer_and_its_replay() {
    let (_node, up) = start(
        "node",
        &[dir().join("wire/node_framing.js").to_str().unwrap()],
        &[],
    );
    both_framing_headers(up);
}

#[test]
fn uvicorn_httptools_with_both_framing_headers_is_one_answer_and_its_replay() {
    let site = dir().join("wire/site");
    let (_uvicorn, up) = start(
        "python3",
        &[dir().join("wire/uvicorn_framing.py").to_str().unwrap()],
        &[("PYTHONPATH", site)],
    );
    both_framing_headers(up);
}

#[test]
fn node_http_lengths_that_disagree_with_the_body_head_101_and_connect() {
    let (_node, up) = start(
        "node",
        &[dir().join("wire/node_framing.js").to_str().unwrap()],
        &[],
    );
    let (g, _dir) = gate(up, "");
    // Longer than the body, buffered: a broken answer, held unknown, never run again.
    let long = each(
        g.addr,
        vec![
            post("/long", "k-long", "{}", ""),
            post("/long", "k-long", "{}", ""),
        ],
    );
    assert_eq!(long[0].status, 502, "{}", long[0].text());
    assert!(long[0].problem().ends_with("/upstream-broken-answer"));
    assert_eq!(long[1].status, 409, "{}", long[1].text());
    assert!(long[1].problem().ends_with("/outcome-unknown"));
    assert_eq!(ran(up), 1);
    // Longer, streamed (pass-through): the connection ends, no short answer then the next.
    let mut c = Conn::open(g.addr);
    let mut bytes = get("/long");
    bytes.extend(get("/balance"));
    c.send(&bytes);
    assert!(c.read(false).is_none(), "a short answer reached the client");
    // Shorter than the body, buffered and streamed: the declared bytes, then the next
    // answer is its own.
    for first in [post("/short", "k-short", "{}", ""), get("/short")] {
        let mut c = Conn::open(g.addr);
        let mut bytes = first;
        bytes.extend(get("/balance"));
        c.send(&bytes);
        let a = c.read(false).expect("first");
        assert_eq!(a.text(), "{\"id\":1}");
        one_answer_framed_by_its_bytes(&a);
        assert_eq!(
            c.read(false).expect("next").text(),
            "{\"balance\":\"B-own\"}"
        );
    }
    // HEAD: its length, no body, and the next answer its own.
    let mut c = Conn::open(g.addr);
    let mut bytes = b"HEAD /head HTTP/1.1\r\nhost: x\r\n\r\n".to_vec();
    bytes.extend(get("/balance"));
    c.send(&bytes);
    assert_eq!(
        c.read(true).expect("head").header("content-length"),
        Some("100")
    );
    assert_eq!(
        c.read(false).expect("next").text(),
        "{\"balance\":\"B-own\"}"
    );
    // A 101 to a protected POST: a broken answer, never recorded as the operation's.
    let before = ran(up);
    let up101 = each(
        g.addr,
        vec![
            post("/upgrade", "k-101", "{}", ""),
            post("/upgrade", "k-101", "{}", ""),
        ],
    );
    assert_eq!(up101[0].status, 502, "{}", up101[0].text());
    assert_eq!(up101[1].status, 409, "{}", up101[1].text());
    assert_eq!(ran(up), before + 1);
    // CONNECT: refused by idemgate, never forwarded.
    let mut c = Conn::open(g.addr);
    c.send(format!("CONNECT {up} HTTP/1.1\r\nhost: {up}\r\n\r\n").as_bytes());
    let a = c.read(false).expect("an answer to CONNECT");
    assert_eq!(a.status, 405);
    assert!(a.header("allow").is_some());
    assert_eq!(ran(up), before + 1);
}

// Path spellings behind real routers' defaults.

/// Runs `first` then each of `then` under one key through `g`: the answers.
fn under_one_key(g: &Gate, key: &str, paths: &[&[u8]]) -> Vec<Read1> {
    let requests = paths
        .iter()
        .map(|p| {
            let mut r = b"POST ".to_vec();
            r.extend_from_slice(p);
            let rest = post("", key, "{\"amount\":1}", "");
            r.extend_from_slice(&rest[5..]);
            r
        })
        .collect();
    each(g.addr, requests)
}

fn refused(a: &Read1) {
    assert_eq!(a.status, 400, "{}", a.text());
    assert!(a.problem().ends_with("/invalid-path"), "{}", a.text());
}

#[test]
fn express_default_routing_letter_case_is_refused_by_default() {
    let d = dir();
    let (_express, up) = start("node", &[d.join("express/app.js").to_str().unwrap()], &[]);
    // Express routes another case to the handler.
    let direct = each(up, vec![post("/V1/Transfers", "x", "{}", "")]);
    assert_eq!(direct[0].status, 201);
    let base = ran(up);
    let (g, _dir) = gate(
        up,
        "[[routes]]\npath = \"/v1/transfers\"\nrequire_key = true\n",
    );
    let answers = under_one_key(
        &g,
        "k-case",
        &[
            b"/v1/transfers",
            b"/V1/Transfers",
            b"/v1/TRANSFERS",
            b"/v1/transfer%53",
        ],
    );
    assert_eq!(answers[0].status, 201);
    for a in &answers[1..] {
        refused(a);
    }
    assert_eq!(ran(up), base + 1, "one execution under one key");
}

const KOA_ROUTE: &str =
    "[[routes]]\npath = \"/v1/accounts/{id}/transfers\"\nframework = \"koa\"\nrequire_key = true\n";

#[test]
fn koa2_router13_letter_case_and_a_raw_plus() {
    let d = dir();
    let (_koa, up) = start("node", &[d.join("koa2/app.js").to_str().unwrap()], &[]);
    // @koa/router 13 hands `a+b` to its handler as `a b`.
    let direct = each(up, vec![post("/v1/accounts/a+b/transfers", "x", "{}", "")]);
    assert!(
        direct[0].text().contains("\"account\":\"a b\""),
        "{}",
        direct[0].text()
    );
    let base = ran(up);
    // The preset cannot know the router's version: a raw `+` is refused.
    let (g, _dir) = gate(up, KOA_ROUTE);
    let answers = under_one_key(
        &g,
        "k-plus",
        &[
            b"/v1/accounts/a%20b/transfers",
            b"/v1/accounts/a+b/transfers",
        ],
    );
    assert_eq!(answers[0].status, 201);
    refused(&answers[1]);
    // Letter case: the preset says Koa folds it, so another case is the same operation.
    let answers = under_one_key(
        &g,
        "k-case",
        &[
            b"/v1/accounts/acct/transfers",
            b"/V1/Accounts/acct/TRANSFERS",
        ],
    );
    assert_eq!(answers[1].header("idempotent-replayed"), Some("true"));
    assert_eq!(ran(up), base + 2);
    drop(g);
    // Said: `+` a space, so `a+b` and `a%20b` are one account.
    let (g, _dir2) = gate(up, &format!("{KOA_ROUTE}plus_is_space = true\n"));
    let answers = under_one_key(
        &g,
        "k-space",
        &[
            b"/v1/accounts/a+b/transfers",
            b"/v1/accounts/a%20b/transfers",
        ],
    );
    assert_eq!(answers[0].status, 201);
    assert_eq!(answers[1].header("idempotent-replayed"), Some("true"));
    assert_eq!(ran(up), base + 3);
}

#[test]
fn tornado_raw_utf8_is_refused_by_default() {
    let site = dir().join("wire/site");
    let (_tornado, up) = start(
        "python3",
        &[dir().join("wire/tornado_app.py").to_str().unwrap()],
        &[("PYTHONPATH", site)],
    );
    // Tornado hands the raw bytes to its handler as another account than their escapes.
    let direct = each(
        up,
        vec![post("/v1/accounts/jos%C3%A9/transfers", "x", "{}", ""), {
            let mut r = b"POST /v1/accounts/jos\xc3\xa9/transfers".to_vec();
            r.extend_from_slice(&post("", "x", "{}", "")[5..]);
            r
        }],
    );
    let account = |a: &Read1| {
        serde_json::from_slice::<serde_json::Value>(&a.body).unwrap()["account"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_ne!(
        account(&direct[0]),
        account(&direct[1]),
        "Tornado reads two accounts"
    );
    let base = ran(up);
    let (g, _dir) = gate(
        up,
        "[[routes]]\npath = \"/v1/accounts/{id}/transfers\"\nrequire_key = true\n",
    );
    let answers = under_one_key(
        &g,
        "k-utf8",
        &[
            b"/v1/accounts/jos%C3%A9/transfers",
            b"/v1/accounts/jos\xc3\xa9/transfers",
        ],
    );
    assert_eq!(answers[0].status, 201);
    refused(&answers[1]);
    assert_eq!(ran(up), base + 1);
}
