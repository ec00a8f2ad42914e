//! Object mode's fast path (issue 22 item 3, first step): which packets of a protected
//! connection must reach the agent's slow path and which may pass without leaving the kernel,
//! decided as the TRODS engine would (`bpf/object/obj_fast.c`):
//!
//! - [`Prog::FromClient`] and [`Prog::ToClient`]: socket filters for `iptables -m bpf` in
//!   mangle PREROUTING and OUTPUT, 1 = the slow path ([`Steer::Slow`]), 0 = pass.
//! - [`Prog::ToClientTc`]: tc egress, the one rewrite the engine makes on a server packet it
//!   passes (the ACK lowered to the stored hold), on packets the slow path did not decide.
//!
//! The connection's entry ([`State`], in `obj_slots`, found through `obj_index`, mapped into
//! this process) is published by the agent from the engine's state ([`State::publish`] of
//! [`trods::FastView`]); the kernel keeps in it what the engine would have counted on the
//! packets it passed ([`Kept`]), and hands it over with [`Object::take`]. The agent attaches
//! them ([`Object::pin_filters`] for its `-m bpf` queue rules, [`Object::attach_egress`]).

use std::collections::{HashMap as StdHashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsFd, AsRawFd};
use std::ptr::addr_of_mut;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use aya::maps::{Array, HashMap, PerCpuArray};
use aya::programs::{SchedClassifier, SocketFilter, TestRun, TestRunOptions};
use aya::{Ebpf, EbpfLoader};
use unbroken_engines::trods::{self, FastView, FAR_PAST_PROGRESS};

use super::{attach_tcx, bpf_err, load_classifiers, Error, ETH_HLEN};

/// The compiled programs (build.rs).
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/obj_fast.o"));

const INDEX: &str = "obj_index";
const SLOTS: &str = "obj_slots";
/// Entries in `obj_slots` (its `max_entries`).
const SLOT_COUNT: u32 = 65536;
/// A freed slot is reused only after this long: far longer than any program run, so a program
/// that found the slot through the old index entry cannot write into a new connection's.
const QUARANTINE: Duration = Duration::from_secs(1);
const LEASES: &str = "obj_leases";
/// Entries in `obj_leases`: one per possible bucket, then the agent's own lease
/// ([`Object::set_alive`]).
const LEASE_COUNT: usize = 65537;
/// The agent's own lease in `obj_leases` (OBJ_ALIVE_SLOT).
const ALIVE_SLOT: usize = 65536;
const COUNTERS: &str = "obj_counters";

/// The agent's mark (`obj_decided_mark`; control's `AGENT_MARK`): its injected ACKs carry it,
/// and its NFQUEUE verdicts are to set it on every packet the slow path decided.
/// [`Prog::ToClientTc`] leaves those alone. [`Options::agent_mark`] sets another.
pub const DECIDED_MARK: u32 = 0x7562;

/// `OBJ_NONE`: no ACK limit, no wall.
pub const NONE: u64 = u64::MAX;

/// Flags of [`State::flags`] (`OBJ_F_*` in `bpf/object/obj_state.h`).
pub mod flag {
    pub const CLIENT_FAST: u32 = 1 << 0;
    pub const SERVER_FAST: u32 = 1 << 1;
    pub const BUCKET_KNOWN: u32 = 1 << 2;
    pub const NO_FENCE: u32 = 1 << 3;
    /// An unprotected connection whose tombstone is stored ([`passthrough`]).
    pub const PASSTHROUGH: u32 = 1 << 4;
    /// Set by the kernel when it sent a packet of the connection to the slow path.
    pub const USER: u32 = 1 << 8;
}

/// The programs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prog {
    /// The client's packets (socket filter, mangle PREROUTING).
    FromClient,
    /// The server's packets (socket filter, mangle OUTPUT).
    ToClient,
    /// The server's packets at tc egress (the ACK limit).
    ToClientTc,
}

impl Prog {
    fn name(self) -> &'static str {
        match self {
            Prog::FromClient => "obj_from_client",
            Prog::ToClient => "obj_to_client",
            Prog::ToClientTc => "obj_to_client_tc",
        }
    }
}

/// A socket filter's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Steer {
    /// 0: the packet passes without leaving the kernel.
    Pass,
    /// 1: the packet goes to the slow path (the `-m bpf` match sends it to NFQUEUE).
    Slow,
    /// Anything else (a bug).
    Other(u32),
}

/// The map key (`struct obj_key`): the client's and the service's endpoints, IPv4 as
/// `::ffff:a.b.c.d`, ports in network order.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Key {
    pub client_addr: [u8; 16],
    pub service_addr: [u8; 16],
    pub client_port: [u8; 2],
    pub service_port: [u8; 2],
}

