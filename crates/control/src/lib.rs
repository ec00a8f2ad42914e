//! `unbroken-control`: the control floor, one folder per mode beside what every daemon shares.
//!
//! - [`checkpoint`]: the checkpoint guard ([`checkpoint::guard`] decisions,
//!   [`checkpoint::runtime`] I/O), its configuration, the steering rules.
//! - [`object`]: object mode's agent ([`object::agentcore`] decisions, [`object::agent`] I/O),
//!   load balancer ([`object::lb`], [`object::detector`]) and store ([`object::store`],
//!   [`object::kv`]).
//! - [`replica`]: replica mode's daemon ([`replica::core`] decisions, [`replica::daemon`] I/O).
//! - Shared: the packet loop every mode runs in ([`daemon`]), status files ([`status`]),
//!   signals ([`signals`]), rate-limited logging ([`ratelog`]), lock and panic handling
//!   ([`sync`]) and the configurations' common pieces ([`service`]).
//!
//! A mode's module uses only its own folder and the shared modules; the shared modules use no
//! mode. The network-namespace labs live in the `unbroken-lab` crate.

pub mod checkpoint;
pub mod daemon;
pub mod object;
pub mod ratelog;
pub mod replica;
pub mod service;
pub mod signals;
pub mod status;
pub mod sync;
