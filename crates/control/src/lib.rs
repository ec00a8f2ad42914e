//! `unbroken-control`: the control floor. The checkpoint guard ([`guard`] decisions,
//! [`runtime`] I/O), its configuration, the steering rules; object mode's agent ([`agentcore`] decisions, [`agent`]
//! I/O), load balancer ([`lb`], [`detector`]) and store ([`store`], [`kv`]). The network-namespace
//! labs live in the `unbroken-lab` crate.

pub mod agent;
pub mod agentcore;
pub mod config;
pub mod daemon;
pub mod detector;
pub mod guard;
pub mod hbproto;
pub mod kv;
pub mod lb;
pub mod ratelog;
pub mod records;
pub mod replica;
pub mod replicacore;
pub mod runtime;
pub mod signals;
pub mod status;
pub mod steer;
pub mod sync;
pub mod store;