// SAFETY: plain bytes, no padding (36 bytes, asserted below and in C).
unsafe impl aya::Pod for Key {}

impl Key {
    pub fn new(k: &trods::Key) -> Key {
        let addr = |ip: IpAddr| match ip {
            IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
            IpAddr::V6(v6) => v6.octets(),
        };
        let (c, s): (SocketAddr, SocketAddr) = (k.client, k.service);
        Key { client_addr: addr(c.ip()), service_addr: addr(s.ip()), client_port: c.port().to_be_bytes(), service_port: s.port().to_be_bytes() }
    }
}

/// The map value (`struct obj_conn`, 128 bytes): published by the agent, the last block kept
/// by the kernel. Field meanings in `bpf/object/obj_state.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct State {
    pub cli_next: u64,
    pub ack_wall: u64,
    pub body_end: u64,
    pub sent_wall: u64,
    pub ack_limit: u64,
    pub srv_ack: u64,
    pub srv_ack_cap: u64,
    pub told: u64,
    pub iss: u32,
    pub irs: u32,
    pub flags: u32,
    pub wseq: u32,
    pub bucket: u16,
    pub server_ws: u8,
    pub has_ts: u8,
    pub last_window: u16,
    /// The agent's publication, +1 at every [`Object::insert`] / [`Object::publish`] (whatever
    /// the given value): a program that judged a packet against an older one does not write.
    pub pub_gen: u16,
    pub client_acked: u64,
    pub srv_next: u64,
    pub sent_next: u64,
    pub last_seen_ns: u64,
    pub last_tsval: u32,
    pub last_tsecr: u32,
}

// SAFETY: plain integers, no padding (128 bytes, asserted below and in C).
unsafe impl aya::Pod for State {}

const _: () = assert!(std::mem::size_of::<Key>() == 36);
const _: () = assert!(std::mem::size_of::<State>() == 128);
const _: () = assert!(std::mem::offset_of!(State, iss) == 64);
const _: () = assert!(std::mem::offset_of!(State, flags) == 72);
const _: () = assert!(std::mem::offset_of!(State, bucket) == 80);
const _: () = assert!(std::mem::offset_of!(State, client_acked) == 88);
const _: () = assert!(std::mem::offset_of!(State, last_tsval) == 120);

/// What the kernel keeps for the engine as packets pass: the engine's fields of the same
/// names (`Conn::last_ts` as `Option`), the agent's hand-off reads them back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kept {
    pub client_acked: u64,
    pub srv_next: u64,
    pub sent_next: u64,
    pub last_window: u16,
    pub last_ts: Option<(u32, u32)>,
}

impl Kept {
    /// The same fields of the engine's view.
    pub fn of(v: &FastView) -> Kept {
        Kept { client_acked: v.client_acked, srv_next: v.srv_next, sent_next: v.sent_next, last_window: v.last_window, last_ts: v.last_ts }
    }
}

/// Whether the engine's connection is quiet: nothing held, nothing being stored, nothing the
/// next packet could end or start except through the walls [`State::publish`] sets. Only then
/// may any of its packets pass (docs/architecture.md, "Fast path: object mode").
pub fn quiet(v: &FastView) -> bool {
    v.protected
        && !v.degraded
        && !v.closed
        && !v.muted
        && !v.needs_no_record
        && v.gen == v.stored_gen
        && !v.in_flight
        && !v.deleting
        && v.held == 0
        && !v.tomb_on_ack
        && !v.stale_record
        && !v.moved_unseen
        && !v.unsent_acks
        && v.fin_at.is_none()
        && v.srv_fin.is_none()
        && v.ack_limit.is_some()
        && (v.stored_gen > 0 || v.adopted)
}

/// Whether the engine's connection is unprotected and settled: its tombstone stored (no ACK
/// limit, no stale record), nothing held or in flight. The engine then parses nothing of it and
/// passes every packet but SYN, RST and FIN unchanged (`on_client` returns before the ACK is
/// learned, `on_server` is not called), counting only the server's sent bytes, its window and
/// timestamps, `srv_ack` and `told`; the kernel does the same, without the response walls.
pub fn passthrough(v: &FastView) -> bool {
    !v.protected
        && !v.degraded
        && !v.closed
        && !v.muted
        && !v.stale_record
        && v.ack_limit.is_none()
        && !v.in_flight
        && !v.deleting
        && v.held == 0
        && !v.tomb_on_ack
        && !v.moved_unseen
        && !v.unsent_acks
}

