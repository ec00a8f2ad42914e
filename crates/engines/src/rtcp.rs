//! RTCP, the man-in-the-middle TCP recovery filter (seed 004), as a sans-I/O engine.
//!
//! Read side by side with section 3.1 of the paper: [`incoming`] is algorithm I (I1-I4),
//! [`outgoing`] is algorithm O (O1-O9), [`command`] is algorithm C (C1-C6). *A* is the
//! protected application, *B* its remote peer. Like librtcp, the engine keeps a constant
//! [`Conn`] per connection (36 bytes, asserted by a test: the paper's 32 and the end of what
//! *A*'s current socket sent, see [`Conn::a_end`]), buffers nothing, has no clock, and a
//! zeroed `Conn` means both "new connection" and "the filter restarted" (section 2.7).
//!
//! Beyond the paper, required by unbroken:
//! - SACK edges are shifted with Δ wherever they name *A*'s sequence space (the peer's SACK
//!   blocks, incoming). *B*'s sequence space is never renumbered: the synthesized SYN-ACK takes
//!   ISN = ackA - 1, so *A*'s SACK blocks (outgoing) already name the numbers *B* uses.
//! - PAWS: when the recovered socket's timestamp clock differs from the old one, the engine keeps
//!   a per-connection offset so the TSval *B* sees stays monotonic, and subtracts it from the
//!   TSecr *B* echoes.
//! - Window scale: if the new socket picked another window scale than the old one, *A*'s window
//!   field is rescaled to the shift *B* still applies.
//! - Section 6's last improvement: when a recovery SYN finds no state (the filter restarted), it
//!   is forwarded, and *B*'s answering (challenge) ACK is rewritten at once into the SYN-ACK *A*
//!   expects, instead of waiting a second for *A* to retransmit the SYN.
//! - Recovery (O5) also clears `ack_everything`: the paper returns to "its default behavior before
//!   the RTCP_SHUTDOWN", which must include not acknowledging everything.
//! - After a recovery and until the application's RTCP_TELL, the new socket's stream origin
//!   moves with ackB ([`flag::ORIGIN_PINNED`]): when *B* acknowledges more of the dead
//!   incarnation's output, Δ shrinks by as much, so the TELL reports exactly where the new
//!   socket's stream begins, and *B*'s acknowledgments never run ahead of what the new socket
//!   sent (found by tests/sim.rs, `o5_tell_after_peer_acknowledged_more` and
//!   `s2_4_shutdown_then_crash_twice_at_every_packet`).
//! - O7 never raises the ACK above what *A*'s TCP itself acknowledges (`min(ackA, ACK)`), so a
//!   buggy or hostile ACKNOWLEDGE cannot make the peer drop bytes *A* never received.
//! - A pure ACK from *B* whose SEQ (B's SND.NXT) lies beyond the right edge *B* last saw from
//!   *A* is given that edge as SEQ, so a recovered socket with a smaller window than the dead one
//!   still reads its ACK field (found with the guard's recovery nudge on bulk streams).
//! - Every packet from *B* may be forged (issue 9, item 2): its checksum must verify and it must
//!   lie where *A*'s TCP could accept it before it changes the state; RSTs follow RFC 5961 and
//!   never change the state; *B*'s SYN on a synchronized connection is left to *A*'s TCP's
//!   challenge ACK ([`incoming_with`]).
//! - When O7 lowers the ACK, the window grows by the same amount, so the right edge *B* sees is
//!   *A*'s real one. Without it, an application that stops reading while it writes (its kernel
//!   holding more than a window beyond ackA) deadlocks: *B*'s ACKs arrive with a SEQ *A*'s TCP
//!   discards as old, so *A*'s output never drains (found by the >4 GiB echo test).
//! - *B*'s acknowledgments never run ahead of what *A*'s current socket sent ([`Conn::a_end`],
//!   4 bytes beyond the paper's 32): after a recovery, *B* may still acknowledge the dead
//!   incarnation's output or FIN, beyond anything the new socket has resent yet. *A*'s TCP
//!   discards such an ACK (RFC 793 3.9), so an application waiting for its FIN's
//!   acknowledgement hung, and a sender whose congestion window was smaller than the old data
//!   in flight stalled. The ACK is lowered to the new socket's end: true (*B* has every byte
//!   below it) and acceptable (issue 21, item 2; `peer_acks_of_an_old_fin_after_tell_are_clamped`).
//! - *A*'s SYN-ACK (*A* the server) records ackB0, its SEQ + 1, in `ack_b` without setting
//!   RECOVERABLE: the only ACK *B*'s handshake can carry. ADOPT can then hand over a connection
//!   whose application died before *B*'s handshake ACK arrived (issue 21, item 3). Its
//!   recovery SYN is forwarded with *A*'s old ISN, so that a *B* that never got the SYN-ACK
//!   (still in SYN-SENT) answers the old numbering with a simultaneous open's SYN-ACK, which
//!   becomes the new socket's SYN-ACK like section 6's challenge ACK.

use unbroken_wire::ctl::{self, Command, ConnOptions, Op};
use unbroken_wire::ip::{self, IpInfo};
use unbroken_wire::tcp::{self, flags as F, kind, Packet as Tcp, Repr};
use unbroken_wire::{Error, Result, Seq};

use crate::Verdict;

/// Window scale nibble meaning "no window scaling on this connection / not known".
const WS_NONE: u8 = 15;
/// MSS assumed for a synthesized SYN-ACK when neither the handshake nor the application told us
/// the peer's (fits IPv6's minimum MTU with room for options).
pub const FALLBACK_MSS: u16 = 1220;

