//! `unbroken demo object --chaos N [--seed S] --json`: N trials on the object-mode demo
//! topology (3 servers behind the LB, Redis, a client namespace). In each trial curl (IPv4),
//! wget (IPv6) and a python `http.client` keep-alive client doing consecutive Range GETs
//! download the same object concurrently, paced so that every fault lands mid-transfer, while
//! 1 to 3 faults drawn from a seeded RNG hit the system:
//!
//! * `crash`: power loss of a live server (one serving a client when there is one); at least
//!   one server always stays alive;
//! * `revive`: a server crashed earlier in the trial boots again (after the LB declared it dead);
//! * `false_suspicion`: the LB namespace drops one live server's heartbeats for 50-200 ms past
//!   the LB's deadline (`dead_after_ms`)
//!   (an iptables rule, removed afterwards); its agent keeps running;
//! * `store_blip`: Redis is SIGSTOPped for 100-500 ms, then SIGCONTed;
//! * `agent_restart`: SIGTERM or SIGKILL to one agent, then a new agent (nginx keeps running).
//!
//! What is measured per transfer: sha256 against the object, exit status, RSTs that reached the
//! client namespace, hangs (no byte for [`HANG_AFTER`]: the client is killed), and per fault
//! the stall: the longest gap between two reads of the client's output that overlaps the
//! fault's window (`[start, end + settle]`, where settle covers the moves a fault triggers
//! later: the revive hold for `revive` and `false_suspicion`). `two_senders_seen` counts
//! connections on which server replies from two servers were interleaved within one LB epoch
//! (server A, then B, then A again), captured with an AF_PACKET socket on the LB's server
//! bridge, where the source MAC names the sending server (on the client's own leg every
//! frame carries the LB's MAC); a report names the connection's latest frames. A server that
//! lost its power sends nothing more: a frame of another server after that is its successor's
//! (whose first one, a probe, may leave before any client segment shows the LB's move), never an
//! interleaving. `resets_sent_by_servers` says which server sent each RST on that bridge.
//! `leftovers`: what a trial left behind 5 s after its clients exited (records still in the
//! store, connections a live agent still serves on a rebuilt socket (`rebuilt_serving`), with
//! the servers' sockets and where the agent's threads wait); a
//! finished connection's record is probed and rebuilt when its bucket moves, and the kernel's
//! RST to its client's TIME_WAIT answer reaches the client, so any leftover fails the run.

use crate::common::Rng;
use crate::object::demo::{make_object, EnvOpts, ObjectEnv};
use serde::Serialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use unbroken_lab::lab;
use unbroken_lab::objlab::{addr, dev, server_mac};

/// No byte for this long: the transfer hangs (the client is killed).
pub const HANG_AFTER: Duration = Duration::from_secs(30);
/// How long the system may take to be whole again between trials.
const SETTLE_DEADLINE: Duration = Duration::from_secs(120);
/// Added to every fault's window for the stall (the recovery after the fault's end).
const SETTLE_MS: u64 = 500;
/// The pacing reader's piece size.
const READ_CHUNK: usize = 64 << 10;
/// The client namespace's TCP receive buffer bounds (`net.ipv4.tcp_rmem`): with paced reading
/// the receive buffer is full, and what it holds hides a stall from the measurement (at most
/// 256 KiB plus the pipe's 64 KiB, 40 ms at the default 8 MiB/s).
const CLIENT_RMEM: &str = "4096 131072 262144";
const CLIENT_PY: &str = include_str!("chaos_client.py");

/// Options of [`run_chaos`].
#[derive(Debug, Clone)]
pub struct ChaosOpts {
    pub trials: usize,
    pub seed: u64,
    /// Object size, bytes.
    pub size: u64,
    /// Per-client rate, bytes/s.
    pub rate: u64,
    /// Range GETs of the keep-alive client per transfer.
    pub parts: u64,
    pub live: bool,
    pub bin: Option<PathBuf>,
    /// The fault kinds to draw from (default: all of [`FAULT_KINDS`]).
    pub kinds: Vec<String>,
}

/// Every fault kind, and its weight in the draw.
pub const FAULT_KINDS: [(&str, u64); 5] = [("crash", 30), ("revive", 25), ("false_suspicion", 20), ("store_blip", 15), ("agent_restart", 15)];

impl Default for ChaosOpts {
    fn default() -> Self {
        ChaosOpts { trials: 10, seed: 1, size: 64 << 20, rate: 8 << 20, parts: 4, live: false, bin: None, kinds: FAULT_KINDS.iter().map(|k| k.0.to_string()).collect() }
    }
}

/// The client kinds, in the order they are started.
pub const CLIENTS: [&str; 3] = ["curl", "wget", "python"];

/// One fault as it happened.
#[derive(Debug, Clone, Serialize)]
pub struct FaultLog {
    pub trial: usize,
    pub kind: String,
    pub server: usize,
    /// Detail: the signal, the duration of a blip or of a suspicion.
    pub detail: String,
    pub start_ms: u64,
    pub end_ms: u64,
    /// Bytes each client had received when the fault started (curl, wget, python).
    pub at_bytes: Vec<u64>,
    /// Every client was mid-transfer when the fault started.
    pub mid_transfer: bool,
}

/// One transfer.
#[derive(Debug, Clone, Serialize)]
pub struct TransferLog {
    pub trial: usize,
    pub client: String,
    pub exit: Option<i32>,
    pub bytes: u64,
    pub byte_exact: bool,
    pub hang: bool,
    /// Stall per fault of the trial (ms), in fault order (None: not mid-transfer then).
    pub stalls_ms: Vec<Option<u64>>,
    /// The client's local port (its connection; python keeps one for all its requests).
    pub port: Option<u16>,
    /// The longest gap between reads outside every fault's window (the no-fault baseline).
    pub baseline_gap_ms: u64,
    pub stderr: String,
}

/// Read times of one client's output, milliseconds since the trial's start, and its hash.
#[derive(Default)]
struct Reads {
    times: Vec<u32>,
    bytes: u64,
    sha256: String,
}

/// Reads the client's output in [`READ_CHUNK`] pieces at `rate` bytes/s: the client, blocked
/// on a full pipe, stops reading its socket and the server is held back by the TCP window
/// (the pacing of a slow consumer, identical for every client kind; a client's own rate
/// limiter sleeps in steps of up to a second, which would read as stalls).
fn reader(mut out: impl Read + Send + 'static, t0: Instant, rate: u64, progress: Arc<AtomicU64>, last_ms: Arc<AtomicU64>) -> std::thread::JoinHandle<Reads> {
    std::thread::spawn(move || {
        let mut h = Sha256::new();
        let mut buf = vec![0u8; READ_CHUNK];
        let mut r = Reads::default();
        let start = Instant::now();
        loop {
            if rate > 0 {
                let due = Duration::from_secs_f64(r.bytes as f64 / rate as f64);
                if let Some(ahead) = due.checked_sub(start.elapsed()) {
                    std::thread::sleep(ahead); // pacing, not synchronisation
                }
            }
            let n = match out.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let now = t0.elapsed().as_millis() as u64;
            r.times.push(now as u32);
            last_ms.store(now, Ordering::Relaxed);
            h.update(&buf[..n]);
            r.bytes += n as u64;
            progress.store(r.bytes, Ordering::Relaxed);
        }
        r.sha256 = h.finalize().iter().map(|x| format!("{x:02x}")).collect();
        r
    })
}

/// The longest gap between two consecutive reads that overlaps `[ws, we]` (ms).
pub fn stall_in(times: &[u32], ws: u64, we: u64) -> Option<u64> {
    times.windows(2).filter(|w| (w[1] as u64) > ws && (w[0] as u64) < we).map(|w| (w[1] - w[0]) as u64).max()
}

