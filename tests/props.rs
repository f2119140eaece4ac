//! Pure tests of the crate's parts and of the repository itself: no network, no process of their
//! own (fingerprints and canonical JSON against their vectors and properties, the configuration
//! reference, the layout of src/).
//!
//! Each module is one file of tests/ (`cargo test --test props NAME::` runs one).

#![allow(clippy::unwrap_used)]
// A test reads as one scenario, from its set-up to its verdict; the length limit holds
// for src/.
#![allow(clippy::too_many_lines)]

#[macro_use]
mod common;

mod canonicalize_robustness;
mod config_reference;
mod docs_toml;
mod fingerprint_props;
mod jcs_vectors;
mod layout;
mod number_guard;
