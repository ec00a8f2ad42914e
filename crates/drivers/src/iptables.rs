//! The `iptables`/`ip6tables` rules that steer a guard's traffic into its NFQUEUE.
//!
//! Each guard instance owns one chain (e.g. `UNBROKEN-Q0`) in each address family it protects:
//!
//! ```text
//! -N UNBROKEN-Q0
//! -A UNBROKEN-Q0 -m mark --mark 0x4242/0xffffffff -m comment --comment unbroken-owner:PID:START -j RETURN
//! -A UNBROKEN-Q0 -p tcp -s 10.0.0.2 --sport 80 [-i APP_IF] -m comment --comment ... -j NFQUEUE --queue-num 0 [--queue-bypass]
//! -A UNBROKEN-Q0 -p tcp -s 10.0.0.2 --sport 80 -m comment --comment ... -j DROP       # only with APP_IF
//! -A UNBROKEN-Q0 -p tcp -d 10.0.0.2 --dport 80 [-o APP_IF] -m comment --comment ... -j NFQUEUE --queue-num 0 [--queue-bypass]
//! -I FORWARD 1 -j UNBROKEN-Q0                                        # one per built-in chain
//! ```
//!
//! **Direction.** With [`RuleSpec::app_iface`] (a gateway's leg toward the protected services)
//! a packet *from* a service is queued only when it arrives on that interface and a packet *to*
//! a service only when it leaves through it; any other packet carrying a service's source
//! address and port came from the wrong side, so it is forged, and is dropped (counted by the
//! rule's packet counter, `iptables -t mangle -L CHAIN -v`). Without it (a guard on the
//! application's own host, OUTPUT and INPUT) the kernel itself refuses packets that arrive from
//! the wire with a local source address (martian source, `accept_local=0`).
//!
//! **Ownership.** Every rule of the chain carries a comment naming the process that installed
//! it ([`Owner`]: its pid and its start time, so a reused pid is not taken for it). Installing,
//! replacing and removing first read the chain: one that belongs to another process that still
//! runs is never touched (the error names that process); one left by a process that is gone
//! (a daemon that stopped or crashed and deliberately left its rules, or an older version
//! without comments) is taken over. Only exact jumps to the chain are ever deleted from the
//! built-in chains, so rules of other tools there are never touched.
//!
//! **Table.** The default is `mangle`: it is the table meant for rules whose packets get
//! altered; on every hook it runs before `filter` (priority -150 against 0), so the guard sees
//! packets before firewall policy or `filter`-table managers (Docker, libvirt, firewalld's
//! iptables backend) that insert their own `ACCEPT`s at the top of `FORWARD`; and it also
//! offers PREROUTING/POSTROUTING. It runs after conntrack and, on OUTPUT, before `nat`, so on
//! the application's host the guard sees original destinations. [`Table::Filter`] is there
//! for setups that reserve `mangle`.
//!
//! **Crash safety.** [`Rules::install`] first removes whatever a previous run (no longer
//! running) left under the same chain name (jumps from every built-in chain of the table, then
//! the chain) in both families, so installing is idempotent. [`Rules::remove`] and `Drop` undo an installation.
//! Commands run with `-w 30` so concurrent iptables users wait for the lock (up to 30 s)
//! instead of failing.

use std::ffi::OsString;
use std::io;
use std::net::IpAddr;
use std::process::{Command, Output};

/// The table the chain lives in. See the module documentation for the default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Table {
    /// `-t mangle` (default).
    #[default]
    Mangle,
    /// `-t filter`; has no PREROUTING/POSTROUTING.
    Filter,
}

impl Table {
    /// The name passed to `-t`.
    pub fn as_str(self) -> &'static str {
        match self {
            Table::Mangle => "mangle",
            Table::Filter => "filter",
        }
    }

    /// The built-in chains of this table.
    pub fn builtin_chains(self) -> &'static [BuiltinChain] {
        use BuiltinChain::*;
        match self {
            Table::Mangle => &[Prerouting, Input, Forward, Output, Postrouting],
            Table::Filter => &[Input, Forward, Output],
        }
    }
}

/// A built-in chain to jump from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BuiltinChain {
    Prerouting,
    /// Packets to a local address (a guard on the application's own host).
    Input,
    /// Routed packets (a guard on a gateway).
    Forward,
    /// Locally generated packets (a guard on the application's own host).
    Output,
    Postrouting,
}

impl BuiltinChain {
    /// The chain's iptables name.
    pub fn as_str(self) -> &'static str {
        match self {
            BuiltinChain::Prerouting => "PREROUTING",
            BuiltinChain::Input => "INPUT",
            BuiltinChain::Forward => "FORWARD",
            BuiltinChain::Output => "OUTPUT",
            BuiltinChain::Postrouting => "POSTROUTING",
        }
    }
}

/// Transport protocol of a protected service.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Proto {
    #[default]
    Tcp,
    Udp,
}

impl Proto {
    fn as_str(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        }
    }
}

/// A protected service: traffic from and to `addr:port` is queued. An unspecified address
/// (`0.0.0.0` or `::`) matches every address of its family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Service {
    pub addr: IpAddr,
    pub port: u16,
    pub proto: Proto,
}

impl Service {
    /// A TCP service.
    pub fn tcp(addr: IpAddr, port: u16) -> Service {
        Service {
            addr,
            port,
            proto: Proto::Tcp,
        }
    }

