//! `idemgate records`: the admin API's record endpoints from a shell, for whoever reconciles
//! `unknown` records. Each command is one or a few admin requests (`GET /records`,
//! `GET /records/{id}`, `POST /records/lookup`, `DELETE /records/{id}`,
//! `POST /records/{id}/complete`); the answer is printed as a table, or as the API's JSON
//! with `--json`.
//!
//! Exit codes: 0 done; 1 no such record; 2 refused (the owner may still be working on it,
//! the record already holds an answer, or a release of a `completed` record without
//! `--completed`); 64 usage (bad flags, or a request the API calls
//! malformed, or a reason it refuses: 400 `reason-required`); 69 the admin API cannot be
//! reached, or its store is unavailable (which includes listing on Redis Cluster: the
//! reason is printed); 70 an answer the CLI does not understand; 77 the admin token is
//! missing or wrong (401); 78 the token's role does not allow it (403 `role-forbidden`);
//! 79 refused as a write from another origin (403 `cross-origin-refused`); 80 the admin
//! listener does not answer to the host of `--admin-url` (421 `admin-host-refused`: add it
//! to `admin_hosts`); 81 a body of another type (415 `unsupported-media-type`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};

/// Done.
pub const OK: u8 = 0;
/// No such record.
pub const NOT_FOUND: u8 = 1;
/// Refused: the owner may still be working on it, or the record already holds an answer.
pub const REFUSED: u8 = 2;
/// Bad flags, or a request the admin API calls malformed.
pub const USAGE: u8 = 64;
/// The admin API cannot be reached, or answers that its store is unavailable.
pub const UNAVAILABLE: u8 = 69;
/// An answer the CLI does not understand.
pub const SOFTWARE: u8 = 70;
/// The admin token is missing or wrong.
pub const UNAUTHORIZED: u8 = 77;
/// The token's role does not allow it (403 `role-forbidden`).
pub const ROLE_FORBIDDEN: u8 = 78;
/// Refused as a write from another origin (403 `cross-origin-refused`).
pub const CROSS_ORIGIN: u8 = 79;
/// The admin listener does not answer to `--admin-url`'s host (421 `admin-host-refused`).
pub const HOST_REFUSED: u8 = 80;
/// The admin API refused the body's type (415 `unsupported-media-type`).
pub const UNSUPPORTED_MEDIA_TYPE: u8 = 81;

/// Records of the admin API: list, show, look up, release, complete.
#[derive(Parser, Debug)]
#[command(name = "idemgate records")]
pub struct RecordsCli {
    /// The admin listener's base URL (plain http).
    #[arg(
        long,
        env = "IDEMGATE_ADMIN_URL",
        value_name = "URL",
        default_value = "http://127.0.0.1:9901",
        global = true
    )]
    admin_url: String,
    /// The operator's token (`admin_token`, or one of `admin_operators`), sent as a bearer
    /// token.
    #[arg(
        long,
        env = "IDEMGATE_ADMIN_TOKEN",
        value_name = "TOKEN",
        hide_env_values = true,
        global = true
    )]
    token: Option<String>,
    /// Print the admin API's JSON instead of a table.
    #[arg(long, global = true)]
    json: bool,
    /// How long to wait for each answer of the admin API.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = humantime::parse_duration, global = true)]
    timeout: Duration,
    #[command(subcommand)]
    action: Action,
}

