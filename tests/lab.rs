//! The lab and the history checkers: long runs of retrying traffic through idemgate, checked from
//! the clients' side.
//!
//! Each module is one file of tests/ (`cargo test --test lab NAME::` runs one).

#![allow(clippy::unwrap_used)]

#[macro_use]
mod common;

mod history;
mod history_faults;
mod lab_bad_day;
mod lab_direct;
mod lab_through_idemgate;
mod postgres_history;
mod redis_failover_history;