impl State {
    /// The entry the agent publishes for a connection from the engine's view: `bucket` as its
    /// core recorded it, `fenced` unless there is no load balancer, `now_ns` the
    /// CLOCK_MONOTONIC time of the engine's `last_seen`.
    pub fn publish(v: &FastView, bucket: Option<u16>, fenced: bool, now_ns: u64) -> State {
        let q = quiet(v);
        let mut flags = 0;
        if q {
            // The client's first ACK marks the connection established (Conn::est).
            if v.est {
                flags |= flag::CLIENT_FAST;
            }
            if !v.header_pending {
                flags |= flag::SERVER_FAST;
            }
        }
        if !q && passthrough(v) {
            flags |= flag::PASSTHROUGH | flag::SERVER_FAST;
            if v.est {
                flags |= flag::CLIENT_FAST;
            }
        }
        if bucket.is_some() {
            flags |= flag::BUCKET_KNOWN;
        }
        if !fenced {
            flags |= flag::NO_FENCE;
        }
        let (tsval, tsecr) = v.last_ts.unwrap_or((0, 0));
        State {
            cli_next: v.cli_next,
            ack_wall: v.first_end.unwrap_or(NONE),
            body_end: v.srv_next + v.body_left,
            sent_wall: (v.progress_asked.saturating_add(v.progress_step)).min(v.progress_stored + FAR_PAST_PROGRESS + 1),
            ack_limit: v.ack_limit.unwrap_or(NONE),
            srv_ack: v.srv_ack,
            srv_ack_cap: v.cli_next + v.cli_fin.is_some() as u64,
            told: v.told,
            iss: v.hs.iss,
            irs: v.hs.irs,
            flags,
            wseq: 0,
            bucket: bucket.unwrap_or(0),
            server_ws: v.hs.server_ws,
            has_ts: v.last_ts.is_some() as u8,
            last_window: v.last_window,
            pub_gen: 0,
            client_acked: v.client_acked,
            srv_next: v.srv_next,
            sent_next: v.sent_next,
            last_seen_ns: now_ns,
            last_tsval: tsval,
            last_tsecr: tsecr,
        }
    }

    /// What the kernel kept.
    pub fn kept(&self) -> Kept {
        Kept {
            client_acked: self.client_acked,
            srv_next: self.srv_next,
            sent_next: self.sent_next,
            last_window: self.last_window,
            last_ts: (self.has_ts != 0).then_some((self.last_tsval, self.last_tsecr)),
        }
    }
}

/// Counters the programs keep (summed over CPUs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counters {
    pub client_passed: u64,
    pub client_slow: u64,
    pub server_passed: u64,
    pub server_slow: u64,
    pub acks_lowered: u64,
}

/// One packet's trip through a program by `BPF_PROG_TEST_RUN`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    /// The program's return value.
    pub ret: u32,
    /// The IP packet as the program left it.
    pub packet: Vec<u8>,
}

impl Run {
    /// A socket filter's return value as a steering decision.
    pub fn steer(&self) -> Steer {
        match self.ret {
            0 => Steer::Pass,
            1 => Steer::Slow,
            r => Steer::Other(r),
        }
    }

    /// The tc program's return value.
    pub fn verdict(&self) -> super::Verdict {
        super::Verdict::from_return(self.ret)
    }
}

/// How the programs are loaded (their constants).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// The agent's mark ([`DECIDED_MARK`] by default): tc egress leaves packets with it alone.
    pub agent_mark: u32,
    /// Take a client packet whose checksum field holds only the pseudo-header's sum as one the
    /// kernel has not checksummed yet (built on this host or sent over a veth), as the engine
    /// does when NFQUEUE flags it `csum_not_ready`. A socket filter cannot read `ip_summed`, so
    /// a corrupted packet from the wire with that value (one in 65,536) passes too (the
    /// kernel's TCP drops it; the entry has learned its ACK). Off by default.
    pub trust_partial_csum: bool,
}

impl Default for Options {
    fn default() -> Options {
        Options { agent_mark: DECIDED_MARK, trust_partial_csum: false }
    }
}

/// The loaded programs and their maps, with `obj_slots` mapped into this process.
pub struct Object {
    ebpf: Ebpf,
    /// `obj_slots`, mapped shared (`SLOT_COUNT` entries).
    slots: *mut State,
    map_len: usize,
    /// The slot of every connection with an entry (what `obj_index` holds).
    index: StdHashMap<Key, u32>,
    /// Freed slots, oldest first, with when they were freed.
    free: VecDeque<(u32, Instant)>,
    /// Slots never used yet start here.
    fresh: u32,
    /// `obj_leases`, mapped shared (`LEASE_COUNT` entries of u64).
    leases: *mut u64,
    leases_len: usize,
}

