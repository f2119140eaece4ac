//! One way to start the idemgate under test: a typed [`Config`] built up with
//! [`Idemgate`], then started in this process ([`Idemgate::in_process`], a [`Running`]) or as
//! the real binary ([`Idemgate::binary`], a [`Gate`]), which reads the same settings from a
//! TOML file. The probes every test reads (`/metrics`, `/readyz`, records) are on both
//! handles through [`Probes`].
//!
//! `Gate::start` with `IDEMGATE_*` strings stays for the tests that are about the environment
//! itself and for a previous release's binary, which may not know newer keys.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use idemgate::config::{Anonymous, Config};
use idemgate::Running;

use super::{free_port, http_get, metric_in, series_value, Gate, RedisServer, NAMESPACE};

/// The settings of one idemgate under test, before it starts.
///
/// It starts as the tests' usual instance: in front of the given upstream, the embedded
/// store, the admin listener on, requests without a tenant in one shared anonymous scope
/// (tests not about tenants need no credentials), and no wait for a running instance's
/// scope secret (each test's store is its own).
#[must_use]
pub struct Idemgate {
    config: Config,
    // The binary's log level (`RUST_LOG`): tests that read the log ask for more.
    log_filter: String,
    // Variables for the binary that are not settings (none of `IDEMGATE_*` belongs here:
    // settings travel in the file).
    env: Vec<(String, String)>,
    // A `ulimit -n` to start the binary under.
    nofile: Option<u32>,
}

impl Idemgate {
    /// An instance in front of `upstream` (a URL) on the embedded store.
    pub fn new(upstream: &str) -> Idemgate {
        let mut c = Config::for_upstream(upstream);
        c.namespace = Some(NAMESPACE.into());
        c.admin_listen = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
        c.defaults.anonymous = Anonymous::Shared;
        c.scope_secret_create_delay = Duration::ZERO;
        Idemgate {
            config: c,
            log_filter: "info".into(),
            env: Vec::new(),
            nofile: None,
        }
    }

    /// On the Redis server at `url` (an empty URL keeps the embedded store, as
    /// `Gate::start` reads it).
    pub fn redis_url(mut self, url: &str) -> Idemgate {
        if !url.is_empty() {
            self.config.redis_url = Some(url.into());
        }
        self
    }

    /// On a Redis server the test holds.
    pub fn redis(self, redis: &RedisServer) -> Idemgate {
        self.redis_url(&redis.url())
    }

    /// On the persistent embedded store in `path`.
    pub fn on_disk(mut self, path: &Path) -> Idemgate {
        self.config.store_path = Some(path.to_path_buf());
        self
    }

    /// Changes any other setting.
    pub fn set(mut self, change: impl FnOnce(&mut Config)) -> Idemgate {
        change(&mut self.config);
        self
    }

    /// The binary logs at `filter` (`RUST_LOG`) instead of `info`.
    pub fn log(mut self, filter: &str) -> Idemgate {
        self.log_filter = filter.into();
        self
    }

    /// The binary gets the environment variable `name`, for what is not a setting (a test
    /// hook of the binary's own).
    pub fn env(mut self, name: &str, value: &str) -> Idemgate {
        self.env.push((name.into(), value.into()));
        self
    }

    /// The binary runs under `ulimit -n nofile`.
    pub fn nofile(mut self, nofile: u32) -> Idemgate {
        self.nofile = Some(nofile);
        self
    }

    /// The settings as they stand.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Starts in this process, on port 0.
    pub async fn in_process(self) -> Running {
        idemgate::start(self.config).await.expect("idemgate starts")
    }

    /// Starts the binary with these settings in a TOML file (`--config`), on free ports, and
    /// waits until it is healthy and past start-up.
    pub fn binary(self) -> Gate {
        Gate::launch_on_free_ports(|| {
            let (cmd, addr, admin, dir) = self.command();
            (cmd, addr, admin, dir)
        })
    }

    /// Runs the binary with these settings to its exit (within 20 s): its exit code and its
    /// log. For start-up refusals.
    pub fn run_to_exit(self) -> (Option<i32>, String) {
        let (cmd, _, _, dir) = self.command();
        Gate::run_command_to_exit(cmd, &dir)
    }

