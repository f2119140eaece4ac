//! A TCP proxy for tests, between idemgate and a real server (a `redis-server`), that breaks
//! the wire on cue: replies swallowed, requests or replies held back for a while, the next
//! request swallowed with its connection cut, every connection cut, new connections refused.
//!
//! Faults act on chunks, what one `read` returns: a Redis command or reply of a few hundred
//! bytes is one chunk on loopback. A cut closes the client's side at once (idemgate sees its
//! connection drop) while what the proxy already read from the client is still delivered to
//! the server, at its time, as a kernel does with data a peer sent before it went away: a
//! request can reach the server after its sender gave up on it.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// The proxy; it stops accepting when dropped (connections it holds are cut then too).
pub struct FaultProxy {
    pub addr: SocketAddr,
    state: Arc<State>,
    accept: tokio::task::JoinHandle<()>,
}

#[derive(Default)]
struct State {
    /// Replies are read from the server and thrown away.
    drop_replies: AtomicBool,
    /// The next request chunk (on any connection) is swallowed and its connection cut.
    cut_next_request: AtomicBool,
    /// New connections are closed as soon as they are accepted.
    refuse: AtomicBool,
    /// Request chunks holding these bytes are swallowed and their connection cut (one
    /// kind of call failing while the others pass: an answer's write, by its body).
    cut_containing: Mutex<Option<Vec<u8>>>,
    /// Request chunks read from clients and not yet written to the server.
    queued_requests: AtomicUsize,
    /// Counters, for tests to check that a fault really happened.
    replies_dropped: AtomicUsize,
    cuts: AtomicUsize,
    /// Bytes read from the server, on every connection.
    reply_bytes: AtomicU64,
    conns: Mutex<Vec<Weak<Conn>>>,
}

/// One proxied connection's knobs.
struct Conn {
    request_delay_ms: AtomicU64,
    reply_delay_ms: AtomicU64,
    cut: watch::Sender<bool>,
}

impl Conn {
    fn cut(&self, state: &State) {
        if !self.cut.send_replace(true) {
            state.cuts.fetch_add(1, Ordering::SeqCst);
        }
    }
}

impl FaultProxy {
    /// Starts a proxy on a free loopback port in front of `target`.
    pub async fn start(target: SocketAddr) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let state = Arc::new(State::default());
        let s = state.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                if s.refuse.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                tokio::spawn(proxy(client, target, s.clone()));
            }
        });
        FaultProxy {
            addr,
            state,
            accept,
        }
    }

    /// In front of a test's redis-server.
    pub async fn for_redis(redis: &super::RedisServer) -> FaultProxy {
        let target = format!("127.0.0.1:{}", redis.port).parse().expect("addr");
        Self::start(target).await
    }

    /// A Redis URL through the proxy.
    pub fn redis_url(&self) -> String {
        format!("redis://{}/0", self.addr)
    }

    /// Swallows every reply from now on (`true`) or passes them again (`false`). The server
    /// still executes what it receives.
    pub fn drop_replies(&self, on: bool) {
        self.state.drop_replies.store(on, Ordering::SeqCst);
    }

    /// Swallows the next request chunk and cuts the connection it came on.
    pub fn cut_next_request(&self) {
        self.state.cut_next_request.store(true, Ordering::SeqCst);
    }

    /// Swallows every request chunk that holds `bytes` (and cuts its connection) from now
    /// on, or (`None`) none any more. Other requests pass.
    pub fn cut_requests_containing(&self, bytes: Option<&[u8]>) {
        *self.state.cut_containing.lock().expect("lock") = bytes.map(<[u8]>::to_vec);
    }

    /// Cuts every connection now.
    pub fn cut_all(&self) {
        for c in self.live() {
            c.cut(&self.state);
        }
    }

    /// Closes new connections at once (`true`) or accepts them again.
    pub fn refuse(&self, on: bool) {
        self.state.refuse.store(on, Ordering::SeqCst);
    }

    /// Holds back every request chunk read from now on, on the connections open now, for
    /// `d` (new connections are not delayed).
    pub fn delay_requests(&self, d: Duration) {
        for c in self.live() {
            c.request_delay_ms
                .store(d.as_millis() as u64, Ordering::SeqCst);
        }
    }

    /// Holds back every reply read from now on, on the connections open now, for `d`.
    pub fn delay_replies(&self, d: Duration) {
        for c in self.live() {
            c.reply_delay_ms
                .store(d.as_millis() as u64, Ordering::SeqCst);
        }
    }

    /// Request chunks the proxy holds that the server has not been sent yet.
    pub fn queued_requests(&self) -> usize {
        self.state.queued_requests.load(Ordering::SeqCst)
    }

    /// Replies swallowed so far.
    pub fn replies_dropped(&self) -> usize {
        self.state.replies_dropped.load(Ordering::SeqCst)
    }

    /// Bytes the server has sent so far, on every connection (what its clients were sent,
    /// or would have been had the replies not been swallowed).
    pub fn reply_bytes(&self) -> u64 {
        self.state.reply_bytes.load(Ordering::SeqCst)
    }

    /// Connections cut so far.
    pub fn cuts(&self) -> usize {
        self.state.cuts.load(Ordering::SeqCst)
    }

    fn live(&self) -> Vec<Arc<Conn>> {
        let mut conns = self.state.conns.lock().expect("lock");
        conns.retain(|c| c.strong_count() > 0);
        conns.iter().filter_map(Weak::upgrade).collect()
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut_all();
    }
}

