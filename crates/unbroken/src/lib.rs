//! The `unbroken` toolkit's top floor: one folder per mode with its demo, its chaos trials and
//! its benchmark, run on the network-namespace labs of `unbroken-lab`.
//!
//! - [`checkpoint`]: the lab scenarios that drive guard, application and the unmodified peer
//!   ([`checkpoint::scenario`], [`checkpoint::peer`]), the chaos trials and `bench checkpoint`.
//! - [`object`]: object mode's demo ([`object::demo`]), chaos trials, `bench object`, the
//!   detector benchmark and the `unbroken lb` command.
//! - [`replica`]: replica mode's demo ([`replica::demo`]), its verifying client, chaos trials
//!   and `bench replica`.
//! - [`common`]: what they share (a seeded generator, percentiles, report helpers).

pub mod checkpoint;
pub mod common;
pub mod object;
pub mod replica;