/// State bits of [`Conn::flags`].
pub mod flag {
    /// `ackB` is meaningful (an ACK from *B* was seen).
    pub const RECOVERABLE: u16 = 1 << 0;
    /// *A* announced RTCP_SHUTDOWN or SHUTDOWN_WRITING: its FINs are genuine.
    pub const FIN_ALLOWED: u16 = 1 << 1;
    /// `ackA` is meaningful.
    pub const ACK_ALLOWED: u16 = 1 << 2;
    /// *A* announced SHUTDOWN or SHUTDOWN_READING: stop checkpointing acknowledgments.
    pub const ACK_EVERYTHING: u16 = 1 << 3;
    /// The negotiated options (peer MSS, window scales, SACK, timestamps) are known.
    pub const OPTS_KNOWN: u16 = 1 << 4;
    pub const SACK_OK: u16 = 1 << 5;
    pub const TS_OK: u16 = 1 << 6;
    /// `ts_a` holds a TSval *B* has seen from *A* (in *B*'s view).
    pub const TS_A_KNOWN: u16 = 1 << 7;
    /// `ts_b` holds *B*'s latest TSval.
    pub const TS_B_KNOWN: u16 = 1 << 8;
    /// A recovery SYN was forwarded to *B* for lack of state; `delta` holds its SEQ and
    /// `ts_off` its TSval until *B*'s answer arrives (section 6).
    pub const SYN_PENDING: u16 = 1 << 9;
    /// The pending SYN offered SACK / timestamps.
    pub const PEND_SACK: u16 = 1 << 10;
    pub const PEND_TS: u16 = 1 << 11;
    /// Not `SYN_PENDING` (the bit is `PEND_SACK`'s, which only means something while a SYN is
    /// pending): a recovered socket has sent no data yet, and its stream origin is pinned to
    /// `ackB` (Δ = its ISN + 1 - ackB). Set by the SYN-ACK (O5, section 6), cleared by
    /// RTCP_TELL or the socket's first data. Meanwhile, when *B* acknowledges more of the dead
    /// incarnation's output, Δ follows ackB. Without it, either TELL reports a later ackB than
    /// the origin (the application resumes past the socket's first byte: a corrupt stream), or
    /// ackB stays behind *B* and *B*'s ACKs acknowledge data the new socket never sent (which
    /// *A*'s TCP discards, stalling it when Nagle or its congestion window waits for them).
    pub const ORIGIN_PINNED: u16 = PEND_SACK;
    /// `a_win` holds the last window field *B* saw from *A*.
    pub const A_WIN_KNOWN: u16 = 1 << 12;
    /// A genuine FIN went out from *A* / a FIN came in from *B*.
    pub const FIN_A_SEEN: u16 = 1 << 13;
    pub const FIN_B_SEEN: u16 = 1 << 14;
    /// Δ and the timestamp offset are known: this state witnessed the connection's handshake or
    /// its last recovery. A restarted filter may learn ackA from an RTCP_ACKNOWLEDGE that
    /// arrives before the application's next packet, but never Δ; without this bit it would
    /// forward that packet unrenumbered (section 2.7 assumes the packet comes first).
    pub const SYNCED: u16 = 1 << 15;
}

/// Per-connection state: 36 bytes, all zero for a new connection or a restarted filter.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Conn {
    /// Δ: *A*'s current sequence space minus *B*'s view of it (outgoing SEQ -= Δ, incoming
    /// ACK += Δ). While `SYN_PENDING`: the pending SYN's SEQ.
    pub delta: u32,
    /// ackB: *B*'s latest acknowledgment (*B*'s view of *A*'s sequence space).
    pub ack_b: u32,
    /// ackA: the checkpointed acknowledgment (*B*'s sequence space).
    pub ack_a: u32,
    /// *B*'s latest TSval.
    pub ts_b: u32,
    /// Latest TSval *B* has seen from *A*, after the offset.
    pub ts_a: u32,
    /// Added to *A*'s TSval going out, subtracted from *B*'s TSecr coming in. While
    /// `SYN_PENDING`: the pending SYN's TSval.
    pub ts_off: u32,
    /// The end (SEQ + length, SYN and FIN counted) of what *A*'s current socket has sent, in
    /// *B*'s view of *A*'s sequence space (after O8): set by the handshake and by a recovery (the
    /// new socket's origin, ackB), raised by every segment O forwards. *B*'s ACKs beyond it are
    /// lowered to it (they acknowledge an earlier incarnation's output, which this socket has
    /// not resent yet). Meaningful once `SYNCED` and `A_WIN_KNOWN` hold (no flag bit is free).
    /// Not in the paper's 32 bytes (issue 21, item 2).
    pub a_end: u32,
    /// *B*'s MSS from the handshake (0 unknown).
    pub b_mss: u16,
    /// Last window field *B* saw from *A*.
    pub a_win: u16,
    /// Low nibble: *B*'s window scale; high nibble: *A*'s window scale as *B* applies it
    /// (15 = none).
    pub ws: u8,
    /// Low nibble: the window scale of *A*'s current socket; high nibble: the scale offered by
    /// a pending or first SYN from *A* (15 = none).
    pub ws_cur: u8,
    /// [`flag`] bits.
    pub flags: u16,
}

/// Something worth counting or logging that happened to a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// O1: a RST from *A*'s TCP was dropped.
    SpuriousRstDropped,
    /// O6: a FIN from *A* without SHUTDOWN was turned into a RST for *A*.
    SpuriousFinReset,
    /// O6: a packet from *A* with no checkpointed ACK or no Δ known (filter restarted) was turned
    /// into a RST for *A*, forcing its recovery (section 2.7).
    NoCheckpointReset,
    /// O5: a recovery SYN was answered at once with a synthesized SYN-ACK.
    Recovered,
    /// O4: a recovery SYN met no state and was forwarded to elicit *B*'s ACK.
    RecoverySynForwarded,
    /// Section 6: *B*'s ACK was rewritten into the SYN-ACK for a pending recovery SYN.
    RecoveredFromPeerAck,
    /// *B*'s ACK arrived for a pending SYN, but no checkpoint is known yet: rewritten into a
    /// RST for *A*'s SYN, so the application recovers again (ACKNOWLEDGE first).
    PendingWithoutCheckpoint,
    /// A packet without SYN or ACK from *A*: not valid TCP, dropped.
    BogusFlags,
    /// I0: a packet from *B* met a state that cannot translate it (the filter restarted):
    /// rewritten into an out-of-window ACK that makes *A*'s TCP answer, so O6 can reset it.
    PeerWithoutState,
    /// A packet from *B* with a TCP checksum that does not verify: dropped, nothing learned
    /// (issue 9, item 2).
    PeerBadChecksum,
    /// A packet from *B* outside the window *A*'s TCP could accept (its SEQ beyond ackA + span,
    /// a RST's SEQ outside [ackA, ackA + span], a SYN-ACK that answers no pending SYN):
    /// dropped, nothing learned (issue 9, item 2; RFC 5961).
    PeerOutOfWindow,
    /// A SYN from *B* on a synchronized connection: forwarded unchanged without touching the
    /// state, so *A*'s own TCP answers it with a challenge ACK (RFC 5961 section 4).
    PeerSynChallenged,
}

/// Whether [`incoming_with`] must verify *B*'s TCP checksum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerChecksum {
    /// Verify it (what [`incoming`] does): a packet that fails is dropped unlearned.
    Verify,
    /// The checksum field is not final (a locally built packet handed over with a partial
    /// checksum, e.g. NFQUEUE's `csum_not_ready`): it cannot be verified and never crossed a
    /// wire.
    Partial,
}

/// The engine's answer for one packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// `Accept { modified }` (sent on its way; `modified` when any byte changed), `Drop`, or
    /// `Inject`: rewritten into a packet travelling the other way (back toward its sender),
    /// which the driver must inject instead of forwarding. The engine gives no other verdict.
    pub verdict: Verdict,
    /// New length of the packet in the buffer.
    pub len: usize,
    pub event: Option<Event>,
}

/// An accepted packet some of whose bytes the engine rewrote.
const REWRITTEN: Verdict = Verdict::Accept { modified: true };

impl Outcome {
    fn forward(len: usize, modified: bool) -> Outcome {
        Outcome { verdict: Verdict::Accept { modified }, len, event: None }
    }
    fn with(verdict: Verdict, len: usize, event: Event) -> Outcome {
        Outcome { verdict, len, event: Some(event) }
    }
    /// True when any byte of the packet changed (a driver holding a packet with a partial
    /// checksum, e.g. a GSO packet from NFQUEUE, must then recompute the full TCP checksum).
    pub fn modified(&self) -> bool {
        match self.verdict {
            Verdict::Accept { modified } => modified,
            Verdict::Inject => true,
            _ => false,
        }
    }
}

