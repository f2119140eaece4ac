//! Every problem of the configuration's sources at once, through the binary: `config check`
//! and start-up name each key of the wrong type and each key written in the wrong table,
//! with the file or the environment variable that set it, and quote each value once.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
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

/// `toml` in a file of its own directory.
fn file(toml: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idemgate.toml");
    std::fs::write(&path, toml).unwrap();
    (dir, path)
}

/// The lines of `err` that report a problem.
fn problems(err: &str) -> Vec<&str> {
    err.lines()
        .filter(|l| l.starts_with("idemgate: configuration error:"))
        .collect()
}

const THREE_BAD_KEYS: &str =
    "store_timeout = \"fast\"\n[defaults]\nlease = \"10 seconds please\"\nanonymous = \"yes\"\n";

#[test]
fn config_check_names_each_key_of_the_wrong_type_with_its_file() {
    let (_dir, path) = file(THREE_BAD_KEYS);
    let path = path.to_str().unwrap();
    let o = idemgate(&["config", "check", path], &[]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(64), "{err}");
    let lines = problems(&err);
    assert_eq!(lines.len(), 3, "{err}");
    for key in [
        "`store_timeout`",
        "`defaults.lease`",
        "`defaults.anonymous`",
    ] {
        let line = lines
            .iter()
            .find(|l| l.contains(key))
            .unwrap_or_else(|| panic!("{key} not named:\n{err}"));
        assert!(line.contains(&format!("in file {path}")), "{line}");
    }
    assert!(err.contains("\"10 seconds please\""), "{err}");
    assert!(o.stdout.is_empty(), "nothing printed as the configuration");
}

#[test]
fn start_up_names_each_key_of_the_wrong_type() {
    let (_dir, path) = file(THREE_BAD_KEYS);
    let o = idemgate(&["--config", path.to_str().unwrap()], &[]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(64), "{err}");
    let lines = problems(&err);
    assert_eq!(lines.len(), 3, "{err}");
    for key in [
        "`store_timeout`",
        "`defaults.lease`",
        "`defaults.anonymous`",
    ] {
        assert!(lines.iter().any(|l| l.contains(key)), "{key}:\n{err}");
    }
}

#[test]
fn config_check_names_each_bad_environment_variable() {
    let o = idemgate(
        &["config", "check"],
        &[
            ("IDEMGATE_STORE_TIMEOUT", "fast"),
            ("IDEMGATE_DEFAULTS__LEASE", "nope"),
        ],
    );
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(64), "{err}");
    let lines = problems(&err);
    assert_eq!(lines.len(), 2, "{err}");
    for (key, var) in [
        (
            "`store_timeout`",
            "environment variable IDEMGATE_STORE_TIMEOUT",
        ),
        (
            "`defaults.lease`",
            "environment variable IDEMGATE_DEFAULTS__LEASE",
        ),
    ] {
        assert!(
            lines.iter().any(|l| l.contains(key) && l.contains(var)),
            "{key} from {var}:\n{err}"
        );
    }
}

#[test]
fn a_route_key_at_the_top_level_is_told_where_it_belongs() {
    let (_dir, path) = file("lease = \"10s\"\nanonymous = \"shared\"\n");
    let o = idemgate(&["config", "check", path.to_str().unwrap()], &[]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(64), "{err}");
    assert_eq!(problems(&err).len(), 2, "{err}");
    for key in ["lease", "anonymous"] {
        let said = format!(
            "`{key}` at the top level is a route key: put it under [defaults] or a [[routes]] entry"
        );
        assert!(err.contains(&said), "{said}:\n{err}");
    }
    // No list of every key there is.
    assert!(!err.contains("upstream_tls_ca_file"), "{err}");
}

#[test]
fn values_are_quoted_once() {
    let (_dir, path) = file("[defaults]\nanonymous = \"open\"\n");
    let o = idemgate(&["config", "check", path.to_str().unwrap()], &[]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(64), "{err}");
    assert!(
        err.contains(
            "unknown value `open`, expected `refuse` or `shared` for key `defaults.anonymous`"
        ),
        "{err}"
    );
    assert!(!err.contains("``"), "{err}");
}
