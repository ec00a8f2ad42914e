//! Replica mode's demo and benchmark: the running pair in the replica lab ([`demo`]), the
//! verifying Redis client ([`client`]), the chaos trials and `bench replica`.

pub mod bench;
pub mod chaos;
pub mod client;
pub mod demo;