impl Conn {
    #[inline]
    fn has(&self, f: u16) -> bool {
        self.flags & f != 0
    }
    #[inline]
    fn set(&mut self, f: u16) {
        self.flags |= f;
    }
    #[inline]
    fn clear(&mut self, f: u16) {
        self.flags &= !f;
    }
    fn b_ws(&self) -> u8 {
        self.ws & 0x0f
    }
    fn a_ws_b(&self) -> u8 {
        self.ws >> 4
    }
    fn set_ws(&mut self, b: u8, a: u8) {
        self.ws = (a.min(WS_NONE) << 4) | b.min(WS_NONE);
    }
    fn a_ws_cur(&self) -> u8 {
        self.ws_cur & 0x0f
    }
    fn a_ws_offered(&self) -> u8 {
        self.ws_cur >> 4
    }
    fn set_ws_cur(&mut self, cur: u8, offered: u8) {
        self.ws_cur = (offered.min(WS_NONE) << 4) | cur.min(WS_NONE);
    }
    /// True once both directions closed with genuine FINs: the driver may forget the state
    /// after its own TIME-WAIT-like grace period (the engine has no clock).
    pub fn is_closed(&self) -> bool {
        self.has(flag::FIN_A_SEEN) && self.has(flag::FIN_B_SEEN)
    }
    /// True when the state is all zero (never saw a packet or command).
    pub fn is_empty(&self) -> bool {
        *self == Conn::default()
    }
    /// The connection options as far as known, for TELL responses.
    pub fn options(&self) -> Option<ConnOptions> {
        if !self.has(flag::OPTS_KNOWN) {
            return None;
        }
        let ws = |v: u8| if v == WS_NONE { None } else { Some(v) };
        Some(ConnOptions {
            peer_mss: self.b_mss,
            peer_wscale: ws(self.b_ws()),
            app_wscale: ws(self.a_ws_b()),
            sack: self.has(flag::SACK_OK),
            timestamps: self.has(flag::TS_OK),
        })
    }
    /// Flag bits as reported in a TELL response (see [`ctl::flag`]).
    fn ctl_flags(&self) -> u8 {
        let mut f = 0;
        for (mine, theirs) in [
            (flag::ACK_ALLOWED, ctl::flag::ACK_ALLOWED),
            (flag::RECOVERABLE, ctl::flag::RECOVERABLE),
            (flag::FIN_ALLOWED, ctl::flag::FIN_ALLOWED),
            (flag::ACK_EVERYTHING, ctl::flag::ACK_EVERYTHING),
        ] {
            if self.has(mine) {
                f |= theirs;
            }
        }
        f
    }
}

/// Options found in a segment, with unknown ones already overwritten with NOPs (I1/O2).
#[derive(Default)]
struct Opts {
    mss: Option<u16>,
    ws: Option<u8>,
    sack_perm: bool,
    /// Header offset of the timestamp option, and its values.
    ts_at: Option<usize>,
    tsval: u32,
    tsecr: u32,
    /// Header offset and block count of the SACK option.
    sack_at: Option<usize>,
    sack_n: usize,
}

/// I1 / O2: scan the options, suppress the unrecognized ones with NOPs.
fn scan_options(t: &mut Tcp<&mut [u8]>) -> Result<(Opts, bool)> {
    // One read-only walk. Unrecognized options are rare (mostly on SYNs): count them here and
    // overwrite them afterwards, one walk each, instead of keeping slots on every packet's path.
    let mut o = Opts::default();
    let mut n_unknown = 0;
    for s in t.option_slots() {
        let s = s?;
        match tcp::parse_option(&t.as_bytes()[s.offset..s.offset + s.len])? {
            tcp::TcpOption::Mss(m) => o.mss = Some(m),
            tcp::TcpOption::WindowScale(w) => o.ws = Some(w.min(14)),
            tcp::TcpOption::SackPermitted => o.sack_perm = true,
            tcp::TcpOption::Timestamp { tsval, tsecr } => {
                o.ts_at = Some(s.offset);
                o.tsval = tsval;
                o.tsecr = tsecr;
            }
            tcp::TcpOption::Sack(_, k) => {
                o.sack_at = Some(s.offset);
                o.sack_n = k as usize;
            }
            tcp::TcpOption::Unknown { .. } => n_unknown += 1,
            tcp::TcpOption::NoOp | tcp::TcpOption::EndOfList => {}
        }
    }
    for _ in 0..n_unknown {
        let known = |k: u8| matches!(k, kind::EOL | kind::NOP | kind::MSS | kind::WSCALE | kind::SACK_PERM | kind::SACK | kind::TIMESTAMP);
        // The walk above validated every slot, so this one cannot fail.
        if let Some(s) = t.option_slots().flatten().find(|s| !known(s.kind)) {
            t.nop_option(s);
        }
    }
    Ok((o, n_unknown > 0))
}

/// The TCP view of the segment of `buf[..len]`, whose IP facts the caller parsed (once):
/// an `info` that does not fit `len` is an error, never a panic.
fn tcp_at<'a>(buf: &'a mut [u8], len: usize, info: &IpInfo) -> Result<Tcp<&'a mut [u8]>> {
    if info.protocol != ip::PROTO_TCP {
        return Err(Error::Unsupported("not tcp"));
    }
    let end = info.l4_offset.checked_add(info.l4_len).filter(|&e| e <= len.min(buf.len())).ok_or(Error::Truncated)?;
    Tcp::new_checked(&mut buf[info.l4_offset..end])
}

/// Writes a complete packet `src -> dst` with TCP header `r` and no payload into `buf`,
/// checksums filled. Returns its length.
fn emit_segment(buf: &mut [u8], src: std::net::IpAddr, dst: std::net::IpAddr, r: &Repr) -> Result<usize> {
    let tl = r.header_len();
    let hl = ip::emit_header(buf, src, dst, ip::PROTO_TCP, tl)?;
    r.emit(&mut buf[hl..hl + tl])?;
    let pseudo = ip::pseudo_sum(src, dst, ip::PROTO_TCP, tl);
    Tcp::new_checked(&mut buf[hl..hl + tl])?.fill_checksum(pseudo);
    Ok(hl + tl)
}

/// Rewrites the packet in `buf` into a bare RST for *A* (as if from *B*) that *A*'s TCP accepts:
/// SEQ = the ACK field of *A*'s own packet (its RCV.NXT). No options, so no PAWS check applies.
fn reflect_rst(buf: &mut [u8], info: &IpInfo, a_port: u16, b_port: u16, a_rcv_nxt: Seq) -> Result<usize> {
    let r = Repr { src_port: b_port, dst_port: a_port, seq: a_rcv_nxt, flags: F::RST, ..Default::default() };
    emit_segment(buf, info.dst, info.src, &r)
}

