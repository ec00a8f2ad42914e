//! The segment plumbing of replica mode: both hosts own the service address, only one of them
//! may speak for it on the link.
//!
//! - [`ArpSuppress`]: on the backup, the kernel neither answers ARP requests for the service
//!   address on one device nor sends ARP with it as the sender address (which would announce it
//!   and pull the clients' traffic over). An nftables table of family `arp`, one per device:
//!
//!   ```text
//!   table arp unbroken-arp-eth0 {
//!     comment "unbroken-owner:PID:START"
//!     chain in  { type filter hook input priority filter; policy accept;
//!       iifname "eth0" arp operation request arp daddr ip 10.0.0.10 counter drop comment "unbroken-owner:PID:START" }
//!     chain out { type filter hook output priority filter; policy accept;
//!       oifname "eth0" arp saddr ip 10.0.0.10 counter drop comment "unbroken-owner:PID:START" }
//!   }
//!   ```
//!
//!   Why nftables and not `arp_ignore`/`arp_announce`: those sysctls act on every address of an
//!   interface (or of the host), not on one, so they would change how the backup's own host
//!   address is resolved too; `arp_ignore=1` still answers for an address configured on the
//!   receiving interface (where the service address must be for the backup's server to bind
//!   it); and a sysctl carries no owner, so a crashed daemon's setting could not be told from the
//!   operator's. The table is one transaction to install and one to delete, carries the owner
//!   like the guard's iptables chains ([`Owner`]), and its counters show what it dropped.
//!   Its chains accept everything else: other addresses, other devices, and the gratuitous ARP
//!   of [`Announcer`] (an `AF_PACKET` socket bypasses the `arp` hooks altogether).
//!
//!   **Ownership and idempotence** as in [`crate::iptables`]: [`ArpSuppress::install`] reads the
//!   table first; one of another process that still runs is never touched (the error names it);
//!   one left by a process that is gone, or without an owner comment, is replaced, atomically
//!   (`table; delete table; table {...}` in one `nft -f` transaction, so there is no moment
//!   without suppression). [`ArpSuppress::remove`] deletes the table if it is still this
//!   owner's; removing an absent table is not an error. `Drop` removes, unless
//!   [`ArpSuppress::leave_installed`].
//!
//! - [`Announcer`]: the gratuitous ARP a backup sends when it takes over, built by
//!   [`unbroken_wire::arp`] and sent from an `AF_PACKET` socket, no external tool. Each
//!   [`Announcer::announce`] sends two broadcast frames: the request form (RFC 5227's
//!   announcement, as `arping -U`) and the reply form (target MAC = sender MAC, the form Linux's
//!   `arp_is_garp` also accepts). A Linux peer updates an existing neighbour entry from either,
//!   overriding its lock time; one without an entry creates none unless its `arp_accept` allows,
//!   and resolves afresh when it next needs to, which the backup then answers (suppression
//!   removed first). Order on takeover: release the withheld output, remove the suppression,
//!   then announce (an announcement before the backup can answer makes clients' packets meet a
//!   host that is not ready).
//!
//! - [`HubReceive`]: on the backup, the client's frames that a hub, a port mirror or [`Mirror`]
//!   delivers name the primary's MAC, so the backup's stack drops them (`PACKET_OTHERHOST`)
//!   although their IP destination is its own (the service address). One nftables netdev
//!   ingress rule on the backup's device, `ip daddr { ADDRS } tcp dport { PORTS } meta pkttype
//!   other meta pkttype set host`, hands exactly the replicated services' TCP segments to its
//!   stack (whose answers replica mode's queue then withholds); everything else stays the
//!   primary's alone: pings (one reply, not two), other TCP ports (no RST from the backup), UDP,
//!   frames for its host address, broadcasts and other destinations. Counted
//!   ([`HubReceive::handed`]); owned, installed and removed like [`ArpSuppress`]; IPv4 only
//!   (IPv6 service addresses are refused: there is no neighbour-discovery suppression yet).
//!
//! - [`Mirror`]: for a segment without a hub, on the router in front: an nftables netdev egress
//!   `dup` of every frame toward the primary for the service address, out of the router's link
//!   to the backup. Owned like [`ArpSuppress`].

use std::ffi::CString;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::process::{Command, Stdio};

use unbroken_wire::arp::{self, Operation, Repr};

use crate::iptables::check_iface_name;
pub use crate::iptables::Owner;
use crate::sys;

