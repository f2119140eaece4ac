//! Real frameworks as upstreams: Express 5, Koa 3, Fastify 5, Flask 3.1, Starlette 1.10 and
//! Debian's Jetty 9.4, each with a transfer handler at `/v1/transfers` that counts its
//! executions, behind the binary with a route that protects it (`require_key = true`). Every spelling of the corpus
//! (`tests/frameworks/spellings.txt`) is sent as raw bytes, directly (what the framework
//! routes to the handler) and through idemgate, and the handler's own count is the oracle:
//! under one key it runs at most once whatever the spelling, and never without a key.
//!
//! The second test puts each framework's parameterised handler
//! (`/v1/accounts/:id/transfers`, which answers with the account and method it was handed)
//! behind a template route and the framework's preset, and sends pairs of requests under
//! one key (a parameter escaped and raw, in another case, trailing control characters,
//! another method case, `_method` bodies, suffixes): a replay must answer what the handler
//! runs as the first request, and what it runs as the first must not run again.
//!
//! The frameworks are installed, pinned, by `tests/frameworks/install.sh`, which the tests'
//! shared set-up (`tests/setup/install.sh`) runs once per machine into its cache. `docs/path-spellings.md` holds the table this test
//! makes: it fails when the table there differs; `IDEMGATE_WRITE_DOCS=1` rewrites it.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const BODY: &str = r#"{"amount":10,"to":"acct-2"}"#;

/// A framework's server process, killed on drop.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

struct Reply {
    status: u16,
    problem: Option<String>,
    replayed: bool,
    /// The answer's body (the handler's JSON).
    body: String,
}

impl Reply {
    /// What the parameterised handler says it was handed: (account, method).
    fn handed(&self) -> Option<(String, String)> {
        let v: serde_json::Value = serde_json::from_str(self.body.trim()).ok()?;
        Some((
            v["account"].as_str()?.to_string(),
            v["method"].as_str()?.to_string(),
        ))
    }
}

/// Sends `POST target` (its bytes as they are) with `headers`; `None` when the connection
/// broke before an answer.
fn post(addr: SocketAddr, target: &[u8], headers: &[(&str, &str)]) -> Option<Reply> {
    send(addr, "POST", target, headers, "application/json", BODY)
}

/// Sends `method target` with a body of `content_type`.
fn send(
    addr: SocketAddr,
    method: &str,
    target: &[u8],
    headers: &[(&str, &str)],
    content_type: &str,
    body: &str,
) -> Option<Reply> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    let mut req = format!("{method} ").into_bytes();
    req.extend_from_slice(target);
    req.extend_from_slice(
        format!(
            " HTTP/1.1\r\nHost: {addr}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n",
            body.len()
        )
        .as_bytes(),
    );
    for (k, v) in headers {
        req.extend_from_slice(format!("{k}: {v}\r\n").as_bytes());
    }
    req.extend_from_slice(b"\r\n");
    req.extend_from_slice(body.as_bytes());
    s.write_all(&req).ok()?;
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out);
    let status = text.split(' ').nth(1)?.parse().ok()?;
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let header = |name: &str| {
        head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case(name).then(|| v.trim().to_string())
        })
    };
    // A chunked body is one chunk here: its JSON is on the line after the size.
    let body = if header("transfer-encoding").is_some_and(|t| t.contains("chunked")) {
        rest.lines().nth(1).unwrap_or_default().to_string()
    } else {
        rest.to_string()
    };
    Some(Reply {
        status,
        problem: header("idemgate-error"),
        replayed: header("idempotent-replayed").as_deref() == Some("true"),
        body,
    })
}

/// The handler's executions so far, asked of the framework directly.
fn executions(addr: SocketAddr) -> Option<u64> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(
        format!("GET /count HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .ok()?;
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let body = out.split("\r\n\r\n").nth(1)?;
    let body = body.trim_start_matches(|c: char| c != '{');
    let v: serde_json::Value = serde_json::from_str(body.split('\n').next()?.trim()).ok()?;
    v["n"].as_u64()
}

/// The corpus, each spelling as its bytes and as written in the corpus.
fn corpus() -> Vec<(Vec<u8>, String)> {
    let text = include_str!("frameworks/spellings.txt");
    text.lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let mut bytes = Vec::new();
            let b = l.as_bytes();
            let mut i = 0;
            while i < b.len() {
                if b[i] == b'\\' && b.get(i + 1) == Some(&b'\\') {
                    bytes.push(b'\\');
                    i += 2;
                } else if b[i] == b'\\' && b.get(i + 1) == Some(&b'x') {
                    let hex = std::str::from_utf8(&b[i + 2..i + 4]).unwrap();
                    bytes.push(u8::from_str_radix(hex, 16).unwrap());
                    i += 4;
                } else {
                    bytes.push(b[i]);
                    i += 1;
                }
            }
            (bytes, l.to_string())
        })
        .collect()
}

