//! Deterministic simulation of replica mode (issue 10 item 5): an unmodified client, a primary
//! and a backup host each running the same deterministic server, the two engines
//! (`replica::Primary`, `replica::Backup`) and two `replica::Detector`s, over a simulated
//! segment where every client packet reaches both hosts (ST-TCP 3.2.1) and a side channel
//! carries the progress heartbeats through their wire format and MAC.
//!
//! ```text
//!            ┌──incoming()──► primary's stack ──outgoing()──┐ (held / released / fresh ACKs)
//!   client ──┤                                              ├──► client
//!            └──incoming()──► backup's stack ──outgoing()───┘ (withheld until take-over)
//!                 backup ──progress──► primary      primary ──report──► backup (beats)
//! ```
//!
//! Every TCP stack is smoltcp (userspace), with its own ISN and timestamp clock, so the backup
//! really has to be aligned. The server reads requests of `REQ` bytes and answers each with a
//! reply that is a function of the request; after the last one it closes. Faults, one per run
//! (ST-TCP Table 3.3's single failures and a few more), at a time drawn from the seed: host crash
//! of either side, application crash with FIN, with RST or without either (a hang) on one side,
//! temporary loss at the backup, a backup that lags beyond the bound, the side channel cut (a
//! false suspicion: the fence makes it true), non-determinism (the backup's server answers one
//! reply differently).
//!
//! Every run asserts: the client's stream is byte-exact (checked at every byte) and complete, it
//! ends with the server's FIN; no RST ever reaches the client; never two hosts answering (no
//! packet leaves the primary toward the client once the backup is promoted, none leaves the
//! backup while the primary is alive); every packet either engine passes or builds has valid
//! checksums (smoltcp verifies them); the run ends within a virtual time bound.
//!
//! A third of the runs put the segment at fault: loss on every copy of every packet, jitter that
//! reorders, a lossy and reordering side channel. Three things Linux does and smoltcp does not
//! are emulated by the link, each where it is written: a segment whose ACK is older than one
//! its receiver already got is given the newer ACK (Linux takes its data, smoltcp drops it); the
//! FIN of a segment whose data the client already has is delivered alone (smoltcp drops the
//! segment as a duplicate); a FIN beyond a gap is held back until the gap fills (Linux queues it
//! out of order, smoltcp drops it).
//!
//! A failing run prints how to replay it: `SIM_FAULT=<fault> SIM_SEED=<seed> cargo test
//! --release -p unbroken-engines --test replica_sim replay -- --nocapture` (with `SIM_TRACE=1`
//! for every packet). `SIM_SCALE` multiplies the number of seeds.

use std::cell::Cell;
use std::collections::VecDeque;
use std::net::Ipv4Addr;

use smoltcp::iface::{Config, Interface, SocketHandle, SocketSet};
use smoltcp::socket::tcp::{self, State};
use smoltcp::time::Instant;
use smoltcp::wire::{HardwareAddress, IpAddress, IpCidr, IpEndpoint};

use unbroken_engines::replica::{
    RelayFrom, Backup, Config as PConfig, ConnKey, Detector, DetectorAction, DetectorConfig, Notice, Primary,
    ReadWatch, ServerSocket, Why,
};
use unbroken_engines::Verdict;
use unbroken_wire::ctl::Key;
use unbroken_wire::replica::{self as rw, ConnProgress, Progress, Role};
use unbroken_wire::Seq;

const SVC: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 0, 9, 2);
const PORT: u16 = 6379;
const CPORT: u16 = 40123;
const REQ: usize = 150;
/// The daemons sample their servers' sockets this often ([`ReadWatch`]).
const READ_CHECK_MS: u64 = 20;
/// The hang bound ([`PConfig::max_hang_ms`]), the daemons' default.
const MAX_HANG_MS: u64 = unbroken_engines::replica::DEFAULT_MAX_HANG_MS;

fn scale() -> u64 {
    std::env::var("SIM_SCALE").ok().and_then(|v| v.parse().ok()).unwrap_or(1)
}

struct Rng(u64);
impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xd1b5_4a32_d192_ed03)
    }
    fn next(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 * 1.0 < p
    }
}

// ---------------------------------------------------------------------------------------------
// Clocks for TCP timestamps (smoltcp takes a plain `fn() -> u32`)
// ---------------------------------------------------------------------------------------------

thread_local! {
    static NOW: Cell<u64> = const { Cell::new(0) };
    static TS_P: Cell<u32> = const { Cell::new(0) };
    static TS_B: Cell<u32> = const { Cell::new(0) };
}
fn now_ms() -> u64 {
    NOW.with(|n| n.get())
}
fn ts_client() -> u32 {
    (now_ms() as u32).wrapping_add(5_000_000)
}
fn ts_primary() -> u32 {
    (now_ms() as u32).wrapping_add(TS_P.with(|c| c.get()))
}
fn ts_backup() -> u32 {
    (now_ms() as u32).wrapping_add(TS_B.with(|c| c.get()))
}

// ---------------------------------------------------------------------------------------------
// Simulated device and host
// ---------------------------------------------------------------------------------------------

#[path = "common/simdev.rs"]
mod simdev;
use simdev::Dev;

struct Host {
    iface: Interface,
    dev: Dev,
    sockets: SocketSet<'static>,
    sock: SocketHandle,
}

impl Host {
    fn new(ip: Ipv4Addr, seed: u64, buf: usize, ts: Option<fn() -> u32>) -> Host {
        let mut dev = Dev::default();
        let mut cfg = Config::new(HardwareAddress::Ip);
        cfg.random_seed = seed;
        let mut iface = Interface::new(cfg, &mut dev, Instant::from_millis(0));
        iface.update_ip_addrs(|a| a.push(IpCidr::new(IpAddress::Ipv4(ip), 8)).unwrap());
        let mut s = tcp::Socket::new(tcp::SocketBuffer::new(vec![0; buf]), tcp::SocketBuffer::new(vec![0; buf]));
        s.set_tsval_generator(ts);
        let mut sockets = SocketSet::new(vec![]);
        let sock = sockets.add(s);
        Host { iface, dev, sockets, sock }
    }
    fn poll(&mut self, now: u64) {
        self.iface.poll(Instant::from_millis(now as i64), &mut self.dev, &mut self.sockets);
    }
    fn tcp(&mut self) -> &mut tcp::Socket<'static> {
        self.sockets.get_mut::<tcp::Socket>(self.sock)
    }
}

// ---------------------------------------------------------------------------------------------
// The deterministic server and the client
// ---------------------------------------------------------------------------------------------

fn request(seed: u64, i: usize) -> Vec<u8> {
    let mut r = Rng::new(seed ^ (i as u64) << 32);
    (0..REQ).map(|_| r.next() as u8).collect()
}

fn reply(req: &[u8], i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|j| req[j % REQ] ^ (i as u8).wrapping_mul(31) ^ (j as u8).wrapping_mul(7)).collect()
}

/// How one server's application misbehaves, from `at` on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum AppFault {
    None,
    /// Crash; its kernel closes the socket (FIN).
    Fin,
    /// Crash; its kernel resets the socket.
    Rst,
    /// Hangs: neither reads nor writes, the socket stays open.
    Hang,
    /// Serves at most one request every 8 s (beyond the primary's 5 s AppMaxLagTime).
    Slow,
    /// Answers request `at` differently (non-determinism).
    Corrupt,
    /// Reads and answers nothing for a second from `at` (a long command), then goes on.
    Pause,
}

struct App {
    inbuf: Vec<u8>,
    /// Bytes read from the socket so far (the kernel's `received - unread`).
    consumed: u64,
    /// The daemon's read watch on this server.
    watch: ReadWatch,
    served: usize,
    outq: VecDeque<u8>,
    closed: bool,
    dead: bool,
    fault: AppFault,
    at: u64,
    last_served_ms: u64,
}

