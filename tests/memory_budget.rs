//! Every byte idemgate holds for a client that does not read is counted, through the
//! binary, and the peak memory of the process shows it: a replay's record is admitted by
//! its size before it is read from the store (300 slow readers of a 4 MiB record from
//! Redis took idemgate to 1,357 MiB), first-hand answers waiting for a zero-window client
//! hold their connection's and tenant's share, and one tenant at its share leaves the
//! others served.

#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use common::{client, http_get, post_url, Gate, RedisServer, Upstream, ANSWER_BYTES};

const FOUR_MIB: &str = "4194304";

/// A field of `/proc/<pid>/status`, in MiB (`VmHWM`: the peak resident size).
fn status_mib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kib / 1024
}

fn metric(gate: &Gate, series: &str) -> f64 {
    let text = http_get(gate.admin, "/metrics").unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {series} in\n{text}"))
}

/// An HTTP/1.1 client that sends a keyed POST (asking the test upstream for a 4 MiB
/// answer), reads the head of its answer and never its body: the status, and the socket
/// to keep open.
async fn slow_reader(gate: &Gate, key: &str, tenant: Option<&str>) -> (u16, tokio::net::TcpStream) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut s = socket.connect(gate.addr).await.unwrap();
    let auth = tenant.map_or(String::new(), |t| format!("authorization: Bearer {t}\r\n"));
    let req = format!(
        "POST /v1/reports HTTP/1.1\r\nhost: x\r\nidempotency-key: {key}\r\n{auth}content-type: application/json\r\n{ANSWER_BYTES}: {FOUR_MIB}\r\ncontent-length: 2\r\n\r\n{{}}"
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        s.read_exact(&mut byte).await.unwrap();
        head.push(byte[0]);
    }
    let status = std::str::from_utf8(&head[9..12]).unwrap().parse().unwrap();
    (status, s)
}

/// `n` slow readers of `key` at once, in waves of 50: how many got 201, how many 503,
/// and their sockets.
async fn slow_readers(
    gate: &Gate,
    n: usize,
    key: &str,
    tenant: Option<&str>,
) -> (usize, usize, Vec<tokio::net::TcpStream>) {
    let (mut served, mut refused, mut held) = (0, 0, Vec::new());
    for wave in (0..n).collect::<Vec<_>>().chunks(50) {
        let readers = wave.iter().map(|_| slow_reader(gate, key, tenant));
        for (status, s) in futures_util::future::join_all(readers).await {
            match status {
                201 => served += 1,
                503 => refused += 1,
                other => panic!("status {other}"),
            }
            held.push(s);
        }
    }
    (served, refused, held)
}

/// An h2c connection whose stream windows stay closed (`SETTINGS_INITIAL_WINDOW_SIZE = 0`):
/// its sender, and the task that drives it.
async fn zero_window(gate: &Gate) -> (h2::client::SendRequest<Bytes>, tokio::task::JoinHandle<()>) {
    let tcp = tokio::net::TcpStream::connect(gate.addr).await.unwrap();
    let (h2, conn) = h2::client::Builder::new()
        .initial_window_size(0)
        .handshake::<_, Bytes>(tcp)
        .await
        .unwrap();
    let task = tokio::spawn(async move {
        let _ = conn.await;
    });
    (h2, task)
}