/// The owned-table driver every segment table shares (ArpSuppress, Mirror, HubReceive): a
/// value holding an installed table of `family` for a spec with `table`, `netns`, `nft`,
/// `owner`, `validate` and `ruleset` (the macro gives the spec its `nft_table`). `install` reads the table first: another running owner's is never touched
/// (`AddrInUse`, naming it), a dead owner's or an untagged one is replaced in one transaction;
/// installing twice from the same owner is idempotent. `remove_leftovers` deletes it unless
/// another running process owns it (absent: not an error); `remove` and `Drop` remove it,
/// unless `leave_installed`.
macro_rules! owned_table {
    ($(#[$doc:meta])* $name:ident, $spec:ident, $family:literal) => {
        $(#[$doc])*
        #[derive(Debug)]
        pub struct $name {
            spec: $spec,
            installed: bool,
        }

        impl $name {
            /// Installs the table of `spec` (see the driver's docs for ownership).
            pub fn install(spec: &$spec) -> io::Result<$name> {
                spec.validate()?;
                let t = spec.nft_table();
                check_owner(&t, spec.owner)?;
                nft_stdin(&t, &spec.ruleset())?;
                Ok($name { spec: spec.clone(), installed: true })
            }

            /// Fails (`AddrInUse`) when the table exists and belongs to a running process other
            /// than `spec.owner`.
            pub fn check_owner(spec: &$spec) -> io::Result<()> {
                check_owner(&spec.nft_table(), spec.owner)
            }

            /// Deletes the table of `spec` when it is there and not another running process's;
            /// an absent table is not an error.
            pub fn remove_leftovers(spec: &$spec) -> io::Result<()> {
                spec.validate()?;
                delete_table(&spec.nft_table(), spec.owner)
            }

            /// Who owns the table of `spec`: `None` when it does not exist, `Some(None)` when it
            /// has no owner comment.
            pub fn owner(spec: &$spec) -> io::Result<Option<Option<Owner>>> {
                table_owner(&spec.nft_table())
            }

            /// The spec installed.
            pub fn spec(&self) -> &$spec {
                &self.spec
            }

            /// Removes the table.
            pub fn remove(mut self) -> io::Result<()> {
                self.installed = false;
                Self::remove_leftovers(&self.spec)
            }

            /// Leaves the table installed when this value goes away (e.g. a restarting daemon).
            pub fn leave_installed(mut self) {
                self.installed = false;
            }
        }

        impl $spec {
            /// The table as `nft` names it.
            fn nft_table(&self) -> NftTable<'_> {
                NftTable { family: $family, name: &self.table, netns: self.netns.as_deref(), bin: &self.nft }
            }
        }

        impl Drop for $name {
            fn drop(&mut self) {
                if self.installed {
                    self.installed = false;
                    if let Err(e) = Self::remove_leftovers(&self.spec) {
                        eprintln!("unbroken: removing nftables table {} {}: {e}", $family, self.spec.table);
                    }
                }
            }
        }
    };
}

/// What [`ArpSuppress::install`] installs. Build with [`ArpSuppressSpec::new`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArpSuppressSpec {
    /// The nftables table (family `arp`), by default [`ArpSuppressSpec::table_name`] of the
    /// device. At most 32 characters of `[A-Za-z0-9_-]`, starting with a letter.
    pub table: String,
    /// The device the service address lives on.
    pub device: String,
    /// The service address.
    pub addr: Ipv4Addr,
    /// Run `nft` inside this named network namespace (`ip netns exec NAME nft ...`).
    pub netns: Option<String>,
    /// The `nft` binary.
    pub nft: String,
    /// The process the table belongs to ([`Owner::current`] by default).
    pub owner: Owner,
}

impl ArpSuppressSpec {
    /// Suppress `addr` on `device`, table `unbroken-arp-DEVICE`, in this namespace, owned by
    /// the calling process.
    pub fn new(device: impl Into<String>, addr: Ipv4Addr) -> ArpSuppressSpec {
        let device = device.into();
        ArpSuppressSpec {
            table: Self::table_name(&device),
            device,
            addr,
            netns: None,
            nft: "nft".into(),
            owner: Owner::current(),
        }
    }

    /// `unbroken-arp-DEVICE` (characters nftables would not take in a name become `_`).
    pub fn table_name(device: &str) -> String {
        table_name("unbroken-arp", device)
    }

    fn validate(&self) -> io::Result<()> {
        check_iface_name(&self.device)?;
        check_table_name(&self.table)?;
        check_unicast(std::net::IpAddr::V4(self.addr))
    }

    /// The `nft -f` transaction that installs (or atomically replaces) the table.
    fn ruleset(&self) -> String {
        let (t, d, a, tag) = (&self.table, &self.device, self.addr, self.owner.tag());
        format!(
            "table arp {t}\n\
             delete table arp {t}\n\
             table arp {t} {{\n\
             \x20 comment \"{tag}\"\n\
             \x20 chain in {{\n\
             \x20   type filter hook input priority filter; policy accept;\n\
             \x20   iifname \"{d}\" arp operation request arp daddr ip {a} counter drop comment \"{tag}\"\n\
             \x20 }}\n\
             \x20 chain out {{\n\
             \x20   type filter hook output priority filter; policy accept;\n\
             \x20   oifname \"{d}\" arp saddr ip {a} counter drop comment \"{tag}\"\n\
             \x20 }}\n\
             }}\n"
        )
    }
}