impl App {
    fn new(fault: AppFault, at: u64) -> App {
        App {
            inbuf: vec![],
            consumed: 0,
            watch: ReadWatch::default(),
            served: 0,
            outq: VecDeque::new(),
            closed: false,
            dead: false,
            fault,
            at,
            last_served_ms: 0,
        }
    }
    /// The daemon's sample of this server's socket: since when it has read nothing while input
    /// waited ([`ReadWatch::sample`]).
    fn sample(&mut self, s: &tcp::Socket<'static>, now: u64) -> Option<u64> {
        let unread = s.recv_queue() as u32;
        // Its CPU time: a paused (busy) server computes, a hung one does not.
        let cpu = if self.fault == AppFault::Pause && now >= self.at && now < self.at + 1_000 {
            now
        } else {
            self.consumed
        };
        self.watch.sample(
            now,
            &[ServerSocket {
                id: 1,
                key: ConnKey { client: std::net::IpAddr::V4(CLIENT), client_port: CPORT, server_port: PORT },
                unread,
                received: self.consumed + unread as u64,
                send_queued: 0,
                send_buf: 0,
            }],
            Some(cpu),
        )
    }

    fn run(&mut self, s: &mut tcp::Socket<'static>, sc: &Scenario, now: u64) {
        if self.dead {
            return;
        }
        if now >= self.at {
            match self.fault {
                AppFault::Fin => {
                    s.close();
                    self.dead = true;
                    return;
                }
                AppFault::Rst => {
                    s.abort();
                    self.dead = true;
                    return;
                }
                AppFault::Hang => return,
                AppFault::Pause if now < self.at + 1_000 => return,
                _ => {}
            }
        }
        while s.can_recv() {
            let mut b = [0u8; 2048];
            let n = s.recv_slice(&mut b).unwrap_or(0);
            if n == 0 {
                break;
            }
            self.inbuf.extend_from_slice(&b[..n]);
            self.consumed += n as u64;
        }
        while self.inbuf.len() >= REQ && self.served < sc.nreq {
            if self.fault == AppFault::Slow && now >= self.at && now < self.last_served_ms + 8_000 {
                break;
            }
            let req: Vec<u8> = self.inbuf.drain(..REQ).collect();
            let mut rep = reply(&req, self.served, sc.reply_len);
            if self.fault == AppFault::Corrupt && self.served == self.at as usize {
                rep[sc.reply_len / 2] ^= 0x55;
            }
            self.outq.extend(rep);
            self.served += 1;
            self.last_served_ms = now;
        }
        while !self.outq.is_empty() && s.can_send() {
            let (a, _) = self.outq.as_slices();
            let n = s.send_slice(a).unwrap_or(0);
            if n == 0 {
                break;
            }
            self.outq.drain(..n);
        }
        if self.served == sc.nreq && self.outq.is_empty() && !self.closed {
            s.close();
            self.closed = true;
        }
    }
}

struct ClientApp {
    sent: usize,
    got: Vec<u8>,
    expected: Vec<u8>,
    eof: bool,
    last_progress: u64,
    max_stall: u64,
}

// ---------------------------------------------------------------------------------------------
// Scenario
// ---------------------------------------------------------------------------------------------

/// One fault per run (ST-TCP Table 3.3 and a few more).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    None,
    /// Row 1, primary: the primary host dies (silent).
    PrimaryHostCrash,
    /// Row 1, backup.
    BackupHostCrash,
    /// Row 2, primary / backup: the application hangs, no FIN or RST.
    PrimaryAppHang,
    BackupAppHang,
    /// Row 3: the application crashes and its kernel sends a FIN / a RST, on one side.
    PrimaryAppFin,
    PrimaryAppRst,
    BackupAppFin,
    BackupAppRst,
    /// Row 5, backup: client packets toward the backup lost for a while.
    BackupTemporaryLoss,
    /// The backup lags beyond the bound (a slow backup application).
    BackupLagging,
    /// The side channel is cut both ways: a false suspicion, made true by the fence.
    SideChannelCut,
    /// The backup's server answers one request differently.
    Nondeterministic,
    /// Row 5 then row 1: client packets toward the backup are being lost when the primary host
    /// crashes. ST-TCP loses the bytes the backup was fetching from the primary (3.7.5); with
    /// Koch's min ACK the client still holds them and resends them to the backup.
    LossThenPrimaryCrash,
    /// Both servers stop reading and answering for a second at the same time (a long command
    /// of a deterministic server): both hung, neither failed.
    LongCommand,
    /// Every client packet toward the primary is lost for 300 ms (the backup hears them).
    PrimaryTemporaryLoss,
}

const ALL_FAULTS: [Fault; 16] = [
    Fault::None,
    Fault::PrimaryHostCrash,
    Fault::BackupHostCrash,
    Fault::PrimaryAppHang,
    Fault::BackupAppHang,
    Fault::PrimaryAppFin,
    Fault::PrimaryAppRst,
    Fault::BackupAppFin,
    Fault::BackupAppRst,
    Fault::BackupTemporaryLoss,
    Fault::BackupLagging,
    Fault::SideChannelCut,
    Fault::Nondeterministic,
    Fault::LossThenPrimaryCrash,
    Fault::LongCommand,
    Fault::PrimaryTemporaryLoss,
];

#[derive(Clone, Debug)]
struct Scenario {
    fault: Fault,
    seed: u64,
    strict: bool,
    timestamps: bool,
    nreq: usize,
    reply_len: usize,
    /// When the fault strikes (ms; for `Nondeterministic`, the request answered differently).
    at: u64,
    hb: DetectorConfig,
    /// The first fence attempt fails.
    fence_fails_first: bool,
    max_ms: u64,
    /// Loss on each copy of each packet between the client and the hosts, and extra latency
    /// of 0..=jitter ms (which reorders).
    loss: f64,
    jitter: u64,
    /// Loss on the side channel (its messages get the same jitter).
    side_loss: f64,
    /// Socket buffers of every host (the client's receive window).
    buf: usize,
    /// A server packet lost on its own host before its engine saw it (an NFQUEUE that
    /// overflowed), each host independently.
    out_drop: f64,
}

impl Scenario {
    fn from_seed(fault: Fault, seed: u64) -> Scenario {
        let mut r = Rng::new(seed);
        let nreq = 4 + r.below(12) as usize;
        let reply_len = [40, 900, 3000, 10_000][r.below(4) as usize];
        let strict = fault == Fault::Nondeterministic || r.below(4) != 0;
        let timestamps = r.below(2) == 0;
        let at = if fault == Fault::Nondeterministic { r.below(nreq as u64) } else { 1 + r.below(6 * nreq as u64 + 10) };
        let hb = DetectorConfig { interval_ms: [10, 10, 5, 20][r.below(4) as usize], misses: 2 + r.below(3) as u32 };
        let fence_fails_first = r.below(5) == 0;
        // A third of the runs on a faulty segment: loss, jitter (reordering), and a lossy,
        // reordering side channel (then at least three misses, so that a false suspicion stays
        // rare; one is still safe: the fence makes it true).
        let (loss, jitter, side_loss) = match r.below(3) {
            0 => ([0.005, 0.01, 0.02][r.below(3) as usize], r.below(4), [0.0, 0.01, 0.02][r.below(3) as usize]),
            _ => (0.0, 0, 0.0),
        };
        let hb = if side_loss > 0.0 { DetectorConfig { misses: hb.misses.max(4), ..hb } } else { hb };
        Scenario { fault, seed, strict, timestamps, nreq, reply_len, at, hb, fence_fails_first, max_ms: 300_000, loss, jitter, side_loss, buf: 64 * 1024, out_drop: 0.0 }
    }

    /// Issue 20's load: replies of 100-400 KB through a 256 KiB window, strict, timestamps on
    /// (PAWS), and in half the runs server packets lost before their engine (a queue that
    /// overflowed: the primary's engine then sees its own server's output with a gap).
    fn large_from_seed(fault: Fault, seed: u64) -> Scenario {
        let mut sc = Scenario::from_seed(fault, seed);
        let mut r = Rng::new(seed ^ 0x1a56e);
        sc.reply_len = [100_000, 250_000, 400_000][r.below(3) as usize];
        sc.nreq = 2 + r.below(4) as usize;
        sc.strict = true;
        sc.timestamps = true;
        sc.buf = 256 * 1024;
        // No reordering: smoltcp's client keeps only a few out-of-order ranges, so a reordered
        // 256 KiB window is recovered by go-back-N timeouts, which says nothing about the engines.
        sc.jitter = 0;
        sc.out_drop = if r.below(2) == 0 { [0.001, 0.01][r.below(2) as usize] } else { 0.0 };
        if fault != Fault::Nondeterministic {
            sc.at = 1 + r.below(400);
        }
        sc
    }
    fn replay_hint(&self) -> String {
        let large = if self.buf > 64 * 1024 { "SIM_LARGE=1 " } else { "" };
        format!("replay: {large}SIM_FAULT={:?} SIM_SEED={} cargo test --release -p unbroken-engines --test replica_sim replay -- --nocapture (SIM_TRACE=1 for every packet)", self.fault, self.seed)
    }
}

