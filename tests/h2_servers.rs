//! What an upstream receives over h2 and HTTP/1.1, through the real binary.
//!
//! First header by header, from an HTTPS upstream of the test's own that records every
//! field it is sent: over h2 the authority goes once (`:authority`, no `host` beside it) and
//! no connection-specific header goes at all (RFC 9113 8.2.2, 8.3.1); over HTTP/1.1 exactly
//! one `Host`, the upstream's. Then against servers that no one here wrote, installed from
//! Debian's packages by the tests' shared set-up (`tests/setup/install.sh`): nginx
//! (`listen ... ssl http2`), Caddy (`protocols h1 h2 h2c`) and Apache httpd with mod_http2,
//! each as an `https://` upstream, with ALPN h2 and with `upstream_http2 = false`: a
//! pass-through GET, a protected POST and its replay, and the server's own access log saying
//! which protocol it spoke and how often it executed.

#![allow(clippy::unwrap_used)]

use crate::common;
use common::Probes;

use std::convert::Infallible;
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::certs::{Ca, Dir, Leaf};
use common::Gate;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper::{Request, Response, Version};
use hyper_util::rt::{TokioExecutor, TokioIo};
use idemgate::config::UpstreamHttp2;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// One request as the recording upstream saw it: its protocol, the authority of its URI
/// (`:authority` on h2; absent on HTTP/1.1, whose target is origin-form) and every header
/// field in the order received, repeated names kept.
#[derive(Clone, Debug)]
struct Received {
    version: Version,
    method: String,
    authority: Option<String>,
    fields: Vec<(String, String)>,
}

impl Received {
    fn all(&self, name: &str) -> Vec<&str> {
        self.fields
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }
}

/// An HTTPS upstream on hyper (h2 and HTTP/1.1 by ALPN) that records what it receives and
/// answers 201.
struct Recorder {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Received>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Recorder {
    async fn start(leaf: &Leaf) -> Recorder {
        let chain = CertificateDer::pem_slice_iter(leaf.cert.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .unwrap();
        let key = PrivateKeyDer::from_pem_slice(leaf.key.as_bytes()).unwrap();
        let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .unwrap();
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let (acceptor, seen) = (acceptor.clone(), s.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
                        let seen = seen.clone();
                        async move {
                            seen.lock().unwrap().push(Received {
                                version: req.version(),
                                method: req.method().to_string(),
                                authority: req.uri().authority().map(|a| a.to_string()),
                                fields: req
                                    .headers()
                                    .iter()
                                    .map(|(n, v)| {
                                        (
                                            n.as_str().to_string(),
                                            String::from_utf8_lossy(v.as_bytes()).into_owned(),
                                        )
                                    })
                                    .collect(),
                            });
                            Ok::<_, Infallible>(
                                Response::builder()
                                    .status(201)
                                    .header("content-type", "application/json")
                                    .body(Full::new(Bytes::from_static(b"{\"ok\":true}")))
                                    .unwrap(),
                            )
                        }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(tls), svc)
                        .await;
                });
            }
        });
        Recorder { addr, seen, task }
    }

    fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.addr.port())
    }

    fn seen(&self) -> Vec<Received> {
        self.seen.lock().unwrap().clone()
    }
}

/// The connection-specific fields of RFC 9113 8.2.2 (and the legacy ones of RFC 9110 7.6.1).
const CONNECTION_SPECIFIC: [&str; 5] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "upgrade",
];

