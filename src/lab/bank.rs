//! A deliberately non-idempotent legacy payment API.
//!
//! Every `POST /transfers` moves money, however many times it arrives: that is the bug
//! idemgate exists to hide. The `Idempotency-Key` header is written into the ledger row for
//! the auditor and never read by the bank itself.
//!
//! The transfer is committed *before* the configured latency, and the answer is sent after
//! it, so a client that gives up during a slow answer has still moved the money.
//!
//! Crates: `hyper`/`hyper-util` serve HTTP/1.1 on a plain tokio listener (the same stack the
//! proxy uses, so no second HTTP framework); `http-body-util` collects bounded request bodies;
//! `bytes` holds response bodies; `tokio` for the listener, timers and the shutdown signal;
//! `serde`/`serde_json` for the JSON API and the ledger snapshot; `rand` draws the latency
//! from a seeded generator; `tracing` reports connection errors.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio::sync::{watch, Notify};
use tokio::task::JoinSet;

/// A transfer request larger than this is not a transfer.
const MAX_BODY_BYTES: usize = 64 * 1024;
/// A client that opens a connection and never finishes its request headers is dropped.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Nor does the bank wait forever for a body that was announced and never sent.
const BODY_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// A connection closed without saying so goes this long after its answer.
const SILENT_CLOSE_AFTER: Duration = Duration::from_millis(20);
/// How long `serve` waits for open connections after it was told to stop.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// How slowly the bank answers a transfer.
#[derive(Debug, Clone, Serialize)]
pub struct BankOptions {
    /// Typical latency; each answer draws uniformly from half to one and a half times this.
    pub base_latency: Duration,
    /// The slow tail: some answers take this long, long enough for impatient clients to give up.
    pub slow_latency: Duration,
    /// Share of transfer answers (0.0 to 1.0) that take `slow_latency`.
    pub slow_ratio: f64,
    /// Seeds the latency draws, so a bank's sequence of latencies is reproducible.
    pub seed: u64,
}

impl Default for BankOptions {
    fn default() -> Self {
        BankOptions {
            base_latency: Duration::from_millis(4),
            slow_latency: Duration::from_millis(300),
            slow_ratio: 0.15,
            seed: 7,
        }
    }
}

/// One executed transfer, as the ledger keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferRow {
    /// Ledger order: 1 for the first transfer the bank ever executed.
    pub id: u64,
    pub from: String,
    pub to: String,
    /// Minor units (cents).
    pub amount: i64,
    /// The `Idempotency-Key` header the request arrived with, for auditing only.
    pub idempotency_key: Option<String>,
}

/// A consistent copy of the whole ledger.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LedgerSnapshot {
    /// Balance per account id, in minor units.
    pub accounts: BTreeMap<String, i64>,
    /// Every executed transfer, in the order it was executed.
    pub transfers: Vec<TransferRow>,
}

/// Why the bank refused a transfer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransferError {
    UnknownAccount(String),
    InsufficientFunds { balance: i64 },
    Invalid(&'static str),
}

/// The bank: a ledger behind a mutex. Cloning shares the same ledger.
#[derive(Clone)]
pub struct Bank {
    inner: Arc<Inner>,
}

struct Inner {
    ledger: Mutex<LedgerSnapshot>,
    /// Latency draws; behind its own lock so a slow answer never holds the ledger.
    rng: Mutex<StdRng>,
    options: BankOptions,
    /// Transfer requests being handled right now, so the lab can wait until the bank is quiet
    /// before it audits (clients that gave up leave requests still running here).
    in_flight: AtomicUsize,
    /// Woken when `in_flight` drops to zero.
    idle: Notify,
    /// A [`CloseAfterAnswer`] as its number: a stretch of a bad day where the bank closes
    /// each connection after its answer.
    close_after_answer: AtomicU8,
    /// The tellers who serve the transfers whose latency the day decides (the stretches a
    /// bad day compares): a fixed number at once, so that there the bank's capacity, not
    /// the clients' pace, sets how many transfers a second get done.
    tellers: tokio::sync::Semaphore,
}

