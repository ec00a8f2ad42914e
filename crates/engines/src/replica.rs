//! Replica mode (issue 10): a hot backup of an unmodified, deterministic server tracks every
//! connection of the primary and takes them over when the primary dies. Read side by side with
//! ST-TCP (Marwah, seed 001, chapter 3) and Koch et al., "Transparent TCP Connection Failover"
//! (seed 003, sections 3-6). Like the other engines it does no I/O and has no clock: packets,
//! side-channel messages and time go in; verdicts, packets to inject and notices come out.
//!
//! Both hosts own the service address and every client packet reaches both (ST-TCP 3.2.1).
//!
//! - [`Backup`] (ST-TCP 3.3.0.1, 3.3.1; Koch 3.1): the backup's server picks its own ISN. The
//!   client's handshake ACK names the primary's ISN + 1, so the engine learns Δ = ISN(P) -
//!   ISN(B) from it (ST-TCP's step 3), and the timestamp offset from its TSecr. Client → backup:
//!   ACK - Δ, SACK edges - Δ, TSecr - offset, so the backup's kernel stays a faithful copy; the
//!   ACK (and SACK edges) are clamped to what the backup's server has sent, since Linux discards
//!   a segment whose ACK covers unsent data, payload included. Backup → client: SEQ + Δ, TSval +
//!   offset (its SACK blocks name the client's sequence space, which both hosts share: nothing to
//!   translate); withheld (dropped, counted) until [`Backup::take_over`]. The backup reports its
//!   progress ([`unbroken_wire::replica`]): what its server received (its own ACK and window)
//!   and produced (output end and digest in the primary's space, FIN, RST).
//! - [`Primary`] (Koch 3.2, 3.4, 6; ST-TCP 3.7): the primary never acknowledges client bytes the
//!   backup has not received: its ACK to the client is min(primary, backup) and its right window
//!   edge min(primary, backup) (the window follows, so the edge does not move left when the ACK
//!   is lowered). A SYN-ACK waits until the backup has seen the SYN. When the backup catches up,
//!   a fresh ACK is injected at once (Koch 3.4's empty segment). With strict output commit
//!   ([`Config::strict`], Koch 3.2) output bytes are held until the backup reports the same
//!   bytes (same offset, same digest), then released with the current ACK and window; different
//!   bytes at the same offset are a divergence.
//! - [`Detector`] (ST-TCP 3.3.3): missed beats → suspected → fencing hook → take-over (backup) or
//!   backup failed (primary).
//!
//! ST-TCP Table 3.3, as this engine handles each single failure:
//! 1. Host crash of the primary: the backup's detector misses beats, fences, takes over. Host
//!    crash of the backup: the primary's detector misses beats, fences the backup, then
//!    [`Primary::backup_failed`]: every held byte is released and the primary runs unprotected
//!    (Koch 6), reported.
//! 2. Application failure without FIN/RST: the side whose application lags by more than
//!    [`Config::max_lag_bytes`] or holds one byte back longer than [`Config::max_lag_ms`] is the
//!    failed one: a lagging backup makes the connection unprotected and the backup stale
//!    ([`Primary::backup_stale`]); a lagging primary asks its daemon to yield
//!    ([`Notice::YieldToBackup`]: stop, so the backup fences it and takes over) only when its
//!    whole server stalled (nothing new left it on any connection for half the lag bound),
//!    otherwise that connection runs unprotected ([`Why::PrimaryFailed`]).
//! 3. Application failure with FIN/RST on one side: a FIN is output like a byte and is released
//!    only once the backup produced its FIN at the same offset. A FIN where the other side has
//!    data at that offset marks the FIN's side as failed (primary: after
//!    [`PRIMARY_FAIL_GRACE_MS`], a yield if its listening socket is gone
//!    ([`Primary::server_listening`]), else that connection's failure; backup: unprotected and
//!    stale). A lone primary FIN waits [`Config::max_delay_fin_ms`] (ST-TCP's MaxDelayFIN) from
//!    the client's ACK of every byte before it, then goes out unprotected. A primary RST is never
//!    sent while protected: if the backup does not reset too within MaxDelayFIN, it is that
//!    connection's failure (a yield with its listener gone). A backup RST makes the connection
//!    unprotected and the backup stale.
//! 4. NIC or cable failure (two heartbeat links, gateway pings): not handled; the daemon's
//!    business, it has one side channel for now.
//! 5. Temporary loss at the backup: the primary's ACK stays at the backup's, so the client keeps
//!    what the backup missed (Koch 4), and the primary sends those bytes to the backup itself
//!    (ST-TCP 3.6's retransmission from the primary: [`Primary::take_relay`],
//!    [`Backup::relayed_input`]); after [`Config::nudge_after_ms`] three duplicate ACKs also make
//!    the client resend at once. Temporary loss at the primary (the table leaves it to the
//!    client's retransmission, a timeout of 200 ms and more after the loss): the backup hands
//!    the primary the client's ACKs it heard and the bytes the primary missed
//!    ([`Backup::take_relay`], [`Primary::backup_input`]; issue 20).
//!
//! Divergence (strict mode): the connection becomes unprotected on the primary, which goes on
//! alone with its own output (the bytes the client has seen so far were verified, and the rest
//! come from the one server it has been talking to), counts it and reports it to the backup in
//! its own progress ([`Primary::report`], flag DIVERGED); a promoted backup never sends a byte on
//! a diverged connection. Without strict mode output passes at once and divergence goes unseen.
//!
//! Preconditions not checked yet: both servers announce the same window scale and MSS (same
//! kernel settings); the connection is opened by the client (Koch 7.2, connections the server
//! opens, is out of scope).

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;

use unbroken_wire::ip::{self, IpInfo};
use unbroken_wire::replica::{self as rw, hash_continue, ConnProgress, Progress, Role, HASH_INIT};
use unbroken_wire::tcp::{self, flags as F, Packet as Tcp, TcpOption};
use unbroken_wire::{Error, Result, Seq};

use crate::Verdict;

/// A connection as both hosts name it: the service address is the same on both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConnKey {
    pub client: IpAddr,
    pub client_port: u16,
    pub server_port: u16,
}

impl ConnKey {
    fn of(r: &ConnProgress) -> ConnKey {
        ConnKey { client: r.client, client_port: r.client_port, server_port: r.server_port }
    }
}

/// The facts of one segment, parsed once.
struct Seg {
    info: IpInfo,
    src_port: u16,
    dst_port: u16,
    flags: u8,
    seq: Seq,
    ack: Seq,
    window: u16,
    /// Offset of the payload from the start of the packet, and its length.
    payload_at: usize,
    payload_len: usize,
    /// Timestamp option: its offset in the TCP header, TSval, TSecr.
    ts: Option<(usize, u32, u32)>,
    /// SACK option: its offset in the TCP header and the number of blocks.
    sack: Option<(usize, u8)>,
    wscale: Option<u8>,
    mss: Option<u16>,
    csum_ok: bool,
}

impl Seg {
    fn has(&self, f: u8) -> bool {
        self.flags & f != 0
    }
    fn fin(&self) -> bool {
        self.has(F::FIN)
    }
}

fn parse(pkt: &[u8]) -> Result<Seg> {
    let info = IpInfo::parse(pkt)?;
    if info.protocol != ip::PROTO_TCP {
        return Err(Error::Unsupported("not tcp"));
    }
    let end = info.l4_offset.checked_add(info.l4_len).filter(|&e| e <= pkt.len()).ok_or(Error::Truncated)?;
    let seg = &pkt[info.l4_offset..end];
    let t = Tcp::new_checked(seg)?;
    let mut s = Seg {
        info,
        src_port: t.src_port(),
        dst_port: t.dst_port(),
        flags: t.flags(),
        seq: t.seq(),
        ack: t.ack(),
        window: t.window(),
        payload_at: info.l4_offset + t.header_len(),
        payload_len: t.payload().len(),
        ts: None,
        sack: None,
        wscale: None,
        mss: None,
        csum_ok: t.verify_checksum(info.pseudo_sum(info.l4_len)),
    };
    for slot in t.option_slots() {
        let slot = slot?;
        match tcp::parse_option(&seg[slot.offset..slot.offset + slot.len])? {
            TcpOption::Timestamp { tsval, tsecr } => s.ts = Some((slot.offset, tsval, tsecr)),
            TcpOption::Sack(_, n) => s.sack = Some((slot.offset, n)),
            TcpOption::WindowScale(w) => s.wscale = Some(w.min(14)),
            TcpOption::Mss(m) => s.mss = Some(m),
            _ => {}
        }
    }
    Ok(s)
}

/// The TCP view of a packet [`parse`] accepted.
fn tcp_mut<'a>(pkt: &'a mut [u8], s: &Seg) -> Result<Tcp<&'a mut [u8]>> {
    Tcp::new_checked(&mut pkt[s.info.l4_offset..s.info.l4_offset + s.info.l4_len])
}

/// RFC 793's acceptability test against a receive window [`rcv_nxt`, `edge`]: some of the
/// segment at or after RCV.NXT, its start not beyond the right edge.
fn acceptable(s: &Seg, rcv_nxt: Seq, edge: Seq) -> bool {
    let end = s.seq + s.payload_len as u32 + s.fin() as u32;
    end.ge(rcv_nxt) && s.seq.le(edge)
}

fn seq_min(a: Seq, b: Seq) -> Seq {
    if a.lt(b) {
        a
    } else {
        b
    }
}

/// Rewrites every SACK edge `e` into `f(e)`.
fn map_sack(t: &mut Tcp<&mut [u8]>, at: usize, n: u8, mut f: impl FnMut(Seq) -> Seq) {
    for i in 0..n as usize {
        for edge in [at + 2 + 8 * i, at + 6 + 8 * i] {
            let v = Seq(u32::from_be_bytes(t.as_bytes()[edge..edge + 4].try_into().unwrap()));
            let w = f(v);
            if w != v {
                t.rewrite_u32_at(edge, w.0);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The backup (ST-TCP 3.3.0.1 / 3.3.1, Koch 3.1)
// ---------------------------------------------------------------------------------------------

/// Output checkpoints a backup keeps for the primary (one per output segment), oldest first:
/// the primary verifies its held output in order, so the ones it needs next are the oldest. At
/// 4,096 segments they cover more output than the primary holds ([`Config::max_held_bytes`]).
const MAX_CHECKPOINTS: usize = 4096;
/// The backup's checkpoints fall at most this far apart: at every multiple of it in the
/// primary's sequence space that a segment's bytes cross, and at the segment's end
/// ([`learn_output`]; `rep_b_out` does the same, `REP_CP_STEP`). A GSO super-packet's end alone
/// left the primary, whose held segments end elsewhere, short of the next checkpoint.
pub const CHECKPOINT_STEP: u32 = 1024;
/// Unverified checkpoints a full beat repeats (the oldest), so that a lost message never leaves
/// the primary without a digest at an offset it reached.
const BEAT_CHECKPOINTS: usize = 16;

/// The fields of a backup connection the kernel's fast path reads and writes (issue 22 item 4;
/// `drivers::fastpath::replica::State` is their C layout, with a flag per `Option`). Everything
/// else (checkpoints, kept copies, output beyond a gap, the take-over's figures) stays the
/// engine's and reaches it through [`Backup::push_checkpoint`] and [`Backup::push_kept`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BFast {
    pub aligned: bool,
    pub rcv_known: bool,
    pub client_seen: bool,
    pub delta: u32,
    pub ts_off: u32,
    pub ws_b: u8,
    pub snd_max: Seq,
    pub rcv_nxt: Seq,
    pub rcv_edge: Seq,
    pub out_end: Seq,
    pub out_hash: u64,
    pub last_ack: Seq,
    pub acked_b: Option<Seq>,
    pub p_out: Option<Seq>,
    pub ts_floor: Option<u32>,
    pub client_ts_max: Option<(u32, u32)>,
    pub client_ts: Option<(u32, u32)>,
    /// The backup server's newest TSval and when it was seen (the engine's clock, ms: the
    /// caller converts from the kernel's).
    pub b_ts_seen: Option<(u32, u64)>,
    pub client_win: u16,
    pub server: Option<IpAddr>,
}

/// What a backup connection holds beyond [`BFast`], for inspection: the unverified
/// checkpoints (end, digest), the kept copies (end in the backup's space, length), and
/// whether output waits beyond a gap.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BSide {
    pub checkpoints: Vec<(Seq, u64)>,
    pub kept: Vec<(Seq, usize)>,
    pub ooo_empty: bool,
    /// Where the copy of the client's bytes for the primary ends, and its length.
    pub input_end: Option<Seq>,
    pub input_len: usize,
}

#[derive(Debug, Clone, Default)]
struct BConn {
    /// Its number in the table's insertion order.
    born: u64,
    /// The backup server's ISN and its SYN-ACK's TSval.
    b_isn: Option<Seq>,
    b_ts0: Option<u32>,
    /// The backup's own window shift, from its server's SYN-ACK (0: no scaling).
    ws_b: u8,
    /// Δ = ISN(P) - ISN(B) and the timestamp offset are known (ST-TCP 3.3.0.1, step 3).
    aligned: bool,
    delta: u32,
    ts_off: u32,
    /// The backup server's SND.MAX (its own space).
    snd_max: Seq,
    rcv_known: bool,
    rcv_nxt: Seq,
    rcv_edge: Seq,
    /// Output produced, primary's space, and its digest from ISN + 1.
    out_end: Seq,
    out_hash: u64,
    fin_out: bool,
    rst_out: bool,
    last_ack: Seq,
    /// The highest ACK handed to the backup's server (its own space, after clamping to
    /// `snd_max`), from the client or relayed: a client ACK clamped because the backup's server
    /// had not sent those bytes yet is relayed again once it has (else that server waits for an
    /// ACK the client, which has everything from the primary, never sends again).
    acked_b: Option<Seq>,
    /// The primary reported a divergence: never answer on this connection.
    diverged: bool,
    /// The primary's ISN, from its report: only the client's ACK of the primary's SYN-ACK
    /// (ISN + 1) aligns, and an alignment made before it arrived is checked against it.
    p_isn: Option<Seq>,
    /// Aligned on a forged ACK (Δ differs from the primary's ISN - the backup's): its server's
    /// connection is not the client's; never answer on it, and tell the primary.
    misaligned: bool,
    client_fin: bool,
    /// The MSS of the client's SYN (the latest before alignment) and of its server's SYN-ACK:
    /// a kept copy larger than the smaller (a GSO super-packet) is cut to it before the
    /// take-over resends it (a forged SYN can name any MSS; the SYN-ACK's bounds it by the
    /// backup's own link).
    client_mss: Option<u16>,
    b_mss: Option<u16>,
    /// The latest client ACK seen (`last_ack`): its window field, timestamps (client's clock,
    /// primary's TSecr) and the service address it was sent to.
    client_seen: bool,
    client_isn: Option<Seq>,
    /// Output ends (with their digests) not yet verified by the primary, oldest first.
    checkpoints: VecDeque<(Seq, u64)>,
    /// The newest checkpoint already sent in a message: a message between beats carries only
    /// the newer ones.
    cp_sent: Option<Seq>,
    /// The newest TSval the client has seen from this connection (its TSecr, and after take-over
    /// what this backup sent): a promoted backup never sends an older one, which the client would
    /// discard (PAWS, RFC 7323 5), however the offset learned at the handshake drifted.
    ts_floor: Option<u32>,
    /// The newest TSval of the backup's server and when it was seen (the engine's clock, ms):
    /// at take-over the server's clock now is estimated from it (Linux's timestamp clock runs
    /// at 1 kHz), so that resent withheld segments carry a current TSval, not the one of
    /// seconds ago, which the client would discard (PAWS).
    b_ts_seen: Option<(u32, u64)>,
    /// The newest TSval (and its TSecr) of a client segment the backup's server takes.
    client_ts_max: Option<(u32, u32)>,
    /// Output seen beyond a gap in the digest (start, payload, FIN), at most
    /// [`MAX_KEPT_BYTES`].
    ooo: Vec<(Seq, Vec<u8>, bool)>,
    ooo_bytes: usize,
    client_win: u16,
    client_ts: Option<(u32, u32)>,
    server: Option<IpAddr>,
    /// The end of the output the primary verified (its reports' `out_end`): the client has
    /// received at most this far.
    p_out: Option<Seq>,
    /// A promoted backup reset this diverged connection toward the client.
    reset_sent: bool,
    /// Withheld segments with payload or FIN the client may not have (end in the backup's
    /// space), resent at take-over; trimmed as the client's ACKs reach the backup's server.
    kept: VecDeque<(Seq, Vec<u8>)>,
    kept_bytes: usize,
    /// When the primary's report last named this connection (ms, the backup's clock): only a
    /// connection the primary follows is continued at take-over, and a half-open entry it
    /// still names is not expired.
    p_seen_at: Option<u64>,
    /// The client reset the connection (an acceptable RST): it is over.
    client_rst: bool,
    /// How many of the primary's beats the backup had heard when it aligned this connection:
    /// a connection the primary's reports still do not name two beats later is one it does not
    /// follow.
    aligned_at_beats: u64,
    /// Loss toward the primary (the reverse of ST-TCP 3.6): the primary server's RCV.NXT as
    /// its reports give it, and when it last moved (the backup's clock, ms).
    p_rcv: Option<(Seq, u64)>,
    /// Copies of the client's bytes this backup's server took beyond `p_rcv`, in order and
    /// contiguous (start, bytes, when they came), their total, and where the next byte goes:
    /// relayed to the primary when it missed them, instead of waiting for the client's
    /// retransmission timeout (issue 20: 300 ms stalls after 200 ms of loss).
    input: VecDeque<InputCopy>,
    input_len: usize,
    input_end: Option<Seq>,
    /// Two copies of the same client bytes differed (a forgery that guessed the client's
    /// sequence number, before or after the real segment): nothing is copied again until the
    /// primary's figure passes this point.
    input_hold: Option<Seq>,
    /// The end of the last bytes relayed to the primary, when, and the gap before a relay the
    /// primary does not confirm goes again (doubling).
    relay_end: Option<Seq>,
    relay_at: u64,
    relay_gap: u64,
}

impl BConn {
    /// The primary follows this connection: its reports name it, or it was aligned less than
    /// two of the primary's beats ago (`p_beats` heard so far), so that its report may still
    /// come.
    fn reported(&self, p_beats: u64) -> bool {
        self.p_seen_at.is_some() || p_beats < self.aligned_at_beats + 2
    }

    /// Drops every copy of client bytes kept for the primary: what they counted.
    fn drop_input(&mut self) -> usize {
        let n = self.input_len;
        self.input.clear();
        self.input_len = 0;
        self.input_end = None;
        n
    }

    /// Whether the client bytes of `s` are copied for the primary: a segment with bytes and
    /// without RST or SYN, of a connection the primary follows and this backup can continue.
    fn wants_input(&self, s: &Seg, p_beats: u64) -> bool {
        s.payload_len > 0 && !s.has(F::RST) && !s.has(F::SYN) && self.reported(p_beats) && !self.diverged && !self.misaligned
    }
}

impl Entry for BConn {
    fn born(&self) -> u64 {
        self.born
    }
    fn set_born(&mut self, n: u64) {
        self.born = n;
    }
    /// Not aligned: no acceptable client ACK of the handshake yet.
    fn half_open(&self) -> bool {
        !self.aligned
    }
    fn finished(&self) -> bool {
        self.rst_out || self.client_rst || (self.fin_out && self.client_fin)
    }
}

/// What the backup's engine counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct BackupCounters {
    /// Packets of the backup's server toward clients dropped before take-over.
    pub withheld: u64,
    /// Connections whose sequence space was aligned with the primary's.
    pub aligned: u64,
    /// Client packets dropped because the backup's server has not answered the SYN yet (no
    /// ISN to align with): the primary's ACK waits for the backup, so the client resends.
    pub unaligned_dropped: u64,
    /// Client ACKs (or SACK edges) lowered to what the backup's server has sent.
    pub ack_clamped: u64,
    pub bad_checksum: u64,
    pub malformed: u64,
    /// Output of a promoted backup on a connection the primary found diverged, dropped.
    pub diverged_silenced: u64,
    /// Connections whose withheld, unacknowledged output was resent at take-over.
    pub takeover_resent: u64,
    /// Withheld segments not kept for the take-over (beyond the per-connection bound).
    pub kept_dropped: u64,
    /// RSTs a promoted backup sent to the clients of diverged connections (the connection
    /// cannot go on without a wrong byte; the client is told instead of left waiting).
    pub diverged_reset: u64,
    /// Output beyond a gap in the backup server's stream (a local TCP never does that).
    pub output_gap: u64,
    /// Client ACKs the backup missed, relayed from the primary's report.
    pub acks_relayed: u64,
    /// Retransmissions by the backup's server of bytes the client's ACK (as given to that
    /// server, or relayed) already covered: that ACK never reached it; relayed again.
    pub acks_unheard: u64,
    /// New connections not followed because the table was full of established connections
    /// (they cannot be taken over).
    pub table_full: u64,
    /// Half-open entries (no client handshake ACK yet: a SYN flood's) evicted, oldest first,
    /// to make room for a new connection in a full table.
    pub half_open_evicted: u64,
    /// Client packets outside the backup server's receive window (a forgery, or very old), or
    /// (before alignment, the primary's ISN known) whose ACK is not the primary's ISN + 1:
    /// nothing is learned from them; before alignment they are dropped.
    pub unacceptable: u64,
    /// Connections found aligned on a forged ACK once the primary's ISN arrived: silenced for
    /// good, reported (MISALIGNED) so that the primary runs them unprotected.
    pub misaligned: u64,
    /// Client ACKs beyond anything the backup's server sent and the primary reported (a blind
    /// forgery, or ahead of the primary's report): lowered to the last known ACK, not learned.
    pub ack_unverified: u64,
    /// Half-open entries (no handshake within [`HALF_OPEN_TTL_MS`], not named by the primary)
    /// forgotten.
    pub half_open_expired: u64,
    /// Client RSTs that ended a connection.
    pub client_resets: u64,
    /// Connections the primary never reported (it did not follow them: started before it
    /// armed, its table full), reset at take-over instead of continued unchecked.
    pub unreported_reset: u64,
    /// After take-over: client packets of connections this backup does not follow answered
    /// with a RST, and its server's packets of such connections dropped (never sent in the
    /// backup's own numbering).
    pub unknown_reset: u64,
    pub unknown_dropped: u64,
    /// Client bytes the primary relayed (the backup missed them), handed to its server.
    pub relayed_in: u64,
    /// Client bytes relayed to the primary (its host missed them, this one did not).
    pub relayed_to_primary: u64,
    /// Client bytes not copied for the primary: beyond [`MAX_INPUT_COPY`] or
    /// [`MAX_INPUT_COPY_TOTAL`] (the primary then waits for the client's retransmission).
    pub input_copy_full: u64,
    /// Client segments whose bytes differed from a copy of the same sequence numbers (a
    /// forgery that guessed them): that connection's copies dropped, none kept until the
    /// primary has those bytes.
    pub input_conflicts: u64,
}

/// The backup's engine: every client packet goes through [`Backup::incoming`] before the
/// backup's server sees it, every packet of that server through [`Backup::outgoing`].
#[derive(Debug)]
pub struct Backup {
    conns: HashMap<ConnKey, BConn>,
    births: Births,
    promoted: bool,
    max_conns: usize,
    /// Packets to send to clients (the RSTs of diverged connections after take-over).
    out: Vec<Vec<u8>>,
    /// Bytes kept for the take-over, all connections (recounted with every full progress, so
    /// connections forgotten or evicted meanwhile only make it overestimate).
    kept_total: usize,
    /// Connections whose figures may have moved since the last progress message: the backup
    /// server's packets move them (its ACK, window and output); a client packet changes
    /// nothing the primary waits for.
    changed: std::collections::HashSet<ConnKey>,
    /// The latest time passed to [`Backup::tick`] (ms).
    clock: u64,
    /// Strict output commit (the primary's [`Config::strict`]): no genuine client ACK can lie
    /// beyond what the backup's server sent, so a segment whose does is dropped. Without it the
    /// primary's output passes at once and a genuine ACK may: lowered, as before.
    strict: bool,
    /// The primary's beats heard (distinct beat numbers, growing), and the newest.
    p_beats: u64,
    p_last_beat: Option<u64>,
    /// Client bytes copied for the primary, all connections (with each copy's overhead), the
    /// relays to send ([`Backup::take_relay`]), and whether copies are kept at all (not by a
    /// backup that can no longer take over: nobody would trim them).
    input_total: usize,
    input_on: bool,
    relay: Vec<Relay>,
    pub counters: BackupCounters,
}

/// Client bytes one host relays to the other over the side channel: the connection, the
/// client sequence number of the first byte, at most [`rw::MAX_INPUT`] bytes, and (backup to
/// primary) the client's newest timestamps the sender's server took (TSval, TSecr).
pub type Relay = (ConnKey, Seq, Vec<u8>, Option<RelayFrom>);

/// One copy of a client segment's bytes on the backup: the first byte's sequence number, the
/// bytes, when they came (ms), and the segment's own timestamps (TSval, TSecr in the primary's
/// clock): a relay never carries a TSval newer than the bytes' own, which would make the
/// primary's kernel discard the client's later segments still on their way (PAWS).
#[derive(Debug, Clone, Default)]
struct InputCopy {
    at: Seq,
    data: Vec<u8>,
    came: u64,
    ts: Option<(u32, u32)>,
}

impl InputCopy {
    fn end(&self) -> Seq {
        self.at + self.data.len() as u32
    }
    /// What it counts against the bounds: its bytes and a fixed cost (a client sending 1-byte
    /// segments must not get 64 MiB of copies for 64 MiB of entries' overhead).
    fn cost(&self) -> usize {
        self.data.len() + INPUT_COPY_OVERHEAD
    }
}

/// What one copy counts against [`MAX_INPUT_COPY`] beyond its bytes.
const INPUT_COPY_OVERHEAD: usize = 64;

/// What a backup's relay says of the client besides its bytes: its newest timestamps the
/// backup's server took (TSval, TSecr in the primary's clock) and its latest window field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RelayFrom {
    pub ts: Option<(u32, u32)>,
    pub window: u16,
}