/// Nearest-rank percentile of sorted values.
pub fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let k = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[k.clamp(1, sorted.len()) - 1]
}

fn stats(v: &[u64]) -> Value {
    let mut s = v.to_vec();
    s.sort_unstable();
    json!({"p50": percentile(&s, 50.0), "p99": percentile(&s, 99.0), "max": s.last().copied().unwrap_or(0), "samples": s.len()})
}

// ---- the sender capture --------------------------------------------------------------------

/// Sender bookkeeping of one connection (trial, family, client port).
#[derive(Default)]
struct ConnSenders {
    /// The server the LB forwards the client's segments to (the latest one seen).
    owner: Option<u8>,
    /// Servers that sent since the owner last changed, consecutive repeats collapsed.
    seq: Vec<u8>,
    last: Option<u8>,
    interleaved: Option<String>,
    /// The latest frames of the connection, as text (ms since the trial's start, direction,
    /// server, flags, sequence number, payload length): the evidence in a two-senders report.
    recent: std::collections::VecDeque<String>,
}

/// Frames kept per connection for a two-senders report.
const RECENT_FRAMES: usize = 16;

/// What the capture on the LB's server bridge saw. The epoch of a connection is the time
/// the LB forwards its client's segments to one server (a change of that server starts a new
/// one; it is the kernel table's decision, seen in-band, so no status file lags behind it).
/// Two senders in one epoch: within one epoch, a server sent again after another one had
/// sent (A, B, A); a clean handover (A's last frames, then B) is one switch, not two senders.
#[derive(Default)]
pub struct SenderLog {
    conns: HashMap<(usize, u8, u16), ConnSenders>,
    /// Sender changes on a connection (failovers and moves home).
    pub switches: u64,
    pub frames: u64,
}

impl SenderLog {
    /// The LB forwarded the client's segment on `port` to `srv`.
    pub fn to_server(&mut self, trial: usize, fam: u8, port: u16, srv: u8) {
        self.to_server_noted(trial, fam, port, srv, None);
    }

    /// [`SenderLog::to_server`], with the frame described for the connection's recent frames.
    pub fn to_server_noted(&mut self, trial: usize, fam: u8, port: u16, srv: u8, note: Option<String>) {
        let c = self.conns.entry((trial, fam, port)).or_default();
        if let Some(n) = note {
            push_recent(&mut c.recent, format!("{n} -> {srv}"));
        }
        if c.owner != Some(srv) {
            c.owner = Some(srv);
            c.seq.clear();
        }
    }

    /// Server `srv` sent to the client's `port`.
    pub fn from_server(&mut self, trial: usize, fam: u8, port: u16, srv: u8) {
        self.from_server_noted(trial, fam, port, srv, None);
    }

    /// [`SenderLog::from_server`], with the frame described for the connection's recent frames.
    pub fn from_server_noted(&mut self, trial: usize, fam: u8, port: u16, srv: u8, note: Option<String>) {
        self.frames += 1;
        let c = self.conns.entry((trial, fam, port)).or_default();
        if let Some(n) = note {
            push_recent(&mut c.recent, format!("{n} <- {srv}"));
        }
        if c.last.is_some_and(|l| l != srv) {
            self.switches += 1;
        }
        c.last = Some(srv);
        if c.seq.last() == Some(&srv) {
            return;
        }
        if c.seq.contains(&srv) && c.interleaved.is_none() {
            let recent: Vec<&str> = c.recent.iter().map(String::as_str).collect();
            c.interleaved = Some(format!("trial {trial} port {port}: LB forwarding to server {:?}, senders {:?} then {srv} again; latest frames: {}", c.owner, c.seq, recent.join("; ")));
        }
        c.seq.push(srv);
    }

    /// Server `srv` lost its power: it sends nothing from now on, so no later frame of
    /// another server interleaves with what it sent (its successor's first frame, a probe, may
    /// leave before any client segment tells the capture that the LB moved the connection).
    /// Only the connections the LB was forwarding to it: on another's, a frame of the crashed
    /// server was an interloper's, and the owner's next frame still shows the interleaving.
    pub fn crashed(&mut self, trial: usize, srv: u8) {
        for ((t, _, _), c) in self.conns.iter_mut() {
            if *t == trial && c.owner == Some(srv) {
                c.seq.retain(|s| *s != srv);
            }
        }
    }

    /// Connections with interleaved senders within one epoch.
    pub fn two_senders(&self) -> Vec<String> {
        self.conns.values().filter_map(|c| c.interleaved.clone()).collect()
    }
}

/// Classic BPF: IPv4 or IPv6 TCP from or to port 80, first 128 bytes; everything else dropped.
fn port80_filter() -> Vec<libc::sock_filter> {
    let f = |code: u16, jt: u8, jf: u8, k: u32| libc::sock_filter { code, jt, jf, k };
    vec![
        f(0x28, 0, 0, 12),      // 0: ldh [12]
        f(0x15, 8, 0, 0x86dd),  // 1: ipv6 -> 10
        f(0x15, 0, 14, 0x0800), // 2: not ipv4 -> drop
        f(0x30, 0, 0, 23),      // 3: ldb [23] (protocol)
        f(0x15, 0, 12, 6),      // 4: not tcp -> drop
        f(0xb1, 0, 0, 14),      // 5: ldxb 4*([14]&0xf)
        f(0x48, 0, 0, 14),      // 6: ldh [x+14] (source port)
        f(0x15, 8, 0, 80),      // 7: 80 -> accept
        f(0x48, 0, 0, 16),      // 8: ldh [x+16] (destination port)
        f(0x15, 6, 7, 80),      // 9: 80 -> accept, else drop
        f(0x30, 0, 0, 20),      // 10: ldb [20] (next header)
        f(0x15, 0, 5, 6),       // 11: not tcp -> drop
        f(0x28, 0, 0, 54),      // 12: ldh [54] (source port)
        f(0x15, 2, 0, 80),      // 13: 80 -> accept
        f(0x28, 0, 0, 56),      // 14: ldh [56] (destination port)
        f(0x15, 0, 1, 80),      // 15: 80 -> accept, else drop
        f(0x06, 0, 0, 128),     // 16: accept 128 bytes
        f(0x06, 0, 0, 0),       // 17: drop
    ]
}

fn push_recent(r: &mut std::collections::VecDeque<String>, s: String) {
    if r.len() == RECENT_FRAMES {
        r.pop_front();
    }
    r.push_back(s);
}

/// The TCP flags of a captured IPv4 or IPv6 segment.
fn segment_flags(b: &[u8]) -> Option<u8> {
    b.get(tcp_at(b)? + 13).copied()
}

/// One captured TCP segment, briefly: flags, sequence number, payload length.
fn describe_segment(b: &[u8]) -> Option<String> {
    let t = tcp_at(b)?;
    // The frame's end by the IP header's length field (a capture keeps only the headers).
    let total = if b[12..14] == [0x86, 0xdd] { u16::from_be_bytes([*b.get(18)?, *b.get(19)?]) as usize + 54 } else { u16::from_be_bytes([*b.get(16)?, *b.get(17)?]) as usize + 14 };
    let g = b.get(t..t + 14)?;
    let doff = ((g[12] >> 4) as usize) * 4;
    let len = total.saturating_sub(t + doff);
    let f = g[13];
    let names: String = [(0x02, 'S'), (0x01, 'F'), (0x04, 'R'), (0x08, 'P'), (0x10, '.')].iter().filter(|(m, _)| f & m != 0).map(|(_, c)| *c).collect();
    Some(format!("[{names}] seq {} ack {} len {len}", u32::from_be_bytes([g[4], g[5], g[6], g[7]]), u32::from_be_bytes([g[8], g[9], g[10], g[11]])))
}

