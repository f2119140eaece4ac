//! The binary's contract with its operator: flags, configuration layering, exit codes.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

fn idemgate(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idemgate"));
    cmd.args(args);
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("IDEMGATE_")) {
        cmd.env_remove(k);
    }
    cmd.envs(env.iter().copied());
    cmd.output().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn help_and_version() {
    let help = idemgate(&["--help"], &[]);
    assert!(help.status.success());
    let text = String::from_utf8_lossy(&help.stdout);
    for flag in [
        "--config",
        "--listen",
        "--upstream",
        "--redis-url",
        "--namespace",
        "--admin-listen",
        "lab",
        "bank",
    ] {
        assert!(text.contains(flag), "--help lacks {flag}: {text}");
    }
    for default in [
        "[default: 127.0.0.1:8080]",
        "[default: http://127.0.0.1:9000]",
        "[default: 127.0.0.1:9901]",
    ] {
        assert!(text.contains(default), "--help lacks {default}: {text}");
    }
    let version = idemgate(&["--version"], &[]);
    assert!(String::from_utf8_lossy(&version.stdout).contains(env!("CARGO_PKG_VERSION")));
}

#[test]
fn bad_configuration_exits_64_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("idemgate.toml");
    std::fs::write(&file, "[defaults]\nlease = \"often\"\n").unwrap();
    let o = idemgate(&["--config", file.to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(64), "{}", stderr(&o));
    assert!(stderr(&o).contains("defaults.lease"), "{}", stderr(&o));

    let o = idemgate(&[], &[("IDEMGATE_UPSTREAM", "ftp://bank.example")]);
    assert_eq!(o.status.code(), Some(64));
    assert!(stderr(&o).contains("upstream"), "{}", stderr(&o));

    let o = idemgate(
        &[],
        &[
            ("IDEMGATE_UPSTREAM", "https://bank.example"),
            ("IDEMGATE_UPSTREAM_TLS_CA_FILE", "/nonexistent/ca.pem"),
        ],
    );
    assert_eq!(o.status.code(), Some(64));
    assert!(
        stderr(&o).contains("upstream_tls_ca_file"),
        "{}",
        stderr(&o)
    );

    let o = idemgate(&[], &[("IDEMGATE_DEFAULTS__ON_AMBIGUOUS", "retry")]);
    assert_eq!(o.status.code(), Some(64));
    // The environment provider reports the key as it was spelled there.
    assert!(
        stderr(&o).to_lowercase().contains("defaults.on_ambiguous"),
        "{}",
        stderr(&o)
    );

    std::fs::write(&file, "listn = \"127.0.0.1:1\"\n").unwrap();
    let o = idemgate(&["--config", file.to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(64));
    assert!(stderr(&o).contains("listn"), "{}", stderr(&o));

    let o = idemgate(&[], &[("IDEMGATE_WORKER_THREADS", "0")]);
    assert_eq!(o.status.code(), Some(64));
    assert!(stderr(&o).contains("worker_threads"), "{}", stderr(&o));

    let o = idemgate(&["--config", "/nonexistent/idemgate.toml"], &[]);
    assert_eq!(o.status.code(), Some(64), "{}", stderr(&o));
}

#[test]
fn flags_beat_environment_beats_file() {
    // A flag with a bad value must win over a good file and environment: proof of order.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("idemgate.toml");
    std::fs::write(&file, "upstream = \"http://127.0.0.1:9\"\n").unwrap();
    let o = idemgate(
        &["--config", file.to_str().unwrap(), "--upstream", "ftp://x"],
        &[("IDEMGATE_UPSTREAM", "http://127.0.0.1:9")],
    );
    assert_eq!(o.status.code(), Some(64));
    assert!(stderr(&o).contains("upstream"), "{}", stderr(&o));
    // Environment over file: the environment fixes the upstream, so the error left is the
    // lease that only the environment sets.
    std::fs::write(&file, "upstream = \"ftp://x\"\n").unwrap();
    let o = idemgate(
        &["--config", file.to_str().unwrap()],
        &[
            ("IDEMGATE_UPSTREAM", "http://127.0.0.1:9"),
            ("IDEMGATE_DEFAULTS__LEASE", "1ms"),
        ],
    );
    assert_eq!(o.status.code(), Some(64));
    assert!(stderr(&o).contains("defaults.lease"), "{}", stderr(&o));
    assert!(!stderr(&o).contains("`upstream`"), "{}", stderr(&o));
}

#[test]
fn unreachable_redis_at_start_exits_69() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let o = idemgate(
        &["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"],
        &[
            ("IDEMGATE_REDIS_URL", &format!("redis://127.0.0.1:{port}/0")),
            ("IDEMGATE_NAMESPACE", "payments"),
        ],
    );
    assert_eq!(o.status.code(), Some(69), "{}", stderr(&o));
    assert!(
        stderr(&o).contains(&format!("Redis at 127.0.0.1:{port}")),
        "{}",
        stderr(&o)
    );
    // The address, never the URL's credentials.
    let o = idemgate(
        &["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"],
        &[
            (
                "IDEMGATE_REDIS_URL",
                &format!("redis://user:pw-8c1f@127.0.0.1:{port}/0"),
            ),
            ("IDEMGATE_NAMESPACE", "payments"),
        ],
    );
    assert_eq!(o.status.code(), Some(69), "{}", stderr(&o));
    assert!(!stderr(&o).contains("pw-8c1f"), "{}", stderr(&o));
}

