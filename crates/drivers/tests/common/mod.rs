//! Shared fixtures for the root/namespace tests: a pair of network namespaces joined by a veth,
//! running closures inside a namespace, a queue consumer thread, and tiny packet helpers.
#![allow(dead_code)] // each test binary uses a different subset

use std::fs::File;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::AsRawFd;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use unbroken_drivers::{Queue, QueuedPacket, Stats, Verdict};

// The skip rule of this crate's tests (also included by the unit tests in src/).
include!("require.rs");
include!("loaded.rs");

pub const A4: Ipv4Addr = Ipv4Addr::new(10, 201, 0, 1);
pub const B4: Ipv4Addr = Ipv4Addr::new(10, 201, 0, 2);
pub const A6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x201, 0, 0, 0, 0, 0, 1);
pub const B6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x201, 0, 0, 0, 0, 0, 2);

/// Upper bound for anything a test waits for.
pub const TIMEOUT: Duration = Duration::from_secs(20);

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// Two namespaces `a` and `b` joined by veth `va`/`vb` with 10.201.0.1-2/24 and
/// fd00:201::1-2/64. Deleted on drop (also when the test panics), which also removes every
/// rule and queue created inside them.
pub struct NetnsPair {
    pub a: String,
    pub b: String,
}

fn ip(args: &[&str]) -> Output {
    Command::new("ip").args(args).output().expect("running ip")
}

fn must(args: &[&str]) {
    let out = ip(args);
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl NetnsPair {
    /// Creates the pair, or [`skip_or_fail`]s and returns `None` (not root, or `ip netns add`
    /// does not work here).
    pub fn setup(test: &str) -> Option<NetnsPair> {
        // SAFETY: trivial syscall.
        if unsafe { libc::geteuid() } != 0 {
            skip_or_fail(test, "needs root (network namespaces, iptables, NFQUEUE)");
            return None;
        }
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let pid = std::process::id();
        let a = format!("ubdrv-{pid}-{n}-a");
        let b = format!("ubdrv-{pid}-{n}-b");
        let out = ip(&["netns", "add", &a]);
        if !out.status.success() {
            skip_or_fail(
                test,
                &format!(
                    "`ip netns add` failed: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            );
            return None;
        }
        let pair = NetnsPair {
            a: a.clone(),
            b: b.clone(),
        };
        must(&["netns", "add", &b]);
        must(&[
            "-n", &a, "link", "add", "va", "type", "veth", "peer", "name", "vb", "netns", &b,
        ]);
        for (ns, dev, v4, v6) in [
            (&a, "va", "10.201.0.1/24", "fd00:201::1/64"),
            (&b, "vb", "10.201.0.2/24", "fd00:201::2/64"),
        ] {
            must(&["-n", ns, "addr", "add", v4, "dev", dev]);
            must(&["-n", ns, "addr", "add", v6, "dev", dev, "nodad"]);
            must(&["-n", ns, "link", "set", "lo", "up"]);
            must(&["-n", ns, "link", "set", dev, "up"]);
        }
        // Wait until both ends report carrier (operstate UP).
        wait_for("veth up", || {
            [(&a, "va"), (&b, "vb")].iter().all(|(ns, dev)| {
                let out = ip(&["-n", ns, "-br", "link", "show", dev]);
                String::from_utf8_lossy(&out.stdout)
                    .split_whitespace()
                    .nth(1)
                    == Some("UP")
            })
        });
        Some(pair)
    }

    /// Runs `f` on a thread that has entered namespace `ns`. Sockets created there stay in
    /// that namespace wherever they are used afterwards.
    pub fn run_in<T: Send>(&self, ns: &str, f: impl FnOnce() -> T + Send) -> T {
        let path = format!("/run/netns/{ns}");
        std::thread::scope(|s| {
            s.spawn(|| {
                let file = File::open(&path).expect("open netns");
                // SAFETY: setns on the current thread with a valid namespace fd.
                let r = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
                assert_eq!(r, 0, "setns {path}: {}", io::Error::last_os_error());
                f()
            })
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e))
        })
    }

    /// Runs a command inside `ns` and returns its output.
    pub fn exec(&self, ns: &str, args: &[&str]) -> Output {
        Command::new("ip")
            .args(["netns", "exec", ns])
            .args(args)
            .output()
            .expect("ip netns exec")
    }

    /// Like `exec` but asserts success and returns stdout.
    pub fn exec_ok(&self, ns: &str, args: &[&str]) -> String {
        let out = self.exec(ns, args);
        assert!(
            out.status.success(),
            "{}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for NetnsPair {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.a]);
        let _ = ip(&["netns", "del", &self.b]);
    }
}

/// Polls `cond` until it holds; panics after [`TIMEOUT`].
pub fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + TIMEOUT;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::yield_now();
        // Back off a little without using sleep as synchronisation: the condition is rechecked.
        std::thread::park_timeout(Duration::from_millis(5));
    }
}

