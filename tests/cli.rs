//! The binary's contract with its operator: flags, configuration layering, exit codes.
#![allow(clippy::unwrap_used)]

use std::process::{Command, Output};

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

    let o = idemgate(&[], &[("IDEMGATE_UPSTREAM", "https://bank.example")]);
    assert_eq!(o.status.code(), Some(64));
    assert!(stderr(&o).contains("upstream"), "{}", stderr(&o));

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
    assert!(stderr(&o).contains("store"), "{}", stderr(&o));
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