    /// A UDP service.
    pub fn udp(addr: IpAddr, port: u16) -> Service {
        Service {
            addr,
            port,
            proto: Proto::Udp,
        }
    }
}

/// The process an installation belongs to: its pid and its start time (clock ticks after boot,
/// field 22 of `/proc/PID/stat`), so that a pid reused by another process is not taken for
/// the owner. Processes compared this way must share a pid namespace (they share the network
/// namespace whose rules they manage).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Owner {
    pub pid: u32,
    /// 0 when `/proc` could not be read; such an owner is alive while its pid exists.
    pub start: u64,
}

const OWNER_PREFIX: &str = "unbroken-owner:";

impl Owner {
    /// The calling process.
    pub fn current() -> Owner {
        let pid = std::process::id();
        Owner { pid, start: start_time(pid).unwrap_or(0) }
    }

    /// Another running process (for tests and tools); `None` when it does not exist.
    pub fn of_pid(pid: u32) -> Option<Owner> {
        start_time(pid).map(|start| Owner { pid, start })
    }

    /// Whether this process still runs (a zombie, killed but not reaped yet, does not: it
    /// has closed its sockets and holds nothing any more).
    pub fn is_alive(&self) -> bool {
        if self.start == 0 {
            // SAFETY: signal 0 only checks that the pid exists.
            let r = unsafe { libc::kill(self.pid as libc::pid_t, 0) };
            return r == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
        }
        proc_stat(self.pid).is_some_and(|(state, start)| start == self.start && !matches!(state, 'Z' | 'X' | 'x'))
    }

    /// The comment put on every rule: `unbroken-owner:PID:START` (no spaces or quotes, so it
    /// reads back the same from `iptables -S` with either backend).
    pub fn tag(&self) -> String {
        format!("{OWNER_PREFIX}{}:{}", self.pid, self.start)
    }

    /// Reads a [`Owner::tag`] back.
    pub fn parse_tag(s: &str) -> Option<Owner> {
        let rest = s.trim_matches('"').strip_prefix(OWNER_PREFIX)?;
        let (pid, start) = rest.split_once(':')?;
        Some(Owner { pid: pid.parse().ok()?, start: start.parse().ok()? })
    }

    /// `pid 1234 (unbroken guard --config /etc/g.toml)`, as far as `/proc` tells.
    pub fn describe(&self) -> String {
        let cmd = std::fs::read(format!("/proc/{}/cmdline", self.pid))
            .map(|b| {
                b.split(|&c| c == 0)
                    .filter(|a| !a.is_empty())
                    .map(|a| String::from_utf8_lossy(a).into_owned())
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .unwrap_or_default();
        if cmd.is_empty() {
            format!("pid {}", self.pid)
        } else {
            format!("pid {} ({cmd})", self.pid)
        }
    }
}

/// Field 22 of `/proc/PID/stat`, the start time.
fn start_time(pid: u32) -> Option<u64> {
    proc_stat(pid).map(|(_, start)| start)
}

/// Fields 3 (state) and 22 (start time) of `/proc/PID/stat`.
fn proc_stat(pid: u32) -> Option<(char, u64)> {
    crate::procfs::stat(pid).map(|s| (s.state, s.start))
}

/// What to install. Build with [`RuleSpec::new`] and adjust the public fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleSpec {
    /// The guard's own chain, e.g. from [`RuleSpec::chain_name`]. At most 28 characters of
    /// `[A-Za-z0-9_.-]`, not starting with `-`.
    pub chain: String,
    /// Table of the chain and the jumps.
    pub table: Table,
    /// Built-in chains that jump to the guard's chain: `[Forward]` on a gateway, `[Input,
    /// Output]` on the application's own host.
    pub hooks: Vec<BuiltinChain>,
    /// Services whose traffic is queued. Each family with at least one service gets a chain.
    pub services: Vec<Service>,
    /// `--queue-num`.
    pub queue_num: u16,
    /// Add `--queue-bypass`: accept instead of drop while no consumer is bound.
    pub queue_bypass: bool,
    /// Mark of the guard's injected packets (must be nonzero): matching packets `RETURN`.
    pub mark: u32,
    /// Mask for the mark match (`--mark mark/mask`); `0xffffffff` for an exact match.
    pub mark_mask: u32,
    /// A mark bit a fast path sets on packets it decided (issue 22): such a packet `RETURN`s
    /// before the queue rules (`--mark bit/bit`).
    pub fast_mark: Option<u32>,
    /// Pinned BPF socket filters that choose which packets of a service the queue rules
    /// take (`-m bpf --object-pinned`, issue 22): the first on packets *to* a service (its
    /// clients'), the second on packets *from* it. The rest pass the chain untouched. `None`:
    /// every packet of a service is queued.
    pub bpf_match: Option<(std::path::PathBuf, std::path::PathBuf)>,
    /// Run the commands inside this named network namespace (`ip netns exec NAME ...`).
    pub netns: Option<String>,
    /// IPv4 binary, `iptables` by default (e.g. `iptables-legacy`).
    pub iptables: String,
    /// IPv6 binary, `ip6tables` by default.
    pub ip6tables: String,
    /// The interface toward the services (a gateway's application-side leg): packets from a
    /// service are queued only when they arrive on it, packets to a service only when they
    /// leave through it, and other packets with a service's source are dropped as forged. Only
    /// with FORWARD hooks (`-i`/`-o` mean nothing in INPUT/OUTPUT respectively).
    pub app_iface: Option<String>,
    /// The process these rules belong to ([`Owner::current`] by default).
    pub owner: Owner,
}

impl RuleSpec {
    /// A spec for `chain` in `mangle`, with no hooks or services yet, no bypass, an exact mark
    /// match and the default binaries.
    pub fn new(chain: impl Into<String>, queue_num: u16, mark: u32) -> RuleSpec {
        RuleSpec {
            chain: chain.into(),
            table: Table::Mangle,
            hooks: Vec::new(),
            services: Vec::new(),
            queue_num,
            queue_bypass: false,
            mark,
            mark_mask: u32::MAX,
            fast_mark: None,
            bpf_match: None,
            netns: None,
            iptables: "iptables".into(),
            ip6tables: "ip6tables".into(),
            app_iface: None,
            owner: Owner::current(),
        }
    }

