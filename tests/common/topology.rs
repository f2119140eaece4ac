//! Production-shaped Redis set-ups, started by the tests themselves on loopback: a private
//! CA with server and client certificates (openssl), redis-server over TLS, a primary with
//! replicas watched by three sentinels, and a cluster of three primaries and three
//! replicas. Every process is killed on drop; its log is printed if the test failed.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::free_port;

/// A CA, a server certificate for `localhost` only (so that `127.0.0.1` is a wrong name),
/// a node certificate for `localhost` and `127.0.0.1` (sentinels and cluster nodes, which
/// name each other by IP), a client certificate, and a second, unrelated CA. Written to a
/// fresh directory.
pub struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    pub fn new() -> Pki {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path();
        let run = |args: &[&str]| {
            let out = Command::new("openssl")
                .args(args)
                .current_dir(p)
                .stdin(Stdio::null())
                .output()
                .expect("openssl on PATH");
            assert!(
                out.status.success(),
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        for ca in ["ca", "other-ca"] {
            run(&[
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "2",
                "-subj",
                &format!("/CN=idemgate test {ca}"),
                "-keyout",
                &format!("{ca}.key"),
                "-out",
                &format!("{ca}.crt"),
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign",
            ]);
        }
        std::fs::write(
            p.join("server.ext"),
            "subjectAltName=DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n",
        )
        .expect("ext");
        // Sentinels and cluster nodes name each other by IP: their certificate has it too.
        std::fs::write(
            p.join("node.ext"),
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n",
        )
        .expect("ext");
        std::fs::write(p.join("client.ext"), "extendedKeyUsage=clientAuth\n").expect("ext");
        for (name, ext) in [
            ("server", "server.ext"),
            ("node", "node.ext"),
            ("client", "client.ext"),
        ] {
            run(&[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-subj",
                &format!("/CN={name}"),
                "-keyout",
                &format!("{name}.key"),
                "-out",
                &format!("{name}.csr"),
            ]);
            run(&[
                "x509",
                "-req",
                "-in",
                &format!("{name}.csr"),
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                ext,
                "-out",
                &format!("{name}.crt"),
            ]);
        }
        Pki { dir }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

/// One `redis-server` (data node or sentinel) with its own directory.
pub struct Node {
    pub port: u16,
    child: Option<Child>,
    dir: tempfile::TempDir,
    args: Vec<String>,
    /// `redis-cli` flags: TLS when the node speaks only TLS, a password.
    cli_args: Vec<String>,
}

impl Node {
    /// Starts `redis-server [conf] --port P --bind 127.0.0.1 ... args` and waits for PING.
    pub fn start(args: &[&str]) -> Node {
        Self::start_on(free_port(), args, Vec::new(), None)
    }

    fn start_on(port: u16, args: &[&str], cli_args: Vec<String>, conf: Option<&str>) -> Node {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut all: Vec<String> = Vec::new();
        if let Some(conf) = conf {
            let path = dir.path().join("node.conf");
            std::fs::write(&path, conf).expect("conf");
            all.push(path.display().to_string());
        }
        all.extend(args.iter().map(|s| s.to_string()));
        let mut n = Node {
            port,
            child: None,
            dir,
            args: all,
            cli_args,
        };
        n.spawn();
        n
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("node.log")
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    fn spawn(&mut self) {
        self.spawn_process();
        let pong = || self.cli(&["PING"]).is_some_and(|r| r.trim() == "PONG");
        assert!(
            super::held_within(Duration::from_secs(15), pong),
            "redis-server did not start on port {}:\n{}",
            self.port,
            self.log()
        );
    }

    /// Starts again on the same port, directory and arguments, and waits only until the
    /// port accepts connections: for a node that `redis-cli` cannot talk to (a certificate
    /// it refuses).
    pub fn restart_listening(&mut self) {
        self.kill();
        self.spawn_process();
        let port = self.port;
        let listening = || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok();
        assert!(
            super::held_within(Duration::from_secs(15), listening),
            "redis-server did not listen on port {}:\n{}",
            self.port,
            self.log()
        );
    }

    fn spawn_process(&mut self) {
        super::setup::tools();
        let mut cmd = Command::new("redis-server");
        cmd.args(&self.args)
            .arg("--bind")
            .arg("127.0.0.1")
            .arg("--dir")
            .arg(self.dir.path())
            .arg("--logfile")
            .arg(self.log_path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if !self.args.iter().any(|a| a == "--tls-port") {
            cmd.arg("--port").arg(self.port.to_string());
        }
        self.child = Some(cmd.spawn().expect("redis-server on PATH"));
    }

    /// Runs `redis-cli -p PORT args...` and returns its output.
    pub fn cli(&self, args: &[&str]) -> Option<String> {
        let out = Command::new("redis-cli")
            .arg("-p")
            .arg(self.port.to_string())
            .args(&self.cli_args)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// SIGKILL, as a crash.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Starts again on the same port, directory and arguments.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// One `INFO` field.
    pub fn info_field(&self, section: &str, name: &str) -> Option<String> {
        let info = self.cli(&["INFO", section])?;
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(|v| v.trim().to_string())
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!("--- redis node {} log ---\n{}", self.port, self.log());
        }
    }
}

/// A TLS-only redis-server signed by `pki`'s CA; `auth_clients`: client certificates
/// are required.
pub fn tls_node(pki: &Pki, auth_clients: bool, extra: &[&str]) -> Node {
    let port = free_port();
    let mut args = tls_args(pki, "server", port, auth_clients);
    for a in ["--save", "", "--appendonly", "no"].iter().chain(extra) {
        args.push(a.to_string());
    }
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    Node::start_on(port, &refs, tls_cli_args(pki), None)
}

/// `redis-server` flags for TLS only on `port` with `pki`'s certificate `cert` (also the
/// client certificate that the node presents to the nodes it connects to).
fn tls_args(pki: &Pki, cert: &str, port: u16, auth_clients: bool) -> Vec<String> {
    let s = |n: &str| pki.path(n).display().to_string();
    [
        "--port",
        "0",
        "--tls-port",
        &port.to_string(),
        "--tls-cert-file",
        &s(&format!("{cert}.crt")),
        "--tls-key-file",
        &s(&format!("{cert}.key")),
        "--tls-ca-cert-file",
        &s("ca.crt"),
        "--tls-auth-clients",
        if auth_clients { "yes" } else { "no" },
    ]
    .iter()
    .map(|a| a.to_string())
    .collect()
}

/// `redis-cli` flags for a TLS-only node that wants client certificates.
fn tls_cli_args(pki: &Pki) -> Vec<String> {
    let s = |n: &str| pki.path(n).display().to_string();
    vec![
        "--tls".into(),
        "--sni".into(),
        "localhost".into(),
        "--cacert".into(),
        s("ca.crt"),
        "--cert".into(),
        s("client.crt"),
        "--key".into(),
        s("client.key"),
    ]
}

/// A primary, `replicas` replicas and three sentinels watching it as `mymaster`.
pub struct Sentinels {
    pub data: Vec<Node>,
    pub sentinels: Vec<Node>,
}

pub const MASTER: &str = "mymaster";

impl Sentinels {
    pub fn start(replicas: usize) -> Sentinels {
        Self::start_with(replicas, None)
    }

    /// With `password`, every data node and sentinel requires it (`requirepass`), and
    /// replicas and sentinels use it among themselves.
    pub fn start_with(replicas: usize, password: Option<&str>) -> Sentinels {
        Self::start_on(replicas, password, None)
    }

    /// TLS only, everywhere: data nodes and sentinels have no plain port, want client
    /// certificates of `pki`'s CA, and replicas and sentinels speak TLS to the nodes
    /// (`tls-replication yes`). Every node has `pki`'s node certificate (`127.0.0.1`).
    pub fn start_tls(replicas: usize, pki: &Pki) -> Sentinels {
        Self::start_on(replicas, None, Some(pki))
    }

    fn start_on(replicas: usize, password: Option<&str>, pki: Option<&Pki>) -> Sentinels {
        let mut persist: Vec<String> = ["--save", "", "--appendonly", "no"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let mut cli: Vec<String> = Vec::new();
        if let Some(pki) = pki {
            cli = tls_cli_args(pki);
        }
        // Each node's flags on its port: TLS (and `tls-replication`) with `pki`.
        let on = |port: u16, args: &[String]| -> Vec<String> {
            let mut all = match pki {
                Some(pki) => {
                    let mut a = tls_args(pki, "node", port, true);
                    a.extend(["--tls-replication".to_string(), "yes".to_string()]);
                    a
                }
                None => Vec::new(),
            };
            all.extend(args.iter().cloned());
            all
        };
        if let Some(pw) = password {
            for a in ["--requirepass", pw, "--masterauth", pw] {
                persist.push(a.to_string());
            }
            for a in ["-a", pw, "--no-auth-warning"] {
                cli.push(a.to_string());
            }
        }
        let start = |args: &[String]| {
            let port = free_port();
            let args = on(port, args);
            let a: Vec<&str> = args.iter().map(String::as_str).collect();
            Node::start_on(port, &a, cli.clone(), None)
        };
        let primary = start(&persist);
        let mut data = vec![primary];
        for _ in 0..replicas {
            let mut args = persist.clone();
            args.push("--replicaof".into());
            args.push(format!("127.0.0.1 {}", data[0].port));
            data.push(start(&args));
        }
        let p = data[0].port;
        let mut sentinels = Vec::new();
        for _ in 0..3 {
            let mut conf = format!(
                "sentinel monitor {MASTER} 127.0.0.1 {p} 2\n\
                 sentinel down-after-milliseconds {MASTER} 1000\n\
                 sentinel failover-timeout {MASTER} 4000\n\
                 sentinel parallel-syncs {MASTER} 2\n"
            );
            if let Some(pw) = password {
                conf.push_str(&format!(
                    "sentinel auth-pass {MASTER} {pw}\nrequirepass {pw}\nsentinel sentinel-pass {pw}\n"
                ));
            }
            let port = free_port();
            let mut args = vec!["--sentinel".to_string()];
            if pki.is_some() {
                args.extend(on(port, &[]));
            }
            let a: Vec<&str> = args.iter().map(String::as_str).collect();
            sentinels.push(Node::start_on(port, &a, cli.clone(), Some(&conf)));
        }
        let s = Sentinels { data, sentinels };
        s.wait_replicas_online(replicas);
        s
    }

    pub fn addrs(&self) -> Vec<String> {
        self.sentinels.iter().map(Node::addr).collect()
    }

    /// The port that a sentinel now names as the primary.
    pub fn primary_port(&self) -> Option<u16> {
        let s = self.sentinels.iter().find(|s| s.is_running())?;
        let out = s.cli(&["SENTINEL", "get-master-addr-by-name", MASTER])?;
        out.lines().nth(1)?.trim().parse().ok()
    }

    /// Index in `data` of the node on `port`.
    pub fn index_of(&self, port: u16) -> usize {
        self.data
            .iter()
            .position(|n| n.port == port)
            .expect("a data node on that port")
    }

    /// Waits until the primary has `n` replicas online and streaming
    /// ([`replicas_streaming`]).
    pub fn wait_replicas_online(&self, n: usize) {
        let until = Instant::now() + Duration::from_secs(30);
        super::wait_until(
            Duration::from_secs(30),
            &format!("{n} replicas online"),
            || {
                self.primary_port().is_some_and(|port| {
                    let node = &self.data[self.index_of(port)];
                    let step = (Instant::now() + Duration::from_secs(2)).min(until);
                    replicas_streaming(|a| node.cli(a), n, step)
                })
            },
        );
    }

    /// Kills the primary and waits until the sentinels name another one, which answers
    /// as a primary. Returns the index of the killed node.
    pub fn fail_over(&mut self) -> usize {
        let old = self.primary_port().expect("a primary");
        let i = self.index_of(old);
        self.data[i].kill();
        super::wait_until(Duration::from_secs(60), "a failover", || {
            self.primary_port()
                .filter(|p| *p != old)
                .is_some_and(|port| {
                    let n = &self.data[self.index_of(port)];
                    n.info_field("replication", "role").as_deref() == Some("master")
                })
        });
        i
    }
}

/// Three primaries and three replicas (`redis-cli --cluster create --cluster-replicas 1`).
pub struct Cluster {
    pub nodes: Vec<Node>,
}

impl Cluster {
    pub fn start() -> Cluster {
        Self::start_on(None)
    }

    /// TLS only, the cluster bus too (`tls-cluster yes`), with `pki`'s node certificate
    /// (`127.0.0.1`) and client certificates required.
    pub fn start_tls(pki: &Pki) -> Cluster {
        Self::start_on(Some(pki))
    }

    fn start_on(pki: Option<&Pki>) -> Cluster {
        let args = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "1500",
            "--save",
            "",
            "--appendonly",
            "no",
            // A replica may take over whatever its last contact with its primary.
            "--cluster-replica-validity-factor",
            "0",
        ];
        let cli = pki.map(tls_cli_args).unwrap_or_default();
        let nodes: Vec<Node> = (0..6)
            .map(|_| {
                let port = free_cluster_port();
                let mut all: Vec<String> = match pki {
                    Some(pki) => tls_args(pki, "node", port, true),
                    None => Vec::new(),
                };
                if pki.is_some() {
                    for a in ["--tls-replication", "yes", "--tls-cluster", "yes"] {
                        all.push(a.to_string());
                    }
                }
                all.extend(args.iter().map(|a| a.to_string()));
                let refs: Vec<&str> = all.iter().map(String::as_str).collect();
                Node::start_on(port, &refs, cli.clone(), None)
            })
            .collect();
        let mut create = Command::new("redis-cli");
        create.args(&cli).args(["--cluster", "create"]);
        for n in &nodes {
            create.arg(n.addr());
        }
        let out = create
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("redis-cli");
        assert!(
            out.status.success(),
            "cluster create: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let c = Cluster { nodes };
        c.wait_ok();
        c
    }

    pub fn addrs(&self) -> Vec<String> {
        self.nodes.iter().map(Node::addr).collect()
    }

    /// Waits until every running node says `cluster_state:ok`, three primaries own slots
    /// and each has a replica online.
    pub fn wait_ok(&self) {
        let until = Instant::now() + Duration::from_secs(60);
        super::wait_until(Duration::from_secs(60), "the cluster to be ok", || {
            self.nodes.iter().filter(|n| n.is_running()).all(|n| {
                n.cli(&["CLUSTER", "INFO"])
                    .is_some_and(|i| i.contains("cluster_state:ok"))
            }) && self.primaries().len() == 3
                && self.primaries().iter().all(|i| {
                    let step = (Instant::now() + Duration::from_secs(2)).min(until);
                    replicas_streaming(|a| self.nodes[*i].cli(a), 1, step)
                })
        });
    }

    /// Indices of the running nodes that are primaries owning slots.
    pub fn primaries(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|i| {
                let n = &self.nodes[*i];
                n.is_running()
                    && n.info_field("replication", "role").as_deref() == Some("master")
                    && owns_slots(n)
            })
            .collect()
    }

    /// Records per primary, by node index (the scope secret is not a record).
    pub fn keys_per_primary(&self) -> Vec<(usize, u64)> {
        self.primaries()
            .into_iter()
            .map(|i| {
                let node = &self.nodes[i];
                let n: u64 = node
                    .cli(&["DBSIZE"])
                    .and_then(|s| s.trim().parse().ok())
                    .unwrap_or(0);
                // The scope secret and the namespace's verifier, and their copies on
                // every primary, are not records.
                let meta = node
                    .cli(&["KEYS", "idemgate:scope-*"])
                    .map_or(0, |s| s.lines().filter(|l| !l.trim().is_empty()).count())
                    as u64;
                (i, n - meta)
            })
            .collect()
    }
}

/// A free port for a cluster node: its bus port (10,000 higher) must be free too, and so
/// exist: a node on a port above 55535 exits at once ("Redis port number too high"), and a
/// fifth of the ports the kernel hands out are.
fn free_cluster_port() -> u16 {
    loop {
        let port = free_port();
        if port <= 55535 && std::net::TcpListener::bind(("127.0.0.1", port + 10000)).is_ok() {
            return port;
        }
    }
}

fn owns_slots(n: &Node) -> bool {
    let Some(myid) = n.cli(&["CLUSTER", "MYID"]) else {
        return false;
    };
    let myid = myid.trim().to_string();
    n.cli(&["CLUSTER", "NODES"]).is_some_and(|nodes| {
        nodes.lines().any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.first() == Some(&myid.as_str()) && f.len() > 8
        })
    })
}

/// The shared test configuration in front of `up`, with the namespace that Redis needs;
/// the caller says which Redis.
pub fn redis_base(up: &super::Upstream) -> idemgate::Config {
    let mut c = super::config(up, &super::Backend::memory());
    c.namespace = Some(super::NAMESPACE.into());
    c
}

/// Waits until `n` replicas of the primary that `cmd` sends to apply its replication
/// stream: each must acknowledge the offset of a probe write (a key set and deleted again;
/// on a cluster node, under the first hash tag that node serves). `state=online` alone is
/// not that: after a diskless full sync, Redis 7.0 names a replica online but streams
/// nothing to it until the replica's next `REPLCONF ACK`, up to a second later, and a
/// replica frozen in that window acknowledges nothing, however long a `WAIT` waits.
/// False if that does not happen by `until`.
pub fn replicas_streaming(
    cmd: impl Fn(&[&str]) -> Option<String>,
    n: usize,
    until: Instant,
) -> bool {
    let offsets = |info: &str| -> (Option<u64>, Vec<u64>) {
        let mut primary = None;
        let mut acked = Vec::new();
        for l in info.lines().map(str::trim) {
            if let Some(v) = l.strip_prefix("master_repl_offset:") {
                primary = v.parse().ok();
            } else if l.starts_with("slave") && l.contains("state=online") {
                acked.extend(
                    l.split(',')
                        .find_map(|f| f.strip_prefix("offset="))
                        .and_then(|v| v.parse::<u64>().ok()),
                );
            }
        }
        (primary, acked)
    };
    let left = || until.saturating_duration_since(Instant::now());
    super::held_within(left(), || {
        let online = cmd(&["INFO", "replication"]).map_or(0, |i| offsets(&i).1.len());
        if online < n {
            return false;
        }
        let probe = (0..256)
            .map(|tag| format!("test:replication-probe:{{{tag}}}"))
            .find(|key| cmd(&["SET", key, "1"]).is_some_and(|r| r.trim_end().ends_with("OK")));
        let Some(key) = probe else {
            return false;
        };
        cmd(&["DEL", &key]);
        let Some(target) = cmd(&["INFO", "replication"]).and_then(|i| offsets(&i).0) else {
            return false;
        };
        // Caught up by `until`, or not at all.
        super::held_within(left(), || {
            let caught_up = cmd(&["INFO", "replication"]).map_or(0, |i| {
                offsets(&i).1.iter().filter(|o| **o >= target).count()
            });
            caught_up >= n
        })
    })
}