/// What the table dropped so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ArpSuppressCounters {
    /// ARP requests for the service address that arrived on the device (not answered).
    pub requests_dropped: u64,
    /// ARP packets the kernel would have sent with the service address as the sender.
    pub announcements_dropped: u64,
}

owned_table! {
    /// An installed suppression; removed by [`ArpSuppress::remove`] (takeover: the backup
    /// answers for the address from now on) or on drop; [`ArpSuppress::leave_installed`] keeps
    /// it (a backup daemon restarting must not let its host answer ARP for the address in
    /// between).
    ArpSuppress, ArpSuppressSpec, "arp"
}

impl ArpSuppress {
    /// What the table has dropped so far; `NotFound` when it is not installed.
    pub fn counters(spec: &ArpSuppressSpec) -> io::Result<ArpSuppressCounters> {
        let t = spec.nft_table();
        let text = list_table(&t)?.ok_or_else(|| not_installed(&t))?;
        Ok(parse_counters(&text))
    }
}

/// What [`Mirror::install`] installs: on a router in front of a bridge-less segment, every
/// frame it sends toward the primary (`device`) to the service address is also sent, unchanged,
/// out of `to`, toward the backup. Build with [`MirrorSpec::new`].
///
/// ```text
/// table netdev unbroken-mirror-lan0 {
///   comment "unbroken-owner:PID:START"
///   chain c { type filter hook egress device "lan0" priority filter; policy accept;
///     ip daddr 10.0.0.10 counter dup to "bk0" comment "unbroken-owner:PID:START" }
/// }
/// ```
///
/// The copies name the primary's MAC, so the backup's stack ignores them until its own ingress
/// marks them as its own (`meta pkttype set host`, see `docs/architecture.md`). The netdev egress
/// hook needs Linux 5.16 or later. Owned, installed and removed like [`ArpSuppress`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MirrorSpec {
    /// The nftables table (family `netdev`), by default `unbroken-mirror-DEVICE`.
    pub table: String,
    /// The router's device toward the primary (its egress is mirrored).
    pub device: String,
    /// The router's device toward the backup (copies leave through it).
    pub to: String,
    /// The service address: only packets to it are mirrored.
    pub addr: std::net::IpAddr,
    /// Run `nft` inside this named network namespace.
    pub netns: Option<String>,
    /// The `nft` binary.
    pub nft: String,
    /// The process the table belongs to ([`Owner::current`] by default).
    pub owner: Owner,
}

impl MirrorSpec {
    /// Mirror what leaves `device` for `addr` out of `to`, in this namespace, owned by the
    /// calling process.
    pub fn new(
        device: impl Into<String>,
        to: impl Into<String>,
        addr: std::net::IpAddr,
    ) -> MirrorSpec {
        let device = device.into();
        MirrorSpec {
            table: table_name("unbroken-mirror", &device),
            device,
            to: to.into(),
            addr,
            netns: None,
            nft: "nft".into(),
            owner: Owner::current(),
        }
    }

    fn validate(&self) -> io::Result<()> {
        check_iface_name(&self.device)?;
        check_iface_name(&self.to)?;
        if self.device == self.to {
            return Err(invalid(format!("mirroring {} to itself", self.device)));
        }
        check_table_name(&self.table)?;
        check_unicast(self.addr)
    }

    /// The `nft -f` transaction that installs (or atomically replaces) the table.
    fn ruleset(&self) -> String {
        let (t, d, to, tag) = (&self.table, &self.device, &self.to, self.owner.tag());
        let m = match self.addr {
            std::net::IpAddr::V4(a) => format!("ip daddr {a}"),
            std::net::IpAddr::V6(a) => format!("ip6 daddr {a}"),
        };
        format!(
            "table netdev {t}\n\
             delete table netdev {t}\n\
             table netdev {t} {{\n\
             \x20 comment \"{tag}\"\n\
             \x20 chain c {{\n\
             \x20   type filter hook egress device \"{d}\" priority filter; policy accept;\n\
             \x20   {m} counter dup to \"{to}\" comment \"{tag}\"\n\
             \x20 }}\n\
             }}\n"
        )
    }
}

owned_table! {
    /// An installed mirror; removed by [`Mirror::remove`] or on drop.
    Mirror, MirrorSpec, "netdev"
}

impl Mirror {
    /// Packets mirrored so far; `NotFound` when not installed.
    pub fn mirrored(spec: &MirrorSpec) -> io::Result<u64> {
        let t = spec.nft_table();
        let text = list_table(&t)?.ok_or_else(|| not_installed(&t))?;
        Ok(sum_counters(&text))
    }
}

