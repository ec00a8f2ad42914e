//! Checkpoint mode's fast path: the RTCP engine's transform for established, unremarkable
//! packets (`bpf/checkpoint/ckpt_tc.c`: `ckpt_outgoing` for *A* → *B*, `ckpt_incoming` for
//! *B* → *A*), reading and updating the connection's entry of the `ckpt_conns` map ([`Entry`]:
//! the engine's [`Conn`] byte for byte ([`State`]), what the guard keeps beside it, and the
//! hand-off between the paths), and the daemon's side of the hand-off ([`Checkpoint::op`], the
//! `ckpt_op` program run by `BPF_PROG_TEST_RUN`; see `bpf/checkpoint/rtcp_state.h`).

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use aya::maps::HashMap;
use aya::programs::SchedClassifier;
use aya::Ebpf;
use unbroken_engines::rtcp::Conn;

use super::{attach_tcx, bpf_err, classifier, load_classifiers, test_run, Error, Run, Verdict};

/// The compiled programs (build.rs).
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/ckpt_tc.o"));

const MAP: &str = "ckpt_conns";
const STATS: &str = "ckpt_stats";
const OP_PROGRAM: &str = "ckpt_op";

/// `BPF_F_LOCK`: map lookups and updates from here copy the value under its spin lock.
const BPF_F_LOCK: u64 = 4;
/// `BPF_NOEXIST`.
const BPF_NOEXIST: u64 = 1;

/// Bits of [`Entry::ctl`] (`CKPT_C_*`).
pub mod ctl {
    /// The programs leave every packet of the connection to the slow path.
    pub const FROZEN: u32 = 1 << 0;
    /// The daemon took the state: its copy is the newest, the entry's is stale.
    pub const USER: u32 = 1 << 1;
    /// [`super::Entry::a_hi`] is known.
    pub const A_HI: u32 = 1 << 2;
    /// [`super::Entry::peer_lo`] and `peer_hi` are known.
    pub const PEER: u32 = 1 << 3;
}

/// Bits the programs OR into `skb->mark`: the steering chain RETURNs a packet with
/// [`MARK_DONE`] (decided on the fast path); [`MARK_SLOW`] names a packet the daemon must take
/// with [`Op::Take`].
pub const MARK_DONE: u32 = 0x2000_0000;
pub const MARK_SLOW: u32 = 0x1000_0000;

/// Which of the two programs: the direction of the packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// From the protected application *A* to its peer *B* (algorithm O).
    Outgoing,
    /// From *B* to *A* (algorithm I).
    Incoming,
}

impl Direction {
    fn program(self) -> &'static str {
        match self {
            Direction::Outgoing => "ckpt_outgoing",
            Direction::Incoming => "ckpt_incoming",
        }
    }
}

/// The map key: *A*'s and *B*'s endpoints (`struct ckpt_key`). IPv4 addresses are stored as
/// `::ffff:a.b.c.d`, ports in network order.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Key {
    pub a_addr: [u8; 16],
    pub b_addr: [u8; 16],
    pub a_port: [u8; 2],
    pub b_port: [u8; 2],
}

// SAFETY: plain bytes, no padding (36 bytes, asserted below and in C).
unsafe impl aya::Pod for Key {}

impl Key {
    /// The key of the connection between *A* at `a` and *B* at `b`.
    pub fn new(a: SocketAddr, b: SocketAddr) -> Key {
        let addr = |ip: IpAddr| match ip {
            IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
            IpAddr::V6(v6) => v6.octets(),
        };
        Key { a_addr: addr(a.ip()), b_addr: addr(b.ip()), a_port: a.port().to_be_bytes(), b_port: b.port().to_be_bytes() }
    }
}

