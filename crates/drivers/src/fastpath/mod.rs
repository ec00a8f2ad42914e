//! The kernel fast path (issue 22): each mode's per-packet transform as tc-BPF programs
//! (`crates/drivers/bpf/<mode>/*.c`, compiled by `build.rs`), whose only state is BPF maps the
//! daemon owns. A program claims only the packets it decides exactly as the mode's engine
//! would ([`Verdict::Done`]); everything else comes back as [`Verdict::Slow`], untouched, for
//! the engine behind NFQUEUE.
//!
//! What exists (step 1, checkpoint mode): loading, the map entries, and running packets through
//! `BPF_PROG_TEST_RUN` ([`checkpoint::Checkpoint::run`]). Not yet: attaching, the kernel's
//! steering of slow-path packets to the queue, the hand-off between the paths and map updates
//! from the daemon (docs/architecture.md, "Fast path").

pub mod checkpoint;
pub mod object;
pub mod replica;

use std::fmt;

use aya::programs::{ProgramType, SchedClassifier, TestRun, TestRunOptions};
use aya::Ebpf;

/// `TC_ACT_OK`: the verdict of a packet the program claimed.
const TC_ACT_OK: i32 = 0;
/// `TC_ACT_SHOT`.
const TC_ACT_SHOT: i32 = 2;
/// `TC_ACT_UNSPEC`: not claimed; attached, the packet continues unchanged to the stack.
const TC_ACT_UNSPEC: i32 = -1;

/// Ethernet header length: a tc program on an Ethernet device (and `BPF_PROG_TEST_RUN` for
/// one) sees the frame.
const ETH_HLEN: usize = 14;

/// What a fast-path program answered for one packet (`FP_*` in `bpf/common/fastpath.h`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Claimed: decided as the engine would, the packet goes on (rewritten where needed).
    Done,
    /// Not claimed, not a byte changed: the slow path decides.
    Slow,
    /// A rewrite failed halfway (the kernel could not make the packet writable): dropped, the
    /// state untouched.
    Drop,
    /// Anything else a program returned (a bug).
    Other(i32),
}

impl Verdict {
    fn from_return(v: u32) -> Verdict {
        match v as i32 {
            TC_ACT_OK => Verdict::Done,
            TC_ACT_UNSPEC => Verdict::Slow,
            TC_ACT_SHOT => Verdict::Drop,
            other => Verdict::Other(other),
        }
    }
}

/// Why the fast path cannot be loaded or run.
#[derive(Debug)]
pub enum Error {
    /// This process cannot use BPF here (not root, or the kernel lacks tc-BPF): the caller
    /// falls back to the slow path alone.
    Unavailable(String),
    /// Loading, the verifier, a map or a test run failed: a bug or a kernel that behaves
    /// differently from the one the programs were written for.
    Bpf(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Unavailable(why) => write!(f, "BPF fast path unavailable: {why}"),
            Error::Bpf(why) => write!(f, "BPF fast path: {why}"),
        }
    }
}

impl std::error::Error for Error {}

fn bpf_err(what: &str, e: impl fmt::Display) -> Error {
    Error::Bpf(format!("{what}: {e}"))
}

/// The tc program `name` of `ebpf`.
fn classifier<'a>(ebpf: &'a Ebpf, name: &str) -> Result<&'a SchedClassifier, Error> {
    ebpf.program(name).ok_or_else(|| Error::Bpf(format!("no program {name} in the object")))?.try_into().map_err(|e| bpf_err(name, e))
}

/// The tc program `name` of `ebpf`, to load or attach.
fn classifier_mut<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut SchedClassifier, Error> {
    ebpf.program_mut(name).ok_or_else(|| Error::Bpf(format!("no program {name} in the object")))?.try_into().map_err(|e| bpf_err(name, e))
}

/// Loads the tc programs `names` of `ebpf` through the verifier.
fn load_classifiers(ebpf: &mut Ebpf, names: &[&str]) -> Result<(), Error> {
    for &name in names {
        classifier_mut(ebpf, name)?.load().map_err(|e| bpf_err(&format!("loading {name} (verifier)"), e))?;
    }
    Ok(())
}