/// What [`HubReceive::install`] installs: on the backup, TCP segments on `device` to one of
/// the replicated services (service address and port) but to another host's MAC (the
/// primary's: a hub, a port mirror or [`Mirror`] delivers them) are handed to the backup's own
/// stack. Build with [`HubReceiveSpec::tcp`].
///
/// ```text
/// table netdev unbroken-rx-eth0 {
///   comment "unbroken-owner:PID:START"
///   chain c { type filter hook ingress device "eth0" priority filter; policy accept;
///     ip daddr { 10.0.0.10 } tcp dport { 6379 } meta pkttype other counter meta pkttype set host comment "unbroken-owner:PID:START" }
/// }
/// ```
///
/// Nothing else addressed to the service address reaches the backup's stack: it would answer
/// it beside the primary (a second echo reply to every ping, a RST to a SYN for another port
/// the primary serves, ICMP port-unreachable for UDP). Non-first IP fragments carry no port and
/// are not handed over either.
///
/// IPv4 only for now: an IPv6 address is refused (the segment has no NDP counterpart of
/// [`ArpSuppress`] yet, so an IPv6 service address would be answered for by both hosts).
/// Owned, installed and removed like [`ArpSuppress`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubReceiveSpec {
    /// The nftables table (family `netdev`), by default `unbroken-rx-DEVICE`.
    pub table: String,
    /// The backup's segment device (its ingress is hooked).
    pub device: String,
    /// The service addresses: only frames to them are handed over. At least one; IPv4 only.
    pub addrs: Vec<std::net::IpAddr>,
    /// The replicated services' TCP ports (at least one, none 0): only TCP segments to them are
    /// handed over. `None`: TCP to every port of `addrs`, what the transitional
    /// [`HubReceiveSpec::new`] gives (still no ICMP, UDP or other protocol).
    pub ports: Option<Vec<u16>>,
    /// Run `nft` inside this named network namespace.
    pub netns: Option<String>,
    /// The `nft` binary.
    pub nft: String,
    /// The process the table belongs to ([`Owner::current`] by default).
    pub owner: Owner,
}

impl HubReceiveSpec {
    /// Hand TCP segments to `ports` of `addrs` arriving on `device` to this host's stack, in
    /// this namespace, owned by the calling process.
    pub fn tcp(
        device: impl Into<String>,
        addrs: impl IntoIterator<Item = std::net::IpAddr>,
        ports: impl IntoIterator<Item = u16>,
    ) -> HubReceiveSpec {
        let mut s = HubReceiveSpec::new(device, addrs);
        s.ports = Some(ports.into_iter().collect());
        s
    }

    /// Transitional, for callers that do not give the service ports yet: TCP to every port of
    /// `addrs` (a SYN for another port the primary serves still draws the backup's RST). Use
    /// [`HubReceiveSpec::tcp`].
    pub fn new(
        device: impl Into<String>,
        addrs: impl IntoIterator<Item = std::net::IpAddr>,
    ) -> HubReceiveSpec {
        let device = device.into();
        HubReceiveSpec {
            table: table_name("unbroken-rx", &device),
            device,
            addrs: addrs.into_iter().collect(),
            ports: None,
            netns: None,
            nft: "nft".into(),
            owner: Owner::current(),
        }
    }

    fn validate(&self) -> io::Result<()> {
        check_iface_name(&self.device)?;
        check_table_name(&self.table)?;
        if self.addrs.is_empty() {
            return Err(invalid("no service address to receive for".into()));
        }
        for a in &self.addrs {
            match a {
                std::net::IpAddr::V6(a) => {
                    return Err(io::Error::new(
                        io::ErrorKind::Unsupported,
                        format!(
                            "service address {a}: IPv6 is not supported on a replica segment yet \
                             (no neighbour-discovery suppression); use IPv4 service addresses"
                        ),
                    ))
                }
                v4 => check_unicast(*v4)?,
            }
        }
        match &self.ports {
            Some(p) if p.is_empty() => Err(invalid("no service port to receive for".into())),
            Some(p) if p.contains(&0) => Err(invalid("service port 0".into())),
            _ => Ok(()),
        }
    }

    /// The `nft -f` transaction that installs (or atomically replaces) the table. Addresses
    /// and ports are sorted and deduplicated (nft refuses a set with one element twice).
    fn ruleset(&self) -> String {
        let (t, d, tag) = (&self.table, &self.device, self.owner.tag());
        fn sorted<T: Ord + Clone + ToString>(v: &[T]) -> String {
            let mut v = v.to_vec();
            v.sort();
            v.dedup();
            v.iter().map(T::to_string).collect::<Vec<_>>().join(", ")
        }
        let set = sorted(&self.addrs);
        let tcp = match &self.ports {
            Some(p) => format!("tcp dport {{ {} }}", sorted(p)),
            None => "meta l4proto tcp".into(),
        };
        format!(
            "table netdev {t}\n\
             delete table netdev {t}\n\
             table netdev {t} {{\n\
             \x20 comment \"{tag}\"\n\
             \x20 chain c {{\n\
             \x20   type filter hook ingress device \"{d}\" priority filter; policy accept;\n\
             \x20   ip daddr {{ {set} }} {tcp} meta pkttype other counter meta pkttype set host comment \"{tag}\"\n\
             \x20 }}\n\
             }}\n"
        )
    }
}

owned_table! {
    /// An installed hand-over rule; removed by [`HubReceive::remove`] or on drop.
    HubReceive, HubReceiveSpec, "netdev"
}

