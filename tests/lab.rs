//! The lab and the history checkers: long runs of retrying traffic through idemgate, checked from
//! the clients' side.
//!
//! Each module is one file of tests/ (`cargo test --test lab NAME::` runs one).

#![allow(clippy::unwrap_used)]
// A test reads as one scenario, from its set-up to its verdict; the length limit holds
// for src/.
#![allow(clippy::too_many_lines)]

#[macro_use]
mod common;

mod history;
mod history_faults;
mod lab_bad_day;
mod lab_direct;
mod lab_through_idemgate;
mod postgres_history;
mod redis_failover_history;
