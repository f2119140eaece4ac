//! A `redis-server` the bad day starts itself (`idemgate lab --bad-day --redis-server`), with
//! persistence on (`appendonly yes`, `appendfsync always`), so that the day can stop it with
//! SIGSTOP for its freeze and restart it (SIGTERM, then the same port and directory again)
//! with its records kept.
//!
//! Crates: `tokio` for the child process and the readiness probe; signals go through
//! kill(1), as the tests send theirs, rather than a crate for one call.

use std::path::PathBuf;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long a (re)started redis-server gets to answer PING (it loads its AOF first).
const READY_LIMIT: Duration = Duration::from_secs(10);

/// The lab's own redis-server, on a free loopback port, its AOF in a directory of its own.
pub struct LabRedis {
    port: u16,
    dir: PathBuf,
    child: Option<tokio::process::Child>,
}

impl Drop for LabRedis {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.start_kill();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl LabRedis {
    /// Starts `redis-server` from PATH and waits until it answers.
    pub async fn start() -> Result<LabRedis, String> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("no free port: {e}"))?
            .port();
        let dir = std::env::temp_dir().join(format!(
            "idemgate-lab-redis-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).map_err(|e| format!("the redis-server's directory: {e}"))?;
        let mut redis = LabRedis {
            port,
            dir,
            child: None,
        };
        redis.launch().await?;
        Ok(redis)
    }

    /// The URL the instances use.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    async fn launch(&mut self) -> Result<(), String> {
        let child = tokio::process::Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &self.port.to_string()])
            .arg("--dir")
            .arg(&self.dir)
            .args([
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--save",
                "",
            ])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("could not start redis-server (is it on PATH?): {e}"))?;
        self.child = Some(child);
        let deadline = tokio::time::Instant::now() + READY_LIMIT;
        while tokio::time::Instant::now() < deadline {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                return Err(format!("redis-server exited at start: {status}"));
            }
            if self.pong().await {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(format!("redis-server was not ready within {READY_LIMIT:?}"))
    }

    /// Whether it answers PING (not `-LOADING`).
    async fn pong(&self) -> bool {
        let probe = async {
            let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", self.port)).await?;
            conn.write_all(b"PING\r\n").await?;
            let mut buf = [0u8; 16];
            let n = conn.read(&mut buf).await?;
            Ok::<_, std::io::Error>(buf[..n].starts_with(b"+PONG"))
        };
        matches!(
            tokio::time::timeout(Duration::from_secs(1), probe).await,
            Ok(Ok(true))
        )
    }

    /// Sends `signal` (`STOP`, `CONT`, `TERM`) to the server.
    pub fn signal(&self, signal: &str) -> Result<(), String> {
        let pid = self
            .child
            .as_ref()
            .and_then(|c| c.id())
            .ok_or("redis-server is not running")?;
        let status = std::process::Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status()
            .map_err(|e| format!("kill(1): {e}"))?;
        if status.success() {
            Ok(())
        } else {
            Err(format!("kill -{signal} {pid}: {status}"))
        }
    }

    /// SIGTERM (redis-server fsyncs its AOF and exits), then the same port and directory
    /// again: the records are read back from the AOF.
    pub async fn restart(&mut self) -> Result<(), String> {
        self.signal("TERM")?;
        if let Some(mut child) = self.child.take() {
            let _ = child.wait().await;
        }
        self.launch().await
    }

    /// Stops it for good and removes its directory.
    pub async fn stop(mut self) {
        let _ = self.signal("CONT");
        if let Some(mut child) = self.child.take() {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }
}