/// Where the frameworks are installed: in the tests' shared cache (tests/setup/install.sh).
fn install_dir() -> PathBuf {
    common::setup::tools().join("frameworks")
}

fn wait_until(what: &str, ready: impl FnMut() -> bool) {
    common::wait_until(
        Duration::from_secs(60),
        &format!("{what} to be ready"),
        ready,
    );
}

fn start(framework: &str, dir: &Path) -> (Server, SocketAddr) {
    let port = common::free_port();
    let mut cmd = match framework {
        "express" | "koa" | "fastify" => {
            let mut c = Command::new("node");
            c.arg(dir.join(framework).join("app.js"));
            c
        }
        "flask" => {
            let mut c = Command::new("python3");
            c.env("PYTHONPATH", dir.join("flask/site"))
                .arg(dir.join("flask/app.py"));
            c
        }
        "starlette" => {
            let mut c = Command::new("python3");
            c.env("PYTHONPATH", dir.join("starlette/site"))
                .arg(dir.join("starlette/app.py"));
            c
        }
        "jetty" => {
            let cp = std::fs::read_to_string(dir.join("jetty/classpath")).unwrap();
            let mut c = Command::new("java");
            c.arg("-cp").arg(cp.trim()).arg("Transfers");
            c
        }
        other => panic!("no framework {other}"),
    };
    let child = cmd
        .arg(port.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("start {framework}: {e}"));
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let server = Server(child);
    wait_until(framework, || executions(addr).is_some());
    (server, addr)
}

fn start_idemgate(
    upstream: SocketAddr,
    route_extra: &str,
) -> (Server, SocketAddr, tempfile::TempDir) {
    start_idemgate_on(upstream, "/v1/transfers", route_extra)
}

/// idemgate in front of `upstream` with one route, `path`, that requires a key.
fn start_idemgate_on(
    upstream: SocketAddr,
    path: &str,
    route_extra: &str,
) -> (Server, SocketAddr, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let (port, admin) = (common::free_port(), common::free_port());
    let config = format!(
        "listen = \"127.0.0.1:{port}\"\nadmin_listen = \"127.0.0.1:{admin}\"\nupstream = \"http://{upstream}\"\n\n[[routes]]\npath = \"{path}\"\nrequire_key = true\n{route_extra}\n"
    );
    let file = dir.path().join("idemgate.toml");
    std::fs::write(&file, config).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .env_clear()
        .env("IDEMGATE_CONFIG", &file)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let server = Server(child);
    let admin: SocketAddr = format!("127.0.0.1:{admin}").parse().unwrap();
    wait_until("idemgate", || common::started(admin));
    (server, format!("127.0.0.1:{port}").parse().unwrap(), dir)
}

/// What one spelling did on one framework: directly, then through idemgate.
struct Cell {
    direct: String,
    through: String,
}

fn describe(r: &Option<Reply>, ran: bool) -> String {
    match r {
        None => "no answer".into(),
        Some(_) if ran => "runs the handler".into(),
        Some(r) if r.replayed => "same operation (replayed)".into(),
        Some(Reply {
            status,
            problem: Some(p),
            ..
        }) => format!("{status} {p}"),
        Some(r) => format!("{} (not the handler)", r.status),
    }
}