/// Client bytes a backup copies per connection for the primary, and for all connections
/// together: what the client sends during a loss toward the primary (its congestion window).
pub const MAX_INPUT_COPY: usize = 4 << 20;
pub const MAX_INPUT_COPY_TOTAL: usize = 64 << 20;

/// How long the primary server's RCV.NXT must have stood still, below bytes the backup has had
/// as long, before the backup relays them: its reports come every beat (10 ms), so in a steady
/// stream the primary has reported those bytes by then.
pub const INPUT_RELAY_AFTER_MS: u64 = 20;

impl Default for Backup {
    fn default() -> Backup {
        Backup::with_capacity(DEFAULT_MAX_CONNS)
    }
}

/// Connections an engine follows by default; beyond, a new one goes unprotected (counted) unless
/// a finished one can be forgotten for it. Every SYN may be forged: the table must not grow
/// without bound.
pub const DEFAULT_MAX_CONNS: usize = 65_536;

/// A connection table's entry as [`insert`] sees it.
trait Entry {
    /// Its number in the table's insertion order ([`Births`]).
    fn born(&self) -> u64;
    fn set_born(&mut self, n: u64);
    /// The client's handshake has not completed (all a forged SYN ever gets to).
    fn half_open(&self) -> bool;
    /// Both sides are done with it: it can be forgotten.
    fn finished(&self) -> bool;
}

/// A table's entries in the order they were made, oldest first, so that a full table evicts
/// its oldest half-open entry in O(1) amortized (a SYN cache): a SYN flood churns half-open
/// entries and never displaces an established connection, and a real connection opened during
/// or after the flood gets a place (it is evicted only if a whole table's worth of SYNs arrive
/// before its handshake completes). Entries that completed their handshake or left the table
/// leave stale numbers behind, skipped on eviction and compacted away.
#[derive(Debug, Default)]
struct Births {
    /// (key, its number, when it was made or last found in use (ms)).
    order: VecDeque<(ConnKey, u64, u64)>,
    next: u64,
}

/// How long an entry may stay half-open (its handshake not completed: all a forged SYN gets
/// to) before it is forgotten. A real client completes its handshake within a round trip, or
/// within the server's SYN-ACK retransmissions (1, 3, 7 s) when its ACK is lost.
pub const HALF_OPEN_TTL_MS: u64 = 30_000;

/// Forgets the half-open entries made more than `ttl` ago, oldest first, in O(1) amortized
/// (their places in the birth order are oldest first; established entries' places are dropped
/// on the way, they are never needed again). `keep` may spare an entry (it is found in use: its
/// place moves to the back, stamped `now`).
fn expire_half_open<V: Entry>(map: &mut HashMap<ConnKey, V>, births: &mut Births, now: u64, ttl: u64, keep: impl Fn(&V) -> bool) -> Vec<(ConnKey, V)> {
    let mut gone = vec![];
    while let Some(&(k, n, t)) = births.order.front() {
        let Some(v) = map.get(&k).filter(|v| v.born() == n && v.half_open()) else {
            births.order.pop_front();
            continue;
        };
        if now < t.saturating_add(ttl) {
            break;
        }
        births.order.pop_front();
        if keep(v) {
            births.order.push_back((k, n, now));
        } else if let Some(v) = map.remove(&k) {
            gone.push((k, v));
        }
    }
    gone
}

/// What [`make_room`] did.
enum Room<V> {
    Free,
    /// The oldest half-open entry was evicted.
    Evicted(V),
    /// A finished entry was forgotten.
    Forgotten(V),
    /// Every entry is an established connection that has not finished.
    Full,
}

/// Room for one more entry in `map` (at most `cap`): the oldest half-open entry goes first,
/// else a finished one.
fn make_room<V: Entry>(map: &mut HashMap<ConnKey, V>, births: &mut Births, cap: usize) -> Room<V> {
    if map.len() < cap {
        return Room::Free;
    }
    while let Some((k, n, _)) = births.order.pop_front() {
        if map.get(&k).is_some_and(|v| v.born() == n && v.half_open()) {
            if let Some(v) = map.remove(&k) {
                return Room::Evicted(v);
            }
        }
    }
    match map.iter().find(|(_, v)| v.finished()).map(|(k, _)| *k).and_then(|k| map.remove(&k)) {
        Some(v) => Room::Forgotten(v),
        None => Room::Full,
    }
}

/// Makes `v` the entry of `key` (replacing one there), numbered as the youngest, after making
/// room for it. `None`: the table is full of established connections, nothing changed.
/// `Some(gone)`: the entry it replaced, or the one evicted (counted in `evicted`) or forgotten
/// for it.
fn insert<V: Entry>(map: &mut HashMap<ConnKey, V>, births: &mut Births, cap: usize, key: ConnKey, mut v: V, evicted: &mut u64, now: u64) -> Option<Option<V>> {
    let mut gone = None;
    if !map.contains_key(&key) {
        match make_room(map, births, cap.max(1)) {
            Room::Full => return None,
            Room::Evicted(old) => {
                *evicted += 1;
                gone = Some(old);
            }
            Room::Forgotten(old) => gone = Some(old),
            Room::Free => {}
        }
    }
    let n = births.next;
    births.next += 1;
    v.set_born(n);
    let replaced = map.insert(key, v);
    births.order.push_back((key, n, now));
    if births.order.len() > 2 * map.len() + 64 {
        births.order.retain(|(k, n, _)| map.get(k).is_some_and(|v| v.born() == *n && v.half_open()));
    }
    Some(gone.or(replaced))
}

impl Backup {
    pub fn new() -> Backup {
        Backup::default()
    }

    /// A backup following at most `max_conns` connections.
    pub fn with_capacity(max_conns: usize) -> Backup {
        Backup { conns: HashMap::new(), births: Births::default(), promoted: false, max_conns: max_conns.max(1), out: Vec::new(), kept_total: 0, changed: Default::default(), clock: 0, strict: true, p_beats: 0, p_last_beat: None, input_total: 0, input_on: true, relay: Vec::new(), counters: BackupCounters::default() }
    }

    /// Time passes: half-open entries older than [`HALF_OPEN_TTL_MS`] that the primary no
    /// longer names are forgotten (a burst of forged SYNs loads the tables and the side channel
    /// for that long, not for good).
    pub fn tick(&mut self, now_ms: u64) {
        self.clock = self.clock.max(now_ms);
        let now = self.clock;
        let gone = expire_half_open(&mut self.conns, &mut self.births, now, HALF_OPEN_TTL_MS, |c: &BConn| c.p_seen_at.is_some_and(|t| t + HALF_OPEN_TTL_MS / 2 > now));
        self.counters.half_open_expired += gone.len() as u64;
        for (_, c) in gone {
            self.kept_total = self.kept_total.saturating_sub(c.kept_bytes);
        }
    }

    pub fn is_promoted(&self) -> bool {
        self.promoted
    }

    /// Whether the pair runs strict output commit (default true), as the daemon's config says.
    pub fn set_strict(&mut self, strict: bool) {
        self.strict = strict;
    }

    /// Koch 5: the primary failed (and was fenced): stop withholding; every connection goes on
    /// in the primary's sequence space, translations stay on for good.
    ///
    /// The output the backup's server produced last was withheld: its TCP counts it as sent
    /// and lost and would resend it only at its retransmission timeout (200 ms and more,
    /// backed off), while the client, which never got it from the dead primary, waits; a
    /// duplicate ACK does not hurry it on a SACK connection. So the engine keeps a copy of the
    /// withheld segments the client has not acknowledged (at most [`MAX_KEPT_BYTES`] per
    /// connection) and sends them now, translated ([`Backup::take_transmit`]): the client gets
    /// them one round trip after the take-over, and its ACKs settle the backup's TCP.
    pub fn take_over(&mut self) {
        if self.promoted {
            return;
        }
        self.promoted = true;
        self.kept_total = 0;
        self.input_total = 0;
        self.relay.clear();
        for (key, c) in self.conns.iter_mut() {
            let kept = std::mem::take(&mut c.kept);
            c.kept_bytes = 0;
            c.drop_input();
            // A connection the primary reported it no longer protects (DIVERGED: it diverged,
            // or ran unprotected for any reason, so its input here may have a hole the client
            // will never fill) or that this backup numbered wrong never goes on: its client is
            // reset now, at the client's last ACK and at the end the primary verified (one of
            // them is where the client stands, or inside its window, where Linux answers with a
            // challenge ACK that `incoming` resets exactly), and whatever it sends later is
            // answered with a RST. So is a connection the primary does not follow:
            // A connection the primary's reports have not named although two of its beats came
            // since it was aligned: the primary does not follow it (it started before the
            // primary armed, or its table was full), so nothing checked its output. One aligned
            // more recently gets the benefit of the doubt: the primary's report of it may not
            // have come yet.
            let unreported = !c.reported(self.p_beats);
            if c.diverged || c.misaligned || !c.aligned || unreported {
                if c.aligned && !c.finished() {
                    if unreported && !c.diverged && !c.misaligned {
                        self.counters.unreported_reset += 1;
                    }
                    c.diverged = true;
                    c.reset_sent = true;
                    if let (Some(server), true) = (c.server, c.client_seen) {
                        let mut at = vec![c.last_ack];
                        if let Some(p) = c.p_out.filter(|p| p.gt(c.last_ack)) {
                            at.push(p);
                        }
                        for seq in at {
                            if let Some(r) = reset_to_client(key, server, seq) {
                                self.counters.diverged_reset += 1;
                                self.out.push(r);
                            }
                        }
                    }
                }
                continue;
            }
            if let Some((v, t)) = c.b_ts_seen {
                let now_b = v.wrapping_add(self.clock.saturating_sub(t).min(1 << 30) as u32);
                let est = now_b.wrapping_add(c.ts_off);
                if c.ts_floor.is_none_or(|f| ts_before(f, est)) {
                    c.ts_floor = Some(est);
                }
            }
            let acked = c.acked_b;
            let mut any = false;
            for (end, mut pkt) in kept {
                if acked.is_some_and(|a| end.le(a)) {
                    continue;
                }
                let Ok(s) = parse(&pkt) else { continue };
                if translate_out(c, &mut pkt, &s) {
                    any = true;
                    // A GSO super-packet (the backup's queue takes them whole) goes out as the
                    // kernel would have cut it: at most the client's MSS of payload (RFC 1122's
                    // 536 at the least, so a forged SYN's tiny MSS cannot make thousands), less
                    // the options.
                    cut(&mut self.out, pkt, c.client_mss, c.b_mss);
                }
            }
            if any {
                self.counters.takeover_resent += 1;
            }
        }
    }

    /// A client packet toward the backup's server: align on the handshake ACK, translate.
    pub fn incoming(&mut self, pkt: &mut [u8]) -> Verdict {
        let s = match parse(pkt) {
            Ok(s) => s,
            Err(_) => {
                self.counters.malformed += 1;
                return Verdict::PASS;
            }
        };
        if !s.csum_ok {
            self.counters.bad_checksum += 1;
            return Verdict::Drop;
        }
        let key = ConnKey { client: s.info.src, client_port: s.src_port, server_port: s.dst_port };
        if s.has(F::SYN) && !s.has(F::ACK) {
            // A new connection, or the port reused after both sides closed (or the server
            // reset): a new entry. A SYN on a live connection changes nothing (a
            // retransmission, or a forgery, which the kernel answers with a challenge ACK).
            let fresh = self.conns.get(&key).is_none_or(|c| c.finished() && c.client_isn != Some(s.seq));
            if fresh && insert(&mut self.conns, &mut self.births, self.max_conns, key, BConn::default(), &mut self.counters.half_open_evicted, self.clock).is_none() {
                self.counters.table_full += 1;
                return Verdict::PASS;
            }
            if let Some(c) = self.conns.get_mut(&key).filter(|c| !c.aligned) {
                // Until the SYN-ACK names the SYN its server answered (any SYN may be forged).
                c.client_isn = Some(s.seq);
                c.client_mss = s.mss;
            }
            return Verdict::PASS;
        }
        let Some(c) = self.conns.get_mut(&key) else {
            if self.promoted && s.has(F::ACK) && !s.has(F::RST) {
                // A connection this backup does not follow (the primary never reported it, or
                // its table was full): its server cannot continue it in the client's numbering.
                // The client's ACK names where it stands: a RST there, never a silent hang.
                if let Some(r) = reset_to_client(&key, s.info.dst, s.ack) {
                    self.counters.unknown_reset += 1;
                    self.out.push(r);
                }
                return Verdict::Drop;
            }
            return Verdict::PASS;
        };
        // Only a segment the backup's server would accept teaches anything (RFC 793's test,
        // against the receive window it announced): a blind forgery must guess the client's
        // sequence number, not merely its address, to align the connection or move its ACK.
        let in_window = !c.rcv_known || acceptable(&s, c.rcv_nxt, c.rcv_edge);
        if !in_window {
            self.counters.unacceptable += 1;
            if !c.aligned {
                return Verdict::Drop;
            }
        }
        if s.fin() && in_window {
            c.client_fin = true;
        }
        if s.has(F::RST) && c.rcv_known && s.seq == c.rcv_nxt {
            // The client ended it (RFC 5961: only a RST exactly at RCV.NXT resets; an
            // in-window one draws a challenge ACK): a reused 4-tuple must not inherit this entry.
            if !c.client_rst {
                self.counters.client_resets += 1;
            }
            c.client_rst = true;
            return Verdict::PASS;
        }
        if self.promoted && (c.diverged || c.misaligned) && !s.has(F::RST) {
            // A client still talking on a connection that cannot go on: its ACK names exactly
            // where it stands; answered with a RST there (at most once per packet it sends).
            if s.has(F::ACK) {
                if let Some(r) = reset_to_client(&key, s.info.dst, s.ack) {
                    self.counters.diverged_reset += 1;
                    self.out.push(r);
                }
            }
            return Verdict::Drop;
        }
        if !s.has(F::ACK) {
            return Verdict::PASS;
        }
        if !c.aligned {
            // ST-TCP 3.3.0.1 (3): the client's handshake ACK acknowledges the primary's SYN-ACK.
            let Some(isn) = c.b_isn else {
                self.counters.unaligned_dropped += 1;
                return Verdict::Drop;
            };
            // Once the primary reported its ISN only its SYN-ACK's ACK aligns (the primary holds
            // output until the backup is aligned, so the client's first ACK is exactly that): a
            // forgery must guess the primary's ISN, not just the client's sequence number.
            // (After take-over the backup's own SYN-ACK may have gone out instead: its ACK too.)
            if c.p_isn.is_some_and(|p| s.ack != p + 1u32 && !(self.promoted && s.ack == isn + 1u32)) {
                self.counters.unacceptable += 1;
                return Verdict::Drop;
            }
            c.delta = (s.ack - 1u32) - isn;
            c.ts_off = match (s.ts, c.b_ts0) {
                (Some((_, _, ecr)), Some(t0)) => ecr.wrapping_sub(t0),
                _ => 0,
            };
            c.aligned = true;
            c.aligned_at_beats = self.p_beats;
            c.out_end = isn + 1 + c.delta;
            c.out_hash = HASH_INIT;
            self.counters.aligned += 1;
        }
        if let (true, Some((_, _, ecr))) = (in_window, s.ts) {
            if c.ts_floor.is_none_or(|f| ts_before(f, ecr)) {
                c.ts_floor = Some(ecr);
            }
        }
        // An ACK beyond what the backup's server sent is lowered to it only where the primary
        // reported output that far (the client may legitimately acknowledge it: the backup's
        // server is behind); beyond, it is a blind forgery or ahead of the report, lowered to
        // the last ACK the backup's server was given and not learned (the primary's report
        // relays the client's real ACK). Clamping it to everything sent would turn a forged
        // in-window segment into a full acknowledgement.
        // (After take-over no report will come: the client's ACK is all there is, and only an
        // in-window one, which a blind forgery must guess, is learned.)
        let beyond = !self.promoted && (s.ack - c.delta).gt(c.snd_max) && !c.p_out.is_some_and(|p| s.ack.le(p));
        // The client's newest timestamps, from a segment its server's kernel takes (in window,
        // and, with strict output commit, its ACK not beyond what was sent; without it such a
        // segment passes with its ACK clamped and the kernel takes its TSval all the same): a
        // relayed segment carries them (an older TSval would be discarded, PAWS: the relayed
        // ACK lost, the backup's server stuck in retransmission backoff behind it). A forgery
        // must guess the client's sequence number to set them.
        if let (true, false, Some((_, val, ecr))) = (in_window, beyond && self.strict, s.ts) {
            if c.client_ts_max.is_none_or(|(v, _)| !ts_before(val, v)) {
                c.client_ts_max = Some((val, ecr));
            }
        }
        if beyond {
            self.counters.ack_unverified += 1;
        }
        if beyond && self.strict {
            // Linux would discard this segment, payload and all (its ACK covers unsent data):
            // so does the backup, where a lowered ACK let bytes the primary's server refused into
            // the backup's alone (a forgery that merely guessed the client's sequence number).
            // In strict mode no genuine ACK lies beyond what the backup's server sent. (Without
            // strict mode one may, ahead of the primary's report: its ACK is lowered instead,
            // and such a forgery's bytes can reach the backup's server alone: a limit of that
            // mode, docs/threat-model.md.)
            return Verdict::Drop;
        }
        if in_window && !beyond && (s.ack.gt(c.last_ack) || !c.client_seen) {
            c.last_ack = s.ack;
            c.client_win = s.window;
            c.client_ts = s.ts.map(|t| (t.1, t.2));
            c.server = Some(s.info.dst);
            c.client_seen = true;
        }
        if in_window && self.input_on && !self.promoted && c.wants_input(&s, self.p_beats) {
            let data = &pkt[s.payload_at..s.payload_at + s.payload_len];
            let ts = s.ts.map(|t| (t.1, t.2));
            copy_input(c, &mut self.input_total, &mut self.counters, s.seq, data, ts, self.clock);
        }
        let Ok(mut t) = tcp_mut(pkt, &s) else { return Verdict::PASS };
        let limit = c.snd_max;
        let delta = c.delta;
        // (Without strict output commit a beyond ACK is genuine as often as not: the primary's
        // output passes at once, before the backup's server sent the same. Lowered below what
        // that server sent, its server was starved of ACKs, fell behind by megabytes with
        // large values and went stale; clamped to what it sent, it goes on, as before issue 20.)
        let floor = limit;
        let mut clamped = false;
        let mut to_b = |v: Seq| {
            let b = v - delta;
            if b.gt(limit) {
                clamped = true;
                floor
            } else {
                b
            }
        };
        let ack_b = to_b(s.ack);
        if in_window && c.acked_b.is_none_or(|a| ack_b.gt(a)) {
            c.acked_b = Some(ack_b);
        }
        let mut modified = false;
        if ack_b != s.ack {
            t.rewrite_ack(ack_b);
            modified = true;
        }
        if let Some((at, n)) = s.sack {
            map_sack(&mut t, at, n, &mut to_b);
            modified |= delta != 0;
        }
        if clamped {
            self.counters.ack_clamped += 1;
            modified = true;
        }
        if let (Some((at, _, ecr)), true) = (s.ts, c.ts_off != 0) {
            t.rewrite_u32_at(at + 6, ecr.wrapping_sub(c.ts_off));
            modified = true;
        }
        Verdict::Accept { modified }
    }

