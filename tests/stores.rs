//! idemgate on each store and topology: PostgreSQL servers, Redis over TLS, Sentinel and Cluster
//! set-ups, the store contract, the files of the persistent stores.
//!
//! Each module is one file of tests/ (`cargo test --test stores NAME::` runs one).

#![allow(clippy::unwrap_used)]
// A test reads as one scenario, from its set-up to its verdict; the length limit holds
// for src/.
#![allow(clippy::too_many_lines)]

#[macro_use]
mod common;

mod at_rest;
mod persistent;
mod postgres;
mod postgres_faults;
mod postgres_tls;
mod redis_cluster;
mod redis_sentinel;
mod redis_tls;
mod redis_values;
mod sql_namespaces;
mod store_contract;