/// The map value: [`Conn`] as `struct rtcp_conn` lays it out (the same `#[repr(C)]` fields in
/// the same order; aya's `Pod` cannot be implemented for the engine's own type here).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct State {
    pub delta: u32,
    pub ack_b: u32,
    pub ack_a: u32,
    pub ts_b: u32,
    pub ts_a: u32,
    pub ts_off: u32,
    pub a_end: u32,
    pub b_mss: u16,
    pub a_win: u16,
    pub ws: u8,
    pub ws_cur: u8,
    pub flags: u16,
}

// SAFETY: plain integers, no padding (36 bytes, asserted below and in C).
unsafe impl aya::Pod for State {}

const _: () = assert!(std::mem::size_of::<Key>() == 36);
const _: () = assert!(std::mem::size_of::<State>() == 36);
const _: () = assert!(std::mem::size_of::<State>() == std::mem::size_of::<Conn>());

impl From<&Conn> for State {
    fn from(c: &Conn) -> State {
        let Conn { delta, ack_b, ack_a, ts_b, ts_a, ts_off, a_end, b_mss, a_win, ws, ws_cur, flags } = *c;
        State { delta, ack_b, ack_a, ts_b, ts_a, ts_off, a_end, b_mss, a_win, ws, ws_cur, flags }
    }
}

impl From<State> for Conn {
    fn from(s: State) -> Conn {
        let State { delta, ack_b, ack_a, ts_b, ts_a, ts_off, a_end, b_mss, a_win, ws, ws_cur, flags } = s;
        Conn { delta, ack_b, ack_a, ts_b, ts_a, ts_off, a_end, b_mss, a_win, ws, ws_cur, flags }
    }
}

/// A map entry (`struct ckpt_entry`): the hand-off fields, the guard's own state beside the
/// engine's, and [`State`].
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Entry {
    /// `struct bpf_spin_lock`: never read or written from here (the kernel skips it).
    lock: u32,
    pub ctl: u32,
    /// Packets the programs left to the slow path.
    pub slow: u32,
    /// Of those, how many the daemon took.
    pub seen: u32,
    pub a_hi: u32,
    pub peer_lo: u32,
    pub peer_hi: u32,
    pub state: State,
}

// SAFETY: plain integers, no padding (64 bytes, asserted below and in C).
unsafe impl aya::Pod for Entry {}

const _: () = assert!(std::mem::size_of::<Entry>() == 64);

impl Entry {
    /// An entry the fast path owns, holding `c` and the guard's `a_hi` and `peer`.
    pub fn new(c: &Conn, a_hi: Option<u32>, peer: Option<(u32, u32)>) -> Entry {
        let mut e = Entry { state: State::from(c), ..Entry::default() };
        if let Some(hi) = a_hi {
            e.ctl |= ctl::A_HI;
            e.a_hi = hi;
        }
        if let Some((lo, hi)) = peer {
            e.ctl |= ctl::PEER;
            e.peer_lo = lo;
            e.peer_hi = hi;
        }
        e
    }

    pub fn conn(&self) -> Conn {
        self.state.into()
    }

    pub fn a_hi(&self) -> Option<u32> {
        (self.ctl & ctl::A_HI != 0).then_some(self.a_hi)
    }

    pub fn peer(&self) -> Option<(u32, u32)> {
        (self.ctl & ctl::PEER != 0).then_some((self.peer_lo, self.peer_hi))
    }
}

/// The daemon's operations on an entry (`CKPT_OP_*`), atomic against the programs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// A packet marked [`MARK_SLOW`] arrived: freeze the entry, count the packet as taken,
    /// and give the state to the daemon.
    Take,
    /// Freeze the entry and give the state to the daemon (a command, or a packet the
    /// programs did not count).
    Freeze,
    /// Give the connection back to the fast path with this state, only if every packet the
    /// programs left to the slow path was taken.
    Thaw,
    /// The same, even if not (a counted packet never reached the queue).
    ThawForce,
    /// RTCP C2 in place: raise the checkpoint to `value.state.ack_a` as the engine's
    /// ACKNOWLEDGE does, on an entry the programs own ([`OpResult::Refused`] otherwise).
    Acknowledge,
}