// SAFETY: the mapping is only touched through atomics (flags, wseq) and volatile reads and
// writes of plain integers, which the programs on other CPUs share anyway; the index and the
// free list change only through `&mut self`.
unsafe impl Send for Object {}
// SAFETY: as above.
unsafe impl Sync for Object {}

impl Drop for Object {
    fn drop(&mut self) {
        // SAFETY: the mappings made in `load_with`, unmapped once.
        unsafe {
            libc::munmap(self.slots as *mut libc::c_void, self.map_len);
            libc::munmap(self.leases as *mut libc::c_void, self.leases_len);
        }
    }
}

impl Object {
    /// Loads the three programs (through the verifier), creates the maps and maps the entries
    /// into this process. [`Error::Unavailable`] when this process cannot use BPF
    /// ([`super::available`]).
    pub fn load() -> Result<Object, Error> {
        Object::load_with(Options::default())
    }

    /// [`Object::load`] with other [`Options`].
    pub fn load_with(o: Options) -> Result<Object, Error> {
        super::available()?;
        let trust = o.trust_partial_csum as u32;
        let mut ebpf = EbpfLoader::new()
            .override_global("obj_decided_mark", &o.agent_mark, true)
            .override_global("obj_trust_partial_csum", &trust, true)
            .load(OBJECT)
            .map_err(|e| bpf_err("loading bpf/object/obj_fast.o", e))?;
        for p in [Prog::FromClient, Prog::ToClient] {
            let name = p.name();
            let prog: &mut SocketFilter = ebpf.program_mut(name).ok_or_else(|| Error::Bpf(format!("no program {name}")))?.try_into().map_err(|e| bpf_err(name, e))?;
            prog.load().map_err(|e| bpf_err(&format!("loading {name} (verifier)"), e))?;
        }
        load_classifiers(&mut ebpf, &[Prog::ToClientTc.name()])?;
        let slots = map_shared(&ebpf, SLOTS, SLOT_COUNT as usize * std::mem::size_of::<State>())?;
        let leases = match map_shared(&ebpf, LEASES, LEASE_COUNT * 8) {
            Ok(l) => l,
            Err(e) => {
                // SAFETY: the mapping just made, unmapped once.
                unsafe { libc::munmap(slots.0 as *mut libc::c_void, slots.1) };
                return Err(e);
            }
        };
        Ok(Object { ebpf, slots: slots.0 as *mut State, map_len: slots.1, index: StdHashMap::new(), free: VecDeque::new(), fresh: 0, leases: leases.0 as *mut u64, leases_len: leases.1 })
    }