/// Attaches the tc program `name` to `iface` at `point` by TCX (a bpf_link, Linux 6.6 or
/// later; detached when `ebpf` is dropped). Only TCX: aya falls back to a netlink filter on
/// older kernels, which outlives a killed daemon and would keep claiming packets from a map
/// nobody updates any more.
fn attach_tcx(ebpf: &mut Ebpf, name: &str, iface: &str, point: aya::programs::TcAttachType) -> Result<(), Error> {
    let opts = aya::programs::tc::TcAttachOptions::TcxOrder(aya::programs::LinkOrder::default());
    let at = match point {
        aya::programs::TcAttachType::Ingress => "ingress",
        aya::programs::TcAttachType::Egress => "egress",
        _ => "tc",
    };
    classifier_mut(ebpf, name)?.attach_with_options(iface, point, opts).map_err(|e| bpf_err(&format!("attaching {name} to {iface} (tc {at}, TCX: Linux 6.6 or later)"), e))?;
    Ok(())
}

/// `Ok` when this process can load and run tc programs; otherwise why not.
pub fn available() -> Result<(), Error> {
    // SAFETY: trivial syscall.
    let euid = unsafe { libc::geteuid() };
    if euid != 0 {
        return Err(Error::Unavailable(format!("not root (euid {euid}): loading BPF programs needs CAP_BPF and CAP_NET_ADMIN")));
    }
    match aya::sys::is_program_supported(ProgramType::SchedClassifier) {
        Ok(true) => Ok(()),
        Ok(false) => Err(Error::Unavailable("the kernel does not load tc (sched_cls) programs".into())),
        Err(e) => Err(Error::Unavailable(format!("probing for tc programs failed: {e}"))),
    }
}

/// The names of this network namespace's interfaces (`if_nameindex`: /sys may show another
/// namespace's when the guard was entered with nsenter).
pub fn interfaces() -> std::io::Result<Vec<String>> {
    // SAFETY: if_nameindex returns an array terminated by a zero entry, freed below.
    unsafe {
        let list = libc::if_nameindex();
        if list.is_null() {
            return Err(std::io::Error::last_os_error());
        }
        let mut names = Vec::new();
        let mut p = list;
        while (*p).if_index != 0 && !(*p).if_name.is_null() {
            names.push(std::ffi::CStr::from_ptr((*p).if_name).to_string_lossy().into_owned());
            p = p.add(1);
        }
        libc::if_freenameindex(list);
        Ok(names)
    }
}

/// Whether `name` is an Ethernet device (ARPHRD_ETHER), by SIOCGIFHWADDR.
pub fn is_ethernet(name: &str) -> bool {
    if name.len() >= libc::IFNAMSIZ {
        return false;
    }
    // SAFETY: a zeroed ifreq with a NUL-terminated name, an ioctl on a socket we close.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return false;
        }
        let mut ifr: libc::ifreq = std::mem::zeroed();
        for (i, b) in name.bytes().enumerate() {
            ifr.ifr_name[i] = b as libc::c_char;
        }
        let ok = libc::ioctl(fd, libc::SIOCGIFHWADDR, &mut ifr) == 0 && ifr.ifr_ifru.ifru_hwaddr.sa_family == libc::ARPHRD_ETHER;
        libc::close(fd);
        ok
    }
}

/// One packet's trip through a program by `BPF_PROG_TEST_RUN`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    pub verdict: Verdict,
    /// The IP packet as the program left it.
    pub packet: Vec<u8>,
}

/// Runs the IP packet `ip` through `prog` inside an Ethernet frame, `repeat` times (the kernel
/// builds the skb once and runs the program on it again and again); returns the last run's
/// result and the kernel's mean time per run.
fn test_run(prog: &SchedClassifier, ip: &[u8], repeat: u32) -> Result<(Run, std::time::Duration), Error> {
    test_run_marked(prog, ip, repeat, 0)
}

