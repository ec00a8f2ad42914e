//! Replica mode (ST-TCP): `unbroken replica` on the primary or the backup host. Its core,
//! every decision and no I/O ([`core`]: presence of the peer, the side channel, beats and
//! progress, fencing and takeover), and its I/O ([`daemon`]: the queue, the UDP side channel,
//! the fencing command, the segment plumbing). The backup's fast path: its hand-off is part
//! of the core (`core`'s fast half), the kernel's map behind it [`fastmap`].

pub mod core;
pub mod daemon;
pub mod fastmap;