/// What a SYN from *A* offered, needed to build the answer.
struct SynOffer {
    seq: Seq,
    tsval: u32,
    ws: u8,
    sack: bool,
    ts: bool,
    mss: Option<u16>,
}

/// O5 / section 6: the SYN-ACK *A*'s recovering TCP expects, as if from *B*: SEQ = ackA - 1 so
/// *B*'s numbering continues unchanged, ACK = the SYN's SEQ + 1, and only options both the
/// original connection and the new SYN have. Updates Δ, the timestamp offset and window scales.
fn synthesize_synack(c: &mut Conn, buf: &mut [u8], a: std::net::IpAddr, b: std::net::IpAddr, a_port: u16, b_port: u16, syn: &SynOffer, b_window: u16) -> Result<usize> {
    c.delta = (syn.seq + 1 - Seq(c.ack_b)) as u32; // Δ ← seq + 1 - ackB
    c.a_end = c.ack_b; // the new socket's origin: it has sent nothing but its SYN
    let known = c.has(flag::OPTS_KNOWN);
    let b_ws = if known { c.b_ws() } else { WS_NONE };
    let use_ws = b_ws != WS_NONE && syn.ws != WS_NONE;
    let use_sack = known && c.has(flag::SACK_OK) && syn.sack;
    let use_ts = known && c.has(flag::TS_OK) && syn.ts;
    let mss = match (known && c.b_mss != 0, syn.mss) {
        (true, Some(m)) => c.b_mss.min(m.max(FALLBACK_MSS)),
        (true, None) => c.b_mss,
        (false, Some(m)) => m.min(FALLBACK_MSS.max(536)).max(536),
        (false, None) => FALLBACK_MSS,
    };
    let a_ws_b = if known { c.a_ws_b() } else { WS_NONE };
    // The new socket applies syn.ws to its own windows only if we answer with a WS option.
    c.set_ws_cur(if use_ws { syn.ws } else { WS_NONE }, WS_NONE);
    if !known {
        // Without knowledge the best guess is that nothing changed.
        c.set_ws(WS_NONE, if use_ws { syn.ws } else { WS_NONE });
    } else {
        c.set_ws(b_ws, a_ws_b);
    }
    c.ts_off = if use_ts && c.has(flag::TS_A_KNOWN) { c.ts_a.wrapping_add(1).wrapping_sub(syn.tsval) } else { 0 };
    let r = Repr {
        src_port: b_port,
        dst_port: a_port,
        seq: Seq(c.ack_a) - 1,
        ack: syn.seq + 1,
        flags: F::SYN | F::ACK,
        window: b_window,
        mss: Some(mss),
        wscale: if use_ws { Some(b_ws) } else { None },
        sack_perm: use_sack,
        timestamp: if use_ts { Some((c.ts_b, syn.tsval)) } else { None },
        ..Default::default()
    };
    c.clear(flag::FIN_ALLOWED | flag::ACK_EVERYTHING | flag::SYN_PENDING | flag::PEND_SACK | flag::PEND_TS | flag::FIN_A_SEEN);
    c.set(flag::SYNCED | flag::ORIGIN_PINNED);
    emit_segment(buf, b, a, &r)
}

/// How far from the checkpoint ackA a segment of *B* may lie and still teach the engine
/// anything: the largest window *A* can announce with the scale *B* applies (`0xffff << ws`;
/// ws 14 when the options are not known). `None` when ackA says nothing about where *A*'s
/// TCP receives (no checkpoint known yet, or acknowledgments no longer checkpointed).
///
/// *B*'s SND.NXT never lies beyond a right edge *A* (or the guard, C2) announced, and every
/// such edge is at most ackA + span, because ackA only grows.
fn peer_span(c: &Conn) -> Option<u32> {
    if !c.has(flag::ACK_ALLOWED) || c.has(flag::ACK_EVERYTHING) {
        return None;
    }
    let s = if !c.has(flag::OPTS_KNOWN) {
        14
    } else if c.a_ws_b() == WS_NONE {
        0
    } else {
        c.a_ws_b() as u32
    };
    Some(0xffff_u32 << s)
}

/// Where a segment of *B* lies relative to what *A*'s TCP could accept (issue 9, item 2).
#[derive(PartialEq, Eq)]
enum Place {
    /// Overlaps or follows ackA within the span: the engine may learn from it.
    InWindow,
    /// Entirely below ackA: an old duplicate (the network may deliver one arbitrarily late).
    /// Forwarded (A's TCP answers it with a duplicate ACK, as it would a forged one) but
    /// nothing is learned from it.
    Old,
    /// Beyond ackA + span: no TCP would accept it. Dropped.
    Outside,
}

fn place(c: &Conn, seq: Seq, seg_len: u32) -> Place {
    let Some(span) = peer_span(c) else { return Place::InWindow };
    let ack_a = Seq(c.ack_a);
    if seq.ge(ack_a) {
        return if seq - ack_a <= span { Place::InWindow } else { Place::Outside };
    }
    if (seq + seg_len).gt(ack_a) {
        Place::InWindow
    } else {
        Place::Old
    }
}

/// Algorithm I: a packet from *B* to *A*. `buf[..len]` is the IP packet; `buf` may be longer
/// (room to grow: a rewrite into a SYN-ACK needs up to 40 bytes more than a bare ACK). The TCP
/// checksum is verified ([`incoming_with`]).
pub fn incoming(c: &mut Conn, buf: &mut [u8], len: usize) -> Result<Outcome> {
    incoming_with(c, buf, len, PeerChecksum::Verify)
}

/// [`incoming`], saying whether the packet's checksum can be verified.
///
/// Every packet from *B* may be forged (issue 9, item 2): the state changes only for a packet
/// whose checksum verifies and that lies where *A*'s TCP could accept it ([`peer_span`]):
/// - a RST is forwarded (its ACK shifted) only when its SEQ lies in [ackA, ackA + span]: *A*'s
///   own TCP then applies RFC 5961 (an exact SEQ resets, an inexact one draws a challenge
///   ACK); any other RST is dropped. A RST never changes the state;
/// - a SYN on a synchronized connection changes nothing and goes to *A*'s TCP, which answers
///   it with a challenge ACK (RFC 5961 section 4); a SYN-ACK must answer the SYN that is
///   pending (its ACK = that SYN's SEQ + 1);
/// - any other segment beyond ackA + span is dropped; one entirely below ackA (an old
///   duplicate, or a forgery) is forwarded without teaching anything (ackB, timestamps, FIN).
///
/// Not checked here: that *B*'s ACK field stays below what *A* ever sent (an ACK beyond what the
/// current socket sent is lowered to it, [`Conn::a_end`], but may be genuine: an earlier
/// incarnation sent more; the guard's flow table drops one beyond the connection's end when it
/// saw the handshake), nor
/// its TSecr (a restarted filter knows only a lower bound of the TSval
/// *B* saw last). A forger must still land its SEQ in the span (odds span / 2^32 per try); a
/// wrong ackB then shows at the application's recovery as `DeliveredBeyondSent`, never as a
/// corrupt stream.
pub fn incoming_with(c: &mut Conn, buf: &mut [u8], len: usize, csum: PeerChecksum) -> Result<Outcome> {
    let info = IpInfo::parse(&buf[..len])?;
    incoming_parsed(c, buf, len, &info, csum)
}