/// A pass-through GET and a protected POST, each carrying the client's own `Host` and
/// every connection-specific field a client may send over HTTP/1.1.
async fn send_both(g: &Gate, key: &str) {
    let client = common::client();
    let hop = [
        ("host", "api.example"),
        ("connection", "keep-alive, x-hop"),
        ("x-hop", "1"),
        ("keep-alive", "timeout=5"),
        ("proxy-connection", "keep-alive"),
        ("te", "trailers"),
    ];
    let mut get = client.get(g.url("/status"));
    let mut post = client
        .post(g.url("/pay"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body("{\"amount\":1}");
    for (n, v) in hop {
        get = get.header(n, v);
        post = post.header(n, v);
    }
    assert_eq!(get.send().await.unwrap().status(), 201);
    assert_eq!(post.send().await.unwrap().status(), 201);
}

/// Over h2: `:authority` is the upstream's, no `host` field beside it, no
/// connection-specific field, `te` at most `trailers`; the client's `Host` survives only as
/// `X-Forwarded-Host`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_h2_the_authority_goes_once_and_no_connection_specific_field_goes() {
    let ca = Ca::new("upstream ca");
    let up = Recorder::start(&ca.leaf(&["127.0.0.1"])).await;
    let dir = Dir::new();
    let ca_file = dir.write("ca.pem", &ca.pem());
    let g = common::Idemgate::new(&up.url())
        .set(|c| c.upstream_tls_ca_file = Some(ca_file.into()))
        .binary();
    send_both(&g, "h2-fields").await;
    let seen = up.seen();
    assert_eq!(seen.len(), 2, "{seen:?}");
    let authority = format!("127.0.0.1:{}", up.addr.port());
    for r in &seen {
        assert_eq!(r.version, Version::HTTP_2, "{r:?}");
        assert_eq!(r.authority.as_deref(), Some(authority.as_str()), "{r:?}");
        assert!(
            r.all("host").is_empty(),
            "a host field beside :authority: {r:?}"
        );
        for name in CONNECTION_SPECIFIC.iter().chain(&["x-hop"]) {
            assert!(r.all(name).is_empty(), "{name} sent over h2: {r:?}");
        }
        assert!(r.all("te").iter().all(|v| *v == "trailers"), "{r:?}");
        assert_eq!(r.all("x-forwarded-host"), ["api.example"], "{r:?}");
    }
    assert_eq!(
        seen.iter().map(|r| r.method.as_str()).collect::<Vec<_>>(),
        ["GET", "POST"]
    );
}

/// Over HTTP/1.1 (`upstream_http2 = false`): exactly one `Host`, the upstream's, and of the
/// client's connection-specific fields none; a protected request's own `Connection: close`
/// (its connection is opened for it and closed after) is idemgate's, not the client's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_http1_exactly_one_host_goes_and_it_is_the_upstreams() {
    let ca = Ca::new("upstream ca");
    let up = Recorder::start(&ca.leaf(&["127.0.0.1"])).await;
    let dir = Dir::new();
    let ca_file = dir.write("ca.pem", &ca.pem());
    let g = common::Idemgate::new(&up.url())
        .set(|c| {
            c.upstream_tls_ca_file = Some(ca_file.into());
            c.upstream_http2 = UpstreamHttp2::Off;
        })
        .binary();
    send_both(&g, "h1-fields").await;
    let seen = up.seen();
    assert_eq!(seen.len(), 2, "{seen:?}");
    let authority = format!("127.0.0.1:{}", up.addr.port());
    for r in &seen {
        assert_eq!(r.version, Version::HTTP_11, "{r:?}");
        assert_eq!(r.all("host"), [authority.as_str()], "{r:?}");
        for name in ["keep-alive", "proxy-connection", "upgrade", "te", "x-hop"] {
            assert!(r.all(name).is_empty(), "{name} forwarded: {r:?}");
        }
        assert_eq!(r.all("x-forwarded-host"), ["api.example"], "{r:?}");
    }
    let (get, post) = (&seen[0], &seen[1]);
    assert!(get.all("connection").is_empty(), "{get:?}");
    assert_eq!(post.all("connection"), ["close"], "{post:?}");
}

// Servers no one here wrote.

/// The servers come from Debian's packages, installed by the tests' shared set-up.
fn install() {
    common::setup::tools();
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    Nginx,
    Caddy,
    Apache,
}

/// One request in a server's access log.
#[derive(Debug, PartialEq)]
struct Logged {
    method: String,
    path: String,
    protocol: String,
    status: u16,
}

/// A real server on a free port, with the test CA's certificate, answering every request
/// with 201 and a body unique to that execution, and logging each request it executes.
struct Real {
    kind: Kind,
    port: u16,
    dir: PathBuf,
    child: Child,
    _files: tempfile::TempDir,
}

impl Drop for Real {
    fn drop(&mut self) {
        // The server runs in a process group of its own (nginx's and Apache's workers are
        // its children): stop the whole group, so that no worker outlives the test.
        let group = format!("-{}", self.child.id());
        let _ = Command::new("kill").args(["-TERM", "--", &group]).status();
        common::held_within(Duration::from_secs(3), || {
            !matches!(self.child.try_wait(), Ok(None))
        });
        let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            for log in ["error.log", "out.log"] {
                if let Ok(s) = std::fs::read_to_string(self.dir.join(log)) {
                    eprintln!("--- {:?} {log}:\n{s}", self.kind);
                }
            }
        }
    }
}

