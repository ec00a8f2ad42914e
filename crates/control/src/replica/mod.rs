//! Replica mode (ST-TCP): `unbroken replica` on the primary or the backup host. Its core,
//! every decision and no I/O ([`core`]: presence of the peer, the side channel, beats and
//! progress, fencing and takeover), and its I/O ([`daemon`]: the queue, the UDP side channel,
//! the fencing command, the segment plumbing). The fast-path half is to come beside the core.

pub mod core;
pub mod daemon;