/// The configuration shipped in `deploy/k8s/configmap.yaml` loads as it is: a key renamed
/// or a value tightened in the code must not leave it behind.
#[test]
fn the_shipped_kubernetes_configuration_loads() {
    let yaml = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/k8s/configmap.yaml"
    ))
    .unwrap();
    // The block scalar under `idemgate.toml: |`, indented by four spaces.
    let toml: String = yaml
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("idemgate.toml: |"))
        .skip(1)
        .take_while(|l| l.is_empty() || l.starts_with("    "))
        .map(|l| format!("{}\n", l.get(4..).unwrap_or("")))
        .collect();
    assert!(toml.contains("upstream = "), "{toml}");
    let dir = tempfile::tempdir().unwrap();
    // The Redis CA and password come from Secrets in the pod; here stand-ins do.
    let ca = dir.path().join("ca.crt");
    std::fs::write(
        &ca,
        "-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    let toml = toml.replace("/etc/idemgate-redis-tls/ca.crt", &ca.display().to_string());
    let toml = format!("redis_password = \"stand-in\"\n{toml}");
    let file = dir.path().join("idemgate.toml");
    std::fs::write(&file, &toml).unwrap();
    let settings = idemgate::Config::load(idemgate::Config::figment(Some(&file)))
        .unwrap_or_else(|e| panic!("{e}\n{toml}"));
    assert_eq!(settings.config.worker_threads, 1);
}

/// Runs the binary with `args` and `env` (nothing else from this environment), stderr to a
/// file (not a terminal), until its admin listener at `admin` answers `/healthz` or 15 s
/// pass; then kills it. Whether it got healthy, and its stderr.
fn run_until_healthy(args: &[&str], env: &[(&str, &str)], admin: &str) -> (bool, String) {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("stderr.log");
    let mut child = Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .env_clear()
        .env("RUST_LOG", "info")
        .envs(env.iter().copied())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let admin = admin.parse().unwrap();
    // Healthy, or given up: exited, or 15 s without becoming healthy.
    let mut healthy = false;
    common::held_within(Duration::from_secs(15), || {
        healthy = common::started(admin);
        healthy || child.try_wait().unwrap().is_some()
    });
    let _ = child.kill();
    let _ = child.wait();
    (healthy, std::fs::read_to_string(&log).unwrap())
}