    /// A packet of the backup's server toward a client: learn its progress; withhold it until
    /// take-over, then translate it into the primary's space.
    pub fn outgoing(&mut self, pkt: &mut [u8]) -> Verdict {
        let promoted = self.promoted;
        let s = match parse(pkt) {
            Ok(s) => s,
            Err(_) => {
                self.counters.malformed += 1;
                return self.withhold();
            }
        };
        let key = ConnKey { client: s.info.dst, client_port: s.dst_port, server_port: s.src_port };
        if s.has(F::SYN) && s.has(F::ACK) && (self.conns.contains_key(&key) || insert(&mut self.conns, &mut self.births, self.max_conns, key, BConn::default(), &mut self.counters.half_open_evicted, self.clock).is_some()) {
            let Some(c) = self.conns.get_mut(&key) else { return self.withhold() };
            if !c.aligned {
                c.b_isn = Some(s.seq);
                c.b_ts0 = s.ts.map(|t| t.1);
                // The SYN its server answered (the SYN-ACK acknowledges it), not the latest SYN
                // seen: any of them may be forged. Its window scaling is in effect only if the
                // SYN-ACK carries the option (RFC 7323 2.2: only in answer to a SYN that did),
                // so a forged SYN, with or without the option, cannot set it.
                c.client_isn = Some(s.ack - 1u32);
                c.ws_b = s.wscale.unwrap_or(0);
                c.b_mss = s.mss;
                c.snd_max = s.seq + 1;
                c.rcv_nxt = s.ack;
                c.rcv_edge = s.ack + s.window as u32;
                c.rcv_known = true;
            }
        }
        let Some(c) = self.conns.get_mut(&key) else {
            if promoted && !(s.has(F::SYN) && s.has(F::ACK)) {
                // Never the backup's own numbering on a connection nobody followed (a SYN-ACK
                // of a connection opened after take-over needs no translation: it passes).
                self.counters.unknown_dropped += 1;
                return Verdict::Drop;
            }
            return self.withhold();
        };
        self.changed.insert(key);
        if s.has(F::RST) {
            c.rst_out = true;
        }
        if let Some((_, v, _)) = s.ts {
            if c.b_ts_seen.is_none_or(|(w, _)| !ts_before(v, w)) {
                c.b_ts_seen = Some((v, self.clock));
            }
        }
        if !c.aligned {
            // Before alignment nothing can be translated. After take-over such a SYN-ACK goes
            // out as it is: the client answers it with an ACK that names the sequence space it
            // knows, and `incoming` aligns on that.
            return if promoted { Verdict::PASS } else { self.withhold() };
        }
        let end_b = s.seq + s.payload_len as u32 + s.has(F::SYN) as u32 + s.fin() as u32;
        if end_b.gt(c.snd_max) {
            c.snd_max = end_b;
        }
        if s.has(F::ACK) && !s.has(F::RST) {
            if !c.rcv_known || s.ack.gt(c.rcv_nxt) {
                c.rcv_nxt = s.ack;
            }
            let edge = s.ack + ((s.window as u32) << c.ws_b);
            if !c.rcv_known || edge.gt(c.rcv_edge) {
                c.rcv_edge = edge;
            }
            c.rcv_known = true;
        }
        let sp = s.seq + c.delta;
        let n = s.payload_len as u32;
        if n > 0 && !s.has(F::RST) {
            let e = sp + n;
            if sp.le(c.out_end) && e.gt(c.out_end) {
                learn_output(c, sp, &pkt[s.payload_at..s.payload_at + s.payload_len], s.fin(), self.strict);
                // Output that arrived beyond a gap (a segment this engine never saw: its queue
                // overflowed) continues the digest once the gap is filled, instead of waiting for
                // its server to send it all again, which it does only after timeouts.
                while let Some(i) = c.ooo.iter().position(|(a, d, _)| a.le(c.out_end) && (*a + d.len() as u32).gt(c.out_end)) {
                    let (a, d, fin) = c.ooo.swap_remove(i);
                    c.ooo_bytes -= d.len();
                    learn_output(c, a, &d, fin, self.strict);
                }
                let end = c.out_end;
                c.ooo.retain(|(a, d, _)| (*a + d.len() as u32).gt(end));
                c.ooo_bytes = c.ooo.iter().map(|(_, d, _)| d.len()).sum();
            } else if sp.gt(c.out_end) {
                self.counters.output_gap += 1;
                if c.ooo_bytes + n as usize <= MAX_KEPT_BYTES && !c.ooo.iter().any(|(a, _, _)| *a == sp) {
                    c.ooo_bytes += n as usize;
                    c.ooo.push((sp, pkt[s.payload_at..s.payload_at + s.payload_len].to_vec(), s.fin()));
                }
            }
        }
        if s.fin() && sp + n == c.out_end {
            c.fin_out = true;
        }
        if !promoted {
            if n > 0 && c.acked_b.is_some_and(|a| end_b.le(a)) {
                // Its kernel resends what the client's ACK covered: that ACK (clamped and
                // passed, or relayed) never reached it (PAWS, a lost injection). Lowered to
                // where the kernel stands, so that the primary's next report relays it again;
                // else its server waits in retransmission backoff for an ACK the client, which
                // has everything, never sends again.
                c.acked_b = Some(s.seq);
                self.counters.acks_unheard += 1;
            }
            drop_acked_kept(c, &mut self.kept_total);
            if n > 0 || s.fin() {
                keep(c, &mut self.kept_total, &mut self.counters, end_b, pkt.to_vec());
            }
            return self.withhold();
        }
        if c.diverged || c.misaligned {
            // Never a byte of this output: the client has the primary's, which differed (or
            // this backup's numbering of it is wrong). Reset the connection once, at the
            // furthest point the client can have reached (exact, or inside its window, where
            // Linux answers with a challenge ACK that `incoming` resets exactly); never leave
            // the client waiting for ever.
            self.counters.diverged_silenced += 1;
            if !c.reset_sent {
                c.reset_sent = true;
                let at = match c.p_out {
                    Some(p) if p.gt(c.last_ack) => p,
                    _ => c.last_ack,
                };
                if let Some(r) = reset_to_client(&key, s.info.src, at) {
                    self.counters.diverged_reset += 1;
                    self.out.push(r);
                }
            }
            return Verdict::Drop;
        }
        let modified = c.delta != 0 || s.ts.is_some();
        if !translate_out(c, pkt, &s) {
            return Verdict::Drop;
        }
        Verdict::Accept { modified }
    }

    fn withhold(&mut self) -> Verdict {
        if self.promoted {
            return Verdict::PASS;
        }
        self.counters.withheld += 1;
        Verdict::Drop
    }

    /// The backup's progress records (ST-TCP 3.6), at most [`rw::MAX_RECORDS`] a message:
    /// every connection (a beat).
    pub fn progress(&mut self, beat: u64) -> Vec<Progress> {
        self.changed.clear();
        self.kept_total = self.conns.values().map(|c| c.kept_bytes).sum();
        self.input_total = self.conns.values().map(|c| c.input_len).sum();
        let keys: Vec<ConnKey> = self.conns.iter().filter(|(_, c)| c.b_isn.is_some() || c.rst_out).map(|(k, _)| *k).collect();
        self.progress_of(beat, keys, true)
    }

    /// The records of the connections a packet touched since the last message (none: no
    /// message), so that strict output commit and the primary's ACK need not wait for the beat
    /// and a busy backup does not send every connection's figures after every packet.
    pub fn progress_changed(&mut self, beat: u64) -> Vec<Progress> {
        let keys: Vec<ConnKey> = self.changed.drain().filter(|k| self.conns.get(k).is_some_and(|c| c.b_isn.is_some() || c.rst_out)).collect();
        if keys.is_empty() {
            return vec![];
        }
        self.progress_of(beat, keys, false)
    }

    /// A beat (`full`) repeats the oldest unverified checkpoints; a message between beats
    /// carries the checkpoints made since the last message.
    fn progress_of(&mut self, beat: u64, mut keys: Vec<ConnKey>, full: bool) -> Vec<Progress> {
        keys.sort_by_key(|k| (k.client_port, k.server_port, k.client));
        let mut recs = vec![];
        for k in &keys {
            let Some(c) = self.conns.get_mut(k) else { continue };
            let mut flags = 0;
            for (on, f) in [(c.rcv_known, rw::flag::RCV_KNOWN), (c.aligned, rw::flag::ALIGNED), (c.fin_out, rw::flag::FIN_OUT), (c.rst_out, rw::flag::RST_OUT), (c.diverged, rw::flag::DIVERGED), (c.b_isn.is_some(), rw::flag::ISN_KNOWN), (c.misaligned, rw::flag::MISALIGNED)] {
                if on {
                    flags |= f;
                }
            }
            let rec = ConnProgress {
                client: k.client,
                client_port: k.client_port,
                server_port: k.server_port,
                rcv_nxt: c.rcv_nxt,
                rcv_edge: c.rcv_edge,
                out_end: c.out_end,
                out_hash: c.out_hash,
                last_ack: c.last_ack,
                isn: c.b_isn.unwrap_or(Seq(0)),
                flags,
            };
            // Earlier output checkpoints the primary has not verified yet, oldest first: a
            // lost message must not leave the primary without a digest at an offset it reached
            // (it may be unable to go further while its output is held).
            let cp_flags = flags & !(rw::flag::FIN_OUT | rw::flag::RST_OUT);
            let before_end = |e: &Seq| e.lt(c.out_end);
            if full {
                for &(end, hash) in c.checkpoints.iter().filter(|(e, _)| before_end(e)).take(BEAT_CHECKPOINTS) {
                    recs.push(ConnProgress { out_end: end, out_hash: hash, flags: cp_flags, ..rec });
                }
            } else {
                let sent = c.cp_sent;
                for &(end, hash) in c.checkpoints.iter().filter(|(e, _)| before_end(e) && sent.is_none_or(|s| e.gt(s))) {
                    recs.push(ConnProgress { out_end: end, out_hash: hash, flags: cp_flags, ..rec });
                }
            }
            c.cp_sent = Some(c.out_end);
            recs.push(rec);
        }
        chunk(Role::Backup, beat, recs)
    }

    /// The primary's own report (already authenticated). Connections it found diverged are
    /// silenced for good. Where the client acknowledged more than the backup's server has heard
    /// of (a client ACK lost on its way to the backup: ST-TCP 3.6's LastAckReceived), an ACK as
    /// the client would have sent it is returned, already translated, for the daemon to inject
    /// into the backup's stack. Without it, a backup server waiting for that ACK to open its
    /// window withholds output that strict output commit waits for, while the client waits for
    /// that output: a stall until the lag bound (found by the simulation with loss).
    pub fn primary_report(&mut self, p: &Progress) -> Vec<Vec<u8>> {
        let mut inject = vec![];
        if p.role != Role::Primary {
            return inject;
        }
        if self.p_last_beat.is_none_or(|b| p.beat > b) {
            self.p_last_beat = Some(p.beat);
            self.p_beats += 1;
        }
        for r in &p.records {
            let key = ConnKey::of(r);
            let Some(c) = self.conns.get_mut(&key) else { continue };
            c.p_seen_at = Some(self.clock);
            if r.flags & rw::flag::DIVERGED != 0 {
                c.diverged = true;
            }
            if r.flags & rw::flag::ISN_KNOWN != 0 {
                c.p_isn = Some(r.isn);
                // Δ learned from a client ACK before the primary's ISN was known: a forged ACK
                // (one that guessed the client's sequence number) gave a wrong one. The backup's
                // server has taken the forgery as its handshake: that connection cannot be
                // taken over.
                if let (true, Some(b), false, false) = (c.aligned, c.b_isn, c.misaligned, self.promoted) {
                    if c.delta != r.isn - b {
                        c.misaligned = true;
                        self.counters.misaligned += 1;
                    }
                }
            }
            // The primary's out_end is what it verified: those checkpoints are done.
            while c.checkpoints.front().is_some_and(|(e, _)| e.le(r.out_end)) {
                c.checkpoints.pop_front();
            }
            if r.out_end != Seq(0) && c.p_out.is_none_or(|p| r.out_end.gt(p)) {
                c.p_out = Some(r.out_end);
            }
            if r.flags & rw::flag::RCV_KNOWN != 0 && !self.promoted {
                if r.flags & rw::flag::DIVERGED != 0 {
                    self.input_total -= c.drop_input();
                } else {
                    relay_input(c, key, r.rcv_nxt, self.clock, &mut self.input_total, &mut self.relay, &mut self.counters);
                }
            }
            let (Some(server), true, true) = (c.server, c.aligned, c.client_seen) else { continue };
            // The client's latest ACK as the primary heard it (authenticated, and never beyond
            // what the primary's server sent; not the backup's own `last_ack`, which any packet
            // with the client's address and a valid checksum may have raised): relayed when it
            // acknowledges more than the backup's server was given, also when an earlier one was
            // clamped and that server has sent more since.
            if r.last_ack == Seq(0) {
                continue;
            }
            let latest = r.last_ack;
            let mut ack_b = latest - c.delta;
            if ack_b.gt(c.snd_max) {
                ack_b = c.snd_max;
            }
            if c.acked_b.is_some_and(|a| !ack_b.gt(a)) {
                continue;
            }
            let ts = c.client_ts_max.or(c.client_ts).map(|(v, e)| (v, e.wrapping_sub(c.ts_off)));
            let rep = tcp::Repr { src_port: key.client_port, dst_port: key.server_port, seq: c.rcv_nxt, ack: ack_b, flags: F::ACK, window: c.client_win, timestamp: ts, ..Default::default() };
            if let Ok(pkt) = ip::tcp_packet(key.client, server, &rep, &[]) {
                if latest.gt(c.last_ack) {
                    c.last_ack = latest;
                }
                c.acked_b = Some(ack_b);
                self.counters.acks_relayed += 1;
                inject.push(pkt);
            }
        }
        inject
    }

    /// Client bytes the primary relayed (already authenticated): a segment as the client
    /// would have sent it (its latest ACK, window and timestamps, translated), for the daemon
    /// to inject into the backup's stack; `None` when nothing in it is new to the backup's
    /// server or the connection is unknown.
    pub fn relayed_input(&mut self, key: &ConnKey, seq: Seq, data: &[u8]) -> Option<Vec<u8>> {
        let c = self.conns.get_mut(key)?;
        let (Some(server), true, true, false) = (c.server, c.aligned, c.rcv_known, self.promoted) else { return None };
        if data.is_empty() || !(seq + data.len() as u32).gt(c.rcv_nxt) || seq.gt(c.rcv_edge) {
            return None;
        }
        let ts = c.client_ts_max.or(c.client_ts).map(|(v, e)| (v, e.wrapping_sub(c.ts_off)));
        let ack = c.acked_b.unwrap_or(c.snd_max);
        let rep = tcp::Repr { src_port: key.client_port, dst_port: key.server_port, seq, ack, flags: F::ACK | F::PSH, window: c.client_win, timestamp: ts, ..Default::default() };
        let pkt = ip::tcp_packet(key.client, server, &rep, data).ok()?;
        self.counters.relayed_in += data.len() as u64;
        Some(pkt)
    }

    /// Forgets a connection (the daemon's grace period after it closed).
    pub fn forget(&mut self, key: &ConnKey) {
        if let Some(mut c) = self.conns.remove(key) {
            self.input_total -= c.drop_input();
        }
    }

    /// A copy of a client segment the kernel's fast path passed to the backup's server (it
    /// decided acceptability as [`Backup::incoming`] does): its bytes are copied for the primary
    /// as `incoming` would have. Anything that does not parse, a connection not followed or not
    /// aligned, and bytes outside the window the backup's server announced are ignored.
    pub fn push_input(&mut self, key: &ConnKey, pkt: &[u8]) {
        let Ok(s) = parse(pkt) else { return };
        let of = ConnKey { client: s.info.src, client_port: s.src_port, server_port: s.dst_port };
        if !self.input_on || self.promoted || of != *key {
            return;
        }
        let Some(c) = self.conns.get_mut(key) else { return };
        if !c.aligned || !c.wants_input(&s, self.p_beats) || (c.rcv_known && !acceptable(&s, c.rcv_nxt, c.rcv_edge)) {
            return;
        }
        // The program wrote the TSecr into the backup's clock: back into the primary's.
        let ts = s.ts.map(|t| (t.1, t.2.wrapping_add(c.ts_off)));
        let data = &pkt[s.payload_at..s.payload_at + s.payload_len];
        copy_input(c, &mut self.input_total, &mut self.counters, s.seq, data, ts, self.clock);
    }

    /// Client bytes the primary missed and this backup's server took, for the primary
    /// ([`Primary::backup_input`]): the reverse of ST-TCP 3.6's retransmission, the loss being
    /// toward the primary.
    pub fn take_relay(&mut self) -> Vec<Relay> {
        std::mem::take(&mut self.relay)
    }

    /// Whether client bytes are copied for the primary: off for a backup that can no longer
    /// take over (stale, fenced out: no report will trim the copies), which drops them all.
    pub fn set_input_copies(&mut self, on: bool) {
        if self.input_on == on {
            return;
        }
        self.input_on = on;
        if !on {
            for c in self.conns.values_mut() {
                c.drop_input();
            }
            self.input_total = 0;
            self.relay.clear();
        }
    }

    /// Packets for the clients the engine built (RSTs of diverged connections after take-over).
    pub fn take_transmit(&mut self) -> Vec<Vec<u8>> {
        std::mem::take(&mut self.out)
    }

    /// Connections over on both sides (the server reset it, or both sent their FIN): the
    /// daemon forgets them after a grace period.
    pub fn finished(&self) -> Vec<ConnKey> {
        self.conns.iter().filter(|(_, c)| c.finished()).map(|(k, _)| *k).collect()
    }

    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    /// Whether the engine follows `key` (it is in the table).
    pub fn follows(&self, key: &ConnKey) -> bool {
        self.conns.contains_key(key)
    }

    // -- The kernel's fast path (issue 22 item 4): the hand-off of a connection's fields. --

    /// The fields the fast path keeps, as the engine has them.
    pub fn fast_state(&self, key: &ConnKey) -> Option<BFast> {
        let c = self.conns.get(key)?;
        Some(BFast {
            aligned: c.aligned,
            rcv_known: c.rcv_known,
            client_seen: c.client_seen,
            delta: c.delta,
            ts_off: c.ts_off,
            ws_b: c.ws_b,
            snd_max: c.snd_max,
            rcv_nxt: c.rcv_nxt,
            rcv_edge: c.rcv_edge,
            out_end: c.out_end,
            out_hash: c.out_hash,
            last_ack: c.last_ack,
            acked_b: c.acked_b,
            p_out: c.p_out,
            ts_floor: c.ts_floor,
            client_ts_max: c.client_ts_max,
            client_ts: c.client_ts,
            b_ts_seen: c.b_ts_seen,
            client_win: c.client_win,
            server: c.server,
        })
    }

    /// Takes the fields back from the fast path (after a TAKE or FREEZE, before the engine
    /// decides the packet or message that caused it, whatever that makes of the connection).
    /// False, and nothing changed, for a connection the engine does not follow, after the
    /// take-over (the daemon loads every entry before it), or for fields the fast path cannot
    /// have produced from this connection (not aligned, or another Δ, timestamp offset or
    /// window shift: those are learned from the handshake only).
    pub fn set_fast_state(&mut self, key: &ConnKey, f: &BFast) -> bool {
        if self.promoted {
            return false;
        }
        let Some(c) = self.conns.get_mut(key) else { return false };
        if !c.aligned {
            return false;
        }
        // The alignment and what was learned from the SYN-ACK never move on the fast path.
        if !f.aligned || f.delta != c.delta || f.ts_off != c.ts_off || f.ws_b != c.ws_b {
            return false;
        }
        c.rcv_known = f.rcv_known;
        c.client_seen = f.client_seen;
        c.snd_max = f.snd_max;
        c.rcv_nxt = f.rcv_nxt;
        c.rcv_edge = f.rcv_edge;
        c.out_end = f.out_end;
        c.out_hash = f.out_hash;
        c.last_ack = f.last_ack;
        c.acked_b = f.acked_b;
        c.p_out = f.p_out;
        c.ts_floor = f.ts_floor;
        c.client_ts_max = f.client_ts_max;
        c.client_ts = f.client_ts;
        c.b_ts_seen = f.b_ts_seen;
        c.client_win = f.client_win;
        c.server = f.server;
        true
    }

    /// Whether the fast path may carry `key`: aligned, not promoted, nothing waiting beyond a
    /// gap in its output (the programs cannot fill it). A diverged or misaligned connection, or
    /// one closing, is decided the same way by the programs before the take-over (withheld,
    /// translated; FIN and RST are the engine's anyway), and the take-over loads every entry.
    pub fn fast_eligible(&self, key: &ConnKey) -> bool {
        !self.promoted && self.conns.get(key).is_some_and(|c| c.aligned && c.ooo.is_empty())
    }

    /// A checkpoint the fast path made (`learn_output`'s: the output end, primary's space, and
    /// the digest there), in the order it made them; an end not beyond the last one is ignored.
    pub fn push_checkpoint(&mut self, key: &ConnKey, end: Seq, hash: u64) {
        let Some(c) = self.conns.get_mut(key) else { return };
        if c.checkpoints.back().is_some_and(|&(e, _)| !end.gt(e)) {
            return;
        }
        if c.checkpoints.len() < MAX_CHECKPOINTS {
            c.checkpoints.push_back((end, hash));
        }
        self.changed.insert(*key);
    }

    /// A withheld segment the fast path consumed, kept for the take-over within the same bounds
    /// as the engine's own (`kept_dropped` beyond them); copies the client's ACK already
    /// covers are let go first, as `outgoing` does.
    pub fn push_kept(&mut self, key: &ConnKey, end_b: Seq, pkt: Vec<u8>) {
        if self.promoted {
            return;
        }
        let Some(c) = self.conns.get_mut(key) else { return };
        drop_acked_kept(c, &mut self.kept_total);
        keep(c, &mut self.kept_total, &mut self.counters, end_b, pkt);
    }

    /// The fast path moved the connection's figures: the next message reports it.
    pub fn mark_changed(&mut self, key: &ConnKey) {
        if self.conns.contains_key(key) {
            self.changed.insert(*key);
        }
    }

    /// The connection's checkpoints, kept copies and gap, for inspection.
    pub fn side(&self, key: &ConnKey) -> Option<BSide> {
        let c = self.conns.get(key)?;
        Some(BSide { checkpoints: c.checkpoints.iter().copied().collect(), kept: c.kept.iter().map(|(e, p)| (*e, p.len())).collect(), ooo_empty: c.ooo.is_empty(), input_end: c.input_end, input_len: c.input_len })
    }
}

/// Lets go of the kept copies the client's ACK (as given to the backup's server) covers.
fn drop_acked_kept(c: &mut BConn, kept_total: &mut usize) {
    let Some(a) = c.acked_b else { return };
    while c.kept.front().is_some_and(|(e, _)| e.le(a)) {
        if let Some((_, p)) = c.kept.pop_front() {
            c.kept_bytes -= p.len();
            *kept_total = kept_total.saturating_sub(p.len());
        }
    }
}

/// Keeps a copy of a withheld segment (its end in the backup's space) for the take-over, within
/// the bounds: beyond them (per connection, host-wide) the newest segments are left to the
/// backup's own retransmission timer: the client needs the oldest first, a resend with a hole
/// at its front would only wait.
fn keep(c: &mut BConn, kept_total: &mut usize, counters: &mut BackupCounters, end_b: Seq, pkt: Vec<u8>) {
    if c.kept_bytes + pkt.len() > MAX_KEPT_BYTES || *kept_total + pkt.len() > MAX_KEPT_TOTAL {
        counters.kept_dropped += 1;
    } else {
        c.kept_bytes += pkt.len();
        *kept_total += pkt.len();
        c.kept.push_back((end_b, pkt));
    }
}

