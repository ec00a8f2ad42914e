//! TOML configuration of `unbroken guard` (checkpoint mode).
//!
//! ```toml
//! [guard]
//! queue = 7                         # NFQUEUE number
//! placement = "gateway"             # "gateway" (FORWARD) or "local" (OUTPUT + INPUT on the app's host)
//! app_interface = "lan0"            # gateway only: the leg toward the application hosts
//! control = ["10.77.2.1:7900"]      # UDP side-channel listen addresses
//! key = "00112233445566778899aabbccddeeff"   # shared key, hex (or key_file = "/etc/unbroken/key")
//! allowed_sources = ["10.77.2.0/24"] # who may send commands
//! status_file = "/run/unbroken/guard.json"
//! fast_path = true                  # gateway: established packets stay in the kernel (tc-BPF)
//!
//! [[service]]                        # protected endpoints (the application A)
//! addr = "10.77.2.10"
//! port = 7000
//! ```

use serde::Deserialize;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use unbroken_wire::ctl::Key;
use crate::service::Service;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Placement {
    /// On a router between the application hosts and their peers: the FORWARD chain.
    Gateway,
    /// On the application's own host: OUTPUT and INPUT chains.
    Local,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuardSection {
    pub queue: u16,
    pub placement: Placement,
    /// With `placement = "gateway"` (required there, refused otherwise): the interface toward
    /// the application hosts. Packets from a service are queued only when they arrive on it,
    /// packets to a service only when they leave through it; a packet with a service's source
    /// arriving on any other interface is forged and dropped (issue 9, item 1).
    #[serde(default)]
    pub app_interface: Option<String>,
    pub control: Vec<SocketAddr>,
    #[serde(default)]
    pub key: Option<String>,
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    pub allowed_sources: Vec<String>,
    #[serde(default)]
    pub status_file: Option<PathBuf>,
    /// Where the side channel's replay high-water marks survive a restart (issue 21, item 5;
    /// `guard::ReplayFloor`). Default: `status_file` + ".replay"; with neither, a command
    /// captured before a restart can be replayed once to the new guard within the clock window.
    /// On persistent storage it also covers a host reboot.
    #[serde(default)]
    pub replay_file: Option<PathBuf>,
    /// Mark put on packets the guard injects, so its rules skip them.
    #[serde(default = "default_mark")]
    pub injection_mark: u32,
    /// Carry established, unremarkable packets in the kernel (tc-BPF, issue 22; gateway
    /// placement): only what needs a decision reaches the queue. On by default; off, or when the
    /// kernel or the placement cannot, every protected packet goes through the queue (the
    /// guard says why in one line at start and in its status).
    #[serde(default = "default_true")]
    pub fast_path: bool,
    /// Let traffic bypass the queue while no guard is bound (`--queue-bypass`). Off by default:
    /// a recovered connection's packets must be renumbered, so bypassing cannot keep them alive.
    #[serde(default)]
    pub queue_bypass: bool,
    /// Seconds a connection closed in both directions is remembered (the guard's TIME-WAIT).
    #[serde(default = "default_grace")]
    pub closed_grace_secs: u64,
    /// Upper bound on remembered connections; the longest-idle are forgotten beyond it (a
    /// forgotten live connection is recovered through the application, section 2.5).
    #[serde(default = "default_max_conns")]
    pub max_connections: usize,
    /// Accepted clock difference for commands (replay window), milliseconds.
    #[serde(default = "default_skew")]
    pub max_clock_skew_ms: u64,
    /// After a recovery, send the peer an ACK with a SACK block of its last segment when the
    /// application TELLs, so it resends what the dead socket lost at once instead of at its
    /// retransmission timeout (see `guard::nudge`). Experimental, off by default: bulk streams
    /// hung in 2 of about 40 lab runs with it (docs/benchmarks.md).
    #[serde(default)]
    pub recovery_nudge: bool,
    /// A connection this guard never saw begin (it restarted, or forgot it) and that no
    /// application claimed (no command named it, no recovery was announced) for this many
    /// seconds after the guard first saw it ends when the application's host resets it: the
    /// host's RST passes to the peer instead of being dropped (O1). That ends the double fault
    /// of an application dying before its first TELL and the guard restarting before it is
    /// back visibly (issue 21, item 4); an application holding a record of such a connection
    /// that restarts slower than this loses it, and so does a live application that does not
    /// touch a connection for this long after the guard restarted (O6 reset its socket; it
    /// recovers at its next call). 0: never (the peer waits for its own timeout).
    #[serde(default = "default_unclaimed_reset")]
    pub unclaimed_reset_secs: u64,
}

/// Upper bounds of the numeric settings (see [`Guard::from_toml`]).
pub const MAX_GRACE_SECS: u64 = 86_400;
pub const MAX_SKEW_MS: u64 = 3_600_000;
pub const MAX_CONNECTIONS: usize = 1 << 24;

fn default_true() -> bool {
    true
}

fn default_mark() -> u32 {
    0x7562_0001
}
fn default_grace() -> u64 {
    60
}
fn default_unclaimed_reset() -> u64 {
    120
}
fn default_max_conns() -> usize {
    1 << 20
}
fn default_skew() -> u64 {
    30_000
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuardConfig {
    pub guard: GuardSection,
    #[serde(rename = "service")]
    pub services: Vec<Service>,
}

/// An IP prefix such as 10.77.2.0/24 or fd77::/32 (a bare address means a single host).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefix {
    pub addr: IpAddr,
    pub len: u8,
}

impl Prefix {
    pub fn parse(s: &str) -> Result<Prefix, String> {
        let (a, l) = match s.split_once('/') {
            Some((a, l)) => (a, Some(l)),
            None => (s, None),
        };
        let addr: IpAddr = a.trim().parse().map_err(|_| format!("bad address in prefix {s:?}"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let len = match l {
            Some(l) => l.trim().parse::<u8>().map_err(|_| format!("bad prefix length in {s:?}"))?,
            None => max,
        };
        if len > max {
            return Err(format!("prefix length {len} too long in {s:?}"));
        }
        Ok(Prefix { addr, len })
    }
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
            v4 => v4,
        };
        match (self.addr, ip) {
            (IpAddr::V4(p), IpAddr::V4(a)) => {
                let mask = if self.len == 0 { 0 } else { u32::MAX << (32 - self.len) };
                u32::from(p) & mask == u32::from(a) & mask
            }
            (IpAddr::V6(p), IpAddr::V6(a)) => {
                let mask = if self.len == 0 { 0 } else { u128::MAX << (128 - self.len) };
                u128::from(p) & mask == u128::from(a) & mask
            }
            _ => false,
        }
    }
}

/// A validated configuration: every problem is reported with what to fix.
pub struct Guard {
    pub raw: GuardConfig,
    pub key: Key,
    pub allowed: Vec<Prefix>,
}

impl Guard {
    pub fn from_toml(text: &str) -> Result<Guard, String> {
        let raw: GuardConfig = toml::from_str(text).map_err(|e| format!("config: {e}"))?;
        let key = match (&raw.guard.key, &raw.guard.key_file) {
            (Some(k), None) => Key::from_hex(k).map_err(|e| format!("config: guard.key: {e} (give at least 32 hex digits)"))?,
            (None, Some(p)) => {
                let t = std::fs::read_to_string(p).map_err(|e| format!("config: guard.key_file {}: {e}", p.display()))?;
                Key::from_hex(t.trim()).map_err(|e| format!("config: guard.key_file {}: {e}", p.display()))?
            }
            _ => return Err("config: give exactly one of guard.key and guard.key_file".into()),
        };
        if raw.services.is_empty() {
            return Err("config: at least one [[service]] (addr, port) to protect is required".into());
        }
        if raw.guard.control.is_empty() {
            return Err("config: guard.control needs at least one UDP address to listen on".into());
        }
        if raw.guard.allowed_sources.is_empty() {
            return Err("config: guard.allowed_sources is empty: no application could send commands".into());
        }
        // Bounds on every number, so that no later arithmetic on them can overflow (issue 9,
        // item 11): a wrong value is a precise error, never a wrapped one.
        let g = &raw.guard;
        if g.closed_grace_secs > MAX_GRACE_SECS {
            return Err(format!("config: guard.closed_grace_secs = {}: at most {MAX_GRACE_SECS} (a day)", g.closed_grace_secs));
        }
        if g.unclaimed_reset_secs > MAX_GRACE_SECS {
            return Err(format!("config: guard.unclaimed_reset_secs = {}: at most {MAX_GRACE_SECS} (a day; 0 = never)", g.unclaimed_reset_secs));
        }
        if g.max_clock_skew_ms == 0 || g.max_clock_skew_ms > MAX_SKEW_MS {
            return Err(format!("config: guard.max_clock_skew_ms = {}: 1 to {MAX_SKEW_MS} (an hour)", g.max_clock_skew_ms));
        }
        if g.max_connections == 0 || g.max_connections > MAX_CONNECTIONS {
            return Err(format!("config: guard.max_connections = {}: 1 to {MAX_CONNECTIONS}", g.max_connections));
        }
        match (raw.guard.placement, &raw.guard.app_interface) {
            (Placement::Gateway, None) => {
                return Err("config: guard.app_interface is required with placement = \"gateway\": name the interface toward the application hosts (packets from a service are queued only when they arrive on it; one with a service's address arriving from the peers' side is forged and dropped)".into())
            }
            (Placement::Gateway, Some(i)) => unbroken_drivers::iptables::check_iface_name(i).map_err(|e| format!("config: guard.app_interface: {e}"))?,
            (Placement::Local, Some(_)) => {
                return Err("config: guard.app_interface is for placement = \"gateway\" only (on the application's host the kernel refuses packets from the wire with a local source address)".into())
            }
            (Placement::Local, None) => {}
        }
        let allowed = raw.guard.allowed_sources.iter().map(|s| Prefix::parse(s).map_err(|e| format!("config: allowed_sources: {e}"))).collect::<Result<Vec<_>, _>>()?;
        Ok(Guard { raw, key, allowed })
    }
    pub fn load(path: &std::path::Path) -> Result<Guard, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("config {}: {e}", path.display()))?;
        Guard::from_toml(&text)
    }
    /// The replay file in effect: `replay_file`, else `status_file` + ".replay".
    pub fn replay_file(&self) -> Option<PathBuf> {
        let g = &self.raw.guard;
        g.replay_file.clone().or_else(|| {
            g.status_file.as_ref().map(|p| {
                let mut s = p.clone().into_os_string();
                s.push(".replay");
                PathBuf::from(s)
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[guard]
queue = 7
placement = "gateway"
app_interface = "lan0"
control = ["10.77.2.1:7900"]
key = "00112233445566778899aabbccddeeff"
allowed_sources = ["10.77.2.0/24", "fd77:2::/64"]

[[service]]
addr = "10.77.2.10"
port = 7000
"#;

    #[test]
    fn parses_and_validates() {
        let g = Guard::from_toml(GOOD).unwrap();
        assert_eq!(g.raw.guard.placement, Placement::Gateway);
        assert_eq!(g.raw.services[0].port, 7000);
        assert!(g.allowed[0].contains("10.77.2.11".parse().unwrap()));
        assert!(!g.allowed[0].contains("10.77.1.2".parse().unwrap()));
        assert!(g.allowed[1].contains("fd77:2::12".parse().unwrap()));
        assert_eq!(g.raw.guard.closed_grace_secs, 60);
        assert_eq!(g.raw.guard.unclaimed_reset_secs, 120);
        // The replay file (issue 21, item 5): explicit, else beside the status file, else none.
        assert_eq!(g.replay_file(), None);
        let s = GOOD.replace("allowed_sources", "status_file = \"/run/unbroken/guard.json\"\nallowed_sources");
        assert_eq!(Guard::from_toml(&s).unwrap().replay_file(), Some("/run/unbroken/guard.json.replay".into()));
        let r = s.replace("allowed_sources", "replay_file = \"/var/lib/unbroken/guard.replay\"\nallowed_sources");
        assert_eq!(Guard::from_toml(&r).unwrap().replay_file(), Some("/var/lib/unbroken/guard.replay".into()));
    }

    #[test]
    fn broken_configs_get_clear_errors() {
        let e = Guard::from_toml(&GOOD.replace("key = \"00112233445566778899aabbccddeeff\"", "key = \"0011\"")).err().unwrap();
        assert!(e.contains("guard.key"), "{e}");
        let e = Guard::from_toml(&GOOD.replace("placement = \"gateway\"", "placement = \"moon\"")).err().unwrap();
        assert!(e.contains("placement") || e.contains("variant"), "{e}");
        let e = Guard::from_toml(&GOOD.replace("10.77.2.0/24", "10.77.2.0/99")).err().unwrap();
        assert!(e.contains("too long"), "{e}");
        let e = Guard::from_toml(&GOOD.replace("[[service]]\naddr = \"10.77.2.10\"\nport = 7000\n", "service = []\n")).err().unwrap();
        assert!(e.contains("service"), "{e}");
        let e = Guard::from_toml("[guard]\nqueue = \"x\"").err().unwrap();
        assert!(e.starts_with("config:"), "{e}");
        let e = Guard::from_toml(&GOOD.replace("queue = 7", "queue = 7\nbogus = 1")).err().unwrap();
        assert!(e.contains("bogus"), "{e}");
    }

    #[test]
    fn hostile_huge_numbers_are_refused_not_wrapped() {
        // Issue 9 item 11: closed_grace_secs * 1000 wrapped to a tiny grace in release builds.
        for (field, value, want) in [
            ("closed_grace_secs", "9223372036854775807", "guard.closed_grace_secs"),
            ("closed_grace_secs", "18446744073709552", "guard.closed_grace_secs"),
            ("max_clock_skew_ms", "9223372036854775807", "guard.max_clock_skew_ms"),
            ("max_clock_skew_ms", "0", "guard.max_clock_skew_ms"),
            ("max_connections", "9223372036854775807", "guard.max_connections"),
            ("max_connections", "0", "guard.max_connections"),
            ("unclaimed_reset_secs", "86401", "guard.unclaimed_reset_secs"),
            ("unclaimed_reset_secs", "18446744073709552", "guard.unclaimed_reset_secs"),
        ] {
            let e = Guard::from_toml(&GOOD.replace("queue = 7", &format!("queue = 7\n{field} = {value}"))).err().unwrap_or_else(|| panic!("{field} = {value} accepted"));
            assert!(e.contains(want), "{field} = {value}: {e}");
        }
        // Out of the type's range at all: toml's own error, still an error.
        for (field, value) in [("queue", "65536"), ("injection_mark", "4294967296"), ("closed_grace_secs", "-1"), ("closed_grace_secs", "1e30")] {
            let e = Guard::from_toml(&GOOD.replace("queue = 7", &format!("queue = 7\n{field} = {value}")).replacen("queue = 7\nqueue = 65536", "queue = 65536", 1)).err().unwrap_or_else(|| panic!("{field} = {value} accepted"));
            assert!(e.starts_with("config:"), "{e}");
        }
        let g = Guard::from_toml(&GOOD.replace("queue = 7", "queue = 7\nclosed_grace_secs = 86400")).unwrap();
        assert_eq!(g.raw.guard.closed_grace_secs, MAX_GRACE_SECS);
    }

    #[test]
    fn hostile_gateway_without_or_with_a_wrong_app_interface() {
        // Issue 9 item 1: a gateway guard without the application side would queue packets
        // forged on the peers' side with a service's source as the application's.
        let e = Guard::from_toml(&GOOD.replace("app_interface = \"lan0\"\n", "")).err().unwrap();
        assert!(e.contains("guard.app_interface is required"), "{e}");
        for bad in ["lan0 -j ACCEPT", "-i", "eth+", "0123456789abcdef", ""] {
            let e = Guard::from_toml(&GOOD.replace("\"lan0\"", &format!("{bad:?}"))).err().unwrap();
            assert!(e.contains("guard.app_interface") && e.contains("bad interface name"), "{bad}: {e}");
        }
        let local = GOOD.replace("placement = \"gateway\"", "placement = \"local\"");
        let e = Guard::from_toml(&local).err().unwrap();
        assert!(e.contains("gateway\" only"), "{e}");
        assert!(Guard::from_toml(&local.replace("app_interface = \"lan0\"\n", "")).is_ok());
    }
}