/// Classic BPF: IPv4 or IPv6 TCP segments with RST set, first 128 bytes.
fn rst_filter() -> Vec<libc::sock_filter> {
    let f = |code: u16, jt: u8, jf: u8, k: u32| libc::sock_filter { code, jt, jf, k };
    vec![
        f(0x28, 0, 0, 12),      // 0: ldh [12]
        f(0x15, 6, 0, 0x86dd),  // 1: ipv6 -> 8
        f(0x15, 0, 10, 0x0800), // 2: not ipv4 -> drop
        f(0x30, 0, 0, 23),      // 3: ldb [23] (protocol)
        f(0x15, 0, 8, 6),       // 4: not tcp -> drop
        f(0xb1, 0, 0, 14),      // 5: ldxb 4*([14]&0xf)
        f(0x50, 0, 0, 27),      // 6: ldb [x+27] (TCP flags)
        f(0x45, 4, 5, 4),       // 7: RST -> accept, else drop
        f(0x30, 0, 0, 20),      // 8: ldb [20] (next header)
        f(0x15, 0, 3, 6),       // 9: not tcp -> drop
        f(0x30, 0, 0, 67),      // 10: ldb [67] (TCP flags)
        f(0x45, 0, 1, 4),       // 11: RST -> accept, else drop
        f(0x06, 0, 0, 128),     // 12: accept 128 bytes
        f(0x06, 0, 0, 0),       // 13: drop
    ]
}

/// One RST frame as text: family, addresses, ports, sequence number.
fn describe_rst(b: &[u8]) -> Option<String> {
    match u16::from_be_bytes([*b.get(12)?, *b.get(13)?]) {
        0x0800 => {
            let ihl = ((b.get(14)? & 0xf) as usize) * 4;
            let t = 14 + ihl;
            let ip = |o: usize| std::net::Ipv4Addr::new(b[o], b[o + 1], b[o + 2], b[o + 3]);
            let g = b.get(t..t + 14)?;
            Some(format!("{}:{} > {}:{} flags {:#04x} seq {}", ip(26), u16::from_be_bytes([g[0], g[1]]), ip(30), u16::from_be_bytes([g[2], g[3]]), g[13], u32::from_be_bytes([g[4], g[5], g[6], g[7]])))
        }
        0x86dd => {
            let a = |o: usize| -> Option<std::net::Ipv6Addr> { Some(std::net::Ipv6Addr::from(<[u8; 16]>::try_from(b.get(o..o + 16)?).ok()?)) };
            let g = b.get(54..68)?;
            Some(format!("[{}]:{} > [{}]:{} flags {:#04x} seq {}", a(22)?, u16::from_be_bytes([g[0], g[1]]), a(38)?, u16::from_be_bytes([g[2], g[3]]), g[13], u32::from_be_bytes([g[4], g[5], g[6], g[7]])))
        }
        _ => None,
    }
}

/// Where the TCP header of a captured IPv4 or IPv6 frame starts (no IPv6 extension headers).
fn tcp_at(b: &[u8]) -> Option<usize> {
    match u16::from_be_bytes([*b.get(12)?, *b.get(13)?]) {
        0x0800 => Some(14 + ((b.get(14)? & 0xf) as usize) * 4),
        0x86dd => Some(54),
        _ => None,
    }
}

/// The destination (client) port of a captured RST.
fn rst_client_port(b: &[u8]) -> Option<u16> {
    let t = tcp_at(b)?;
    Some(u16::from_be_bytes([*b.get(t + 2)?, *b.get(t + 3)?]))
}

/// The local port of each client's connection (by its process id), from `ss` in the client
/// namespace; None for a client without an established connection to port 80.
fn client_ports(env: &ObjectEnv, pids: &[u32]) -> Vec<Option<u16>> {
    let out = lab::run(env.lab.client(), Command::new("ss").args(["-Htnp", "state", "established", "( dport = :80 )"])).ok();
    let text = out.map(|o| String::from_utf8_lossy(&o.stdout).to_string()).unwrap_or_default();
    pids.iter()
        .map(|pid| {
            let tag = format!("pid={pid},");
            text.lines().find(|l| l.contains(&tag)).and_then(|l| l.split_whitespace().find(|w| w.contains(':') && !w.ends_with(":80"))).and_then(|a| a.rsplit(':').next()).and_then(|p| p.parse().ok())
        })
        .collect()
}

/// Opens a capture socket on `dev` in `ns` with the filter `prog`.
fn open_capture(ns: &str, devname: &str, prog: Vec<libc::sock_filter>) -> std::io::Result<i32> {
    let devname = devname.to_string();
    lab::in_ns(ns, move || -> std::io::Result<i32> {
        let proto = (libc::ETH_P_ALL as u16).to_be();
        // SAFETY: plain socket calls on a descriptor we own; closed on every error path.
        unsafe {
            let fd = libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, proto as i32);
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let fail = |fd: i32| {
                let e = std::io::Error::last_os_error();
                libc::close(fd);
                Err(e)
            };
            let fp = libc::sock_fprog { len: prog.len() as u16, filter: prog.as_ptr() as *mut _ };
            if libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_ATTACH_FILTER, &fp as *const _ as *const libc::c_void, std::mem::size_of::<libc::sock_fprog>() as u32) != 0 {
                return fail(fd);
            }
            let rcv: libc::c_int = 16 << 20;
            libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, &rcv as *const _ as *const libc::c_void, 4);
            let tv = libc::timeval { tv_sec: 0, tv_usec: 100_000 };
            libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVTIMEO, &tv as *const _ as *const libc::c_void, std::mem::size_of::<libc::timeval>() as u32);
            let name = std::ffi::CString::new(devname).map_err(std::io::Error::other)?;
            let ifindex = libc::if_nametoindex(name.as_ptr());
            if ifindex == 0 {
                return fail(fd);
            }
            let mut sll: libc::sockaddr_ll = std::mem::zeroed();
            sll.sll_family = libc::AF_PACKET as u16;
            sll.sll_protocol = proto;
            sll.sll_ifindex = ifindex as i32;
            if libc::bind(fd, &sll as *const _ as *const libc::sockaddr, std::mem::size_of::<libc::sockaddr_ll>() as u32) != 0 {
                return fail(fd);
            }
            Ok(fd)
        }
    })?
}

/// One frame on the LB's server bridge.
#[derive(Debug, PartialEq, Eq)]
pub enum Frame {
    /// Server `srv` (its source MAC) sends to the client's `port`.
    FromServer { fam: u8, port: u16, srv: u8 },
    /// The LB forwards the client's segment from `port` to server `srv` (its destination MAC).
    ToServer { fam: u8, port: u16, srv: u8 },
}

fn server_of(mac: &[u8]) -> Option<u8> {
    let m = server_mac(1);
    (mac.len() == 6 && mac[..5] == m[..5]).then(|| mac[5])
}

/// Parses one captured frame.
pub fn parse_frame(b: &[u8]) -> Option<Frame> {
    if b.len() < 14 {
        return None;
    }
    let (fam, t) = match u16::from_be_bytes([b[12], b[13]]) {
        0x0800 => (4, 14 + ((b.get(14)? & 0xf) as usize) * 4),
        0x86dd => (6, 54),
        _ => return None,
    };
    let g = b.get(t..t + 4)?;
    let (sport, dport) = (u16::from_be_bytes([g[0], g[1]]), u16::from_be_bytes([g[2], g[3]]));
    if sport == 80 {
        server_of(&b[6..12]).map(|srv| Frame::FromServer { fam, port: dport, srv })
    } else if dport == 80 {
        server_of(&b[0..6]).map(|srv| Frame::ToServer { fam, port: sport, srv })
    } else {
        None
    }
}

