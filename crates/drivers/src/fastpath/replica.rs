//! Replica mode's fast path, the backup's half (issue 22 item 4, step 1): the steady-state steps
//! of [`unbroken_engines::replica::Backup`] for an aligned connection (`bpf/replica/rep_tc.c`:
//! `rep_b_in` for client → backup server, `rep_b_out` for the backup server's output, withheld
//! with its digest), reading and updating the connection's entry of the `rep_b_conns` map
//! ([`Entry`]: the hand-off fields and [`State`], the engine's per-connection fields these steps
//! use), and sending the daemon what the engine keeps in collections (checkpoints, the copies
//! kept for the take-over, which connections changed) as ring-buffer [`Record`]s. The daemon's
//! side of the hand-off is [`Replica::op`] (`rep_op` by `BPF_PROG_TEST_RUN`; see
//! `bpf/replica/rep_state.h`). The primary's half is the steady state of a protected
//! connection ([`PrimaryDirection`]: `rep_p_in` learns from the client's pure ACKs, `rep_p_out`
//! gates its server's pure ACKs, retransmissions of released bytes and, without strict output
//! commit, its new output, Koch 3.2) in the map `rep_p_conns` ([`PEntry`], [`PState`]). The
//! backup's programs are attached by [`Replica::attach_backup`], the primary's by
//! [`Replica::attach_primary`] (the replica daemon's fast path).

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aya::maps::{HashMap, MapData, RingBuf};
use aya::programs::SchedClassifier;
use aya::Ebpf;

use unbroken_engines::replica::{BFast, PFast};
use unbroken_wire::seq::Seq;

use super::{bpf_err, classifier, load_classifiers, test_run, Error, Run, Verdict};

/// The compiled programs (build.rs).
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/rep_tc.o"));

const MAP: &str = "rep_b_conns";
const STATS: &str = "rep_stats";
const RING: &str = "rep_records";
const OP_PROGRAM: &str = "rep_op";

const BPF_F_LOCK: u64 = 4;
const BPF_NOEXIST: u64 = 1;

/// What `rep_b_out` (and `rep_p_out`) return for a packet they claimed and consumed: a withheld
/// segment of the backup's server, or one copied to the daemon (`TC_ACT_STOLEN`: attached as a
/// `cls_bpf` filter, consumed and reported sent). `rep_b_in` drops a client segment the engine
/// drops by decision with [`Verdict::Drop`] (`TC_ACT_SHOT`: TCX ignores STOLEN).
pub const CONSUMED: Verdict = Verdict::Other(4);

/// Bits of [`Entry::ctl`] (`REP_C_*`).
pub mod ctl {
    pub const FROZEN: u32 = 1 << 0;
    pub const USER: u32 = 1 << 1;
    /// The figures the primary waits for moved since the daemon last collected them.
    pub const CHANGED: u32 = 1 << 2;
}

/// Bits of [`State::flags`] (`REP_B_*`): which of the engine's `Option`s are `Some`.
pub mod flag {
    pub const ALIGNED: u32 = 1 << 0;
    pub const RCV_KNOWN: u32 = 1 << 1;
    pub const CLIENT_SEEN: u32 = 1 << 2;
    pub const ACKED_B: u32 = 1 << 3;
    pub const P_OUT: u32 = 1 << 4;
    pub const TS_FLOOR: u32 = 1 << 5;
    pub const CTS_MAX: u32 = 1 << 6;
    pub const CTS: u32 = 1 << 7;
    pub const B_TS: u32 = 1 << 8;
    pub const SERVER: u32 = 1 << 9;
    pub const STRICT: u32 = 1 << 10;
}

/// `skb->mark` bits: decided on the fast path / counted for the daemon (as checkpoint mode's).
pub const MARK_DONE: u32 = 0x2000_0000;
pub const MARK_SLOW: u32 = 0x1000_0000;

/// Which program: the direction of the packet on the backup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// A client segment toward the backup's server (`Backup::incoming`).
    Incoming,
    /// A segment of the backup's server toward the client (`Backup::outgoing`).
    Outgoing,
}

impl Direction {
    fn program(self) -> &'static str {
        match self {
            Direction::Incoming => "rep_b_in",
            Direction::Outgoing => "rep_b_out",
        }
    }
}

/// The map key (`struct rep_key`): `replica::ConnKey`, IPv4 as `::ffff:a.b.c.d`, ports in
/// network order.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Key {
    pub client: [u8; 16],
    pub client_port: [u8; 2],
    pub server_port: [u8; 2],
}

// SAFETY: plain bytes, no padding (20 bytes, asserted below and in C).
unsafe impl aya::Pod for Key {}

/// An address as the programs store it.
pub fn addr16(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    }
}

impl Key {
    pub fn new(client: SocketAddr, server_port: u16) -> Key {
        Key { client: addr16(client.ip()), client_port: client.port().to_be_bytes(), server_port: server_port.to_be_bytes() }
    }
}

/// `struct rep_b_state`: the engine's `BConn` fields the programs keep (same names; [`flag`]
/// says which options are set).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct State {
    pub out_hash: u64,
    /// When `b_ts_val` was seen: the kernel's clock (ns, `bpf_ktime_get_ns`) where a program
    /// set it; the engine keeps its own clock (ms) instead.
    pub b_ts_at: u64,
    pub flags: u32,
    pub delta: u32,
    pub ts_off: u32,
    pub snd_max: u32,
    pub rcv_nxt: u32,
    pub rcv_edge: u32,
    pub out_end: u32,
    pub last_ack: u32,
    pub acked_b: u32,
    pub p_out: u32,
    pub ts_floor: u32,
    pub cts_max_val: u32,
    pub cts_max_ecr: u32,
    pub cts_val: u32,
    pub cts_ecr: u32,
    pub b_ts_val: u32,
    pub server: [u8; 16],
    pub client_win: u16,
    pub ws_b: u8,
    pub pad: u8,
    pub pad2: u32,
}

// SAFETY: integers and bytes, no implicit padding (104 bytes, asserted below and in C).
unsafe impl aya::Pod for State {}

/// A map entry (`struct rep_b_entry`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Entry {
    /// `struct bpf_spin_lock`: never read or written from here.
    lock: u32,
    pub ctl: u32,
    pub slow: u32,
    pub seen: u32,
    pub gen: u32,
    pad: u32,
    pub state: State,
}

// SAFETY: integers, no implicit padding (128 bytes).
unsafe impl aya::Pod for Entry {}

const _: () = assert!(std::mem::size_of::<Key>() == 20);
const _: () = assert!(std::mem::size_of::<State>() == 104);
const _: () = assert!(std::mem::size_of::<Entry>() == 128);

impl State {
    /// The engine's fields ([`Backup::fast_state`]) in the programs' layout: `strict` is the
    /// pair's mode, `kernel_ts_at` the time of `b_ts_seen` on the kernel's clock (ns; the
    /// caller converts from the engine's milliseconds).
    ///
    /// [`Backup::fast_state`]: unbroken_engines::replica::Backup::fast_state
    pub fn from_engine(f: &BFast, strict: bool, kernel_ts_at: u64) -> State {
        let mut fl = if strict { flag::STRICT } else { 0 };
        for (on, bit) in [
            (f.aligned, flag::ALIGNED),
            (f.rcv_known, flag::RCV_KNOWN),
            (f.client_seen, flag::CLIENT_SEEN),
            (f.acked_b.is_some(), flag::ACKED_B),
            (f.p_out.is_some(), flag::P_OUT),
            (f.ts_floor.is_some(), flag::TS_FLOOR),
            (f.client_ts_max.is_some(), flag::CTS_MAX),
            (f.client_ts.is_some(), flag::CTS),
            (f.b_ts_seen.is_some(), flag::B_TS),
            (f.server.is_some(), flag::SERVER),
        ] {
            if on {
                fl |= bit;
            }
        }
        let (cts_max_val, cts_max_ecr) = f.client_ts_max.unwrap_or_default();
        let (cts_val, cts_ecr) = f.client_ts.unwrap_or_default();
        State {
            out_hash: f.out_hash,
            b_ts_at: if f.b_ts_seen.is_some() { kernel_ts_at } else { 0 },
            flags: fl,
            delta: f.delta,
            ts_off: f.ts_off,
            snd_max: f.snd_max.0,
            rcv_nxt: f.rcv_nxt.0,
            rcv_edge: f.rcv_edge.0,
            out_end: f.out_end.0,
            last_ack: f.last_ack.0,
            acked_b: f.acked_b.map_or(0, |s| s.0),
            p_out: f.p_out.map_or(0, |s| s.0),
            ts_floor: f.ts_floor.unwrap_or(0),
            cts_max_val,
            cts_max_ecr,
            cts_val,
            cts_ecr,
            b_ts_val: f.b_ts_seen.map_or(0, |(v, _)| v),
            server: f.server.map_or([0; 16], addr16),
            client_win: f.client_win,
            ws_b: f.ws_b,
            pad: 0,
            pad2: 0,
        }
    }

