//! `unbroken-lab`: the network-namespace labs the demos, benchmarks and lab tests run in
//! ([`lab`]: pairs and checkpoint topologies; [`objlab`]: object mode with an LB, servers and a
//! store). Test scaffolding only: the daemons' crate (`unbroken-control`) does not depend on it.

pub mod lab;
pub mod objlab;