/// Runs the corpus against one framework behind a route with `route_extra`; the violations
/// found, and the table column.
fn run(framework: &str, route_extra: &str, dir: &Path) -> (Vec<String>, Vec<Cell>) {
    let (_fw, fw) = start(framework, dir);
    let (_idemgate, proxy, _config) = start_idemgate(fw, route_extra);
    let auth = ("Authorization", "Bearer acct-1");
    let count = || executions(fw).expect("the framework's count");
    let mut violations = Vec::new();
    let mut cells = Vec::new();
    for (i, (target, written)) in corpus().into_iter().enumerate() {
        // Directly: does the framework route this spelling to the handler?
        let before = count();
        let direct = post(fw, &target, &[]);
        let routes_to_handler = count() > before;
        // The plain spelling first, then this one, under one key: one execution.
        let k1 = format!("{framework}-{i}-first");
        let before = count();
        let plain = post(proxy, b"/v1/transfers", &[auth, ("Idempotency-Key", &k1)]);
        let after_plain = count();
        if after_plain != before + 1 || plain.as_ref().map(|r| r.status) != Some(201) {
            violations.push(format!(
                "{written}: the plain spelling under a new key did not run once"
            ));
        }
        let second = post(proxy, &target, &[auth, ("Idempotency-Key", &k1)]);
        if count() != after_plain {
            violations.push(format!(
                "{written}: ran again under the key of `/v1/transfers` ({:?})",
                second.as_ref().map(|r| r.status)
            ));
        }
        // This spelling first, then the plain one: at most one execution.
        let k2 = format!("{framework}-{i}-second");
        let before = count();
        post(proxy, &target, &[auth, ("Idempotency-Key", &k2)]);
        post(proxy, b"/v1/transfers", &[auth, ("Idempotency-Key", &k2)]);
        if count() > before + 1 {
            violations.push(format!(
                "{written}: then `/v1/transfers` under one key ran {} times",
                count() - before
            ));
        }
        // No key: `require_key` holds whatever the spelling.
        let before = count();
        let keyless = post(proxy, &target, &[auth]);
        if count() != before {
            violations.push(format!(
                "{written}: ran without a key ({:?})",
                keyless.as_ref().map(|r| r.status)
            ));
        }
        cells.push(Cell {
            direct: if routes_to_handler {
                "handler".into()
            } else {
                direct.map_or("no answer".into(), |r| r.status.to_string())
            },
            through: describe(&second, false),
        });
    }
    (violations, cells)
}

const COLUMNS: [(&str, &str, &str); 7] = [
    ("Express 5.2", "express", "case_insensitive_paths = true"),
    (
        "Koa 3.3, `framework = \"koa\"`",
        "koa",
        "framework = \"koa\"",
    ),
    (
        "Fastify 5.12, `framework = \"fastify\"`",
        "fastify",
        "framework = \"fastify\"",
    ),
    ("Flask 3.1", "flask", ""),
    (
        "Starlette 1.10, `framework = \"fastapi\"`",
        "starlette",
        "framework = \"fastapi\"",
    ),
    ("Jetty 9.4", "jetty", ""),
    (
        "Jetty 9.4, `path_params = \"strip\"`",
        "jetty",
        "path_params = \"strip\"",
    ),
];

#[test]
fn every_spelling_a_framework_routes_to_the_handler_is_one_operation_or_refused() {
    let dir = install_dir();
    let mut all_violations = Vec::new();
    let mut columns = Vec::new();
    for (title, framework, extra) in COLUMNS {
        let (violations, cells) = run(framework, extra, &dir);
        all_violations.extend(violations.into_iter().map(|v| format!("{title}: {v}")));
        columns.push(cells);
    }
    assert!(
        all_violations.is_empty(),
        "{} violations:\n{}",
        all_violations.len(),
        all_violations.join("\n")
    );
    check_docs_block("spellings", &table(&columns));
}

/// Checks that docs/path-spellings.md shows `table` between `<!-- name:begin -->` and
/// `<!-- name:end -->`; `IDEMGATE_WRITE_DOCS=1` rewrites it there.
fn check_docs_block(name: &str, table: &str) {
    let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/path-spellings.md");
    let text = std::fs::read_to_string(&docs).unwrap_or_default();
    let (begin, end) = (
        format!("<!-- {name}:begin -->\n"),
        format!("<!-- {name}:end -->"),
    );
    if std::env::var_os("IDEMGATE_WRITE_DOCS").is_some() {
        let (Some(b), Some(e)) = (text.find(&begin), text.find(&end)) else {
            panic!("docs/path-spellings.md has no {begin:?} ... {end:?} block");
        };
        let new = format!("{}{table}{}", &text[..b + begin.len()], &text[e..]);
        std::fs::write(&docs, new).unwrap();
    } else {
        assert!(
            text.contains(&format!("{begin}{table}{end}")),
            "docs/path-spellings.md does not show what the frameworks did; run with IDEMGATE_WRITE_DOCS=1 to rewrite its table:\n{table}"
        );
    }
}