/// [`incoming_with`] for a packet whose IP header the caller already parsed into `info` (the
/// guard does, to find the flow): the packet is parsed once.
pub fn incoming_parsed(c: &mut Conn, buf: &mut [u8], len: usize, info: &IpInfo, csum: PeerChecksum) -> Result<Outcome> {
    let info = *info;
    let mut t = tcp_at(buf, len, &info)?;
    if csum == PeerChecksum::Verify && !t.verify_checksum(info.pseudo_sum(info.l4_len)) {
        return Ok(Outcome::with(Verdict::Drop, len, Event::PeerBadChecksum));
    }
    // I1. Handle options.
    let (o, mut modified) = scan_options(&mut t)?;
    let f = t.flags();
    let (a_port, b_port) = (t.dst_port(), t.src_port());
    let synchronized = c.has(flag::RECOVERABLE) && c.has(flag::SYNCED) && !c.is_closed();
    let where_ = place(c, t.seq(), t.seq_len());
    let out_of_window = Outcome::with(Verdict::Drop, len, Event::PeerOutOfWindow);
    // B's SYN-ACK to a recovery SYN that `outgoing` sent with A's old ISN (an adopted
    // connection inside its handshake whose SYN-ACK B never got: a simultaneous open). It
    // confirms ackB0 and becomes the SYN-ACK A's new socket waits for, as in section 6.
    let renumbered_answer = c.has(flag::SYN_PENDING) && c.has(flag::SYNCED) && c.has(flag::OPTS_KNOWN) && !c.has(flag::RECOVERABLE) && f & (F::SYN | F::ACK | F::RST) == F::SYN | F::ACK && t.ack() == Seq(c.ack_b) && t.seq() + 1 == Seq(c.ack_a);

    if f & F::RST != 0 {
        // RFC 5961 section 3: only a RST within A's receive window may reach A's TCP, which
        // checks its SEQ exactly. The guard's lower edge is the checkpoint (A's RCV.NXT is at
        // least that), so its window contains A's.
        if peer_span(c).is_some() && (where_ != Place::InWindow || t.seq().lt(Seq(c.ack_a))) {
            return Ok(out_of_window);
        }
        // A reset from B ends the connection for A's TCP; keep our state (a spoofed RST must not
        // wipe it) and shift its ACK like any other.
        if f & F::ACK != 0 && c.delta != 0 && !c.has(flag::SYN_PENDING) {
            t.rewrite_ack(t.ack() + c.delta);
            modified = true;
        }
        return Ok(Outcome::forward(len, modified));
    }

    if f & F::SYN != 0 {
        if f & F::ACK == 0 && synchronized {
            // RFC 5961 section 4: A's TCP answers with a challenge ACK; B, if it really
            // restarted, resets with that ACK's number. Nothing here is learned from it.
            return Ok(Outcome { event: Some(Event::PeerSynChallenged), ..Outcome::forward(len, modified) });
        }
        if f & F::ACK != 0 {
            // A SYN-ACK answers A's SYN: the one pending, if any; none on a synchronized
            // connection (a forged one would re-key the checkpoint and Δ).
            let pending = c.has(flag::SYN_PENDING);
            if !pending && synchronized && t.seq() + 1 == Seq(c.ack_a) && c.delta == 0 {
                // B resends its SYN-ACK (A's handshake ACK was lost): A's TCP answers it again.
                return Ok(Outcome::forward(len, modified));
            }
            if (pending && t.ack() != Seq(c.delta) + 1 && !renumbered_answer) || (!pending && synchronized) {
                return Ok(out_of_window);
            }
        }
    } else {
        match where_ {
            Place::Outside => return Ok(out_of_window),
            Place::Old => {
                // Translate it like any other (A's TCP answers it with a duplicate ACK) but
                // learn nothing from it.
                if f & F::ACK != 0 && !c.has(flag::SYN_PENDING) && c.has(flag::SYNCED) {
                    let ack = peer_ack(c, t.ack());
                    if c.delta != 0 || ack != t.ack() {
                        t.rewrite_ack(ack + c.delta);
                        shift_sack(&mut t, &o, c.delta);
                        modified = true;
                    }
                }
                if let (Some(at), true) = (o.ts_at, c.ts_off != 0 && o.tsecr != 0 && !c.has(flag::SYN_PENDING)) {
                    t.rewrite_u32_at(at + 6, o.tsecr.wrapping_sub(c.ts_off));
                    modified = true;
                }
                return Ok(Outcome::forward(len, modified));
            }
            Place::InWindow => {}
        }
    }

    // Timestamps: remember B's clock and what B has seen of A's.
    if let Some(at) = o.ts_at {
        if !c.has(flag::TS_B_KNOWN) || Seq(o.tsval).gt(Seq(c.ts_b)) {
            c.ts_b = o.tsval;
            c.set(flag::TS_B_KNOWN);
        }
        if o.tsecr != 0 && (!c.has(flag::TS_A_KNOWN) || Seq(o.tsecr).gt(Seq(c.ts_a))) {
            c.ts_a = o.tsecr;
            c.set(flag::TS_A_KNOWN);
        }
        if c.ts_off != 0 && o.tsecr != 0 && !c.has(flag::SYN_PENDING) {
            t.rewrite_u32_at(at + 6, o.tsecr.wrapping_sub(c.ts_off));
            modified = true;
        }
    }

    // I2. Initialize checkpointed acknowledgments: SEQ is B's initial sequence number.
    if f & F::SYN != 0 && !renumbered_answer {
        let syn_ack = f & F::ACK != 0;
        c.ack_a = (t.seq() + 1).0;
        c.set(flag::ACK_ALLOWED);
        // A new connection starts unshifted.
        c.delta = 0;
        c.ts_off = 0;
        c.clear(flag::SYN_PENDING | flag::ORIGIN_PINNED | flag::FIN_ALLOWED | flag::ACK_EVERYTHING | flag::FIN_A_SEEN | flag::FIN_B_SEEN);
        c.set(flag::SYNCED);
        // What A sent is known again from A's SYN-ACK (A is the server) or from B's SYN-ACK.
        c.clear(flag::A_WIN_KNOWN);
        c.a_end = if syn_ack { t.ack().0 } else { 0 };
        c.b_mss = o.mss.unwrap_or(536);
        let b_ws = o.ws.unwrap_or(WS_NONE);
        if syn_ack {
            // B's SYN-ACK carries the negotiated set: A offered its scale in its SYN.
            let a_ws = if b_ws == WS_NONE { WS_NONE } else { c.a_ws_offered() };
            let b_ws = if a_ws == WS_NONE { WS_NONE } else { b_ws };
            c.set_ws(b_ws, a_ws);
            c.set_ws_cur(a_ws, WS_NONE);
            c.clear(flag::SACK_OK | flag::TS_OK);
            if o.sack_perm {
                c.set(flag::SACK_OK);
            }
            if o.ts_at.is_some() {
                c.set(flag::TS_OK);
            }
            c.set(flag::OPTS_KNOWN);
        } else {
            // B's SYN: A's SYN-ACK completes the negotiation.
            c.set_ws(b_ws, WS_NONE);
            c.clear(flag::OPTS_KNOWN | flag::SACK_OK | flag::TS_OK);
            if o.sack_perm {
                c.set(flag::SACK_OK);
            }
            if o.ts_at.is_some() {
                c.set(flag::TS_OK);
            }
        }
    }

    if f & F::ACK != 0 {
        let ack = t.ack();
        if c.has(flag::RECOVERABLE) && ack.gt(Seq(c.ack_b)) && c.has(flag::ORIGIN_PINNED) && !c.has(flag::SYN_PENDING) {
            // The recovered socket has sent nothing yet: its stream now begins where B is.
            c.delta = c.delta.wrapping_sub(ack - Seq(c.ack_b));
            c.ack_b = ack.0;
            c.a_end = ack.0;
        } else if !c.has(flag::RECOVERABLE) || ack.ge(Seq(c.ack_b)) {
            c.ack_b = ack.0;
        }
        c.set(flag::RECOVERABLE);

        // Section 6: B's answer to a forwarded recovery SYN becomes the SYN-ACK A waits for.
        if c.has(flag::SYN_PENDING) && (f & F::SYN == 0 || renumbered_answer) {
            if !c.has(flag::ACK_ALLOWED) && !c.has(flag::ACK_EVERYTHING) {
                // No checkpoint: the filter restarted after the application's ACKNOWLEDGE and
                // before its SYN. Nothing would ever teach us ackA (the SDK sends ACKNOWLEDGE
                // once per recovery), so the SYN would be retransmitted in vain until the
                // application's connect timed out (10 s by default). Reset the SYN instead: the
                // application recovers again at once, ACKNOWLEDGE first.
                let syn_seq = Seq(c.delta);
                c.delta = 0;
                c.ts_off = 0;
                c.clear(flag::SYN_PENDING | flag::PEND_SACK | flag::PEND_TS);
                drop(t);
                let r = Repr { src_port: b_port, dst_port: a_port, seq: Seq(0), ack: syn_seq + 1, flags: F::RST | F::ACK, ..Default::default() };
                let n = emit_segment(buf, info.src, info.dst, &r)?;
                return Ok(Outcome::with(REWRITTEN, n, Event::PendingWithoutCheckpoint));
            }
            let syn = SynOffer {
                seq: Seq(c.delta),
                tsval: c.ts_off,
                ws: c.a_ws_offered(),
                sack: c.has(flag::PEND_SACK),
                ts: c.has(flag::PEND_TS),
                mss: None,
            };
            let b_window = window_unscaled(t.window(), c.b_ws());
            drop(t);
            let n = synthesize_synack(c, buf, info.dst, info.src, a_port, b_port, &syn, b_window)?;
            return Ok(Outcome::with(REWRITTEN, n, Event::RecoveredFromPeerAck));
        }

        // I3. Handle acknowledgment: ACK ← ACK + Δ, and the SACK edges with it. The ACK never
        // covers more than A's current socket sent (`peer_ack`); ackB above keeps B's own.
        let fwd = peer_ack(c, ack);
        if c.delta != 0 || fwd != ack {
            t.rewrite_ack(fwd + c.delta);
            modified = true;
        }
        if c.delta != 0 {
            shift_sack(&mut t, &o, c.delta);
        }
    }
    // B's pure ACK carries B's SND.NXT as its SEQ. After a recovery that may lie far beyond the
    // new socket's window (B had a full window in flight to the dead socket; a new Linux socket
    // opens with 64 KB), and A's TCP drops an out-of-window segment unread, ACK field included:
    // A would never learn that B received its output, and an application blocked writing it
    // (not reading, so never checkpointing) deadlocks with a B that waits for acknowledgments
    // (found with the recovery nudge on bulk streams). Such a SEQ is lowered to the right edge
    // B last saw from A, which A's TCP accepts; it means nothing else in a pure ACK.
    let pure = t.payload().is_empty() && f & (F::SYN | F::FIN | F::RST) == 0 && f & F::ACK != 0;
    let need = flag::A_WIN_KNOWN | flag::SYNCED | flag::ACK_ALLOWED;
    if pure && c.flags & need == need && !c.has(flag::SYN_PENDING) && !c.has(flag::ACK_EVERYTHING) {
        let s = if c.a_ws_b() == WS_NONE { 0 } else { c.a_ws_b() as u32 };
        let edge = Seq(c.ack_a) + ((c.a_win as u32) << s);
        if t.seq().gt(edge) {
            t.rewrite_seq(edge);
            modified = true;
        }
    }
    // I0 (unbroken's addition, found by the guard's simulation): a state that witnessed neither
    // the handshake nor a recovery (the filter restarted) cannot translate B's ACK. If A's
    // socket is a recovered one (Δ ≠ 0), A's TCP discards B's segment without a word whenever
    // that ACK lands beyond what it has sent (RFC 793 3.9), and an application that only waits
    // for input then never sends the packet O6 needs to force the recovery: a hang. So B's
    // segment becomes a bare ACK whose SEQ lies 2^31 away, outside any window A can have (at
    // most 2^30): A's TCP answers an unacceptable segment with an ACK of its own (RFC 793 3.9;
    // Linux rate-limits these to one per 500 ms), which O6 turns into the reset that starts the
    // recovery. B resends what this dropped.
    if !c.has(flag::SYNCED) && !c.has(flag::SYN_PENDING) && f & F::SYN == 0 {
        let r = Repr {
            src_port: b_port,
            dst_port: a_port,
            seq: t.seq() + 0x8000_0000,
            ack: t.ack(),
            flags: F::ACK,
            window: t.window(),
            timestamp: o.ts_at.map(|_| (o.tsval, o.tsecr)),
            ..Default::default()
        };
        drop(t);
        let n = emit_segment(buf, info.src, info.dst, &r)?;
        return Ok(Outcome::with(REWRITTEN, n, Event::PeerWithoutState));
    }

    if f & F::FIN != 0 {
        c.set(flag::FIN_B_SEEN);
    }
    // I4. Forward.
    Ok(Outcome::forward(len, modified))
}