impl Real {
    fn start(kind: Kind, leaf: &Leaf) -> Real {
        install();
        let files = tempfile::tempdir().unwrap();
        let dir = files.path().to_path_buf();
        // Apache's children and CGI run as www-data: they must read what is here.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let write = |name: &str, content: &str, mode: u32| {
            let p = dir.join(name);
            std::fs::write(&p, content).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        };
        write("cert.pem", &leaf.cert, 0o644);
        write("key.pem", &leaf.key, 0o644);
        let port = common::free_port();
        let d = dir.display();
        let out = std::fs::File::create(dir.join("out.log")).unwrap();
        let mut cmd = match kind {
            Kind::Nginx => {
                std::fs::create_dir(dir.join("tmp")).unwrap();
                write(
                    "nginx.conf",
                    &format!(
                        r#"daemon off;
master_process off;
worker_processes 1;
error_log {d}/error.log info;
pid {d}/nginx.pid;
events {{ worker_connections 256; }}
http {{
  log_format proto '$request_method $request_uri $server_protocol $status';
  access_log {d}/access.log proto;
  client_body_temp_path {d}/tmp/body;
  proxy_temp_path {d}/tmp/proxy;
  fastcgi_temp_path {d}/tmp/fastcgi;
  uwsgi_temp_path {d}/tmp/uwsgi;
  scgi_temp_path {d}/tmp/scgi;
  server {{
    listen 127.0.0.1:{port} ssl http2;
    ssl_certificate {d}/cert.pem;
    ssl_certificate_key {d}/key.pem;
    location / {{
      default_type application/json;
      return 201 '{{"execution":"$request_id","method":"$request_method"}}';
    }}
  }}
}}
"#
                    ),
                    0o644,
                );
                let mut c = Command::new("nginx");
                c.arg("-p").arg(&dir).arg("-c").arg(dir.join("nginx.conf"));
                c
            }
            Kind::Caddy => {
                write(
                    "Caddyfile",
                    &format!(
                        r#"{{
	admin off
	auto_https off
	servers {{
		protocols h1 h2 h2c
	}}
}}
https://127.0.0.1:{port} {{
	tls {d}/cert.pem {d}/key.pem
	log {{
		output file {d}/access.log
		format json
	}}
	header Content-Type application/json
	respond `{{"execution":"{{http.request.uuid}}","method":"{{method}}"}}` 201
}}
"#
                    ),
                    0o644,
                );
                let mut c = Command::new("caddy");
                c.args(["run", "--adapter", "caddyfile", "--config"])
                    .arg(dir.join("Caddyfile"))
                    .env("HOME", &dir)
                    .env("XDG_DATA_HOME", dir.join("data"))
                    .env("XDG_CONFIG_HOME", dir.join("config"));
                c
            }
            Kind::Apache => {
                std::fs::create_dir(dir.join("cgi")).unwrap();
                // mod_cgid runs it per request: its UNIQUE_ID names the execution. It reads
                // the body first: over h2 an unread body holds the stream open.
                write(
                    "cgi/app.sh",
                    "#!/bin/sh\ncat > /dev/null\nprintf 'Status: 201 Created\\r\\nContent-Type: \
                     application/json\\r\\n\\r\\n{\"execution\":\"%s\",\"method\":\"%s\"}' \
                     \"$UNIQUE_ID\" \"$REQUEST_METHOD\"\n",
                    0o755,
                );
                let m = "/usr/lib/apache2/modules";
                write(
                    "httpd.conf",
                    &format!(
                        r#"ServerRoot {d}
ServerName 127.0.0.1
Listen 127.0.0.1:{port}
DefaultRuntimeDir {d}
PidFile {d}/httpd.pid
Mutex file:{d} default
User www-data
Group www-data
LoadModule mpm_event_module {m}/mod_mpm_event.so
LoadModule authz_core_module {m}/mod_authz_core.so
LoadModule ssl_module {m}/mod_ssl.so
LoadModule http2_module {m}/mod_http2.so
LoadModule cgid_module {m}/mod_cgid.so
LoadModule alias_module {m}/mod_alias.so
LoadModule unique_id_module {m}/mod_unique_id.so
ScriptSock {d}/cgid.sock
ErrorLog {d}/error.log
LogFormat "%m %U %H %>s" proto
CustomLog {d}/access.log proto
Protocols h2 http/1.1
SSLEngine on
SSLCertificateFile {d}/cert.pem
SSLCertificateKeyFile {d}/key.pem
ScriptAliasMatch ^/ {d}/cgi/app.sh
<Directory {d}/cgi>
  Require all granted
</Directory>
"#
                    ),
                    0o644,
                );
                let mut c = Command::new("/usr/sbin/apache2");
                c.arg("-f").arg(dir.join("httpd.conf")).arg("-DFOREGROUND");
                c
            }
        };
        let child = cmd
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("start {kind:?}: {e}"));
        let mut real = Real {
            kind,
            port,
            dir,
            child,
            _files: files,
        };
        let listening = common::held_within(Duration::from_secs(20), || {
            if let Ok(Some(status)) = real.child.try_wait() {
                panic!("{kind:?} exited at start with {status}");
            }
            TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        assert!(listening, "{kind:?} did not listen");
        real
    }

    fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    /// The server's access log, one entry per request it executed.
    fn logged(&self) -> Vec<Logged> {
        let text = std::fs::read_to_string(self.dir.join("access.log")).unwrap_or_default();
        text.lines()
            .filter(|l| !l.trim().is_empty())
            .map(|line| match self.kind {
                Kind::Caddy => {
                    let v: serde_json::Value = serde_json::from_str(line).unwrap();
                    let r = &v["request"];
                    Logged {
                        method: r["method"].as_str().unwrap().into(),
                        path: r["uri"].as_str().unwrap().into(),
                        protocol: r["proto"].as_str().unwrap().into(),
                        status: v["status"].as_u64().unwrap() as u16,
                    }
                }
                Kind::Nginx | Kind::Apache => {
                    let f: Vec<&str> = line.split(' ').collect();
                    Logged {
                        method: f[0].into(),
                        path: f[1].into(),
                        protocol: f[2].into(),
                        status: f[3].parse().unwrap(),
                    }
                }
            })
            .collect()
    }
}