    /// Pins the two socket filters as `DIR/obj_from_client` and `DIR/obj_to_client` (`DIR` on
    /// a BPF filesystem, created if missing; files left by an earlier process are replaced),
    /// for `iptables -m bpf --object-pinned`. They stay pinned when this is dropped, as long as
    /// the rules that name them (`iptables-legacy` opens the path again whenever it rewrites
    /// the table); [`unpin_filters`] removes them. Returns the two paths, client's first.
    pub fn pin_filters(&mut self, dir: &Path) -> Result<(PathBuf, PathBuf), Error> {
        std::fs::create_dir_all(dir).map_err(|e| bpf_err(&format!("creating {}", dir.display()), e))?;
        let mut paths = Vec::new();
        for p in [Prog::FromClient, Prog::ToClient] {
            let path = dir.join(p.name());
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(bpf_err(&format!("removing the stale pin {}", path.display()), e)),
            }
            let prog: &mut SocketFilter = self.ebpf.program_mut(p.name()).ok_or_else(|| Error::Bpf(format!("no program {}", p.name())))?.try_into().map_err(|e| bpf_err(p.name(), e))?;
            prog.pin(&path).map_err(|e| bpf_err(&format!("pinning {} at {}", p.name(), path.display()), e))?;
            paths.push(path);
        }
        // The leases too: a successor revokes this agent's fast path through them
        // ([`revoke_pinned`]) while the queue rules still name these filters.
        let path = dir.join(LEASES);
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(bpf_err(&format!("removing the stale pin {}", path.display()), e)),
        }
        self.ebpf.map(LEASES).ok_or_else(|| Error::Bpf(format!("no map {LEASES}")))?.pin(&path).map_err(|e| bpf_err(&format!("pinning {LEASES} at {}", path.display()), e))?;
        Ok((paths[0].clone(), paths[1].clone()))
    }

    /// Attaches [`Prog::ToClientTc`] at the tc egress of `iface` (TCX; detached when this is
    /// dropped).
    pub fn attach_egress(&mut self, iface: &str) -> Result<(), Error> {
        attach_tcx(&mut self.ebpf, Prog::ToClientTc.name(), iface, aya::programs::TcAttachType::Egress)
    }

    fn index_map(&mut self) -> Result<HashMap<&mut aya::maps::MapData, Key, u32>, Error> {
        let m = self.ebpf.map_mut(INDEX).ok_or_else(|| Error::Bpf(format!("no map {INDEX}")))?;
        HashMap::try_from(m).map_err(|e| bpf_err(INDEX, e))
    }

    fn slot(&self, i: u32) -> *mut State {
        assert!(i < SLOT_COUNT);
        // SAFETY: inside the mapping (SLOT_COUNT entries of State, the C struct's layout).
        unsafe { self.slots.add(i as usize) }
    }

    fn flags(&self, i: u32) -> &AtomicU32 {
        // SAFETY: an aligned u32 inside the mapping, shared with the programs, which use atomic
        // operations on it too.
        unsafe { AtomicU32::from_ptr(addr_of_mut!((*self.slot(i)).flags)) }
    }

    fn wseq(&self, i: u32) -> &AtomicU32 {
        // SAFETY: as `flags`.
        unsafe { AtomicU32::from_ptr(addr_of_mut!((*self.slot(i)).wseq)) }
    }

    /// Publishes `s` for the connection `key` (creating its entry, in a free slot, or writing
    /// over its slot in place): every field but the kernel's write sequence, `flags` last (a
    /// release store), so a program that reads the flags without `USER` reads the rest as
    /// published. On a live entry the caller must hold it first ([`Object::take`]): a program
    /// may be writing the kept fields otherwise.
    pub fn insert(&mut self, key: &Key, s: &State) -> Result<(), Error> {
        let i = match self.index.get(key) {
            Some(&i) => i,
            None => {
                let i = match self.free.front() {
                    Some(&(i, at)) if at.elapsed() >= QUARANTINE => {
                        self.free.pop_front();
                        i
                    }
                    _ if self.fresh < SLOT_COUNT => {
                        self.fresh += 1;
                        self.fresh - 1
                    }
                    _ => return Err(Error::Bpf("every obj_slots entry is in use or in quarantine".into())),
                };
                // A fresh entry is the agent's until published.
                self.flags(i).store(flag::USER, Ordering::SeqCst);
                self.write(i, s);
                self.index_map()?.insert(key, i, 0).map_err(|e| bpf_err("index insert", e))?;
                self.index.insert(*key, i);
                return Ok(());
            }
        };
        self.write(i, s);
        Ok(())
    }

    /// Publishes `s` over the existing entry of `key` ([`Object::insert`] without creating
    /// one; callable while other threads run packets through the programs).
    pub fn publish(&self, key: &Key, s: &State) -> Result<(), Error> {
        let &i = self.index.get(key).ok_or_else(|| Error::Bpf("publish: no entry".into()))?;
        self.write(i, s);
        Ok(())
    }

    fn write(&self, i: u32, s: &State) {
        let p = self.slot(i);
        let State { cli_next, ack_wall, body_end, sent_wall, ack_limit, srv_ack, srv_ack_cap, told, iss, irs, flags, wseq: _, bucket, server_ws, has_ts, last_window, pub_gen: _, client_acked, srv_next, sent_next, last_seen_ns, last_tsval, last_tsecr } = *s;
        // SAFETY: fields of a slot inside the mapping; programs read them concurrently but
        // write them only while USER is clear, which the caller guarantees it is not.
        unsafe {
            addr_of_mut!((*p).cli_next).write_volatile(cli_next);
            addr_of_mut!((*p).ack_wall).write_volatile(ack_wall);
            addr_of_mut!((*p).body_end).write_volatile(body_end);
            addr_of_mut!((*p).sent_wall).write_volatile(sent_wall);
            addr_of_mut!((*p).ack_limit).write_volatile(ack_limit);
            addr_of_mut!((*p).srv_ack).write_volatile(srv_ack);
            addr_of_mut!((*p).srv_ack_cap).write_volatile(srv_ack_cap);
            addr_of_mut!((*p).told).write_volatile(told);
            addr_of_mut!((*p).iss).write_volatile(iss);
            addr_of_mut!((*p).irs).write_volatile(irs);
            addr_of_mut!((*p).bucket).write_volatile(bucket);
            addr_of_mut!((*p).server_ws).write_volatile(server_ws);
            addr_of_mut!((*p).has_ts).write_volatile(has_ts);
            addr_of_mut!((*p).last_window).write_volatile(last_window);
            let gen = addr_of_mut!((*p).pub_gen).read_volatile().wrapping_add(1);
            addr_of_mut!((*p).pub_gen).write_volatile(gen);
            addr_of_mut!((*p).client_acked).write_volatile(client_acked);
            addr_of_mut!((*p).srv_next).write_volatile(srv_next);
            addr_of_mut!((*p).sent_next).write_volatile(sent_next);
            addr_of_mut!((*p).last_seen_ns).write_volatile(last_seen_ns);
            addr_of_mut!((*p).last_tsval).write_volatile(last_tsval);
            addr_of_mut!((*p).last_tsecr).write_volatile(last_tsecr);
        }
        self.flags(i).store(flags, Ordering::Release);
    }

    /// The entry of `key` as it is now, if any (a plain read: torn while a program writes it;
    /// [`Object::take`] is the hand-off's read).
    pub fn get(&self, key: &Key) -> Result<Option<State>, Error> {
        let Some(&i) = self.index.get(key) else { return Ok(None) };
        // SAFETY: a slot inside the mapping.
        Ok(Some(unsafe { self.slot(i).read_volatile() }))
    }

    /// The hand-off: takes the entry of `key` from the kernel (sets `USER`, after which every
    /// packet of the connection goes slow and no program starts writing it), waits until no
    /// program is writing it (an even write sequence, the same before and after the read), and
    /// returns it, kept fields final. `None` without an entry.
    pub fn take(&self, key: &Key) -> Result<Option<State>, Error> {
        let Some(&i) = self.index.get(key) else { return Ok(None) };
        self.flags(i).fetch_or(flag::USER, Ordering::SeqCst);
        Ok(Some(self.read_stable(i)))
    }

    fn read_stable(&self, i: u32) -> State {
        loop {
            let s1 = self.wseq(i).load(Ordering::SeqCst);
            if s1 % 2 == 1 {
                std::hint::spin_loop();
                continue;
            }
            // SAFETY: a slot inside the mapping; a torn copy is caught by the second read.
            let s = unsafe { self.slot(i).read_volatile() };
            std::sync::atomic::fence(Ordering::SeqCst);
            if self.wseq(i).load(Ordering::SeqCst) == s1 {
                return s;
            }
        }
    }

    /// Takes every entry from the kernel at once (sets `USER` on each, no wait): from now on
    /// every packet of every connection goes to the slow path (an agent that stops leaves its
    /// queue rules and their filters in place: with nothing lent, none passes them).
    pub fn take_all(&self) {
        for &i in self.index.values() {
            self.flags(i).fetch_or(flag::USER, Ordering::SeqCst);
        }
    }

    /// Removes the entry of `key` (its packets then all go to the slow path); its slot is
    /// reused after [`QUARANTINE`].
    pub fn remove(&mut self, key: &Key) -> Result<(), Error> {
        let Some(i) = self.index.remove(key) else { return Ok(()) };
        self.flags(i).fetch_or(flag::USER, Ordering::SeqCst);
        match self.index_map()?.remove(key) {
            Ok(()) => {}
            Err(e) => return Err(bpf_err("index remove", e)),
        }
        self.free.push_back((i, Instant::now()));
        Ok(())
    }

    /// This server holds the lease on `bucket` until `until_ns` (CLOCK_MONOTONIC; 0: it does
    /// not own the bucket).
    pub fn set_lease(&self, bucket: u16, until_ns: u64) -> Result<(), Error> {
        // SAFETY: an aligned u64 inside the mapping (LEASE_COUNT > u16::MAX), which the
        // programs read whole.
        let slot = unsafe { AtomicU64::from_ptr(self.leases.add(bucket as usize)) };
        slot.store(until_ns, Ordering::Release);
        Ok(())
    }

    /// The agent that publishes the entries is alive until `until_ns` (CLOCK_MONOTONIC): the
    /// programs pass nothing once it lapses (0 at load: nothing passes before the first call).
    /// The agent renews it every round, so that a killed or stalled agent's filters, which its
    /// queue rules keep using until a successor replaces them, send every packet to the slow
    /// path within this time.
    pub fn set_alive(&self, until_ns: u64) {
        // SAFETY: an aligned u64 inside the mapping (ALIVE_SLOT < LEASE_COUNT).
        let slot = unsafe { AtomicU64::from_ptr(self.leases.add(ALIVE_SLOT)) };
        slot.store(until_ns, Ordering::Release);
    }

    /// The programs' counters, summed over CPUs.
    pub fn counters(&self) -> Result<Counters, Error> {
        let m = self.ebpf.map(COUNTERS).ok_or_else(|| Error::Bpf(format!("no map {COUNTERS}")))?;
        let a: PerCpuArray<_, u64> = PerCpuArray::try_from(m).map_err(|e| bpf_err(COUNTERS, e))?;
        let sum = |i: u32| -> Result<u64, Error> { Ok(a.get(&i, 0).map_err(|e| bpf_err("counters", e))?.iter().sum()) };
        Ok(Counters { client_passed: sum(0)?, client_slow: sum(1)?, server_passed: sum(2)?, server_slow: sum(3)?, acks_lowered: sum(4)? })
    }

    /// Runs the IP packet `ip` through `p` once (`BPF_PROG_TEST_RUN`), inside an Ethernet
    /// frame from `src_mac` (the LB's bucket marker, or any other), with the skb's mark
    /// `mark`: the return value and the packet as the program left it; the maps as it
    /// updated them.
    pub fn run(&self, p: Prog, ip: &[u8], src_mac: [u8; 6], mark: u32) -> Result<Run, Error> {
        Ok(self.run_n(p, ip, src_mac, mark, 1)?.0)
    }

    /// Runs `ip` through `p` `repeat` times on one skb (each run sees the maps as the previous
    /// one left them): the last run's result.
    pub fn run_repeat(&self, p: Prog, ip: &[u8], src_mac: [u8; 6], repeat: u32) -> Result<Run, Error> {
        Ok(self.run_n(p, ip, src_mac, 0, repeat)?.0)
    }

    /// The kernel's mean time per run of `ip` through `p` over `repeat` runs (each run sees
    /// the maps as the previous one left them).
    pub fn time_per_packet(&self, p: Prog, ip: &[u8], src_mac: [u8; 6], repeat: u32) -> Result<Duration, Error> {
        Ok(self.run_n(p, ip, src_mac, 0, repeat)?.1)
    }

    fn run_n(&self, p: Prog, ip: &[u8], src_mac: [u8; 6], mark: u32, repeat: u32) -> Result<(Run, Duration), Error> {
        let name = p.name();
        let prog = self.ebpf.program(name).ok_or_else(|| Error::Bpf(format!("no program {name}")))?;
        let mut frame = vec![0u8; ETH_HLEN + ip.len()];
        frame[..6].copy_from_slice(&[0x02, 0, 0, 0, 0, 1]);
        frame[6..12].copy_from_slice(&src_mac);
        let ethertype: u16 = if ip.first().map(|b| b >> 4) == Some(6) { 0x86dd } else { 0x0800 };
        frame[12..14].copy_from_slice(&ethertype.to_be_bytes());
        frame[ETH_HLEN..].copy_from_slice(ip);
        let mut out = vec![0u8; frame.len() + 256];
        // struct __sk_buff up to its mark (len and pkt_type must be zero).
        let mut ctx = [0u8; 12];
        ctx[8..12].copy_from_slice(&mark.to_ne_bytes());
        let opts = TestRunOptions { data_in: Some(&frame), data_out: Some(&mut out), ctx_in: Some(&ctx), repeat: repeat.max(1), ..Default::default() };
        let r = match p {
            Prog::ToClientTc => {
                let prog: &SchedClassifier = prog.try_into().map_err(|e| bpf_err(name, e))?;
                prog.test_run(opts)
            }
            _ => {
                let prog: &SocketFilter = prog.try_into().map_err(|e| bpf_err(name, e))?;
                prog.test_run(opts)
            }
        }
        .map_err(|e| bpf_err("BPF_PROG_TEST_RUN", e))?;
        let n = (r.data_size_out as usize).min(out.len());
        if n < ETH_HLEN {
            return Err(Error::Bpf(format!("BPF_PROG_TEST_RUN returned {n} bytes, less than an Ethernet header")));
        }
        out.truncate(n);
        let packet = out.split_off(ETH_HLEN);
        Ok((Run { ret: r.return_value, packet }, r.duration))
    }
}