#[derive(clap::Subcommand, Debug)]
enum Action {
    /// Every record (of a state), following the listing's cursor to its end. Not available
    /// on Redis Cluster (the admin API says why).
    List {
        /// Only records in this state.
        #[arg(long, value_parser = ["unknown", "in_progress", "completed"])]
        state: Option<String>,
        /// Stop after this many records.
        #[arg(long, value_name = "N")]
        limit: Option<usize>,
    },
    /// One record.
    Show {
        /// The record id (64 hex characters).
        id: String,
        /// Also show the recorded body.
        #[arg(long)]
        body: bool,
    },
    /// The id and state of a request's record, computed as the proxy computes it.
    Lookup {
        /// The request's method, as the client sent it.
        #[arg(long, default_value = "POST")]
        method: String,
        /// The request's path, as the client sent it.
        #[arg(long)]
        path: String,
        /// The request's idempotency key.
        #[arg(long)]
        key: String,
        /// A header that names the tenant, as the client sent it (`Authorization: Bearer
        /// x`, the route's `tenant_headers`); repeatable.
        #[arg(long = "header", value_name = "NAME: VALUE", value_parser = parse_header)]
        headers: Vec<(String, String)>,
    },
    /// Deletes a record, so that the client's next retry executes (refused while its owner
    /// may still be working on it, unless forced).
    Release {
        /// The record id.
        id: String,
        /// Release even though its owner may still be working on it (only when that
        /// idemgate instance is known to be gone).
        #[arg(long)]
        force: bool,
        /// Release a `completed` record: its request executed, and the client's next retry
        /// executes it again instead of getting the recorded answer replayed (refused
        /// without this flag).
        #[arg(long)]
        completed: bool,
        /// Release a record written by a version that kept no namespace (`namespace:
        /// null` on the SQL stores): it may be another namespace's (refused without it).
        #[arg(long)]
        any_namespace: bool,
        /// Why (1 to 500 characters): the audit log keeps it with the operator's name.
        #[arg(long, value_name = "TEXT")]
        reason: String,
    },
    /// Records the answer an `unknown` record's request got, which its retries then get
    /// replayed.
    Complete {
        /// The record id.
        id: String,
        /// The status retries get.
        #[arg(long, value_name = "N")]
        status: u16,
        /// The body retries get (`-`: standard input); none without it.
        #[arg(long, value_name = "FILE")]
        body_file: Option<PathBuf>,
        /// A header retries get; repeatable.
        #[arg(long = "header", value_name = "NAME: VALUE", value_parser = parse_header)]
        headers: Vec<(String, String)>,
        /// Complete it even while it is `in_progress`.
        #[arg(long)]
        force: bool,
        /// Complete a record written by a version that kept no namespace (`namespace:
        /// null` on the SQL stores): it may be another namespace's (refused without it).
        #[arg(long)]
        any_namespace: bool,
        /// Why (1 to 500 characters): the audit log keeps it with the operator's name.
        #[arg(long, value_name = "TEXT")]
        reason: String,
    },
}

fn parse_header(s: &str) -> Result<(String, String), String> {
    let (name, value) = s
        .split_once(':')
        .ok_or_else(|| format!("`{s}` is not `Name: value`"))?;
    let name = name.trim();
    if name.is_empty() {
        return Err(format!("`{s}` has no header name"));
    }
    Ok((name.to_string(), value.trim().to_string()))
}

/// Runs `idemgate records ARGS...` (`args` without the program name and `records`) and
/// returns the exit code.
pub fn main(args: Vec<std::ffi::OsString>) -> u8 {
    let argv = std::iter::once(std::ffi::OsString::from("idemgate records")).chain(args);
    let cli = match RecordsCli::try_parse_from(argv) {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            let _ = e.print();
            return match e.kind() {
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => OK,
                _ => USAGE,
            };
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("idemgate records: cannot start a runtime: {e}");
            return 71;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(Failure { code, message }) => {
            eprintln!("idemgate records: {message}");
            code
        }
    }
}

/// Why a command did not finish: the exit code and what to tell.
struct Failure {
    code: u8,
    message: String,
}

fn fail(code: u8, message: impl Into<String>) -> Failure {
    Failure {
        code,
        message: message.into(),
    }
}

/// The admin listener, as the flags name it.
struct AdminApi {
    base: String,
    token: Option<String>,
    timeout: Duration,
    client: Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
}

/// One answer of the admin API.
struct Answer {
    status: StatusCode,
    body: Bytes,
}