    /// The chain name for guard instance `instance`: `prefix` followed by the number, e.g.
    /// `chain_name("UNBROKEN-Q", 3) == "UNBROKEN-Q3"`.
    pub fn chain_name(prefix: &str, instance: u32) -> String {
        format!("{prefix}{instance}")
    }

    fn validate(&self) -> io::Result<()> {
        let c = &self.chain;
        let ok_chars = c
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
        if c.is_empty() || c.len() > 28 || c.starts_with('-') || !ok_chars {
            return Err(invalid(format!(
                "bad chain name {c:?}: 1-28 characters of [A-Za-z0-9_.-], not starting with '-'"
            )));
        }
        if self.table.builtin_chains().iter().any(|b| b.as_str() == c) {
            return Err(invalid(format!("chain name {c:?} is a built-in chain")));
        }
        if self.hooks.is_empty() {
            return Err(invalid("no built-in chain to jump from".into()));
        }
        if let Some(h) = self
            .hooks
            .iter()
            .find(|h| !self.table.builtin_chains().contains(h))
        {
            return Err(invalid(format!(
                "table {} has no {} chain",
                self.table.as_str(),
                h.as_str()
            )));
        }
        if self.services.is_empty() {
            return Err(invalid("no service to protect".into()));
        }
        if self.fast_mark.is_some_and(|b| b == 0 || b & (b - 1) != 0) {
            return Err(invalid(format!("fast-path mark {:#x}: must be one bit", self.fast_mark.unwrap_or(0))));
        }
        if let Some((a, b)) = &self.bpf_match {
            if let Some(p) = [a, b].into_iter().find(|p| !p.is_absolute() || p.to_str().is_none_or(|s| s.chars().any(|c| c.is_whitespace() || c.is_control()))) {
                return Err(invalid(format!("bpf match {}: must be an absolute path without spaces", p.display())));
            }
        }
        if self.mark & self.mark_mask == 0 {
            return Err(invalid(
                "the injection mark must be nonzero under its mask".into(),
            ));
        }
        if let Some(i) = &self.app_iface {
            check_iface_name(i)?;
            if let Some(h) = self.hooks.iter().find(|h| **h != BuiltinChain::Forward) {
                return Err(invalid(format!(
                    "an application-side interface ({i}) needs FORWARD hooks only (a gateway), not {}",
                    h.as_str()
                )));
            }
        }
        Ok(())
    }

    /// The families that have services, in a fixed order.
    fn families(&self) -> Vec<Family> {
        [Family::V4, Family::V6]
            .into_iter()
            .filter(|f| self.services.iter().any(|s| Family::of(s.addr) == *f))
            .collect()
    }