/// Adds Δ to the edges of *B*'s SACK blocks (they name *A*'s sequence space).
fn shift_sack(t: &mut Tcp<&mut [u8]>, o: &Opts, delta: u32) {
    if let Some(at) = o.sack_at {
        for i in 0..o.sack_n {
            for edge in [at + 2 + 8 * i, at + 6 + 8 * i] {
                let v = u32::from_be_bytes(t.as_bytes()[edge..edge + 4].try_into().unwrap());
                t.rewrite_u32_at(edge, v.wrapping_add(delta));
            }
        }
    }
}

/// A window field scaled by `ws` expressed as an unscaled 16-bit value (SYN-ACK windows are
/// never scaled).
fn window_unscaled(w: u16, ws: u8) -> u16 {
    let s = if ws == WS_NONE { 0 } else { ws as u32 };
    ((w as u32) << s).min(0xffff) as u16
}

/// *B*'s ACK as *A*'s current socket may see it, before I3 adds Δ: never beyond what that
/// socket sent ([`Conn::a_end`]). After a recovery *B* may acknowledge the dead incarnation's
/// output or FIN that the new socket has not resent yet; *A*'s TCP discards an ACK beyond its
/// SND.MAX, so an application waiting for its FIN's acknowledgement hung (issue 21, item 2). The
/// lowered ACK is true: *B* has every byte below the one it acknowledged.
fn peer_ack(c: &Conn, ack: Seq) -> Seq {
    let need = flag::SYNCED | flag::A_WIN_KNOWN;
    if c.flags & need == need && !c.has(flag::SYN_PENDING) && ack.gt(Seq(c.a_end)) {
        Seq(c.a_end)
    } else {
        ack
    }
}