/// [`test_run`] with `skb->mark` = `mark` (the context's `len` and `pkt_type` left zero, as
/// the kernel requires; everything after `mark` zero too).
fn test_run_marked(prog: &SchedClassifier, ip: &[u8], repeat: u32, mark: u32) -> Result<(Run, std::time::Duration), Error> {
    let mut frame = vec![0u8; ETH_HLEN + ip.len()];
    // Destination MAC: the test device's own (loopback's, all zero), so that the kernel
    // takes the frame as one for this host (PACKET_HOST, as the programs require); source
    // locally administered; EtherType by IP version.
    frame[..6].copy_from_slice(&[0, 0, 0, 0, 0, 0]);
    frame[6..12].copy_from_slice(&[0x02, 0, 0, 0, 0, 2]);
    let ethertype: u16 = if ip.first().map(|b| b >> 4) == Some(6) { 0x86dd } else { 0x0800 };
    frame[12..14].copy_from_slice(&ethertype.to_be_bytes());
    frame[ETH_HLEN..].copy_from_slice(ip);
    let mut out = vec![0u8; frame.len() + 256];
    // struct __sk_buff: len (u32), pkt_type (u32), mark (u32), ...
    let mut ctx = [0u8; 12];
    ctx[8..12].copy_from_slice(&mark.to_ne_bytes());
    let opts = TestRunOptions { data_in: Some(&frame), data_out: Some(&mut out), ctx_in: (mark != 0).then_some(&ctx[..]), repeat: repeat.max(1), ..Default::default() };
    let r = prog.test_run(opts).map_err(|e| bpf_err("BPF_PROG_TEST_RUN", e))?;
    let n = (r.data_size_out as usize).min(out.len());
    if n < ETH_HLEN {
        return Err(Error::Bpf(format!("BPF_PROG_TEST_RUN returned {n} bytes, less than an Ethernet header")));
    }
    out.truncate(n);
    let packet = out.split_off(ETH_HLEN);
    Ok((Run { verdict: Verdict::from_return(r.return_value), packet }, r.duration))
}