impl Answer {
    fn json(&self) -> Result<Value, Failure> {
        serde_json::from_slice(&self.body).map_err(|_| {
            fail(
                SOFTWARE,
                format!(
                    "the admin API answered {} with a body that is not JSON: {}",
                    self.status,
                    String::from_utf8_lossy(&self.body).trim()
                ),
            )
        })
    }

    /// What the API said was wrong: a problem document's `detail`, an `error`, or the text.
    fn reason(&self) -> String {
        if let Ok(v) = serde_json::from_slice::<Value>(&self.body) {
            for field in ["detail", "error"] {
                if let Some(s) = v.get(field).and_then(Value::as_str) {
                    return s.to_string();
                }
            }
        }
        String::from_utf8_lossy(&self.body).trim().to_string()
    }

    /// The problem's name (the last segment of its `type`), if the answer is one.
    fn problem(&self) -> String {
        serde_json::from_slice::<Value>(&self.body)
            .ok()
            .and_then(|v| {
                v.get("type")
                    .and_then(Value::as_str)
                    .and_then(|t| t.rsplit('/').next())
                    .map(str::to_string)
            })
            .unwrap_or_default()
    }
}

/// `reason=...`, URL-encoded, for a decision's query.
fn reason_param(reason: &str) -> String {
    form_urlencoded::Serializer::new(String::new())
        .append_pair("reason", reason)
        .finish()
}

impl AdminApi {
    fn new(cli: &RecordsCli) -> Result<AdminApi, Failure> {
        let base = cli.admin_url.trim_end_matches('/').to_string();
        let uri: hyper::Uri = base
            .parse()
            .map_err(|_| fail(USAGE, format!("--admin-url `{base}` is not a URL")))?;
        if uri.scheme_str() != Some("http") || uri.authority().is_none() {
            return Err(fail(
                USAGE,
                format!("--admin-url `{base}` is not an http://host:port URL (the admin listener speaks plain HTTP)"),
            ));
        }
        let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
        Ok(AdminApi {
            base,
            token: cli.token.clone().filter(|t| !t.is_empty()),
            timeout: cli.timeout,
            client,
        })
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<Answer, Failure> {
        let url = format!("{}{path}", self.base);
        let mut req = Request::builder().method(method).uri(&url);
        if let Some(t) = &self.token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let body = match body {
            Some(v) => {
                req = req.header("content-type", "application/json");
                Bytes::from(v.to_string())
            }
            None => Bytes::new(),
        };
        let req = req
            .body(Full::new(body))
            .map_err(|e| fail(USAGE, format!("{url}: {e}")))?;
        let exchange = async {
            let res = self.client.request(req).await.map_err(|e| {
                let mut why = e.to_string();
                let mut source = std::error::Error::source(&e);
                while let Some(s) = source {
                    why = format!("{why}: {s}");
                    source = s.source();
                }
                fail(
                    UNAVAILABLE,
                    format!("cannot reach the admin API at {url}: {why}"),
                )
            })?;
            let status = res.status();
            let body = res
                .into_body()
                .collect()
                .await
                .map_err(|e| fail(UNAVAILABLE, format!("{url}: the answer broke off: {e}")))?
                .to_bytes();
            Ok(Answer { status, body })
        };
        match tokio::time::timeout(self.timeout, exchange).await {
            Ok(answer) => answer,
            Err(_) => Err(fail(
                UNAVAILABLE,
                format!(
                    "the admin API at {url} did not answer within {:?}",
                    self.timeout
                ),
            )),
        }
    }
}

/// The exit code and message of an answer that is not a success.
fn refusal(answer: &Answer, json: bool) -> Failure {
    if json {
        if let Ok(v) = serde_json::from_slice::<Value>(&answer.body) {
            println!("{v}");
        }
    }
    let reason = answer.reason();
    let problem = answer.problem();
    let code = match (answer.status, problem.as_str()) {
        (_, "role-forbidden") => {
            return fail(
                ROLE_FORBIDDEN,
                format!("403 role-forbidden: {reason} (ask an operator whose role allows it)"),
            )
        }
        (_, "cross-origin-refused") => {
            return fail(CROSS_ORIGIN, format!("403 cross-origin-refused: {reason}"))
        }
        (_, "admin-host-refused") => {
            return fail(
                HOST_REFUSED,
                format!("421 admin-host-refused: {reason} (or use the listener's address in --admin-url)"),
            )
        }
        (_, "unsupported-media-type") => {
            return fail(
                UNSUPPORTED_MEDIA_TYPE,
                format!("415 unsupported-media-type: {reason}"),
            )
        }
        (_, "reason-required") => {
            return fail(USAGE, format!("400 reason-required: {reason}"))
        }
        (StatusCode::NOT_FOUND, _) => NOT_FOUND,
        (StatusCode::CONFLICT, _) => REFUSED,
        (StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN, _) => {
            return fail(
                UNAUTHORIZED,
                format!(
                    "the admin API refused the token ({}): set --token or IDEMGATE_ADMIN_TOKEN to the proxy's admin_token or your own operator token",
                    answer.status
                ),
            )
        }
        (StatusCode::BAD_REQUEST, _) => USAGE,
        (StatusCode::SERVICE_UNAVAILABLE, _) => UNAVAILABLE,
        _ => SOFTWARE,
    };
    fail(code, format!("{}: {reason}", answer.status.as_u16()))
}

fn check_id(id: &str) -> Result<(), Failure> {
    if id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(())
    } else {
        Err(fail(
            USAGE,
            format!("`{id}` is not a record id (64 hex characters)"),
        ))
    }
}