fn table(columns: &[Vec<Cell>]) -> String {
    let mut out = String::from("| Spelling |");
    for (title, _, _) in COLUMNS {
        out.push_str(&format!(" {title} |"));
    }
    out.push_str("\n|---|");
    out.push_str(&"---|".repeat(COLUMNS.len()));
    out.push('\n');
    for (i, (_, written)) in corpus().iter().enumerate() {
        out.push_str(&format!("| `{written}` |"));
        for col in columns {
            let c = &col[i];
            out.push_str(&format!(" {}: {} |", c.direct, c.through));
        }
        out.push('\n');
    }
    out
}

/// One cell of the parameter table: a first request (`POST`, JSON) and a second under the
/// same key, as a method, a target, a content type and a body.
struct Pair {
    label: &'static str,
    first: &'static str,
    method: &'static str,
    second: &'static str,
    content_type: &'static str,
    body: &'static str,
}

const JSON: &str = "application/json";
const FORM: &str = "application/x-www-form-urlencoded";
const MULTIPART: &str = "multipart/form-data; boundary=b0";
const MULTIPART_BODY: &str =
    "--b0\r\ncontent-disposition: form-data; name=\"_method\"\r\n\r\nPATCH\r\n--b0--\r\n";

const fn pair(label: &'static str, first: &'static str, second: &'static str) -> Pair {
    Pair {
        label,
        first,
        method: "POST",
        second,
        content_type: JSON,
        body: BODY,
    }
}

const ALICE: &str = "/v1/accounts/alice/transfers";

const PAIRS: [Pair; 17] = [
    pair(
        "`@`, then `%40`",
        "/v1/accounts/alice@example.com/transfers",
        "/v1/accounts/alice%40example.com/transfers",
    ),
    pair(
        "`%40`, then `@`",
        "/v1/accounts/bob%40example.com/transfers",
        "/v1/accounts/bob@example.com/transfers",
    ),
    pair(
        "`:`, then `%3a`",
        "/v1/accounts/a:b/transfers",
        "/v1/accounts/a%3ab/transfers",
    ),
    pair(
        "`+`, then `%20`",
        "/v1/accounts/al+b/transfers",
        "/v1/accounts/al%20b/transfers",
    ),
    pair(
        "`+`, then `%2B`",
        "/v1/accounts/al+c/transfers",
        "/v1/accounts/al%2Bc/transfers",
    ),
    pair("parameter's case", ALICE, "/v1/accounts/ALICE/transfers"),
    pair(
        "literal segments' case",
        ALICE,
        "/V1/Accounts/alice/TRANSFERS",
    ),
    pair("trailing `%0A`", ALICE, "/v1/accounts/alice/transfers%0A"),
    pair(
        "trailing `%0D%0A`",
        ALICE,
        "/v1/accounts/alice/transfers%0D%0A",
    ),
    pair(
        "`%0A` in the parameter",
        ALICE,
        "/v1/accounts/alice%0A/transfers",
    ),
    pair("trailing `.`", ALICE, "/v1/accounts/alice/transfers."),
    pair("trailing `%20`", ALICE, "/v1/accounts/alice/transfers%20"),
    pair(
        "U+FFFD, then `%E9`",
        "/v1/accounts/jos%EF%BF%BD/transfers",
        "/v1/accounts/jos%E9/transfers",
    ),
    pair("`.json` suffix", ALICE, "/v1/accounts/alice/transfers.json"),
    Pair {
        method: "post",
        ..pair("method `post`", ALICE, ALICE)
    },
    Pair {
        content_type: FORM,
        body: "amount=10&_method=PATCH",
        ..pair("`_method=PATCH` form body", ALICE, ALICE)
    },
    Pair {
        content_type: MULTIPART,
        body: MULTIPART_BODY,
        ..pair("`_method` multipart body", ALICE, ALICE)
    },
];

/// The frameworks of the parameter table: title, framework, the route's setting.
const PARAM_COLUMNS: [(&str, &str, &str); 5] = [
    ("Express 5.2", "express", "framework = \"express\""),
    // @koa/router 15 keeps a `+`, which the preset cannot know (13 reads a space).
    (
        "Koa 3.3",
        "koa",
        "framework = \"koa\"\nplus_is_space = false",
    ),
    ("Fastify 5.12", "fastify", "framework = \"fastify\""),
    ("Flask 3.1", "flask", "framework = \"flask\""),
    ("Starlette 1.10", "starlette", "framework = \"fastapi\""),
];

