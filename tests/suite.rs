//! The integration tests that share one process: idemgate through its binary or in process, a
//! redis-server of each test's own, upstreams over TCP.
//!
//! Each module is one file of tests/ (`cargo test --test suite NAME::` runs one).

#![allow(clippy::unwrap_used)]
// A test reads as one scenario, from its set-up to its verdict; the length limit holds
// for src/.
#![allow(clippy::too_many_lines)]

#[macro_use]
mod common;

mod admin_access;
mod admin_probes;
mod body_paths;
mod cli;
mod codings;
mod config_problems;
mod deciding_headers;
mod decoded_params;
mod error_formats;
mod faults;
mod fingerprint_e2e;
mod framework_presets;
mod framing;
mod hangups;
mod honest_retries;
mod jwt_principal;
mod key_in_body;
mod large_records;
mod late_writes;
mod logs;
mod many_headers;
mod method_override;
mod observability;
mod observe;
mod observe_fleet;
mod operator;
mod ops;
mod otel;
mod own_answers;
mod path_strictness;
mod proxy;
mod record_control;
mod record_mode;
mod record_policy;
mod records_cli;
mod reload;
mod retry_after;
mod roundtrips;
mod route_templates;
mod runbook;
mod scope;
mod scope_secret;
mod shutdown;
mod starting;
mod tenants;
mod tls;
mod tls_alerts;
mod tls_handshakes;
mod wire_faults;