/// Removes what [`Object::pin_filters`] pinned in `dir`, and `dir` when empty (after the rules
/// that named them are gone).
pub fn unpin_filters(dir: &Path) -> std::io::Result<()> {
    super::unpin(dir, &[Prog::FromClient.name(), Prog::ToClient.name(), LEASES])
}

/// Ends the own lease of the agent whose filters are pinned in `dir` ([`Object::pin_filters`]):
/// its filters pass nothing from now on. A new agent calls it first thing: its predecessor's
/// queue rules, which name those filters, stay until the new rules replace them, and a killed
/// predecessor's filters would pass packets on its entries until its own lease lapsed.
/// `Ok(false)` when nothing is pinned there.
pub fn revoke_pinned(dir: &Path) -> Result<bool, Error> {
    let path = dir.join(LEASES);
    if !path.exists() {
        return Ok(false);
    }
    let md = aya::maps::MapData::from_pin(&path).map_err(|e| bpf_err(&format!("opening {}", path.display()), e))?;
    let map = aya::maps::Map::from_map_data(md).map_err(|e| bpf_err(&format!("opening {}", path.display()), e))?;
    let mut a: Array<aya::maps::MapData, u64> = Array::try_from(map).map_err(|e| bpf_err(LEASES, e))?;
    if a.len() as usize != LEASE_COUNT {
        return Err(Error::Bpf(format!("{} has {} entries, not {LEASE_COUNT}: not this version's", path.display(), a.len())));
    }
    a.set(ALIVE_SLOT as u32, 0, 0).map_err(|e| bpf_err(&format!("revoking {}", path.display()), e))?;
    Ok(true)
}

