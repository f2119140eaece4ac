//! Tests that read a process's resources (resident memory, threads, sockets, the accept queue) or
//! load it on purpose (floods, overload): kept out of the main binary so that other tests'
//! traffic does not share their process.
//!
//! Each module is one file of tests/ (`cargo test --test measured NAME::` runs one).

#![allow(clippy::unwrap_used)]
// A test reads as one scenario, from its set-up to its verdict; the length limit holds
// for src/.
#![allow(clippy::too_many_lines)]

#[macro_use]
mod common;

mod accept_queue;
mod flow_control;
mod hostile;
mod keepalive;
mod limits;
mod memory_budget;
mod overload;
mod threads;
