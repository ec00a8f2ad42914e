//! `unbroken-control`: the control floor. The checkpoint guard ([`guard`] decisions,
//! [`runtime`] I/O), its configuration, the steering rules, and the network-namespace [`lab`]
//! the demos and tests run in.

pub mod agent;
pub mod agentcore;
pub mod config;
pub mod detector;
pub mod guard;
pub mod kv;
pub mod lab;
pub mod lb;
pub mod objlab;
pub mod runtime;
pub mod signals;
pub mod steer;
pub mod store;