/// Mounts a BPF filesystem on `/sys/fs/bpf` unless one is there (systemd mounts it on most
/// hosts; pinned programs live there).
pub fn ensure_bpffs() -> Result<(), Error> {
    const BPF_FS_MAGIC: i64 = 0xcafe4a11;
    let path = c"/sys/fs/bpf";
    // SAFETY: a valid NUL-terminated path and a statfs to write.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(path.as_ptr(), &mut st) } == 0 && st.f_type as i64 == BPF_FS_MAGIC {
        return Ok(());
    }
    // SAFETY: valid NUL-terminated strings; no data.
    let r = unsafe { libc::mount(c"bpf".as_ptr(), path.as_ptr(), c"bpf".as_ptr(), 0, std::ptr::null()) };
    if r != 0 {
        return Err(bpf_err("mounting a BPF filesystem on /sys/fs/bpf", std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Maps the `BPF_F_MMAPABLE` array `name` (`bytes` long) shared into this process: its
/// address and the mapping's length.
fn map_shared(ebpf: &Ebpf, name: &str, bytes: usize) -> Result<(*mut libc::c_void, usize), Error> {
    let fd = match ebpf.map(name) {
        Some(aya::maps::Map::Array(md)) => md.fd().as_fd().as_raw_fd(),
        _ => return Err(Error::Bpf(format!("no array map {name}"))),
    };
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
    let len = bytes.div_ceil(page) * page;
    // SAFETY: a shared mapping of the array map's memory (BPF_F_MMAPABLE), checked below; the
    // caller unmaps it before the map (kept by `ebpf`) goes.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0) };
    if p == libc::MAP_FAILED {
        return Err(bpf_err(&format!("mmap {name}"), std::io::Error::last_os_error()));
    }
    Ok((p, len))
}

/// The clock of `last_seen_ns` and the leases ([`super::monotonic_ns`]).
pub use super::monotonic_ns;

#[cfg(test)]
mod tests {
    use super::*;

    /// `bpf/object/obj_state.h` holds these flag values.
    #[test]
    fn c_flags_are_these() {
        let header = include_str!("../../bpf/object/obj_state.h");
        for (name, v) in [("CLIENT_FAST", flag::CLIENT_FAST), ("SERVER_FAST", flag::SERVER_FAST), ("BUCKET_KNOWN", flag::BUCKET_KNOWN), ("NO_FENCE", flag::NO_FENCE), ("PASSTHROUGH", flag::PASSTHROUGH), ("USER", flag::USER)] {
            let line = header.lines().find(|l| l.starts_with(&format!("#define OBJ_F_{name} "))).unwrap_or_else(|| panic!("OBJ_F_{name} missing"));
            let bit: u32 = line.split("(1u << ").nth(1).unwrap().trim_end_matches(')').parse().unwrap();
            assert_eq!(1 << bit, v, "OBJ_F_{name}");
        }
        let c = include_str!("../../bpf/object/obj_fast.c");
        assert!(c.contains(&format!("obj_decided_mark = {DECIDED_MARK:#x};")), "DECIDED_MARK");
    }

    #[test]
    fn keys_map_ipv4_to_ipv6_and_keep_ports_in_network_order() {
        let k = Key::new(&trods::Key { client: "10.77.0.2:40000".parse().unwrap(), service: "[fd77::2]:80".parse().unwrap() });
        assert_eq!(&k.client_addr[10..], &[0xff, 0xff, 10, 77, 0, 2]);
        assert_eq!(k.service_addr[..2], [0xfd, 0x77]);
        assert_eq!((k.client_port, k.service_port), ([0x9c, 0x40], [0, 80]));
    }
}