    /// The argument lists (after `-w -t TABLE`) that build the chain for `family`, in order:
    /// create, mark return, queue rules, then the jumps.
    fn install_commands(&self, family: Family) -> Vec<Vec<String>> {
        let tag = self.owner.tag();
        let comment = args(&["-m", "comment", "--comment", &tag]);
        let mut mark_return = args(&[
            "-A",
            &self.chain,
            "-m",
            "mark",
            "--mark",
            &format!("{:#x}/{:#x}", self.mark, self.mark_mask),
        ]);
        mark_return.extend(comment.iter().cloned());
        mark_return.extend(args(&["-j", "RETURN"]));
        let mut cmds = vec![args(&["-N", &self.chain]), mark_return];
        if let Some(bit) = self.fast_mark {
            // Only in the directions the fast path claims: from the application's leg (its
            // packets) and toward it (its peers'). A packet with the bit that arrived from the
            // peers' side carrying a service's source still meets the DROP below.
            let legs: Vec<Vec<String>> = match &self.app_iface {
                Some(i) => vec![args(&["-i", i]), args(&["-o", i])],
                None => vec![vec![]],
            };
            for leg in legs {
                let mut r = args(&["-A", &self.chain, "-m", "mark", "--mark", &format!("{bit:#x}/{bit:#x}")]);
                r.extend(leg);
                r.extend(comment.iter().cloned());
                r.extend(args(&["-j", "RETURN"]));
                cmds.push(r);
            }
        }
        let queue = self.queue_num.to_string();
        for s in self
            .services
            .iter()
            .filter(|s| Family::of(s.addr) == family)
        {
            let port = s.port.to_string();
            let addr = s.addr.to_string();
            for (addr_flag, port_flag, iface_flag) in [("-s", "--sport", "-i"), ("-d", "--dport", "-o")] {
                let mut c = args(&["-A", &self.chain, "-p", s.proto.as_str()]);
                if !s.addr.is_unspecified() {
                    c.extend(args(&[addr_flag, &addr]));
                }
                c.extend(args(&[port_flag, &port]));
                let base = c.clone();
                if let Some(i) = &self.app_iface {
                    c.extend(args(&[iface_flag, i]));
                }
                if let Some((to_service, from_service)) = &self.bpf_match {
                    let prog = if addr_flag == "-d" { to_service } else { from_service };
                    c.extend(args(&["-m", "bpf", "--object-pinned", &prog.to_string_lossy()]));
                }
                c.extend(comment.iter().cloned());
                c.extend(args(&["-j", "NFQUEUE", "--queue-num", &queue]));
                if self.queue_bypass {
                    c.push("--queue-bypass".into());
                }
                cmds.push(c);
                // A service's source from any other side is forged (not for a wildcard
                // address: a peer-side host may well send from the same port).
                if self.app_iface.is_some() && addr_flag == "-s" && !s.addr.is_unspecified() {
                    let mut d = base;
                    d.extend(comment.iter().cloned());
                    d.extend(args(&["-j", "DROP"]));
                    cmds.push(d);
                }
            }
        }
        for h in &self.hooks {
            cmds.push(args(&["-I", h.as_str(), "1", "-j", &self.chain]));
        }
        cmds
    }
}

fn args(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

/// A Linux interface name iptables takes literally: 1-15 bytes, none of them whitespace, `/`,
/// `:` or a quote, not `.`/`..`, not starting with `-` or `!`, no `+` (a wildcard to iptables).
pub fn check_iface_name(i: &str) -> io::Result<()> {
    let ok = !i.is_empty()
        && i.len() <= 15
        && i != "."
        && i != ".."
        && !i.starts_with(['-', '!'])
        && i.bytes().all(|b| b.is_ascii_graphic() && !b"/:+\"'".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(invalid(format!(
            "bad interface name {i:?}: 1-15 printable characters, no '/', ':', '+', quotes or spaces, not starting with '-' or '!'"
        )))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    V4,
    V6,
}

impl Family {
    fn of(a: IpAddr) -> Family {
        if a.is_ipv4() {
            Family::V4
        } else {
            Family::V6
        }
    }
}

/// Installed rules; removed by [`Rules::remove`] or on drop.
#[derive(Debug)]
pub struct Rules {
    spec: RuleSpec,
    /// Families where the chain was (at least partly) created.
    installed: Vec<Family>,
}

impl Rules {
    /// Removes leftovers of a previous run under the same chain name (refused while the
    /// process that installed them still runs, see [`Rules::check_owner`]), then creates the
    /// chain and its rules and finally the jumps, for each family that has services. On
    /// failure the partial installation is removed and the error names the command and its
    /// stderr.
    pub fn install(spec: &RuleSpec) -> io::Result<Rules> {
        spec.validate()?;
        Self::remove_leftovers(spec)?;
        let mut rules = Rules {
            spec: spec.clone(),
            installed: Vec::new(),
        };
        for family in spec.families() {
            rules.installed.push(family);
            for cmd in spec.install_commands(family) {
                // On error `rules` drops here and removes what was created.
                run(spec, family, &cmd)?;
            }
        }
        Ok(rules)
    }

    /// Like [`Rules::install`], but when the chain is already there (a daemon restarting after
    /// a crash or a stop, whose predecessor left its rules) its rules are replaced in one
    /// `iptables-restore --noflush` transaction and the existing jumps stay: traffic is never
    /// left unsteered, not even for a moment. A gap would let the application host's RSTs
    /// (answers to the peer's retransmissions while nobody rewrites) reach the peer. Jumps
    /// missing from a hook are added in the same transaction. Refused, touching nothing, while
    /// the chain belongs to another process that still runs ([`Rules::check_owner`]).
    pub fn install_or_replace(spec: &RuleSpec) -> io::Result<Rules> {
        spec.validate()?;
        Self::check_owner(spec)?;
        let mut rules = Rules {
            spec: spec.clone(),
            installed: Vec::new(),
        };
        for family in spec.families() {
            let mut text = format!("*{}\n:{} - [0:0]\n", spec.table.as_str(), spec.chain);
            for cmd in spec.install_commands(family) {
                match cmd.first().map(String::as_str) {
                    Some("-N") => continue, // the declaration above creates or flushes it
                    Some("-I") => {
                        // Keep an existing jump in place; add it only where it is missing.
                        let check: Vec<String> = std::iter::once("-C".to_string()).chain(cmd[1..].iter().filter(|a| a.as_str() != "1").cloned()).collect();
                        if try_run(spec, family, &check)?.status.success() {
                            continue;
                        }
                    }
                    _ => {}
                }
                text.push_str(&cmd.join(" "));
                text.push('\n');
            }
            text.push_str("COMMIT\n");
            rules.installed.push(family);
            restore(spec, family, &text)?;
        }
        Ok(rules)
    }

    /// Fails (`AddrInUse`, naming the process) when the chain of `spec` exists in a family and
    /// its rules belong to a process other than `spec.owner` that still runs. A chain of a
    /// process that is gone, or without owner comments (an older version), is free to take
    /// over. A family whose binary is missing is skipped unless `spec` has services in it.
    pub fn check_owner(spec: &RuleSpec) -> io::Result<()> {
        let needed = spec.families();
        for family in [Family::V4, Family::V6] {
            match live_other_owner(spec, family) {
                Ok(None) => {}
                Ok(Some(o)) => return Err(in_use(spec, family, o)),
                Err(e) if e.kind() == io::ErrorKind::NotFound && !needed.contains(&family) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Removes the chain named in `spec` and every plain jump to it from the built-in chains
    /// of its table, in both families; does nothing where the chain does not exist. Refused
    /// (before removing anything) while the chain belongs to another process that still runs.
    /// A family whose binary is missing is skipped unless `spec` has services in it.
    pub fn remove_leftovers(spec: &RuleSpec) -> io::Result<()> {
        Self::check_owner(spec)?;
        let needed = spec.families();
        for family in [Family::V4, Family::V6] {
            match remove_chain(spec, family) {
                Err(e) if e.kind() == io::ErrorKind::NotFound && !needed.contains(&family) => {}
                other => other?,
            }
        }
        Ok(())
    }

    /// Adds the jump from `hook` to the chain of `spec` (first in `hook`) in every family of
    /// `spec` where it is missing: traffic of that hook is steered from now on (replica mode's
    /// take-over: its server's packets through the queue again). The chain must exist; the
    /// jump goes with the chain ([`Rules::remove`], [`Rules::remove_leftovers`]).
    pub fn add_jump(spec: &RuleSpec, hook: BuiltinChain) -> io::Result<()> {
        for family in spec.families() {
            if try_run(spec, family, &args(&["-C", hook.as_str(), "-j", &spec.chain]))?.status.success() {
                continue;
            }
            run(spec, family, &args(&["-I", hook.as_str(), "1", "-j", &spec.chain]))?;
        }
        Ok(())
    }

    /// Removes every jump from `hook` to the chain of `spec` (one a predecessor left that this
    /// run does not want).
    pub fn remove_jump(spec: &RuleSpec, hook: BuiltinChain) -> io::Result<()> {
        for family in spec.families() {
            for _ in 0..16 {
                if !try_run(spec, family, &args(&["-C", hook.as_str(), "-j", &spec.chain]))?.status.success() {
                    break;
                }
                run(spec, family, &args(&["-D", hook.as_str(), "-j", &spec.chain]))?;
            }
        }
        Ok(())
    }

    /// The spec these rules were installed from.
    pub fn spec(&self) -> &RuleSpec {
        &self.spec
    }

    /// The guard's chain name.
    pub fn chain(&self) -> &str {
        &self.spec.chain
    }

    /// Deletes the jumps and the chain, reporting the first error (and still trying the other
    /// family).
    pub fn remove(mut self) -> io::Result<()> {
        self.remove_installed()
    }

    /// Leaves the rules installed when this value goes away (a daemon stopping so that the
    /// next instance takes over its traffic: with nobody reading the queue the kernel drops
    /// the packets, instead of answering them without the daemon).
    pub fn leave_installed(mut self) {
        self.installed.clear();
    }

    /// Removes only what is still this owner's: a chain another running process has taken
    /// over since is left alone (an error says so).
    fn remove_installed(&mut self) -> io::Result<()> {
        let mut result = Ok(());
        for family in std::mem::take(&mut self.installed) {
            let r = match live_other_owner(&self.spec, family) {
                Ok(None) => remove_chain(&self.spec, family),
                Ok(Some(o)) => Err(in_use(&self.spec, family, o)),
                Err(e) => Err(e),
            };
            if let Err(e) = r {
                if result.is_ok() {
                    result = Err(e);
                }
            }
        }
        result
    }
}

impl Drop for Rules {
    fn drop(&mut self) {
        let _ = self.remove_installed();
    }
}

/// Packets the `DROP` rules of the chain of `spec` dropped so far (packets with a service's
/// source address arriving from the wrong side, see [`RuleSpec::app_iface`]), all families.
pub fn dropped_by_rules(spec: &RuleSpec) -> io::Result<u64> {
    let mut n = 0u64;
    for family in spec.families() {
        let out = try_run(spec, family, &args(&["-L", &spec.chain, "-v", "-x", "-n"]))?;
        if !out.status.success() {
            continue;
        }
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.get(2) == Some(&"DROP") {
                n = n.saturating_add(f[0].parse::<u64>().unwrap_or(0));
            }
        }
    }
    Ok(n)
}

/// The owners named by the comments of the chain's rules in `family`; `None` when the chain
/// does not exist.
fn chain_owners(spec: &RuleSpec, family: Family) -> io::Result<Option<Vec<Owner>>> {
    let out = try_run(spec, family, &args(&["-S", &spec.chain]))?;
    if !out.status.success() {
        return Ok(None);
    }
    let mut owners = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let mut words = line.split_whitespace();
        while let Some(w) = words.next() {
            if w == "--comment" {
                if let Some(o) = words.next().and_then(Owner::parse_tag) {
                    if !owners.contains(&o) {
                        owners.push(o);
                    }
                }
            }
        }
    }
    Ok(Some(owners))
}

/// A process other than `spec.owner`, still running, that owns rules of the chain in `family`.
fn live_other_owner(spec: &RuleSpec, family: Family) -> io::Result<Option<Owner>> {
    Ok(chain_owners(spec, family)?.and_then(|owners| owners.into_iter().find(|o| *o != spec.owner && o.is_alive())))
}

fn in_use(spec: &RuleSpec, family: Family, o: Owner) -> io::Error {
    let bin = match family {
        Family::V4 => &spec.iptables,
        Family::V6 => &spec.ip6tables,
    };
    io::Error::new(
        io::ErrorKind::AddrInUse,
        format!(
            "chain {} ({bin} -t {}) is in use by {}, which still runs: stop it first, or give this instance another queue number",
            spec.chain,
            spec.table.as_str(),
            o.describe()
        ),
    )
}

/// Removes jumps to the chain, then flushes and deletes it. Absent chain: nothing to do.
fn remove_chain(spec: &RuleSpec, family: Family) -> io::Result<()> {
    let chain = spec.chain.as_str();
    if !try_run(spec, family, &args(&["-S", chain]))?
        .status
        .success()
    {
        // No such chain, hence no jumps to it either (iptables refuses both otherwise).
        return Ok(());
    }
    for b in spec.table.builtin_chains() {
        // Each -D removes one matching jump; a crashed run may have left several. The bound
        // keeps a misbehaving binary from looping forever.
        for _ in 0..64 {
            if !try_run(spec, family, &args(&["-D", b.as_str(), "-j", chain]))?
                .status
                .success()
            {
                break;
            }
        }
    }
    run(spec, family, &args(&["-F", chain]))?;
    run(spec, family, &args(&["-X", chain]))?;
    Ok(())
}

/// How long a command waits for the xtables lock held by another iptables user.
const LOCK_WAIT_SECS: &str = "30";

fn command(spec: &RuleSpec, family: Family, a: &[String]) -> Command {
    let bin = match family {
        Family::V4 => &spec.iptables,
        Family::V6 => &spec.ip6tables,
    };
    let mut argv: Vec<OsString> = Vec::new();
    let mut cmd = match &spec.netns {
        Some(ns) => {
            argv.extend(["netns".into(), "exec".into(), ns.into(), bin.into()]);
            Command::new("ip")
        }
        None => Command::new(bin),
    };
    // Wait for the xtables lock (iptables-legacy), but not forever.
    argv.extend([
        "-w".into(),
        LOCK_WAIT_SECS.into(),
        "-t".into(),
        spec.table.as_str().into(),
    ]);
    argv.extend(a.iter().map(OsString::from));
    cmd.args(argv);
    cmd.env("LC_ALL", "C");
    cmd
}

/// Feeds `text` to `iptables-restore --noflush` (or the `-restore` of the configured binary).
fn restore(spec: &RuleSpec, family: Family, text: &str) -> io::Result<()> {
    use std::io::Write;
    let bin = match family {
        Family::V4 => &spec.iptables,
        Family::V6 => &spec.ip6tables,
    };
    let restore_bin = format!("{bin}-restore");
    let mut cmd = match &spec.netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns.as_str(), restore_bin.as_str()]);
            c
        }
        None => Command::new(&restore_bin),
    };
    cmd.args(["--noflush", "-w", LOCK_WAIT_SECS]).env("LC_ALL", "C");
    cmd.stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| io::Error::new(e.kind(), format!("running `{}`: {e}", describe(&cmd))))?;
    child.stdin.take().expect("piped").write_all(text.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        return Err(io::Error::other(format!("`{}` failed ({}): {}\ninput:\n{text}", describe(&cmd), out.status, String::from_utf8_lossy(&out.stderr).trim())));
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

/// Runs a command and returns its output whatever the exit status. A missing binary is
/// `NotFound`; with `ip netns exec` a missing iptables binary shows up as exit status 255
/// with "No such file" on stderr, which is mapped to `NotFound` as well.
fn try_run(spec: &RuleSpec, family: Family, a: &[String]) -> io::Result<Output> {
    let mut cmd = command(spec, family, a);
    let out = cmd
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| io::Error::new(e.kind(), format!("running `{}`: {e}", describe(&cmd))))?;
    if !out.status.success() && spec.netns.is_some() {
        let err = String::from_utf8_lossy(&out.stderr);
        if err.contains("No such file or directory") && err.contains("exec") {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("`{}`: {}", describe(&cmd), err.trim()),
            ));
        }
    }
    Ok(out)
}