/// Transfers served at once when the day decides their latency (see `Inner::tellers`).
pub const TELLERS: usize = 2;

/// Whether the bank keeps a connection open after an answer (a bad day's stretch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseAfterAnswer {
    /// Keep-alive, as HTTP/1.1 wants.
    Never,
    /// Closes it after the answer, having said so (`Connection: close`).
    Announced,
    /// Closes it after the answer without saying so: the client's pool finds out when it
    /// reuses the connection (a request it sends then is never read).
    Silent,
}

#[derive(Deserialize)]
struct TransferRequest {
    from: String,
    to: String,
    amount: i64,
}

#[derive(Serialize)]
struct TransferAnswer<'a> {
    id: u64,
    from: &'a str,
    to: &'a str,
    amount: i64,
    balances: BTreeMap<&'a str, i64>,
}

impl Bank {
    /// A bank with the given accounts and opening balances (minor units).
    pub fn new(options: BankOptions, accounts: impl IntoIterator<Item = (String, i64)>) -> Bank {
        let rng = StdRng::seed_from_u64(options.seed);
        Bank {
            inner: Arc::new(Inner {
                ledger: Mutex::new(LedgerSnapshot {
                    accounts: accounts.into_iter().collect(),
                    transfers: Vec::new(),
                }),
                rng: Mutex::new(rng),
                options,
                in_flight: AtomicUsize::new(0),
                idle: Notify::new(),
                close_after_answer: AtomicU8::new(0),
                tellers: tokio::sync::Semaphore::new(TELLERS),
            }),
        }
    }

    /// The accounts `idemgate bank` opens with, so there is something to try by hand.
    pub fn with_demo_accounts(options: BankOptions) -> Bank {
        Bank::new(
            options,
            [
                ("alice".to_owned(), 100_000),
                ("bob".to_owned(), 50_000),
                ("carol".to_owned(), 0),
            ],
        )
    }

    /// A copy of the ledger, taken under the lock.
    pub fn snapshot(&self) -> LedgerSnapshot {
        self.ledger().clone()
    }

    /// From now on, whether the bank closes each connection after its answer.
    pub fn set_close_after_answer(&self, mode: CloseAfterAnswer) {
        let n = match mode {
            CloseAfterAnswer::Never => 0,
            CloseAfterAnswer::Announced => 1,
            CloseAfterAnswer::Silent => 2,
        };
        self.inner.close_after_answer.store(n, Ordering::SeqCst);
    }

    fn close_after_answer(&self) -> CloseAfterAnswer {
        match self.inner.close_after_answer.load(Ordering::SeqCst) {
            1 => CloseAfterAnswer::Announced,
            2 => CloseAfterAnswer::Silent,
            _ => CloseAfterAnswer::Never,
        }
    }

    /// Transfer requests currently being handled.
    pub fn in_flight(&self) -> usize {
        self.inner.in_flight.load(Ordering::SeqCst)
    }

