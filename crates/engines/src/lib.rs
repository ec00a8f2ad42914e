//! `unbroken-engines`: one sans-I/O state machine per recovery mechanism. Each engine takes a
//! packet (bytes) and its per-connection state, and returns a verdict with the packet rewritten
//! in place. No syscalls, no clock, no allocation: the same decisions can later run in tc-BPF
//! and be checked against the same test vectors.
//!
//! - [`rtcp`]: checkpoint mode, RTCP (seed 004, Surton et al., "Man-in-the-Middle TCP Recovery").
//! - [`trods`] (with [`http`]): object mode, TRODS-KV (seed 000, Lloyd & Freedman, "Transparent
//!   Recovery for Object Delivery Services"). Unlike rtcp it buffers headers, so it allocates.
//! - [`replica`]: replica mode, a hot backup of a deterministic server (seeds 001 ST-TCP and 003
//!   Koch et al., "Transparent TCP Connection Failover"). Holds output, so it allocates.
//! - [`verdict`]: the one verdict type every core gives a packet.

pub mod http;
pub mod replica;
pub mod resume;
pub mod rtcp;
pub mod trods;
pub mod verdict;

pub use verdict::Verdict;