#[derive(Debug, Default)]
struct Report {
    virtual_ms: u64,
    takeover_at: Option<u64>,
    primary_killed_at: Option<u64>,
    backup_failed_at: Option<u64>,
    unprotected: Vec<Why>,
    stale: Option<Why>,
    /// Segments the client's TCP discarded by PAWS (Linux's rule, emulated by the link).
    paws_dropped: u64,
    yields: u32,
    fences: u32,
    max_stall_ms: u64,
    fresh_acks: u64,
    /// Client ACKs the backup heard and the primary's host missed, given to its server.
    acks_from_backup: u64,
    /// Client bytes the backup relayed to the primary, and those the primary's server got.
    relayed_to_primary: u64,
    backup_input: u64,
    acks_lowered: u64,
    held: u64,
    diverged: u64,
    withheld: u64,
    aligned: u64,
    ack_clamped: u64,
    unaligned_dropped: u64,
    /// Client bytes the primary relayed to the backup (ST-TCP 3.6).
    relayed: u64,
}

// ---------------------------------------------------------------------------------------------
// The simulation
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum To {
    Client,
    Primary,
    Backup,
    /// A FIN the link holds back until it is in order (Linux's out-of-order queue): it was
    /// checked (PAWS) when it first arrived.
    ClientQueued,
}

struct Sim {
    /// The backup's daemon found its server hung (flagged in its progress messages).
    backup_hung: bool,
    sc: Scenario,
    rng: Rng,
    now: u64,
    client: Host,
    capp: ClientApp,
    primary: Host,
    papp: App,
    backup: Host,
    bapp: App,
    peng: Primary,
    beng: Backup,
    pdet: Detector,
    bdet: Detector,
    primary_alive: bool,
    backup_alive: bool,
    /// In flight: (deliver at, to, packet).
    link: Vec<(u64, To, Vec<u8>)>,
    side: Vec<(u64, Role, Vec<u8>)>,
    key: Key,
    beat: u64,
    fence_attempts: u32,
    /// The server's ISN as the client knows it, and the client's receive state (offsets).
    server_isn: Option<u32>,
    client_rcv: u64,
    client_ooo: Vec<(u64, u64)>,
    /// The newest ACK each receiver got (client, primary, backup).
    newest_ack: [Option<unbroken_wire::Seq>; 3],
    /// The client's TS.Recent (PAWS).
    ts_recent: Option<u32>,
    report: Report,
    trace: bool,
    log: VecDeque<String>,
}

fn describe(p: &[u8]) -> String {
    match smoltcp::wire::Ipv4Packet::new_checked(p).and_then(|ip| smoltcp::wire::TcpPacket::new_checked(ip.payload()).map(|t| (ip.src_addr(), t.src_port(), t.seq_number(), t.ack_number(), t.syn(), t.fin(), t.rst(), t.payload().len(), t.window_len()))) {
        Ok((src, sp, seq, ack, syn, fin, rst, n, w)) => format!("{src}:{sp} seq={seq} ack={ack} len={n} win={w}{}{}{}", if syn { " SYN" } else { "" }, if fin { " FIN" } else { "" }, if rst { " RST" } else { "" }),
        Err(e) => format!("<bad packet: {e}>"),
    }
}

impl Sim {
    fn new(sc: Scenario) -> Sim {
        NOW.with(|n| n.set(0));
        let mut r = Rng::new(sc.seed ^ 0xabcdef);
        TS_P.with(|c| c.set(r.next() as u32));
        TS_B.with(|c| c.set(r.next() as u32));
        let ts = |f: fn() -> u32| if sc.timestamps { Some(f) } else { None };
        let mut client = Host::new(CLIENT, r.next(), sc.buf, ts(ts_client));
        let mut primary = Host::new(SVC, r.next(), sc.buf, ts(ts_primary));
        let mut backup = Host::new(SVC, r.next(), sc.buf, ts(ts_backup));
        primary.tcp().listen(PORT).unwrap();
        backup.tcp().listen(PORT).unwrap();
        let cx = client.iface.context();
        client.sockets.get_mut::<tcp::Socket>(client.sock).connect(cx, IpEndpoint::new(IpAddress::Ipv4(SVC), PORT), CPORT).unwrap();
        let (pf, bf) = match sc.fault {
            Fault::PrimaryAppHang => (AppFault::Hang, AppFault::None),
            Fault::PrimaryAppFin => (AppFault::Fin, AppFault::None),
            Fault::PrimaryAppRst => (AppFault::Rst, AppFault::None),
            Fault::BackupAppHang => (AppFault::None, AppFault::Hang),
            Fault::BackupAppFin => (AppFault::None, AppFault::Fin),
            Fault::BackupAppRst => (AppFault::None, AppFault::Rst),
            Fault::BackupLagging => (AppFault::None, AppFault::Slow),
            Fault::Nondeterministic => (AppFault::None, AppFault::Corrupt),
            Fault::LongCommand => (AppFault::Pause, AppFault::Pause),
            _ => (AppFault::None, AppFault::None),
        };
        let mut expected = vec![];
        for i in 0..sc.nreq {
            expected.extend(reply(&request(sc.seed, i), i, sc.reply_len));
        }
        let pcfg = PConfig {
            strict: sc.strict,
            max_lag_bytes: 1 << 20,
            max_lag_ms: 5_000,
            max_delay_fin_ms: 5_000,
            max_held_bytes: 1 << 20,
            max_held_total: 256 << 20,
            nudge_after_ms: 40,
            max_conns: 16,
            max_hang_ms: MAX_HANG_MS,
        };
        Sim {
            rng: Rng::new(sc.seed ^ 0x5151),
            now: 0,
            client,
            capp: ClientApp { sent: 0, got: vec![], expected, eof: false, last_progress: 0, max_stall: 0 },
            primary,
            papp: App::new(pf, sc.at),
            backup,
            bapp: App::new(bf, sc.at),
            peng: Primary::new(pcfg),
            beng: {
                let mut b = Backup::new();
                b.set_strict(sc.strict);
                b
            },
            pdet: Detector::new(sc.hb, Role::Primary, 0),
            bdet: Detector::new(sc.hb, Role::Backup, 0),
            primary_alive: true,
            backup_alive: true,
            link: vec![],
            side: vec![],
            key: Key::new(&[0x42; 32]).unwrap(),
            beat: 0,
            backup_hung: false,
            fence_attempts: 0,
            server_isn: None,
            client_rcv: 0,
            client_ooo: vec![],
            newest_ack: [None; 3],
            ts_recent: None,
            report: Report::default(),
            trace: std::env::var("SIM_TRACE").is_ok(),
            log: VecDeque::new(),
            sc,
        }
    }

    fn note(&mut self, s: String) {
        let line = format!("{:>6} ms {s}", self.now);
        if self.trace {
            eprintln!("{line}");
        }
        self.log.push_back(line);
        if self.log.len() > 60 {
            self.log.pop_front();
        }
    }

    fn fail(&self, why: &str) -> String {
        let mut s = format!("{why}\n  scenario: {:?}\n  report: {:?}\n  {}\n  last events:\n", self.sc, self.report, self.sc.replay_hint());
        for l in &self.log {
            s.push_str("    ");
            s.push_str(l);
            s.push('\n');
        }
        s
    }

