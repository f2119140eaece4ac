//! The tests' one-time set-up: `tests/setup/install.sh`, run once per test binary (the script
//! itself keeps what is in place and holds a lock, so binaries starting at once install once).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

/// Runs the set-up script with `args`; returns the cache directory it printed. Panics with
/// the script's own message (what is missing, and the command that installs it) on failure.
fn run(args: &[&str]) -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/setup/install.sh");
    let out = Command::new("bash")
        .arg(&script)
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .expect("run tests/setup/install.sh");
    assert!(
        out.status.success(),
        "tests/setup/install.sh {} failed ({}): see its message above",
        args.join(" "),
        out.status
    );
    let stdout = String::from_utf8(out.stdout).expect("the cache directory in UTF-8");
    let dir = stdout.lines().last().expect("the cache directory").trim();
    PathBuf::from(dir)
}

/// What every test may use from outside the crate (Debian's packages, the pinned frameworks
/// and SDKs), installed if missing; the cache directory holding the npm and PyPI parts.
pub fn tools() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| run(&[]))
}

/// Debian's chromium and the pinned Playwright for tests/admin_browser.rs, installed once per
/// machine: the directory holding Playwright's `site` (for `PYTHONPATH`) and the page script.
pub fn browser() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| run(&["browser"]).join("browser"))
        .clone()
}

/// The previous release's binary for tests/mixed_version.rs, built once per machine.
pub fn previous_release() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let previous = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/setup/previous-release"),
        )
        .expect("tests/setup/previous-release");
        run(&["previous-release"])
            .join("previous-release")
            .join(previous.trim())
            .join("debug/idemgate")
    })
    .clone()
}