struct Capture {
    stop: Arc<AtomicBool>,
    handle: Option<std::thread::JoinHandle<()>>,
    log: Arc<Mutex<SenderLog>>,
    /// RSTs that reached the client's link: (trial, ms since the run's start, what).
    rsts: Arc<Mutex<Vec<(u16, String)>>>,
    /// RSTs the client's kernel sent (answers to segments of connections it no longer has).
    rsts_sent: Arc<AtomicU64>,
    rst_handle: Option<std::thread::JoinHandle<()>>,
    /// RSTs a server sent (on the LB's server bridge): which server, when (ms since its trial's
    /// start), to which port. A RST that reaches the client says who sent it here.
    server_rsts: Arc<Mutex<Vec<String>>>,
    /// When the capture started, and the current trial's start (ms after it).
    t0: Instant,
    trial_at: Arc<AtomicU64>,
}

impl Capture {
    fn start(lb_ns: &str, client_ns: &str, trial: Arc<AtomicU64>) -> std::io::Result<Capture> {
        let fd = open_capture(lb_ns, dev::BRIDGE, port80_filter())?;
        let rfd = open_capture(client_ns, dev::CLIENT, rst_filter())?;
        let stop = Arc::new(AtomicBool::new(false));
        let log = Arc::new(Mutex::new(SenderLog::default()));
        let rsts = Arc::new(Mutex::new(Vec::new()));
        let rsts_sent = Arc::new(AtomicU64::new(0));
        let server_rsts = Arc::new(Mutex::new(Vec::new()));
        let trial_at = Arc::new(AtomicU64::new(0));
        let (st, rs, tr, sent, ta) = (stop.clone(), rsts.clone(), trial.clone(), rsts_sent.clone(), trial_at.clone());
        let t0 = Instant::now();
        let rst_handle = std::thread::spawn(move || {
            let mut buf = [0u8; 256];
            while !st.load(Ordering::Relaxed) {
                let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
                let mut len = std::mem::size_of::<libc::sockaddr_ll>() as u32;
                // SAFETY: recvfrom into our buffer and address.
                let n = unsafe { libc::recvfrom(rfd, buf.as_mut_ptr() as *mut libc::c_void, buf.len(), 0, &mut sll as *mut _ as *mut libc::sockaddr, &mut len) };
                if n > 0 && sll.sll_pkttype == libc::PACKET_OUTGOING as u8 {
                    sent.fetch_add(1, Ordering::Relaxed);
                } else if n > 0 {
                    let b = &buf[..n as usize];
                    let what = describe_rst(b).unwrap_or_else(|| "unparsed".into());
                    let port = rst_client_port(b).unwrap_or(0);
                    let t = (t0.elapsed().as_millis() as u64).saturating_sub(ta.load(Ordering::Relaxed));
                    rs.lock().unwrap().push((port, format!("trial {} t {t} ms: {what}", tr.load(Ordering::Relaxed))));
                }
            }
            // SAFETY: our descriptor, closed once.
            unsafe { libc::close(rfd) };
        });
        let (st, lg, srs, ta) = (stop.clone(), log.clone(), server_rsts.clone(), trial_at.clone());
        let handle = std::thread::spawn(move || {
            let mut buf = [0u8; 256];
            while !st.load(Ordering::Relaxed) {
                let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
                let mut len = std::mem::size_of::<libc::sockaddr_ll>() as u32;
                // SAFETY: recvfrom into our buffer and address.
                let n = unsafe { libc::recvfrom(fd, buf.as_mut_ptr() as *mut libc::c_void, buf.len(), 0, &mut sll as *mut _ as *mut libc::sockaddr, &mut len) };
                if n <= 0 {
                    continue;
                }
                let t = trial.load(Ordering::Relaxed) as usize;
                let b = &buf[..n as usize];
                let ms = (t0.elapsed().as_millis() as u64).saturating_sub(ta.load(Ordering::Relaxed));
                let note = describe_segment(b).map(|d| format!("{ms} ms {d}"));
                match parse_frame(b) {
                    Some(Frame::FromServer { fam, port, srv }) if sll.sll_pkttype != libc::PACKET_OUTGOING as u8 => {
                        if rst_client_port(b).is_some() && segment_flags(b).is_some_and(|f| f & 0x04 != 0) {
                            srs.lock().unwrap().push(format!("trial {t} t {ms} ms: server {srv} sent a RST to port {port} ({})", describe_rst(b).unwrap_or_default()));
                        }
                        lg.lock().unwrap().from_server_noted(t, fam, port, srv, note)
                    }
                    Some(Frame::ToServer { fam, port, srv }) if sll.sll_pkttype == libc::PACKET_OUTGOING as u8 => lg.lock().unwrap().to_server_noted(t, fam, port, srv, note),
                    _ => {}
                }
            }
            // SAFETY: our descriptor, closed once.
            unsafe { libc::close(fd) };
        });
        Ok(Capture { stop, handle: Some(handle), log, rsts, rsts_sent, rst_handle: Some(rst_handle), server_rsts, t0, trial_at })
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for h in [self.handle.take(), self.rst_handle.take()].into_iter().flatten() {
            let _ = h.join();
        }
    }
}

// ---- the trials --------------------------------------------------------------------------

struct Running {
    kind: &'static str,
    child: Child,
    progress: Arc<AtomicU64>,
    last_ms: Arc<AtomicU64>,
    rx: Option<std::thread::JoinHandle<Reads>>,
    err: Arc<Mutex<String>>,
    status: Option<Option<i32>>,
    hang: bool,
}

fn start_client(env: &ObjectEnv, kind: &'static str, o: &ChaosOpts, t0: Instant) -> Result<Running, String> {
    let mut cmd = match kind {
        "curl" => {
            let mut c = Command::new("curl");
            c.args(["-sS", "--fail", "-o", "-", &env.url(false, "/big.bin")]);
            c
        }
        "wget" => {
            let mut c = Command::new("wget");
            c.args(["-q", "-O", "-", "--tries=1", &env.url(true, "/big.bin")]);
            c
        }
        _ => {
            let mut c = Command::new("python3");
            c.args(["-c", CLIENT_PY, &addr::VIP_V4.to_string(), "big.bin", &o.size.to_string(), &o.parts.to_string(), "0"]);
            c
        }
    };
    let mut child = env.client_cmd(&mut cmd).map_err(|e| format!("starting {kind}: {e}"))?;
    let progress = Arc::new(AtomicU64::new(0));
    let last_ms = Arc::new(AtomicU64::new(t0.elapsed().as_millis() as u64));
    let rx = reader(child.stdout.take().ok_or("stdout")?, t0, o.rate, progress.clone(), last_ms.clone());
    let mut stderr = child.stderr.take().ok_or("stderr")?;
    let err = Arc::new(Mutex::new(String::new()));
    let e2 = err.clone();
    std::thread::spawn(move || {
        let mut t = String::new();
        let _ = stderr.read_to_string(&mut t);
        *e2.lock().unwrap() = t;
    });
    Ok(Running { kind, child, progress, last_ms, rx: Some(rx), err, status: None, hang: false })
}

fn lb_events(env: &ObjectEnv) -> Vec<Value> {
    env.lb_status().ok().and_then(|s| s["events"].as_array().cloned()).unwrap_or_default()
}