    /// Back into the engine's form ([`Backup::set_fast_state`]): `engine_ts_at` is the time of
    /// `b_ts_val` on the engine's clock (ms), `v6` whether the connection is IPv6 (an IPv4
    /// address is stored mapped).
    ///
    /// [`Backup::set_fast_state`]: unbroken_engines::replica::Backup::set_fast_state
    pub fn to_engine(&self, engine_ts_at: u64, v6: bool) -> BFast {
        let on = |bit: u32| self.flags & bit != 0;
        let server = if v6 {
            IpAddr::V6(std::net::Ipv6Addr::from(self.server))
        } else {
            IpAddr::V4(std::net::Ipv6Addr::from(self.server).to_ipv4_mapped().unwrap_or(std::net::Ipv4Addr::UNSPECIFIED))
        };
        BFast {
            aligned: on(flag::ALIGNED),
            rcv_known: on(flag::RCV_KNOWN),
            client_seen: on(flag::CLIENT_SEEN),
            delta: self.delta,
            ts_off: self.ts_off,
            ws_b: self.ws_b,
            snd_max: Seq(self.snd_max),
            rcv_nxt: Seq(self.rcv_nxt),
            rcv_edge: Seq(self.rcv_edge),
            out_end: Seq(self.out_end),
            out_hash: self.out_hash,
            last_ack: Seq(self.last_ack),
            acked_b: on(flag::ACKED_B).then_some(Seq(self.acked_b)),
            p_out: on(flag::P_OUT).then_some(Seq(self.p_out)),
            ts_floor: on(flag::TS_FLOOR).then_some(self.ts_floor),
            client_ts_max: on(flag::CTS_MAX).then_some((self.cts_max_val, self.cts_max_ecr)),
            client_ts: on(flag::CTS).then_some((self.cts_val, self.cts_ecr)),
            b_ts_seen: on(flag::B_TS).then_some((self.b_ts_val, engine_ts_at)),
            client_win: self.client_win,
            server: on(flag::SERVER).then_some(server),
        }
    }
}

impl Entry {
    pub fn new(s: &State) -> Entry {
        Entry { state: *s, ..Entry::default() }
    }
}

/// `struct rep_svc`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct Svc {
    addr: [u8; 16],
    port: [u8; 2],
    pad: u16,
}

// SAFETY: bytes, no implicit padding (20 bytes).
unsafe impl aya::Pod for Svc {}

/// What the programs sent the daemon (`struct rep_rec`), in the order they decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    /// The connection's figures moved since the daemon last collected them ([`Op::Collect`]).
    Changed(Key),
    /// `learn_output`'s checkpoint: the output end (primary's space) and its digest.
    Checkpoint { key: Key, end: u32, hash: u64 },
    /// A piece of a withheld segment kept for the take-over: the segment's end in the
    /// backup's space, the IP packet's length, where the piece starts, its packet ([`PieceOf`]),
    /// its bytes.
    Keep { key: Key, end_b: u32, total: u32, off: u32, of: PieceOf, bytes: Vec<u8> },
    /// A piece of a packet of the service an egress program declined in copy mode
    /// ([`Replica::set_egress_copy`]): consumed there, for the daemon's engine to decide. The IP
    /// packet's length, where the piece starts, its bytes.
    /// `counted`: the packet was counted in its entry's `slow` (as a packet marked
    /// [`MARK_SLOW`]: the daemon takes it with [`Op::Take`]); false when it had no entry.
    Slow { key: Key, counted: bool, total: u32, off: u32, of: PieceOf, bytes: Vec<u8> },
    /// A piece of a client segment with bytes that `rep_b_in` passed to the backup's server: a
    /// copy for the primary (the engine's `Backup::push_input`), as for [`Record::Keep`].
    Input { key: Key, total: u32, off: u32, of: PieceOf, bytes: Vec<u8> },
    /// A record this version does not know.
    Unknown(u32),
}

/// Which packet a piece belongs to: the CPU whose program wrote it and that CPU's number of
/// the packet. One packet's pieces are consecutive in the ring; two CPUs' interleave.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct PieceOf {
    pub cpu: u32,
    pub id: u32,
}

const REC_LEN: usize = 56;

impl Record {
    fn parse(b: &[u8]) -> Option<Record> {
        if b.len() < REC_LEN {
            return None;
        }
        let u32_at = |i: usize| u32::from_ne_bytes(b[i..i + 4].try_into().unwrap());
        let hash = u64::from_ne_bytes(b[24..32].try_into().unwrap());
        let mut key = Key::default();
        key.client.copy_from_slice(&b[32..48]);
        key.client_port.copy_from_slice(&b[48..50]);
        key.server_port.copy_from_slice(&b[50..52]);
        let (ty, len, a, bb, off) = (u32_at(0), u32_at(4) as usize, u32_at(8), u32_at(12), u32_at(16));
        let of = PieceOf { cpu: u32_at(20), id: u32_at(52) };
        Some(match ty {
            1 => Record::Changed(key),
            2 => Record::Checkpoint { key, end: a, hash },
            3 => Record::Keep { key, end_b: a, total: bb, off, of, bytes: b.get(REC_LEN..REC_LEN + len)?.to_vec() },
            4 => Record::Slow { key, counted: a != 0, total: bb, off, of, bytes: b.get(REC_LEN..REC_LEN + len)?.to_vec() },
            5 => Record::Input { key, total: bb, off, of, bytes: b.get(REC_LEN..REC_LEN + len)?.to_vec() },
            t => Record::Unknown(t),
        })
    }
}

/// The daemon's operations on an entry (`REP_OP_*`), atomic against the programs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// A packet marked [`MARK_SLOW`] arrived: freeze, count it as taken, hand over the state.
    Take,
    /// Freeze and hand over the state (a side-channel message, an unmarked packet).
    Freeze,
    /// Give the connection back with this state if no packet is between the paths.
    Thaw,
    /// The same, even if one is (it was lost before the queue).
    ThawForce,
    /// Read the entry and clear [`ctl::CHANGED`]: the daemon reports its figures now.
    Collect,
    /// The primary's only ([`Replica::p_report`]): a backup record applied in place.
    Report,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpResult {
    Done,
    NoEntry,
    /// [`Op::Thaw`] refused: the entry stays frozen and the daemon's. [`Op::Report`]: it was
    /// frozen already (the daemon's), nothing applied.
    Stale,
    /// [`Op::Report`]: applied, and the entry frozen: the engine answers this record with a
    /// packet (a fresh ACK, the client's ACK relayed), so the connection is the daemon's now.
    Taken,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpAnswer {
    pub result: OpResult,
    pub ctl_before: u32,
    pub entry: Entry,
}

/// `struct rep_op_req` / `struct rep_op_ans`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct OpMsg {
    word0: u32,
    word1: u32,
    key: Key,
    pad: u32,
    value: Entry,
}

const _: () = assert!(std::mem::size_of::<OpMsg>() == 160);

