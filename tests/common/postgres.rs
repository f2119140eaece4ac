//! A real PostgreSQL server of the test's own: `initdb` and `pg_ctl` in a temporary
//! directory, run as the `postgres` user when the tests run as root (PostgreSQL refuses
//! root), on a free port with its unix socket in that directory; stopped on drop, its log
//! printed if the test failed. Never the machine's own server.

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::free_port;

pub struct PgServer {
    pub port: u16,
    dir: tempfile::TempDir,
    bin: PathBuf,
}

/// The directory with `initdb` and `pg_ctl`: `$PG_BIN`, else the newest
/// /usr/lib/postgresql/*/bin, else the PATH.
fn bin_dir() -> PathBuf {
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
        let dir = tempfile::Builder::new()
            .prefix("idemgate-pg")
            .tempdir()
            .expect("tempdir");
        let s = PgServer {
            port: free_port(),
            dir,
            bin: bin_dir(),
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
        s.pg_ctl_start();
        s
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
        let opts = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200 \
             -c shared_preload_libraries=pg_stat_statements",
            self.port,
            self.dir.path().display()
        );
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

    /// A new, empty database of its own (for tests sharing one server).
    pub async fn fresh_db(&self) -> String {
        static N: AtomicUsize = AtomicUsize::new(0);
        let name = format!(
            "t{}_{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let (client, conn) = tokio_postgres::connect(&self.url("postgres"), tokio_postgres::NoTls)
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
        let deadline = Instant::now() + Duration::from_secs(10);
        let (client, conn) = loop {
            match tokio_postgres::connect(url, tokio_postgres::NoTls).await {
                Ok(c) => break c,
                Err(e) if Instant::now() > deadline => panic!("connect: {e}"),
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        };
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