async fn run(cli: RecordsCli) -> Result<u8, Failure> {
    let api = AdminApi::new(&cli)?;
    let json = cli.json;
    match cli.action {
        Action::List { state, limit } => list(&api, state.as_deref(), limit, json).await,
        Action::Show { id, body } => {
            check_id(&id)?;
            let path = format!("/records/{id}{}", if body { "?body=1" } else { "" });
            let answer = api.call(Method::GET, &path, None).await?;
            if !answer.status.is_success() {
                return Err(refusal(&answer, json));
            }
            let v = answer.json()?;
            if json {
                println!("{v}");
            } else {
                print!("{}", record_block(&v, now_ms()));
            }
            Ok(OK)
        }
        Action::Lookup {
            method,
            path,
            key,
            headers,
        } => {
            let headers: BTreeMap<String, String> = headers.into_iter().collect();
            let body = json!({"method": method, "path": path, "key": key, "headers": headers});
            lookup(&api, body, json).await
        }
        Action::Release {
            id,
            force,
            completed,
            any_namespace,
            reason,
        } => {
            check_id(&id)?;
            let mut query = Vec::new();
            if force {
                query.push("force=true".to_string());
            }
            if completed {
                query.push("completed=true".to_string());
            }
            if any_namespace {
                query.push("any_namespace=true".to_string());
            }
            // As a query parameter, which an instance that does not read it ignores.
            query.push(reason_param(&reason));
            let path = format!("/records/{id}?{}", query.join("&"));
            let answer = api.call(Method::DELETE, &path, None).await?;
            if !answer.status.is_success() {
                return Err(release_refused(&answer, json));
            }
            print_answer(&answer.json()?, json, |v| {
                let was = v["released"]["state"].as_str().unwrap_or("-");
                let next = match (was, v["released"]["status"].as_u64()) {
                    ("completed", Some(s)) => format!("the client's next retry executes the request again (it had executed and been answered {s}; that answer is no longer replayed)"),
                    ("completed", None) => "the client's next retry executes the request again (it had executed; its answer is no longer replayed)".to_string(),
                    _ => "the client's next retry executes the request".to_string(),
                };
                format!("released {id} (was {was}); {next}")
            });
            Ok(OK)
        }
        Action::Complete {
            id,
            status,
            body_file,
            headers,
            force,
            any_namespace,
            reason,
        } => {
            check_id(&id)?;
            let outcome = outcome(status, body_file.as_deref(), headers)?;
            let force = if force { "force=true&" } else { "" };
            let any = if any_namespace {
                "any_namespace=true&"
            } else {
                ""
            };
            let path = format!(
                "/records/{id}/complete?{force}{any}{}",
                reason_param(&reason)
            );
            let answer = api.call(Method::POST, &path, Some(outcome)).await?;
            if !answer.status.is_success() {
                let mut failure = refusal(&answer, json);
                if unscoped_refusal(&answer) {
                    failure
                        .message
                        .push_str(" [here: `idemgate records complete ID --any-namespace`]");
                }
                return Err(failure);
            }
            print_answer(&answer.json()?, json, |v| {
                let was = v["was"]["state"].as_str().unwrap_or("-");
                format!("completed {id} (was {was}); its retries get {status} replayed")
            });
            Ok(OK)
        }
    }
}