/// Continues a backup's output digest with `data` (at `at`, primary's space, reaching past the
/// digest's end), records the checkpoint, and a FIN at its end. Without strict output commit
/// (`digest` false) only the end moves: the primary releases output without the backup's
/// digest, so none is computed (`out_hash` stays, no checkpoints; `hdr::RELAXED` tells the
/// primary, which refuses a pair whose settings differ).
fn learn_output(c: &mut BConn, at: Seq, data: &[u8], fin: bool, digest: bool) {
    let e = at + data.len() as u32;
    if !(at.le(c.out_end) && e.gt(c.out_end)) {
        return;
    }
    if !digest {
        c.out_end = e;
        c.fin_out |= fin;
        return;
    }
    let skip = (c.out_end - at) as usize;
    // A checkpoint at every multiple of CHECKPOINT_STEP (primary's sequence space) the bytes
    // cross, and at their end: the primary can release its held segments only up to a
    // checkpoint, and a segment of the backup's may be a 64 KiB super-packet (GSO), whose end
    // alone left the primary short of the next one with its window full of held bytes.
    let mut pos = c.out_end;
    let mut rest = &data[skip..];
    while !rest.is_empty() {
        let to_step = CHECKPOINT_STEP - (pos.0 % CHECKPOINT_STEP);
        let n = (to_step as usize).min(rest.len());
        c.out_hash = hash_continue(c.out_hash, &rest[..n]);
        pos = pos + n as u32;
        rest = &rest[n..];
        // Beyond the bound the newest are left out: every message ends with the current end
        // anyway, and the primary needs the oldest first.
        if (rest.is_empty() || pos.0 % CHECKPOINT_STEP == 0) && c.checkpoints.len() < MAX_CHECKPOINTS {
            c.checkpoints.push_back((pos, c.out_hash));
        }
    }
    c.out_end = e;
    if fin {
        c.fin_out = true;
    }
}

/// Whether the server's segment `s` acknowledges the client's FIN (its kernel had taken the
/// client's close): the evidence of [`Why::PrimaryClosedEarly`].
fn acks_client_fin(c: &PConn, s: &Seg) -> bool {
    c.client_fin_at.is_some_and(|f| s.has(F::ACK) && s.ack.gt(f))
}

/// RFC 1122's default MSS: the least a kept copy is cut to at the take-over.
const DEFAULT_MSS: u16 = 536;

/// A held packet as it goes out now: a GSO super-packet whose verified part partial releases
/// sent already only from there (sent whole, up to 64 KiB went twice). A wire-sized segment
/// goes whole as before (the client takes the duplicate part as a retransmission; the
/// simulation's smoltcp clients were tuned on that shape), and so does a FIN.
fn unsent_part(c: &PConn, pkt: Vec<u8>, end: Seq, fin: bool) -> Vec<u8> {
    let Ok(s) = parse(&pkt) else { return pkt };
    if !fin && s.payload_len > wire_payload(&s, c.client_mss, c.p_mss) && s.seq.lt(c.snd_c) && c.snd_c.lt(end) {
        if let Some(p) = trimmed(&pkt, &s, c.snd_c, end) {
            return p;
        }
    }
    pkt
}

/// The most payload one wire segment like `s` carries ([`cut`]).
fn wire_payload(s: &Seg, client_mss: Option<u16>, server_mss: Option<u16>) -> usize {
    let opts = s.payload_at - s.info.l4_offset - 20;
    let mss = client_mss.unwrap_or(DEFAULT_MSS).min(server_mss.unwrap_or(u16::MAX)).max(DEFAULT_MSS) as usize;
    mss.saturating_sub(opts).max(1)
}

/// Queues `pkt` for the raw socket, cut as the sending kernel would have cut it if it is a GSO
/// super-packet (both daemons' queues take them whole; a raw socket cannot send one): at most
/// the smaller of the two MSS options of the handshake of payload (RFC 1122's 536 at the least,
/// so that a forged SYN's tiny MSS cannot make thousands), less the segment's options. A packet
/// that cannot be cut goes as it is (the kernel refuses it; its server sends the bytes again).
fn cut(out: &mut Vec<Vec<u8>>, pkt: Vec<u8>, client_mss: Option<u16>, server_mss: Option<u16>) {
    let Ok(s) = parse(&pkt) else {
        out.push(pkt);
        return;
    };
    let max = wire_payload(&s, client_mss, server_mss);
    if s.payload_len <= max {
        out.push(pkt);
        return;
    }
    match ip::split_tcp(&pkt, max) {
        Ok(parts) => out.extend(parts),
        Err(_) => out.push(pkt),
    }
}

/// Withheld output a backup keeps per connection for its take-over ([`Backup::take_over`]),
/// and for all connections together.
pub const MAX_KEPT_BYTES: usize = 8 << 20;
pub const MAX_KEPT_TOTAL: usize = 256 << 20;

/// Copies the client's bytes `data` at `seq` (a segment the backup's server may take, with its
/// timestamps `ts`) for the primary: only the bytes that continue the copy (or, with none, start
/// at the primary's figure or at this segment), never below what the primary has; bytes that
/// overlap a copy must equal it, else every copy of that connection goes and none is kept until
/// the primary has them (`input_conflicts`: one of the two was a forgery); within the bounds,
/// else counted and left out (a hole the client's own retransmission fills).
#[allow(clippy::too_many_arguments)]
fn copy_input(c: &mut BConn, total: &mut usize, counters: &mut BackupCounters, seq: Seq, data: &[u8], ts: Option<(u32, u32)>, now: u64) {
    let end = seq + data.len() as u32;
    let p = c.p_rcv.map(|(p, _)| p);
    if let (Some(h), Some(p)) = (c.input_hold, p) {
        if !h.gt(p) {
            c.input_hold = None;
        }
    }
    if c.input_hold.is_some() {
        return;
    }
    // The overlap with what is copied already: the same bytes, or a conflict.
    if let Some(first) = c.input.front().map(|e| e.at) {
        let lo = seq.max(first);
        let hi = if c.input_end.is_some_and(|e| e.lt(end)) { c.input_end.unwrap_or(end) } else { end };
        if hi.gt(lo) {
            let mut same = true;
            for e in c.input.iter() {
                let (a, b) = (lo.max(e.at), if hi.lt(e.end()) { hi } else { e.end() });
                if b.gt(a) && e.data[(a - e.at) as usize..(b - e.at) as usize] != data[(a - seq) as usize..(b - seq) as usize] {
                    same = false;
                    break;
                }
            }
            if !same {
                counters.input_conflicts += 1;
                c.input_hold = Some(c.input_end.map_or(end, |e| e.max(end)));
                *total -= c.drop_input();
                return;
            }
        }
    }
    let at = c.input_end.unwrap_or(seq);
    let at = p.map_or(at, |p| p.max(at));
    if seq.gt(at) || !end.gt(at) {
        return;
    }
    let copy = InputCopy { at, data: data[(at - seq) as usize..].to_vec(), came: now, ts };
    if c.input_len + copy.cost() > MAX_INPUT_COPY || *total + copy.cost() > MAX_INPUT_COPY_TOTAL {
        counters.input_copy_full += copy.data.len() as u64;
        return;
    }
    c.input_len += copy.cost();
    *total += copy.cost();
    c.input_end = Some(end);
    c.input.push_back(copy);
}

/// The primary's report says what reached its host in order is `p`: the copies below go; bytes
/// above it that the backup's own server acknowledged (so its kernel took them: never bytes of a
/// segment it discarded) and that the backup has had for [`INPUT_RELAY_AFTER_MS`], while `p`
/// stood still as long, are relayed, each with its own segment's timestamps ([`RELAY_BUDGET`] at
/// a time; what the primary does not confirm goes again after a gap that doubles, counted from
/// the oldest unconfirmed relay). A primary merely behind (its queue on a loaded host) moves `p`
/// and gets nothing: duplicates would only load it further.
fn relay_input(c: &mut BConn, key: ConnKey, p: Seq, now: u64, total: &mut usize, out: &mut Vec<Relay>, counters: &mut BackupCounters) {
    match c.p_rcv {
        Some((q, _)) if !p.gt(q) => {}
        _ => c.p_rcv = Some((p, now)),
    }
    let Some((p, since)) = c.p_rcv else { return };
    while let Some(e) = c.input.front_mut() {
        if !e.end().gt(p) {
            c.input_len -= e.cost();
            *total -= e.cost();
            c.input.pop_front();
        } else {
            if p.gt(e.at) {
                let n = (p - e.at) as usize;
                e.data.drain(..n);
                c.input_len -= n;
                *total -= n;
                e.at = p;
            }
            break;
        }
    }
    if c.input.is_empty() && c.input_end.is_some_and(|e| !e.gt(p)) {
        c.input_end = None;
    }
    if c.relay_end.is_some_and(|e| !e.gt(p)) {
        c.relay_end = None;
        c.relay_gap = 0;
    }
    if now < since + INPUT_RELAY_AFTER_MS || !c.rcv_known {
        return;
    }
    // The end of the bytes that came at least that long ago (those the primary missed), no
    // further than the backup's server acknowledged.
    let due = c.input.iter().take_while(|e| now >= e.came + INPUT_RELAY_AFTER_MS).last().map(InputCopy::end);
    let Some(mut due) = due.filter(|d| d.gt(p)) else { return };
    if due.gt(c.rcv_nxt) {
        due = c.rcv_nxt;
    }
    let again = c.relay_end.is_some() && now >= c.relay_at + c.relay_gap;
    let from = match c.relay_end {
        Some(e) if !again => e,
        _ => p,
    };
    if !due.gt(from) {
        return;
    }
    let window = c.client_win;
    let mut at = from;
    let mut budget = RELAY_BUDGET;
    for e in c.input.iter() {
        if !e.end().gt(at) {
            continue;
        }
        if e.at.gt(at) || budget == 0 || !at.lt(due) {
            break;
        }
        let mut i = (at - e.at) as usize;
        let stop = ((due - e.at) as usize).min(e.data.len());
        while i < stop && budget > 0 {
            let n = (stop - i).min(rw::MAX_INPUT).min(budget);
            out.push((key, e.at + i as u32, e.data[i..i + n].to_vec(), Some(RelayFrom { ts: e.ts, window })));
            counters.relayed_to_primary += n as u64;
            budget -= n;
            i += n;
        }
        at = e.at + i as u32;
    }
    if at.gt(from) {
        // The retry timer runs from the oldest relay the primary has not confirmed: new bytes
        // sent meanwhile do not push a lost first relay's resend back.
        if c.relay_end.is_none() || again {
            c.relay_gap = if again { (c.relay_gap * 2).min(MAX_RELAY_GAP_MS) } else { INPUT_RELAY_AFTER_MS * 2 };
            c.relay_at = now;
        }
        c.relay_end = Some(at);
    }
}

/// A backup server's segment into the primary's space (SEQ + delta, TSval + offset); false when
/// the packet cannot be written.
fn translate_out(c: &mut BConn, pkt: &mut [u8], s: &Seg) -> bool {
    let Ok(mut t) = tcp_mut(pkt, s) else { return false };
    if c.delta != 0 {
        t.rewrite_seq(s.seq + c.delta);
    }
    if let Some((at, v, _)) = s.ts {
        let mut out = v.wrapping_add(c.ts_off);
        match c.ts_floor {
            Some(f) if ts_before(out, f) => out = f,
            _ => c.ts_floor = Some(out),
        }
        if out != v {
            t.rewrite_u32_at(at + 2, out);
        }
    }
    true
}

/// `a` is older than `b` in timestamp space (RFC 7323's serial comparison).
fn ts_before(a: u32, b: u32) -> bool {
    (b.wrapping_sub(a) as i32) > 0
}

/// A RST from the service address `server` to the client of `key` at `seq` (primary's space).
fn reset_to_client(key: &ConnKey, server: IpAddr, seq: Seq) -> Option<Vec<u8>> {
    let rep = tcp::Repr { src_port: key.server_port, dst_port: key.client_port, seq, flags: F::RST, ..Default::default() };
    ip::tcp_packet(server, key.client, &rep, &[]).ok()
}

fn chunk(role: Role, beat: u64, recs: Vec<ConnProgress>) -> Vec<Progress> {
    if recs.is_empty() {
        return vec![Progress { role, beat, flags: 0, records: vec![] }];
    }
    recs.chunks(rw::MAX_RECORDS).map(|c| Progress { role, beat, flags: 0, records: c.to_vec() }).collect()
}

// ---------------------------------------------------------------------------------------------
// The primary (Koch 3.2, 3.4, 6; ST-TCP 3.7)
// ---------------------------------------------------------------------------------------------

/// The primary's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// Koch's strict output commit: send the client only bytes the backup also produced.
    pub strict: bool,
    /// ST-TCP's AppMaxLagBytes: with strict output commit, a backup whose output is behind the
    /// primary's by more than this has failed on that connection (it runs unprotected). Input
    /// lag, and output lag without strict mode, are judged by [`Config::max_lag_ms`] alone (the
    /// client's window bounds the one; the other costs nothing while the backup catches up).
    pub max_lag_bytes: u32,
    /// ST-TCP's AppMaxLagTime: a byte one side produced (or received) and the other has not,
    /// for longer than this, marks the other as failed.
    pub max_lag_ms: u64,
    /// ST-TCP's MaxDelayFIN: how long a FIN (or RST) of the primary alone is held (a FIN: from
    /// the client's ACK of every byte before it; a FIN the client never gets that far is held).
    pub max_delay_fin_ms: u64,
    /// Output held per connection before the backup counts as lagging.
    pub max_held_bytes: usize,
    /// Output held for all connections together (bytes of held packets, as
    /// [`Primary::held_bytes`] counts them): the connection whose output would go beyond it
    /// runs unprotected ([`Why::HeldTotal`]), its held output released as its server built it.
    pub max_held_total: usize,
    /// When the backup has missed client bytes the primary has (its ACK stays behind) for this
    /// long, three duplicate ACKs at the backup's ACK are injected, so the client resends at
    /// once (fast retransmit) instead of after its retransmission timeout; again after twice as
    /// long, and so on. 0: never.
    pub nudge_after_ms: u64,
    /// Connections followed at most; beyond, a new one runs unprotected (counted).
    pub max_conns: usize,
    /// A hung server (issue 20: stopped, deadlocked): one that has read none of the input its
    /// sockets hold for this long ([`ReadWatch`], [`Primary::server_reading`]) while the other
    /// host's server went on, for this long too, is the failed one at once, without waiting
    /// for [`Config::max_lag_ms`]: a hung primary yields, a hung backup is stale. Both hung (a
    /// long command of a deterministic server runs on both) is no failure. 0: only the lag
    /// bound.
    pub max_hang_ms: u64,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            strict: true,
            max_lag_bytes: 4 << 20,
            max_lag_ms: 5_000,
            max_delay_fin_ms: 5_000,
            max_held_bytes: 4 << 20,
            max_held_total: 256 << 20,
            nudge_after_ms: 40,
            max_conns: DEFAULT_MAX_CONNS,
            max_hang_ms: DEFAULT_MAX_HANG_MS,
        }
    }
}

/// [`Config::max_hang_ms`] by default: with the daemon's check every 20 ms, the backup takes
/// over a stopped primary about 200 ms after its server stopped reading.
pub const DEFAULT_MAX_HANG_MS: u64 = 150;

/// Why a connection (or the whole primary) runs unprotected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// The detector declared the backup dead ([`Primary::backup_failed`]).
    BackupFailed,
    /// The backup fell behind by more than the bounds (Table 3.3 row 2, backup).
    BackupLagging,
    /// The backup's server closed (FIN) where the primary's has more output (row 3, backup).
    BackupFinAlone,
    /// The same after the client closed with every byte the primary sent and with the backup's
    /// server holding all the input the primary's acknowledged: it dropped output it had not
    /// written when it read the client's EOF. That connection only; the backup is not stale.
    BackupClosedEarly,
    /// The primary's server closed with less output than the backup's after the client closed:
    /// it dropped replies it had not written when it read the client's EOF. A close race, not a
    /// failure: that connection only, nothing counted as `primary_failed`.
    PrimaryClosedEarly,
    /// The backup's server reset the connection (row 3, backup).
    BackupRst,
    /// The primary's FIN waited MaxDelayFIN for the backup's and went out alone.
    FinTimeout,
    /// Strict output commit found different bytes at the same offset.
    Diverged,
    /// The host-wide cap on held output ([`Config::max_held_total`]) would have been passed.
    HeldTotal,
    /// The backup aligned on a forged client ACK (its Δ disagrees with the primary's ISN): its
    /// server's connection is not the client's.
    BackupMisaligned,
    /// The primary's server alone failed on this connection (closed or reset it where the
    /// backup's went on, or stalled where the backup's answered) while the host shows no sign of
    /// sickness: one connection's failure (a close race, an idle timeout meeting a request) is
    /// that connection's, the client sees what the primary's server did (issue 20 item 9).
    PrimaryFailed,
    /// The backup can no longer take over ([`Primary::backup_stale`]): every connection runs
    /// unprotected.
    BackupStale,
    /// The backup's daemon restarted: its engine lost every connection's state.
    BackupRestarted,
    /// The backup's server is hung (it read none of its input for [`Config::max_hang_ms`])
    /// while the primary's answered: the backup is stale.
    BackupHung,
}

/// Something the primary's daemon must act on or report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Notice {
    /// The connection runs unprotected from now on.
    Unprotected { key: ConnKey, why: Why },
    /// The primary's server failed and the host shows it (Table 3.3 rows 2-3, primary): it
    /// stalled on a connection while producing nothing on any for the lag bound, or its
    /// listening socket is gone ([`Primary::server_listening`]; `key` is then `None`). The
    /// daemon must stop the primary (stop beating, take the address down) so that the backup's
    /// detector fences it and takes over.
    YieldToBackup { key: Option<ConnKey> },
    /// The backup missed input the primary's server consumed, or its server failed on a
    /// connection: its state is no longer the primary's and it must never take over
    /// ([`Primary::backup_stale`]). Every connection runs unprotected from now on.
    BackupStale { why: Why },
}

/// What the primary's engine counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PrimaryCounters {
    /// Output packets held for the backup, and released.
    pub held: u64,
    pub released: u64,
    /// Retransmissions of bytes held already (a copy is kept): dropped.
    pub retrans_dropped: u64,
    /// Fresh ACKs injected when the backup caught up.
    pub fresh_acks: u64,
    /// ACK fields lowered to the backup's.
    pub acks_lowered: u64,
    /// Divergences found (strict output commit).
    pub diverged: u64,
    /// RSTs of the primary's server dropped while the backup had not reset.
    pub rst_held: u64,
    /// Connections the engine never saw open (passed unprotected).
    pub unknown_conns: u64,
    pub malformed: u64,
    pub stale_progress: u64,
    /// Triples of duplicate ACKs injected for client bytes the backup missed.
    pub nudges: u64,
    /// New connections not followed because the table was full of established connections
    /// (they run unprotected).
    pub table_full: u64,
    /// Half-open entries (no client handshake ACK yet: a SYN flood's) evicted, oldest first,
    /// to make room for a new connection in a full table.
    pub half_open_evicted: u64,
    /// Connections made unprotected because the host-wide cap on held output was reached.
    pub held_total_exceeded: u64,
    /// Connections the backup reported aligned on a forged ACK (run unprotected).
    pub backup_misaligned: u64,
    /// Output segments dropped because the connection already held [`Config::max_held_bytes`]
    /// (its server sends them again once the held output is verified and acknowledged).
    pub held_cap_dropped: u64,
    /// Verified bytes sent ahead of the rest of their held segment (the backup's checkpoint
    /// fell inside it), and retransmissions trimmed to their verified part.
    pub partial_released: u64,
    /// Released segments whose TSval was raised to the newest sent (PAWS).
    pub ts_raised: u64,
    /// Segments of its server's output seen beyond a gap (kept aside until the gap fills).
    pub output_gap: u64,
    /// Triples of duplicate ACKs injected into the primary's own server for output it sent
    /// that this engine never saw.
    pub self_nudges: u64,
    /// Client bytes sent to the backup because it missed them.
    pub relayed_bytes: u64,
    /// Connections on which the primary's server alone failed ([`Why::PrimaryFailed`] or a
    /// yield).
    pub primary_failed: u64,
    /// Half-open entries (no handshake within [`HALF_OPEN_TTL_MS`]) forgotten.
    pub half_open_expired: u64,
    /// Client RSTs that ended a connection.
    pub client_resets: u64,
    /// Yields because this host's server was hung while the backup's answered.
    pub hung_yields: u64,
    /// Client ACKs the backup heard and this host did not, handed to its server.
    pub acks_from_backup: u64,
    /// Connections the backup's server reset after both servers had closed them with a FIN
    /// and the backup had all the input (no failure).
    pub backup_rst_after_close: u64,
    /// Client segments whose bytes differed from a copy already kept for the same sequence
    /// numbers (a forgery that guessed the client's sequence number): the copies of that range
    /// are dropped, never relayed; the backup waits for the client's own retransmission.
    pub input_conflicts: u64,
    /// Client bytes the backup relayed (this host missed them) handed to this host's server,
    /// and relays that brought nothing new.
    pub backup_input: u64,
    pub backup_input_redundant: u64,
}

/// Client bytes relayed to the backup at a time (then again once it confirmed them).
pub const RELAY_BUDGET: usize = 256 << 10;

/// The longest an unconfirmed relay waits before it is sent again.
pub const MAX_RELAY_GAP_MS: u64 = 1_000;

/// Ranges of kept client bytes a connection may hold: a client that leaves holes (1-byte
/// segments every other offset) must not cost memory and time per byte.
pub const MAX_INPUT_RANGES: usize = 4096;

/// A kept range grows in place up to this size (a stream in order is a few ranges, not one
/// per segment); beyond, a new one starts (ranges are freed whole once the backup has them).
const INPUT_RANGE_BYTES: usize = 64 << 10;

/// The smallest extent covering `a` (if any) and `b` (sequence numbers within a window).
fn span(a: Option<(Seq, Seq)>, b: (Seq, Seq)) -> (Seq, Seq) {
    match a {
        Some((x, y)) => (if b.0.lt(x) { b.0 } else { x }, if b.1.gt(y) { b.1 } else { y }),
        None => b,
    }
}

/// The index of the first kept range that ends beyond `at` (ranges are disjoint, in order).
fn first_ending_after(input: &VecDeque<(Seq, Vec<u8>)>, at: Seq) -> usize {
    input.partition_point(|(a, d)| !(*a + d.len() as u32).gt(at))
}