/// A Service called `idemgate` makes Kubernetes inject `IDEMGATE_PORT=tcp://...` and
/// friends into every pod of its namespace: idemgate starts anyway and names them once.
#[test]
fn unknown_environment_variables_are_ignored_with_one_warning() {
    let admin = format!("127.0.0.1:{}", common::free_port());
    let (healthy, out) = run_until_healthy(
        &[],
        &[
            ("IDEMGATE_LISTEN", "127.0.0.1:0"),
            ("IDEMGATE_ADMIN_LISTEN", &admin),
            ("IDEMGATE_PORT", "tcp://10.96.0.17:80"),
            ("IDEMGATE_PORT_80_TCP_ADDR", "10.96.0.17"),
            ("IDEMGATE_SERVICE_HOST", "10.96.0.17"),
        ],
        &admin,
    );
    assert!(healthy, "idemgate did not start:\n{out}");
    let warnings: Vec<&str> = out
        .lines()
        .filter(|l| l.contains("name no setting"))
        .collect();
    assert_eq!(warnings.len(), 1, "{out}");
    for name in [
        "IDEMGATE_PORT,",
        "IDEMGATE_PORT_80_TCP_ADDR",
        "IDEMGATE_SERVICE_HOST",
    ] {
        assert!(warnings[0].contains(name), "{name} not named: {out}");
    }
    assert!(!warnings[0].contains("IDEMGATE_LISTEN"), "{out}");
}

/// A first run: `--listen localhost:PORT` works, the start-up line names the admin address
/// as an address, and a log that is not a terminal gets no colour codes.
#[test]
fn first_run_start_up_line_is_plain() {
    let port = common::free_port();
    let listen = format!("localhost:{port}");
    let admin = format!("127.0.0.1:{}", common::free_port());
    let (healthy, out) = run_until_healthy(
        &["--listen", &listen, "--admin-listen", &admin],
        &[],
        &admin,
    );
    assert!(healthy, "idemgate did not start:\n{out}");
    let line = out
        .lines()
        .find(|l| l.contains("idemgate starting"))
        .unwrap_or_else(|| panic!("no start-up line:\n{out}"));
    assert!(line.contains(&format!("admin={admin}")), "{line}");
    assert!(!line.contains("Some("), "{line}");
    assert!(line.contains(&format!(":{port} ")), "{line}");
    assert!(
        !out.contains('\u{1b}'),
        "colour codes in a log file:\n{out}"
    );
}