    fn send(&mut self, to: To, pkt: Vec<u8>, from: &str) -> Result<(), String> {
        self.note(format!("{from} -> {to:?}: {}", describe(&pkt)));
        if to == To::Client {
            // Never two hosts answering.
            if from.starts_with("primary") && self.beng.is_promoted() {
                return Err(self.fail("the primary answered the client after the backup took over"));
            }
            if from.starts_with("backup") && self.primary_alive {
                return Err(self.fail("the backup answered the client while the primary is alive"));
            }
            let ip = smoltcp::wire::Ipv4Packet::new_checked(&pkt[..]).map_err(|e| self.fail(&format!("bad ipv4 to client: {e}")))?;
            let t = smoltcp::wire::TcpPacket::new_checked(ip.payload()).map_err(|e| self.fail(&format!("bad tcp to client: {e}")))?;
            if !t.verify_checksum(&IpAddress::Ipv4(ip.src_addr()), &IpAddress::Ipv4(ip.dst_addr())) {
                return Err(self.fail(&format!("bad tcp checksum from {from}")));
            }
            if t.rst() {
                return Err(self.fail(&format!("a RST reached the client (from {from})")));
            }
        }
        if self.rng.chance(self.sc.loss) {
            self.note("link: lost".into());
            return Ok(());
        }
        let at = self.delay();
        self.link.push((at, to, pkt));
        Ok(())
    }

    /// Linux takes the FIN of a segment whose data it already has (the segment's end, FIN
    /// included, lies beyond RCV.NXT); smoltcp drops the whole segment as a duplicate. A
    /// take-over or a lost segment meets exactly that (the data arrived before, the segment
    /// comes again with its FIN), so the client's smoltcp is handed the FIN alone.
    fn linux_takes_the_fin(&mut self, pkt: Vec<u8>) -> Vec<u8> {
        let Some(isn) = self.server_isn else { return pkt };
        let rcv_nxt = isn.wrapping_add(1).wrapping_add(self.client_rcv as u32);
        let Ok(ip) = smoltcp::wire::Ipv4Packet::new_checked(&pkt[..]) else { return pkt };
        let Ok(t) = smoltcp::wire::TcpPacket::new_checked(ip.payload()) else { return pkt };
        let n = t.payload().len() as u32;
        let end = (t.seq_number().0 as u32).wrapping_add(n);
        if !t.fin() || t.syn() || n == 0 || rcv_nxt.wrapping_sub(end) >= 1 << 30 {
            return pkt;
        }
        let p = unbroken_wire::tcp::Packet::new_checked(ip.payload()).unwrap();
        let mut r = unbroken_wire::tcp::Repr::parse(&p).unwrap();
        r.seq = unbroken_wire::Seq(end);
        let bare = unbroken_wire::ip::tcp_packet(ip.src_addr().into(), ip.dst_addr().into(), &r, &[]).unwrap();
        self.note(format!("link: FIN of an old segment delivered alone: {}", describe(&bare)));
        bare
    }

    /// Linux takes the data of a segment whose ACK is older than one it already got (the
    /// network reordered them) and ignores the old ACK; smoltcp drops the whole segment. The
    /// link raises such an ACK to the newest its receiver has seen, which Linux would do in
    /// effect.
    fn linux_ignores_old_acks(&mut self, to: To, mut pkt: Vec<u8>) -> Vec<u8> {
        let Ok(info) = unbroken_wire::ip::IpInfo::parse(&pkt) else { return pkt };
        let Ok(mut t) = unbroken_wire::tcp::Packet::new_checked(&mut pkt[info.l4_offset..info.l4_offset + info.l4_len]) else { return pkt };
        if t.flags() & unbroken_wire::tcp::flags::ACK == 0 || t.flags() & unbroken_wire::tcp::flags::RST != 0 {
            return pkt;
        }
        let slot = &mut self.newest_ack[to as usize];
        match *slot {
            Some(n) if t.ack().lt(n) => {
                if !t.payload().is_empty() || t.flags() & unbroken_wire::tcp::flags::FIN != 0 {
                    t.rewrite_ack(n);
                }
            }
            _ => *slot = Some(t.ack()),
        }
        pkt
    }

    /// Linux's PAWS (RFC 7323 5, tcp_paws_discard): a segment whose TSval is older than the
    /// client's TS.Recent by more than one tick is discarded (smoltcp does not check); TS.Recent
    /// follows the TSval of segments at or before RCV.NXT.
    fn paws_rejects(&mut self, pkt: &[u8]) -> bool {
        let Ok(info) = unbroken_wire::ip::IpInfo::parse(pkt) else { return false };
        let Ok(t) = unbroken_wire::tcp::Packet::new_checked(&pkt[info.l4_offset..info.l4_offset + info.l4_len]) else { return false };
        let Ok(r) = unbroken_wire::tcp::Repr::parse(&t) else { return false };
        let Some((tsval, _)) = r.timestamp else { return false };
        if r.flags & (unbroken_wire::tcp::flags::RST | unbroken_wire::tcp::flags::SYN) != 0 {
            // (Linux answers a SYN it discards by PAWS with a duplicate ACK, which is all a
            // promoted backup's own SYN-ACK asks for; smoltcp answers it without the check.)
            return false;
        }
        if let Some(recent) = self.ts_recent {
            if recent.wrapping_sub(tsval) as i32 > 1 {
                self.report.paws_dropped += 1;
                self.note(format!("link: client discards by PAWS (TSval {tsval} < TS.Recent {recent}): {}", describe(pkt)));
                return true;
            }
        }
        let in_order = match self.server_isn {
            Some(isn) => {
                let off = r.seq.0.wrapping_sub(isn.wrapping_add(1));
                r.flags & unbroken_wire::tcp::flags::SYN != 0 || off >= 1 << 31 || off as u64 <= self.client_rcv
            }
            None => true,
        };
        if in_order && self.ts_recent.is_none_or(|t| tsval.wrapping_sub(t) as i32 >= 0) {
            self.ts_recent = Some(tsval);
        }
        false
    }

    fn fin_out_of_order(&self, pkt: &[u8]) -> bool {
        let Some(isn) = self.server_isn else { return false };
        let Ok(ip) = smoltcp::wire::Ipv4Packet::new_checked(pkt) else { return false };
        let Ok(t) = smoltcp::wire::TcpPacket::new_checked(ip.payload()) else { return false };
        let off = (t.seq_number().0 as u32).wrapping_sub(isn.wrapping_add(1));
        t.fin() && !t.syn() && off < 1 << 31 && off as u64 > self.client_rcv
    }

    /// The client's RCV.NXT as its TCP has it: in-order data plus what fills gaps.
    fn model_client_rcv(&mut self, pkt: &[u8]) {
        let Ok(ip) = smoltcp::wire::Ipv4Packet::new_checked(pkt) else { return };
        let Ok(t) = smoltcp::wire::TcpPacket::new_checked(ip.payload()) else { return };
        if t.syn() {
            self.server_isn.get_or_insert(t.seq_number().0 as u32);
            return;
        }
        let (Some(isn), n) = (self.server_isn, t.payload().len() as u64) else { return };
        let off = (t.seq_number().0 as u32).wrapping_sub(isn.wrapping_add(1));
        if n == 0 || off >= 1 << 31 {
            return;
        }
        self.client_ooo.push((off as u64, off as u64 + n));
        self.client_ooo.sort();
        let mut keep = vec![];
        for (a, b) in std::mem::take(&mut self.client_ooo) {
            if a <= self.client_rcv {
                self.client_rcv = self.client_rcv.max(b);
            } else {
                keep.push((a, b));
            }
        }
        self.client_ooo = keep;
    }

    fn delay(&mut self) -> u64 {
        self.now + 1 + self.rng.below(self.sc.jitter + 1)
    }

    fn kill_primary(&mut self, why: &str) {
        if self.primary_alive {
            self.primary_alive = false;
            self.report.primary_killed_at = Some(self.now);
            self.note(format!("primary host down ({why})"));
        }
    }