/// What the programs decided, summed over the CPUs (`struct rep_counters`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counters {
    pub incoming: u64,
    pub withheld: u64,
    pub slow: u64,
    pub dropped: u64,
    /// The engine's `BackupCounters` of the same names, for the packets claimed here.
    pub unacceptable: u64,
    pub ack_unverified: u64,
    pub ack_clamped: u64,
    /// Client segments dropped because their ACK lay beyond what the backup's server sent
    /// (strict mode).
    pub dropped_beyond: u64,
    /// Records that did not fit the ring (checkpoints, kept copies).
    pub records_lost: u64,
    /// Copy mode, `rep_b_out`: packets that may be TCP from a service address but that the
    /// parser refused (IP options, BIG TCP, fragments, IPv6 extension headers), dropped.
    pub unparsed_dropped: u64,
}

// SAFETY: plain integers.
unsafe impl aya::Pod for Counters {}

const P_MAP: &str = "rep_p_conns";
const P_STATS: &str = "rep_p_stats";
const P_OP_PROGRAM: &str = "rep_p_op";

/// The primary's programs: the direction of the packet on the primary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrimaryDirection {
    /// A client segment toward the primary's server (`Primary::incoming`: learned, unchanged).
    Incoming,
    /// A segment of the primary's server toward the client (`Primary::outgoing`: gated).
    Outgoing,
}

impl PrimaryDirection {
    fn program(self) -> &'static str {
        match self {
            PrimaryDirection::Incoming => "rep_p_in",
            PrimaryDirection::Outgoing => "rep_p_out",
        }
    }
}

/// Bits of [`PState::flags`] (`REP_P_*`).
pub mod pflag {
    pub const ANSWERED: u32 = 1 << 0;
    pub const ESTABLISHED: u32 = 1 << 1;
    pub const B_RCV_KNOWN: u32 = 1 << 2;
    pub const TS: u32 = 1 << 3;
    pub const TS_MAX: u32 = 1 << 4;
    pub const SENT_ACK: u32 = 1 << 5;
    pub const CLIENT_LAST: u32 = 1 << 6;
    pub const CL_TS: u32 = 1 << 7;
    pub const B: u32 = 1 << 8;
    pub const B_ALIGNED: u32 = 1 << 9;
    pub const OUT_SEEN: u32 = 1 << 10;
    pub const STRICT: u32 = 1 << 11;
}

/// `struct rep_p_state`: the engine's `PConn` fields the primary's programs keep.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PState {
    /// `client_heard_at`: the kernel's clock (ns) where a program set it.
    pub heard_at: u64,
    pub flags: u32,
    pub ack_p: u32,
    pub edge_p: u32,
    pub b_rcv_nxt: u32,
    pub b_rcv_edge: u32,
    pub ts_val: u32,
    pub ts_ecr: u32,
    pub ts_max: u32,
    pub sent_ack: u32,
    pub snd_p: u32,
    pub p_max: u32,
    pub stream_start: u32,
    pub client_ack: u32,
    pub cl_end: u32,
    pub cl_ts_val: u32,
    pub cl_ts_ecr: u32,
    pub cl_win: u16,
    pub ws_p: u8,
    pub pad: u8,
    pub rel: u32,
    pub p_end: u32,
    pub snd_c: u32,
    pub pad2: u32,
}

// SAFETY: integers, no implicit padding (96 bytes).
unsafe impl aya::Pod for PState {}

impl PState {
    /// The engine's fields ([`Primary::fast_state`]) in the programs' layout: `strict` is the
    /// pair's mode, `heard_at` `client_heard_at` on the kernel's clock (ns; the caller converts
    /// from the engine's milliseconds).
    ///
    /// [`Primary::fast_state`]: unbroken_engines::replica::Primary::fast_state
    pub fn from_engine(f: &PFast, strict: bool, heard_at: u64) -> PState {
        let mut st = PState { heard_at, ..PState::default() };
        let mut fl = if strict { pflag::STRICT } else { 0 };
        for (on, bit) in [(f.answered, pflag::ANSWERED), (f.established, pflag::ESTABLISHED), (f.out_seen, pflag::OUT_SEEN)] {
            if on {
                fl |= bit;
            }
        }
        if let Some((rcv_known, aligned, rcv_nxt, rcv_edge)) = f.b {
            fl |= pflag::B;
            if rcv_known {
                fl |= pflag::B_RCV_KNOWN;
            }
            if aligned {
                fl |= pflag::B_ALIGNED;
            }
            (st.b_rcv_nxt, st.b_rcv_edge) = (rcv_nxt.0, rcv_edge.0);
        }
        if let Some((v, e)) = f.ts {
            fl |= pflag::TS;
            (st.ts_val, st.ts_ecr) = (v, e);
        }
        if let Some(m) = f.ts_max {
            fl |= pflag::TS_MAX;
            st.ts_max = m;
        }
        if let Some(a) = f.sent_ack {
            fl |= pflag::SENT_ACK;
            st.sent_ack = a.0;
        }
        if let Some((end, win, ts)) = f.client_last {
            fl |= pflag::CLIENT_LAST;
            (st.cl_end, st.cl_win) = (end.0, win);
            if let Some((v, e)) = ts {
                fl |= pflag::CL_TS;
                (st.cl_ts_val, st.cl_ts_ecr) = (v, e);
            }
        }
        st.flags = fl;
        (st.rel, st.p_end, st.snd_c, st.ack_p, st.edge_p) = (f.rel.0, f.p_end.0, f.snd_c.0, f.ack_p.0, f.edge_p.0);
        (st.snd_p, st.p_max, st.stream_start, st.client_ack, st.ws_p) = (f.snd_p.0, f.p_max.0, f.stream_start.0, f.client_ack.0, f.ws_p);
        st
    }

    /// Back into the engine's form ([`Primary::set_fast_state`]): `engine_heard_at` is
    /// `client_heard_at` on the engine's clock (ms).
    ///
    /// [`Primary::set_fast_state`]: unbroken_engines::replica::Primary::set_fast_state
    pub fn to_engine(&self, engine_heard_at: u64) -> PFast {
        let on = |bit: u32| self.flags & bit != 0;
        PFast {
            answered: on(pflag::ANSWERED),
            established: on(pflag::ESTABLISHED),
            ws_p: self.ws_p,
            ack_p: Seq(self.ack_p),
            edge_p: Seq(self.edge_p),
            b: on(pflag::B).then_some((on(pflag::B_RCV_KNOWN), on(pflag::B_ALIGNED), Seq(self.b_rcv_nxt), Seq(self.b_rcv_edge))),
            rel: Seq(self.rel),
            p_end: Seq(self.p_end),
            sent_ack: on(pflag::SENT_ACK).then_some(Seq(self.sent_ack)),
            snd_c: Seq(self.snd_c),
            ts: on(pflag::TS).then_some((self.ts_val, self.ts_ecr)),
            ts_max: on(pflag::TS_MAX).then_some(self.ts_max),
            p_max: Seq(self.p_max),
            client_last: on(pflag::CLIENT_LAST).then_some((Seq(self.cl_end), self.cl_win, on(pflag::CL_TS).then_some((self.cl_ts_val, self.cl_ts_ecr)))),
            client_ack: Seq(self.client_ack),
            snd_p: Seq(self.snd_p),
            client_heard_at: engine_heard_at,
            stream_start: Seq(self.stream_start),
            out_seen: on(pflag::OUT_SEEN),
        }
    }
}

/// A primary map entry (`struct rep_p_entry`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PEntry {
    lock: u32,
    pub ctl: u32,
    pub slow: u32,
    pub seen: u32,
    pub gen: u32,
    pad: u32,
    pub state: PState,
}

// SAFETY: integers, no implicit padding (120 bytes).
unsafe impl aya::Pod for PEntry {}

const _: () = assert!(std::mem::size_of::<PState>() == 96);
const _: () = assert!(std::mem::size_of::<PEntry>() == 120);