/// Algorithm O: a packet from *A* to *B*.
pub fn outgoing(c: &mut Conn, buf: &mut [u8], len: usize) -> Result<Outcome> {
    let info = IpInfo::parse(&buf[..len])?;
    outgoing_parsed(c, buf, len, &info)
}

/// [`outgoing`] for a packet whose IP header the caller already parsed into `info`.
pub fn outgoing_parsed(c: &mut Conn, buf: &mut [u8], len: usize, info: &IpInfo) -> Result<Outcome> {
    let info = *info;
    let mut t = tcp_at(buf, len, &info)?;
    let f = t.flags();
    // O1. Suppress resets.
    if f & F::RST != 0 {
        return Ok(Outcome::with(Verdict::Drop, len, Event::SpuriousRstDropped));
    }
    // O2. Handle options.
    let (o, mut modified) = scan_options(&mut t)?;
    let (a_port, b_port) = (t.src_port(), t.dst_port());

    // O3. Attempting recovery? Only the client's SYN lacks ACK.
    if f & F::ACK == 0 {
        if f & F::SYN == 0 {
            return Ok(Outcome::with(Verdict::Drop, len, Event::BogusFlags));
        }
        let syn = SynOffer {
            seq: t.seq(),
            tsval: o.tsval,
            ws: o.ws.unwrap_or(WS_NONE),
            sack: o.sack_perm,
            ts: o.ts_at.is_some(),
            mss: o.mss,
        };
        let have_ack = c.has(flag::ACK_ALLOWED) || c.has(flag::ACK_EVERYTHING);
        if c.has(flag::RECOVERABLE) && have_ack {
            // O5. Recover: answer at once from ackB.
            let n = synthesize_synack(c, buf, info.src, info.dst, a_port, b_port, &syn, 0xffff)?;
            return Ok(Outcome::with(Verdict::Inject, n, Event::Recovered));
        }
        // O4. Recovery impossible for now: a first connection, or state lost. Forward unchanged
        // and remember the SYN so B's answer can be rewritten (section 6).
        let first = !c.has(flag::RECOVERABLE) && !have_ack && !c.has(flag::OPTS_KNOWN);
        // An adopted connection inside its handshake (issue 21, item 3): A's SYN-ACK went out
        // (ackB0 = its SEQ + 1 is known, not yet confirmed by B). B may not have received that
        // SYN-ACK (lost) and still be in SYN-SENT: the SYN goes out with A's old ISN, so that
        // either B's answer names the old numbering, its challenge ACK (established) or its
        // SYN-ACK (a simultaneous open, see `incoming`), and the record's ackB0 holds.
        let renumber = c.has(flag::SYNCED) && c.has(flag::OPTS_KNOWN) && !c.has(flag::RECOVERABLE) && have_ack;
        if renumber {
            t.rewrite_seq(Seq(c.ack_b) - 1);
            modified = true;
        }
        c.delta = syn.seq.0;
        c.ts_off = syn.tsval;
        c.set_ws_cur(c.a_ws_cur(), syn.ws);
        c.clear(flag::PEND_SACK | flag::PEND_TS);
        if syn.sack {
            c.set(flag::PEND_SACK);
        }
        if syn.ts {
            c.set(flag::PEND_TS);
        }
        c.set(flag::SYN_PENDING);
        let out = Outcome::forward(len, modified);
        return Ok(if first { out } else { Outcome { event: Some(Event::RecoverySynForwarded), ..out } });
    }

    if c.has(flag::SYN_PENDING) && f & F::SYN == 0 {
        // Our SYN is pending and A's TCP sends a non-SYN: it cannot be synchronized yet.
        let a_rcv_nxt = t.ack();
        drop(t);
        let n = reflect_rst(buf, &info, a_port, b_port, a_rcv_nxt)?;
        return Ok(Outcome::with(Verdict::Inject, n, Event::NoCheckpointReset));
    }

    // O6. Reset? No checkpoint or no Δ known (filter restarted), or a spurious FIN.
    let have_ack = c.has(flag::ACK_ALLOWED) || c.has(flag::ACK_EVERYTHING);
    let synced = c.has(flag::SYNCED);
    if !have_ack || !synced || (f & F::FIN != 0 && !c.has(flag::FIN_ALLOWED)) {
        let ev = if have_ack && synced { Event::SpuriousFinReset } else { Event::NoCheckpointReset };
        let a_rcv_nxt = t.ack();
        drop(t);
        let n = reflect_rst(buf, &info, a_port, b_port, a_rcv_nxt)?;
        return Ok(Outcome::with(Verdict::Inject, n, ev));
    }

    if f & F::SYN != 0 {
        // A's SYN-ACK (A is the server): it completes the option negotiation B's SYN began,
        // and fixes ackB0: B's handshake ACK can only be A's ISN + 1. Not yet RECOVERABLE (B
        // may not have it), but ADOPT can hand the connection over with it if the application
        // dies before B's ACK arrives (issue 21, item 3).
        if !c.has(flag::RECOVERABLE) {
            c.ack_b = (t.seq() + 1).0;
        }
        let a_ws = if c.b_ws() == WS_NONE { WS_NONE } else { o.ws.unwrap_or(WS_NONE) };
        let b_ws = if a_ws == WS_NONE { WS_NONE } else { c.b_ws() };
        c.set_ws(b_ws, a_ws);
        c.set_ws_cur(a_ws, WS_NONE);
        if !o.sack_perm {
            c.clear(flag::SACK_OK);
        }
        if o.ts_at.is_none() {
            c.clear(flag::TS_OK);
        }
        c.set(flag::OPTS_KNOWN);
    }

    // O7. Checkpoint ACK, never above what A's TCP acknowledges itself. `held` bytes A's TCP
    // has but the application has not checkpointed stay unacknowledged.
    let mut held: u32 = 0;
    if !c.has(flag::ACK_EVERYTHING) {
        let ack = t.ack();
        let ck = Seq(c.ack_a);
        if ck.lt(ack) {
            held = ack - ck;
            t.rewrite_ack(ck);
            modified = true;
        }
    }
    // A recovered socket's first data fixes its stream origin (see ORIGIN_PINNED).
    if c.has(flag::ORIGIN_PINNED) && !c.has(flag::SYN_PENDING) && (!t.payload().is_empty() || f & F::FIN != 0) {
        c.clear(flag::ORIGIN_PINNED);
    }
    // O8. Fix SEQ.
    if c.delta != 0 {
        t.rewrite_seq(t.seq() - c.delta);
        modified = true;
    }
    // The end of what the current socket sent (see `Conn::a_end`); A's SYN-ACK starts it.
    let end = t.seq() + t.seq_len();
    if f & F::SYN != 0 || end.gt(Seq(c.a_end)) {
        c.a_end = end.0;
    }
    // Timestamps: keep what B sees monotonic across sockets.
    if let Some(at) = o.ts_at {
        let v = o.tsval.wrapping_add(c.ts_off);
        if c.ts_off != 0 {
            t.rewrite_u32_at(at + 2, v);
            modified = true;
        }
        if !c.has(flag::TS_A_KNOWN) || Seq(v).gt(Seq(c.ts_a)) {
            c.ts_a = v;
            c.set(flag::TS_A_KNOWN);
        }
    }
    // Window: keep the right edge B sees where A's TCP put it. The ACK was lowered by `held`
    // bytes, so the window grows by as much (otherwise, once A holds more than a window of
    // unconsumed data, B's pure ACKs carry a SEQ at B's idea of the window's end, which A's TCP
    // discards as old, and A never learns B's acknowledgments: a deadlock when the application
    // blocks writing). Also rescale if the new socket's shift differs from the one B applies.
    if f & F::SYN == 0 {
        let (cur, old) = (c.a_ws_cur(), c.a_ws_b());
        let w = t.window();
        let w2 = if cur != old || held != 0 {
            let s_cur = if cur == WS_NONE { 0 } else { cur as u32 };
            let s_old = if old == WS_NONE { 0 } else { old as u32 };
            ((((w as u64) << s_cur) + held as u64) >> s_old).min(0xffff) as u16
        } else {
            w
        };
        if w2 != w {
            t.rewrite_window(w2);
            modified = true;
        }
        c.a_win = w2;
        c.set(flag::A_WIN_KNOWN);
    }
    if f & F::FIN != 0 {
        c.set(flag::FIN_A_SEEN);
    }
    // O9. Forward.
    Ok(Outcome::forward(len, modified))
}