/// What a consumer thread saw.
#[derive(Debug, Default, Clone)]
pub struct Seen {
    pub packets: u64,
    pub max_len: usize,
    pub gso: u64,
    pub csum_not_ready: u64,
    pub marks: Vec<u32>,
}

/// A thread that receives from a queue and answers each packet with `decide`.
pub struct Consumer {
    stop: Arc<AtomicBool>,
    pub count: Arc<AtomicU64>,
    pub seen: Arc<Mutex<Seen>>,
    handle: Option<JoinHandle<io::Result<Stats>>>,
}

/// A verdict and an optional replacement packet.
pub type Decision = (Verdict, Option<Vec<u8>>);
/// A verdict, an optional new mark and an optional replacement packet.
pub type MarkDecision = (Verdict, Option<u32>, Option<Vec<u8>>);

impl Consumer {
    pub fn spawn(
        q: Queue,
        mut decide: impl FnMut(&QueuedPacket) -> Decision + Send + 'static,
    ) -> Consumer {
        Self::spawn_marking(q, move |p| {
            let (v, payload) = decide(p);
            (v, None, payload)
        })
    }

    /// Like `spawn`, but the decision may also set the packet's mark.
    pub fn spawn_marking(
        mut q: Queue,
        mut decide: impl FnMut(&QueuedPacket) -> MarkDecision + Send + 'static,
    ) -> Consumer {
        let stop = Arc::new(AtomicBool::new(false));
        let count = Arc::new(AtomicU64::new(0));
        let seen = Arc::new(Mutex::new(Seen::default()));
        let (stop2, count2, seen2) = (stop.clone(), count.clone(), seen.clone());
        let handle = std::thread::spawn(move || {
            let mut batch = Vec::new();
            while !stop2.load(Ordering::SeqCst) {
                q.recv_batch(&mut batch, 64, Some(Duration::from_millis(50)))?;
                for p in &batch {
                    {
                        let mut s = seen2.lock().unwrap();
                        s.packets += 1;
                        s.max_len = s.max_len.max(p.data.len());
                        s.gso += p.gso as u64;
                        s.csum_not_ready += p.csum_not_ready as u64;
                        if s.marks.len() < 16 {
                            s.marks.push(p.mark);
                        }
                    }
                    // Counted before the verdict: whoever sees the packet's effect after the
                    // verdict also sees the count.
                    count2.fetch_add(1, Ordering::SeqCst);
                    let (v, mark, payload) = decide(p);
                    q.set_verdict_mark(p.id, v, mark, payload.as_deref())?;
                }
                q.flush()?;
            }
            let stats = q.stats();
            q.close()?;
            Ok(stats)
        });
        Consumer {
            stop,
            count,
            seen,
            handle: Some(handle),
        }
    }

    /// Stops the thread and returns the queue's final counters.
    pub fn finish(mut self) -> Stats {
        self.stop.store(true, Ordering::SeqCst);
        self.handle
            .take()
            .unwrap()
            .join()
            .expect("consumer panicked")
            .expect("consumer failed")
    }