/// What an [`Op`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpResult {
    Done,
    /// No entry for the key.
    NoEntry,
    /// [`Op::Thaw`] refused: a packet of the connection is still on its way to the daemon;
    /// the entry stays frozen and the daemon's.
    Stale,
    /// [`Op::Acknowledge`] refused: the entry is frozen, or C2 would change more than the
    /// checkpoint and the window (the first checkpoint, options not known).
    Refused,
}

/// The answer to an [`Op`]: the result, the entry's `ctl` before it, the entry after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpAnswer {
    pub result: OpResult,
    pub ctl_before: u32,
    pub entry: Entry,
}

/// `struct ckpt_op_req` / `struct ckpt_op_ans`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct OpMsg {
    word0: u32,
    word1: u32,
    key: Key,
    value: Entry,
}

const _: () = assert!(std::mem::size_of::<OpMsg>() == 108);

/// What the programs decided, summed over the CPUs (`struct ckpt_counters`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counters {
    /// Packets from *A* decided on the fast path.
    pub outgoing: u64,
    /// Packets from *B* decided on the fast path.
    pub incoming: u64,
    /// Packets of a connection with an entry left to the slow path.
    pub slow: u64,
    /// Rewrites the kernel could not write (the packet dropped; TCP resends it).
    pub dropped: u64,
}

// SAFETY: plain integers.
unsafe impl aya::Pod for Counters {}

/// The loaded programs and their map.
pub struct Checkpoint {
    ebpf: Ebpf,
}

impl Checkpoint {
    /// Loads both programs (through the verifier) and creates the map. [`Error::Unavailable`]
    /// when this process cannot use BPF ([`super::available`]).
    pub fn load() -> Result<Checkpoint, Error> {
        super::available()?;
        let mut ebpf = Ebpf::load(OBJECT).map_err(|e| bpf_err("loading bpf/checkpoint/ckpt_tc.o", e))?;
        load_classifiers(&mut ebpf, &[Direction::Outgoing.program(), Direction::Incoming.program(), OP_PROGRAM])?;
        Ok(Checkpoint { ebpf })
    }

    fn map(&mut self) -> Result<HashMap<&mut aya::maps::MapData, Key, Entry>, Error> {
        let m = self.ebpf.map_mut(MAP).ok_or_else(|| Error::Bpf(format!("no map {MAP}")))?;
        HashMap::try_from(m).map_err(|e| bpf_err(MAP, e))
    }

    /// Writes the state of the connection `key` (creating or replacing its entry, which the
    /// fast path then owns, nothing pending). For tests; the daemon uses [`Checkpoint::install`]
    /// and [`Checkpoint::op`].
    pub fn insert(&mut self, key: &Key, c: &Conn) -> Result<(), Error> {
        self.map()?.insert(key, Entry::new(c, None, None), 0).map_err(|e| bpf_err("map insert", e))
    }