/// Keeps a copy of the client's bytes `data` at `seq` in `input` (disjoint ranges in sequence
/// order, `len` bytes in all): only what lies at or beyond `from` (what the backup confirmed
/// and the primary's kernel had not taken yet when the segment came: bytes below it were
/// kept when they came, and a later copy of them proves nothing), outside `poison`, not kept
/// yet, within `cap` bytes and [`MAX_INPUT_RANGES`] ranges (higher ranges are dropped to make
/// room for lower bytes). Returns the extent of the copies
/// the segment contradicted (bytes that differ for the same sequence numbers), which are
/// dropped: the caller never keeps that extent again until the backup has it, so that only
/// bytes every copy agreed on are relayed.
fn keep_input(input: &mut VecDeque<(Seq, Vec<u8>)>, len: &mut usize, from: Seq, poison: Option<(Seq, Seq)>, seq: Seq, data: &[u8], cap: usize) -> Option<(Seq, Seq)> {
    let end = seq + data.len() as u32;
    if !end.gt(from) {
        return None;
    }
    let (mut at, mut rest) = if seq.lt(from) { (from, &data[(from - seq) as usize..]) } else { (seq, data) };
    let mut conflict: Option<(Seq, Seq)> = None;
    let mut i = first_ending_after(input, at);
    while !rest.is_empty() {
        if let Some((_, pe)) = poison.filter(|(pa, pe)| !at.lt(*pa) && at.lt(*pe)) {
            let n = ((pe - at) as usize).min(rest.len());
            at = at + n as u32;
            rest = &rest[n..];
            i = first_ending_after(input, at);
            continue;
        }
        if i < input.len() && !input[i].0.gt(at) {
            // Overlapping range i: the same bytes, or a contradiction.
            let (a, e) = (input[i].0, input[i].0 + input[i].1.len() as u32);
            let off = (at - a) as usize;
            let n = (input[i].1.len() - off).min(rest.len());
            if input[i].1[off..off + n] != rest[..n] {
                conflict = Some(span(conflict, (a, e)));
                let gone = input.remove(i).map_or(0, |(_, d)| d.len());
                *len -= gone;
                // The rest of the removed extent is the caller's poison from now on.
                let skip = ((e - at) as usize).min(rest.len());
                at = at + skip as u32;
                rest = &rest[skip..];
            } else {
                at = at + n as u32;
                rest = &rest[n..];
                i += 1;
            }
            continue;
        }
        // A gap before range i (or after every range): the part of the segment that fills it,
        // up to that range or the poisoned extent.
        let mut n = rest.len();
        if i < input.len() {
            n = n.min((input[i].0 - at) as usize);
        }
        if let Some((pa, _)) = poison.filter(|(pa, _)| pa.gt(at)) {
            n = n.min((pa - at) as usize);
        }
        if let Some((ca, _)) = conflict.filter(|(ca, _)| ca.gt(at)) {
            n = n.min((ca - at) as usize);
        }
        let joins = i > 0 && input[i - 1].0 + input[i - 1].1.len() as u32 == at && input[i - 1].1.len() < INPUT_RANGE_BYTES;
        // At a bound, the highest ranges make room for these lower bytes: the backup takes
        // input in order, so what lies above a hole is worth nothing until the hole is filled
        // (refusing the hole's bytes stopped the relay for good once the bound was reached).
        while input.len() > i && (*len + n > cap || (!joins && input.len() >= MAX_INPUT_RANGES)) {
            if let Some((_, d)) = input.pop_back() {
                *len -= d.len();
            }
        }
        if *len + n <= cap {
            if joins {
                input[i - 1].1.extend_from_slice(&rest[..n]);
                *len += n;
            } else if input.len() < MAX_INPUT_RANGES {
                input.insert(i, (at, rest[..n].to_vec()));
                *len += n;
                i += 1;
            }
        }
        at = at + n as u32;
        rest = &rest[n..];
    }
    conflict
}

/// How long the primary must have heard nothing of a client whose ACK the backup heard before
/// that ACK is handed to the primary's server: the backup's progress comes at least every beat
/// (10 ms), so in a steady stream the primary has heard what it reports by then.
pub const ACK_RELAY_AFTER_MS: u64 = 20;

/// How long a failure of the primary's server on one connection waits for evidence of a sick
/// host (its listening socket gone, which the daemon checks every beat) before it is taken for
/// that connection's own.
pub const PRIMARY_FAIL_GRACE_MS: u64 = 100;

/// Backup checkpoints the primary keeps per connection (the oldest; the newest replaces the
/// last place when full).
const MAX_REPORTS: usize = 4096;

/// The fields of a primary connection the kernel's fast path reads and writes (issue 22 item 4;
/// `drivers::fastpath::replica::PState` is their C layout). Held output, the backup's reports,
/// the relay's copies and the timers stay the engine's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PFast {
    pub answered: bool,
    pub established: bool,
    pub ws_p: u8,
    pub ack_p: Seq,
    pub edge_p: Seq,
    /// The backup's receive figures from its reports: (rcv_known, aligned, rcv_nxt, rcv_edge).
    pub b: Option<(bool, bool, Seq, Seq)>,
    pub rel: Seq,
    pub p_end: Seq,
    pub sent_ack: Option<Seq>,
    pub snd_c: Seq,
    pub ts: Option<(u32, u32)>,
    pub ts_max: Option<u32>,
    pub p_max: Seq,
    pub client_last: Option<(Seq, u16, Option<(u32, u32)>)>,
    pub client_ack: Seq,
    pub snd_p: Seq,
    /// When the client was last heard (the engine's clock, ms: the caller converts).
    pub client_heard_at: u64,
    pub stream_start: Seq,
    pub out_seen: bool,
}

#[derive(Debug, Clone, Copy, Default)]
struct BRec {
    rcv_known: bool,
    rcv_nxt: Seq,
    rcv_edge: Seq,
    aligned: bool,
    out_end: Seq,
    fin: bool,
    rst: bool,
}

#[derive(Debug)]
struct HeldPkt {
    pkt: Vec<u8>,
    /// End of its payload (primary's space).
    end: Seq,
    fin: bool,
}

#[derive(Debug)]
struct PConn {
    /// Its number in the table's insertion order.
    born: u64,
    /// The server's SYN-ACK was seen, and an acceptable client ACK of it since.
    answered: bool,
    established: bool,
    server: IpAddr,
    /// The primary's window shift, from its server's SYN-ACK (0: no scaling).
    ws_p: u8,
    /// The MSS options of the client's SYN and of the primary server's SYN-ACK: held output
    /// the engine sends itself is cut to them ([`cut`]).
    client_mss: Option<u16>,
    p_mss: Option<u16>,
    synack: Option<Vec<u8>>,
    synack_ack: Seq,
    /// The primary server's latest ACK and right window edge.
    ack_p: Seq,
    edge_p: Seq,
    b: Option<BRec>,
    /// Backup output reports not yet verified: (end, digest).
    reports: VecDeque<(Seq, u64)>,
    held: VecDeque<HeldPkt>,
    /// Bytes of the packets in `held`.
    held_len: usize,
    /// Output bytes from `rel` to `p_end` (strict mode), not yet verified.
    held_bytes: VecDeque<u8>,
    rel: Seq,
    rel_hash: u64,
    p_end: Seq,
    /// The primary's server sent a FIN at `p_end`.
    p_fin: bool,
    fin_since: Option<u64>,
    /// Since when the client has acknowledged every byte before the held FIN: MaxDelayFIN
    /// counts from there. Before, the client may still be waiting for the data before the FIN
    /// (lost, retransmitted on the primary's timer), so it has not sent the next request that
    /// would show the backup's output going past the FIN (found by the simulation: a lost last
    /// segment, retransmitted after 1, 2, 4 s, let a lone FIN out after 5 s before the client had
    /// asked for more).
    fin_acked_since: Option<u64>,
    rst_since: Option<u64>,
    sent_ack: Option<Seq>,
    /// Highest sequence number (FIN included) the client has been sent.
    snd_c: Seq,
    ts: Option<(u32, u32)>,
    /// The newest TSval sent to the client: a held segment released after younger ones (a
    /// retransmission of released bytes, a pure ACK) carries it instead of its own older one,
    /// which the client would discard (PAWS, RFC 7323 5: thousands of discarded segments and
    /// stalls of 200-600 ms with large replies, issue 20 item 2).
    ts_max: Option<u32>,
    state: Option<Why>,
    behind: Option<(Seq, Seq, u64)>,
    ahead: Option<(Seq, u64)>,
    /// Where the client's FIN is (its sequence number), from an acceptable segment: the
    /// client closed.
    client_fin_at: Option<Seq>,
    /// The primary's server sent its FIN acknowledging the client's: its kernel had taken the
    /// client's close before the server closed (evidence for `PrimaryClosedEarly`).
    fin_after_client: bool,
    /// The client reset the connection (an acceptable RST): it is over.
    client_rst: bool,
    /// Since when the primary's FIN stands where the backup's server has more output.
    fin_alone_since: Option<u64>,
    /// Output seen beyond a gap (start, end, packet), at most [`Config::max_held_bytes`], and
    /// the furthest its server has sent: its application is not behind the backup's while its
    /// output only waits for a gap to fill.
    ooo: Vec<(Seq, Seq, Vec<u8>)>,
    ooo_len: usize,
    p_max: Seq,
    /// The client's latest acceptable segment: the end of its data, its window field and
    /// timestamps (for duplicate ACKs built in its name toward the primary's own server).
    client_last: Option<(Seq, u16, Option<(u32, u32)>)>,
    /// The backup has output the primary's engine never saw from its own server although the
    /// client acknowledged everything before it (a segment lost before this engine, when its
    /// queue overflowed, at the tail of what its server sent): since (ms), next nudge at, gap.
    tail_since: Option<u64>,
    tail_nudge_at: u64,
    tail_gap: u64,
    /// Copies of the client's bytes the backup has not confirmed yet (start, bytes: disjoint
    /// ranges in order, gaps allowed), their total, and where copies start to matter (what the
    /// backup confirmed, or the stream's start): sent to the backup when it missed them
    /// (ST-TCP 3.6), instead of waiting for the client to resend, which after a loss it does
    /// one segment per retransmission timeout (seconds; issue 20 item 5).
    input: VecDeque<(Seq, Vec<u8>)>,
    input_len: usize,
    input_from: Seq,
    /// The extent of copies a contradicting segment dropped: never kept again until the
    /// backup has it (a forgery's second try must not fill the hole its first one made).
    input_poison: Option<(Seq, Seq)>,
    /// The end of the last bytes relayed to the backup, and when (a relay it does not confirm
    /// is sent again after `relay_gap`).
    relay_end: Option<Seq>,
    relay_at: u64,
    /// How long an unconfirmed relay waits before it goes again (doubling), and the backup's
    /// receive point as last reported with when it last moved.
    relay_gap: u64,
    relay_seen: (Seq, u64),
    /// The client's latest ACK (primary's space), and the primary server's SND.MAX.
    client_ack: Seq,
    snd_p: Seq,
    /// When the primary last heard an acceptable segment of the client (ms, its clock).
    client_heard_at: u64,
    /// The end of the client's bytes, in order, that reached this host or came from the backup
    /// ([`Primary::backup_input`]): a relay below it is a duplicate.
    rcv_seen: Seq,
    /// The backup's server reset it after both servers had closed it (no failure).
    late_rst: bool,
    /// The backup's ACK is behind the primary's since (ms), and the next nudge is due at.
    rcv_behind_since: Option<u64>,
    nudge_at: u64,
    nudge_gap: u64,
    synack_since: Option<u64>,
    /// ISN + 1 of the primary's server.
    stream_start: Seq,
    /// The primary's server has sent output (`p_end` moved past `stream_start`): from then on
    /// no FIN is "before the stream start" (after 2 GiB the serial comparison would say so).
    out_seen: bool,
}

impl PConn {
    /// Holds `h`, counted in `total` (all connections' held bytes).
    fn hold(&mut self, h: HeldPkt, total: &mut usize) {
        self.held_len += h.pkt.len();
        *total += h.pkt.len();
        self.held.push_back(h);
    }

    /// The oldest held packet, no longer counted.
    fn unhold(&mut self, total: &mut usize) -> Option<HeldPkt> {
        let h = self.held.pop_front()?;
        self.held_len -= h.pkt.len();
        *total -= h.pkt.len();
        Some(h)
    }

    /// The end of the client's bytes in order that reached this host (its server acknowledged
    /// them, or its engine saw them, or the backup relayed them).
    fn rcv_in_order(&self) -> Seq {
        self.ack_p.max(self.rcv_seen)
    }
}

impl Entry for PConn {
    fn born(&self) -> u64 {
        self.born
    }
    fn set_born(&mut self, n: u64) {
        self.born = n;
    }
    fn half_open(&self) -> bool {
        !self.established
    }
    fn finished(&self) -> bool {
        self.rst_since.is_some() || self.client_rst || (self.p_fin && self.client_fin_at.is_some())
    }
}

/// The primary's engine: [`Primary::incoming`] sees every client packet before the primary's
/// server, [`Primary::outgoing`] every packet of that server toward clients; the backup's
/// progress messages go to [`Primary::backup_progress`], the clock to [`Primary::tick`].
/// Packets to send to clients (released output, fresh ACKs) are drained with
/// [`Primary::take_transmit`], notices with [`Primary::take_notices`].
#[derive(Debug)]
pub struct Primary {
    cfg: Config,
    conns: HashMap<ConnKey, PConn>,
    births: Births,
    /// Bytes of every connection's held packets.
    held_total: usize,
    unprotected: Option<Why>,
    /// Set once the backup can no longer take over.
    stale: Option<Why>,
    /// A yield was asked for (once).
    yielded: bool,
    /// When the primary's server last produced new output on any connection (ms).
    last_output_ms: u64,
    /// The daemon's latest word on the server's listening socket (`None`: not told yet).
    listening: Option<bool>,
    /// Since when this host's server has read none of its pending input, on which
    /// connections it waits ([`Primary::server_reading`]), and when it was last stalled.
    stalled_since: Option<u64>,
    stalled_on: std::collections::HashSet<ConnKey>,
    stalled_at: Option<u64>,
    /// The backup says its server is hung ([`Primary::backup_hung`]), and when it last said
    /// so: the backup is ahead of a hung primary only from then on.
    backup_hung: bool,
    backup_hung_at: u64,
    /// Connections whose timers run (held output, a held SYN-ACK or FIN or RST, a lag or a
    /// nudge pending): [`Primary::tick`] walks only these.
    timed: std::collections::HashSet<ConnKey>,
    /// The latest time passed in (ms).
    clock: u64,
    /// A connection whose output moved on while it has output kept beyond a gap.
    refill: Option<ConnKey>,
    /// Packets in the client's name for the primary's own server ([`Primary::take_inject`]).
    inject: Vec<Vec<u8>>,
    /// Client bytes for the backup ([`Primary::take_relay`]).
    relay: Vec<(ConnKey, Seq, Vec<u8>)>,
    last_beat: Option<u64>,
    out: Vec<Vec<u8>>,
    notices: Vec<Notice>,
    pub counters: PrimaryCounters,
}