/// Runs a command that must succeed; the error carries the command line and its stderr.
fn run(spec: &RuleSpec, family: Family, a: &[String]) -> io::Result<()> {
    let out = try_run(spec, family, a)?;
    if out.status.success() {
        return Ok(());
    }
    let cmd = command(spec, family, a);
    Err(io::Error::other(format!(
        "`{}` failed ({}): {}",
        describe(&cmd),
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> RuleSpec {
        let mut s = RuleSpec::new(RuleSpec::chain_name("UNBROKEN-Q", 2), 2, 0x4242);
        s.hooks = vec![BuiltinChain::Input, BuiltinChain::Output];
        s.services = vec![
            Service::tcp("10.0.0.2".parse().unwrap(), 80),
            Service::tcp("fd00::2".parse().unwrap(), 443),
            Service::udp("0.0.0.0".parse().unwrap(), 53),
        ];
        s.owner = Owner { pid: 7, start: 9 };
        s
    }

    #[test]
    fn commands_for_each_family() {
        let mut s = spec();
        s.queue_bypass = true;
        let v4: Vec<String> = s
            .install_commands(Family::V4)
            .iter()
            .map(|c| c.join(" "))
            .collect();
        assert_eq!(
            v4,
            vec![
                "-N UNBROKEN-Q2",
                "-A UNBROKEN-Q2 -m mark --mark 0x4242/0xffffffff -m comment --comment unbroken-owner:7:9 -j RETURN",
                "-A UNBROKEN-Q2 -p tcp -s 10.0.0.2 --sport 80 -m comment --comment unbroken-owner:7:9 -j NFQUEUE --queue-num 2 --queue-bypass",
                "-A UNBROKEN-Q2 -p tcp -d 10.0.0.2 --dport 80 -m comment --comment unbroken-owner:7:9 -j NFQUEUE --queue-num 2 --queue-bypass",
                "-A UNBROKEN-Q2 -p udp --sport 53 -m comment --comment unbroken-owner:7:9 -j NFQUEUE --queue-num 2 --queue-bypass",
                "-A UNBROKEN-Q2 -p udp --dport 53 -m comment --comment unbroken-owner:7:9 -j NFQUEUE --queue-num 2 --queue-bypass",
                "-I INPUT 1 -j UNBROKEN-Q2",
                "-I OUTPUT 1 -j UNBROKEN-Q2",
            ]
        );
        let v6: Vec<String> = s
            .install_commands(Family::V6)
            .iter()
            .map(|c| c.join(" "))
            .collect();
        assert_eq!(
            v6[2],
            "-A UNBROKEN-Q2 -p tcp -s fd00::2 --sport 443 -m comment --comment unbroken-owner:7:9 -j NFQUEUE --queue-num 2 --queue-bypass"
        );
        assert_eq!(v6.len(), 6);
        assert_eq!(s.families(), vec![Family::V4, Family::V6]);
    }

    #[test]
    fn command_lines() {
        let mut s = spec();
        let c = command(&s, Family::V6, &args(&["-S", "X"]));
        assert_eq!(describe(&c), "ip6tables -w 30 -t mangle -S X");
        s.netns = Some("ns1".into());
        s.table = Table::Filter;
        let c = command(&s, Family::V4, &args(&["-F", "X"]));
        assert_eq!(
            describe(&c),
            "ip netns exec ns1 iptables -w 30 -t filter -F X"
        );
    }

    #[test]
    fn validation() {
        assert!(spec().validate().is_ok());
        let bad = |f: &dyn Fn(&mut RuleSpec)| {
            let mut s = spec();
            f(&mut s);
            s.validate().unwrap_err().kind()
        };
        assert_eq!(bad(&|s| s.chain = "-X".into()), io::ErrorKind::InvalidInput);
        assert_eq!(
            bad(&|s| s.chain = "A B".into()),
            io::ErrorKind::InvalidInput
        );
        assert_eq!(
            bad(&|s| s.chain = "X".repeat(29)),
            io::ErrorKind::InvalidInput
        );
        assert_eq!(
            bad(&|s| s.chain = "INPUT".into()),
            io::ErrorKind::InvalidInput
        );
        assert_eq!(bad(&|s| s.hooks.clear()), io::ErrorKind::InvalidInput);
        assert_eq!(bad(&|s| s.services.clear()), io::ErrorKind::InvalidInput);
        assert_eq!(bad(&|s| s.mark = 0), io::ErrorKind::InvalidInput);
        assert_eq!(
            bad(&|s| {
                s.table = Table::Filter;
                s.hooks = vec![BuiltinChain::Prerouting];
            }),
            io::ErrorKind::InvalidInput
        );
    }

    #[test]
    fn hostile_rules_match_the_side_they_mean() {
        // A gateway guard: a packet with a service's source is queued only from the
        // application side; from any other side it is forged and dropped. A packet to a
        // service is queued only on its way out to the application side.
        let mut s = spec();
        s.hooks = vec![BuiltinChain::Forward];
        s.app_iface = Some("lan0".into());
        let v4: Vec<String> = s.install_commands(Family::V4).iter().map(|c| c.join(" ")).collect();
        assert_eq!(
            v4[2..],
            [
                "-A UNBROKEN-Q2 -p tcp -s 10.0.0.2 --sport 80 -i lan0 -m comment --comment unbroken-owner:7:9 -j NFQUEUE --queue-num 2",
                "-A UNBROKEN-Q2 -p tcp -s 10.0.0.2 --sport 80 -m comment --comment unbroken-owner:7:9 -j DROP",
                "-A UNBROKEN-Q2 -p tcp -d 10.0.0.2 --dport 80 -o lan0 -m comment --comment unbroken-owner:7:9 -j NFQUEUE --queue-num 2",
                // A wildcard address: queued by side, never dropped by port alone.
                "-A UNBROKEN-Q2 -p udp --sport 53 -i lan0 -m comment --comment unbroken-owner:7:9 -j NFQUEUE --queue-num 2",
                "-A UNBROKEN-Q2 -p udp --dport 53 -o lan0 -m comment --comment unbroken-owner:7:9 -j NFQUEUE --queue-num 2",
                "-I FORWARD 1 -j UNBROKEN-Q2",
            ]
        );
        assert!(s.validate().is_ok());
        // -i/-o mean nothing in OUTPUT/INPUT: refused, not silently never matching.
        let mut local = s.clone();
        local.hooks = vec![BuiltinChain::Input, BuiltinChain::Output];
        let e = local.validate().unwrap_err().to_string();
        assert!(e.contains("FORWARD") && e.contains("INPUT"), "{e}");
        for bad in ["", "eth0 -j ACCEPT", "-x", "!eth0", "eth+", "a/b", "0123456789abcdef", "..", "e\"0"] {
            let mut b = s.clone();
            b.app_iface = Some(bad.into());
            assert_eq!(b.validate().unwrap_err().kind(), io::ErrorKind::InvalidInput, "{bad:?}");
        }
    }

    /// The fast path's RETURN (issue 22): only for packets on the legs it claims (from and to
    /// the application side), so that a packet from the peers' side with a service's source
    /// meets the DROP whatever its mark; a mark of more than one bit is refused.
    #[test]
    fn hostile_fast_path_return_only_on_the_application_legs() {
        let mut s = spec();
        s.hooks = vec![BuiltinChain::Forward];
        s.app_iface = Some("lan0".into());
        s.fast_mark = Some(0x2000_0000);
        let v4: Vec<String> = s.install_commands(Family::V4).iter().map(|c| c.join(" ")).collect();
        assert_eq!(
            v4[2..5],
            [
                "-A UNBROKEN-Q2 -m mark --mark 0x20000000/0x20000000 -i lan0 -m comment --comment unbroken-owner:7:9 -j RETURN",
                "-A UNBROKEN-Q2 -m mark --mark 0x20000000/0x20000000 -o lan0 -m comment --comment unbroken-owner:7:9 -j RETURN",
                "-A UNBROKEN-Q2 -p tcp -s 10.0.0.2 --sport 80 -i lan0 -m comment --comment unbroken-owner:7:9 -j NFQUEUE --queue-num 2",
            ]
        );
        assert!(v4.iter().any(|r| r == "-A UNBROKEN-Q2 -p tcp -s 10.0.0.2 --sport 80 -m comment --comment unbroken-owner:7:9 -j DROP"));
        assert!(s.validate().is_ok());
        for bad in [0, 0x3000_0000] {
            s.fast_mark = Some(bad);
            assert_eq!(s.validate().unwrap_err().kind(), io::ErrorKind::InvalidInput, "{bad:#x}");
        }
    }

    /// Object mode's fast path (issue 22): each direction's queue rule takes only what its
    /// pinned filter returns 1 for; the rest passes the chain untouched. A relative or spaced
    /// path is refused.
    #[test]
    fn hostile_bpf_matched_queue_rules_name_each_directions_filter() {
        let mut s = spec();
        s.hooks = vec![BuiltinChain::Prerouting, BuiltinChain::Output];
        s.bpf_match = Some(("/sys/fs/bpf/ub/in".into(), "/sys/fs/bpf/ub/out".into()));
        let v4: Vec<String> = s.install_commands(Family::V4).iter().map(|c| c.join(" ")).collect();
        assert!(v4.iter().any(|r| r == "-A UNBROKEN-Q2 -p tcp -s 10.0.0.2 --sport 80 -m bpf --object-pinned /sys/fs/bpf/ub/out -m comment --comment unbroken-owner:7:9 -j NFQUEUE --queue-num 2"), "{v4:#?}");
        assert!(v4.iter().any(|r| r == "-A UNBROKEN-Q2 -p tcp -d 10.0.0.2 --dport 80 -m bpf --object-pinned /sys/fs/bpf/ub/in -m comment --comment unbroken-owner:7:9 -j NFQUEUE --queue-num 2"), "{v4:#?}");
        assert!(v4.iter().filter(|r| r.contains("NFQUEUE")).all(|r| r.contains("-m bpf --object-pinned /sys/fs/bpf/ub/")), "{v4:#?}");
        assert!(s.validate().is_ok());
        for bad in ["relative/in", "/sys/fs/bpf/a b"] {
            s.bpf_match = Some((bad.into(), "/sys/fs/bpf/ub/out".into()));
            assert_eq!(s.validate().unwrap_err().kind(), io::ErrorKind::InvalidInput, "{bad:?}");
        }
    }

    #[test]
    fn hostile_owner_tags() {
        let me = Owner::current();
        assert_eq!(me.pid, std::process::id());
        assert!(me.start > 0 && me.is_alive());
        assert_eq!(Owner::parse_tag(&me.tag()), Some(me));
        assert_eq!(Owner::parse_tag(&format!("\"{}\"", me.tag())), Some(me), "quoted by iptables -S");
        // The same pid with another start time is another (dead) process: a reused pid.
        assert!(!Owner { start: me.start + 1, ..me }.is_alive());
        for bad in ["", "unbroken-owner:", "unbroken-owner:1", "unbroken-owner:x:1", "other:1:2", "unbroken-owner:1:2:3"] {
            assert_eq!(Owner::parse_tag(bad), None, "{bad:?}");
        }
        assert!(me.describe().starts_with(&format!("pid {} (", me.pid)), "{}", me.describe());
        // A killed process not reaped yet (a zombie) holds nothing: not an owner any more.
        let mut child = std::process::Command::new("sleep").arg("600").spawn().unwrap();
        let owner = Owner::of_pid(child.id()).unwrap();
        assert!(owner.is_alive());
        child.kill().unwrap();
        let end = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while owner.is_alive() && std::time::Instant::now() < end {
            std::thread::sleep(std::time::Duration::from_millis(5)); // waiting for the kill to land, with a deadline
        }
        assert!(matches!(proc_stat(child.id()), Some(('Z', _))), "still unreaped: a zombie");
        assert!(!owner.is_alive(), "a zombie is not alive");
        child.wait().unwrap();
    }
}