    /// Creates the entry of `key` (the fast path owns it from now on); false when there is one
    /// already (left as it is).
    pub fn install(&mut self, key: &Key, e: &Entry) -> Result<bool, Error> {
        let e = Entry { lock: 0, ctl: e.ctl & (ctl::A_HI | ctl::PEER), slow: 0, seen: 0, ..*e };
        match self.map()?.insert(key, e, BPF_NOEXIST) {
            Ok(()) => Ok(true),
            Err(aya::maps::MapError::SyscallError(s)) if s.io_error.raw_os_error() == Some(libc::EEXIST) => Ok(false),
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

    /// The engine's state in the entry of `key`, if it has one.
    pub fn get(&mut self, key: &Key) -> Result<Option<Conn>, Error> {
        Ok(self.entry(key)?.map(|e| e.conn()))
    }

    /// Carries out `op` on the entry of `key` (`value`: the state [`Op::Thaw`] writes).
    pub fn op(&self, op: Op, key: &Key, value: Option<&Entry>) -> Result<OpAnswer, Error> {
        let code = match op {
            Op::Take => 1,
            Op::Freeze => 2,
            Op::Thaw => 3,
            Op::ThawForce => 4,
            Op::Acknowledge => 5,
        };
        let req = OpMsg { word0: code, word1: 0, key: *key, value: value.copied().unwrap_or_default() };
        // SAFETY: OpMsg is #[repr(C)] integers without padding.
        let bytes: [u8; 108] = unsafe { std::mem::transmute(req) };
        let (run, _) = test_run(classifier(&self.ebpf, OP_PROGRAM)?, &bytes, 1)?;
        let mut out = [0u8; 108];
        if run.packet.len() < out.len() {
            return Err(Error::Bpf(format!("{OP_PROGRAM} answered {} bytes", run.packet.len())));
        }
        out.copy_from_slice(&run.packet[..108]);
        // SAFETY: as above.
        let ans: OpMsg = unsafe { std::mem::transmute(out) };
        let result = match (run.verdict, ans.word0) {
            (Verdict::Done, 0) => OpResult::Done,
            (Verdict::Other(1), 1) => OpResult::NoEntry,
            (Verdict::Drop, 2) => OpResult::Stale,
            (Verdict::Other(4), 4) => OpResult::Refused,
            (v, r) => return Err(Error::Bpf(format!("{OP_PROGRAM}: {op:?} returned {v:?}, result {r}"))),
        };
        Ok(OpAnswer { result, ctl_before: ans.word1, entry: ans.value })
    }

    /// What the programs decided so far, summed over the CPUs.
    pub fn counters(&mut self) -> Result<Counters, Error> {
        let m = self.ebpf.map_mut(STATS).ok_or_else(|| Error::Bpf(format!("no map {STATS}")))?;
        let a: aya::maps::PerCpuArray<&mut aya::maps::MapData, Counters> = aya::maps::PerCpuArray::try_from(m).map_err(|e| bpf_err(STATS, e))?;
        let per_cpu = a.get(&0, 0).map_err(|e| bpf_err("counters", e))?;
        let mut t = Counters::default();
        for c in per_cpu.iter() {
            t.outgoing += c.outgoing;
            t.incoming += c.incoming;
            t.slow += c.slow;
            t.dropped += c.dropped;
        }
        Ok(t)
    }

    /// Attaches direction `d`'s program to the ingress of `iface` (TCX; detached when this
    /// value is dropped).
    pub fn attach(&mut self, d: Direction, iface: &str) -> Result<(), Error> {
        attach_tcx(&mut self.ebpf, d.program(), iface, aya::programs::TcAttachType::Ingress)
    }

    /// Removes the entry of `key` (its packets then go to the slow path).
    pub fn remove(&mut self, key: &Key) -> Result<(), Error> {
        match self.map()?.remove(key) {
            Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
            Err(aya::maps::MapError::SyscallError(s)) if s.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
            Err(e) => Err(bpf_err("map remove", e)),
        }
    }

    fn program(&self, d: Direction) -> Result<&SchedClassifier, Error> {
        classifier(&self.ebpf, d.program())
    }

    /// Runs the IP packet `ip` through the program for direction `d` once
    /// (`BPF_PROG_TEST_RUN`), with the map as it is: the verdict, the packet as the program
    /// left it, and the entry updated as the program updates it.
    pub fn run(&self, d: Direction, ip: &[u8]) -> Result<Run, Error> {
        Ok(test_run(self.program(d)?, ip, 1)?.0)
    }

    /// The kernel's mean time per run of `ip` through direction `d`'s program over `repeat`
    /// runs. The kernel builds the packet once and runs the program on it `repeat` times, so
    /// each run sees the packet (and the map entry) as the previous run left them.
    pub fn time_per_packet(&self, d: Direction, ip: &[u8], repeat: u32) -> Result<Duration, Error> {
        Ok(test_run(self.program(d)?, ip, repeat)?.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use unbroken_engines::rtcp::flag;

    /// `bpf/checkpoint/rtcp_state.h` holds the engine's flag values (one home: rtcp::flag; the
    /// header is checked against it).
    #[test]
    fn c_state_flags_are_the_engines() {
        let header = include_str!("../../bpf/checkpoint/rtcp_state.h");
        let value = |name: &str| -> u16 {
            let line = header.lines().find(|l| l.starts_with(&format!("#define RTCP_F_{name} "))).unwrap_or_else(|| panic!("RTCP_F_{name} missing"));
            let v = line.split_whitespace().nth(2).unwrap();
            if let Some(bit) = line.split("(1 << ").nth(1) {
                1 << bit.trim_end_matches(')').parse::<u16>().unwrap()
            } else {
                value_of_alias(header, v)
            }
        };
        for (name, f) in [
            ("RECOVERABLE", flag::RECOVERABLE),
            ("FIN_ALLOWED", flag::FIN_ALLOWED),
            ("ACK_ALLOWED", flag::ACK_ALLOWED),
            ("ACK_EVERYTHING", flag::ACK_EVERYTHING),
            ("OPTS_KNOWN", flag::OPTS_KNOWN),
            ("SACK_OK", flag::SACK_OK),
            ("TS_OK", flag::TS_OK),
            ("TS_A_KNOWN", flag::TS_A_KNOWN),
            ("TS_B_KNOWN", flag::TS_B_KNOWN),
            ("SYN_PENDING", flag::SYN_PENDING),
            ("PEND_SACK", flag::PEND_SACK),
            ("PEND_TS", flag::PEND_TS),
            ("ORIGIN_PINNED", flag::ORIGIN_PINNED),
            ("A_WIN_KNOWN", flag::A_WIN_KNOWN),
            ("FIN_A_SEEN", flag::FIN_A_SEEN),
            ("FIN_B_SEEN", flag::FIN_B_SEEN),
            ("SYNCED", flag::SYNCED),
        ] {
            assert_eq!(value(name), f, "RTCP_F_{name}");
        }
    }

    /// `#define RTCP_F_X RTCP_F_Y`: Y's bit.
    fn value_of_alias(header: &str, alias: &str) -> u16 {
        let line = header.lines().find(|l| l.starts_with(&format!("#define {alias} "))).unwrap();
        1 << line.split("(1 << ").nth(1).unwrap().trim_end_matches(')').parse::<u16>().unwrap()
    }

    /// The map value is the engine's state field for field, both ways.
    #[test]
    fn state_mirrors_conn_field_for_field() {
        let c = Conn { delta: 1, ack_b: 2, ack_a: 3, ts_b: 4, ts_a: 5, ts_off: 6, a_end: 7, b_mss: 8, a_win: 9, ws: 10, ws_cur: 11, flags: 12 };
        let s = State::from(&c);
        assert_eq!(Conn::from(s), c);
        // The same bytes in memory: the C struct is laid out as Conn is.
        // SAFETY: both are #[repr(C)] integers of the same size, without padding.
        let (cb, sb): ([u8; 36], [u8; 36]) = unsafe { (std::mem::transmute(c), std::mem::transmute(s)) };
        assert_eq!(cb, sb);
    }

    #[test]
    fn keys_map_ipv4_to_ipv6_and_keep_ports_in_network_order() {
        let k = Key::new("10.0.2.10:7000".parse().unwrap(), "[fd77::2]:41000".parse().unwrap());
        assert_eq!(&k.a_addr[..12], &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff]);
        assert_eq!(&k.a_addr[12..], &[10, 0, 2, 10]);
        assert_eq!(k.b_addr[..2], [0xfd, 0x77]);
        assert_eq!((k.a_port, k.b_port), ([0x1b, 0x58], [0xa0, 0x28]));
    }
}
