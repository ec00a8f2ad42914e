//! Checkpoint mode's demo and benchmark: the lab scenarios (guard, the example journal server
//! and the unmodified peer, with crashes injected), the chaos trials and `bench checkpoint`.

pub mod bench;
pub mod chaos;
pub mod peer;
pub mod scenario;
