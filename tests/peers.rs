//! Peers no one here wrote: real frameworks, SDKs and h2 servers behind or in front of idemgate,
//! a real browser in front of its admin listener, and the previous release beside this one.
//!
//! Each module is one file of tests/ (`cargo test --test peers NAME::` runs one).

#![allow(clippy::unwrap_used)]
// A test reads as one scenario, from its set-up to its verdict; the length limit holds
// for src/.
#![allow(clippy::too_many_lines)]

#[macro_use]
mod common;

mod admin_browser;
mod frameworks;
mod h2_servers;
mod h2_upstreams;
mod mixed_version;
mod peers_wire;
mod sdks;