    pub fn packets(&self) -> u64 {
        self.count.load(Ordering::SeqCst)
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// RFC 1071 sum over `data`, folded, not complemented.
fn sum16(mut acc: u32, data: &[u8]) -> u32 {
    let mut chunks = data.chunks_exact(2);
    for c in &mut chunks {
        acc += u32::from(u16::from_be_bytes([c[0], c[1]]));
    }
    if let [last] = chunks.remainder() {
        acc += u32::from(*last) << 8;
    }
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    acc
}

/// Offset of the UDP header in an IPv4 or IPv6 packet without extension headers.
pub fn udp_offset(pkt: &[u8]) -> Option<usize> {
    match pkt.first()? >> 4 {
        4 if pkt.get(9) == Some(&17) => Some(usize::from(pkt[0] & 0x0f) * 4),
        6 if pkt.get(6) == Some(&17) => Some(40),
        _ => None,
    }
}

/// Recomputes the UDP checksum of an IPv4/IPv6 packet in full.
pub fn fix_udp_checksum(pkt: &mut [u8]) {
    let off = udp_offset(pkt).expect("udp packet");
    let udp_len = pkt.len() - off;
    pkt[off + 6] = 0;
    pkt[off + 7] = 0;
    let mut acc = if pkt[0] >> 4 == 4 {
        sum16(0, &pkt[12..20])
    } else {
        sum16(0, &pkt[8..40])
    };
    acc = sum16(acc, &(udp_len as u32).to_be_bytes());
    acc = sum16(acc, &[0, 17]);
    acc = sum16(acc, &pkt[off..]);
    let mut c = !(acc as u16);
    if c == 0 {
        c = 0xffff;
    }
    pkt[off + 6..off + 8].copy_from_slice(&c.to_be_bytes());
}

/// A complete UDP packet from `src` to `dst` with a correct checksum.
pub fn udp_packet(src: (IpAddr, u16), dst: (IpAddr, u16), payload: &[u8]) -> Vec<u8> {
    let udp_len = 8 + payload.len();
    let mut p = match (src.0, dst.0) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let mut h = vec![0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, 17, 0, 0];
            let total = (20 + udp_len) as u16;
            h[2..4].copy_from_slice(&total.to_be_bytes());
            h.extend_from_slice(&s.octets());
            h.extend_from_slice(&d.octets());
            let c = !(sum16(0, &h) as u16);
            h[10..12].copy_from_slice(&c.to_be_bytes());
            h
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let mut h = vec![0x60, 0, 0, 0];
            h.extend_from_slice(&(udp_len as u16).to_be_bytes());
            h.extend_from_slice(&[17, 64]);
            h.extend_from_slice(&s.octets());
            h.extend_from_slice(&d.octets());
            h
        }
        _ => panic!("mixed families"),
    };
    p.extend_from_slice(&src.1.to_be_bytes());
    p.extend_from_slice(&dst.1.to_be_bytes());
    p.extend_from_slice(&(udp_len as u16).to_be_bytes());
    p.extend_from_slice(&[0, 0]);
    p.extend_from_slice(payload);
    fix_udp_checksum(&mut p);
    p
}

/// UDP payload of a packet, if it is UDP.
pub fn udp_payload(pkt: &[u8]) -> Option<&[u8]> {
    pkt.get(udp_offset(pkt)? + 8..)
}

/// 64-bit FNV-1a, enough to compare transfers.
#[derive(Clone, Copy)]
pub struct Fnv(pub u64);

impl Fnv {
    pub fn new() -> Fnv {
        Fnv(0xcbf29ce484222325)
    }
    pub fn update(&mut self, data: &[u8]) {
        for &b in data {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x100000001b3);
        }
    }
}

/// Deterministic pseudo-random bytes (xorshift64).
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Reads the packet counter of the first rule in `chain` of `table` whose text satisfies
/// `which`, from `iptables -L -v -x -n` (or ip6tables).
pub fn rule_packets(
    pair: &NetnsPair,
    ns: &str,
    bin: &str,
    table: &str,
    chain: &str,
    which: &dyn Fn(&str) -> bool,
) -> u64 {
    let out = pair.exec_ok(ns, &[bin, "-w", "-t", table, "-L", chain, "-v", "-x", "-n"]);
    out.lines()
        .skip(2)
        .find(|l| which(l))
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no such rule in {chain}:\n{out}"))
}