impl Primary {
    pub fn new(cfg: Config) -> Primary {
        Primary {
            cfg,
            conns: HashMap::new(),
            births: Births::default(),
            held_total: 0,
            unprotected: None,
            stale: None,
            yielded: false,
            last_output_ms: 0,
            listening: None,
            stalled_since: None,
            stalled_on: Default::default(),
            stalled_at: None,
            backup_hung: false,
            backup_hung_at: 0,
            timed: Default::default(),
            clock: 0,
            refill: None,
            inject: vec![],
            relay: vec![],
            last_beat: None,
            out: vec![],
            notices: vec![],
            counters: PrimaryCounters::default(),
        }
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// `Some(why)` once the whole primary runs unprotected.
    pub fn unprotected(&self) -> Option<Why> {
        self.unprotected
    }

    /// The protection state of one connection (`None`: protected or unknown).
    pub fn conn_state(&self, key: &ConnKey) -> Option<Why> {
        self.conns.get(key).and_then(|c| c.state)
    }

    // -- The kernel's fast path (issue 22 item 4): the hand-off of a connection's fields. --

    /// The fields the fast path keeps, as the engine has them.
    pub fn fast_state(&self, key: &ConnKey) -> Option<PFast> {
        let c = self.conns.get(key)?;
        Some(PFast {
            answered: c.answered,
            established: c.established,
            ws_p: c.ws_p,
            ack_p: c.ack_p,
            edge_p: c.edge_p,
            b: c.b.map(|b| (b.rcv_known, b.aligned, b.rcv_nxt, b.rcv_edge)),
            rel: c.rel,
            p_end: c.p_end,
            sent_ack: c.sent_ack,
            snd_c: c.snd_c,
            ts: c.ts,
            ts_max: c.ts_max,
            p_max: c.p_max,
            client_last: c.client_last,
            client_ack: c.client_ack,
            snd_p: c.snd_p,
            client_heard_at: c.client_heard_at,
            stream_start: c.stream_start,
            out_seen: c.out_seen,
        })
    }

    /// Takes the fields back from the fast path (after a TAKE or FREEZE, before the engine
    /// decides what caused it). False, and nothing changed, for a connection the engine does
    /// not follow, one not answered (the programs never carry it), or fields with another
    /// window shift or stream start (learned from the handshake only). The backup's figures
    /// come from its reports, which the engine applies itself: only the receive figures a
    /// program may have read are written back, and only onto a record the engine has.
    pub fn set_fast_state(&mut self, key: &ConnKey, f: &PFast) -> bool {
        let Some(c) = self.conns.get_mut(key) else { return false };
        if !c.answered || !f.answered || f.ws_p != c.ws_p || f.stream_start != c.stream_start {
            return false;
        }
        c.established = f.established;
        c.ack_p = f.ack_p;
        c.edge_p = f.edge_p;
        // Not the alignment: the engine learns it from the backup's report together with the
        // output end it aligned at (a map that had it from the same report first would leave
        // that end unset: its FIN then looked like the backup's output beyond the primary's).
        if let (Some(b), Some((rcv_known, _, rcv_nxt, rcv_edge))) = (c.b.as_mut(), f.b) {
            (b.rcv_known, b.rcv_nxt, b.rcv_edge) = (rcv_known, rcv_nxt, rcv_edge);
        }
        c.rel = f.rel;
        c.p_end = f.p_end;
        c.sent_ack = f.sent_ack;
        c.snd_c = f.snd_c;
        c.ts = f.ts;
        c.ts_max = f.ts_max;
        c.p_max = f.p_max;
        c.client_last = f.client_last;
        c.client_ack = f.client_ack;
        c.snd_p = f.snd_p;
        c.client_heard_at = f.client_heard_at;
        c.out_seen = f.out_seen;
        true
    }

    /// Whether the fast path may carry `key`: protected (and the pair with it), its SYN-ACK
    /// out and answered, nothing held, nothing waiting beyond a gap, its server's FIN not seen.
    pub fn fast_eligible(&self, key: &ConnKey) -> bool {
        self.unprotected.is_none() && self.conns.get(key).is_some_and(|c| c.state.is_none() && c.synack.is_none() && c.answered && c.held.is_empty() && c.ooo.is_empty() && !c.p_fin)
    }

    /// Whether `key` can never be carried by the fast path again: the engine no longer
    /// protects it (or any connection), or forgot it.
    pub fn fast_never(&self, key: &ConnKey) -> bool {
        self.unprotected.is_some() || self.conns.get(key).is_none_or(|c| c.state.is_some())
    }

    /// The connections whose timers [`Primary::tick`] looks at (the fast path gives their
    /// fields to the engine first).
    pub fn timed_keys(&self) -> Vec<ConnKey> {
        self.timed.iter().copied().collect()
    }

    /// The connections with packets built or released and not taken yet
    /// ([`Primary::take_transmit`]): the fast path takes them before they are stamped and sent.
    pub fn pending_keys(&self) -> std::collections::HashSet<ConnKey> {
        self.out.iter().filter_map(|p| parse(p).ok().map(|s| ConnKey { client: s.info.dst, client_port: s.dst_port, server_port: s.src_port })).collect()
    }

    /// A packet of its server the engine let out, cut into wire segments of the connection's
    /// handshake MSS as its own releases are (a GSO super-packet the fast path copied to the
    /// daemon; a raw socket cannot send it whole).
    pub fn wire_segments(&self, pkt: Vec<u8>) -> Vec<Vec<u8>> {
        let mut out = vec![];
        let mss = parse(&pkt).ok().and_then(|s| self.conns.get(&ConnKey { client: s.info.dst, client_port: s.dst_port, server_port: s.src_port })).map(|c| (c.client_mss, c.p_mss));
        let (client_mss, p_mss) = mss.unwrap_or((None, None));
        cut(&mut out, pkt, client_mss, p_mss);
        out
    }

    /// When the primary's server last produced new output (the engine's clock, ms).
    pub fn last_output_ms(&self) -> u64 {
        self.last_output_ms
    }

    /// The fast path passed new output of the primary's server at `at_ms` (the engine's clock):
    /// it is not stalled (`last_output_ms`, which the engine learns from the output it sees).
    pub fn output_seen(&mut self, at_ms: u64) {
        self.last_output_ms = self.last_output_ms.max(at_ms);
    }

    /// The packets the engine built or released, in order. Their timestamps are raised to the
    /// newest sent on their connection at this moment: a packet built earlier (a nudge, a fresh
    /// ACK) may leave after a younger segment its server sent meanwhile (PAWS).
    pub fn take_transmit(&mut self) -> Vec<Vec<u8>> {
        let mut out = std::mem::take(&mut self.out);
        for pkt in out.iter_mut() {
            let Ok(s) = parse(pkt) else { continue };
            let key = ConnKey { client: s.info.dst, client_port: s.dst_port, server_port: s.src_port };
            if let Some(c) = self.conns.get_mut(&key) {
                if stamp(c, pkt, &s) {
                    self.counters.ts_raised += 1;
                }
            }
        }
        out
    }

    pub fn take_notices(&mut self) -> Vec<Notice> {
        std::mem::take(&mut self.notices)
    }

    /// Packets for the daemon to inject into the primary's own stack, as if from the client
    /// (duplicate ACKs that make its server resend output this engine never saw).
    pub fn take_inject(&mut self) -> Vec<Vec<u8>> {
        std::mem::take(&mut self.inject)
    }

    /// Client bytes the backup missed, for the daemon to send it (connection, client sequence
    /// number of the first byte, at most [`rw::MAX_INPUT`] bytes each): ST-TCP 3.6's
    /// retransmission from the primary.
    pub fn take_relay(&mut self) -> Vec<(ConnKey, Seq, Vec<u8>)> {
        std::mem::take(&mut self.relay)
    }

    /// Client bytes the backup relayed (its host heard them, this one did not: loss toward the
    /// primary), authenticated: a segment as the client would have sent it (its latest ACK and
    /// window as this host heard them, the newer of the two hosts' timestamps) for the daemon to
    /// inject into this host's server ([`Primary::take_inject`]), only the part this host has
    /// not had and within its server's window; false when nothing is new or the connection is
    /// not protected. The client's own retransmission, a round-trip timeout after the loss,
    /// comes too late: stalls of 300 ms after 200 ms of loss (issue 20).
    pub fn backup_input(&mut self, key: &ConnKey, seq: Seq, data: &[u8], from: RelayFrom) -> bool {
        let Some(c) = self.conns.get_mut(key) else { return false };
        // Its SYN-ACK released (the backup aligned on the client's ACK of it): the client's
        // handshake ACK may have been lost here too, and the relayed segment completes it.
        if self.unprotected.is_some() || c.state.is_some() || c.synack.is_some() || c.sent_ack.is_none() || data.is_empty() {
            return false;
        }
        // The client's latest ACK this host knows (from the SYN-ACK on: the handshake's).
        let ack = c.client_ack;
        let (win, own_ts) = c.client_last.map_or((from.window, None), |(_, w, t)| (w, t));
        let ts = from.ts;
        let have = c.rcv_in_order();
        let mut seq = seq;
        let mut data = data;
        let end = seq + data.len() as u32;
        if !end.gt(have) || seq.gt(c.edge_p) {
            self.counters.backup_input_redundant += 1;
            return false;
        }
        if have.gt(seq) {
            data = &data[(have - seq) as usize..];
            seq = have;
        }
        let end = if end.gt(c.edge_p) { c.edge_p } else { end };
        if !end.gt(seq) {
            self.counters.backup_input_redundant += 1;
            return false;
        }
        let data = &data[..(end - seq) as usize];
        if data.is_empty() {
            self.counters.backup_input_redundant += 1;
            return false;
        }
        // The newer TSval: the backup heard the client later than this host did (a TSval older
        // than the server's TS.Recent would be discarded, PAWS).
        let ts = match (own_ts, ts) {
            (Some(o), Some(b)) if ts_before(o.0, b.0) => Some(b),
            (Some(o), _) => Some(o),
            (None, b) => b,
        };
        let rep = tcp::Repr { src_port: key.client_port, dst_port: key.server_port, seq, ack, flags: F::ACK | F::PSH, window: win, timestamp: ts, ..Default::default() };
        let Ok(pkt) = ip::tcp_packet(key.client, c.server, &rep, data) else { return false };
        if !seq.gt(have) {
            c.rcv_seen = end;
        }
        // What the client sent last, as far as this host knows now (its ACKs the backup
        // relays are built from it).
        if c.client_last.is_none_or(|(e, _, _)| end.gt(e)) {
            c.client_last = Some((end, win, ts));
        }
        self.counters.backup_input += data.len() as u64;
        self.inject.push(pkt);
        true
    }

    /// Output bytes held for the backup, all connections (bytes of the held packets).
    pub fn held_bytes(&self) -> usize {
        self.held_total
    }

    /// Whether the engine follows `key` (it is in the table).
    pub fn follows(&self, key: &ConnKey) -> bool {
        self.conns.contains_key(key)
    }

    /// A client packet toward the primary's server: learned from, never changed.
    pub fn incoming(&mut self, pkt: &[u8]) -> Verdict {
        let Ok(s) = parse(pkt) else {
            self.counters.malformed += 1;
            return Verdict::PASS;
        };
        if s.csum_ok && s.has(F::SYN) && !s.has(F::ACK) && self.unprotected.is_none() {
            let key = ConnKey { client: s.info.src, client_port: s.src_port, server_port: s.dst_port };
            let fresh = PConn {
                born: 0,
                answered: false,
                established: false,
                server: s.info.dst,
                ws_p: 0,
                client_mss: s.mss,
                p_mss: None,
                synack: None,
                synack_ack: s.seq + 1,
                ack_p: s.seq + 1,
                edge_p: s.seq + 1,
                b: None,
                reports: VecDeque::new(),
                held: VecDeque::new(),
                held_len: 0,
                held_bytes: VecDeque::new(),
                rel: Seq(0),
                rel_hash: HASH_INIT,
                p_end: Seq(0),
                p_fin: false,
                fin_since: None,
                fin_acked_since: None,
                rst_since: None,
                sent_ack: None,
                snd_c: Seq(0),
                ts: None,
                ts_max: None,
                state: None,
                behind: None,
                ahead: None,
                client_fin_at: None,
                fin_after_client: false,
                client_rst: false,
                fin_alone_since: None,
                ooo: Vec::new(),
                ooo_len: 0,
                p_max: Seq(0),
                client_last: None,
                tail_since: None,
                tail_nudge_at: 0,
                tail_gap: 0,
                input: VecDeque::new(),
                input_len: 0,
                input_from: s.seq + 1,
                input_poison: None,
                relay_end: None,
                relay_at: 0,
                relay_gap: 0,
                relay_seen: (Seq(0), 0),
                client_ack: Seq(0),
                client_heard_at: 0,
                rcv_seen: s.seq + 1,
                late_rst: false,
                snd_p: Seq(0),
                rcv_behind_since: None,
                nudge_at: 0,
                nudge_gap: 0,
                synack_since: None,
                stream_start: Seq(0),
                out_seen: false,
            };
            // A SYN for a connection the engine already follows is a retransmission (or a
            // forgery): it changes nothing, unless that connection is over (both sides closed,
            // or the server reset it) and the port is reused.
            // A retransmitted SYN (same ISN) is the same connection, however it ended.
            let keep = self.conns.get(&key).map(|c| !c.finished() || c.synack_ack == s.seq + 1);
            if keep != Some(true) {
                match insert(&mut self.conns, &mut self.births, self.cfg.max_conns, key, fresh, &mut self.counters.half_open_evicted, self.clock) {
                    None => self.counters.table_full += 1,
                    Some(gone) => self.held_total -= gone.map_or(0, |g| g.held_len),
                }
            }
        } else if s.csum_ok && s.has(F::ACK) {
            let key = ConnKey { client: s.info.src, client_port: s.src_port, server_port: s.dst_port };
            if let Some(c) = self.conns.get_mut(&key) {
                // Only from a segment the server's TCP would accept: a blind forgery must guess
                // the client's sequence number. A forged FIN would make the connection look
                // finished (forgettable, its held output with it); a forged ACK would start
                // MaxDelayFIN's clock and be relayed to the backup's server as the client's.
                let in_window = acceptable(&s, c.ack_p, c.edge_p);
                if s.fin() && in_window {
                    c.client_fin_at.get_or_insert(s.seq + s.payload_len as u32);
                }
                if s.has(F::RST) && s.seq == c.ack_p && c.answered && !c.client_rst {
                    // The client ended it (RFC 5961: only a RST exactly at RCV.NXT resets; an
                    // in-window one draws a challenge ACK): a reused 4-tuple must not inherit
                    // this entry.
                    c.client_rst = true;
                    self.counters.client_resets += 1;
                }
                // The handshake completed: an acceptable ACK of the SYN-ACK (a blind forgery
                // must guess the server's ISN). From then on the entry is never evicted.
                if c.answered && in_window && s.ack.ge(c.stream_start) && s.ack.le(c.snd_p) {
                    c.established = true;
                }
                // The client's ACK as the primary heard it, for the backup (ST-TCP 3.6's
                // LastAckReceived); only within what the primary's server has sent.
                let limit = c.snd_p;
                if c.synack.is_none() && in_window && s.ack.gt(c.client_ack) && s.ack.le(limit) {
                    c.client_ack = s.ack;
                }
                if in_window {
                    c.client_last = Some((s.seq + s.payload_len as u32 + s.fin() as u32, s.window, s.ts.map(|t| (t.1, t.2))));
                    c.client_heard_at = self.clock;
                    let end = s.seq + s.payload_len as u32;
                    // Never behind what the server acknowledged, never beyond its window (the
                    // kernel trims a segment there).
                    c.rcv_seen = c.rcv_in_order();
                    let end = if end.gt(c.edge_p) { c.edge_p } else { end };
                    if !s.seq.gt(c.rcv_seen) && end.gt(c.rcv_seen) {
                        c.rcv_seen = end;
                    }
                }
                // Only bytes of a segment the server's kernel takes (in its window, its ACK
                // within what the server sent): never a range the kernel refused. Out of order
                // too: a copy that waited for the next byte in order stopped for good at the
                // first segment the primary saw early or could not keep (its bound), and with it
                // every later relay (issue 20: a backup stale after a 200 ms loss).
                let takes = s.ack.le(c.snd_p);
                if in_window && takes && c.state.is_none() && c.answered && s.payload_len > 0 {
                    let data = &pkt[s.payload_at..s.payload_at + s.payload_len];
                    let cap = self.cfg.max_held_bytes;
                    let from = if c.ack_p.gt(c.input_from) { c.ack_p } else { c.input_from };
                    if let Some(hit) = keep_input(&mut c.input, &mut c.input_len, from, c.input_poison, s.seq, data, cap) {
                        self.counters.input_conflicts += 1;
                        c.input_poison = Some(span(c.input_poison, hit));
                    }
                }
            }
        }
        Verdict::PASS
    }

    /// A packet of the primary's server toward a client.
    pub fn outgoing(&mut self, pkt: &mut [u8], now_ms: u64) -> Verdict {
        let v = self.outgoing_one(pkt, now_ms);
        // Output its server sent beyond a gap (a segment this engine never saw: its queue
        // overflowed) was kept aside; once the gap is filled it is taken as if it came now,
        // instead of waiting for its server to send it all again after timeouts.
        while let Some(key) = self.refill.take() {
            let Some(c) = self.conns.get_mut(&key) else { continue };
            let p_end = c.p_end;
            let Some(i) = c.ooo.iter().position(|(a, z, _)| a.le(p_end) && z.gt(p_end)) else {
                c.ooo.retain(|(_, z, _)| z.gt(p_end));
                c.ooo_len = c.ooo.iter().map(|(_, _, p)| p.len()).sum();
                continue;
            };
            let (_, _, mut p) = c.ooo.swap_remove(i);
            c.ooo_len -= p.len();
            if let Verdict::Accept { .. } = self.outgoing_one(&mut p, now_ms) {
                if let Some(c) = self.conns.get(&key) {
                    cut(&mut self.out, p, c.client_mss, c.p_mss);
                }
            }
            self.refill.get_or_insert(key);
        }
        v
    }

    fn outgoing_one(&mut self, pkt: &mut [u8], now_ms: u64) -> Verdict {
        let Ok(s) = parse(pkt) else {
            self.counters.malformed += 1;
            return Verdict::PASS;
        };
        if self.unprotected.is_some() {
            return Verdict::PASS;
        }
        let key = ConnKey { client: s.info.dst, client_port: s.dst_port, server_port: s.src_port };
        let strict = self.cfg.strict;
        let Some(c) = self.conns.get_mut(&key) else {
            self.counters.unknown_conns += 1;
            return Verdict::PASS;
        };
        self.clock = self.clock.max(now_ms);
        if c.state.is_some() {
            // Unprotected: its output goes out as its server built it, but its ACK still waits
            // for the backup, which may take over (with the others) as long as it is not stale:
            // it must miss none of the input the primary's server consumes.
            if s.payload_len > 0 && (s.seq + s.payload_len as u32).gt(c.p_end) {
                // New output of this server, on any connection: it is not stalled.
                c.p_end = s.seq + s.payload_len as u32;
                self.last_output_ms = now_ms;
            }
            // Where its stream stands as the client saw it (all of it passes), for the fresh
            // ACK that follows the backup (Koch 3.4): past the server's FIN, with its latest
            // timestamp.
            if !s.has(F::RST) && !s.has(F::SYN) {
                let e_all = s.seq + s.payload_len as u32 + s.fin() as u32;
                if e_all.gt(c.snd_c) {
                    c.snd_c = e_all;
                }
                if let Some((_, v, e)) = s.ts {
                    c.ts = Some((v, e));
                }
            }
            if s.has(F::ACK) && !s.has(F::RST) && !s.has(F::SYN) {
                if s.ack.gt(c.ack_p) {
                    c.ack_p = s.ack;
                }
                let edge = s.ack + ((s.window as u32) << c.ws_p);
                if edge.gt(c.edge_p) {
                    c.edge_p = edge;
                }
                let m = gate(c, pkt, &s, &mut self.counters);
                if c.behind.is_none() && c.b.is_some_and(|b| b.rcv_known && c.ack_p.gt(b.rcv_nxt)) {
                    self.timed.insert(key);
                }
                return Verdict::Accept { modified: m };
            }
            return Verdict::PASS;
        }
        if s.has(F::SYN) && s.has(F::ACK) {
            // Koch 7.1: the SYN-ACK goes out once the backup's server answered the SYN too.
            // Window scaling is in effect only if the SYN-ACK carries the option (RFC 7323
            // 2.2: only in answer to a SYN that did): the SYN the server answered, not whichever
            // SYN the engine saw first, which may be forged.
            c.answered = true;
            c.ws_p = s.wscale.unwrap_or(0);
            c.p_mss = s.mss;
            c.rel = s.seq + 1;
            c.stream_start = s.seq + 1;
            c.p_end = s.seq + 1;
            c.p_max = s.seq + 1;
            c.snd_c = s.seq + 1;
            c.ack_p = s.ack;
            c.edge_p = s.ack + s.window as u32;
            c.synack_ack = s.ack;
            c.input_from = s.ack;
            c.snd_p = s.seq + 1;
            c.client_ack = s.seq + 1;
            c.ts = s.ts.map(|t| (t.1, t.2));
            if c.b.is_some_and(|b| b.rcv_known && b.rcv_nxt.ge(s.ack)) {
                c.sent_ack = Some(s.ack);
                return Verdict::PASS;
            }
            c.synack = Some(pkt.to_vec());
            c.synack_since.get_or_insert(now_ms);
            self.counters.held += 1;
            self.timed.insert(key);
            return Verdict::Held;
        }
        if s.has(F::ACK) && !s.has(F::RST) {
            // The server sends anything but its SYN-ACK only on an established connection (a
            // handshake ACK the engine could not learn from, e.g. a bad checksum, would
            // otherwise leave a connection with output evictable).
            c.established |= c.answered;
        }
        if s.has(F::ACK) {
            if s.ack.gt(c.ack_p) {
                c.ack_p = s.ack;
            }
            let edge = s.ack + ((s.window as u32) << c.ws_p);
            if edge.gt(c.edge_p) {
                c.edge_p = edge;
            }
        }
        if let Some((_, v, e)) = s.ts {
            c.ts = Some((v, e));
        }
        // A FIN before the stream's first byte (a server that closed during the handshake)
        // means the connection is lost on the primary: treated like its RST.
        let bogus_fin = s.fin() && !c.out_seen && (s.seq + s.payload_len as u32).lt(c.stream_start);
        if s.has(F::RST) || bogus_fin {
            // ST-TCP 3.7.4: a RST is treated like a FIN; it never reaches the client while the
            // backup may still continue the connection.
            if c.b.is_some_and(|b| b.rst) {
                return Verdict::PASS;
            }
            c.rst_since.get_or_insert(now_ms);
            self.counters.rst_held += 1;
            self.timed.insert(key);
            return Verdict::Drop;
        }
        let n = s.payload_len as u32;
        let (start, end) = (s.seq, s.seq + n);
        let e_all = end + s.fin() as u32;
        if e_all.gt(c.snd_p) {
            c.snd_p = e_all;
        }
        if e_all.gt(c.p_max) {
            c.p_max = e_all;
        }
        if n == 0 && !s.fin() {
            let m = gate(c, pkt, &s, &mut self.counters);
            return Verdict::Accept { modified: m };
        }
        let fin_sent = c.snd_c.gt(end);
        if end.le(c.rel) && (!s.fin() || fin_sent) {
            // Koch 4: a retransmission of released bytes goes out at once.
            let m = gate(c, pkt, &s, &mut self.counters);
            return Verdict::Accept { modified: m };
        }
        if end.le(c.rel) && s.fin() && n > 0 {
            // Released bytes with a FIN that is not: the bytes go out without it (else a client
            // that lost them waits for them forever while the FIN waits for the backup).
            if !c.p_fin && end == c.p_end {
                c.p_fin = true;
                c.fin_after_client = acks_client_fin(c, &s);
                c.fin_since.get_or_insert(now_ms);
                if let Some(f) = fin_segment(&s, c.ts) {
                    c.hold(HeldPkt { pkt: f, end, fin: true }, &mut self.held_total);
                }
            }
            strip_fin(pkt, &s);
            gate(c, pkt, &s, &mut self.counters);
            self.timed.insert(key);
            return Verdict::Accept { modified: true };
        }
        if start.gt(c.p_end) {
            // Beyond a gap: kept aside (bounded) until the gap is filled.
            self.counters.output_gap += 1;
            if e_all.gt(c.p_max) {
                c.p_max = e_all;
            }
            if c.ooo_len + pkt.len() <= self.cfg.max_held_bytes && !c.ooo.iter().any(|(a, _, _)| *a == start) {
                c.ooo_len += pkt.len();
                c.ooo.push((start, e_all, pkt.to_vec()));
            }
            return Verdict::Drop;
        }
        if strict && end.gt(c.p_end) && c.held_bytes.len() + (end - c.p_end) as usize > self.cfg.max_held_bytes {
            // Flow control rather than giving up: beyond the bound new output is dropped (not
            // learned), its server sends it again once the held output is verified and the
            // client acknowledged it. A backup that stays behind is caught by the lag bound.
            self.counters.held_cap_dropped += 1;
            return Verdict::Drop;
        }
        let old_end = c.p_end;
        let old_fin = c.p_fin;
        if end.gt(c.p_end) {
            let skip = (c.p_end - start) as usize;
            if strict {
                c.held_bytes.extend(&pkt[s.payload_at + skip..s.payload_at + s.payload_len]);
            }
            c.p_end = end;
            c.out_seen = true;
            self.last_output_ms = now_ms;
            if !c.ooo.is_empty() {
                self.refill = Some(key);
            }
        }
        if s.fin() && end == c.p_end {
            if !c.p_fin {
                c.fin_after_client = acks_client_fin(c, &s);
            }
            c.p_fin = true;
            c.fin_since.get_or_insert(now_ms);
        }
        let news = end.gt(old_end) || (c.p_fin && !old_fin);
        if !strict && !s.fin() && c.b.is_some_and(|b| b.aligned) && c.held.is_empty() {
            // ST-TCP: output passes at once; only the ACK and window wait for the backup. Not
            // before the backup is aligned, though: until then the client must not acknowledge
            // any output, or the ACK the backup aligns on would not be ISN(P) + 1.
            c.rel = c.p_end;
            if end.gt(c.snd_c) {
                c.snd_c = end;
            }
            let m = gate(c, pkt, &s, &mut self.counters);
            return Verdict::Accept { modified: m };
        }
        if !news {
            // A retransmission of held bytes: the copy waits. Its verified part (the backup's
            // checkpoint fell inside it) goes out now, with this segment's fresh timestamp, so
            // a client that lost it is not left waiting for the rest to be verified.
            if strict && start.lt(c.rel) && !s.fin() {
                if let Some(p) = trimmed(pkt, &s, start, c.rel) {
                    if let Ok(ps) = parse(&p) {
                        let mut p = p;
                        gate(c, &mut p, &ps, &mut self.counters);
                        cut(&mut self.out, p, c.client_mss, c.p_mss);
                        self.counters.partial_released += 1;
                        return Verdict::Drop;
                    }
                }
            }
            self.counters.retrans_dropped += 1;
            return Verdict::Drop;
        }
        if s.fin() && n > 0 {
            // The data goes out once verified; the FIN waits for the backup's (ST-TCP 3.7.4).
            // Held together, the data would wait for the FIN: a client waiting for those bytes
            // never sends the request that would show which side failed.
            let mut data = pkt.to_vec();
            if let Some(f) = fin_segment(&s, c.ts) {
                strip_fin(&mut data, &s);
                c.hold(HeldPkt { pkt: data, end, fin: false }, &mut self.held_total);
                c.hold(HeldPkt { pkt: f, end, fin: true }, &mut self.held_total);
            } else {
                c.hold(HeldPkt { pkt: pkt.to_vec(), end, fin: true }, &mut self.held_total);
            }
        } else {
            c.hold(HeldPkt { pkt: pkt.to_vec(), end, fin: s.fin() }, &mut self.held_total);
        }
        self.counters.held += 1;
        if self.held_total > self.cfg.max_held_total {
            // Beyond the host-wide cap the connection whose output would pass it runs
            // unprotected: its held output goes out as its server built it (never a wrong
            // byte), which also frees what it held.
            self.counters.held_total_exceeded += 1;
            self.unprotect(key, Why::HeldTotal);
        } else {
            self.settle(key, now_ms);
        }
        Verdict::Held
    }

    /// A progress message of the backup (already authenticated: [`Progress::parse`]).
    pub fn backup_progress(&mut self, p: &Progress, now_ms: u64) {
        if p.role != Role::Backup {
            return;
        }
        // One beat may span several messages (more records than fit one): same number.
        if self.last_beat.is_some_and(|b| p.beat < b) {
            self.counters.stale_progress += 1;
            return;
        }
        self.last_beat = Some(p.beat);
        if self.unprotected.is_some() {
            return;
        }
        for r in &p.records {
            let key = ConnKey::of(r);
            let strict = self.cfg.strict;
            let Some(c) = self.conns.get_mut(&key) else { continue };
            let b = c.b.get_or_insert_with(BRec::default);
            let f = |x: u8| r.flags & x != 0;
            if f(rw::flag::RCV_KNOWN) {
                if !b.rcv_known || r.rcv_nxt.gt(b.rcv_nxt) {
                    b.rcv_nxt = r.rcv_nxt;
                }
                if !b.rcv_known || r.rcv_edge.gt(b.rcv_edge) {
                    b.rcv_edge = r.rcv_edge;
                }
                b.rcv_known = true;
            }
            if f(rw::flag::ALIGNED) {
                if !b.aligned || r.out_end.gt(b.out_end) {
                    b.out_end = r.out_end;
                }
                b.aligned = true;
                // Kept in offset order, each once: a beat repeats the oldest checkpoints the
                // primary has not verified, which are older than ones already kept (taking only
                // newer ones than the last kept lost exactly those, and strict output commit then
                // waited for the lag bound: issue 20 item 1).
                if strict && r.out_end.gt(c.rel) {
                    let at = c.reports.iter().position(|&(e, _)| !e.lt(r.out_end)).unwrap_or(c.reports.len());
                    let dup = c.reports.get(at).is_some_and(|&(e, _)| e == r.out_end);
                    if !dup && (c.reports.len() < MAX_REPORTS || at < c.reports.len()) {
                        if c.reports.len() >= MAX_REPORTS {
                            c.reports.pop_back();
                        }
                        c.reports.insert(at, (r.out_end, r.out_hash));
                    }
                }
            }
            b.fin |= f(rw::flag::FIN_OUT);
            b.rst |= f(rw::flag::RST_OUT);
            // Loss toward the primary (its host misses the client's segments, the backup's does
            // not): the client's ACK as the backup heard it (from an acceptable segment, within
            // what the primary verified), into the primary's own server in the client's name,
            // once the primary has heard nothing of that client for a while: its server stops
            // retransmitting into the loss with a backed-off timer (issue 20).
            // Never once its server sent its FIN: the socket may have closed already (its host
            // heard the client's last ACKs, which the engine missed: the fast path passes a
            // frozen connection's pure ACKs unlearned), and a closed socket answers any relayed
            // copy with a RST, whatever it acknowledges: held as the primary's failure, or
            // passed to the client. A server that missed an ACK retransmits, and the client
            // answers that (under loss that goes on, its answers are lost too and the socket
            // lingers in LAST_ACK with backed-off retries: harmless, the client has every byte).
            let quiet = now_ms >= c.client_heard_at + ACK_RELAY_AFTER_MS;
            if quiet && !c.p_fin && c.answered && c.state.is_none() && r.last_ack != Seq(0) && r.last_ack.gt(c.client_ack) && r.last_ack.le(c.snd_c) {
                if let Some((_, cwin, cts)) = c.client_last {
                    let rep = tcp::Repr { src_port: key.client_port, dst_port: key.server_port, seq: c.ack_p, ack: r.last_ack, flags: F::ACK, window: cwin, timestamp: cts, ..Default::default() };
                    if let Ok(pkt) = ip::tcp_packet(key.client, c.server, &rep, &[]) {
                        self.inject.push(pkt);
                        c.client_ack = r.last_ack;
                        self.counters.acks_from_backup += 1;
                    }
                }
            }
            if c.state.is_some() {
                // Unprotected: nothing to verify or release, but its ACK waits for the backup.
                self.fresh_ack(key);
                continue;
            }
            if f(rw::flag::MISALIGNED) {
                self.counters.backup_misaligned += 1;
                self.unprotect(key, Why::BackupMisaligned);
                continue;
            }
            if b.rst && c.rst_since.is_none() {
                // Both servers closed with a FIN and the backup's had every byte of input the
                // primary's got: a RST after that answers a segment that came after its close
                // (a late retransmission, a relayed copy): the connection ended the same way on
                // both, nothing diverged.
                if b.fin && c.p_fin && b.rcv_known && b.rcv_nxt.ge(c.ack_p) {
                    if !c.late_rst {
                        c.late_rst = true;
                        self.counters.backup_rst_after_close += 1;
                    }
                } else {
                    self.unprotect(key, Why::BackupRst);
                    continue;
                }
            }
            if let Some(sa) = c.synack.take() {
                if b.rcv_known && b.rcv_nxt.ge(c.synack_ack) {
                    c.sent_ack = Some(c.synack_ack);
                    self.out.push(sa);
                    self.counters.released += 1;
                } else {
                    c.synack = Some(sa);
                }
            }
            self.settle(key, now_ms);
            self.fresh_ack(key);
        }
    }

    /// Time passes: MaxDelayFIN, AppMaxLagTime, nudges, half-open entries expire. Walks only
    /// the connections with a timer running, not the whole table.
    pub fn tick(&mut self, now_ms: u64) {
        self.clock = self.clock.max(now_ms);
        let gone = expire_half_open(&mut self.conns, &mut self.births, self.clock, HALF_OPEN_TTL_MS, |_| false);
        self.counters.half_open_expired += gone.len() as u64;
        for (k, c) in gone {
            self.held_total -= c.held_len;
            self.timed.remove(&k);
        }
        if self.unprotected.is_some() {
            return;
        }
        let keys: Vec<ConnKey> = self.timed.iter().copied().collect();
        for key in keys {
            self.settle(key, now_ms);
        }
    }

    /// The daemon's check of the server's listening socket (every beat or so). A server seen
    /// listening whose socket is gone has died or restarted (its state lost): the primary is
    /// the sick host, it yields to the backup ([`Notice::YieldToBackup`] with no key).
    pub fn server_listening(&mut self, up: bool) {
        if up {
            self.listening = Some(true);
        } else if self.listening.is_some() {
            // Seen listening before (a server that never started is not one that died); asked
            // again at every check while the yield was refused.
            self.listening = Some(false);
            self.yield_to_backup(None);
        }
    }

    /// The daemon's latest sample of its server's sockets ([`ReadWatch::sample`]): since when
    /// the server has read none of the input they hold (`None`: it reads, or has nothing to
    /// read). Hung for [`Config::max_hang_ms`] while the backup's server answered beyond it
    /// for as long, the primary yields (its timers see it at the next [`Primary::tick`]).
    pub fn server_reading(&mut self, stalled_since: Option<u64>, waiting: &std::collections::HashSet<ConnKey>) {
        self.stalled_since = stalled_since;
        if stalled_since.is_some() {
            self.stalled_on.clone_from(waiting);
            self.stalled_at = Some(self.clock);
        } else {
            self.stalled_on.clear();
        }
    }

    /// The backup's word (in its beats) on its own server: hung or not. A hung backup whose
    /// output the primary has waited for [`Config::max_hang_ms`] is stale
    /// ([`Why::BackupHung`]), unless this host's server is hung too.
    pub fn backup_hung(&mut self, hung: bool) {
        self.backup_hung = hung;
        if hung {
            self.backup_hung_at = self.clock;
        }
    }

    /// Whether this host's server is hung at `now` (see [`Config::max_hang_ms`]).
    fn hung(&self, now: u64) -> bool {
        self.cfg.max_hang_ms > 0
            && self
                .stalled_since
                .is_some_and(|t| now >= t + self.cfg.max_hang_ms)
    }

    /// The daemon refused the yield (the backup is not heard, or is stale): ask again at the
    /// next evidence instead of never.
    pub fn yield_refused(&mut self) {
        self.yielded = false;
    }

    /// `Some(why)` once the backup can no longer take over: it missed input the primary's
    /// server consumed (a connection's ACK stopped waiting for it), or its server failed on a
    /// connection. Its server's state is no longer the primary's for every connection that
    /// shares it (issue 20 item 5): the daemon tells it (it must never take over), and the
    /// primary runs every connection unprotected.
    pub fn backup_stale(&self) -> Option<Why> {
        self.stale
    }

    /// The backup's daemon restarted (a new boot on the side channel): it lost every
    /// connection's state and can take none of them over; it is stale at once.
    pub fn backup_restarted(&mut self) {
        self.make_stale(Why::BackupRestarted);
    }

    fn yield_to_backup(&mut self, key: Option<ConnKey>) {
        if self.yielded || self.unprotected.is_some() {
            return;
        }
        self.yielded = true;
        self.notices.push(Notice::YieldToBackup { key });
    }

    /// The primary's server alone failed on `key`. A host-wide yield needs evidence that the
    /// host is sick: its listening socket gone, or (a stall) no new output on any connection for
    /// the lag bound. Otherwise the failure is the connection's own (a close race, an idle
    /// timeout meeting a request): it runs unprotected, the client sees what the primary's
    /// server did, and no client can force a failover (issue 20 item 9).
    fn primary_failed(&mut self, key: ConnKey, now: u64, stalled: bool) {
        self.counters.primary_failed += 1;
        // (A stalled server's kernel still sends what its buffers hold for a while after the
        // process stopped: half the lag bound without new output anywhere is a stall.)
        let sick = self.listening == Some(false) || (stalled && now >= self.last_output_ms + self.cfg.max_lag_ms / 2);
        if sick {
            self.yield_to_backup(Some(key));
        } else {
            self.unprotect(key, Why::PrimaryFailed);
        }
    }

    fn make_stale(&mut self, why: Why) {
        if self.stale.is_some() || self.unprotected.is_some() {
            return;
        }
        self.stale = Some(why);
        self.notices.push(Notice::BackupStale { why });
        let keys: Vec<ConnKey> = self.conns.keys().copied().collect();
        for key in keys {
            self.unprotect(key, Why::BackupStale);
        }
        self.unprotected = Some(Why::BackupStale);
        self.timed.clear();
    }

    /// Koch 6: the backup failed. Every held byte goes out now; ACK and window pass unchanged.
    pub fn backup_failed(&mut self) {
        if self.unprotected.is_some() {
            return;
        }
        let keys: Vec<ConnKey> = self.conns.keys().copied().collect();
        for key in keys {
            if self.conns[&key].state.is_none() {
                self.unprotect(key, Why::BackupFailed);
            }
        }
        self.unprotected = Some(Why::BackupFailed);
    }

    /// The primary's own progress for the backup: its figures and the DIVERGED flags.
    pub fn report(&self, beat: u64) -> Vec<Progress> {
        let recs = self
            .conns
            .iter()
            .map(|(k, c)| ConnProgress {
                client: k.client,
                client_port: k.client_port,
                server_port: k.server_port,
                // What reached this host in order (its server has it, or will once it
                // acknowledges): the backup relays only what lies beyond (loss toward the
                // primary), not what a server slow to acknowledge (a delayed ACK) already got.
                rcv_nxt: c.rcv_in_order(),
                rcv_edge: c.edge_p,
                // What strict output commit verified (the backup drops older checkpoints).
                out_end: if self.cfg.strict { c.rel } else { c.p_end },
                out_hash: 0,
                last_ack: c.client_ack,
                isn: c.stream_start - 1u32,
                flags: rw::flag::RCV_KNOWN
                    | if c.answered { rw::flag::ISN_KNOWN } else { 0 }
                    // Any connection this primary no longer protects (not only a divergence):
                    // a backup must never continue it after a take-over, its input may have a
                    // hole the client will never fill.
                    | if c.state.is_some() { rw::flag::DIVERGED } else { 0 }
                    | if c.p_fin { rw::flag::FIN_OUT } else { 0 }
                    | if c.rst_since.is_some() { rw::flag::RST_OUT } else { 0 },
            })
            .collect();
        chunk(Role::Primary, beat, recs)
    }

    pub fn forget(&mut self, key: &ConnKey) {
        if let Some(c) = self.conns.remove(key) {
            self.held_total -= c.held_len;
        }
    }

    /// Connections over on both sides (see [`Backup::finished`]).
    pub fn finished(&self) -> Vec<ConnKey> {
        self.conns.iter().filter(|(_, c)| c.finished()).map(|(k, _)| *k).collect()
    }

    /// Connections followed.
    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    /// Verifies what can be verified, releases what is verified, applies the lag and FIN
    /// rules (ST-TCP 3.7.3, 3.7.4).
    fn settle(&mut self, key: ConnKey, now: u64) {
        self.clock = self.clock.max(now);
        self.settle_inner(key, now);
        match self.conns.get(&key) {
            Some(c) if self.unprotected.is_none() && timer_runs(c) => {
                self.timed.insert(key);
            }
            _ => {
                self.timed.remove(&key);
            }
        }
    }

    fn settle_inner(&mut self, key: ConnKey, now: u64) {
        let cfg = self.cfg;
        // A hung server on one side only (both hung: a long command runs on both).
        let own_hung = self.hung(now);
        // Only on a connection whose own input waits unread here (one parked socket elsewhere is
        // no evidence about this one).
        let i_hang = own_hung && !self.backup_hung && self.stalled_on.contains(&key);
        let backup_went_on = self.backup_hung_at;
        // The primary's server went on: not stalled now, and not within the bound before either
        // (both stalled, the one that finishes first must not condemn the other).
        let backup_hangs = self.backup_hung && !own_hung && cfg.max_hang_ms > 0 && self.stalled_at.is_none_or(|t| now >= t + cfg.max_hang_ms);
        let Some(c) = self.conns.get_mut(&key) else {
            return;
        };
        if c.state.is_some() {
            // Unprotected, but its ACK still waits for the backup (so that the backup misses no
            // input while it may take over): if the backup's input stays behind for the lag
            // bound, it cannot catch up, and it is stale.
            let Some(b) = c.b.filter(|b| b.rcv_known && !c.finished()) else {
                c.behind = None;
                return;
            };
            if c.ack_p.gt(b.rcv_nxt) {
                match c.behind {
                    Some((_, mr, _)) if b.rcv_nxt.ge(mr) => {
                        c.behind = Some((c.p_end, c.ack_p, now))
                    }
                    Some((_, _, t))
                        if now >= t + cfg.max_lag_ms
                            || (backup_hangs && now >= t + cfg.max_hang_ms) =>
                    {
                        c.behind = None;
                        self.make_stale(if now >= t + cfg.max_lag_ms {
                            Why::BackupLagging
                        } else {
                            Why::BackupHung
                        });
                    }
                    Some(_) => {}
                    None => c.behind = Some((c.p_end, c.ack_p, now)),
                }
            } else {
                c.behind = None;
            }
            return;
        }
        if c.synack.is_some() {
            // The backup's server never answered the SYN (its application is down, its
            // backlog full) or reset it: the connection cannot be protected; the client must
            // not wait for it longer than the lag bound.
            let reset = c.b.is_some_and(|b| b.rst);
            if reset || c.synack_since.is_some_and(|t| now >= t + cfg.max_lag_ms) {
                self.unprotect(key, if reset { Why::BackupRst } else { Why::BackupLagging });
                // Its server never had this connection: it missed its input.
                self.make_stale(if reset { Why::BackupRst } else { Why::BackupLagging });
            }
            return;
        }
        let Some(b) = c.b else { return };
        // Strict output commit (Koch 3.2): the backup's digest at an offset the primary reached.
        if cfg.strict {
            while let Some(&(end, hash)) = c.reports.front() {
                if end.le(c.rel) {
                    c.reports.pop_front();
                    continue;
                }
                if end.gt(c.p_end) {
                    break;
                }
                let k = (end - c.rel) as usize;
                let (a, z) = c.held_bytes.as_slices();
                let h = if k <= a.len() { hash_continue(c.rel_hash, &a[..k]) } else { hash_continue(hash_continue(c.rel_hash, a), &z[..k - a.len()]) };
                if h != hash {
                    self.counters.diverged += 1;
                    self.unprotect(key, Why::Diverged);
                    return;
                }
                c.rel = end;
                c.rel_hash = h;
                c.held_bytes.drain(..k);
                c.reports.pop_front();
            }
        }
        // FIN (ST-TCP 3.7.4): released when the backup closed at the same offset.
        let fin_ok = c.p_fin && b.fin && b.aligned && b.out_end == c.p_end && (!cfg.strict || c.rel == c.p_end);
        if b.fin && b.aligned && c.p_end.gt(b.out_end) {
            // The client closed first with every byte the primary sent, and the backup's server
            // had all the input the primary's acknowledged (so its state is the primary's): its
            // shorter output is what it had not written yet when it read the client's EOF (Redis
            // drops such replies; a backup behind in relaxed mode meets it at every close). Only
            // this connection stops being protected. Otherwise the backup missed input: stale.
            let all_input = b.rcv_known && b.rcv_nxt.ge(c.ack_p);
            let why = if c.client_fin_at.is_some() && c.client_ack.ge(c.p_end) && all_input { Why::BackupClosedEarly } else { Why::BackupFinAlone };
            self.unprotect(key, why);
            return;
        }
        if c.p_fin && !fin_ok && b.aligned && b.out_end.gt(c.p_end) {
            // Decided after a grace in which the daemon's check of the listening socket can
            // show a crashed server (then the whole host yields, this connection with it).
            let t = *c.fin_alone_since.get_or_insert(now);
            if now >= t + PRIMARY_FAIL_GRACE_MS {
                // After the client's own close it is the reverse of `BackupClosedEarly`: the
                // primary's server read the client's EOF with replies still unwritten (Redis
                // drops them), the backup's had written more. No failure: the client closed and
                // gets what the primary's server did, as it would without us. Only with the
                // evidence that its kernel had the client's FIN when its server closed (its FIN
                // acknowledged it): a client's FIN after the server's is the close race of
                // table 3.3 row 3, the primary's failure.
                if c.fin_after_client && self.listening != Some(false) {
                    self.unprotect(key, Why::PrimaryClosedEarly);
                } else {
                    self.primary_failed(key, now, false);
                }
                return;
            }
        }
        if c.p_fin && !fin_ok && c.fin_since.is_some() && c.client_ack.ge(c.p_end) {
            c.fin_acked_since.get_or_insert(now);
        }
        if c.p_fin && !fin_ok && c.fin_acked_since.is_some_and(|t| now >= t + cfg.max_delay_fin_ms) {
            self.unprotect(key, Why::FinTimeout);
            return;
        }
        if c.rst_since.is_some_and(|t| now >= t + cfg.max_delay_fin_ms) && !b.rst {
            self.primary_failed(key, now, false);
            return;
        }
        // Release.
        let mut any = false;
        while let Some(h) = c.held.front() {
            let ok = if h.fin {
                fin_ok
            } else if cfg.strict {
                h.end.le(c.rel)
            } else {
                b.aligned
            };
            if !ok {
                break;
            }
            let Some(h) = c.unhold(&mut self.held_total) else { break };
            let mut pkt = unsent_part(c, h.pkt, h.end, h.fin);
            if let Ok(s) = parse(&pkt) {
                gate(c, &mut pkt, &s, &mut self.counters);
            }
            if !cfg.strict && h.end.gt(c.rel) {
                c.rel = h.end;
            }
            let e = h.end + h.fin as u32;
            if e.gt(c.snd_c) {
                c.snd_c = e;
            }
            cut(&mut self.out, pkt, c.client_mss, c.p_mss);
            self.counters.released += 1;
            any = true;
        }
        // The oldest held segment straddles the verified end (the backup's segments end
        // elsewhere than the primary's): its verified part goes out now. Otherwise a client whose
        // server retransmits only that segment (its window collapsed after a timeout) waits until
        // the backup reports an end beyond it, which may never come (issue 20 item 1).
        if cfg.strict && c.rel.gt(c.snd_c) {
            if let Some(h) = c.held.front().filter(|h| !h.fin && h.end.gt(c.rel)) {
                if let Ok(s) = parse(&h.pkt) {
                    let from = if c.snd_c.gt(s.seq) { c.snd_c } else { s.seq };
                    if let Some(mut p) = trimmed(&h.pkt, &s, from, c.rel) {
                        if let Ok(ps) = parse(&p) {
                            gate(c, &mut p, &ps, &mut self.counters);
                            c.snd_c = c.rel;
                            cut(&mut self.out, p, c.client_mss, c.p_mss);
                            self.counters.partial_released += 1;
                        }
                    }
                }
            }
        }
        if any {
            c.fin_since = if c.held.iter().any(|h| h.fin) { c.fin_since } else { None };
            c.fin_acked_since = c.fin_since.and(c.fin_acked_since);
        }
        // ST-TCP 3.7.3: AppMaxLagBytes / AppMaxLagTime, both ways.
        if !b.aligned || !b.rcv_known {
            return;
        }
        let out_behind = if c.p_end.gt(b.out_end) { c.p_end - b.out_end } else { 0 };
        let rcv_behind = if c.ack_p.gt(b.rcv_nxt) { c.ack_p - b.rcv_nxt } else { 0 };
        // Koch 4 leaves client bytes the backup missed to the client's retransmission timer
        // (seconds, with backoff); three duplicate ACKs make the client resend them at once.
        while c.input.front().is_some_and(|(a, d)| (*a + d.len() as u32).le(b.rcv_nxt)) {
            if let Some((_, d)) = c.input.pop_front() {
                c.input_len -= d.len();
            }
        }
        if b.rcv_nxt.gt(c.input_from) {
            c.input_from = b.rcv_nxt;
        }
        if c.input_poison.is_some_and(|(_, e)| !e.gt(b.rcv_nxt)) {
            c.input_poison = None;
        }
        if c.relay_seen.0 != b.rcv_nxt {
            c.relay_seen = (b.rcv_nxt, now);
        }
        // Only a backup whose server stopped taking input (for half the nudge bound) missed
        // some: one that is merely behind (its daemon's queue holds the client's packets on a
        // loaded host) gets them from the client, and copies sent to it then are duplicates
        // that load it further. A relay it did not confirm goes again after a gap that doubles
        // each time (a backlog takes longer to clear than a lost message): resending every
        // nudge bound fed a loaded backup megabytes of duplicates until it fell seconds behind
        // and went stale (issue 20, `replica_loss_toward_backup_large_values`).
        let stuck = now >= c.relay_seen.1 + cfg.nudge_after_ms / 2;
        let confirmed = c.relay_end.is_none_or(|e| b.rcv_nxt.ge(e));
        if rcv_behind == 0 {
            c.relay_end = None;
        } else if cfg.nudge_after_ms > 0 && stuck && c.rcv_behind_since.is_some_and(|t| now >= t + cfg.nudge_after_ms / 2) && (confirmed || now >= c.relay_at + c.relay_gap) {
            // ST-TCP 3.6: the backup missed client bytes the primary's server has: they go to
            // the backup over the side channel (its daemon injects them into its server), a
            // budget at a time, again once it confirmed the last and stopped again.
            let gap = if confirmed { cfg.nudge_after_ms } else { (c.relay_gap * 2).min(MAX_RELAY_GAP_MS).max(cfg.nudge_after_ms) };
            let mut at = b.rcv_nxt;
            let mut budget = RELAY_BUDGET;
            for (a, d) in c.input.iter() {
                let e = *a + d.len() as u32;
                if !e.gt(at) {
                    continue;
                }
                if a.gt(at) || budget == 0 || !at.lt(c.ack_p) {
                    break;
                }
                let mut from = (at - *a) as usize;
                let stop = ((c.ack_p - *a) as usize).min(d.len());
                while from < stop && budget > 0 {
                    let n = (stop - from).min(rw::MAX_INPUT).min(budget);
                    self.relay.push((key, *a + from as u32, d[from..from + n].to_vec()));
                    self.counters.relayed_bytes += n as u64;
                    budget -= n;
                    from += n;
                }
                at = *a + from as u32;
            }
            if at.gt(b.rcv_nxt) {
                c.relay_end = Some(at);
                c.relay_at = now;
                c.relay_gap = gap;
            }
        }
        if rcv_behind == 0 {
            c.rcv_behind_since = None;
        } else if cfg.nudge_after_ms > 0 {
            let since = *c.rcv_behind_since.get_or_insert_with(|| {
                c.nudge_gap = cfg.nudge_after_ms;
                c.nudge_at = now + cfg.nudge_after_ms;
                now
            });
            if now >= c.nudge_at && now > since {
                if let Some((ack, win)) = gated(c) {
                    note_ts(c);
                    let r = tcp::Repr { src_port: key.server_port, dst_port: key.client_port, seq: c.snd_c, ack, flags: F::ACK, window: win, timestamp: c.ts, ..Default::default() };
                    if let Ok(p) = ip::tcp_packet(c.server, key.client, &r, &[]) {
                        for _ in 0..3 {
                            self.out.push(p.clone());
                        }
                        self.counters.nudges += 1;
                    }
                }
                c.nudge_gap = c.nudge_gap.saturating_mul(2);
                c.nudge_at = now + c.nudge_gap;
            }
        }
        // A backup whose input lags for the lag bound has missed what the primary's server
        // consumed: stale. One whose output only lags still has the same input (its state
        // follows): that connection runs unprotected beyond the bounds, its ACK still waiting
        // for the backup, which stays a spare. Input lag is judged by time only: the primary's
        // ACK waits for the backup, so the client keeps (and resends) whatever the backup lacks,
        // and how far the primary's server got ahead is bounded by the client's window, which
        // Linux grows to several MiB under load (a byte bound on it made a backup behind a
        // large window stale with no fault: `replica_primary_host_crash_not_strict`, 1 run in 5).
        // (Without strict output commit the primary's output does not wait for the backup's:
        // a backup whose server runs megabytes behind under load is still a replica, its server
        // produces the same bytes later, and a takeover skips what the client already has; only
        // the time bound applies.)
        let input_lags = rcv_behind > 0;
        if cfg.strict && out_behind > cfg.max_lag_bytes {
            self.unprotect(key, Why::BackupLagging);
            return;
        }
        if out_behind > 0 || rcv_behind > 0 {
            match c.behind {
                Some((mo, mr, _)) if b.out_end.ge(mo) && b.rcv_nxt.ge(mr) => c.behind = Some((c.p_end, c.ack_p, now)),
                Some((_, _, t)) if now >= t + cfg.max_lag_ms => {
                    self.unprotect(key, Why::BackupLagging);
                    if input_lags {
                        self.make_stale(Why::BackupLagging);
                    }
                    return;
                }
                Some((_, _, t)) if backup_hangs && now >= t + cfg.max_hang_ms => {
                    // The backup's server stopped reading while this host's went on: it
                    // cannot follow any connection (table 3.3 row 2, backup), at once.
                    self.unprotect(key, Why::BackupHung);
                    self.make_stale(Why::BackupHung);
                    return;
                }
                Some(_) => {}
                None => c.behind = Some((c.p_end, c.ack_p, now)),
            }
        } else {
            c.behind = None;
        }
        // Output the backup produced beyond everything the primary's engine saw, while the client
        // acknowledged all of that: the primary's server sent it (it has the same input) but
        // the segment was lost before this engine (its queue overflowed). Its server resends it
        // only at its retransmission timeout (backed off, seconds): three duplicate ACKs in
        // the client's name make it resend at once (fast retransmit), again after twice as long.
        let tail = (b.out_end.gt(c.p_end) || !c.ooo.is_empty()) && c.client_ack.ge(c.p_end) && !c.p_fin && c.ack_p.ge(b.rcv_nxt) && c.held.is_empty();
        if !tail || cfg.nudge_after_ms == 0 {
            c.tail_since = None;
        } else {
            let since = *c.tail_since.get_or_insert_with(|| {
                c.tail_gap = cfg.nudge_after_ms;
                c.tail_nudge_at = now + cfg.nudge_after_ms;
                now
            });
            if now >= c.tail_nudge_at && now > since {
                if let Some((cseq, cwin, cts)) = c.client_last {
                    let r = tcp::Repr { src_port: key.client_port, dst_port: key.server_port, seq: cseq, ack: c.p_end, flags: F::ACK, window: cwin, timestamp: cts, ..Default::default() };
                    if let Ok(p) = ip::tcp_packet(key.client, c.server, &r, &[]) {
                        for _ in 0..3 {
                            self.inject.push(p.clone());
                        }
                        self.counters.self_nudges += 1;
                    }
                }
                c.tail_gap = c.tail_gap.saturating_mul(2);
                c.tail_nudge_at = now + c.tail_gap;
            }
        }
        // The primary counts as lagging only while it has all the input the backup has: a
        // primary that missed a client segment waits for the client's retransmission, which
        // is the network's delay, not its application's.
        if b.out_end.gt(c.p_end) && b.out_end.gt(c.p_max) && !c.p_fin && c.ack_p.ge(b.rcv_nxt) {
            match c.ahead {
                Some((m, _)) if c.p_end.ge(m) => c.ahead = Some((b.out_end, now)),
                Some((_, t)) if now >= t + cfg.max_lag_ms => {
                    c.ahead = None;
                    self.primary_failed(key, now, true);
                }
                Some((_, t)) if i_hang && now >= t.max(backup_went_on) + cfg.max_hang_ms => {
                    // This host's server reads nothing while the backup's answered (table 3.3
                    // row 2, primary): the host is sick, the backup takes every connection.
                    c.ahead = None;
                    self.counters.primary_failed += 1;
                    self.counters.hung_yields += 1;
                    self.yield_to_backup(Some(key));
                }
                Some(_) => {}
                None => c.ahead = Some((b.out_end, now)),
            }
        } else {
            c.ahead = None;
        }
    }

    /// Koch 3.4: when the backup caught up, the client hears of it at once.
    /// Also on an unprotected connection, whose ACKs still wait for the backup: after its
    /// server answered the client's FIN with its own and closed, nothing else would tell the
    /// client that its FIN arrived, and its retransmission would meet the closed socket's RST.
    fn fresh_ack(&mut self, key: ConnKey) {
        let Some(c) = self.conns.get_mut(&key) else { return };
        if c.synack.is_some() || c.state.is_some() && c.client_rst {
            return;
        }
        let (Some(sent), Some((ack, win))) = (c.sent_ack, gated(c)) else { return };
        if !ack.gt(sent) {
            return;
        }
        note_ts(c);
        let r = tcp::Repr {
            src_port: key.server_port,
            dst_port: key.client_port,
            seq: c.snd_c,
            ack,
            flags: F::ACK,
            window: win,
            timestamp: c.ts,
            ..Default::default()
        };
        if let Ok(p) = ip::tcp_packet(c.server, key.client, &r, &[]) {
            c.sent_ack = Some(ack);
            self.out.push(p);
            self.counters.fresh_acks += 1;
        }
    }

    fn unprotect(&mut self, key: ConnKey, why: Why) {
        let Some(c) = self.conns.get_mut(&key) else { return };
        if c.state.is_some() {
            return;
        }
        c.state = Some(why);
        if let Some(sa) = c.synack.take() {
            self.out.push(sa);
        }
        // Koch 6.1: everything held goes out as the primary's TCP built it (its timestamps
        // raised to the newest sent, PAWS).
        while let Some(h) = c.unhold(&mut self.held_total) {
            let mut pkt = unsent_part(c, h.pkt, h.end, h.fin);
            if let Ok(s) = parse(&pkt) {
                if stamp(c, &mut pkt, &s) {
                    self.counters.ts_raised += 1;
                }
                // Where the stream stands for the client now, for the fresh ACKs of an
                // unprotected connection (past a released FIN).
                let e = s.seq + s.payload_len as u32 + s.fin() as u32;
                if e.gt(c.snd_c) {
                    c.snd_c = e;
                }
            }
            cut(&mut self.out, pkt, c.client_mss, c.p_mss);
            self.counters.released += 1;
        }
        c.held_bytes.clear();
        c.reports.clear();
        c.ahead = None;
        c.behind = None;
        c.input.clear();
        c.input_len = 0;
        c.input_poison = None;
        c.ooo.clear();
        c.ooo_len = 0;
        c.rcv_behind_since = None;
        c.tail_since = None;
        c.fin_since = None;
        c.fin_acked_since = None;
        self.notices.push(Notice::Unprotected { key, why });
        // The backup's server failed on this connection (or numbers it wrong): it no longer
        // receives what the primary's does there, so its state is no longer the primary's.
        if matches!(why, Why::BackupRst | Why::BackupFinAlone | Why::BackupMisaligned) {
            self.make_stale(why);
        }
    }
}

/// A connection whose state needs [`Primary::tick`]: something held, a lag or FIN or RST
/// clock running, a nudge pending.
fn timer_runs(c: &PConn) -> bool {
    c.synack.is_some() || !c.held.is_empty() || c.behind.is_some() || c.ahead.is_some() || c.rcv_behind_since.is_some() || c.fin_since.is_some() || c.rst_since.is_some() || c.tail_since.is_some()
}

/// Keeps the client's view of the server's timestamps monotonic (PAWS, RFC 7323 5): a segment
/// older than the newest sent gets the newest TSval (and the newest TSecr the server echoed, so
/// that the client's RTT sample is not inflated by the time it was held); true when changed.
fn stamp(c: &mut PConn, pkt: &mut [u8], s: &Seg) -> bool {
    let Some((at, v, e)) = s.ts else { return false };
    match c.ts_max {
        Some(m) if ts_before(v, m) => {
            let Ok(mut t) = tcp_mut(pkt, s) else { return false };
            t.rewrite_u32_at(at + 2, m);
            if let Some((_, latest_ecr)) = c.ts.filter(|t| ts_before(e, t.1)) {
                t.rewrite_u32_at(at + 6, latest_ecr);
            }
            true
        }
        _ => {
            c.ts_max = Some(v);
            false
        }
    }
}

/// A segment the engine builds carries the server's latest timestamps: from now on no older
/// TSval may reach the client.
fn note_ts(c: &mut PConn) {
    if let Some((v, _)) = c.ts {
        if c.ts_max.is_none_or(|m| ts_before(m, v)) {
            c.ts_max = Some(v);
        }
    }
}

/// A copy of the segment `s` describes carrying only its bytes [`from`, `to`) (no FIN, no SYN),
/// as its server's TCP would have sent them: same ACK, window and timestamps.
fn trimmed(pkt: &[u8], s: &Seg, from: Seq, to: Seq) -> Option<Vec<u8>> {
    if !from.lt(to) || from.lt(s.seq) || (to - s.seq) as usize > s.payload_len {
        return None;
    }
    let a = s.payload_at + (from - s.seq) as usize;
    let z = s.payload_at + (to - s.seq) as usize;
    // ECE as the segment had it; CWR only on the piece that starts where the segment did (as
    // the kernel's segmentation leaves it on the first).
    let cwr = if from == s.seq { s.flags & F::CWR } else { 0 };
    let r = tcp::Repr { src_port: s.src_port, dst_port: s.dst_port, seq: from, ack: s.ack, flags: (s.flags & (F::ACK | F::PSH | F::ECE)) | cwr, window: s.window, timestamp: s.ts.map(|t| (t.1, t.2)), ..Default::default() };
    ip::tcp_packet(s.info.src, s.info.dst, &r, &pkt[a..z]).ok()
}

/// Clears the FIN flag of the segment `s` describes, keeping its checksum right.
fn strip_fin(pkt: &mut [u8], s: &Seg) {
    if let Ok(mut t) = tcp_mut(pkt, s) {
        let (old, c16) = (u16::from_be_bytes([t.as_bytes()[12], t.as_bytes()[13]]), t.checksum());
        t.set_flags(s.flags & !F::FIN);
        let new = u16::from_be_bytes([t.as_bytes()[12], t.as_bytes()[13]]);
        t.set_checksum(unbroken_wire::checksum::update_u16(c16, old, new));
    }
}

/// A bare FIN (with ACK) at the end of `s`'s payload, as the server's TCP would send it.
fn fin_segment(s: &Seg, ts: Option<(u32, u32)>) -> Option<Vec<u8>> {
    let r = tcp::Repr {
        src_port: s.src_port,
        dst_port: s.dst_port,
        seq: s.seq + s.payload_len as u32,
        ack: s.ack,
        flags: F::FIN | F::ACK,
        window: s.window,
        timestamp: s.ts.map(|t| (t.1, t.2)).or(ts),
        ..Default::default()
    };
    ip::tcp_packet(s.info.src, s.info.dst, &r, &[]).ok()
}

/// The ACK and window field the client may see: min of both hosts (Koch 3.2), the window
/// computed from the lower right edge so that lowering the ACK does not move the edge left.
fn gated(c: &PConn) -> Option<(Seq, u16)> {
    let b = c.b.filter(|b| b.rcv_known)?;
    let ack = seq_min(c.ack_p, b.rcv_nxt);
    let edge = seq_min(c.edge_p, b.rcv_edge);
    let win = if edge.gt(ack) { edge - ack } else { 0 };
    Some((ack, (win >> c.ws_p).min(0xffff) as u16))
}

/// Rewrites the ACK and window of an outgoing packet to [`gated`]'s; true when changed.
fn gate(c: &mut PConn, pkt: &mut [u8], s: &Seg, counters: &mut PrimaryCounters) -> bool {
    let stamped = stamp(c, pkt, s);
    if stamped {
        counters.ts_raised += 1;
    }
    if !s.has(F::ACK) {
        return stamped;
    }
    let Some((ack, win)) = gated(c) else { return stamped };
    let Ok(mut t) = tcp_mut(pkt, s) else { return stamped };
    let mut m = stamped;
    if t.ack() != ack {
        if ack.lt(t.ack()) {
            counters.acks_lowered += 1;
        }
        t.rewrite_ack(ack);
        m = true;
    }
    if t.window() != win {
        t.rewrite_window(win);
        m = true;
    }
    if c.sent_ack.is_none_or(|a| ack.gt(a)) {
        c.sent_ack = Some(ack);
    }
    m
}

// ---------------------------------------------------------------------------------------------
// A hung server (issue 20; ST-TCP Table 3.3 row 2 without waiting for AppMaxLagTime)
// ---------------------------------------------------------------------------------------------

/// One socket of the local server as the kernel counts it (the daemon asks `sock_diag`): its
/// cookie, the input it holds unread by the process, every byte received in order, and its send
/// buffer: the memory its queued output takes and the buffer's size (0 and 0: unknown).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerSocket {
    pub id: u64,
    /// The connection it serves (the daemon samples only sockets on the service address).
    pub key: ConnKey,
    pub unread: u32,
    pub received: u64,
    pub send_queued: u32,
    pub send_buf: u32,
}