    fn step(&mut self) -> Result<(), String> {
        let now = self.now;
        NOW.with(|n| n.set(now));
        // Host-level faults.
        if self.sc.fault == Fault::LossThenPrimaryCrash && now == self.sc.at + 1 + self.sc.seed % 40 {
            self.kill_primary("crash during loss at the backup");
        }
        if now == self.sc.at {
            match self.sc.fault {
                Fault::PrimaryHostCrash => self.kill_primary("crash"),
                Fault::BackupHostCrash => {
                    self.backup_alive = false;
                    self.note("backup host down (crash)".into());
                }
                _ => {}
            }
        }
        // Deliver what is due.
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.link).into_iter().partition(|(t, _, _)| *t <= now);
        self.link = later;
        // The model of the client's RCV.NXT starts from the truth (what its application read
        // plus what its socket holds in order): smoltcp drops some segments the model would take
        // (beyond its few out-of-order ranges), and a model ahead of the truth would strip data.
        if self.server_isn.is_some() {
            let s = self.client.sockets.get_mut::<tcp::Socket>(self.client.sock);
            self.client_rcv = (self.capp.got.len() + s.recv_queue()) as u64;
        }
        for (_, to, pkt) in due {
            let (to, queued) = if to == To::ClientQueued { (To::Client, true) } else { (to, false) };
            let pkt = self.linux_ignores_old_acks(to, pkt);
            match to {
                To::Client => {
                    if !queued && self.paws_rejects(&pkt) {
                        continue;
                    }
                    if self.fin_out_of_order(&pkt) {
                        // Linux keeps a FIN that arrives beyond a gap in its out-of-order queue
                        // and takes it when the gap fills; smoltcp drops it. The link holds it
                        // back instead, a millisecond at a time, until it is in order.
                        self.link.push((now + 1, To::ClientQueued, pkt));
                        continue;
                    }
                    let pkt = self.linux_takes_the_fin(pkt);
                    self.model_client_rcv(&pkt);
                    self.client.dev.rx.push_back(pkt)
                }
                To::Primary if self.primary_alive => self.primary.dev.rx.push_back(pkt),
                To::Backup if self.backup_alive => self.backup.dev.rx.push_back(pkt),
                _ => {}
            }
        }
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.side).into_iter().partition(|(t, _, _)| *t <= now);
        self.side = later;
        for (_, from, dgram) in due {
            let (p, _, input) = Progress::parse_message(&dgram, &self.key).map_err(|e| self.fail(&format!("side channel: {e}")))?;
            if !input.is_empty() {
                if from == Role::Primary && self.backup_alive {
                    let r = p.records[0];
                    let key = ConnKey { client: r.client, client_port: r.client_port, server_port: r.server_port };
                    if let Some(pkt) = self.beng.relayed_input(&key, r.rcv_nxt, &input) {
                        self.note(format!("backup engine injects relayed client bytes: {}", describe(&pkt)));
                        self.backup.dev.rx.push_back(pkt);
                    }
                } else if from == Role::Backup && self.primary_alive {
                    // Client bytes the primary's host missed (loss toward it), from the backup.
                    let r = p.records[0];
                    let key = ConnKey { client: r.client, client_port: r.client_port, server_port: r.server_port };
                    let (ts, window) = r.input_client();
                    self.peng.backup_input(&key, r.rcv_nxt, &input, RelayFrom { ts, window });
                    self.primary_engine_out()?;
                }
                continue;
            }
            match from {
                Role::Backup if self.primary_alive => {
                    if self.trace { self.note(format!("backup progress: {:?} last_ack {:?}", p.records.iter().map(|r| r.out_end.0).collect::<Vec<_>>(), p.records.iter().map(|r| r.last_ack.0).max())); }
                    self.pdet.beat(now);
                    self.peng.backup_hung(p.flags & rw::hdr::HUNG != 0);
                    self.peng.backup_progress(&p, now);
                }
                Role::Primary if self.backup_alive => {
                    self.bdet.beat(now);
                    if self.trace { self.note(format!("primary report: {:?}", p.records.iter().map(|r| r.last_ack).collect::<Vec<_>>())); }
                    for pkt in self.beng.primary_report(&p) {
                        self.note(format!("backup engine relays the client's ACK: {}", describe(&pkt)));
                        self.backup.dev.rx.push_back(pkt);
                    }
                    for (key, seq, data, from) in self.beng.take_relay() {
                        // Over the side channel, as an input message (its loss and delay too).
                        let f = from.unwrap_or_default();
                        let rec = ConnProgress::input(key.client, key.client_port, key.server_port, seq, f.ts, f.window);
                        let d = Progress { role: Role::Backup, beat: self.now + 1, flags: 0, records: vec![rec] }.emit_input(&Default::default(), &data, &self.key).unwrap();
                        self.note(format!("backup engine relays {} client bytes at {} to the primary", data.len(), seq.0));
                        if !self.rng.chance(self.sc.side_loss) {
                            let at = self.delay();
                            self.side.push((at, Role::Backup, d));
                        }
                    }
                }
                _ => {}
            }
        }

        // The client.
        let queued = self.client.dev.rx.len();
        self.client.poll(now);
        if self.trace && queued > 0 {
            let sk = self.client.sockets.get_mut::<tcp::Socket>(self.client.sock);
            let (st, rq, sq) = (sk.state(), sk.recv_queue(), sk.send_queue());
            self.note(format!("client took {queued} packet(s), state {st:?}, recv queue {rq}, send queue {sq}, got {}", self.capp.got.len()));
        }
        self.client_app()?;
        self.client.poll(now);
        for pkt in std::mem::take(&mut self.client.dev.tx) {
            self.note(format!("client: {}", describe(&pkt)));
            // To the primary: unchanged (the engine sees what reaches the host).
            let lost_p = self.sc.fault == Fault::PrimaryTemporaryLoss && now >= self.sc.at && now < self.sc.at + 300;
            if self.primary_alive && !lost_p && !self.rng.chance(self.sc.loss) {
                let v = self.peng.incoming(&pkt);
                if v != Verdict::PASS {
                    return Err(self.fail(&format!("primary incoming verdict {v:?}")));
                }
                let at = self.delay();
                self.link.push((at, To::Primary, pkt.clone()));
            }
            // To the backup: mirrored, through its engine.
            let lossy = matches!(self.sc.fault, Fault::BackupTemporaryLoss | Fault::LossThenPrimaryCrash) && now >= self.sc.at && now < self.sc.at + 300;
            if self.backup_alive && !(lossy && self.rng.chance(0.5)) && !self.rng.chance(self.sc.loss) {
                let mut b = pkt;
                match self.beng.incoming(&mut b) {
                    Verdict::Accept { .. } => {
                        if self.trace {
                            self.note(format!("to the backup's server: {}", describe(&b)));
                        }
                        let at = self.delay();
                        self.link.push((at, To::Backup, b))
                    }
                    Verdict::Drop => self.note("backup engine dropped a client packet".into()),
                    v => return Err(self.fail(&format!("backup incoming verdict {v:?}"))),
                }
            }
        }

        // The primary.
        if self.primary_alive {
            self.primary.poll(now);
            let sc = self.sc.clone();
            let s = self.primary.sockets.get_mut::<tcp::Socket>(self.primary.sock);
            self.papp.run(s, &sc, now);
            if now.is_multiple_of(READ_CHECK_MS) {
                // The daemon's sock_diag sample of its server's sockets.
                let since = self.papp.sample(s, now);
                self.peng.server_reading(since, self.papp.watch.waiting());
            }
            self.primary.poll(now);
            for mut pkt in std::mem::take(&mut self.primary.dev.tx) {
                if self.rng.chance(self.sc.out_drop) {
                    self.note(format!("primary's queue overflowed: {}", describe(&pkt)));
                    continue;
                }
                let v = self.peng.outgoing(&mut pkt, now);
                self.note(format!("primary engine {v:?}: {}", describe(&pkt)));
                if let Verdict::Accept { .. } = v {
                    self.send(To::Client, pkt, "primary")?;
                }
            }
            self.peng.tick(now);
            self.primary_engine_out()?;
            if let Some(DetectorAction::RunFence) = self.pdet.tick(now) {
                // ST-TCP Table 3.3: the primary shuts the backup down before it runs alone.
                self.note("primary: fencing the backup".into());
                self.backup_alive = false;
                if let Some(DetectorAction::BackupFailed) = self.pdet.fence_result(true, now) {
                    self.note("primary: backup failed".into());
                    self.report.backup_failed_at = Some(now);
                    self.peng.backup_failed();
                    self.primary_engine_out()?;
                }
            }
        }

        // The backup.
        if self.backup_alive {
            self.backup.poll(now);
            let sc = self.sc.clone();
            let s = self.backup.sockets.get_mut::<tcp::Socket>(self.backup.sock);
            self.bapp.run(s, &sc, now);
            if now.is_multiple_of(READ_CHECK_MS) {
                self.backup_hung = self
                    .bapp
                    .sample(s, now)
                    .is_some_and(|t| now >= t + MAX_HANG_MS);
            }
            self.backup.poll(now);
            let mut produced = false;
            for mut pkt in std::mem::take(&mut self.backup.dev.tx) {
                produced = true;
                if self.rng.chance(self.sc.out_drop) {
                    self.note(format!("backup's queue overflowed: {}", describe(&pkt)));
                    continue;
                }
                let v = self.beng.outgoing(&mut pkt);
                self.note(format!("backup engine {v:?}: {}", describe(&pkt)));
                match v {
                    Verdict::Accept { .. } => self.send(To::Client, pkt, "backup")?,
                    Verdict::Drop => {}
                    v => return Err(self.fail(&format!("backup outgoing verdict {v:?}"))),
                }
            }
            // Progress: on change (at most once a millisecond) and with every beat.
            let cut = self.sc.fault == Fault::SideChannelCut && now >= self.sc.at;
            if (produced || now.is_multiple_of(self.sc.hb.interval_ms)) && !cut {
                self.beat += 1;
                for mut p in self.beng.progress(self.beat) {
                    if self.backup_hung {
                        // The backup's daemon says its server is hung.
                        p.flags |= rw::hdr::HUNG;
                    }
                    let d = p.emit(&self.key).unwrap();
                    if !self.rng.chance(self.sc.side_loss) {
                        let at = self.delay();
                        self.side.push((at, Role::Backup, d));
                    }
                }
            }
            self.beng.tick(now);
            if let Some(a) = self.bdet.tick(now) {
                if a == DetectorAction::RunFence && self.report.stale.is_some() {
                    // A stale backup never fences nor takes over (its daemon's rule).
                    self.note("backup: stale, never takes over".into());
                } else if a == DetectorAction::RunFence {
                    self.fence_attempts += 1;
                    self.report.fences += 1;
                    let ok = !(self.sc.fence_fails_first && self.fence_attempts == 1);
                    self.note(format!("backup: fencing the primary ({})", if ok { "ok" } else { "failed" }));
                    if ok {
                        // The fencing hook switches the primary off (ST-TCP 3.2.2).
                        self.kill_primary("fenced");
                    }
                    if let Some(DetectorAction::TakeOver) = self.bdet.fence_result(ok, now) {
                        self.note("backup: take-over".into());
                        self.beng.take_over();
                        // The daemon sends what the take-over resends at once.
                        for pkt in self.beng.take_transmit() {
                            self.send(To::Client, pkt, "backup (take-over)")?;
                        }
                        self.report.takeover_at = Some(now);
                    }
                }
            }
        }
        // The primary's beats to the backup.
        let cut = self.sc.fault == Fault::SideChannelCut && now >= self.sc.at;
        if self.primary_alive && now.is_multiple_of(self.sc.hb.interval_ms) {
            // The daemon checks its server's listening socket every beat: a crashed
            // application's is gone.
            self.peng.server_listening(!self.papp.dead);
            self.primary_engine_out()?;
        }
        if self.primary_alive && now.is_multiple_of(self.sc.hb.interval_ms) && !cut {
            for p in self.peng.report(now + 1) {
                let d = p.emit(&self.key).unwrap();
                if !self.rng.chance(self.sc.side_loss) {
                    let at = self.delay();
                    self.side.push((at, Role::Primary, d));
                }
            }
        }
        Ok(())
    }

    fn primary_engine_out(&mut self) -> Result<(), String> {
        for pkt in self.peng.take_transmit() {
            self.send(To::Client, pkt, "primary (engine)")?;
        }
        for (key, seq, data) in self.peng.take_relay() {
            // Over the side channel, as an input message (its loss and delay too).
            let rec = ConnProgress { client: key.client, client_port: key.client_port, server_port: key.server_port, rcv_nxt: seq, rcv_edge: Seq(0), out_end: Seq(0), out_hash: 0, last_ack: Seq(0), isn: Seq(0), flags: 0 };
            let d = Progress { role: Role::Primary, beat: self.now + 1, flags: 0, records: vec![rec] }.emit_input(&Default::default(), &data, &self.key).unwrap();
            if !self.rng.chance(self.sc.side_loss) {
                let at = self.delay();
                self.side.push((at, Role::Primary, d));
            }
        }
        for pkt in self.peng.take_inject() {
            // The daemon injects these into its own stack (a raw socket, like the backup's
            // relayed ACKs).
            self.note(format!("primary engine injects into its own server: {}", describe(&pkt)));
            self.primary.dev.rx.push_back(pkt);
        }
        for n in self.peng.take_notices() {
            self.note(format!("primary notice: {n:?}"));
            match n {
                Notice::Unprotected { why, .. } => self.report.unprotected.push(why),
                Notice::YieldToBackup { .. } => {
                    // The daemon stops the primary so that the backup's detector takes over.
                    self.report.yields += 1;
                    self.kill_primary("yielded");
                }
                Notice::BackupStale { why } => {
                    // The daemon tells the backup (a flag in its messages): it never takes over.
                    self.report.stale = Some(why);
                }
            }
        }
        Ok(())
    }

    fn client_app(&mut self) -> Result<(), String> {
        let now = self.now;
        let s = self.client.sockets.get_mut::<tcp::Socket>(self.client.sock);
        let c = &mut self.capp;
        let mut bad = None;
        while s.can_recv() {
            let mut b = [0u8; 4096];
            let n = s.recv_slice(&mut b).unwrap_or(0);
            if n == 0 {
                break;
            }
            let at = c.got.len();
            c.got.extend_from_slice(&b[..n]);
            if c.got.len() > c.expected.len() || c.got[at..] != c.expected[at..c.got.len()] {
                let off = (at..c.got.len()).find(|&i| c.expected.get(i) != Some(&c.got[i])).unwrap_or(at);
                bad = Some(off);
                break;
            }
            c.max_stall = c.max_stall.max(now - c.last_progress);
            c.last_progress = now;
        }
        if let Some(off) = bad {
            return Err(self.fail(&format!("the client's stream differs at byte {off}")));
        }
        let s = self.client.sockets.get_mut::<tcp::Socket>(self.client.sock);
        let c = &mut self.capp;
        if s.state() == State::Closed && !c.eof {
            return Err(self.fail("the client's socket closed (reset or timeout)"));
        }
        let per = self.sc.reply_len;
        if c.sent < self.sc.nreq && c.got.len() == c.sent * per && s.can_send() && s.send_capacity() - s.send_queue() >= REQ {
            s.send_slice(&request(self.sc.seed, c.sent)).unwrap();
            c.sent += 1;
            if c.last_progress < now {
                c.last_progress = now;
            }
        }
        if !c.eof && !s.may_recv() && matches!(s.state(), State::CloseWait | State::LastAck | State::Closing | State::TimeWait) {
            if c.got.len() != c.expected.len() {
                let (g, e) = (c.got.len(), c.expected.len());
                return Err(self.fail(&format!("the server's FIN reached the client after {g} of {e} bytes")));
            }
            c.eof = true;
            s.close();
        }
        Ok(())
    }

    fn run(mut self) -> Result<Report, String> {
        while self.now <= self.sc.max_ms {
            self.step()?;
            if self.capp.eof {
                break;
            }
            self.now += 1;
        }
        if !self.capp.eof {
            let (g, e) = (self.capp.got.len(), self.capp.expected.len());
            return Err(self.fail(&format!("stalled: the client has {g} of {e} bytes and no FIN after {} ms", self.sc.max_ms)));
        }
        // Without reordering, no segment may reach the client with a TSval older than one it has
        // seen (issue 20 item 2: held output released with old timestamps was discarded by PAWS).
        if self.sc.jitter == 0 && self.report.paws_dropped > 0 {
            return Err(self.fail(&format!("the client discarded {} segments by PAWS", self.report.paws_dropped)));
        }
        // Nothing is forged here: the primary's ISN never contradicts the backup's alignment.
        if self.beng.counters.misaligned != 0 || self.peng.counters.backup_misaligned != 0 {
            return Err(self.fail("the backup was found aligned on a wrong ACK, with no forgery in the simulation"));
        }
        let mut r = self.report;
        r.virtual_ms = self.now;
        r.max_stall_ms = self.capp.max_stall;
        let (pc, bc) = (self.peng.counters, self.beng.counters);
        r.fresh_acks = pc.fresh_acks;
        r.acks_from_backup = pc.acks_from_backup;
        r.relayed_to_primary = bc.relayed_to_primary;
        r.backup_input = pc.backup_input;
        r.acks_lowered = pc.acks_lowered;
        r.held = pc.held;
        r.diverged = pc.diverged;
        r.withheld = bc.withheld;
        r.aligned = bc.aligned;
        r.ack_clamped = bc.ack_clamped;
        r.unaligned_dropped = bc.unaligned_dropped;
        r.relayed = pc.relayed_bytes;
        Ok(r)
    }
}