/// What [`command`] produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommandResult {
    /// C6: the response to send back to the application.
    pub reply: Command,
    /// C2: length of the fresh ACK for *B* written into the caller's buffer, if one was built.
    pub ack_len: Option<usize>,
}

/// Algorithm C: a side-channel command about this connection (already authenticated by the
/// caller). For RTCP_ACKNOWLEDGE, a fresh ACK for *B* is written into `ack_buf` (at least 80
/// bytes) when enough is known to build one.
pub fn command(c: &mut Conn, cmd: &Command, ack_buf: &mut [u8]) -> CommandResult {
    let mut ack_len = None;
    match cmd.op {
        // C1. Tell: answered below from the state. The application has now read where its
        // recovered socket's stream begins, and writes from there: the origin is fixed.
        Op::Tell => {
            if !c.has(flag::SYN_PENDING) {
                c.clear(flag::ORIGIN_PINNED);
            }
        }
        // ADOPT (unbroken's addition): a read of the state, like TELL, for a connection no
        // application has claimed yet; the origin stays pinned to ackB for the TELL that follows.
        Op::Adopt => {}
        // C2. Acknowledge.
        Op::Acknowledge => {
            if !c.has(flag::ACK_ALLOWED) || Seq(cmd.ack_a).ge(Seq(c.ack_a)) {
                // The fresh ACK must not move the right edge B sees beyond the one A's TCP last
                // offered (ackA + window): the window shrinks by as much as ackA advances.
                // Offering more would let B send past A's buffer; A's next real ACK would then
                // move the edge left, and B's window updates would carry a SEQ A's TCP drops as
                // old (a stall until zero-window probes, found by the >4 GiB echo test).
                if c.has(flag::ACK_ALLOWED) && c.has(flag::A_WIN_KNOWN) {
                    let s = if c.a_ws_b() == WS_NONE { 0 } else { c.a_ws_b() as u32 };
                    let edge = c.ack_a as u64 + ((c.a_win as u64) << s);
                    let advance = Seq(cmd.ack_a) - Seq(c.ack_a);
                    let left = (edge - c.ack_a as u64).saturating_sub(advance as u64);
                    c.a_win = (left >> s).min(0xffff) as u16;
                }
                c.ack_a = cmd.ack_a;
            }
            c.set(flag::ACK_ALLOWED);
            if let (Some(o), false) = (cmd.options, c.has(flag::OPTS_KNOWN)) {
                // A restarted filter learns the negotiated options from the application.
                c.b_mss = o.peer_mss;
                let b = o.peer_wscale.unwrap_or(WS_NONE);
                let a = o.app_wscale.unwrap_or(WS_NONE);
                c.set_ws(b, a);
                c.set_ws_cur(a, c.a_ws_offered());
                c.clear(flag::SACK_OK | flag::TS_OK);
                if o.sack {
                    c.set(flag::SACK_OK);
                }
                if o.timestamps {
                    c.set(flag::TS_OK);
                }
                c.set(flag::OPTS_KNOWN);
            }
            if c.has(flag::RECOVERABLE) && c.has(flag::A_WIN_KNOWN) && !c.has(flag::SYN_PENDING) {
                let ts = (c.has(flag::TS_OK) && c.has(flag::TS_A_KNOWN) && c.has(flag::TS_B_KNOWN)).then_some((c.ts_a, c.ts_b));
                let r = Repr {
                    src_port: cmd.app.port(),
                    dst_port: cmd.peer.port(),
                    seq: Seq(c.ack_b),
                    ack: Seq(c.ack_a),
                    flags: F::ACK,
                    window: c.a_win,
                    timestamp: ts,
                    ..Default::default()
                };
                ack_len = emit_segment(ack_buf, cmd.app.ip(), cmd.peer.ip(), &r).ok();
            }
        }
        // C3 / C4. Shutdown writing / reading.
        Op::Shutdown | Op::ShutdownWriting | Op::ShutdownReading => {
            if matches!(cmd.op, Op::Shutdown | Op::ShutdownWriting) {
                c.set(flag::FIN_ALLOWED);
            }
            if matches!(cmd.op, Op::Shutdown | Op::ShutdownReading) {
                c.set(flag::ACK_EVERYTHING);
            }
        }
        // C5. Clear: forget the connection.
        Op::Clear => *c = Conn::default(),
    }
    // C6. Respond.
    let reply = Command {
        response: true,
        status: ctl::Status::Ok as u8,
        flags: c.ctl_flags(),
        ack_a: c.ack_a,
        ack_b: c.ack_b,
        options: c.options(),
        ..*cmd
    };
    CommandResult { reply, ack_len }
}