/// Removes the pins `names` from `dir` (one already gone is fine), and `dir` once empty: what a
/// daemon pinned for its queue rules, after the rules that name them are gone
/// (`iptables-legacy` opens the paths again whenever it rewrites the table).
fn unpin(dir: &std::path::Path, names: &[&str]) -> std::io::Result<()> {
    for name in names {
        match std::fs::remove_file(dir.join(name)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    match std::fs::remove_dir(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound && e.raw_os_error() != Some(libc::ENOTEMPTY) => Err(e),
        _ => Ok(()),
    }
}

/// Where the daemons pin what their queue rules name (`iptables -m bpf --object-pinned`): one
/// directory per daemon, `<kind>-net<inode of its network namespace>-q<queue>`.
pub const PIN_ROOT: &str = "/sys/fs/bpf/unbroken";

/// Removes the pin directories under `root` ([`PIN_ROOT`]) whose network namespace no longer
/// exists (no thread in it, no descriptor or mount of it: [`live_netns`]): the rules that
/// named them went with it, and each kept its programs and their maps in kernel memory for good (an object agent's
/// about 16 MiB: 665 lab runs had left 10 GiB of vmalloc'd maps on the development machine).
/// Directories of live namespaces and names of other shapes are left alone. Returns how many
/// went.
pub fn remove_stale_pins(root: &std::path::Path) -> std::io::Result<usize> {
    // The names first, the living after: a namespace made meanwhile is then seen alive.
    let names: Vec<(std::path::PathBuf, u64)> = match std::fs::read_dir(root) {
        Ok(rd) => rd.flatten().filter_map(|e| Some((e.path(), pin_dir_netns(&e.file_name().to_string_lossy())?))).collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    if names.is_empty() {
        return Ok(0);
    }
    let live = live_netns();
    let mut n = 0;
    for (path, ino) in names {
        if live.contains(&ino) {
            continue;
        }
        // Another cleanup may be at it too: what is gone already is fine.
        if let Ok(files) = std::fs::read_dir(&path) {
            for f in files.flatten() {
                match std::fs::remove_file(f.path()) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                    _ => {}
                }
            }
        }
        match std::fs::remove_dir(&path) {
            Ok(()) => n += 1,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// The inodes of every network namespace this host shows alive: every thread's, every open
/// namespace descriptor's (`net:[N]`), every namespace file mounted somewhere (`ip netns`'s
/// /run/netns, container runtimes' own directories: nsfs mounts in /proc/self/mountinfo).
fn live_netns() -> std::collections::HashSet<u64> {
    use std::os::unix::fs::MetadataExt;
    let mut live = std::collections::HashSet::new();
    let note = |live: &mut std::collections::HashSet<u64>, p: &std::path::Path| {
        if let Ok(m) = std::fs::metadata(p) {
            live.insert(m.ino());
        }
    };
    if let Ok(procs) = std::fs::read_dir("/proc") {
        for pe in procs.flatten() {
            if !pe.file_name().to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
                continue;
            }
            if let Ok(tasks) = std::fs::read_dir(pe.path().join("task")) {
                for t in tasks.flatten() {
                    note(&mut live, &t.path().join("ns/net"));
                }
            }
            if let Ok(fds) = std::fs::read_dir(pe.path().join("fd")) {
                for fd in fds.flatten() {
                    if let Ok(target) = std::fs::read_link(fd.path()) {
                        let t = target.to_string_lossy();
                        if let Some(ino) = t.strip_prefix("net:[").and_then(|r| r.strip_suffix(']')).and_then(|r| r.parse().ok()) {
                            live.insert(ino);
                        }
                    }
                }
            }
        }
    }
    if let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") {
        for line in info.lines() {
            let mut halves = line.splitn(2, " - ");
            let (Some(left), Some(right)) = (halves.next(), halves.next()) else { continue };
            if right.split_whitespace().next() != Some("nsfs") {
                continue;
            }
            if let Some(point) = left.split_whitespace().nth(4) {
                note(&mut live, std::path::Path::new(&point.replace("\\040", " ")));
            }
        }
    }
    if let Ok(rd) = std::fs::read_dir("/run/netns") {
        for e in rd.flatten() {
            note(&mut live, &e.path());
        }
    }
    live
}

/// The network namespace's inode in a pin directory's name (`agent-net4026532177-q7`).
fn pin_dir_netns(name: &str) -> Option<u64> {
    let (kind, rest) = name.split_once("-net")?;
    if !matches!(kind, "agent" | "replica") {
        return None;
    }
    let (ino, queue) = rest.split_once("-q")?;
    if queue.is_empty() || !queue.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    ino.parse().ok()
}

/// CLOCK_MONOTONIC now, in ns: the clock `bpf_ktime_get_ns` reads, so the clock of every
/// program's lease and timestamp.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec to write.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(test)]
mod pin_tests {
    use super::*;

    #[test]
    fn only_daemon_pin_directories_are_named_by_their_namespace() {
        assert_eq!(pin_dir_netns("agent-net4026532177-q7"), Some(4026532177));
        assert_eq!(pin_dir_netns("replica-net12-q9"), Some(12));
        for other in ["test-replica-attach-12", "agent-net12-q", "agent-netx-q1", "other-net12-q1", "agent-net12-q1x", "agent-net12"] {
            assert_eq!(pin_dir_netns(other), None, "{other}");
        }
    }

    #[test]
    fn stale_pin_directories_go_and_live_ones_stay() {
        use std::os::unix::fs::MetadataExt;
        let root = std::env::temp_dir().join(format!("ub-pins-{}", std::process::id()));
        let own = std::fs::metadata("/proc/self/ns/net").unwrap().ino();
        let live = root.join(format!("agent-net{own}-q7"));
        let dead = root.join("replica-net1-q9");
        let other = root.join("something-else");
        for d in [&live, &dead, &other] {
            std::fs::create_dir_all(d).unwrap();
            std::fs::write(d.join("rep_q_out"), b"").unwrap();
        }
        assert_eq!(remove_stale_pins(&root).unwrap(), 1);
        assert!(live.exists() && other.exists() && !dead.exists());
        std::fs::remove_dir_all(&root).unwrap();
        assert_eq!(remove_stale_pins(&root).unwrap(), 0, "no root: nothing to do");
    }
}