impl ServerSocket {
    /// Whether a process writing to it waits: its queued output above two thirds of its send
    /// buffer (the kernel's `sk_stream_is_writeable`).
    pub fn full(&self) -> bool {
        self.send_buf > 0 && self.send_queued as u64 * 3 > self.send_buf as u64 * 2
    }
}

/// Whether the local server reads its input: a server that consumed nothing on any socket
/// while some socket holds input it has not read, and used no CPU meanwhile, has stalled
/// (stopped, deadlocked, waiting on a dead disk). A server with nothing to read is not
/// stalled, however long it is quiet; one slow to answer that still reads is not either, nor
/// one busy computing (a long command, which a deterministic server runs on both hosts, each
/// at its own moment among its connections). What counts is the kernel's own count of
/// consumed bytes (`received - unread`), which no packet can forge, and the server processes'
/// CPU time. Nor is input waiting on a socket whose send buffer is full ([`ServerSocket::full`]):
/// a server blocked writing a reply reads nothing more on that connection, and waits for the
/// client, not for itself. A relaxed backup behind the primary meets that at every large reply:
/// its output is withheld, the client, done with the primary's copy, acknowledges nothing more,
/// and the backup's server moves one window per relayed ACK; it used to be taken for hung under
/// load (the backup stale, protection gone). A hung server's buffer is no longer full once its
/// client (or a relay) acknowledged a third of it, a live one's is filled again at once: after
/// that its unread input counts. A client that keeps its window shut hides a hang on its own
/// connection only (the lag bounds still apply). A stall is a failure only beside a server
/// that went on ([`Primary::server_reading`], [`Config::max_hang_ms`]).
#[derive(Debug, Default)]
pub struct ReadWatch {
    /// Bytes consumed per socket at the last sample.
    consumed: HashMap<u64, u64>,
    /// The server's CPU time at the last sample (any unit).
    cpu: Option<u64>,
    since: Option<u64>,
    /// The connections whose input waits unread, consumed nothing since the last sample.
    waiting: std::collections::HashSet<ConnKey>,
}