impl HubReceive {
    /// Frames handed to the stack so far; `NotFound` when not installed.
    pub fn handed(spec: &HubReceiveSpec) -> io::Result<u64> {
        let t = spec.nft_table();
        let text = list_table(&t)?.ok_or_else(|| not_installed(&t))?;
        Ok(sum_counters(&text))
    }
}

/// `PREFIX-DEVICE` (characters nftables would not take in a name become `_`).
fn table_name(prefix: &str, device: &str) -> String {
    let d: String = device.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' || c == '-' { c } else { '_' }).collect();
    format!("{prefix}-{d}")
}

/// A service address must be one host's: not unspecified, broadcast, multicast or loopback.
fn check_unicast(a: std::net::IpAddr) -> io::Result<()> {
    let bad = a.is_unspecified() || a.is_multicast() || a.is_loopback() || a == std::net::IpAddr::V4(Ipv4Addr::BROADCAST);
    if bad {
        return Err(invalid(format!("{a} is not a unicast service address")));
    }
    Ok(())
}

/// The sum of every `counter packets N` of a listing.
fn sum_counters(listing: &str) -> u64 {
    listing
        .split("counter packets ")
        .skip(1)
        .filter_map(|r| r.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

fn check_table_name(t: &str) -> io::Result<()> {
    let ok = !t.is_empty()
        && t.len() <= 32
        && t.starts_with(|c: char| c.is_ascii_alphabetic())
        && t.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(invalid(format!(
            "bad nftables table name {t:?}: 1-32 characters of [A-Za-z0-9_-], starting with a letter"
        )))
    }
}

/// One nftables table and where to run `nft` for it.
struct NftTable<'a> {
    family: &'static str,
    name: &'a str,
    netns: Option<&'a str>,
    bin: &'a str,
}

fn not_installed(t: &NftTable) -> io::Error {
    io::Error::new(
        io::ErrorKind::NotFound,
        format!("no nftables table {} {}", t.family, t.name),
    )
}

/// Fails (`AddrInUse`) when the table exists and belongs to a running process other than `owner`.
fn check_owner(t: &NftTable, owner: Owner) -> io::Result<()> {
    match table_owner(t)? {
        Some(Some(o)) if o != owner && o.is_alive() => Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!(
                "nftables table {} {} belongs to {}, which still runs",
                t.family,
                t.name,
                o.describe()
            ),
        )),
        _ => Ok(()),
    }
}

/// Deletes the table when it is there and not another running process's; absent is no error.
fn delete_table(t: &NftTable, owner: Owner) -> io::Result<()> {
    check_owner(t, owner)?;
    if table_owner(t)?.is_none() {
        return Ok(());
    }
    match nft(t, &["delete", "table", t.family, t.name]) {
        // Deleted by someone else in between: what we wanted.
        Err(e) if e.to_string().contains("Error: No such file or directory") => Ok(()),
        r => r.map(drop),
    }
}

/// `None`: no such table; `Some(None)`: a table without an owner comment; `Some(Some(o))`.
fn table_owner(t: &NftTable) -> io::Result<Option<Option<Owner>>> {
    Ok(list_table(t)?.map(|l| parse_owner(&l)))
}

/// The table's own comment (the first line after `table ...`) read as an owner tag.
fn parse_owner(listing: &str) -> Option<Owner> {
    listing
        .lines()
        .map(str::trim)
        .skip_while(|l| !l.starts_with("table "))
        .nth(1)
        .and_then(|l| l.strip_prefix("comment "))
        .and_then(Owner::parse_tag)
}

fn parse_counters(listing: &str) -> ArpSuppressCounters {
    let mut c = ArpSuppressCounters::default();
    let mut chain = "";
    for l in listing.lines().map(str::trim) {
        if let Some(rest) = l.strip_prefix("chain ") {
            chain = if rest.starts_with("in ") {
                "in"
            } else if rest.starts_with("out ") {
                "out"
            } else {
                ""
            };
            continue;
        }
        let Some(after) = l.split_once("counter packets ").map(|(_, a)| a) else {
            continue;
        };
        let n: u64 = after
            .split_whitespace()
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        match chain {
            "in" => c.requests_dropped += n,
            "out" => c.announcements_dropped += n,
            _ => {}
        }
    }
    c
}

/// `nft list table arp NAME`: `None` when the table does not exist.
fn list_table(t: &NftTable) -> io::Result<Option<String>> {
    match nft(t, &["list", "table", t.family, t.name]) {
        Ok(s) => Ok(Some(s)),
        // nft's own "Error: No such file or directory" for a missing table; not `ip netns
        // exec`'s "exec of \"nft\" failed: No such file or directory" for a missing binary.
        Err(e)
            if e.kind() != io::ErrorKind::NotFound
                && e.to_string().contains("Error: No such file or directory")
                && !e.to_string().contains("exec of") =>
        {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

fn nft_command(t: &NftTable) -> Command {
    let mut c = match t.netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, t.bin]);
            c
        }
        None => Command::new(t.bin),
    };
    c.env("LC_ALL", "C");
    c
}