    /// Waits until no transfer request is being handled, or `limit` passed. Returns whether
    /// the bank went quiet.
    pub async fn quiesce(&self, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            // Register for the wake-up before looking, so a request that ends in between
            // is not missed.
            let idle = self.inner.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            if self.in_flight() == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, idle).await.is_err() {
                return self.in_flight() == 0;
            }
        }
    }

    /// Executes a transfer: checks and moves the money in one step under the ledger lock.
    pub fn transfer(
        &self,
        from: &str,
        to: &str,
        amount: i64,
        idempotency_key: Option<String>,
    ) -> Result<(TransferRow, i64, i64), TransferError> {
        if amount <= 0 {
            return Err(TransferError::Invalid("amount must be a positive integer"));
        }
        if from == to {
            return Err(TransferError::Invalid("from and to must differ"));
        }
        let mut ledger = self.ledger();
        let from_balance = *ledger
            .accounts
            .get(from)
            .ok_or_else(|| TransferError::UnknownAccount(from.to_owned()))?;
        let to_balance = *ledger
            .accounts
            .get(to)
            .ok_or_else(|| TransferError::UnknownAccount(to.to_owned()))?;
        if from_balance < amount {
            return Err(TransferError::InsufficientFunds {
                balance: from_balance,
            });
        }
        let to_after = to_balance
            .checked_add(amount)
            .ok_or(TransferError::Invalid("amount overflows the balance"))?;
        let from_after = from_balance - amount;
        ledger.accounts.insert(from.to_owned(), from_after);
        ledger.accounts.insert(to.to_owned(), to_after);
        let row = TransferRow {
            id: ledger.transfers.len() as u64 + 1,
            from: from.to_owned(),
            to: to.to_owned(),
            amount,
            idempotency_key,
        };
        ledger.transfers.push(row.clone());
        Ok((row, from_after, to_after))
    }

    fn ledger(&self) -> MutexGuard<'_, LedgerSnapshot> {
        // A panic while holding the lock cannot leave the ledger half-written (every update is
        // computed first and inserted after), so a poisoned lock is still a valid ledger.
        self.inner
            .ledger
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn draw_latency(&self) -> Duration {
        let o = &self.inner.options;
        let mut rng = self
            .inner
            .rng
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if o.slow_ratio > 0.0 && rng.random_bool(o.slow_ratio.clamp(0.0, 1.0)) {
            return o.slow_latency;
        }
        let base = o.base_latency.as_micros() as u64;
        if base == 0 {
            return Duration::ZERO;
        }
        Duration::from_micros(rng.random_range(base / 2..=base + base / 2))
    }

    async fn handle(&self, req: Request<Incoming>) -> Response<Full<Bytes>> {
        let path = req.uri().path().to_owned();
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        match (req.method(), segments.as_slice()) {
            (&Method::POST, ["transfers"]) => {
                self.inner.in_flight.fetch_add(1, Ordering::SeqCst);
                let _guard = InFlight(&self.inner);
                self.post_transfer(req).await
            }
            (&Method::GET, ["transfers"]) => json(StatusCode::OK, &self.ledger().transfers),
            (&Method::GET, ["accounts"]) => json(StatusCode::OK, &self.ledger().accounts),
            (&Method::GET, ["accounts", id]) => match self.ledger().accounts.get(*id) {
                Some(balance) => json(
                    StatusCode::OK,
                    &serde_json::json!({ "id": id, "balance": balance }),
                ),
                None => error(StatusCode::NOT_FOUND, "unknown_account", "no such account"),
            },
            (_, ["transfers"]) | (_, ["accounts"]) | (_, ["accounts", _]) => error(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "method not allowed",
            ),
            _ => error(StatusCode::NOT_FOUND, "not_found", "no such resource"),
        }
    }

    async fn post_transfer(&self, req: Request<Incoming>) -> Response<Full<Bytes>> {
        let key = req
            .headers()
            .get("idempotency-key")
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        // The lab's bad day decides some latencies itself (see `traffic::LATENCY_HEADER`).
        let latency = req
            .headers()
            .get(super::traffic::LATENCY_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
            .map(Duration::from_millis);
        let collect = Limited::new(req.into_body(), MAX_BODY_BYTES).collect();
        let body = match tokio::time::timeout(BODY_READ_TIMEOUT, collect).await {
            Ok(Ok(collected)) => collected.to_bytes(),
            _ => {
                return error(
                    StatusCode::BAD_REQUEST,
                    "bad_body",
                    "body unreadable or too large",
                )
            }
        };
        let parsed: TransferRequest = match serde_json::from_slice(&body) {
            Ok(parsed) => parsed,
            Err(_) => {
                return error(
                    StatusCode::BAD_REQUEST,
                    "bad_json",
                    "expected {\"from\",\"to\",\"amount\"} with an integer amount",
                )
            }
        };
        // A transfer whose latency the day decides waits for a free teller, who stays with
        // it until its answer.
        let _teller = match latency {
            Some(_) => self.inner.tellers.acquire().await.ok(),
            None => None,
        };
        // Commit first, answer after the latency: a client that times out has still paid.
        let outcome = self.transfer(&parsed.from, &parsed.to, parsed.amount, key);
        tokio::time::sleep(latency.unwrap_or_else(|| self.draw_latency())).await;
        match outcome {
            Ok((row, from_balance, to_balance)) => json(
                StatusCode::CREATED,
                &TransferAnswer {
                    id: row.id,
                    from: &row.from,
                    to: &row.to,
                    amount: row.amount,
                    balances: BTreeMap::from([
                        (row.from.as_str(), from_balance),
                        (row.to.as_str(), to_balance),
                    ]),
                },
            ),
            Err(TransferError::UnknownAccount(id)) => error(
                StatusCode::NOT_FOUND,
                "unknown_account",
                &format!("no such account: {id}"),
            ),
            Err(TransferError::InsufficientFunds { balance }) => json(
                StatusCode::UNPROCESSABLE_ENTITY,
                &serde_json::json!({
                    "error": "insufficient_funds",
                    "account": parsed.from,
                    "balance": balance,
                    "amount": parsed.amount,
                }),
            ),
            Err(TransferError::Invalid(why)) => error(StatusCode::BAD_REQUEST, "invalid", why),
        }
    }
}