fn event_n(e: &Value) -> u64 {
    e["n"].as_u64().unwrap_or(0)
}

/// Waits (bounded) until the LB reported server `i` down after event number `after`, or
/// reports it not alive (it may have been declared dead before the crash: a false suspicion
/// or an agent restart, and not yet back).
fn wait_down(env: &ObjectEnv, i: usize, after: u64, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        let s = env.lb_status().unwrap_or_default();
        let evs = s["events"].as_array().cloned().unwrap_or_default();
        if evs.iter().any(|e| event_n(e) > after && e["server"] == i as u64 && e["kind"] == "down") {
            return true;
        }
        if s["servers"].as_array().is_some_and(|v| v.iter().any(|x| x["id"] == i as u64 && x["alive"] == false)) {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10)); // polling the LB's status file with a deadline
    }
}

/// Waits (bounded) until the LB hears server `i`'s heartbeats.
fn wait_heard(env: &ObjectEnv, i: usize, timeout: Duration) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    loop {
        let heard = env.lb_status().ok().is_some_and(|s| s["servers"].as_array().is_some_and(|v| v.iter().any(|x| x["id"] == i as u64 && x["last_heartbeat_age_ms"].as_u64().is_some_and(|a| a < 1000))));
        if heard {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("the LB did not hear revived server {i} within {timeout:?}"));
        }
        std::thread::sleep(Duration::from_millis(10)); // polling the LB's status file with a deadline
    }
}

/// Between trials: every server up, alive at the LB, owning buckets, the store connected.
fn settle(env: &mut ObjectEnv) -> Result<(), String> {
    let n = env.servers();
    for i in 1..=n {
        if env.is_crashed(i) {
            env.revive(i).map_err(|e| format!("reviving server {i}: {e}"))?;
        }
    }
    // The LB damps flapping: a server with many recent deaths is held back longer on return.
    env.wait_alive(&(1..=n).collect::<Vec<_>>(), SETTLE_DEADLINE).map_err(|_| format!("servers not all alive at the LB within {SETTLE_DEADLINE:?}"))?;
    let deadline = Instant::now() + SETTLE_DEADLINE;
    loop {
        let owners_ok = env.lb_status().ok().is_some_and(|s| {
            let o = s["owners"].as_array().cloned().unwrap_or_default();
            s["epoch"] == s["applied_epoch"] && (1..=n).all(|i| o.iter().any(|x| *x == i as u64))
        });
        if owners_ok {
            break;
        }
        if Instant::now() > deadline {
            return Err(format!("the LB did not give every server its buckets back within {SETTLE_DEADLINE:?}"));
        }
        std::thread::sleep(Duration::from_millis(20)); // polling the LB's status file with a deadline
    }
    env.wait_store(Duration::from_secs(10)).map_err(|e| e.to_string())
}

/// Draws the next fault's kind among `kinds`: a crash only while two servers are alive, a
/// revive only while one is dead. None when no kind is possible now.
fn draw_kind(rng: &mut Rng, env: &ObjectEnv, dead: &[usize], kinds: &[String]) -> Option<&'static str> {
    let alive = (1..=env.servers()).filter(|i| !dead.contains(i)).count();
    let w: Vec<(&'static str, u64)> = FAULT_KINDS
        .iter()
        .copied()
        .filter(|(k, _)| kinds.iter().any(|x| x == k))
        .filter(|(k, _)| match *k {
            "crash" => alive >= 2,
            "revive" => !dead.is_empty(),
            _ => true,
        })
        .collect();
    if w.is_empty() {
        return None;
    }
    let total: u64 = w.iter().map(|x| x.1).sum();
    let mut r = rng.range(0, total - 1);
    for (k, x) in &w {
        if r < *x {
            return Some(k);
        }
        r -= x;
    }
    Some(w[0].0)
}

fn iptables_heartbeats(env: &ObjectEnv, server: usize, op: &str) -> Result<(), String> {
    lab::run_ok(
        env.lab.lb(),
        Command::new("iptables").args(["-w", op, "INPUT", "-p", "udp", "-s", &addr::server_v4(server as u8).to_string(), "--dport", &addr::HEARTBEAT_PORT.to_string(), "-j", "DROP"]),
    )
    .map(|_| ())
    .map_err(|e| format!("iptables {op}: {e}"))
}

/// How long after a fault's end its effects count (a revive and a false suspicion move buckets
/// home after the LB's revive hold).
fn settle_ms(kind: &str) -> u64 {
    SETTLE_MS + if kind == "revive" || kind == "false_suspicion" { unbroken_control::object::lb::DEFAULT_REVIVE_HOLD_MS } else { 0 }
}

struct TrialOut {
    faults: Vec<FaultLog>,
    transfers: Vec<TransferLog>,
    false_failovers: u64,
    provoked: u64,
    rsts: u64,
    error: Option<String>,
    leftovers: Vec<String>,
}

