//! `unbroken-drivers`: the kernel-facing I/O of a guard.
//!
//! - [`nfqueue`]: an NFQUEUE consumer over a raw `NETLINK_NETFILTER` socket (no
//!   libnetfilter_queue), with GSO super-packets, batched receive (`recvmmsg`) and batched
//!   verdicts.
//! - [`rawsend`]: injection of complete IPv4/IPv6 packets through `IPPROTO_RAW` sockets with an
//!   `SO_MARK`, so the guard's own packets can be told apart by the firewall.
//! - [`sockdiag`]: looking up one local TCP socket by its address pair (`NETLINK_SOCK_DIAG`).
//! - [`iptables`]: installation and removal of the `iptables`/`ip6tables` rules that steer a
//!   guard's traffic into its queue and let its injected packets through.
//! - [`segment`]: replica mode's segment plumbing: ARP suppression for the service address on
//!   the backup (an owned nftables `arp` table), the rule that hands the backup the client frames
//!   a hub delivers (an owned `netdev` table), the router's mirror, and the gratuitous ARP the
//!   backup announces the address with.
//! - [`fastpath`]: the kernel fast path: each mode's tc-BPF programs (`bpf/`, compiled by
//!   build.rs), their maps, and `BPF_PROG_TEST_RUN` to check them against the engines.
//!
//! Everything here is Linux-only and needs `CAP_NET_ADMIN` (and `CAP_NET_RAW` for raw
//! sockets) at run time. Nothing here parses packets beyond the netlink framing; checksums and
//! headers are `unbroken-wire`'s business.

pub mod fastpath;
pub mod iptables;
mod netlink;
pub mod nfqueue;
pub mod procfs;
pub mod rawsend;
pub mod repair;
pub mod segment;
pub mod sockdiag;
pub mod tcfilter;
mod sys;

pub use iptables::{BuiltinChain, Proto, RuleSpec, Rules, Service, Table};
pub use nfqueue::{NetlinkError, Queue, QueueConfig, QueuedPacket, Stats, Verdict};
pub use rawsend::{RawSender, RawSenderConfig};