/// `struct rep_p_op_req` (the answer is written over it).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct POpMsg {
    word0: u32,
    word1: u32,
    key: Key,
    pad: u32,
    value: PEntry,
}

const _: () = assert!(std::mem::size_of::<POpMsg>() == 152);

/// The primary programs' counters, summed over the CPUs (`struct rep_p_counters`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrimaryCounters {
    pub incoming: u64,
    pub outgoing: u64,
    pub slow: u64,
    pub dropped: u64,
    /// The engine's `PrimaryCounters` of the same names, for the packets claimed here.
    pub acks_lowered: u64,
    pub ts_raised: u64,
    /// Client pure ACKs passed without learning: the entry was the daemon's (frozen) or
    /// another CPU changed it meanwhile (`rep_p_in` never counts those against a thaw).
    pub unlearned: u64,
}

// SAFETY: plain integers.
unsafe impl aya::Pod for PrimaryCounters {}

/// The priorities of the egress filter (`rep_b_out` or `rep_p_out`) (two: a restarted daemon's goes in beside its
/// predecessor's before that one goes) and its handle.
const EGRESS_PRIO: [u16; 2] = [0x7562, 0x7563];
const EGRESS_HANDLE: aya::programs::tc::TcHandle = aya::programs::tc::TcHandle::new(0, 0x7562);

/// Removes the egress filters (`rep_b_out`, `rep_p_out`) from `iface` (a backup daemon's that no longer runs,
/// see [`Replica::attach_backup`]): its program stops withholding. How many there were (none
/// also when this process may not remove filters).
pub fn remove_egress(iface: &str) -> Result<usize, Error> {
    use aya::programs::tc::SchedClassifierLink;
    let mut n = 0;
    for prio in EGRESS_PRIO {
        // No such device: nothing of ours on it.
        let Ok(link) = SchedClassifierLink::attached(iface, aya::programs::TcAttachType::Egress, prio, EGRESS_HANDLE, None) else { continue };
        if aya::programs::links::Link::detach(link).is_ok() {
            n += 1;
        }
    }
    Ok(n)
}

/// What the egress watch found at its last look ([`Replica::watch_egress`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EgressSeen {
    /// The egress filter is attached and nothing runs before it.
    Present,
    /// It is gone or may be skipped: why.
    Gone(String),
}

#[derive(Default)]
struct Watched {
    checks: u64,
    last: Option<Result<EgressSeen, String>>,
}

/// A running egress watch; stops when dropped.
pub struct EgressWatch {
    shared: Arc<Mutex<Watched>>,
    stop: Arc<AtomicBool>,
}

impl EgressWatch {
    /// The latest answer and how many looks there were so far (`None`: not looked yet).
    /// `Err`: the kernel could not be asked that time.
    pub fn seen(&self) -> (u64, Option<Result<EgressSeen, String>>) {
        match self.shared.lock() {
            Ok(w) => (w.checks, w.last.clone()),
            Err(_) => (0, None),
        }
    }
}

impl Drop for EgressWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// One look: the egress program (`rep_b_out` or `rep_p_out`, program `id`) still runs at `iface`'s egress. Gone when the
/// device is gone, the filter is not listed, another filter runs before it (the dump's
/// priority order: one that answers OK skips it; a predecessor's `rep_b_out` at the other of
/// our two priorities is ours too), or TCX egress programs are attached (they run before every
/// tc filter, and their PASS skips it). An error: no answer this time.
pub fn egress_check(iface: &str, id: u32) -> Result<EgressSeen, String> {
    let Some(index) = crate::tcfilter::ifindex(iface).map_err(|e| format!("looking up {iface}: {e}"))? else {
        return Ok(EgressSeen::Gone(format!("the device {iface} is gone")));
    };
    let mut filters = crate::tcfilter::list(index, crate::tcfilter::PARENT_EGRESS).map_err(|e| format!("listing the tc egress filters of {iface}: {e}"))?;
    filters.sort_by_key(|f| f.priority);
    let Some(at) = filters.iter().position(|f| f.kind == "bpf" && f.prog_id == Some(id)) else {
        return Ok(EgressSeen::Gone(format!("the fast path's filter is no longer attached at {iface} egress")));
    };
    if let Some(f) = filters[..at].iter().find(|f| !(f.kind == "bpf" && EGRESS_PRIO.contains(&f.priority))) {
        return Ok(EgressSeen::Gone(format!("a {} filter at priority {} runs before the fast path's filter at {iface} egress and may let packets past it", f.kind, f.priority)));
    }
    if let Ok((_, progs)) = SchedClassifier::query_tcx(iface, aya::programs::TcAttachType::Egress) {
        // (A kernel that cannot answer has no TCX: the fast path needs 6.6, which has it.)
        if !progs.is_empty() {
            let ids: Vec<u32> = progs.iter().map(|p| p.id()).collect();
            return Ok(EgressSeen::Gone(format!("TCX egress programs {ids:?} run at {iface} before every tc filter and may let packets past the fast path's filter")));
        }
    }
    Ok(EgressSeen::Present)
}

/// `rep_cfg`'s flags (`REP_CFG_*`).
mod cfg {
    pub const EGRESS_COPY: u32 = 1 << 0;
    pub const PROMOTED: u32 = 1 << 1;
    pub const USER_OUT: u32 = 1 << 2;
}

/// `struct rep_cfg`.
#[repr(C)]
#[derive(Clone, Copy)]
struct CfgVal {
    flags: u32,
    own_mark: u32,
    lease: u64,
}

// SAFETY: integers, no implicit padding (16 bytes).
unsafe impl aya::Pod for CfgVal {}

/// The queue rules' matches (`rep_q_in`, `rep_q_out`: socket filters for `iptables -m bpf
/// --object-pinned`), as pinned by [`Replica::pin_queue_matches`].
const QUEUE_MATCHES: [&str; 2] = ["rep_q_in", "rep_q_out"];

/// Removes the matches [`Replica::pin_queue_matches`] pinned in `dir` (the daemon's rules that
/// name them removed first: `iptables-legacy` opens the paths again whenever it rewrites the
/// table), and `dir` if it is then empty.
pub fn unpin_queue_matches(dir: &std::path::Path) -> std::io::Result<()> {
    super::unpin(dir, &QUEUE_MATCHES)
}

/// The loaded programs, their map and the ring.
pub struct Replica {
    ebpf: Ebpf,
    ring: RingBuf<MapData>,
    /// What `rep_cfg` holds: the flags, and the daemon's own mark (its raw sends, which the
    /// egress programs pass untouched).
    cfg: u32,
    own_mark: u32,
    /// `rep_cfg.lease` ([`Replica::set_lease`]).
    lease: u64,
    /// The device and the program attached at its egress ([`Replica::attach_backup`],
    /// [`Replica::attach_primary`]).
    egress: Option<(String, &'static str)>,
}

impl Replica {
    /// Loads the three programs (through the verifier) and creates the maps.
    pub fn load() -> Result<Replica, Error> {
        super::available()?;
        let mut ebpf = Ebpf::load(OBJECT).map_err(|e| bpf_err("loading bpf/replica/rep_tc.o", e))?;
        load_classifiers(&mut ebpf, &[Direction::Incoming.program(), Direction::Outgoing.program(), OP_PROGRAM, PrimaryDirection::Incoming.program(), PrimaryDirection::Outgoing.program(), P_OP_PROGRAM])?;
        for name in QUEUE_MATCHES {
            let prog: &mut aya::programs::SocketFilter = ebpf.program_mut(name).ok_or_else(|| Error::Bpf(format!("no program {name}")))?.try_into().map_err(|e| bpf_err(name, e))?;
            prog.load().map_err(|e| bpf_err(&format!("loading {name} (verifier)"), e))?;
        }
        let ring = ebpf.take_map(RING).ok_or_else(|| Error::Bpf(format!("no map {RING}")))?;
        let ring = RingBuf::try_from(ring).map_err(|e| bpf_err(RING, e))?;
        Ok(Replica { ebpf, ring, cfg: 0, own_mark: 0, lease: 0, egress: None })
    }

