//! Checkpoint mode's fast path: the RTCP engine's transform for established, unremarkable
//! packets (`bpf/checkpoint/ckpt_tc.c`: `ckpt_outgoing` for *A* → *B*, `ckpt_incoming` for
//! *B* → *A*), reading and updating the connection's entry of the `ckpt_conns` map, whose value
//! is the engine's [`Conn`] byte for byte ([`State`]).

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use aya::maps::HashMap;
use aya::programs::SchedClassifier;
use aya::Ebpf;
use unbroken_engines::rtcp::Conn;

use super::{bpf_err, test_run, Error, Run};

/// The compiled programs (build.rs).
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/ckpt_tc.o"));

const MAP: &str = "ckpt_conns";

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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
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
        for d in [Direction::Outgoing, Direction::Incoming] {
            let name = d.program();
            let prog: &mut SchedClassifier = ebpf
                .program_mut(name)
                .ok_or_else(|| Error::Bpf(format!("no program {name} in the object")))?
                .try_into()
                .map_err(|e| bpf_err(name, e))?;
            prog.load().map_err(|e| bpf_err(&format!("loading {name} (verifier)"), e))?;
        }
        Ok(Checkpoint { ebpf })
    }

    fn map(&mut self) -> Result<HashMap<&mut aya::maps::MapData, Key, State>, Error> {
        let m = self.ebpf.map_mut(MAP).ok_or_else(|| Error::Bpf(format!("no map {MAP}")))?;
        HashMap::try_from(m).map_err(|e| bpf_err(MAP, e))
    }

    /// Writes the state of the connection `key` (creating or replacing its entry).
    pub fn insert(&mut self, key: &Key, c: &Conn) -> Result<(), Error> {
        self.map()?.insert(key, State::from(c), 0).map_err(|e| bpf_err("map insert", e))
    }

    /// The state of the connection `key`, if it has an entry.
    pub fn get(&mut self, key: &Key) -> Result<Option<Conn>, Error> {
        match self.map()?.get(key, 0) {
            Ok(s) => Ok(Some(s.into())),
            Err(aya::maps::MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(bpf_err("map lookup", e)),
        }
    }

    /// Removes the entry of `key` (its packets then go to the slow path).
    pub fn remove(&mut self, key: &Key) -> Result<(), Error> {
        match self.map()?.remove(key) {
            Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
            Err(e) => Err(bpf_err("map remove", e)),
        }
    }

    fn program(&self, d: Direction) -> Result<&SchedClassifier, Error> {
        let name = d.program();
        self.ebpf.program(name).ok_or_else(|| Error::Bpf(format!("no program {name}")))?.try_into().map_err(|e| bpf_err(name, e))
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