/// `lookup`: `POST /records/lookup` with `body`; exit 1 when no record answers to it.
async fn lookup(api: &AdminApi, body: Value, json: bool) -> Result<u8, Failure> {
    let answer = api
        .call(Method::POST, "/records/lookup", Some(body))
        .await?;
    if !answer.status.is_success() {
        return Err(refusal(&answer, json));
    }
    let v = answer.json()?;
    let found = !v["record"].is_null();
    if json {
        println!("{v}");
    } else if found {
        print!("{}", record_block(&v["record"], now_ms()));
    } else {
        println!("id     {}", text(&v["id"]));
        println!("state  - (no record: the request was never claimed, or its record expired or was released)");
    }
    Ok(if found { OK } else { NOT_FOUND })
}

/// A refused release, with the flag that would have it go through when it was refused
/// for the record's state.
fn release_refused(answer: &Answer, json: bool) -> Failure {
    let mut failure = refusal(answer, json);
    if answer.status == StatusCode::CONFLICT {
        let refused = serde_json::from_slice::<Value>(&answer.body).unwrap_or_default();
        failure
            .message
            .push_str(if refused["state"] == "completed" {
                " [here: `idemgate records release ID --completed`]"
            } else if unscoped_refusal(answer) {
                " [here: `idemgate records release ID --any-namespace`]"
            } else {
                " [here: `idemgate records release ID --force`]"
            });
    }
    failure
}

/// Whether `answer` refused to change a record written without a namespace (409 with
/// `"namespace": null`), which `--any-namespace` reaches.
fn unscoped_refusal(answer: &Answer) -> bool {
    answer.status == StatusCode::CONFLICT
        && serde_json::from_slice::<Value>(&answer.body)
            .is_ok_and(|v| v.get("namespace").is_some_and(Value::is_null))
}

/// `complete`'s outcome as the API takes it: the status, the headers, and the body read
/// from `body_file` (`-` for stdin), as text when it is UTF-8, else base64.
fn outcome(
    status: u16,
    body_file: Option<&std::path::Path>,
    headers: Vec<(String, String)>,
) -> Result<Value, Failure> {
    let bytes = match body_file {
        None => Vec::new(),
        Some(p) if p.as_os_str() == "-" => {
            use std::io::Read;
            let mut buf = Vec::new();
            std::io::stdin()
                .read_to_end(&mut buf)
                .map_err(|e| fail(USAGE, format!("--body-file -: {e}")))?;
            buf
        }
        Some(p) => std::fs::read(p)
            .map_err(|e| fail(USAGE, format!("--body-file {}: {e}", p.display())))?,
    };
    let headers: BTreeMap<String, String> = headers.into_iter().collect();
    let mut outcome = json!({"status": status, "headers": headers});
    match String::from_utf8(bytes) {
        Ok(text) => outcome["body"] = Value::String(text),
        Err(e) => {
            outcome["body_base64"] =
                Value::String(base64::engine::general_purpose::STANDARD.encode(e.into_bytes()))
        }
    }
    Ok(outcome)
}

