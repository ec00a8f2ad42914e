//! Checkpoint mode (RTCP): the guard. Its core, every decision and no I/O ([`guard`]: the
//! [`guard::Core`] the shared packet loop drives); its I/O ([`runtime`]: the queue, the side
//! channel's command loops, the replay file, the status writer); its TOML configuration
//! ([`config`]) and its steering rules ([`steer`]). The fast-path half (the daemon's side of
//! the tc-BPF programs) is to come beside the core.

pub mod config;
pub mod guard;
pub mod runtime;
pub mod steer;
