//! A real PostgreSQL server of the test's own: `initdb` and `pg_ctl` in a temporary
//! directory, run as the `postgres` user when the tests run as root (PostgreSQL refuses
//! root), on a free port with its unix socket in that directory; stopped on drop, its log
//! printed if the test failed. Never the machine's own server.

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use super::free_port;

pub struct PgServer {
    pub port: u16,
    dir: tempfile::TempDir,
    bin: PathBuf,
    /// `ssl = on`: TCP only over TLS, and this side's helpers on the unix socket.
    ssl: bool,
}

/// What a server with `ssl = on` serves: its certificate and key (PEM), and optionally the
/// CA its clients' certificates are verified against, with the role that must present
/// one (`hostssl ... clientcert=verify-full`: a certificate of that CA whose CN is the
/// role's name).
pub struct Ssl<'a> {
    pub cert: &'a str,
    pub key: &'a str,
    pub client_ca: Option<&'a str>,
    pub client_cert_role: Option<&'a str>,
}

/// The directory with `initdb` and `pg_ctl`: `$PG_BIN`, else the newest
/// /usr/lib/postgresql/*/bin, else the PATH.
fn bin_dir() -> PathBuf {
    super::setup::tools();
    if let Some(dir) = std::env::var_os("PG_BIN") {
        return dir.into();
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin"))
        .filter(|p| p.join("initdb").exists())
        .collect();
    found.sort_by_key(|p| {
        p.parent()
            .and_then(|v| v.file_name())
            .and_then(|v| v.to_str())
            .and_then(|v| v.parse::<u32>().ok())
            .unwrap_or(0)
    });
    found.pop().unwrap_or_default()
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0\n"))
}

impl PgServer {
    pub fn start() -> PgServer {
        let s = PgServer::init(false);
        s.pg_ctl_start();
        s
    }

    /// A server with `ssl = on` (`ssl_cert_file`, `ssl_key_file`, and `ssl_ca_file` with a
    /// client CA): TCP connections are served over TLS only (`hostssl`, no plain `host`
    /// line), the unix socket without. [`fresh_db`](Self::fresh_db) and
    /// [`socket_url`](Self::socket_url) use the socket.
    pub fn start_ssl(ssl: &Ssl) -> PgServer {
        let s = PgServer::init(true);
        s.write_ssl(ssl.cert, ssl.key);
        let mut hba = String::from("local all all trust\n");
        if let Some(ca) = ssl.client_ca {
            s.write_owned("client-ca.pem", ca, 0o644);
            if let Some(role) = ssl.client_cert_role {
                hba.push_str(&format!(
                    "hostssl all {role} 127.0.0.1/32 trust clientcert=verify-full\n"
                ));
            }
        }
        hba.push_str("hostssl all all 127.0.0.1/32 trust\n");
        s.write_owned("data/pg_hba.conf", &hba, 0o600);
        s.pg_ctl_start();
        s
    }

    /// Replaces the server's certificate and key (read again at the next start).
    pub fn write_ssl(&self, cert: &str, key: &str) {
        self.write_owned("server.crt", cert, 0o644);
        // PostgreSQL refuses a key that others may read, or that another user owns.
        self.write_owned("server.key", key, 0o600);
    }

    /// Writes `content` to `name` in the server's directory, owned by the user the server
    /// runs as, with `mode`.
    fn write_owned(&self, name: &str, content: &str, mode: u32) {
        use std::os::unix::fs::PermissionsExt;
        let path = self.dir.path().join(name);
        std::fs::write(&path, content).expect("write a PostgreSQL file");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("chmod");
        if is_root() {
            let ok = Command::new("chown")
                .arg("postgres:postgres")
                .arg(&path)
                .status()
                .is_ok_and(|st| st.success());
            assert!(ok, "chown of {} to postgres failed", path.display());
        }
    }

    fn init(ssl: bool) -> PgServer {
        let dir = tempfile::Builder::new()
            .prefix("idemgate-pg")
            .tempdir()
            .expect("tempdir");
        let s = PgServer {
            port: free_port(),
            dir,
            bin: bin_dir(),
            ssl,
        };
        if is_root() {
            let ok = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(s.dir.path())
                .status()
                .is_ok_and(|st| st.success());
            assert!(ok, "chown of the PostgreSQL directory to postgres failed");
        }
        let data = s.dir.path().join("data");
        let out = s
            .cmd("initdb")
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-D"])
            .arg(&data)
            .output()
            .expect("initdb (apt-get install postgresql)");
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        s
    }

    /// The server shared by the tests of one binary that run at the same time (each on a
    /// [`fresh_db`](Self::fresh_db) of its own), started by the first and stopped when the
    /// last lets go of it; blocking. Not for tests that restart the server or read its
    /// server-wide statistics.
    pub fn shared() -> Arc<PgServer> {
        static SHARED: Mutex<Weak<PgServer>> = Mutex::new(Weak::new());
        let mut slot = SHARED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(pg) = slot.upgrade() {
            return pg;
        }
        let pg = Arc::new(PgServer::start());
        *slot = Arc::downgrade(&pg);
        pg
    }

    fn cmd(&self, tool: &str) -> Command {
        let exe = self.bin.join(tool);
        if is_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(exe);
            c
        } else {
            Command::new(exe)
        }
    }

    fn pg_ctl_start(&self) {
        let mut opts = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200 \
             -c shared_preload_libraries=pg_stat_statements",
            self.port,
            self.dir.path().display()
        );
        if self.ssl {
            let d = self.dir.path().display();
            opts.push_str(&format!(
                " -c ssl=on -c ssl_cert_file={d}/server.crt -c ssl_key_file={d}/server.key"
            ));
            if self.dir.path().join("client-ca.pem").exists() {
                opts.push_str(&format!(" -c ssl_ca_file={d}/client-ca.pem"));
            }
        }
        let st = self
            .cmd("pg_ctl")
            .args(["-w", "-t", "30", "-D"])
            .arg(self.dir.path().join("data"))
            .args(["-l"])
            .arg(self.dir.path().join("pg.log"))
            .args(["-o", &opts, "start"])
            .output()
            .expect("pg_ctl");
        assert!(
            st.status.success(),
            "pg_ctl start failed: {}\n{}",
            String::from_utf8_lossy(&st.stderr),
            self.log()
        );
    }

    /// Stops the server at once (no checkpoint, like a crash) and starts it again on the
    /// same port and data.
    pub fn restart(&self) {
        self.stop();
        self.pg_ctl_start();
    }

    pub fn stop(&self) {
        let _ = self
            .cmd("pg_ctl")
            .args(["-w", "-m", "immediate", "-D"])
            .arg(self.dir.path().join("data"))
            .arg("stop")
            .output();
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("pg.log")).unwrap_or_default()
    }

    /// URL of database `db`.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// Runs `sql` with psql over the unix socket (blocking): for set-up that cannot wait
    /// for a runtime, as in a shared server's first start.
    pub fn psql(&self, db: &str, sql: &str) -> String {
        let out = self
            .cmd("psql")
            .arg("-h")
            .arg(self.dir.path())
            .args(["-p", &self.port.to_string(), "-U", "postgres", "-d", db])
            .args(["-X", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-c", sql])
            .output()
            .expect("psql");
        assert!(
            out.status.success(),
            "psql {sql}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// URL of database `db` over the unix socket (no TLS on it).
    pub fn socket_url(&self, db: &str) -> String {
        format!(
            "host={} port={} user=postgres dbname={db}",
            self.dir.path().display(),
            self.port
        )
    }

    /// A new, empty database of its own (for tests sharing one server).
    pub async fn fresh_db(&self) -> String {
        static N: AtomicUsize = AtomicUsize::new(0);
        let name = format!(
            "t{}_{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let admin = if self.ssl {
            self.socket_url("postgres")
        } else {
            self.url("postgres")
        };
        let (client, conn) = tokio_postgres::connect(&admin, tokio_postgres::NoTls)
            .await
            .expect("connect to the test PostgreSQL");
        let task = tokio::spawn(conn);
        client
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .expect("create database");
        drop(client);
        let _ = task.await;
        self.url(&name)
    }

    /// Runs `sql` on database `url` and returns the first column of every row as text.
    pub async fn query(url: &str, sql: &str) -> Vec<String> {
        let (client, conn) = super::retry_until(
            Duration::from_secs(10),
            async || tokio_postgres::connect(url, tokio_postgres::NoTls).await,
            Result::is_ok,
        )
        .await
        .unwrap_or_else(|e| panic!("connect: {e}"));
        let task = tokio::spawn(conn);
        let rows = client.simple_query(sql).await.expect("query");
        drop(client);
        let _ = task.await;
        rows.into_iter()
            .filter_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_string),
                _ => None,
            })
            .collect()
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        self.stop();
        if std::thread::panicking() {
            eprintln!("--- postgres log ---\n{}", self.log());
        }
    }
}
