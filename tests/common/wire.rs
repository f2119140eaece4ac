//! Bytes on the wire, both ways: an upstream that answers with the exact bytes a test scripts
//! (framing no library would write), and a client that reads answers off one kept-alive
//! connection as a client would, by their framing, so that an answer framed wrong shows up
//! as the next one read wrong.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// What a scripted upstream writes for one request, and whether it then closes.
pub struct Script {
    pub bytes: Vec<u8>,
    pub close: bool,
}

impl Script {
    /// `bytes`, then the connection stays open until idemgate closes it.
    pub fn open(bytes: impl Into<Vec<u8>>) -> Script {
        Script {
            bytes: bytes.into(),
            close: false,
        }
    }
    /// `bytes`, then the connection is closed.
    pub fn closing(bytes: impl Into<Vec<u8>>) -> Script {
        Script {
            bytes: bytes.into(),
            close: true,
        }
    }
}

/// An upstream that reads each request (head, then a body by its `Content-Length`) and
/// answers with what `answer` scripts for its head.
pub struct ScriptedUpstream {
    pub addr: SocketAddr,
    hits: Arc<AtomicUsize>,
}

impl ScriptedUpstream {
    pub async fn start<F>(answer: F) -> ScriptedUpstream
    where
        F: Fn(&str) -> Script + Send + Sync + 'static,
    {
        use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let hits = Arc::new(AtomicUsize::new(0));
        let answer = Arc::new(answer);
        let counted = hits.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let (answer, hits) = (answer.clone(), counted.clone());
                tokio::spawn(async move {
                    let mut stream = tokio::io::BufReader::new(stream);
                    loop {
                        let mut head = String::new();
                        loop {
                            let mut line = String::new();
                            match stream.read_line(&mut line).await {
                                Ok(0) | Err(_) => return,
                                Ok(_) => {}
                            }
                            head.push_str(&line);
                            if line == "\r\n" {
                                break;
                            }
                        }
                        let len = head
                            .lines()
                            .find_map(|l| {
                                let (n, v) = l.split_once(':')?;
                                n.eq_ignore_ascii_case("content-length")
                                    .then(|| v.trim().parse::<usize>().ok())?
                            })
                            .unwrap_or(0);
                        let mut body = vec![0u8; len];
                        if stream.read_exact(&mut body).await.is_err() {
                            return;
                        }
                        hits.fetch_add(1, Ordering::SeqCst);
                        let script = answer(&head);
                        if stream.get_mut().write_all(&script.bytes).await.is_err() {
                            return;
                        }
                        if script.close {
                            return;
                        }
                    }
                });
            }
        });
        ScriptedUpstream { addr, hits }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Requests read to their end.
    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

/// One answer as a client read it off its connection.
#[derive(Debug, Clone, PartialEq)]
pub struct Read1 {
    pub status: u16,
    /// Names lower-cased, in order.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Read1 {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
    pub fn all(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    /// The `type` of a problem document, if the body is one.
    pub fn problem(&self) -> String {
        serde_json::from_slice::<serde_json::Value>(&self.body)
            .ok()
            .and_then(|v| v["type"].as_str().map(str::to_string))
            .unwrap_or_default()
    }
    /// Status, headers and body as a replay must repeat them: without `Date`,
    /// `Idempotent-Replayed` and the request id, which name one answer each.
    pub fn as_replayed(&self) -> (u16, Vec<(String, String)>, Vec<u8>) {
        let headers = self
            .headers
            .iter()
            .filter(|(n, _)| !["date", "idempotent-replayed", "x-request-id"].contains(&n.as_str()))
            .cloned()
            .collect();
        (self.status, headers, self.body.clone())
    }
}

/// A client connection that sends raw requests and reads answers by their framing.
pub struct Conn {
    reader: BufReader<TcpStream>,
}

impl Conn {
    pub fn open(addr: SocketAddr) -> Conn {
        let s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        Conn {
            reader: BufReader::new(s),
        }
    }

    pub fn send(&mut self, bytes: &[u8]) {
        self.reader.get_mut().write_all(bytes).expect("write");
    }

    /// Reads one answer (`head`: to a `HEAD`, no body whatever its length says). `None`:
    /// the connection ended before a whole answer.
    pub fn read(&mut self, head: bool) -> Option<Read1> {
        let mut line = String::new();
        if self.reader.read_line(&mut line).ok()? == 0 {
            return None;
        }
        let status: u16 = line.split(' ').nth(1)?.parse().ok()?;
        let mut headers = Vec::new();
        loop {
            let mut l = String::new();
            if self.reader.read_line(&mut l).ok()? == 0 {
                return None;
            }
            let l = l.trim_end_matches(['\r', '\n']);
            if l.is_empty() {
                break;
            }
            let (n, v) = l.split_once(':')?;
            headers.push((n.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
        let mut answer = Read1 {
            status,
            headers,
            body: Vec::new(),
        };
        if head || status == 204 || status == 304 || (100..200).contains(&status) {
            return Some(answer);
        }
        if answer
            .header("transfer-encoding")
            .is_some_and(|v| v.contains("chunked"))
        {
            loop {
                let mut size = String::new();
                if self.reader.read_line(&mut size).ok()? == 0 {
                    return None;
                }
                let n = usize::from_str_radix(size.trim(), 16).ok()?;
                let mut chunk = vec![0u8; n + 2];
                self.reader.read_exact(&mut chunk).ok()?;
                if n == 0 {
                    break;
                }
                answer.body.extend_from_slice(&chunk[..n]);
            }
        } else if let Some(n) = answer.header("content-length") {
            let mut body = vec![0u8; n.parse().ok()?];
            self.reader.read_exact(&mut body).ok()?;
            answer.body = body;
        } else {
            self.reader.read_to_end(&mut answer.body).ok()?;
        }
        Some(answer)
    }

    /// Whether the peer has closed: the next read finds the end of the stream.
    pub fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.reader.read(&mut b), Ok(0) | Err(_))
    }
}

/// A keyed JSON POST as raw bytes.
pub fn post(path: &str, key: &str, body: &str, extra: &str) -> Vec<u8> {
    format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nidempotency-key: {key}\r\ncontent-length: {}\r\n{extra}\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// A GET as raw bytes.
pub fn get(path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n").into_bytes()
}

/// Sends each raw request on a connection of its own to `app` and reads its one answer.
pub async fn send_each(app: &idemgate::Running, requests: Vec<Vec<u8>>) -> Vec<Read1> {
    let addr = app.addr();
    tokio::task::spawn_blocking(move || {
        requests
            .into_iter()
            .map(|r| {
                let mut c = Conn::open(addr);
                c.send(&r);
                c.read(false).expect("an answer")
            })
            .collect()
    })
    .await
    .expect("client")
}