fn trial(env: &mut ObjectEnv, o: &ChaosOpts, k: usize, rng: &mut Rng, want: &str, trial_no: &Arc<AtomicU64>, cap: &Capture) -> Result<TrialOut, String> {
    settle(env)?;
    trial_no.store(k as u64, Ordering::Relaxed);
    let ev0 = lb_events(env).iter().map(event_n).max().unwrap_or(0);
    let rst0 = env.client_rsts();
    // The plan: 1 to 3 faults at progress fractions (of the slowest client).
    let nf = rng.range(1, 3) as usize;
    let mut at: Vec<f64> = (0..nf).map(|_| 0.1 + 0.65 * rng.unit()).collect();
    at.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let t0 = Instant::now();
    cap.trial_at.store(cap.t0.elapsed().as_millis() as u64, Ordering::Relaxed);
    let mut clients = Vec::new();
    for kind in CLIENTS {
        clients.push(start_client(env, kind, o, t0)?);
    }
    let ms = |t0: Instant| t0.elapsed().as_millis() as u64;
    let pids: Vec<u32> = clients.iter().map(|c| c.child.id()).collect();
    let mut ports: Vec<Option<u16>> = vec![None; clients.len()];
    let mut faults: Vec<FaultLog> = Vec::new();
    let mut dead: Vec<usize> = Vec::new();
    let mut error = None;
    let mut suspected: Vec<usize> = Vec::new();
    let mut crashes: HashMap<usize, u64> = HashMap::new();
    loop {
        let now = ms(t0);
        for c in clients.iter_mut().filter(|c| c.status.is_none()) {
            if let Ok(Some(st)) = c.child.try_wait() {
                c.status = Some(st.code());
            } else if now.saturating_sub(c.last_ms.load(Ordering::Relaxed)) >= HANG_AFTER.as_millis() as u64 {
                c.hang = true;
                let _ = c.child.kill();
                c.status = Some(c.child.wait().ok().and_then(|s| s.code()));
            }
        }
        if clients.iter().all(|c| c.status.is_some()) {
            break;
        }
        if ports.iter().any(Option::is_none) && ms(t0) < 10_000 {
            // Each client's connection, once it exists (RSTs are judged by port).
            for (p, q) in ports.iter_mut().zip(client_ports(env, &pids)) {
                *p = p.or(q);
            }
        }
        let running: Vec<u64> = clients.iter().filter(|c| c.status.is_none()).map(|c| c.progress.load(Ordering::Relaxed)).collect();
        let slowest = running.iter().copied().min().unwrap_or(o.size);
        if faults.len() < at.len() && slowest as f64 >= at[faults.len()] * o.size as f64 {
            let Some(kind) = draw_kind(rng, env, &dead, &o.kinds) else {
                // Nothing possible now (only revives asked for, nobody dead): the plan shrinks.
                at.truncate(faults.len());
                continue;
            };
            let at_bytes: Vec<u64> = clients.iter().map(|c| c.progress.load(Ordering::Relaxed)).collect();
            let mid = at_bytes.iter().all(|&b| b > 0 && b < o.size);
            let alive: Vec<usize> = (1..=env.servers()).filter(|i| !dead.contains(i)).collect();
            let serving: Vec<usize> = alive.iter().copied().filter(|&i| env.serving_any(i)).collect();
            let target = rng.pick(if serving.is_empty() { &alive } else { &serving }).unwrap_or(1);
            let start_ms = ms(t0);
            let mut server = target;
            let detail;
            let r: Result<(), String> = match kind {
                "crash" => {
                    detail = "power loss".to_string();
                    let ev = lb_events(env).iter().map(event_n).max().unwrap_or(0);
                    let r = env.crash(target).map_err(|e| format!("crash {target}: {e}"));
                    if r.is_ok() {
                        cap.log.lock().unwrap().crashed(k, target as u8);
                    }
                    dead.push(target);
                    *crashes.entry(target).or_default() += 1;
                    // The next fault comes once the LB has seen this one.
                    if r.is_ok() && !wait_down(env, target, ev, Duration::from_secs(10)) {
                        Err(format!("the LB did not declare crashed server {target} dead within 10 s"))
                    } else {
                        r
                    }
                }
                "revive" => {
                    server = rng.pick(&dead).unwrap_or(target);
                    detail = "boot".to_string();
                    dead.retain(|&d| d != server);
                    // Done once the LB hears it again: when its buckets return is the LB's choice
                    // (the revive hold, longer for a server that died often recently).
                    env.revive(server).map_err(|e| format!("revive {server}: {e}")).and_then(|_| wait_heard(env, server, Duration::from_secs(10)))
                }
                "false_suspicion" => {
                    // Past the LB's deadline, so the LB does declare the server dead.
                    let dead = unbroken_control::object::lb::DEFAULT_DEAD_AFTER_MS;
                    let d = rng.range(dead + 50, dead + 200);
                    detail = format!("heartbeats dropped {d} ms");
                    suspected.push(target);
                    iptables_heartbeats(env, target, "-I").and_then(|_| {
                        std::thread::sleep(Duration::from_millis(d)); // the fault's duration
                        iptables_heartbeats(env, target, "-D")
                    })
                }
                "store_blip" => {
                    let d = rng.range(100, 500);
                    detail = format!("redis stopped {d} ms");
                    server = 0;
                    if env.signal_store(libc::SIGSTOP) {
                        std::thread::sleep(Duration::from_millis(d)); // the fault's duration
                        if env.signal_store(libc::SIGCONT) {
                            Ok(())
                        } else {
                            Err("SIGCONT to redis failed".into())
                        }
                    } else {
                        Err("SIGSTOP to redis failed".into())
                    }
                }
                _ => {
                    let sig = if rng.range(0, 1) == 0 { libc::SIGTERM } else { libc::SIGKILL };
                    detail = if sig == libc::SIGTERM { "SIGTERM".into() } else { "SIGKILL".into() };
                    env.restart_agent(target, sig).map_err(|e| format!("agent restart {target}: {e}"))
                }
            };
            let end_ms = ms(t0);
            if o.live {
                eprintln!("[chaos] trial {k} {:>6} ms {kind} server {server} ({detail}) at {:?} MiB", start_ms, at_bytes.iter().map(|b| b >> 20).collect::<Vec<_>>());
            }
            faults.push(FaultLog { trial: k, kind: kind.to_string(), server, detail, start_ms, end_ms, at_bytes, mid_transfer: mid });
            if let Err(e) = r {
                error.get_or_insert(e);
            }
        }
        std::thread::sleep(Duration::from_millis(5)); // polling progress to time the faults
    }
    // Results.
    let rsts = env.client_rsts().saturating_sub(rst0);
    let mut transfers = Vec::new();
    for (mut c, port) in clients.into_iter().zip(ports) {
        let reads = c.rx.take().and_then(|h| h.join().ok()).unwrap_or_default();
        let stalls = faults
            .iter()
            .map(|f| {
                let i = CLIENTS.iter().position(|k| *k == c.kind).unwrap_or(0);
                let b = f.at_bytes[i];
                (b > 0 && b < o.size).then(|| stall_in(&reads.times, f.start_ms, f.end_ms + settle_ms(&f.kind)).unwrap_or(0))
            })
            .collect();
        let windows: Vec<(u64, u64)> = faults.iter().map(|f| (f.start_ms, f.end_ms + settle_ms(&f.kind))).collect();
        let baseline_gap_ms = reads.times.windows(2).filter(|w| windows.iter().all(|&(a, b)| !((w[1] as u64) > a && (w[0] as u64) < b))).map(|w| (w[1] - w[0]) as u64).max().unwrap_or(0);
        let exit = c.status.flatten();
        transfers.push(TransferLog {
            trial: k,
            client: c.kind.to_string(),
            exit,
            bytes: reads.bytes,
            byte_exact: reads.bytes == o.size && reads.sha256 == want && exit == Some(0),
            hang: c.hang,
            stalls_ms: stalls,
            port,
            baseline_gap_ms,
            stderr: c.err.lock().unwrap().trim().chars().take(300).collect(),
        });
    }
    // LB down events for servers that were not crashed (in this trial, beyond their crashes).
    let evs = lb_events(env);
    let mut downs: BTreeMap<usize, u64> = BTreeMap::new();
    for e in evs.iter().filter(|e| event_n(e) > ev0 && e["kind"] == "down") {
        *downs.entry(e["server"].as_u64().unwrap_or(0) as usize).or_default() += 1;
    }
    let mut false_failovers = 0;
    let mut provoked = 0;
    for (s, n) in downs {
        let f = n.saturating_sub(crashes.get(&s).copied().unwrap_or(0));
        false_failovers += f;
        if suspected.contains(&s) {
            provoked += f.min(suspected.iter().filter(|&&x| x == s).count() as u64);
        }
    }
    let leftovers = leftovers(env, k);
    Ok(TrialOut { faults, transfers, false_failovers, provoked, rsts, error, leftovers })
}

/// What a trial left behind once every client exited (within [`LEFTOVER_WAIT`]): records in the
/// store, connections a live agent lists as rebuilt and still served, with each server's
/// sockets on port 80 for them. A finished connection's record is probed when its bucket moves
/// and rebuilt (its client, in TIME_WAIT, answers the probe); a rebuilt connection listed by an
/// agent is probed by its successor: either ends in the kernel's RST to the client.
fn leftovers(env: &ObjectEnv, trial: usize) -> Vec<String> {
    let deadline = Instant::now() + LEFTOVER_WAIT;
    loop {
        let live: Vec<usize> = (1..=env.servers()).filter(|&i| !env.is_crashed(i)).collect();
        let mut left: Vec<String> = env.records_stored().unwrap_or_else(|| vec!["(the store could not be read)".into()]).into_iter().map(|r| format!("trial {trial}: record {r}")).collect();
        for &i in &live {
            let serving = env.rebuilt_serving(i);
            if serving > 0 {
                left.push(format!("trial {trial}: server {i} still serves {serving} rebuilt connection(s); it lists {:?}", env.rebuilt_listed(i)));
            }
        }
        if left.is_empty() {
            return left;
        }
        if Instant::now() >= deadline {
            for &i in live.iter().filter(|&&i| env.rebuilt_serving(i) > 0) {
                // Where the agent's threads wait (a worker that outlived its connection).
                let conf = env.dir.join(format!("agent{i}.toml"));
                if let Ok(o) = Command::new("pgrep").args(["-f", &conf.to_string_lossy()]).output() {
                    for pid in String::from_utf8_lossy(&o.stdout).split_whitespace() {
                        let mut waits: BTreeMap<String, u64> = BTreeMap::new();
                        for t in std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten() {
                            let p = t.path();
                            let comm = std::fs::read_to_string(p.join("comm")).unwrap_or_default().trim().to_string();
                            let wchan = std::fs::read_to_string(p.join("wchan")).unwrap_or_default().trim().to_string();
                            *waits.entry(format!("{comm}@{wchan}")).or_default() += 1;
                        }
                        left.push(format!("trial {trial}: server {i} agent {pid} threads: {waits:?}"));
                    }
                }
            }
            for &i in &live {
                if let Ok(o) = lab::run(env.lab.server(i), Command::new("ss").args(["-Htn", "state", "all", "( sport = :80 )"])) {
                    let t = String::from_utf8_lossy(&o.stdout).to_string();
                    let socks: Vec<&str> = t.lines().filter(|l| !l.contains("LISTEN")).collect();
                    if !socks.is_empty() {
                        left.push(format!("trial {trial}: server {i} sockets: {}", socks.join(" | ")));
                    }
                }
            }
            return left;
        }
        std::thread::sleep(Duration::from_millis(100)); // polling the store and the lists with a deadline
    }
}