fn run(sc: Scenario) -> Result<Report, String> {
    Sim::new(sc).run()
}

/// Runs `n` seeds of `fault`, panicking with a replay line on the first failure.
fn sweep(fault: Fault, n: u64) -> Vec<(Scenario, Report)> {
    let mut out = vec![];
    for seed in 0..n * scale() {
        let sc = Scenario::from_seed(fault, seed);
        match run(sc.clone()) {
            Ok(r) => out.push((sc, r)),
            Err(e) => panic!("{e}"),
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Failure-free period (ST-TCP 3.3.1, Koch 3)
// ---------------------------------------------------------------------------------------------

/// ST-TCP 3.3.0.1 and 3.3.1 / Koch 3: no fault. The backup aligns on the handshake ACK and
/// withholds everything; the primary's ACKs wait for the backup; strict mode holds output.
#[test]
fn failure_free_period() {
    let reps = sweep(Fault::None, 200);
    for (sc, r) in &reps {
        assert_eq!(r.aligned, 1, "{sc:?} {r:?}");
        assert!(r.withheld > 0, "{sc:?} {r:?}");
        assert!(r.takeover_at.is_none() && r.backup_failed_at.is_none() && r.unprotected.is_empty(), "{sc:?} {r:?}");
        assert!(!sc.strict || r.held > 0, "strict mode held nothing: {sc:?} {r:?}");
    }
    assert!(reps.iter().any(|(_, r)| r.fresh_acks > 0), "Koch 3.4's fresh ACK never sent");
    assert!(reps.iter().any(|(_, r)| r.acks_lowered > 0), "Koch 3.2's min ACK never lowered anything");
}

// ---------------------------------------------------------------------------------------------
// ST-TCP Table 3.3
// ---------------------------------------------------------------------------------------------

/// Row 1, primary: the primary host crashes at any moment; the backup's detector fences it and
/// takes over every connection.
#[test]
fn table_3_3_row1_primary_host_crash() {
    let reps = sweep(Fault::PrimaryHostCrash, 400);
    for (sc, r) in &reps {
        assert!(r.takeover_at.is_none() || r.primary_killed_at.is_some(), "only a dead primary is taken over: {sc:?} {r:?}");
    }
    let crashed = reps.iter().filter(|(_, r)| r.primary_killed_at.is_some_and(|t| t + 2 < r.virtual_ms)).count();
    let taken = reps.iter().filter(|(_, r)| r.takeover_at.is_some()).count();
    assert!(crashed > reps.len() / 2 && taken + reps.len() / 20 >= crashed, "crashed {crashed}, taken over {taken} of {}", reps.len());
    assert!(reps.iter().any(|(sc, _)| sc.fence_fails_first));
}

/// Row 1, backup: the backup host crashes; the primary runs on unprotected.
#[test]
fn table_3_3_row1_backup_host_crash() {
    let reps = sweep(Fault::BackupHostCrash, 300);
    for (sc, r) in &reps {
        assert!(r.takeover_at.is_none(), "{sc:?} {r:?}");
    }
    assert!(reps.iter().filter(|(_, r)| r.backup_failed_at.is_some()).count() > reps.len() / 2);
}

/// Row 2: the application hangs on one side (no FIN, no RST).
#[test]
fn table_3_3_row2_application_hang() {
    let p = sweep(Fault::PrimaryAppHang, 300);
    assert!(
        p.iter()
            .any(|(_, r)| r.yields > 0 && r.takeover_at.is_some()),
        "a hung primary must yield to the backup"
    );
    // With client input waiting unread (the read watch's evidence), the takeover comes after
    // the hang bound, not after AppMaxLagTime (5 s); without (the server hung between reading a
    // request and answering it), when the client's next segment waits, or at the lag bound.
    let after: Vec<u64> = p
        .iter()
        .filter_map(|(sc, r)| r.takeover_at.map(|t| t - sc.at))
        .collect();
    let quick = after.iter().filter(|&&d| d < 400).count();
    assert!(
        quick * 4 >= after.len() * 3,
        "most hung primaries must be taken over within 400 ms: {after:?}"
    );
    assert!(after.iter().all(|&d| d < 5_000 + 1_000), "{after:?}");
    let b = sweep(Fault::BackupAppHang, 300);
    // The backup's daemon says its server is hung: the primary stops waiting for it.
    let hung: Vec<u64> = b
        .iter()
        .filter(|(_, r)| r.stale == Some(Why::BackupHung))
        .map(|(_, r)| r.max_stall_ms)
        .collect();
    assert!(hung.len() * 2 > b.len(), "{} of {}", hung.len(), b.len());
    assert!(
        hung.iter().filter(|&&m| m < 400).count() * 4 >= hung.len() * 3,
        "{hung:?}"
    );
    assert!(b.iter().all(|(_, r)| r.takeover_at.is_none()));
}

/// Row 3: the application crashes on one side and its kernel sends a FIN or a RST.
#[test]
fn table_3_3_row3_application_crash_with_fin_or_rst() {
    for f in [Fault::PrimaryAppFin, Fault::PrimaryAppRst] {
        let reps = sweep(f, 300);
        assert!(reps.iter().any(|(_, r)| r.yields > 0 && r.takeover_at.is_some()), "{f:?}: the primary must yield");
    }
    for f in [Fault::BackupAppFin, Fault::BackupAppRst] {
        let reps = sweep(f, 300);
        assert!(reps.iter().all(|(_, r)| r.takeover_at.is_none()), "{f:?}");
        assert!(reps.iter().any(|(_, r)| !r.unprotected.is_empty()), "{f:?}: the backup's failure must be seen");
    }
}

/// Row 5, backup: client packets toward the backup are lost for a while; the primary's ACK
/// stays at the backup's, so the client resends what the backup missed.
#[test]
fn table_3_3_row5_temporary_loss_at_backup() {
    let reps = sweep(Fault::BackupTemporaryLoss, 300);
    // ST-TCP 3.6: the primary sends the backup the client bytes it missed.
    assert!(reps.iter().filter(|(_, r)| r.relayed > 0).count() > reps.len() / 4, "the primary never relayed what the backup missed");
    assert!(reps.iter().filter(|(_, r)| r.unprotected.is_empty() && r.takeover_at.is_none()).count() > reps.len() / 2);
}

/// Row 5 then row 1: the primary host dies while client packets toward the backup are being
/// lost. The primary never acknowledged what the backup missed, so the client resends it to the
/// backup after the take-over.
#[test]
fn temporary_loss_at_backup_then_primary_crash() {
    let reps = sweep(Fault::LossThenPrimaryCrash, 300);
    assert!(reps.iter().filter(|(_, r)| r.takeover_at.is_some()).count() > reps.len() / 2);
}

/// Every client packet toward the primary is lost for 300 ms: the backup, which heard them,
/// gives the primary's server the client's ACKs it missed (that server then stops
/// retransmitting into the loss with a backed-off timer); the client's own bytes wait for its
/// retransmission. Byte-exact (the run's invariants), never a takeover, a stale backup or an
/// unprotected connection.
#[test]
fn temporary_loss_at_primary() {
    let reps = sweep(Fault::PrimaryTemporaryLoss, 300);
    for (sc, r) in &reps {
        assert!(r.yields == 0 && r.stale.is_none() && r.unprotected.is_empty() && r.takeover_at.is_none(), "{sc:?} {r:?}");
    }
    assert!(reps.iter().filter(|(_, r)| r.acks_from_backup > 0).count() > reps.len() / 4, "the client's ACKs never reached the primary's server");
    // The client's bytes the primary missed come from the backup (the reverse of ST-TCP 3.6):
    // with no other loss, the client never waits for its own retransmission timeout (the loss
    // lasts 300 ms, smoltcp's timeout is a second).
    let clean: Vec<u64> = reps.iter().filter(|(sc, _)| sc.loss == 0.0 && sc.side_loss == 0.0).map(|(_, r)| r.max_stall_ms).collect();
    assert!(clean.len() > 20 && clean.iter().all(|&m| m < 150), "{clean:?}");
    assert!(reps.iter().filter(|(_, r)| r.backup_input > 0).count() > reps.len() / 4, "the client's bytes never reached the primary's server from the backup");
}

/// A second-long command runs on both servers (both stop reading and answering at the same
/// time): each side's read watch says hung, and each side's daemon says so, so neither is
/// the failed one: no yield, no stale backup, no unprotected connection, no take-over.
#[test]
fn long_command_on_both_hosts_is_no_failure() {
    let reps = sweep(Fault::LongCommand, 300);
    for (sc, r) in &reps {
        assert!(
            r.yields == 0
                && r.stale.is_none()
                && r.unprotected.is_empty()
                && r.takeover_at.is_none(),
            "{sc:?} {r:?}"
        );
    }
    assert!(
        reps.iter().filter(|(_, r)| r.max_stall_ms >= 900).count() > reps.len() / 2,
        "the pause must stall the client"
    );
}

/// The backup lags beyond the bound (AppMaxLagTime): the primary stops waiting for it.
#[test]
fn backup_lagging_beyond_bound() {
    let reps = sweep(Fault::BackupLagging, 300);
    assert!(reps.iter().any(|(_, r)| r.unprotected.contains(&Why::BackupLagging)));
}

/// The side channel is cut: both sides suspect each other; the backup fences the (live)
/// primary before it takes over, so never two hosts answer.
#[test]
fn side_channel_cut_false_suspicion() {
    let reps = sweep(Fault::SideChannelCut, 300);
    assert!(reps.iter().any(|(_, r)| r.takeover_at.is_some()));
}

/// Koch's strict output commit: the backup's server answers one request differently; the
/// primary detects it, never sends an unverified byte of a protected connection, and goes on
/// alone on that connection (the client's stream is the primary's, byte-exact).
#[test]
fn strict_output_commit_detects_divergence() {
    let reps = sweep(Fault::Nondeterministic, 300);
    for (sc, r) in &reps {
        assert_eq!(r.diverged, 1, "{sc:?} {r:?}");
        assert_eq!(r.unprotected, vec![Why::Diverged], "{sc:?} {r:?}");
    }
}

/// Every fault, many seeds, both modes: thousands of runs.
#[test]
fn every_fault_many_seeds() {
    let mut runs = 0;
    for f in ALL_FAULTS {
        for seed in 10_000..10_000 + 300 * scale() {
            let sc = Scenario::from_seed(f, seed);
            if let Err(e) = run(sc) {
                panic!("{e}");
            }
            runs += 1;
        }
    }
    assert!(runs >= 4200);
}

/// Replays one run: `SIM_FAULT=<fault> SIM_SEED=<seed>` (does nothing without them).
/// Issue 20 items 1, 2 and 4: large replies, no fault. Never a yield, a stale backup, an
/// unprotected connection or a take-over; no PAWS discard; no stall beyond a second (the
/// primary's engine sees gaps in its own server's output when its queue overflows; the backup
/// reports its checkpoints at its own segment ends).
#[test]
fn large_replies_no_fault() {
    for seed in 0..60 * scale() {
        let sc = Scenario::large_from_seed(Fault::None, seed);
        let r = run(sc.clone()).unwrap_or_else(|e| panic!("{e}"));
        assert!(r.yields == 0 && r.stale.is_none() && r.unprotected.is_empty() && r.takeover_at.is_none(), "{sc:?} {r:?}");
        assert_eq!(r.paws_dropped, 0, "{sc:?} {r:?}");
        // A clean segment never stalls; a lost packet may wait for a retransmission timeout
        // (smoltcp's is at least a second).
        if sc.loss == 0.0 && sc.out_drop == 0.0 {
            assert!(r.max_stall_ms < 200, "stalled {} ms: {sc:?} {r:?}", r.max_stall_ms);
        }
    }
}

/// Large replies with every fault: byte-exact, no RST, complete (the run's invariants).
#[test]
fn large_replies_every_fault() {
    for f in ALL_FAULTS {
        for seed in 0..12 * scale() {
            let sc = Scenario::large_from_seed(f, seed);
            if let Err(e) = run(sc) {
                panic!("{e}");
            }
        }
    }
}

#[test]
fn replay() {
    let (Ok(f), Ok(seed)) = (std::env::var("SIM_FAULT"), std::env::var("SIM_SEED")) else { return };
    let fault = *ALL_FAULTS.iter().find(|x| format!("{x:?}") == f).unwrap_or_else(|| panic!("unknown SIM_FAULT {f}"));
    let seed = seed.parse().expect("SIM_SEED");
    let sc = if std::env::var("SIM_LARGE").is_ok() { Scenario::large_from_seed(fault, seed) } else { Scenario::from_seed(fault, seed) };
    match run(sc.clone()) {
        Ok(r) => eprintln!("{sc:?}\n{r:?}"),
        Err(e) => panic!("{e}"),
    }
}

/// Counts failing runs instead of stopping at the first (`--ignored`, with `SIM_SCALE=n`): the
/// seeds of every simulation test (each `sweep`'s range of its faults, and
/// `every_fault_many_seeds`' seeds of every fault), each failure's replay line printed, the
/// counts per range at the end.
#[test]
#[ignore]
fn census() {
    // The `sweep` ranges of the tests above (seeds 0..n * scale()).
    let sweep_n = |f: Fault| match f {
        Fault::None => 200,
        Fault::PrimaryHostCrash => 400,
        _ => 300,
    };
    let (mut runs, mut failed) = (0, 0);
    let mut lines = vec![];
    for (range, base, n) in [("sweep", 0u64, None), ("every_fault_many_seeds", 10_000, Some(300))] {
        for f in ALL_FAULTS {
            let n = n.unwrap_or_else(|| sweep_n(f)) * scale();
            let mut bad = 0;
            for seed in base..base + n {
                runs += 1;
                if let Err(e) = run(Scenario::from_seed(f, seed)) {
                    bad += 1;
                    eprintln!("{}", e.lines().next().unwrap_or(""));
                    eprintln!("  {}", Scenario::from_seed(f, seed).replay_hint());
                }
            }
            failed += bad;
            lines.push(format!("census: {range} {f:?}: {bad} of {n} failed"));
        }
    }
    for l in lines {
        eprintln!("{l}");
    }
    eprintln!("census: {failed} of {runs} runs failed (SIM_SCALE={})", scale());
    assert_eq!(failed, 0);
}

/// The rare failures `SIM_SCALE=20` found (4 of 84,000 runs of `every_fault_many_seeds`' seeds;
/// seed 1806 from `table_3_3_row3_*`'s range), all on a faulty segment with the primary's
/// application failing; fixed, replayed here for good:
/// - `PrimaryAppHang` 13259, 15226: a client ACK the backup got clamped (its server had not sent
///   those bytes yet) was never relayed once it had, so the backup's server waited for an ACK
///   the client never sends again and its output stayed behind for the whole lag bound
///   (BackupLagging), after which the primary's hung application stalled the client.
/// - `PrimaryAppFin` 1806 (and 13259, 15226, the same ACK): MaxDelayFIN ran while the client
///   was still waiting for the primary's lost last segment (resent after 1, 2, 4 s), so the
///   lone FIN went out before the client asked for more and its stream ended early; the clock
///   now starts at the client's ACK of every byte before the FIN.
#[test]
fn rare_seeds_found_at_scale_20() {
    let seeds = [(Fault::PrimaryAppHang, 13259), (Fault::PrimaryAppHang, 15226), (Fault::PrimaryAppFin, 1806), (Fault::PrimaryAppFin, 13259), (Fault::PrimaryAppFin, 15226)];
    for (fault, seed) in seeds {
        if let Err(e) = run(Scenario::from_seed(fault, seed)) {
            panic!("{e}");
        }
    }
}