/// Decrements the in-flight count however the handler ends, including when hyper drops it.
struct InFlight<'a>(&'a Inner);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

fn json<T: Serialize + ?Sized>(status: StatusCode, value: &T) -> Response<Full<Bytes>> {
    // Serializing these plain structs and maps cannot fail; an empty object is a safe fallback.
    let body = serde_json::to_vec(value).unwrap_or_else(|_| b"{}".to_vec());
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

fn error(status: StatusCode, code: &str, message: &str) -> Response<Full<Bytes>> {
    json(
        status,
        &serde_json::json!({ "error": code, "message": message }),
    )
}

/// Serves the bank on `listener` until `shutdown` completes, then drains open connections
/// for a bounded time.
pub async fn serve(
    listener: TcpListener,
    bank: Bank,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    serve_tls(listener, bank, None, shutdown).await
}

/// As [`serve`], over TLS when `tls` is given (`idemgate lab --tls`): TLS only, a client
/// that does not speak it gets no answer.
pub async fn serve_tls(
    listener: TcpListener,
    bank: Bank,
    tls: Option<tokio_rustls::TlsAcceptor>,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let (stop_tx, stop_rx) = watch::channel(());
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((stream, _)) => stream,
                    Err(err) => {
                        // Out of file descriptors and the like: back off instead of spinning.
                        tracing::warn!(error = %err, "bank: accept failed");
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                };
                let bank = bank.clone();
                let mut stop = stop_rx.clone();
                let tls = tls.clone();
                connections.spawn(async move {
                    let stream = match tls {
                        None => tokio_util::either::Either::Left(stream),
                        Some(tls) => {
                            match tokio::time::timeout(HEADER_READ_TIMEOUT, tls.accept(stream)).await {
                                Ok(Ok(stream)) => tokio_util::either::Either::Right(stream),
                                Ok(Err(err)) => {
                                    tracing::debug!(error = %err, "bank: TLS handshake failed");
                                    return;
                                }
                                Err(_) => return,
                            }
                        }
                    };
                    // A silent close: once this connection has answered, the next request on
                    // it is never read, and the connection goes once the answer is out.
                    let closing = Arc::new(AtomicBool::new(false));
                    let answered = Arc::new(Notify::new());
                    let (closing_in, answered_in) = (closing.clone(), answered.clone());
                    let service = service_fn(move |req| {
                        let bank = bank.clone();
                        let (closing, answered) = (closing_in.clone(), answered_in.clone());
                        async move {
                            if closing.load(Ordering::SeqCst) {
                                std::future::pending::<()>().await;
                            }
                            let mut response = bank.handle(req).await;
                            match bank.close_after_answer() {
                                CloseAfterAnswer::Never => {}
                                CloseAfterAnswer::Announced => {
                                    response.headers_mut().insert(
                                        hyper::header::CONNECTION,
                                        HeaderValue::from_static("close"),
                                    );
                                }
                                CloseAfterAnswer::Silent => {
                                    closing.store(true, Ordering::SeqCst);
                                    answered.notify_one();
                                }
                            }
                            Ok::<_, Infallible>(response)
                        }
                    });
                    let conn = http1::Builder::new()
                        // A legacy bank keeps processing a request whose client hung up: the
                        // read side closing must not cancel the transfer in progress.
                        .half_close(true)
                        .timer(TokioTimer::new())
                        .header_read_timeout(HEADER_READ_TIMEOUT)
                        .serve_connection(TokioIo::new(stream), service);
                    tokio::pin!(conn);
                    let result = tokio::select! {
                        result = conn.as_mut() => result,
                        _ = answered.notified() => {
                            // Long enough to write a small answer on loopback, then gone.
                            let _ = tokio::time::timeout(SILENT_CLOSE_AFTER, conn.as_mut()).await;
                            Ok(())
                        }
                        _ = stop.changed() => {
                            conn.as_mut().graceful_shutdown();
                            match tokio::time::timeout(DRAIN_TIMEOUT, conn.as_mut()).await {
                                Ok(result) => result,
                                Err(_) => Ok(()),
                            }
                        }
                    };
                    if let Err(err) = result {
                        tracing::debug!(error = %err, "bank: connection ended with an error");
                    }
                });
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    let _ = stop_tx.send(());
    let drained = tokio::time::timeout(DRAIN_TIMEOUT, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        connections.abort_all();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    const IO: Duration = Duration::from_secs(5);

    async fn start(bank: Bank) -> (std::net::SocketAddr, tokio::sync::oneshot::Sender<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(serve(listener, bank, async {
            let _ = rx.await;
        }));
        (addr, tx)
    }

    /// One HTTP/1.1 exchange over a fresh connection; returns status and body.
    async fn exchange(
        addr: std::net::SocketAddr,
        method: &str,
        path: &str,
        body: &str,
    ) -> (u16, serde_json::Value) {
        let mut stream = tokio::time::timeout(IO, TcpStream::connect(addr))
            .await
            .expect("connect in time")
            .expect("connect");
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: bank\r\nContent-Type: application/json\r\n\
             Idempotency-Key: k-1\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).await.expect("write");
        let mut raw = Vec::new();
        tokio::time::timeout(IO, stream.read_to_end(&mut raw))
            .await
            .expect("answer in time")
            .expect("read");
        let text = String::from_utf8(raw).expect("utf-8");
        let status: u16 = text[9..12].parse().expect("status");
        let body = text.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
        (status, serde_json::from_str(body).unwrap_or_default())
    }

    fn quick() -> BankOptions {
        BankOptions {
            base_latency: Duration::ZERO,
            slow_latency: Duration::ZERO,
            slow_ratio: 0.0,
            seed: 1,
        }
    }

    /// `POST /transfers` with `body`.
    async fn transfer(addr: std::net::SocketAddr, body: &str) -> (u16, serde_json::Value) {
        exchange(addr, "POST", "/transfers", body).await
    }

    #[tokio::test]
    async fn a_transfer_moves_money_and_is_recorded_with_its_key() {
        let bank = Bank::with_demo_accounts(quick());
        let (addr, _stop) = start(bank.clone()).await;
        let (status, body) = transfer(addr, r#"{"from":"alice","to":"bob","amount":2500}"#).await;
        assert_eq!(status, 201);
        assert_eq!(body["balances"]["alice"], 97_500);
        assert_eq!(body["balances"]["bob"], 52_500);
        let (status, body) = exchange(addr, "GET", "/accounts/bob", "").await;
        assert_eq!((status, body["balance"].as_i64()), (200, Some(52_500)));
        let (_, rows) = exchange(addr, "GET", "/transfers", "").await;
        assert_eq!(rows[0]["idempotency_key"], "k-1");
        assert_eq!(bank.snapshot().transfers.len(), 1);
    }

    #[tokio::test]
    async fn the_same_request_twice_moves_money_twice() {
        let bank = Bank::with_demo_accounts(quick());
        let (addr, _stop) = start(bank.clone()).await;
        for _ in 0..2 {
            let body = r#"{"from":"alice","to":"bob","amount":100}"#;
            assert_eq!(exchange(addr, "POST", "/transfers", body).await.0, 201);
        }
        assert_eq!(bank.snapshot().accounts["alice"], 99_800);
    }

    #[tokio::test]
    async fn insufficient_funds_is_422_and_moves_nothing() {
        let bank = Bank::with_demo_accounts(quick());
        let (addr, _stop) = start(bank.clone()).await;
        let (status, body) = transfer(addr, r#"{"from":"carol","to":"bob","amount":1}"#).await;
        assert_eq!(status, 422);
        assert_eq!(body["error"], "insufficient_funds");
        let snapshot = bank.snapshot();
        assert!(snapshot.transfers.is_empty());
        assert_eq!(snapshot.accounts["bob"], 50_000);
    }

    #[tokio::test]
    async fn bad_requests_are_refused() {
        let bank = Bank::with_demo_accounts(quick());
        let (addr, _stop) = start(bank.clone()).await;
        let cases = [
            ("POST", "/transfers", "{not json", 400),
            (
                "POST",
                "/transfers",
                r#"{"from":"alice","to":"bob","amount":1.5}"#,
                400,
            ),
            (
                "POST",
                "/transfers",
                r#"{"from":"alice","to":"bob","amount":0}"#,
                400,
            ),
            (
                "POST",
                "/transfers",
                r#"{"from":"alice","to":"zed","amount":1}"#,
                404,
            ),
            ("GET", "/accounts/zed", "", 404),
            ("DELETE", "/transfers", "", 405),
        ];
        for (method, path, body, want) in cases {
            assert_eq!(exchange(addr, method, path, body).await.0, want, "{body}");
        }
        assert!(bank.snapshot().transfers.is_empty());
    }

    #[tokio::test]
    async fn the_latency_knob_delays_the_answer_but_not_the_commit() {
        let options = BankOptions {
            base_latency: Duration::from_millis(5),
            slow_latency: Duration::from_millis(400),
            slow_ratio: 1.0,
            seed: 1,
        };
        let bank = Bank::with_demo_accounts(options);
        let (addr, _stop) = start(bank.clone()).await;
        let started = Instant::now();
        let request = tokio::spawn(exchange(
            addr,
            "POST",
            "/transfers",
            r#"{"from":"alice","to":"bob","amount":100}"#,
        ));
        // The money has moved long before the answer: wait for the row, not for a fixed time.
        tokio::time::timeout(IO, async {
            while bank.snapshot().transfers.is_empty() {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
        .await
        .expect("committed");
        assert!(started.elapsed() < Duration::from_millis(400));
        assert_eq!(bank.in_flight(), 1);
        let (status, _) = request.await.expect("join");
        assert_eq!(status, 201);
        assert!(started.elapsed() >= Duration::from_millis(400));
        assert!(bank.quiesce(IO).await);
    }

    #[tokio::test]
    async fn a_client_that_hangs_up_still_pays() {
        let options = BankOptions {
            slow_ratio: 1.0,
            slow_latency: Duration::from_millis(100),
            ..quick()
        };
        let bank = Bank::with_demo_accounts(options);
        let (addr, _stop) = start(bank.clone()).await;
        let body = r#"{"from":"alice","to":"bob","amount":100}"#;
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        let request = format!(
            "POST /transfers HTTP/1.1\r\nHost: bank\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).await.expect("write");
        drop(stream);
        tokio::time::timeout(IO, async {
            while bank.snapshot().transfers.is_empty() {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
        .await
        .expect("the transfer ran although the client left");
        assert!(bank.quiesce(IO).await);
    }
}
