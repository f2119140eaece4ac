use super::*;

const D: Deadlines = Deadlines {
    header: Duration::from_secs(10),
    idle: Duration::from_secs(60),
    send: Duration::from_secs(30),
};

#[tokio::test(start_paused = true)]
async fn a_silent_connection_is_due_a_header_timeout_after_accept() {
    let w = Watch::accepted();
    let accepted = Instant::now();
    assert_eq!(w.due(D), Some((accepted + D.header, Closed::Quiet)));
    let out = w.supervise(D, std::future::pending::<()>()).await;
    assert_eq!(out, Err(Closed::Quiet));
    assert_eq!(Instant::now() - accepted, D.header);
}

// The supervisor sleeps towards the head deadline from accept while the first request
// arrives and is served; once it is answered, the shorter idle deadline must apply.
#[tokio::test(start_paused = true)]
async fn an_idle_timeout_shorter_than_the_head_timeout_is_applied() {
    let d = Deadlines {
        header: Duration::from_secs(30),
        idle: Duration::from_secs(1),
        send: Duration::from_secs(60),
    };
    let w = Watch::accepted();
    let serving = w.serving();
    let supervised = tokio::spawn(w.clone().supervise(d, std::future::pending::<()>()));
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(serving);
    let idle = Instant::now();
    assert!(supervised.await.expect("supervisor").is_err(), "closed");
    assert_eq!(Instant::now() - idle, d.idle);
}

#[tokio::test(start_paused = true)]
async fn idle_after_an_answer_then_a_head_deadline_from_the_next_byte() {
    let w = Watch::accepted();
    let serving = w.serving();
    assert_eq!(w.due(D), None, "no deadline while serving");
    tokio::time::advance(Duration::from_secs(100)).await;
    drop(serving);
    let done = Instant::now();
    assert_eq!(w.due(D), Some((done + D.idle, Closed::Quiet)));
    tokio::time::advance(Duration::from_secs(5)).await;
    w.wrote();
    assert_eq!(
        w.due(D),
        Some((done + Duration::from_secs(5) + D.idle, Closed::Quiet))
    );
    tokio::time::advance(Duration::from_secs(5)).await;
    w.read();
    assert_eq!(w.due(D), Some((Instant::now() + D.header, Closed::Quiet)));
    // More bytes of the same head do not move its deadline.
    let head = Instant::now();
    tokio::time::advance(Duration::from_secs(1)).await;
    w.read();
    assert_eq!(w.due(D), Some((head + D.header, Closed::Quiet)));
}

#[tokio::test(start_paused = true)]
async fn a_head_after_idle_wakes_the_supervisor_for_its_sooner_deadline() {
    let w = Watch::accepted();
    drop(w.serving());
    let watch = w.clone();
    let started = Instant::now();
    let task = tokio::spawn(async move { watch.supervise(D, std::future::pending::<()>()).await });
    tokio::time::sleep(Duration::from_secs(1)).await;
    w.read();
    assert!(task.await.expect("task").is_err());
    assert_eq!(Instant::now() - started, Duration::from_secs(1) + D.header);
}

// A client that stops reading while its answer is written: the request is being served,
// so no quiet deadline applies, but the stalled write closes it after `send`.
#[tokio::test(start_paused = true)]
async fn a_write_without_progress_closes_the_connection_after_the_send_deadline() {
    let w = Watch::accepted();
    let serving = w.serving();
    assert_eq!(w.due(D), None);
    w.stalled();
    let stalled = Instant::now();
    tokio::time::advance(Duration::from_secs(10)).await;
    // Still stalled: the deadline is from the first stall, not the latest poll.
    w.stalled();
    assert_eq!(w.due(D), Some((stalled + D.send, Closed::SendTimeout)));
    // Progress resets it.
    w.wrote();
    assert_eq!(w.due(D), None);
    w.stalled();
    let again = Instant::now();
    let out = w.clone().supervise(D, std::future::pending::<()>()).await;
    assert_eq!(out, Err(Closed::SendTimeout));
    assert_eq!(Instant::now() - again, D.send);
    drop(serving);
}

// An HTTP/2 client's PINGs (bytes read and written, no stream) never make an idle
// connection await a head: it is closed `idle` after its last stream, or its preface.
#[tokio::test(start_paused = true)]
async fn h2_frames_without_a_stream_are_not_activity() {
    let d = Deadlines {
        header: Duration::from_secs(30),
        idle: Duration::from_secs(1),
        send: Duration::from_secs(60),
    };
    let w = Watch::accepted();
    let mut io = Watched::new(tokio::io::empty(), w.clone());
    io.sniff(&H2_PREFACE[..10]);
    assert!(!w.lock().h2, "not before the whole preface");
    io.sniff(&H2_PREFACE[10..]);
    let preface = Instant::now();
    assert_eq!(w.due(d), Some((preface + d.idle, Closed::Quiet)));
    drop(w.serving());
    let idle = Instant::now();
    tokio::time::advance(Duration::from_millis(900)).await;
    w.read();
    w.wrote();
    assert_eq!(w.due(d), Some((idle + d.idle, Closed::Quiet)));
    // HTTP/1.1 is not taken for HTTP/2.
    let h1 = Watch::accepted();
    let mut io = Watched::new(tokio::io::empty(), h1.clone());
    io.sniff(b"POST / HTTP/1.1\r\n");
    io.sniff(H2_PREFACE);
    assert!(!h1.lock().h2);
}

#[tokio::test(start_paused = true)]
async fn only_a_connection_serving_nothing_is_evicted() {
    let w = Watch::accepted();
    let serving = w.serving();
    assert!(!w.evict_if_quiet(), "serving a request");
    drop(serving);
    assert!(w.evict_if_quiet());
    assert!(!w.evict_if_quiet(), "once");
    let out = w.supervise(D, std::future::pending::<()>()).await;
    assert_eq!(out, Err(Closed::Quiet));
}