fn nft(t: &NftTable, a: &[&str]) -> io::Result<String> {
    let mut cmd = nft_command(t);
    cmd.args(a).stdin(Stdio::null());
    let out = cmd
        .output()
        .map_err(|e| io::Error::new(e.kind(), format!("running `{}`: {e}", describe(&cmd))))?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "`{}` failed ({}): {}",
            describe(&cmd),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn nft_stdin(t: &NftTable, text: &str) -> io::Result<()> {
    use std::io::Write;
    let mut cmd = nft_command(t);
    cmd.args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .map_err(|e| io::Error::new(e.kind(), format!("running `{}`: {e}", describe(&cmd))))?;
    child
        .stdin
        .take()
        .expect("piped")
        .write_all(text.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "`{}` failed ({}): {}\ninput:\n{text}",
            describe(&cmd),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

/// Sends gratuitous ARP for an address out of one Ethernet device (see the module docs).
#[derive(Debug)]
pub struct Announcer {
    fd: OwnedFd,
    ifindex: i32,
    mac: [u8; 6],
}

/// `ARPHRD_ETHER` from `linux/if_arp.h`.
const ARPHRD_ETHER: u16 = 1;

impl Announcer {
    /// Opens an `AF_PACKET` socket for `device` in the calling thread's network namespace and
    /// reads the device's MAC. A device that is not Ethernet is `Unsupported`. Needs `CAP_NET_RAW`.
    pub fn open(device: &str) -> io::Result<Announcer> {
        check_iface_name(device)?;
        let name = CString::new(device).map_err(|e| invalid(e.to_string()))?;
        // SAFETY: a valid NUL-terminated string.
        let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
        if ifindex == 0 {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(e.kind(), format!("device {device}: {e}")));
        }
        // Protocol 0: this socket only sends, it receives nothing.
        let fd = sys::socket(libc::AF_PACKET, libc::SOCK_RAW, 0)?;
        // SAFETY: zeroed ifreq is valid; the name fits (checked: at most 15 bytes).
        let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
        for (d, s) in ifr.ifr_name.iter_mut().zip(device.bytes()) {
            *d = s as libc::c_char;
        }
        // SAFETY: SIOCGIFHWADDR fills ifr_hwaddr of the live ifreq.
        sys::cvt(unsafe { libc::ioctl(fd.as_raw_fd(), libc::SIOCGIFHWADDR, &mut ifr) })?;
        // SAFETY: the ioctl above filled the hwaddr member of the union.
        let hw = unsafe { ifr.ifr_ifru.ifru_hwaddr };
        if hw.sa_family != ARPHRD_ETHER {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!(
                    "device {device} is not Ethernet (hardware type {})",
                    hw.sa_family
                ),
            ));
        }
        let mut mac = [0u8; 6];
        for (m, b) in mac.iter_mut().zip(hw.sa_data.iter()) {
            *m = *b as u8;
        }
        Ok(Announcer {
            fd,
            ifindex: ifindex as i32,
            mac,
        })
    }

    /// The device's MAC, the one the announcements name.
    pub fn mac(&self) -> [u8; 6] {
        self.mac
    }

    /// The two broadcast frames [`Announcer::announce`] sends for `ip` from `mac`: the
    /// gratuitous request, then the gratuitous reply.
    pub fn frames(mac: [u8; 6], ip: Ipv4Addr) -> [[u8; arp::MIN_FRAME_LEN]; 2] {
        [Operation::Request, Operation::Reply]
            .map(|op| Repr::gratuitous(op, mac, ip).to_frame(arp::BROADCAST, mac))
    }

    /// Broadcasts the gratuitous request and reply for `ip`.
    pub fn announce(&self, ip: Ipv4Addr) -> io::Result<()> {
        for f in Self::frames(self.mac, ip) {
            self.send(&f)?;
        }
        Ok(())
    }

    fn send(&self, frame: &[u8]) -> io::Result<()> {
        // SAFETY: zeroed sockaddr_ll is valid.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = arp::ETHERTYPE_ARP.to_be();
        sll.sll_ifindex = self.ifindex;
        sll.sll_halen = 6;
        sll.sll_addr[..6].copy_from_slice(&arp::BROADCAST);
        // SAFETY: a live buffer and a live sockaddr_ll of the size passed.
        let n = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                frame.as_ptr().cast(),
                frame.len(),
                0,
                (&sll as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n as usize != frame.len() {
            return Err(io::Error::other(format!(
                "short send: {n} of {} bytes",
                frame.len()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> ArpSuppressSpec {
        let mut s = ArpSuppressSpec::new("eth0", Ipv4Addr::new(10, 77, 3, 10));
        s.owner = Owner { pid: 7, start: 9 };
        s
    }

    #[test]
    fn ruleset_text() {
        let s = spec();
        assert_eq!(s.table, "unbroken-arp-eth0");
        assert_eq!(
            s.ruleset(),
            "table arp unbroken-arp-eth0\n\
             delete table arp unbroken-arp-eth0\n\
             table arp unbroken-arp-eth0 {\n  comment \"unbroken-owner:7:9\"\n  chain in {\n    type filter hook input priority filter; policy accept;\n    \
             iifname \"eth0\" arp operation request arp daddr ip 10.77.3.10 counter drop comment \"unbroken-owner:7:9\"\n  }\n  chain out {\n    \
             type filter hook output priority filter; policy accept;\n    oifname \"eth0\" arp saddr ip 10.77.3.10 counter drop comment \"unbroken-owner:7:9\"\n  }\n}\n"
        );
        assert_eq!(
            ArpSuppressSpec::table_name("br0.100"),
            "unbroken-arp-br0_100"
        );
    }

    #[test]
    fn hostile_specs() {
        assert!(spec().validate().is_ok());
        let bad = |f: &dyn Fn(&mut ArpSuppressSpec)| {
            let mut s = spec();
            f(&mut s);
            s.validate().unwrap_err().kind()
        };
        for d in ["", "eth0\" drop", "a b", "-x", "0123456789abcdef"] {
            assert_eq!(
                bad(&|s| s.device = d.into()),
                io::ErrorKind::InvalidInput,
                "{d:?}"
            );
        }
        for t in ["", "1abc", "a;flush ruleset", "a\"b", &"x".repeat(33)] {
            assert_eq!(
                bad(&|s| s.table = t.into()),
                io::ErrorKind::InvalidInput,
                "{t:?}"
            );
        }
        for a in ["0.0.0.0", "255.255.255.255", "224.0.0.1", "127.0.0.1"] {
            assert_eq!(
                bad(&|s| s.addr = a.parse().unwrap()),
                io::ErrorKind::InvalidInput,
                "{a}"
            );
        }
    }

    #[test]
    fn listing_is_read_back() {
        // What `nft list table arp ...` prints (nftables 1.0.6).
        let listing = "table arp unbroken-arp-eth0 {\n\
            \tcomment \"unbroken-owner:7:9\"\n\
            \tchain in {\n\t\ttype filter hook input priority filter; policy accept;\n\
            \t\tiifname \"eth0\" arp operation request arp daddr ip 10.77.3.10 counter packets 3 bytes 84 drop comment \"unbroken-owner:7:9\"\n\t}\n\n\
            \tchain out {\n\t\ttype filter hook output priority filter; policy accept;\n\
            \t\toifname \"eth0\" arp saddr ip 10.77.3.10 counter packets 1 bytes 28 drop comment \"unbroken-owner:7:9\"\n\t}\n}\n";
        assert_eq!(parse_owner(listing), Some(Owner { pid: 7, start: 9 }));
        assert_eq!(
            parse_counters(listing),
            ArpSuppressCounters {
                requests_dropped: 3,
                announcements_dropped: 1
            }
        );
        // A table without an owner comment (someone else's, or an older version): no owner.
        assert_eq!(
            parse_owner("table arp unbroken-arp-eth0 {\n\tchain in {\n"),
            None
        );
        assert_eq!(parse_counters(""), ArpSuppressCounters::default());
    }

    #[test]
    fn mirror_ruleset_and_specs() {
        let mut m = MirrorSpec::new("lan0", "bk0", "10.77.5.10".parse().unwrap());
        m.owner = Owner { pid: 7, start: 9 };
        assert_eq!(m.table, "unbroken-mirror-lan0");
        assert!(m.validate().is_ok());
        assert_eq!(
            m.ruleset(),
            "table netdev unbroken-mirror-lan0\ndelete table netdev unbroken-mirror-lan0\ntable netdev unbroken-mirror-lan0 {\n  \
             comment \"unbroken-owner:7:9\"\n  chain c {\n    type filter hook egress device \"lan0\" priority filter; policy accept;\n    \
             ip daddr 10.77.5.10 counter dup to \"bk0\" comment \"unbroken-owner:7:9\"\n  }\n}\n"
        );
        m.addr = "fd77:5::10".parse().unwrap();
        assert!(m.ruleset().contains("ip6 daddr fd77:5::10 counter dup"));
        let bad = |f: &dyn Fn(&mut MirrorSpec)| {
            let mut b = m.clone();
            f(&mut b);
            b.validate().unwrap_err().kind()
        };
        assert_eq!(
            bad(&|b| b.to = "lan0".into()),
            io::ErrorKind::InvalidInput,
            "to itself"
        );
        assert_eq!(
            bad(&|b| b.to = "bk0\" accept".into()),
            io::ErrorKind::InvalidInput
        );
        assert_eq!(
            bad(&|b| b.table = "x;flush ruleset".into()),
            io::ErrorKind::InvalidInput
        );
        assert_eq!(
            bad(&|b| b.addr = "::".parse().unwrap()),
            io::ErrorKind::InvalidInput
        );
        assert_eq!(
            bad(&|b| b.addr = "255.255.255.255".parse().unwrap()),
            io::ErrorKind::InvalidInput
        );
    }

    #[test]
    fn hub_receive_ruleset_and_specs() {
        let ip = |s: &str| s.parse::<std::net::IpAddr>().unwrap();
        let mut h = HubReceiveSpec::tcp(
            "eth0",
            [ip("10.77.3.20"), ip("10.77.3.10"), ip("10.77.3.20")],
            [7000, 6379, 7000],
        );
        h.owner = Owner { pid: 7, start: 9 };
        assert_eq!(h.table, "unbroken-rx-eth0");
        assert!(h.validate().is_ok());
        assert_eq!(
            h.ruleset(),
            "table netdev unbroken-rx-eth0\ndelete table netdev unbroken-rx-eth0\ntable netdev unbroken-rx-eth0 {\n  \
             comment \"unbroken-owner:7:9\"\n  chain c {\n    type filter hook ingress device \"eth0\" priority filter; policy accept;\n    \
             ip daddr { 10.77.3.10, 10.77.3.20 } tcp dport { 6379, 7000 } meta pkttype other counter meta pkttype set host comment \"unbroken-owner:7:9\"\n  }\n}\n"
        );
        assert_eq!(
            HubReceiveSpec::tcp("a.b", [ip("10.0.0.1")], [1]).table,
            "unbroken-rx-a_b"
        );
        // The transitional constructor: TCP only, every port.
        let mut any = HubReceiveSpec::new("eth0", [ip("10.77.3.10")]);
        any.owner = h.owner;
        assert!(any.validate().is_ok());
        assert!(
            any.ruleset().contains(
                "ip daddr { 10.77.3.10 } meta l4proto tcp meta pkttype other counter meta pkttype set host"
            ),
            "{}",
            any.ruleset()
        );
        let bad = |f: &dyn Fn(&mut HubReceiveSpec)| {
            let mut b = h.clone();
            f(&mut b);
            b.validate().unwrap_err()
        };
        let e = bad(&|b| b.addrs.push(ip("fd77:3::10")));
        assert_eq!(e.kind(), io::ErrorKind::Unsupported);
        assert!(
            e.to_string().contains("fd77:3::10") && e.to_string().contains("IPv6"),
            "{e}"
        );
        assert_eq!(
            bad(&|b| b.addrs.clear()).kind(),
            io::ErrorKind::InvalidInput
        );
        assert_eq!(
            bad(&|b| b.ports = Some(vec![])).kind(),
            io::ErrorKind::InvalidInput
        );
        assert_eq!(
            bad(&|b| b.ports = Some(vec![6379, 0])).kind(),
            io::ErrorKind::InvalidInput
        );
        for a in ["0.0.0.0", "255.255.255.255", "224.0.0.1", "127.0.0.1"] {
            assert_eq!(
                bad(&|b| b.addrs = vec![ip(a)]).kind(),
                io::ErrorKind::InvalidInput,
                "{a}"
            );
        }
        assert_eq!(
            bad(&|b| b.device = "eth0\" accept".into()).kind(),
            io::ErrorKind::InvalidInput
        );
        assert_eq!(
            bad(&|b| b.table = "x;flush ruleset".into()).kind(),
            io::ErrorKind::InvalidInput
        );
        // What `nft list table netdev ...` prints (nftables 1.0.6).
        let listing = "table netdev unbroken-rx-eth0 {\n\tcomment \"unbroken-owner:7:9\"\n\tchain c {\n\
            \t\ttype filter hook ingress device \"eth0\" priority filter; policy accept;\n\
            \t\tip daddr { 10.77.3.10, 10.77.3.20 } tcp dport { 6379, 7000 } meta pkttype other counter packets 12 bytes 840 meta pkttype set host comment \"unbroken-owner:7:9\"\n\t}\n}\n";
        assert_eq!(parse_owner(listing), Some(Owner { pid: 7, start: 9 }));
        assert_eq!(sum_counters(listing), 12);
    }

    #[test]
    fn announcement_frames() {
        let mac = [0x02, 0, 0, 0, 0, 0x12];
        let ip = Ipv4Addr::new(10, 77, 3, 10);
        let [req, rep] = Announcer::frames(mac, ip);
        let head = [
            0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02, 0, 0, 0, 0, 0x12, 0x08, 0x06, 0, 1, 0x08, 0,
            6, 4,
        ];
        assert_eq!(req[..20], head);
        assert_eq!(
            req[20..42],
            [0, 1, 0x02, 0, 0, 0, 0, 0x12, 10, 77, 3, 10, 0, 0, 0, 0, 0, 0, 10, 77, 3, 10]
        );
        assert_eq!(rep[..20], head);
        assert_eq!(
            rep[20..42],
            [0, 2, 0x02, 0, 0, 0, 0, 0x12, 10, 77, 3, 10, 0x02, 0, 0, 0, 0, 0x12, 10, 77, 3, 10]
        );
        assert!(req[42..].iter().chain(&rep[42..]).all(|&b| b == 0));
    }
}