/// `list`: every page of `GET /records`, up to `limit` records.
async fn list(
    api: &AdminApi,
    state: Option<&str>,
    limit: Option<usize>,
    json: bool,
) -> Result<u8, Failure> {
    let mut records: Vec<Value> = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut query: Vec<(&str, &str)> = Vec::new();
        if let Some(s) = state {
            query.push(("state", s));
        }
        if let Some(c) = cursor.as_deref() {
            query.push(("cursor", c));
        }
        let query: String = form_urlencoded::Serializer::new(String::new())
            .extend_pairs(query)
            .finish();
        let path = if query.is_empty() {
            "/records".to_string()
        } else {
            format!("/records?{query}")
        };
        let answer = api.call(Method::GET, &path, None).await?;
        if !answer.status.is_success() {
            let mut failure = refusal(&answer, json);
            if answer.status == StatusCode::SERVICE_UNAVAILABLE {
                failure.message = format!("cannot list: {}", failure.message);
            }
            return Err(failure);
        }
        let page = answer.json()?;
        let Some(page_records) = page["records"].as_array() else {
            return Err(fail(SOFTWARE, format!("not a page of records: {page}")));
        };
        records.extend(page_records.iter().cloned());
        cursor = page["cursor"].as_str().map(str::to_string);
        if let Some(n) = limit {
            if records.len() >= n {
                records.truncate(n);
                break;
            }
        }
        if cursor.is_none() {
            break;
        }
    }
    if json {
        println!("{}", json!({"records": records, "cursor": cursor}));
    } else {
        print!("{}", table(&records, now_ms()));
    }
    Ok(OK)
}

/// Prints an operator action's answer: as the admin API sent it (`--json`), or the one line
/// `line` makes of it for a person.
fn print_answer(v: &Value, json: bool, line: impl FnOnce(&Value) -> String) {
    if json {
        println!("{v}");
    } else {
        println!("{}", line(v));
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn text(v: &Value) -> String {
    match v {
        Value::Null => "-".to_string(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Milliseconds as a short duration: `850ms`, `12s`, `3m20s`, `5h2m`, `2d3h`.
fn short(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        _ if ms < 1000 => format!("{ms}ms"),
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{}s", s / 60, s % 60),
        3600..86400 => format!("{}h{}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{}h", s / 86400, s % 86400 / 3600),
    }
}

fn ms_field(v: &Value, name: &str) -> String {
    v[name].as_u64().map_or_else(|| "-".to_string(), short)
}

/// How long ago the store created it (by this machine's clock against the store's).
fn age(v: &Value, now_ms: u64) -> String {
    v["created_ms"]
        .as_u64()
        .map_or_else(|| "-".to_string(), |c| short(now_ms.saturating_sub(c)))
}

/// What holds a record back from a plain release: its live lease, or its owner's wait for
/// the upstream.
fn busy(v: &Value) -> String {
    match (v["lease_left_ms"].as_u64(), v["owner_busy_ms"].as_u64()) {
        (Some(ms), _) => format!("lease {}", short(ms)),
        (None, Some(ms)) => format!("owner {}", short(ms)),
        (None, None) => "-".to_string(),
    }
}

/// One line per record, in aligned columns.
fn table(records: &[Value], now_ms: u64) -> String {
    let mut rows = vec![[
        "ID".to_string(),
        "STATE".to_string(),
        "STATUS".to_string(),
        "AGE".to_string(),
        "TTL".to_string(),
        "BUSY".to_string(),
    ]];
    for r in records {
        rows.push([
            text(&r["id"]),
            text(&r["state"]),
            text(&r["status"]),
            age(r, now_ms),
            ms_field(r, "ttl_ms"),
            busy(r),
        ]);
    }
    let mut widths = [0usize; 6];
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let mut out = String::new();
    for row in &rows {
        let line: Vec<String> = row
            .iter()
            .zip(widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}

mod block;

use self::block::record_block;

#[cfg(test)]
mod tests;