/// What the framework made of a request sent to it directly.
fn direct_cell(reply: &Option<Reply>, ran: bool) -> String {
    match (reply, ran) {
        (Some(r), true) => match r.handed() {
            Some((account, method)) => format!("`{}` {method}", account.escape_debug()),
            None => "handler".into(),
        },
        (Some(r), false) => r.status.to_string(),
        (None, _) => "no answer".into(),
    }
}

/// Runs every pair against one framework behind `/v1/accounts/{id}/transfers` with
/// `route_extra`: the violations, and the column.
fn run_pairs(framework: &str, route_extra: &str, dir: &Path) -> (Vec<String>, Vec<Cell>) {
    let (_fw, fw) = start(framework, dir);
    let (_idemgate, proxy, _config) =
        start_idemgate_on(fw, "/v1/accounts/{id}/transfers", route_extra);
    let auth = ("Authorization", "Bearer acct-1");
    let count = || executions(fw).expect("the framework's count");
    let mut violations = Vec::new();
    let mut cells = Vec::new();
    for (i, p) in PAIRS.iter().enumerate() {
        let label = p.label;
        // Directly: what the framework hands its handler for the second request.
        let before = count();
        let direct = send(
            fw,
            p.method,
            p.second.as_bytes(),
            &[],
            p.content_type,
            p.body,
        );
        let ran = count() > before;
        let handed = direct.as_ref().filter(|_| ran).and_then(Reply::handed);
        // Through idemgate, under one key: the first, then the second.
        let key = format!("{framework}-pair-{i}");
        let keyed = [auth, ("Idempotency-Key", key.as_str())];
        let before = count();
        let first = post(proxy, p.first.as_bytes(), &keyed);
        let first_handed = first.as_ref().and_then(Reply::handed);
        if count() != before + 1 || first_handed.is_none() {
            violations.push(format!("{label}: the first request did not run once"));
        }
        let after_first = count();
        let second = send(
            proxy,
            p.method,
            p.second.as_bytes(),
            &keyed,
            p.content_type,
            p.body,
        );
        let ran_again = count() > after_first;
        let through = match &second {
            None => "no answer".to_string(),
            Some(r) if r.replayed => {
                // A replay is right only for what the framework runs as the first.
                if handed.is_some() && handed != first_handed {
                    violations.push(format!(
                        "{label}: replayed {first_handed:?}'s answer for {handed:?}"
                    ));
                }
                "replayed".into()
            }
            Some(r) if ran_again => {
                if handed == first_handed {
                    violations.push(format!("{label}: ran {handed:?} twice under one key"));
                }
                match r.handed() {
                    Some((account, _)) => {
                        format!("another operation (`{}`)", account.escape_debug())
                    }
                    None => "another operation".into(),
                }
            }
            Some(Reply {
                status,
                problem: Some(problem),
                ..
            }) => format!("{status} {problem}"),
            Some(r) => format!("{} (not the handler)", r.status),
        };
        // No key: `require_key` holds whatever the spelling.
        let before = count();
        send(
            proxy,
            p.method,
            p.second.as_bytes(),
            &[auth],
            p.content_type,
            p.body,
        );
        if count() != before {
            violations.push(format!("{label}: ran without a key"));
        }
        cells.push(Cell {
            direct: direct_cell(&direct, ran),
            through,
        });
    }
    (violations, cells)
}

#[test]
fn a_parameter_a_method_and_a_body_are_one_operation_as_the_handler_gets_them() {
    let dir = install_dir();
    let mut all_violations = Vec::new();
    let mut columns = Vec::new();
    for (title, framework, extra) in PARAM_COLUMNS {
        let (violations, cells) = run_pairs(framework, extra, &dir);
        all_violations.extend(violations.into_iter().map(|v| format!("{title}: {v}")));
        columns.push(cells);
    }
    assert!(
        all_violations.is_empty(),
        "{} violations:\n{}",
        all_violations.len(),
        all_violations.join("\n")
    );
    let mut table = String::from("| Second request, after `POST` of the first under its key |");
    for (title, _, extra) in PARAM_COLUMNS {
        let extra = extra.replace('\n', "`, `");
        table.push_str(&format!(" {title}, `{extra}` |"));
    }
    table.push_str("\n|---|");
    table.push_str(&"---|".repeat(PARAM_COLUMNS.len()));
    table.push('\n');
    for (i, p) in PAIRS.iter().enumerate() {
        table.push_str(&format!("| {} |", p.label));
        for col in &columns {
            let c = &col[i];
            table.push_str(&format!(" {}: {} |", c.direct, c.through));
        }
        table.push('\n');
    }
    check_docs_block("parameters", &table);
}
