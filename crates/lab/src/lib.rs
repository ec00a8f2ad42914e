//! `unbroken-lab`: the network-namespace labs the demos, benchmarks and lab tests run in
//! ([`lab`]: pairs and checkpoint topologies; [`objlab`]: object mode with an LB, servers and a
//! store; [`replicalab`]: replica mode's segment, a client and two servers on a hub).
//! Test scaffolding only: the daemons' crate (`unbroken-control`) does not depend on it.

pub mod lab;
pub mod objlab;
pub mod replicalab;