    /// The ring buffer's descriptor: readable when a record that wakes the reader arrived
    /// (`REP_REC_CHANGED`; checkpoints and kept pieces are written without a wake-up).
    pub fn ring_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.ring.as_raw_fd()
    }

    /// Attaches the backup's programs to `iface`. `rep_b_out` at tc egress as a netlink
    /// `cls_bpf` filter in direct-action mode, not TCX: TCX takes only PASS, DROP and REDIRECT
    /// from a program and treats `TC_ACT_STOLEN` (what `rep_b_out` answers for a packet it
    /// withholds or copies) as "next", i.e. passes it, while `cls_bpf` consumes it and tells
    /// the sender it was sent (a DROP would make its TCP reduce its window for every withheld
    /// segment). The filter outlives this process, so that a daemon that dies leaves it
    /// withholding its server's output (fail closed, as the queue rules); a predecessor's is
    /// replaced without a gap: ours goes in at the other of two priorities (the older runs
    /// first or after it, consuming either way), then the older one goes. `rep_b_in` at TCX
    /// ingress (detached when this value is dropped: the queue rule then takes every client
    /// packet again, and drops it while no daemon reads the queue). Copy mode is turned on
    /// first ([`Replica::set_egress_copy`]).
    pub fn attach_backup(&mut self, iface: &str) -> Result<(), Error> {
        self.attach(iface, Direction::Outgoing.program(), Direction::Incoming.program())
    }

    /// Attaches the primary's programs to `iface` as [`Replica::attach_backup`] attaches the
    /// backup's: `rep_p_out` at tc egress (`cls_bpf`, copy mode: a packet of the service it
    /// declines reaches the daemon as a [`Record::Slow`] copy and is consumed, never passed
    /// ungated; the filter outlives this process, fail closed), `rep_p_in` at TCX ingress. The
    /// filters share the backup's priorities: a daemon that restarts in the other role
    /// replaces its predecessor's filter the same way.
    pub fn attach_primary(&mut self, iface: &str) -> Result<(), Error> {
        self.attach(iface, PrimaryDirection::Outgoing.program(), PrimaryDirection::Incoming.program())
    }

    fn attach(&mut self, iface: &str, out: &'static str, inp: &'static str) -> Result<(), Error> {
        use aya::programs::tc::{NlOptions, SchedClassifierLink, TcAttachOptions};
        use aya::programs::TcAttachType;
        self.set_egress_copy(true)?;
        // "Exists" is the usual answer (another program's clsact, or a predecessor's).
        let _ = aya::programs::tc::qdisc_add_clsact(iface);
        let prog = super::classifier_mut(&mut self.ebpf, out)?;
        let mut attached = None;
        let mut first_err = None;
        for (i, &priority) in EGRESS_PRIO.iter().enumerate() {
            let opts = TcAttachOptions::Netlink(NlOptions { priority, handle: EGRESS_HANDLE, ..Default::default() });
            match prog.attach_with_options(iface, TcAttachType::Egress, opts) {
                Ok(id) => {
                    attached = Some((i, id));
                    break;
                }
                Err(e) => {
                    first_err.get_or_insert(e.to_string());
                }
            }
        }
        let Some((i, id)) = attached else {
            return Err(Error::Bpf(format!("attaching {out} to {iface} (tc egress, cls_bpf): {}", first_err.unwrap_or_default())));
        };
        // A failure from here on leaves the predecessor's filter in place (ours is detached
        // with this value if it was not taken yet; once taken it stays, withholding, until a
        // daemon that runs without the fast path removes both after its OUTPUT jump is in):
        // never a moment without a filter or the jump.
        let link = prog.take_link(id).map_err(|e| bpf_err(&format!("taking {out}'s filter"), e))?;
        // Never detached by this process: it outlives it (see above).
        std::mem::forget(link);
        self.egress = Some((iface.to_string(), out));
        super::attach_tcx(&mut self.ebpf, inp, iface, TcAttachType::Ingress)?;
        // Everything of ours runs: a predecessor's filter at the other priority goes.
        if let Ok(old) = SchedClassifierLink::attached(iface, TcAttachType::Egress, EGRESS_PRIO[1 - i], EGRESS_HANDLE, None) {
            let _ = aya::programs::links::Link::detach(old);
        }
        Ok(())
    }