impl ReadWatch {
    /// One sample of every socket of the server at `now_ms` and of its processes' CPU time
    /// (`None`: unknown): since when the server has read nothing and computed nothing while
    /// input waited (`None`: it read or computed since the last sample, or nothing waits). A
    /// socket whose counts make no sense (more unread than received: no `tcp_info`) is
    /// ignored.
    pub fn sample(&mut self, now_ms: u64, socks: &[ServerSocket], cpu: Option<u64>) -> Option<u64> {
        let busy = matches!((self.cpu, cpu), (Some(a), Some(b)) if b != a);
        self.cpu = cpu;
        let mut read = busy;
        let mut consumed = HashMap::with_capacity(socks.len());
        self.waiting.clear();
        for s in socks {
            let Some(c) = s.received.checked_sub(s.unread as u64) else {
                continue;
            };
            match self.consumed.get(&s.id) {
                Some(&was) if c > was => read = true,
                // A socket new since the last sample whose input was partly read already.
                None if c > 0 && !self.consumed.is_empty() => read = true,
                _ if s.unread > 0 && !s.full() => {
                    self.waiting.insert(s.key);
                }
                _ => {}
            }
            consumed.insert(s.id, c);
        }
        let waiting = !self.waiting.is_empty();
        self.consumed = consumed;
        if read || !waiting {
            self.since = None;
            self.waiting.clear();
        } else {
            self.since.get_or_insert(now_ms);
        }
        self.since
    }

    /// The connections whose input waited unread at the last sample of a stalled server.
    pub fn waiting(&self) -> &std::collections::HashSet<ConnKey> {
        &self.waiting
    }
}

// ---------------------------------------------------------------------------------------------
// The failure detector (ST-TCP 3.3.3)
// ---------------------------------------------------------------------------------------------

/// Heartbeat settings: the interval (default 10 ms) and how many beats may be missed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DetectorConfig {
    pub interval_ms: u64,
    pub misses: u32,
}

impl Default for DetectorConfig {
    fn default() -> DetectorConfig {
        DetectorConfig { interval_ms: 10, misses: 10 }
    }
}

/// Where a detector stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DetectorState {
    Watching,
    /// The peer missed its beats; the fencing hook runs.
    Fencing,
    /// The fence succeeded: this backup took over.
    TookOver,
    /// The backup is declared failed (primary only).
    PeerFailed,
}

/// What the daemon must do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DetectorAction {
    /// Run the fencing hook, then report with [`Detector::fence_result`].
    RunFence,
    /// The primary is fenced: call [`Backup::take_over`], announce the address.
    TakeOver,
    /// The backup is fenced: call [`Primary::backup_failed`].
    BackupFailed,
}

/// Missed beats → suspected → fencing → take-over, with time passed in. A suspicion is acted
/// on only after the fencing hook succeeded (ST-TCP 3.2.2: "switch off the power of the
/// primary"; Table 3.3: "shuts backup down"), on both sides: a live primary and an active
/// backup must never both answer, and a primary that runs unprotected (acknowledging what the
/// backup never got) must not be followed by a backup that takes over later (a cut side channel
/// makes both suspect each other: the first fence wins). A failed fence leaves the detector
/// watching; it retries after another silence.
#[derive(Debug, Clone)]
pub struct Detector {
    cfg: DetectorConfig,
    role: Role,
    last_beat: u64,
    state: DetectorState,
    pub fences_failed: u32,
}

impl Detector {
    /// `role` is this host's; the detector watches the other one from `now_ms` on.
    pub fn new(cfg: DetectorConfig, role: Role, now_ms: u64) -> Detector {
        Detector { cfg: DetectorConfig { interval_ms: cfg.interval_ms.max(1), misses: cfg.misses.max(1) }, role, last_beat: now_ms, state: DetectorState::Watching, fences_failed: 0 }
    }

    pub fn state(&self) -> DetectorState {
        self.state
    }

    /// An authenticated message from the peer arrived.
    pub fn beat(&mut self, now_ms: u64) {
        if now_ms > self.last_beat {
            self.last_beat = now_ms;
        }
    }

    fn silent(&self, now_ms: u64) -> bool {
        now_ms > self.last_beat + self.cfg.interval_ms * self.cfg.misses as u64
    }

    pub fn tick(&mut self, now_ms: u64) -> Option<DetectorAction> {
        if self.state != DetectorState::Watching || !self.silent(now_ms) {
            return None;
        }
        self.state = DetectorState::Fencing;
        Some(DetectorAction::RunFence)
    }

    /// The peer said it stopped acting (a primary that yielded, authenticated and fresh): no need
    /// to wait for its silence, fence it now.
    pub fn peer_yielded(&mut self) -> Option<DetectorAction> {
        if self.state != DetectorState::Watching || self.role != Role::Backup {
            return None;
        }
        self.state = DetectorState::Fencing;
        Some(DetectorAction::RunFence)
    }

    /// The fencing hook's result.
    pub fn fence_result(&mut self, ok: bool, now_ms: u64) -> Option<DetectorAction> {
        if self.state != DetectorState::Fencing {
            return None;
        }
        if ok {
            return Some(match self.role {
                Role::Backup => {
                    self.state = DetectorState::TookOver;
                    DetectorAction::TakeOver
                }
                Role::Primary => {
                    self.state = DetectorState::PeerFailed;
                    DetectorAction::BackupFailed
                }
            });
        }
        self.fences_failed += 1;
        self.state = DetectorState::Watching;
        self.last_beat = self.last_beat.max(now_ms);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sequence numbers wrap: a FIN of the primary's server more than 2 GiB after its stream's
    /// start is that stream's end, not "a FIN before the stream start" (which is held like a
    /// RST, and makes the primary yield: a whole-host failover at every such close).
    #[test]
    fn primary_fin_after_2_gib_is_a_fin() {
        let (cli, svc): (IpAddr, IpAddr) = ("10.0.9.2".parse().unwrap(), "10.0.0.1".parse().unwrap());
        let key = ConnKey { client: cli, client_port: 40000, server_port: 6379 };
        let mut p = Primary::new(Config { strict: false, max_lag_bytes: u32::MAX, ..Config::default() });
        let c_isn = 77_777u32;
        let syn = tcp::Repr { src_port: 40000, dst_port: 6379, seq: Seq(c_isn), flags: F::SYN, window: 65535, ..Default::default() };
        p.incoming(&ip::tcp_packet(cli, svc, &syn, &[]).unwrap());
        let sa = tcp::Repr { src_port: 6379, dst_port: 40000, seq: Seq(5), ack: Seq(c_isn + 1), flags: F::SYN | F::ACK, window: 65535, ..Default::default() };
        p.outgoing(&mut ip::tcp_packet(svc, cli, &sa, &[]).unwrap(), 0);
        let rec = ConnProgress { client: cli, client_port: 40000, server_port: 6379, rcv_nxt: Seq(c_isn + 1), rcv_edge: Seq(c_isn + 1001), out_end: Seq(6), out_hash: HASH_INIT, last_ack: Seq(0), isn: Seq(0), flags: rw::flag::RCV_KNOWN | rw::flag::ALIGNED };
        p.backup_progress(&Progress { role: Role::Backup, beat: 1, flags: 0, records: vec![rec] }, 1);
        assert_eq!(p.take_transmit().len(), 1, "the SYN-ACK");
        let send = |p: &mut Primary, off: u32, flags: u8, len: usize| {
            let r = tcp::Repr { src_port: 6379, dst_port: 40000, seq: Seq(6u32.wrapping_add(off)), ack: Seq(c_isn + 1), flags: F::ACK | flags, window: 100, ..Default::default() };
            p.outgoing(&mut ip::tcp_packet(svc, cli, &r, &vec![7u8; len]).unwrap(), 2)
        };
        assert!(matches!(send(&mut p, 0, 0, 10), Verdict::Accept { .. }));
        // 2 GiB and more later (the bytes in between are not the point); the backup's reports,
        // like the stream, move in steps.
        let far = (1u32 << 31) + 100;
        let c = p.conns.get_mut(&key).unwrap();
        (c.p_end, c.rel, c.snd_c, c.snd_p, c.client_ack) = (Seq(6 + far), Seq(6 + far), Seq(6 + far), Seq(6 + far), Seq(6 + far));
        let report = |p: &mut Primary, beat: u64, end: u32| {
            let rec = ConnProgress { out_end: Seq(end), ..rec };
            p.backup_progress(&Progress { role: Role::Backup, beat, flags: 0, records: vec![rec] }, 3);
        };
        report(&mut p, 2, 6 + (1 << 30));
        report(&mut p, 3, 6 + far);
        assert!(matches!(send(&mut p, far, 0, 10), Verdict::Accept { .. }));
        report(&mut p, 4, 6 + far + 10);
        assert_eq!(send(&mut p, far + 10, F::FIN, 0), Verdict::Held, "a FIN, waiting for the backup's");
        assert_eq!(p.counters.rst_held, 0);
        p.tick(10_000);
        let n = p.take_notices();
        assert!(n.is_empty(), "no yield: {n:?}");
    }

    #[test]
    fn detector_backup_fences_before_taking_over() {
        let mut d = Detector::new(DetectorConfig { interval_ms: 10, misses: 3 }, Role::Backup, 0);
        assert_eq!(DetectorConfig::default(), DetectorConfig { interval_ms: 10, misses: 10 }, "the daemon's default: 100 ms of silence");
        for t in (0..100).step_by(10) {
            d.beat(t);
            assert_eq!(d.tick(t + 5), None);
        }
        assert_eq!(d.tick(90 + 30), None, "three missed beats are not yet a suspicion");
        assert_eq!(d.tick(90 + 31), Some(DetectorAction::RunFence));
        assert_eq!(d.tick(200), None, "one fence at a time");
        assert_eq!(d.fence_result(false, 210), None);
        assert_eq!(d.state(), DetectorState::Watching);
        assert_eq!(d.tick(230), None);
        assert_eq!(d.tick(241), Some(DetectorAction::RunFence));
        assert_eq!(d.fence_result(true, 245), Some(DetectorAction::TakeOver));
        assert_eq!(d.state(), DetectorState::TookOver);
        assert_eq!(d.fences_failed, 1);
    }

    #[test]
    fn detector_primary_declares_backup_failed() {
        let mut d = Detector::new(DetectorConfig { interval_ms: 50, misses: 2 }, Role::Primary, 1000);
        assert_eq!(d.tick(1100), None);
        assert_eq!(d.tick(1101), Some(DetectorAction::RunFence));
        assert_eq!(d.fence_result(true, 1102), Some(DetectorAction::BackupFailed));
        d.beat(1102);
        assert_eq!(d.tick(2000), None);
        assert_eq!(d.state(), DetectorState::PeerFailed);
    }
}