/// Through idemgate to `kind`, over ALPN h2 and then over HTTP/1.1 (`upstream_http2 =
/// false`): a pass-through GET, a protected POST and its replay. The server executes the GET
/// and the POST once each, over the protocol asked for, and the replay is the POST's answer.
async fn through_idemgate_to(kind: Kind) {
    let ca = Ca::new("upstream ca");
    let leaf = ca.leaf(&["127.0.0.1"]);
    let server = Real::start(kind, &leaf);
    let dir = Dir::new();
    let ca_file = dir.write("ca.pem", &ca.pem());
    let client = common::client();
    let mut before = 0;
    for (setting, http2, protocol) in [
        (UpstreamHttp2::Offer, "true", "HTTP/2.0"),
        (UpstreamHttp2::Off, "false", "HTTP/1.1"),
    ] {
        let g = common::Idemgate::new(&server.url())
            .set(|c| {
                c.upstream_tls_ca_file = Some(ca_file.as_str().into());
                c.upstream_http2 = setting;
            })
            .binary();
        let what = format!("{kind:?} with upstream_http2 = {http2}");
        let get = client.get(g.url("/status")).send().await.unwrap();
        assert_eq!(get.status(), 201, "{what}: {:?}", get.text().await);
        let get: serde_json::Value = get.json().await.unwrap();
        assert_eq!(get["method"], "GET", "{what}");
        let key = format!("real-{http2}");
        let first =
            common::post_url(&client, &g.url("/pay"), Some(&key), "{\"amount\":1}", &[]).await;
        assert_eq!(first.status, 201, "{what}: {:?}", first.body);
        assert!(!first.replayed(), "{what}");
        assert_eq!(first.json()["method"], "POST", "{what}");
        let again =
            common::post_url(&client, &g.url("/pay"), Some(&key), "{\"amount\":1}", &[]).await;
        assert_eq!(again.status, 201, "{what}: {:?}", again.body);
        assert!(again.replayed(), "{what}: {:?}", again.headers);
        assert_eq!(again.body, first.body, "{what}");
        // The log is written as each request ends; both have.
        let logged = common::retry_until_blocking(
            Duration::from_secs(5),
            || server.logged(),
            |l| l.len() >= before + 2,
        );
        let want = [("GET", "/status"), ("POST", "/pay")].map(|(m, p)| Logged {
            method: m.into(),
            path: p.into(),
            protocol: protocol.into(),
            status: 201,
        });
        assert_eq!(logged[before..], want, "{what}: {logged:?}\n{}", g.log());
        before = logged.len();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_over_h2_and_http1() {
    through_idemgate_to(Kind::Nginx).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn caddy_over_h2_and_http1() {
    through_idemgate_to(Kind::Caddy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apache_httpd_with_mod_http2_over_h2_and_http1() {
    through_idemgate_to(Kind::Apache).await;
}