    /// Pins the queue rules' matches as `DIR/rep_q_in` and `DIR/rep_q_out` (`DIR` on a BPF
    /// filesystem, created if missing; an earlier daemon's files replaced) for `iptables -m bpf
    /// --object-pinned`; returns them in that order (packets to the service, from it). The
    /// OUTPUT rule that names `rep_q_out` takes the server's packets only once
    /// [`Replica::set_promoted`] or [`Replica::set_user_out`] said so (review finding 4: no
    /// iptables command at the take-over). They stay pinned when this is dropped, with the
    /// rules ([`unpin_queue_matches`]).
    pub fn pin_queue_matches(&mut self, dir: &std::path::Path) -> Result<(std::path::PathBuf, std::path::PathBuf), Error> {
        std::fs::create_dir_all(dir).map_err(|e| bpf_err(&format!("creating {}", dir.display()), e))?;
        let mut paths = Vec::new();
        for name in QUEUE_MATCHES {
            let path = dir.join(name);
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(bpf_err(&format!("removing the stale pin {}", path.display()), e)),
            }
            let prog: &mut aya::programs::SocketFilter = self.ebpf.program_mut(name).ok_or_else(|| Error::Bpf(format!("no program {name}")))?.try_into().map_err(|e| bpf_err(name, e))?;
            prog.pin(&path).map_err(|e| bpf_err(&format!("pinning {name} at {}", path.display()), e))?;
            paths.push(path);
        }
        Ok((paths[0].clone(), paths[1].clone()))
    }

    /// Starts watching that `rep_b_out` of this value still withholds its server's output at
    /// the egress of the device [`Replica::attach_backup`] attached it to (review finding 5:
    /// `tc qdisc del dev X clsact`, a recreated device, another tool's cleanup remove it
    /// silently, and the output then reaches the wire), every `period`, on a thread of its own:
    /// the rtnetlink dump waits for the kernel's RTNL lock, which another tool may hold for a
    /// long time, and the packet loop must never wait for it (its beats would stop and the peer
    /// would fence this host). The loop reads the latest answer ([`EgressWatch::seen`]).
    pub fn watch_egress(&self, period: Duration) -> Result<EgressWatch, Error> {
        let (iface, id) = self.egress_target()?;
        let shared = Arc::new(Mutex::new(Watched::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (s2, stop2) = (shared.clone(), stop.clone());
        std::thread::Builder::new()
            .name("replica-egress".into())
            .spawn(move || {
                while !stop2.load(Ordering::Relaxed) {
                    let r = egress_check(&iface, id);
                    if let Ok(mut w) = s2.lock() {
                        w.checks += 1;
                        w.last = Some(r);
                    }
                    std::thread::sleep(period);
                }
            })
            .map_err(|e| bpf_err("starting the egress watch thread", e))?;
        Ok(EgressWatch { shared, stop })
    }

    /// One look now, on this thread ([`egress_check`]; the daemon's look from a thread of its
    /// own, [`Replica::watch_egress`]).
    pub fn egress_now(&self) -> Result<EgressSeen, String> {
        let (iface, id) = self.egress_target().map_err(|e| e.to_string())?;
        egress_check(&iface, id)
    }

    fn egress_target(&self) -> Result<(String, u32), Error> {
        let (iface, prog) = self.egress.clone().ok_or_else(|| Error::Bpf("no egress program is attached".into()))?;
        let id = classifier(&self.ebpf, prog)?.info().map_err(|e| bpf_err(&format!("{prog}'s id"), e))?.id();
        Ok((iface, id))
    }

    /// The daemon takes its server's output through the queue again, without the egress
    /// program (its filter is gone, or may be skipped): the OUTPUT rule's match takes every
    /// packet, in one write (`rep_q_out`). Copy mode stays: if the filter still runs, a packet
    /// that passed OUTPUT just before the write reaches it without the queue's accept mark and
    /// is copied to the daemon, never passed as its server built it.
    pub fn set_user_out(&mut self) -> Result<(), Error> {
        self.write_cfg(self.cfg | cfg::USER_OUT)
    }

    /// The primary: its server's output through the OUTPUT queue rule (`on`: before the pair
    /// protects, and once it no longer can) or through `rep_p_out` alone (off), one write
    /// (`rep_q_out` reads it). Copy mode stays on either way: what passed OUTPUT unqueued
    /// just before the switch is claimed by `rep_p_out` with the entry's newest fields, or
    /// copied to the daemon; the queue's accepted packets carry the daemon's mark and pass.
    pub fn set_queue_out(&mut self, on: bool) -> Result<(), Error> {
        self.write_cfg(if on { self.cfg | cfg::USER_OUT } else { self.cfg & !cfg::USER_OUT })
    }

    /// Detaches `rep_b_out`'s filter from the device this value attached it to (this run
    /// cannot go on with the fast path).
    pub fn detach_egress(&mut self) -> Result<(), Error> {
        match self.egress.take() {
            Some((iface, _)) => remove_egress(&iface).map(drop),
            None => Ok(()),
        }
    }

    /// The take-over (the OUTPUT queue rule installed first): `rep_b_out` passes every packet
    /// untouched from now on.
    pub fn set_promoted(&mut self, on: bool) -> Result<(), Error> {
        self.write_cfg(if on { self.cfg | cfg::PROMOTED } else { self.cfg & !cfg::PROMOTED })
    }

    /// The daemon's own packets (its raw socket's `SO_MARK`, exactly): the egress programs
    /// pass them untouched in every mode. Without it, a backup whose take-over could not
    /// install the OUTPUT rule (copy mode kept, its engine translating the copies) would copy
    /// and consume its own translated sends again. 0: none.
    pub fn set_own_mark(&mut self, mark: u32) -> Result<(), Error> {
        self.own_mark = mark;
        self.write_cfg(self.cfg)
    }

    /// The primary's lease: until `deadline` (the kernel's clock, ns; 0: none) its programs
    /// claim packets; past it they claim nothing (`rep_cfg.lease`), so that a daemon that died
    /// or hangs leaves no connection carried by stale figures. The daemon renews it.
    pub fn set_lease(&mut self, deadline: u64) -> Result<(), Error> {
        self.lease = deadline;
        self.write_cfg(self.cfg)
    }

    fn write_cfg(&mut self, flags: u32) -> Result<(), Error> {
        let m = self.ebpf.map_mut("rep_cfg").ok_or_else(|| Error::Bpf("no map rep_cfg".into()))?;
        let mut a: aya::maps::Array<&mut MapData, CfgVal> = aya::maps::Array::try_from(m).map_err(|e| bpf_err("rep_cfg", e))?;
        a.set(0, CfgVal { flags, own_mark: self.own_mark, lease: self.lease }, 0).map_err(|e| bpf_err("rep_cfg", e))?;
        self.cfg = flags;
        Ok(())
    }

    fn map(&mut self) -> Result<HashMap<&mut MapData, Key, Entry>, Error> {
        let m = self.ebpf.map_mut(MAP).ok_or_else(|| Error::Bpf(format!("no map {MAP}")))?;
        HashMap::try_from(m).map_err(|e| bpf_err(MAP, e))
    }

    /// Writes the entry of `key` (created or replaced; the programs own it, nothing pending).
    pub fn insert(&mut self, key: &Key, s: &State) -> Result<(), Error> {
        self.map()?.insert(key, Entry::new(s), 0).map_err(|e| bpf_err("map insert", e))
    }

    /// Creates the entry of `key`; false when there is one already (left as it is).
    pub fn install(&mut self, key: &Key, s: &State) -> Result<bool, Error> {
        match self.map()?.insert(key, Entry::new(s), BPF_NOEXIST) {
            Ok(()) => Ok(true),
            Err(aya::maps::MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::EEXIST) => Ok(false),
            Err(e) => Err(bpf_err("map insert", e)),
        }
    }

    /// The entry of `key`, read under its lock.
    pub fn entry(&mut self, key: &Key) -> Result<Option<Entry>, Error> {
        match self.map()?.get(key, BPF_F_LOCK) {
            Ok(e) => Ok(Some(e)),
            Err(aya::maps::MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(bpf_err("map lookup", e)),
        }
    }

    /// Removes the entry of `key`.
    pub fn remove(&mut self, key: &Key) -> Result<(), Error> {
        match self.map()?.remove(key) {
            Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
            Err(aya::maps::MapError::SyscallError(s)) if s.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
            Err(e) => Err(bpf_err("map remove", e)),
        }
    }

    /// Carries out `op` on the entry of `key` (`value`: the state [`Op::Thaw`] writes).
    pub fn op(&self, op: Op, key: &Key, value: Option<&State>) -> Result<OpAnswer, Error> {
        let code = match op {
            Op::Take => 1,
            Op::Freeze => 2,
            Op::Thaw => 3,
            Op::ThawForce => 4,
            Op::Collect => 5,
            Op::Report => return Err(Error::Bpf("Op::Report is the primary's".into())),
        };
        let req = OpMsg { word0: code, word1: 0, key: *key, pad: 0, value: value.map(Entry::new).unwrap_or_default() };
        // SAFETY: OpMsg is #[repr(C)] integers and bytes without padding.
        let bytes: [u8; 160] = unsafe { std::mem::transmute(req) };
        let (run, _) = test_run(classifier(&self.ebpf, OP_PROGRAM)?, &bytes, 1)?;
        if run.packet.len() < 160 {
            return Err(Error::Bpf(format!("{OP_PROGRAM} answered {} bytes", run.packet.len())));
        }
        let mut out = [0u8; 160];
        out.copy_from_slice(&run.packet[..160]);
        // SAFETY: as above.
        let ans: OpMsg = unsafe { std::mem::transmute(out) };
        let result = match (run.verdict, ans.word0) {
            (Verdict::Done, 0) => OpResult::Done,
            (Verdict::Other(1), 1) => OpResult::NoEntry,
            (Verdict::Drop, 2) => OpResult::Stale,
            (v, r) => return Err(Error::Bpf(format!("{OP_PROGRAM}: {op:?} returned {v:?}, result {r}"))),
        };
        Ok(OpAnswer { result, ctl_before: ans.word1, entry: ans.value })
    }

    /// Copy mode for the egress programs (`REP_CFG_EGRESS_COPY`): a packet of a service
    /// ([`Replica::add_service`]) that `rep_b_out` or `rep_p_out` declines is copied to the
    /// daemon ([`Record::Slow`]) and consumed instead of passed (attached at tc egress, a
    /// declined packet would otherwise reach the wire as its server built it).
    pub fn set_egress_copy(&mut self, on: bool) -> Result<(), Error> {
        self.write_cfg(if on { self.cfg | cfg::EGRESS_COPY } else { self.cfg & !cfg::EGRESS_COPY })
    }

    /// A service endpoint (the service address and a port) for copy mode; also the address's
    /// wildcard (port 0), which names it for packets the parser refused (`rep_b_out` drops
    /// those: fail closed).
    pub fn add_service(&mut self, svc: SocketAddr) -> Result<(), Error> {
        let m = self.ebpf.map_mut("rep_services").ok_or_else(|| Error::Bpf("no map rep_services".into()))?;
        let mut h: HashMap<&mut MapData, Svc, u8> = HashMap::try_from(m).map_err(|e| bpf_err("rep_services", e))?;
        for port in [svc.port(), 0] {
            h.insert(Svc { addr: addr16(svc.ip()), port: port.to_be_bytes(), pad: 0 }, 1, 0).map_err(|e| bpf_err("rep_services", e))?;
        }
        Ok(())
    }

    /// The records the programs sent since the last call, in order.
    pub fn records(&mut self) -> Vec<Record> {
        let mut out = vec![];
        while let Some(item) = self.ring.next() {
            out.push(Record::parse(&item).unwrap_or(Record::Unknown(0)));
        }
        out
    }

    /// What the programs decided so far, summed over the CPUs.
    pub fn counters(&mut self) -> Result<Counters, Error> {
        let m = self.ebpf.map_mut(STATS).ok_or_else(|| Error::Bpf(format!("no map {STATS}")))?;
        let a: aya::maps::PerCpuArray<&mut MapData, Counters> = aya::maps::PerCpuArray::try_from(m).map_err(|e| bpf_err(STATS, e))?;
        let per_cpu = a.get(&0, 0).map_err(|e| bpf_err("counters", e))?;
        let mut t = Counters::default();
        for c in per_cpu.iter() {
            t.incoming += c.incoming;
            t.withheld += c.withheld;
            t.slow += c.slow;
            t.dropped += c.dropped;
            t.unacceptable += c.unacceptable;
            t.ack_unverified += c.ack_unverified;
            t.ack_clamped += c.ack_clamped;
            t.dropped_beyond += c.dropped_beyond;
            t.records_lost += c.records_lost;
            t.unparsed_dropped += c.unparsed_dropped;
        }
        Ok(t)
    }

    fn p_map(&mut self) -> Result<HashMap<&mut MapData, Key, PEntry>, Error> {
        let m = self.ebpf.map_mut(P_MAP).ok_or_else(|| Error::Bpf(format!("no map {P_MAP}")))?;
        HashMap::try_from(m).map_err(|e| bpf_err(P_MAP, e))
    }

    /// Writes the primary entry of `key` (created or replaced; the programs own it).
    pub fn p_insert(&mut self, key: &Key, s: &PState) -> Result<(), Error> {
        self.p_map()?.insert(key, PEntry { state: *s, ..PEntry::default() }, 0).map_err(|e| bpf_err("map insert", e))
    }

    /// Creates the primary entry of `key`; false when there is one already (left as it is).
    pub fn p_install(&mut self, key: &Key, s: &PState) -> Result<bool, Error> {
        match self.p_map()?.insert(key, PEntry { state: *s, ..PEntry::default() }, BPF_NOEXIST) {
            Ok(()) => Ok(true),
            Err(aya::maps::MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::EEXIST) => Ok(false),
            Err(e) => Err(bpf_err("map insert", e)),
        }
    }

    /// When `rep_p_out` last passed new output of the primary's server (`rep_p_clock`: the
    /// kernel's clock, ns; 0: never): `Primary::last_output_ms` for the output the engine did
    /// not see.
    pub fn p_clock(&mut self) -> Result<u64, Error> {
        let m = self.ebpf.map_mut("rep_p_clock").ok_or_else(|| Error::Bpf("no map rep_p_clock".into()))?;
        let a: aya::maps::Array<&mut MapData, u64> = aya::maps::Array::try_from(m).map_err(|e| bpf_err("rep_p_clock", e))?;
        a.get(&0, 0).map_err(|e| bpf_err("rep_p_clock", e))
    }

    /// The primary entry of `key`, read under its lock.
    pub fn p_entry(&mut self, key: &Key) -> Result<Option<PEntry>, Error> {
        match self.p_map()?.get(key, BPF_F_LOCK) {
            Ok(e) => Ok(Some(e)),
            Err(aya::maps::MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(bpf_err("map lookup", e)),
        }
    }

    /// Removes the primary entry of `key`.
    pub fn p_remove(&mut self, key: &Key) -> Result<(), Error> {
        match self.p_map()?.remove(key) {
            Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
            Err(aya::maps::MapError::SyscallError(s)) if s.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
            Err(e) => Err(bpf_err("map remove", e)),
        }
    }

    /// [`Replica::op`] on a primary entry ([`Op::Collect`] only reads it).
    pub fn p_op(&self, op: Op, key: &Key, value: Option<&PState>) -> Result<(OpResult, u32, PEntry), Error> {
        let code = match op {
            Op::Take => 1,
            Op::Freeze => 2,
            Op::Thaw => 3,
            Op::ThawForce => 4,
            Op::Collect => 5,
            Op::Report => 6,
        };
        let req = POpMsg { word0: code, word1: 0, key: *key, pad: 0, value: PEntry { state: value.copied().unwrap_or_default(), ..PEntry::default() } };
        // SAFETY: POpMsg is #[repr(C)] integers and bytes without padding.
        let bytes: [u8; 152] = unsafe { std::mem::transmute(req) };
        let (run, _) = test_run(classifier(&self.ebpf, P_OP_PROGRAM)?, &bytes, 1)?;
        if run.packet.len() < 152 {
            return Err(Error::Bpf(format!("{P_OP_PROGRAM} answered {} bytes", run.packet.len())));
        }
        let mut out = [0u8; 152];
        out.copy_from_slice(&run.packet[..152]);
        // SAFETY: as above.
        let ans: POpMsg = unsafe { std::mem::transmute(out) };
        let result = match (run.verdict, ans.word0) {
            (Verdict::Done, 0) => OpResult::Done,
            (Verdict::Other(1), 1) => OpResult::NoEntry,
            (Verdict::Drop, 2) => OpResult::Stale,
            (Verdict::Other(4), 4) if op == Op::Report => OpResult::Taken,
            (v, r) => return Err(Error::Bpf(format!("{P_OP_PROGRAM}: {op:?} returned {v:?}, result {r}"))),
        };
        Ok((result, ans.word1, ans.value))
    }

    /// One record of the backup's report (its RCV.NXT and window edge when `rcv` is given, its
    /// alignment, the client's ACK as it heard it, `last_ack`, 0 for none) applied to the
    /// primary entry of `key` in place ([`Op::Report`], `REP_OP_REPORT`): the gate follows it
    /// at once. [`OpResult::Taken`] when the engine would answer the record with a packet (the
    /// entry is then frozen, the daemon's); [`OpResult::Stale`] when it was frozen already.
    pub fn p_report(&self, key: &Key, rcv: Option<(Seq, Seq)>, aligned: bool, last_ack: Seq) -> Result<(OpResult, PEntry), Error> {
        let mut st = PState::default();
        if let Some((nxt, edge)) = rcv {
            st.flags |= pflag::B_RCV_KNOWN;
            (st.b_rcv_nxt, st.b_rcv_edge) = (nxt.0, edge.0);
        }
        if aligned {
            st.flags |= pflag::B_ALIGNED;
        }
        st.client_ack = last_ack.0;
        let (r, _, e) = self.p_op(Op::Report, key, Some(&st))?;
        Ok((r, e))
    }

    /// The primary programs' counters, summed over the CPUs.
    pub fn p_counters(&mut self) -> Result<PrimaryCounters, Error> {
        let m = self.ebpf.map_mut(P_STATS).ok_or_else(|| Error::Bpf(format!("no map {P_STATS}")))?;
        let a: aya::maps::PerCpuArray<&mut MapData, PrimaryCounters> = aya::maps::PerCpuArray::try_from(m).map_err(|e| bpf_err(P_STATS, e))?;
        let per_cpu = a.get(&0, 0).map_err(|e| bpf_err("counters", e))?;
        let mut t = PrimaryCounters::default();
        for c in per_cpu.iter() {
            t.incoming += c.incoming;
            t.outgoing += c.outgoing;
            t.slow += c.slow;
            t.dropped += c.dropped;
            t.acks_lowered += c.acks_lowered;
            t.ts_raised += c.ts_raised;
            t.unlearned += c.unlearned;
        }
        Ok(t)
    }

    fn p_program(&self, d: PrimaryDirection) -> Result<&SchedClassifier, Error> {
        classifier(&self.ebpf, d.program())
    }

    /// Runs `ip` through the primary's program for direction `d` once.
    pub fn run_primary(&self, d: PrimaryDirection, ip: &[u8]) -> Result<Run, Error> {
        Ok(test_run(self.p_program(d)?, ip, 1)?.0)
    }

    /// The kernel's mean time per run of `ip` through the primary's program for `d`.
    pub fn primary_time_per_packet(&self, d: PrimaryDirection, ip: &[u8], repeat: u32) -> Result<Duration, Error> {
        Ok(test_run(self.p_program(d)?, ip, repeat)?.1)
    }

    fn program(&self, d: Direction) -> Result<&SchedClassifier, Error> {
        classifier(&self.ebpf, d.program())
    }

    /// Runs the IP packet `ip` through direction `d`'s program once (`BPF_PROG_TEST_RUN`).
    pub fn run(&self, d: Direction, ip: &[u8]) -> Result<Run, Error> {
        Ok(test_run(self.program(d)?, ip, 1)?.0)
    }

    /// [`Replica::run`] with `skb->mark` set (a packet a socket marked, e.g. the daemon's raw
    /// socket).
    pub fn run_marked(&self, d: Direction, ip: &[u8], mark: u32) -> Result<Run, Error> {
        Ok(super::test_run_marked(self.program(d)?, ip, 1, mark)?.0)
    }

    /// The kernel's mean time per run of `ip` through direction `d`'s program over `repeat`
    /// runs (each run sees the entry as the previous one left it).
    pub fn time_per_packet(&self, d: Direction, ip: &[u8], repeat: u32) -> Result<Duration, Error> {
        Ok(test_run(self.program(d)?, ip, repeat)?.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `bpf/replica/rep_state.h` holds the values of [`flag`] and [`ctl`] (checked here, one
    /// line per define).
    #[test]
    fn c_flags_are_the_mirrors() {
        let header = include_str!("../../bpf/replica/rep_state.h");
        let value = |name: &str| -> u32 {
            let line = header.lines().find(|l| l.starts_with(&format!("#define {name} "))).unwrap_or_else(|| panic!("{name} missing"));
            1 << line.split("(1 << ").nth(1).unwrap().trim_end_matches(')').parse::<u32>().unwrap()
        };
        for (name, f) in [
            ("REP_B_ALIGNED", flag::ALIGNED),
            ("REP_B_RCV_KNOWN", flag::RCV_KNOWN),
            ("REP_B_CLIENT_SEEN", flag::CLIENT_SEEN),
            ("REP_B_ACKED_B", flag::ACKED_B),
            ("REP_B_P_OUT", flag::P_OUT),
            ("REP_B_TS_FLOOR", flag::TS_FLOOR),
            ("REP_B_CTS_MAX", flag::CTS_MAX),
            ("REP_B_CTS", flag::CTS),
            ("REP_B_B_TS", flag::B_TS),
            ("REP_B_SERVER", flag::SERVER),
            ("REP_B_STRICT", flag::STRICT),
            ("REP_C_FROZEN", ctl::FROZEN),
            ("REP_C_USER", ctl::USER),
            ("REP_C_CHANGED", ctl::CHANGED),
            ("REP_P_ANSWERED", pflag::ANSWERED),
            ("REP_P_ESTABLISHED", pflag::ESTABLISHED),
            ("REP_P_B_RCV_KNOWN", pflag::B_RCV_KNOWN),
            ("REP_P_TS", pflag::TS),
            ("REP_P_TS_MAX", pflag::TS_MAX),
            ("REP_P_SENT_ACK", pflag::SENT_ACK),
            ("REP_P_CLIENT_LAST", pflag::CLIENT_LAST),
            ("REP_P_CL_TS", pflag::CL_TS),
            ("REP_P_B", pflag::B),
            ("REP_P_B_ALIGNED", pflag::B_ALIGNED),
            ("REP_P_OUT_SEEN", pflag::OUT_SEEN),
            ("REP_P_STRICT", pflag::STRICT),
        ] {
            assert_eq!(value(name), f, "{name}");
        }
    }

    #[test]
    fn records_parse_as_the_programs_write_them() {
        let mut b = vec![0u8; REC_LEN + 3];
        b[0..4].copy_from_slice(&3u32.to_ne_bytes());
        b[4..8].copy_from_slice(&3u32.to_ne_bytes());
        b[8..12].copy_from_slice(&77u32.to_ne_bytes());
        b[12..16].copy_from_slice(&3u32.to_ne_bytes());
        b[32..48].copy_from_slice(&addr16("10.0.0.9".parse().unwrap()));
        b[48..50].copy_from_slice(&40000u16.to_be_bytes());
        b[50..52].copy_from_slice(&6379u16.to_be_bytes());
        b[20..24].copy_from_slice(&1u32.to_ne_bytes());
        b[52..56].copy_from_slice(&9u32.to_ne_bytes());
        b[56..].copy_from_slice(&[1, 2, 3]);
        let key = Key::new("10.0.0.9:40000".parse().unwrap(), 6379);
        let of = PieceOf { cpu: 1, id: 9 };
        assert_eq!(Record::parse(&b), Some(Record::Keep { key, end_b: 77, total: 3, off: 0, of, bytes: vec![1, 2, 3] }));
        b[0..4].copy_from_slice(&5u32.to_ne_bytes());
        assert_eq!(Record::parse(&b), Some(Record::Input { key, total: 3, off: 0, of, bytes: vec![1, 2, 3] }));
    }

    /// The engine's fields survive the trip through the programs' layout, every `Option` either
    /// way, both families; the clocks are the caller's.
    #[test]
    fn engine_fields_round_trip_through_the_layout() {
        use unbroken_engines::replica::{BFast, PFast};
        let full = BFast {
            aligned: true,
            rcv_known: true,
            client_seen: true,
            delta: 0xdead_beef,
            ts_off: 7,
            ws_b: 7,
            snd_max: Seq(1),
            rcv_nxt: Seq(2),
            rcv_edge: Seq(3),
            out_end: Seq(4),
            out_hash: u64::MAX - 5,
            last_ack: Seq(6),
            acked_b: Some(Seq(0)),
            p_out: Some(Seq(u32::MAX)),
            ts_floor: Some(9),
            client_ts_max: Some((10, 11)),
            client_ts: Some((12, 13)),
            b_ts_seen: Some((14, 15_000)),
            client_win: 16,
            server: Some("10.0.0.1".parse().unwrap()),
        };
        let bare = BFast { acked_b: None, p_out: None, ts_floor: None, client_ts_max: None, client_ts: None, b_ts_seen: None, server: None, ..full };
        let v6 = BFast { server: Some("fd77::1".parse().unwrap()), ..full };
        for (f, is_v6) in [(full, false), (bare, false), (v6, true)] {
            for strict in [true, false] {
                let st = State::from_engine(&f, strict, 123_456_789);
                assert_eq!(st.flags & flag::STRICT != 0, strict);
                assert_eq!(st.b_ts_at, if f.b_ts_seen.is_some() { 123_456_789 } else { 0 });
                let back = st.to_engine(15_000, is_v6);
                assert_eq!(back, f);
            }
        }
        let p = PFast {
            answered: true,
            established: true,
            ws_p: 7,
            ack_p: Seq(1),
            edge_p: Seq(2),
            b: Some((true, false, Seq(3), Seq(4))),
            rel: Seq(5),
            p_end: Seq(6),
            sent_ack: Some(Seq(7)),
            snd_c: Seq(8),
            ts: Some((9, 10)),
            ts_max: Some(11),
            p_max: Seq(12),
            client_last: Some((Seq(13), 14, Some((15, 16)))),
            client_ack: Seq(17),
            snd_p: Seq(18),
            client_heard_at: 19,
            stream_start: Seq(20),
            out_seen: true,
        };
        let p_bare = PFast { b: None, sent_ack: None, ts: None, ts_max: None, client_last: Some((Seq(13), 14, None)), out_seen: false, established: false, ..p };
        let p_none = PFast { client_last: None, ..p_bare };
        for f in [p, p_bare, p_none] {
            let st = PState::from_engine(&f, true, 99);
            assert_eq!((st.heard_at, st.flags & pflag::STRICT), (99, pflag::STRICT));
            assert_eq!(st.to_engine(19), f);
        }
    }
}