/// Records one 4 MiB answer under `key`, then sends 300 slow readers of it at once, and
/// says what they got and the process's peak memory.
async fn three_hundred_slow_readers(gate: &Gate, what: &str) {
    let first = post_url(
        &client(),
        &gate.url("/v1/reports"),
        Some("big"),
        "{}",
        &[(ANSWER_BYTES, FOUR_MIB)],
    )
    .await;
    assert_eq!(first.status, 201);
    let before = status_mib(gate.pid(), "VmHWM");
    let (served, refused, held) = slow_readers(gate, 300, "big", None).await;
    let buffered = metric(gate, "idemgate_buffered_bytes");
    let peak = status_mib(gate.pid(), "VmHWM");
    eprintln!(
        "300 slow readers of a 4 MiB record ({what}): {served} served, {refused} refused, {buffered} bytes buffered, peak RSS {before} -> {peak} MiB"
    );
    // 64 MiB of 4 MiB answers, and nothing read beyond them.
    assert!(served <= 16, "{served}");
    assert_eq!(served + refused, 300);
    assert!(buffered <= 64.0 * 1024.0 * 1024.0, "{buffered}");
    // The budget's 64 MiB and some room: without the admission by size the peak grew by
    // 231 MiB. (The absolute peak of a debug build sits near 128 MiB: its own is ~55.)
    assert!(peak - before < 80, "peak RSS {before} -> {peak} MiB");
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_readers_of_a_large_redis_record_hold_at_most_the_budget() {
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    // One tenant's readers: its share is the whole budget here, so the budget is what binds.
    let gate = Gate::start(
        &up.url(),
        &redis.url(),
        &[
            ("IDEMGATE_MAX_BUFFERED_BYTES_PER_TENANT", "67108864"),
            ("IDEMGATE_STORE_TIMEOUT", "5s"),
        ],
    );
    three_hundred_slow_readers(&gate, "Redis").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_readers_of_a_sealed_embedded_record_hold_at_most_the_budget() {
    let up = Upstream::start().await;
    // Sealed, each replay is opened into memory of its own: room for it is taken first.
    let gate = Gate::start(
        &up.url(),
        "",
        &[
            ("IDEMGATE_MAX_BUFFERED_BYTES_PER_TENANT", "67108864"),
            ("IDEMGATE_STORE_TIMEOUT", "5s"),
            (
                "IDEMGATE_ENCRYPTION_KEYS",
                "k1:MDEyMzQ1Njc4OTAxMjM0NTY3ODkwMTIzNDU2Nzg5MDE=",
            ),
        ],
    );
    three_hundred_slow_readers(&gate, "embedded, sealed").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenant_at_its_share_leaves_the_others_served() {
    let up = Upstream::start().await;
    // The defaults: 64 MiB, a quarter per connection and per tenant.
    let gate = Gate::start(&up.url(), "", &[]);
    let c = client();
    let url = gate.url("/v1/reports");
    let a = [
        ("authorization", "Bearer tenant-a"),
        (ANSWER_BYTES, FOUR_MIB),
    ];
    assert_eq!(post_url(&c, &url, Some("big"), "{}", &a).await.status, 201);
    // Eight connections of one tenant, none reading: each within its connection's share,
    // together at the tenant's.
    let (served, refused, held) = slow_readers(&gate, 8, "big", Some("tenant-a")).await;
    let buffered = metric(&gate, "idemgate_buffered_bytes");
    eprintln!("one tenant's 8 slow readers of 4 MiB: {served} served, {refused} refused, {buffered} bytes held");
    assert_eq!(served, 4, "16 MiB of 4 MiB answers");
    assert_eq!(refused, 4);
    // Its further work waits for its share: a new key is refused before it is claimed.
    let more = post_url(&c, &url, Some("a-new"), "{}", &a).await;
    assert_eq!(more.status, 503, "{:?}", more.body);
    assert!(more.header("retry-after").is_some());
    // Another tenant's payments and reads are served meanwhile.
    let b = [("authorization", "Bearer tenant-b")];
    let paid = post_url(&c, &url, Some("b-1"), "{}", &b).await;
    assert_eq!(paid.status, 201, "{:?}", paid.body);
    let again = post_url(&c, &url, Some("b-1"), "{}", &b).await;
    assert!(again.replayed());
    let read = c.get(gate.url("/v1/reports")).send().await.unwrap();
    assert_eq!(read.status(), 201);
    // Once its readers go, the tenant is served again.
    drop(held);
    common::eventually(Duration::from_secs(5), "the share given back", || {
        metric(&gate, "idemgate_buffered_bytes") == 0.0
    })
    .await;
    let later = post_url(&c, &url, Some("a-new"), "{}", &a).await;
    assert_eq!(later.status, 201, "{:?}", later.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_keys_answered_to_a_zero_window_hold_their_share() {
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let gate = Gate::start(&up.url(), &redis.url(), &[]);
    let (mut h2, task) = zero_window(&gate).await;
    // One after another, each head awaited before the next is sent: each answer is held
    // (never read) when the next request arrives. A burst sent at once is admitted before
    // the first answer lands (docs/requests.md says so).
    let mut statuses = Vec::new();
    for i in 0..40 {
        let req = hyper::Request::post(format!("http://{}/v1/reports", gate.addr))
            .header("idempotency-key", format!("fresh-{i}"))
            .header("content-type", "application/json")
            .header(ANSWER_BYTES, FOUR_MIB)
            .body(())
            .unwrap();
        h2 = h2.ready().await.unwrap();
        let (res, mut body) = h2.send_request(req, false).unwrap();
        body.send_data(Bytes::from_static(b"{}"), true).unwrap();
        let res = tokio::time::timeout(Duration::from_secs(10), res)
            .await
            .unwrap()
            .unwrap();
        statuses.push(res.status().as_u16());
        // Kept unread (dropping it would reset the stream).
        std::mem::forget(res);
    }
    let answered = statuses.iter().filter(|s| **s == 201).count();
    let buffered = metric(&gate, "idemgate_buffered_bytes");
    let peak = status_mib(gate.pid(), "VmHWM");
    eprintln!("40 new keys of 4 MiB to a zero window: {answered} answered 201, {buffered} bytes held, peak RSS {peak} MiB");
    // 16 MiB of 4 MiB answers for the connection (and its tenant); the rest wait for it.
    assert_eq!(answered, 4, "{statuses:?}");
    assert!(statuses[4..].iter().all(|s| *s == 503), "{statuses:?}");
    assert!(buffered <= 16.0 * 1024.0 * 1024.0, "{buffered}");
    assert!(peak < 128, "peak RSS {peak} MiB");
    // Another tenant is served meanwhile.
    let other = post_url(
        &client(),
        &gate.url("/v1/reports"),
        Some("other"),
        "{}",
        &[("authorization", "Bearer another")],
    )
    .await;
    assert_eq!(other.status, 201, "{:?}", other.body);
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_connection_holds_at_most_its_share_of_the_pass_through_slots() {
    let up = Upstream::start().await;
    // A pass-through share of 8 slots (what max_in_flight leaves of the connections); a
    // connection may hold a quarter of it.
    let gate = Gate::start(
        &up.url(),
        "",
        &[
            ("IDEMGATE_MAX_IN_FLIGHT", "64"),
            ("IDEMGATE_MAX_UPSTREAM_CONNECTIONS", "72"),
        ],
    );
    let (mut h2, task) = zero_window(&gate).await;
    // Eight reads of a large answer whose bodies are never pulled.
    let mut pending = Vec::new();
    for _ in 0..8 {
        let req = hyper::Request::get(format!("http://{}/v1/reports", gate.addr))
            .header(ANSWER_BYTES, "1048576")
            .body(())
            .unwrap();
        h2 = h2.ready().await.unwrap();
        let (res, _) = h2.send_request(req, true).unwrap();
        pending.push(res);
    }
    let mut statuses = Vec::new();
    for res in pending {
        let res = tokio::time::timeout(Duration::from_secs(10), res)
            .await
            .unwrap()
            .unwrap();
        statuses.push(res.status().as_u16());
        std::mem::forget(res);
    }
    statuses.sort_unstable();
    eprintln!("8 unread pass-through answers on one connection: {statuses:?}");
    assert_eq!(statuses, [201, 201, 503, 503, 503, 503, 503, 503]);
    // Every other client's reads are served meanwhile, at once.
    let c = client();
    for _ in 0..6 {
        let started = std::time::Instant::now();
        let read = c.get(gate.url("/v1/reports")).send().await.unwrap();
        assert_eq!(read.status(), 201);
        assert!(started.elapsed() < Duration::from_millis(900), "it waited");
    }
    task.abort();
}