    /// The binary's command line: the settings written to `idemgate.toml` in a new directory
    /// (with fresh ports), the log to `idemgate.log` beside it, and no `IDEMGATE_*`
    /// variable but the file's name.
    fn command(&self) -> (Command, SocketAddr, SocketAddr, tempfile::TempDir) {
        let dir = tempfile::tempdir().expect("tempdir");
        let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let admin = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let mut config = self.config.clone();
        config.listen = addr;
        config.admin_listen = Some(admin);
        let file = dir.path().join("idemgate.toml");
        std::fs::write(&file, toml_of(&config)).expect("config file");
        let log = std::fs::File::create(dir.path().join("idemgate.log")).expect("log file");
        let mut cmd = match self.nofile {
            Some(n) => {
                let mut sh = Command::new("sh");
                sh.arg("-c")
                    .arg(format!("ulimit -n {n} && exec \"$0\" \"$@\""))
                    .arg(env!("CARGO_BIN_EXE_idemgate"));
                sh
            }
            None => Command::new(env!("CARGO_BIN_EXE_idemgate")),
        };
        cmd.arg("--config")
            .arg(&file)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("RUST_LOG", &self.log_filter)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        (cmd, addr, admin, dir)
    }
}

/// `config` as the TOML file the binary reads, checked to read back as the same settings
/// (a setting that did not survive the file would make the binary test something else).
pub fn toml_of(config: &Config) -> String {
    let text = toml::to_string(config).expect("the settings as TOML");
    let back: Config =
        figment::Figment::from(figment::providers::Serialized::defaults(Config::default()))
            .merge(<figment::providers::Toml as figment::providers::Format>::string(&text))
            .extract()
            .expect("the settings' TOML reads back");
    assert_eq!(
        format!("{back:?}"),
        format!("{config:?}"),
        "the settings read back from their TOML file differ"
    );
    text
}

/// What a test reads of a running idemgate, in process or the binary.
pub trait Probes {
    /// Where the proxy listens.
    fn proxy(&self) -> SocketAddr;
    /// Where the admin listener listens.
    fn admin(&self) -> SocketAddr;

    fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.proxy(), path)
    }

    fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.admin(), path)
    }

    /// The admin listener's `/metrics` text (empty if it did not answer).
    fn metrics(&self) -> String {
        probe(self.admin(), "/metrics").unwrap_or_default()
    }

    /// One series of `/metrics` (its name and labels exactly as exposed); fails the test if
    /// it is not exposed.
    fn metric(&self, series: &str) -> f64 {
        metric_in(&self.metrics(), series)
    }

    /// One series of `/metrics`, 0 while it is not exposed yet (a labelled counter before
    /// its first increment).
    fn metric_or_zero(&self, series: &str) -> f64 {
        series_value(&self.metrics(), series).unwrap_or(0.0)
    }

    /// Whether `/readyz` answers 200.
    fn ready(&self) -> bool {
        probe(self.admin(), "/readyz").is_some_and(|r| r.starts_with("HTTP/1.1 200"))
    }

    /// `GET /records/{id}`: the record as JSON, or `None` (404).
    fn record(
        &self,
        client: &reqwest::Client,
        id: &str,
    ) -> impl std::future::Future<Output = Option<serde_json::Value>> {
        super::inspect(client, self.admin(), id)
    }
}

/// [`http_get`] from anywhere: on a worker of a multi-thread runtime, the worker's other
/// tasks (an in-process idemgate's among them) move to another worker while this one waits.
/// A current-thread runtime would wait on itself: it fails the test instead.
fn probe(addr: SocketAddr, path: &str) -> Option<String> {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current().map(|h| h.runtime_flavor()) {
        Err(_) => http_get(addr, path),
        Ok(RuntimeFlavor::MultiThread) => tokio::task::block_in_place(|| http_get(addr, path)),
        Ok(_) => panic!("probes block: run the test on a multi-thread runtime"),
    }
}

impl Probes for Gate {
    fn proxy(&self) -> SocketAddr {
        self.addr
    }
    fn admin(&self) -> SocketAddr {
        self.admin
    }
}

impl Probes for Running {
    fn proxy(&self) -> SocketAddr {
        self.addr()
    }
    fn admin(&self) -> SocketAddr {
        self.admin_addr().expect("the admin listener is on")
    }
}
