//! `idemgate probe URL`: the container health check ([`crate::probe`]).

use std::process::ExitCode;
use std::time::Duration;

/// GETs `url` (with `IDEMGATE_ADMIN_TOKEN` as a bearer token when it is set): exit 0 on
/// a 2xx answer, 1 otherwise.
pub fn run(url: &str, timeout: Duration) -> ExitCode {
    let token = std::env::var("IDEMGATE_ADMIN_TOKEN").ok();
    match crate::probe::get(url, token.as_deref(), timeout) {
        Ok(status) if (200..300).contains(&status) => ExitCode::SUCCESS,
        Ok(status) => {
            eprintln!("idemgate probe: {url} answered {status}");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("idemgate probe: {url}: {e}");
            ExitCode::FAILURE
        }
    }
}