/// A chunk and when it may be written.
type Timed = (Instant, Vec<u8>);

async fn proxy(client: TcpStream, target: SocketAddr, state: Arc<State>) {
    let Ok(Ok(server)) =
        tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(target)).await
    else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (cut_tx, cut_rx) = watch::channel(false);
    let conn = Arc::new(Conn {
        request_delay_ms: AtomicU64::new(0),
        reply_delay_ms: AtomicU64::new(0),
        cut: cut_tx,
    });
    state
        .conns
        .lock()
        .expect("lock")
        .push(Arc::downgrade(&conn));
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    let (to_server, for_server) = mpsc::unbounded_channel::<Timed>();
    let (to_client, for_client) = mpsc::unbounded_channel::<Timed>();
    // Client to server: the reader stops at a cut; the writer delivers what was read.
    let requests = tokio::spawn(read_requests(
        cr,
        to_server,
        conn.clone(),
        state.clone(),
        cut_rx.clone(),
    ));
    let delivery = tokio::spawn(write_requests(sw, for_server, state.clone()));
    // Server to client: both stop at a cut.
    let replies = tokio::spawn(read_replies(sr, to_client, conn.clone(), state.clone()));
    let answer = tokio::spawn(write_replies(cw, for_client, cut_rx));
    let _ = tokio::join!(requests, delivery, answer);
    // The server side is closed once everything read from the client was delivered; its
    // last replies have nowhere to go.
    replies.abort();
}

async fn read_requests(
    mut cr: OwnedReadHalf,
    to_server: mpsc::UnboundedSender<Timed>,
    conn: Arc<Conn>,
    state: Arc<State>,
    mut cut: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = tokio::select! {
            r = cr.read(&mut buf) => match r {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
            _ = cut.wait_for(|c| *c) => return,
        };
        let holds = |pattern: &Vec<u8>| buf[..n].windows(pattern.len()).any(|w| w == &pattern[..]);
        let matched = state
            .cut_containing
            .lock()
            .expect("lock")
            .as_ref()
            .is_some_and(holds);
        if matched || state.cut_next_request.swap(false, Ordering::SeqCst) {
            conn.cut(&state);
            return;
        }
        let delay = Duration::from_millis(conn.request_delay_ms.load(Ordering::SeqCst));
        state.queued_requests.fetch_add(1, Ordering::SeqCst);
        if to_server
            .send((Instant::now() + delay, buf[..n].to_vec()))
            .is_err()
        {
            state.queued_requests.fetch_sub(1, Ordering::SeqCst);
            return;
        }
    }
}

async fn write_requests(
    mut sw: OwnedWriteHalf,
    mut for_server: mpsc::UnboundedReceiver<Timed>,
    state: Arc<State>,
) {
    let mut broken = false;
    while let Some((at, chunk)) = for_server.recv().await {
        tokio::time::sleep_until(at).await;
        if !broken {
            broken = sw.write_all(&chunk).await.is_err();
        }
        state.queued_requests.fetch_sub(1, Ordering::SeqCst);
    }
    let _ = sw.shutdown().await;
}

async fn read_replies(
    mut sr: OwnedReadHalf,
    to_client: mpsc::UnboundedSender<Timed>,
    conn: Arc<Conn>,
    state: Arc<State>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match sr.read(&mut buf).await {
            Ok(0) | Err(_) => {
                // The server went away (killed, restarted): so does the client's side.
                conn.cut(&state);
                return;
            }
            Ok(n) => n,
        };
        state.reply_bytes.fetch_add(n as u64, Ordering::SeqCst);
        if state.drop_replies.load(Ordering::SeqCst) {
            state.replies_dropped.fetch_add(1, Ordering::SeqCst);
            continue;
        }
        let delay = Duration::from_millis(conn.reply_delay_ms.load(Ordering::SeqCst));
        if to_client
            .send((Instant::now() + delay, buf[..n].to_vec()))
            .is_err()
        {
            return;
        }
    }
}

async fn write_replies(
    mut cw: OwnedWriteHalf,
    mut for_client: mpsc::UnboundedReceiver<Timed>,
    mut cut: watch::Receiver<bool>,
) {
    loop {
        let next = tokio::select! {
            next = for_client.recv() => next,
            _ = cut.wait_for(|c| *c) => None,
        };
        let Some((at, chunk)) = next else { break };
        tokio::select! {
            _ = tokio::time::sleep_until(at) => {}
            _ = cut.wait_for(|c| *c) => break,
        }
        if cw.write_all(&chunk).await.is_err() {
            break;
        }
    }
    // Dropping the write half here and the read half in `read_requests` closes the client's
    // connection.
    let _ = cw.shutdown().await;
}
