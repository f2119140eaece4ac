//! `idemgate bank`: the lab's deliberately non-idempotent legacy bank, on its own.

use std::net::SocketAddr;
use std::process::ExitCode;

/// Serves the bank on `listen` until SIGINT/SIGTERM; exit 71 when it cannot listen.
pub fn run(listen: SocketAddr) -> ExitCode {
    super::init_tracing(&super::env_filter("info"), None);
    let rt = match super::runtime() {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    rt.block_on(async move {
        let listener = match tokio::net::TcpListener::bind(listen).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("idemgate bank: cannot listen on {listen}: {e}");
                return ExitCode::from(71);
            }
        };
        let bank = crate::lab::Bank::with_demo_accounts(crate::lab::BankOptions::default());
        tracing::info!(%listen, "legacy bank listening (not idempotent: every POST /transfers moves money)");
        match crate::lab::bank::serve(listener, bank, super::shutdown_signal()).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("idemgate bank: {e}");
                ExitCode::FAILURE
            }
        }
    })
}