/// Two services on one Redis must not share records by accident: a Redis set-up without a
/// namespace does not start.
#[test]
fn redis_without_a_namespace_exits_64_naming_the_key() {
    let o = idemgate(
        &[
            "--listen",
            "127.0.0.1:0",
            "--redis-url",
            "redis://127.0.0.1:9/0",
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(64), "{}", stderr(&o));
    assert!(stderr(&o).contains("namespace"), "{}", stderr(&o));
}

/// `config defaults` prints every setting with its default, and `config check` accepts
/// that output as a file.
#[test]
fn config_defaults_print_every_setting_and_check_accepts_them() {
    let out = idemgate(&["config", "defaults"], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    for line in [
        "max_in_flight = 1024",
        "max_queued = 1024",
        "queue_timeout = \"1s\"",
        "send_timeout = \"1m\"",
        "retention = \"1day\"",
        "short_retention_statuses = [401, 403, 407]",
        "# redis_url",
        "# defaults.tenant_jwt_claim",
    ] {
        assert!(text.contains(line), "no `{line}` in\n{text}");
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("defaults.toml");
    std::fs::write(&file, &text).unwrap();
    let check = idemgate(&["config", "check", file.to_str().unwrap()], &[]);
    assert!(check.status.success(), "{}", stderr(&check));
}

/// `config check` runs start-up's checks with start-up's messages and exit code, and
/// prints the effective configuration with its secrets redacted, as a file it accepts.
#[test]
fn config_check_reports_like_start_up_and_redacts_secrets() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "max_in_flight = 0\n").unwrap();
    let out = idemgate(&["config", "check", bad.to_str().unwrap()], &[]);
    assert_eq!(out.status.code(), Some(64), "{}", stderr(&out));
    assert!(stderr(&out).contains("max_in_flight"), "{}", stderr(&out));

    let good = dir.path().join("good.toml");
    std::fs::write(
        &good,
        "redis_url = \"redis://idemgate:hunter2-in-url@127.0.0.1:1/0\"\nnamespace = \"payments\"\n",
    )
    .unwrap();
    let token = "an-admin-token-that-must-not-show";
    let secret = "a-jwt-secret-that-must-not-show-0123456789";
    let scope = "ab".repeat(32);
    let out = idemgate(
        &["config", "check", good.to_str().unwrap()],
        &[
            ("IDEMGATE_ADMIN_TOKEN", token),
            ("IDEMGATE_JWT_HS256_SECRET", secret),
            ("IDEMGATE_SCOPE_SECRET", &scope),
            ("IDEMGATE_REDIS_PASSWORD", "a-redis-password"),
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    for leaked in [
        token,
        secret,
        scope.as_str(),
        "a-redis-password",
        "hunter2-in-url",
    ] {
        assert!(!text.contains(leaked), "{leaked} printed:\n{text}");
    }
    assert!(text.contains("namespace = \"payments\""), "{text}");
    assert!(
        text.contains("redis://idemgate:REDACTED@127.0.0.1:1/0"),
        "{text}"
    );
    // Without network, an unreachable Redis is not checked...
    let printed = dir.path().join("printed.toml");
    std::fs::write(&printed, &text).unwrap();
    let again = idemgate(&["config", "check", printed.to_str().unwrap()], &[]);
    assert!(again.status.success(), "{}", stderr(&again));
    // ... and with --connect it is, with start-up's exit code.
    let connect = idemgate(
        &["config", "check", "--connect", good.to_str().unwrap()],
        &[],
    );
    assert_eq!(connect.status.code(), Some(69), "{}", stderr(&connect));
}

/// `config check` reports every problem of a run, the variables that look mistyped
/// included (their value does not apply: a team that set `IDEMGATE_DEFAULT__MODE=observe`
/// would be enforcing), while Kubernetes' service variables stay harmless.
#[test]
fn config_check_reports_every_problem_and_mistyped_variables_in_one_run() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "max_in_flight = 0\nupstream = \"ftp://x:1\"\nscope_secret_create_delay = \"1s\"\n",
    )
    .unwrap();
    let out = idemgate(
        &["config", "check", bad.to_str().unwrap()],
        &[
            ("IDEMGATE_DEFAULT__MODE", "observe"),
            ("IDEMGATE_PORT", "tcp://10.96.0.17:80"),
        ],
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(64), "{err}");
    for named in [
        "`max_in_flight`",
        "`upstream`",
        "`scope_secret_create_delay`",
        "IDEMGATE_DEFAULT__MODE names no setting",
        "did you mean IDEMGATE_DEFAULTS__MODE?",
    ] {
        assert!(err.contains(named), "{named} missing:\n{err}");
    }
    assert!(!err.contains("IDEMGATE_PORT names"), "{err}");

    // Under a known prefix, with one underscore too few.
    let out = idemgate(
        &["config", "check"],
        &[("IDEMGATE_DEFAULTS_MODE", "observe")],
    );
    assert_eq!(out.status.code(), Some(64), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("did you mean IDEMGATE_DEFAULTS__MODE?"),
        "{}",
        stderr(&out)
    );
    // Kubernetes' names alone: fine.
    let out = idemgate(
        &["config", "check"],
        &[
            ("IDEMGATE_PORT", "tcp://10.96.0.17:80"),
            ("IDEMGATE_PORT_80_TCP_ADDR", "10.96.0.17"),
            ("IDEMGATE_SERVICE_HOST", "10.96.0.17"),
            ("IDEMGATE_SERVICE_PORT", "80"),
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
}

/// Start-up runs with a mistyped variable (it cannot tell a typo from a neighbour's name
/// for sure), but warns naming what it probably meant.
#[test]
fn start_up_warns_about_a_mistyped_variable() {
    let admin = format!("127.0.0.1:{}", common::free_port());
    let (healthy, out) = run_until_healthy(
        &[],
        &[
            ("IDEMGATE_LISTEN", "127.0.0.1:0"),
            ("IDEMGATE_ADMIN_LISTEN", &admin),
            ("IDEMGATE_DEFAULT__MODE", "observe"),
        ],
        &admin,
    );
    assert!(healthy, "idemgate did not start:\n{out}");
    let line = out
        .lines()
        .find(|l| l.contains("IDEMGATE_DEFAULT__MODE names no setting"))
        .unwrap_or_else(|| panic!("no warning:\n{out}"));
    assert!(line.contains("WARN"), "{line}");
    assert!(
        line.contains("did you mean IDEMGATE_DEFAULTS__MODE?"),
        "{line}"
    );
}

/// The printed configuration shows no PostgreSQL password, in any spelling the parser
/// accepts.
#[test]
fn config_check_redacts_postgres_passwords_in_every_spelling() {
    for (url, secret) in [
        ("postgres://app:pa/ss-one@db/pay", "pa/ss-one"),
        (
            "postgres://app:pa?ss-two@db/pay?sslmode=disable",
            "pa?ss-two",
        ),
        (
            "postgres://app@db/pay?password=hunter-three",
            "hunter-three",
        ),
        (
            "host=db user=app password = hunter-four dbname=pay",
            "hunter-four",
        ),
        (
            "host=db user=app password='hunter five' dbname=pay",
            "hunter five",
        ),
    ] {
        let out = idemgate(
            &["config", "check"],
            &[
                ("IDEMGATE_NAMESPACE", "pay"),
                ("IDEMGATE_POSTGRES_URL", url),
            ],
        );
        assert!(out.status.success(), "{url}: {}", stderr(&out));
        let text = String::from_utf8_lossy(&out.stdout);
        let printed = text
            .lines()
            .find(|l| l.starts_with("postgres_url"))
            .unwrap_or_else(|| panic!("{text}"));
        assert!(!printed.contains(secret), "{url} printed as {printed}");
        // Not half of it either (`password='x y'` once lost only its first word).
        for word in secret.split(' ') {
            assert!(!printed.contains(word), "{url} printed as {printed}");
        }
        assert!(printed.contains("REDACTED"), "{printed}");
        assert!(!stderr(&out).contains(secret), "{}", stderr(&out));
    }
}

/// A protected route whose tenant is the raw `Authorization` credential is warned about,
/// with the settings that name a stable principal; one that names another does not.
#[test]
fn config_check_warns_that_a_refreshed_token_is_a_new_tenant() {
    let out = idemgate(&["config", "check"], &[]);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("warning: the tenant of [defaults] is the raw Authorization credential"),
        "{err}"
    );
    assert!(
        err.contains("tenant_jwt_claim") && err.contains("tenant_headers"),
        "{err}"
    );
    let out = idemgate(
        &["config", "check"],
        &[("IDEMGATE_DEFAULTS__TENANT_HEADERS", "[\"X-Account-Id\"]")],
    );
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(!err.contains("raw Authorization credential"), "{err}");
}

/// What start-up warns about from the configuration is printed by `config check` too.
#[test]
fn config_check_prints_start_ups_warnings() {
    let out = idemgate(
        &["config", "check"],
        &[
            ("IDEMGATE_NAMESPACE", "pay"),
            (
                "IDEMGATE_POSTGRES_URL",
                "postgres://app@db.internal/pay?sslmode=require",
            ),
            ("IDEMGATE_ADMIN_LISTEN", "0.0.0.0:9901"),
        ],
    );
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("warning: PostgreSQL at db.internal:5432 over TLS with sslmode=require"),
        "{err}"
    );
    assert!(err.contains("not verified"), "{err}");
    assert!(
        err.contains("reachable from other hosts without admin_token"),
        "{err}"
    );
    let out = idemgate(
        &["config", "check"],
        &[
            ("IDEMGATE_NAMESPACE", "pay"),
            ("IDEMGATE_POSTGRES_URL", "postgres://app@db.internal/pay"),
        ],
    );
    assert!(stderr(&out).contains("plain text"), "{}", stderr(&out));
    let out = idemgate(&["config", "check"], &[]);
    assert!(
        stderr(&out).contains("warning: using the embedded in-memory store"),
        "{}",
        stderr(&out)
    );
    // With --connect, what connecting tells: Redis persistence off.
    let redis = common::RedisServer::start();
    let out = idemgate(
        &["config", "check", "--connect"],
        &[
            ("IDEMGATE_NAMESPACE", "pay"),
            ("IDEMGATE_REDIS_URL", &redis.url()),
            ("IDEMGATE_SCOPE_SECRET_CREATE_DELAY", "0s"),
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("append-only persistence is off"),
        "{}",
        stderr(&out)
    );
}
