//! Object mode's demo and benchmarks: the running system in the object lab ([`demo`]), the
//! chaos trials, `bench object`, `bench detector` and the `unbroken lb` command.

pub mod bench;
pub mod chaos;
pub mod demo;
pub mod detbench;
pub mod lbcmd;