/// How long a finished trial's records and rebuilt connections may take to go.
const LEFTOVER_WAIT: Duration = Duration::from_secs(5);

/// `unbroken demo object --chaos N`: runs the trials and returns the report (`ok` inside).
pub fn run_chaos(o: &ChaosOpts) -> Result<Value, String> {
    if let Some(k) = o.kinds.iter().find(|k| !FAULT_KINDS.iter().any(|f| f.0 == k.as_str())) {
        return Err(format!("unknown fault kind {k:?} ({})", FAULT_KINDS.map(|f| f.0).join(", ")));
    }
    if o.kinds.is_empty() {
        return Err("no fault kind to draw from".into());
    }
    lab::lab_available().map_err(|e| format!("the lab is not available: {e}"))?;
    let mut opts = EnvOpts { servers: 3, ..EnvOpts::default() };
    if let Some(b) = &o.bin {
        opts.bin = b.clone();
    }
    let t_all = Instant::now();
    let mut env = ObjectEnv::start(opts).map_err(|e| format!("starting the system: {e}"))?;
    lab::sysctls(env.lab.client(), &[("net.ipv4.tcp_rmem", CLIENT_RMEM)]).map_err(|e| format!("client tcp_rmem: {e}"))?;
    let want = make_object(&env.docroot.join("big.bin"), o.size, 42).map_err(|e| e.to_string())?;
    let trial_no = Arc::new(AtomicU64::new(0));
    let capture = Capture::start(env.lab.lb(), env.lab.client(), trial_no.clone()).map_err(|e| format!("capture on the LB's server bridge: {e}"))?;
    // RSTs are counted over the whole run: one may reach a client between trials (a stale
    // server socket answering after the transfer ended).
    let rsts_at_start = env.client_rsts();
    let mut rng = Rng::new(o.seed);
    let mut faults: Vec<FaultLog> = Vec::new();
    let mut transfers: Vec<TransferLog> = Vec::new();
    let (mut false_failovers, mut provoked, mut rsts_in_trials) = (0u64, 0u64, 0u64);
    let mut errors: Vec<String> = Vec::new();
    let mut leftovers: Vec<String> = Vec::new();
    for k in 1..=o.trials {
        match trial(&mut env, o, k, &mut rng, &want, &trial_no, &capture) {
            Ok(t) => {
                if o.live {
                    let summary: Vec<String> = t.transfers.iter().map(|x| format!("{} {}{} stalls {:?} (baseline {})", x.client, if x.byte_exact { "ok" } else { "FAILED" }, if x.hang { " HANG" } else { "" }, x.stalls_ms.iter().map(|s| s.map_or("-".to_string(), |v| v.to_string())).collect::<Vec<_>>(), x.baseline_gap_ms)).collect();
                    eprintln!("[chaos] trial {k}: {}; RSTs {}, false failovers {}", summary.join(", "), t.rsts, t.false_failovers);
                }
                faults.extend(t.faults);
                transfers.extend(t.transfers);
                leftovers.extend(t.leftovers);
                false_failovers += t.false_failovers;
                provoked += t.provoked;
                rsts_in_trials += t.rsts;
                if let Some(e) = t.error {
                    errors.push(format!("trial {k}: {e}"));
                }
            }
            Err(e) => {
                errors.push(format!("trial {k}: {e}"));
                break;
            }
        }
    }
    let (two, switches, frames) = {
        let l = capture.log.lock().unwrap();
        (l.two_senders(), l.switches, l.frames)
    };
    let rsts = env.client_rsts().saturating_sub(rsts_at_start);
    let rst_log: Vec<(u16, String)> = capture.rsts.lock().unwrap().clone();
    let transfer_ports: Vec<u16> = transfers.iter().filter_map(|t| t.port).collect();
    let rsts_on_transfers = rst_log.iter().filter(|(p, _)| transfer_ports.contains(p)).count();
    let ports_known = transfers.iter().filter(|t| t.port.is_some()).count();
    let rst_log: Vec<String> = rst_log.into_iter().map(|(p, s)| if transfer_ports.contains(&p) { format!("{s} (a transfer's connection)") } else { s }).collect();
    let rsts_sent = capture.rsts_sent.load(Ordering::Relaxed);
    let server_rsts: Vec<String> = capture.server_rsts.lock().unwrap().clone();
    drop(capture);
    let exact = transfers.iter().filter(|t| t.byte_exact).count();
    let hangs = transfers.iter().filter(|t| t.hang).count();
    let all: Vec<u64> = transfers.iter().flat_map(|t| t.stalls_ms.iter().flatten().copied()).collect();
    let mut by_client = serde_json::Map::new();
    for kind in CLIENTS {
        let v: Vec<u64> = transfers.iter().filter(|t| t.client == kind).flat_map(|t| t.stalls_ms.iter().flatten().copied()).collect();
        by_client.insert(kind.to_string(), stats(&v));
    }
    let mut by_fault = serde_json::Map::new();
    for (kind, _) in FAULT_KINDS {
        let v: Vec<u64> = transfers
            .iter()
            .flat_map(|t| faults.iter().filter(|f| f.trial == t.trial).zip(&t.stalls_ms).filter(|(f, _)| f.kind == kind).filter_map(|(_, s)| *s))
            .collect();
        if !v.is_empty() {
            by_fault.insert(kind.to_string(), stats(&v));
        }
    }
    // Item 6 of issue 8: the stall after a server death, per client kind.
    let mut after_crash = serde_json::Map::new();
    for kind in CLIENTS {
        let v: Vec<u64> = transfers
            .iter()
            .filter(|t| t.client == kind)
            .flat_map(|t| faults.iter().filter(|f| f.trial == t.trial).zip(&t.stalls_ms).filter(|(f, _)| f.kind == "crash").filter_map(|(_, s)| *s))
            .collect();
        after_crash.insert(kind.to_string(), stats(&v));
    }
    let mut baseline = serde_json::Map::new();
    for kind in CLIENTS {
        let v: Vec<u64> = transfers.iter().filter(|t| t.client == kind).map(|t| t.baseline_gap_ms).collect();
        baseline.insert(kind.to_string(), stats(&v));
    }
    let mut kinds: BTreeMap<String, u64> = BTreeMap::new();
    for f in &faults {
        *kinds.entry(f.kind.clone()).or_default() += 1;
    }
    let failed: Vec<&TransferLog> = transfers.iter().filter(|t| !t.byte_exact || t.hang).collect();
    // The fault kinds of the trials with a failed transfer, in order ("agent_restart+crash").
    let mut failed_by: BTreeMap<String, u64> = BTreeMap::new();
    let mut trials_failed: Vec<usize> = failed.iter().map(|t| t.trial).collect();
    trials_failed.dedup();
    for k in &trials_failed {
        let combo: Vec<&str> = faults.iter().filter(|f| f.trial == *k).map(|f| f.kind.as_str()).collect();
        *failed_by.entry(combo.join("+")).or_default() += 1;
    }
    let trials_run = transfers.iter().map(|t| t.trial).max().unwrap_or(0);
    let ok = errors.is_empty() && trials_run == o.trials && exact == transfers.len() && rsts == 0 && hangs == 0 && two.is_empty() && leftovers.is_empty();
    Ok(json!({
        "ok": ok,
        "seed": o.seed,
        "trials": trials_run,
        "byte_exact": {"exact": exact, "total": transfers.len()},
        "resets_seen_by_client": rsts,
        "resets_during_trials": rsts_in_trials,
        "resets": rst_log,
        "resets_on_transfer_connections": rsts_on_transfers,
        "transfer_ports_known": ports_known,
        "resets_sent_by_client": rsts_sent,
        "resets_sent_by_servers": server_rsts,
        "leftovers": leftovers,
        "hangs": hangs,
        "stall_ms": stats(&all),
        "stall_ms_by_client": by_client,
        "stall_ms_by_fault": by_fault,
        "stall_ms_after_crash_by_client": after_crash,
        "baseline_gap_ms_by_client": baseline,
        "false_failovers": false_failovers,
        "false_failovers_provoked": provoked,
        "two_senders_seen": two.len(),
        "two_senders": two,
        "sender_switches": switches,
        "frames_captured": frames,
        "faults": kinds,
        "faults_mid_transfer": faults.iter().filter(|f| f.mid_transfer).count(),
        "errors": errors,
        "failed_transfers": failed,
        "transfers": transfers.iter().map(|t| json!({"trial": t.trial, "client": t.client, "exit": t.exit, "byte_exact": t.byte_exact, "hang": t.hang, "port": t.port, "stalls_ms": t.stalls_ms, "baseline_gap_ms": t.baseline_gap_ms})).collect::<Vec<_>>(),
        "failed_trials_by_faults": failed_by,
        "fault_log": faults,
        "settings": {"kinds": o.kinds, "size": o.size, "rate": o.rate, "parts": o.parts, "dead_after_ms": unbroken_control::object::lb::DEFAULT_DEAD_AFTER_MS},
        "duration_ms": t_all.elapsed().as_millis() as u64,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleaved_senders_count_a_clean_handover_does_not() {
        let mut l = SenderLog::default();
        // Failover 1 -> 2, then home to 1: each handover clean.
        l.to_server(1, 4, 5000, 1);
        l.from_server(1, 4, 5000, 1);
        l.from_server(1, 4, 5000, 1);
        l.to_server(1, 4, 5000, 2);
        l.from_server(1, 4, 5000, 2);
        l.to_server(1, 4, 5000, 1);
        l.from_server(1, 4, 5000, 1);
        assert!(l.two_senders().is_empty());
        assert_eq!(l.switches, 2);
        // The LB forwards to 2; 1 sends, 2 sends, 1 sends again: two senders.
        l.to_server(1, 4, 5001, 2);
        for s in [1, 2, 1] {
            l.from_server(1, 4, 5001, s);
        }
        assert_eq!(l.two_senders().len(), 1);
        // The old owner's last frames after the move, then only the new one: a handover.
        l.to_server(1, 6, 5002, 2);
        for s in [1, 2, 2] {
            l.from_server(1, 6, 5002, s);
        }
        assert_eq!(l.two_senders().len(), 1);
        // The owner loses its power; its successor's probe leaves before any client segment
        // shows the move: a handover, not two senders.
        l.to_server(1, 4, 5003, 2);
        for s in [1, 2] {
            l.from_server(1, 4, 5003, s);
        }
        l.crashed(1, 2);
        l.from_server(1, 4, 5003, 1);
        assert_eq!(l.two_senders().len(), 1);
        // But a server that sent, then another, then the first again while nobody crashed is
        // reported with the frames that show it.
        l.to_server(2, 4, 5004, 2);
        l.from_server_noted(2, 4, 5004, 1, Some("10 ms [.] seq 1 ack 1 len 0".into()));
        l.from_server_noted(2, 4, 5004, 2, Some("11 ms [.] seq 1 ack 1 len 1448".into()));
        l.crashed(2, 3);
        l.from_server_noted(2, 4, 5004, 1, Some("12 ms [.] seq 1449 ack 1 len 1448".into()));
        let two = l.two_senders();
        assert_eq!(two.len(), 2);
        assert!(two.iter().any(|t| t.contains("port 5004") && t.contains("11 ms [.] seq 1 ack 1 len 1448 <- 2")), "{two:?}");
        // An interloper that then loses its power: the owner's next frame still shows it.
        l.to_server(3, 4, 5005, 2);
        for s in [2, 1] {
            l.from_server(3, 4, 5005, s);
        }
        l.crashed(3, 1);
        l.from_server(3, 4, 5005, 2);
        assert_eq!(l.two_senders().len(), 3, "{:?}", l.two_senders());
    }

    #[test]
    fn segments_are_described() {
        let mut f = vec![0u8; 54];
        f[12] = 0x08;
        f[14] = 0x45;
        f[16] = 0;
        f[17] = 40;
        f[34 + 4..34 + 8].copy_from_slice(&7u32.to_be_bytes());
        f[34 + 12] = 0x50;
        f[34 + 13] = 0x14;
        assert_eq!(segment_flags(&f), Some(0x14));
        assert_eq!(describe_segment(&f).as_deref(), Some("[R.] seq 7 ack 0 len 0"));
    }

    #[test]
    fn stall_overlaps_the_window() {
        let t = [0, 10, 20, 300, 310, 320];
        assert_eq!(stall_in(&t, 100, 150), Some(280));
        assert_eq!(stall_in(&t, 305, 315), Some(10));
        assert_eq!(stall_in(&t, 400, 500), None);
        assert_eq!(percentile(&[1, 2, 3, 4], 50.0), 2);
        assert_eq!(percentile(&[1, 2, 3, 4], 99.0), 4);
    }

    #[test]
    fn frames_parse() {
        let mut f = vec![0u8; 80];
        f[6..12].copy_from_slice(&server_mac(2));
        f[12] = 0x08;
        f[14] = 0x45;
        f[34] = 0;
        f[35] = 80;
        f[36] = 0x9c;
        f[37] = 0x40;
        assert_eq!(parse_frame(&f), Some(Frame::FromServer { fam: 4, port: 40000, srv: 2 }));
        f[12..14].copy_from_slice(&[0x86, 0xdd]);
        f[54] = 0;
        f[55] = 80;
        f[56] = 0x9c;
        f[57] = 0x41;
        assert_eq!(parse_frame(&f), Some(Frame::FromServer { fam: 6, port: 40001, srv: 2 }));
        f[6] = 0x12;
        assert_eq!(parse_frame(&f), None);
        // The client's segment forwarded to server 3.
        f[0..6].copy_from_slice(&server_mac(3));
        f[54..58].copy_from_slice(&[0x9c, 0x41, 0, 80]);
        assert_eq!(parse_frame(&f), Some(Frame::ToServer { fam: 6, port: 40001, srv: 3 }));
    }
}
