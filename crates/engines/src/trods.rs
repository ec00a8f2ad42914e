//! Object mode: TRODS-KV (seed 000, Lloyd & Freedman, "Transparent Recovery for Object
//! Delivery Services", sections 2.3, 3 and 4.1), sans-I/O.
//!
//! The engine sits under an unmodified HTTP server (nginx) and sees every packet of the
//! service in both directions. It implements the paper's Table 1 ("normal operation"):
//!
//! | packet | TRODS operation | here |
//! |---|---|---|
//! | client SYN | | [`Engine::packet`] remembers the client's options |
//! | server SYN-ACK | locally store knowledge of this connection | a [`Conn`]; its handshake is stored asynchronously |
//! | client request | extract and locally save the objectID | [`http::parse_request`], in byte order, across segments |
//! | server ACK of the request | drop | pure ACKs beyond the stored hold are dropped |
//! | Resp₁ | extract objectISN; block until objectID/objectISN are durably stored; do not ack the request | the response header is parsed (it may span segments); every response segment is held until the record naming it is stored |
//! | Resp₂… | do not ack the client's request | ACK fields are lowered to the stored hold, SACK blocks above it removed |
//! | client ACK of the whole response | (the paper has one request per connection) | the hold moves past the request once stored; a pure ACK tells the client at once ([`Engine::take_injected`]) |
//! | server FIN, client FIN/ACK | delete objectID/objectISN, delete local state | [`Action::Delete`] (off the critical path) once the connection no longer needs its record: the client acknowledged every response byte and the server's FIN, and the server acknowledged the client's FIN (until then a client that half-closed and still reads stays protected, and its FIN stays unacknowledged so it comes again to a new server) |
//!
//! Beyond the paper's assumptions (its section 3.3), the engine keeps a *list* of responses per
//! connection (persistent and pipelined requests), stores the whole response header (so a
//! header spanning segments, or a failover inside the header, resumes byte-exactly), tracks
//! byte positions as 64-bit stream offsets (objects over 4 GiB; the record carries a progress
//! mark refreshed every [`Config::progress_step`] bytes so a 32-bit ACK can be placed), and
//! stops protecting a connection — visibly, with a counter — when a response cannot be
//! resumed byte-exactly (chunked, close-delimited, multipart).
//!
//! On a kept-alive connection the client must learn promptly that a request is acknowledged
//! once the hold has moved past it: the server acknowledged it long ago, but that ACK was
//! dropped or lowered. Otherwise a client whose retransmission timer fired during a long
//! response (it stays in loss recovery with a congestion window of one), or one whose next
//! small request Nagle's algorithm keeps back, cannot send its next request until its backed-off
//! timer retransmits the old one. So when a stored hold lets the client know more than any
//! packet has told it, and no server packet waits to carry the news, the engine hands its
//! driver a pure ACK to inject, built like the server's own (its latest window and timestamps).
//!
//! Recovery (section 3.2, cases ① to ④) is planned by [`plan_recovery`] from the stored
//! [`Record`] and the client packet that reached a server without the connection; the agent
//! rebuilds the socket and resumes the bytes, then hands the connection back to the engine
//! with [`Engine::adopt`] so a second failure is survived too.
//!
//! Unlike [`crate::rtcp`], this engine allocates: request and response headers are buffered
//! (bounded by [`Config`]) and held packets are copied until their record is stored.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};

use unbroken_wire::ip::IpInfo;
use unbroken_wire::seq::{unwrap_near, Seq};
use unbroken_wire::tcp::{self, flags, kind, TcpOption};

use crate::http;
use crate::Verdict;

/// How far past its last stored progress mark a connection whose record may be stale may
/// send before a tombstone is stored (half the distance at which a 32-bit ACK turns ambiguous,
/// with room for what was in flight).
pub const STALE_SEND_LIMIT: u64 = 1 << 30;

/// Limits and periods.
#[derive(Debug, Clone)]
pub struct Config {
    /// Longest request header block (bytes) before the connection goes unprotected.
    pub max_request_head: usize,
    /// Longest response header block.
    pub max_response_head: usize,
    /// Most responses a connection may have in flight (pipelining) while protected.
    pub max_entries: usize,
    /// Refresh the record's progress mark every this many response bytes.
    pub progress_step: u64,
    /// A closed connection is forgotten after this long (ms).
    pub linger_ms: u64,
    /// A connection with no packet for this long is forgotten and its record deleted (ms).
    pub idle_ms: u64,
    /// A client SYN without the server's SYN-ACK is forgotten after this long (ms).
    pub syn_ms: u64,
    /// Store a protected connection's record again when it has not changed for this long
    /// (ms; 0: never), so a store that expires records (the agent's `ttl_s`) keeps those of
    /// live connections, and a record whose delete was lost expires with its connection.
    pub refresh_ms: u64,
    /// Most connections tracked. A new one beyond it evicts a half-open one first (oldest
    /// first), then one that holds nothing worth protecting (closed, muted, unprotected);
    /// never a protected connection with a record: then it is not tracked, and counted.
    pub max_conns: usize,
    /// Most client SYNs waiting for the server's SYN-ACK (the oldest is evicted).
    pub max_syns: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            max_request_head: 8 << 10,
            max_response_head: 16 << 10,
            max_entries: 16,
            progress_step: 256 << 20,
            linger_ms: 30_000,
            idle_ms: 15 * 60_000,
            syn_ms: 10_000,
            refresh_ms: 0,
            max_conns: 1 << 16,
            max_syns: 1 << 14,
        }
    }
}

/// A connection: the client's and the service's address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Key {
    pub client: SocketAddr,
    pub service: SocketAddr,
}

impl Key {
    /// The store key (TRODS section 4.1: the client's address and port), with the service's
    /// to keep several services apart: `c/<client>/<service>`.
    pub fn store_key(&self) -> String {
        format!("c/{}/{}", self.client, self.service)
    }
}

/// Which way a packet goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    /// From the client to the service (PREROUTING/INPUT).
    FromClient,
    /// From the service to the client (OUTPUT).
    ToClient,
}

// The store record's types and their encoding are the wire crate's (`unbroken_wire::objrec`,
// layout in its module docs and docs/store.md); re-exported so every `trods::` path keeps working.
pub use unbroken_wire::objrec::{Entry, Handshake, Record};

/// The reason [`Engine::abandon`] gives (`last_unprotect_reason`).
pub const FAST_REFUSED: &str = "the fast path's state was refused";

/// Most server stream bytes a connection may send past its last stored progress mark
/// (`Record::sent_off`); further segments wait for the next store. Keeps a record's mark close
/// enough to place the client's 32-bit ACK, and bounds where the client's receive point can be
/// for whoever reads the record: at most this far past `sent_off`, plus one segment.
pub const FAR_PAST_PROGRESS: u64 = 3 << 29;

// ---- recovery planning (section 3.2) ----------------------------------------------------------

/// The client packet that reached a server that does not know its connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Trigger {
    pub seq: u32,
    pub ack: u32,
    pub payload_len: u32,
    pub flags: u8,
    /// The client's window field (unscaled) and timestamp, for the rebuilt socket.
    pub window: u16,
    pub tsval: Option<u32>,
    pub tsecr: Option<u32>,
}

impl Trigger {
    /// Reads a trigger from an IP packet.
    pub fn parse(pkt: &[u8]) -> Option<(Key, Trigger)> {
        let ip = IpInfo::parse(pkt).ok()?;
        if ip.protocol != 6 {
            return None;
        }
        let seg = pkt.get(ip.l4_offset..ip.l4_offset + ip.l4_len)?;
        let t = tcp::Packet::new_checked(seg).ok()?;
        let (mut tsval, mut tsecr) = (None, None);
        for o in t.options_iter().flatten() {
            if let TcpOption::Timestamp { tsval: v, tsecr: e } = o {
                tsval = Some(v);
                tsecr = Some(e);
            }
        }
        Some((
            Key {
                client: SocketAddr::new(ip.src, t.src_port()),
                service: SocketAddr::new(ip.dst, t.dst_port()),
            },
            Trigger {
                seq: t.seq().0,
                ack: t.ack().0,
                payload_len: t.payload().len() as u32,
                flags: t.flags(),
                window: t.window(),
                tsval,
                tsecr,
            },
        ))
    }
}

/// Part of one response to send again on the new server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resume {
    /// Index into the record's entries.
    pub entry: usize,
    /// First byte of the stored header still to send (`header.len()`: none).
    pub header_from: usize,
    /// First body byte still to send.
    pub body_from: u64,
}

/// Which of the paper's cases a recovery is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Case {
    /// ② during setup: no response had started; the client's request comes again.
    DuringSetup,
    /// ③ during download.
    DuringDownload,
    /// ④ after download: everything sent was acknowledged (the 416 case).
    AfterDownload,
}

/// How to rebuild and resume a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub case: Case,
    /// The rebuilt socket's next sequence number to send (the client's ACK).
    pub snd_nxt: u32,
    /// The rebuilt socket's next expected client byte: past every request the record answers
    /// (the stored hold, or the end of the last stored request when that is further). The
    /// client sent those bytes in full (the old server parsed them), so the rebuilt socket
    /// takes them as received and acknowledges them at once: on a kept-alive connection the
    /// client's next request then arrives in order and is served, instead of waiting behind a
    /// gap that only the client's retransmission timer fills (0.3-1.4 s measured with python's
    /// http.client by `unbroken demo object --chaos`). Every server that plans from the same
    /// record picks the same offset, so a second failover agrees with the first.
    pub rcv_nxt: u32,
    /// Client bytes after `rcv_nxt` that belong to requests already answered (skip them):
    /// always 0 now that `rcv_nxt` is past them; kept for drivers that relay with a skip.
    pub skip_client: u64,
    /// Responses to send from `snd_nxt` on, in order.
    pub resume: Vec<Resume>,
    /// The server had closed and the client acknowledged the FIN: send the FIN again.
    pub refin: bool,
    /// After the resumed bytes the server would have closed: shut down writing.
    pub close_after: bool,
    /// Server stream offset the client acknowledged.
    pub acked_off: u64,
}

/// Why a connection cannot be recovered byte-exactly (it is reset instead, and counted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal(pub &'static str);

/// TRODS section 3.2: decide from the stored record and the client's packet what the new
/// server sends. Never guesses: a client position the record does not explain is a refusal.
pub fn plan_recovery(rec: &Record, t: &Trigger) -> Result<Plan, Refusal> {
    if t.flags & flags::RST != 0 || t.flags & flags::SYN != 0 {
        return Err(Refusal("not a failover packet (SYN or RST)"));
    }
    if t.flags & flags::ACK == 0 {
        return Err(Refusal("no ACK in the client's packet"));
    }
    if rec.unprotected {
        return Err(Refusal("the connection had stopped being protected"));
    }
    let hs = &rec.hs;
    // Placed in 32-bit sequence space around the record's positions, never clamped: a number
    // before the connection's start proves nothing (a forged packet; issue 9 item 4).
    let near = |x: u32, isn: u32, reference: u64| -> Option<u64> {
        let d = x.wrapping_sub(isn.wrapping_add(1).wrapping_add(reference as u32)) as i32 as i64;
        u64::try_from(reference as i64 + d).ok()
    };
    let seq_off = near(t.seq, hs.irs, rec.hold_off).ok_or(Refusal("client sequence number before the connection's start"))?;
    let seq_end = seq_off + t.payload_len as u64 + (t.flags & flags::FIN != 0) as u64;
    if seq_end < rec.hold_off {
        return Err(Refusal("client packet ends before the stored hold"));
    }
    // Nor past the window the server offered beyond every request the record answers.
    let answered0 = rec.entries.last().map_or(rec.hold_off, |e| (e.req_off + e.req_len as u64).max(rec.hold_off));
    if seq_off > answered0 + ((65535u64 << hs.server_ws.min(14)).clamp(1 << 16, 1 << 30)) {
        return Err(Refusal("client sequence number beyond the window"));
    }
    let a = near(t.ack, hs.iss, rec.sent_off).ok_or(Refusal("client acknowledged bytes before the connection's start"))?;
    let rcv_nxt = hs.irs.wrapping_add(1).wrapping_add(rec.hold_off as u32);
    let mut plan = Plan {
        case: Case::AfterDownload,
        snd_nxt: t.ack,
        rcv_nxt,
        skip_client: 0,
        resume: Vec::new(),
        refin: false,
        close_after: false,
        acked_off: a,
    };
    // The client closed its side right after the last answered request: the server (which
    // read that end of stream) closes after its responses. A FIN after request bytes the
    // record does not answer comes again with them, and whoever serves them closes then.
    let fin_follows = |answered: u64| rec.client_fin == Some(answered);
    let Some(last) = rec.entries.last() else {
        // Case ②, or ④ with every response acknowledged and pruned.
        if a == rec.sent_off {
            plan.case = if rec.sent_off == 0 { Case::DuringSetup } else { Case::AfterDownload };
            plan.close_after = fin_follows(rec.hold_off);
            return Ok(plan);
        }
        if a == rec.sent_off + 1 && rec.sent_off > 0 {
            // One sequence number past the last byte: the server's FIN, acknowledged.
            plan.refin = true;
            plan.snd_nxt = t.ack.wrapping_sub(1);
            return Ok(plan);
        }
        return Err(Refusal("client acknowledged bytes the record does not describe"));
    };
    let first = &rec.entries[0];
    let answered = (last.req_off + last.req_len as u64).max(rec.hold_off);
    plan.rcv_nxt = hs.irs.wrapping_add(1).wrapping_add(answered as u32);
    let end = last.end_off();
    if a < first.resp_off {
        return Err(Refusal("client acknowledged less than the first stored response"));
    }
    if a > end + 1 {
        return Err(Refusal("client acknowledged bytes the record does not describe"));
    }
    if a == end + 1 {
        plan.refin = true;
        plan.snd_nxt = t.ack.wrapping_sub(1);
        return Ok(plan);
    }
    plan.close_after = last.close || fin_follows(answered);
    for (i, e) in rec.entries.iter().enumerate() {
        if e.end_off() <= a {
            continue;
        }
        let from = a.max(e.resp_off) - e.resp_off;
        let hl = e.header.len() as u64;
        plan.resume.push(Resume {
            entry: i,
            header_from: from.min(hl) as usize,
            body_from: from.saturating_sub(hl),
        });
    }
    if !plan.resume.is_empty() {
        plan.case = Case::DuringDownload;
    }
    Ok(plan)
}

/// Plans the relearn of a connection a local socket still serves (its agent restarted under
/// it) from what that socket itself counts: the bytes the client acknowledged and the bytes
/// received from it (`tcp_info`, read through `sock_diag`), never from a client packet, which
/// anyone can forge (issue 9 item 4: a forged packet the record did not explain used to leave
/// the connection unprotected and its record a tombstone). The same checks as
/// [`plan_recovery`], as if the client had sent a pure ACK at exactly the socket's position;
/// positions that alias modulo 2^32 (a stream past 4 GiB) are refused.
pub fn plan_relearn(rec: &Record, bytes_acked: u64, bytes_received: u64) -> Result<Plan, Refusal> {
    let t = Trigger {
        seq: rec.hs.irs.wrapping_add(1).wrapping_add(bytes_received as u32),
        ack: rec.hs.iss.wrapping_add(1).wrapping_add(bytes_acked as u32),
        payload_len: 0,
        flags: flags::ACK,
        window: 0,
        tsval: None,
        tsecr: None,
    };
    let plan = plan_recovery(rec, &t)?;
    if plan.acked_off != bytes_acked {
        return Err(Refusal("the socket's position aliases the record's (a stream past 4 GiB)"));
    }
    Ok(plan)
}

// ---- the engine ---------------------------------------------------------------------------------

/// Counters (all monotonic except `connections`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counters {
    pub connections: u64,
    pub syns: u64,
    pub protected: u64,
    pub unprotected: u64,
    pub unprotected_store: u64,
    pub unprotected_http: u64,
    /// Connections whose fast-path state the agent could not take back ([`Engine::abandon`]).
    pub unprotected_fast: u64,
    pub unprotected_no_syn: u64,
    /// Of `unprotected_no_syn`: tombstones stored once the client's exact ACK of the SYN-ACK
    /// proved the connection real (see `Conn::tomb_on_ack`).
    pub no_syn_tombstones: u64,
    /// Of `unprotected_http`: requests with credentials (Authorization, Cookie), which are
    /// never stored (issue 9 item 7).
    pub unprotected_credentials: u64,
    /// Of `unprotected_http`: 200/206 responses without a strong validator (issue 9 item 8).
    pub unprotected_no_validator: u64,
    pub entries: u64,
    pub stores: u64,
    pub stores_ok: u64,
    pub stores_failed: u64,
    pub deletes: u64,
    pub held: u64,
    pub released: u64,
    pub acks_lowered: u64,
    pub pure_acks_dropped: u64,
    pub sack_removed: u64,
    pub client_gaps: u64,
    pub unknown_from_client: u64,
    pub unknown_from_server: u64,
    pub malformed: u64,
    pub adopted: u64,
    pub closed: u64,
    pub expired: u64,
    pub muted: u64,
    pub muted_dropped: u64,
    /// Adopted connections whose client acknowledged bytes this server never sent: another
    /// server (the stand-in it took the connection back from) sent them after the plan. The
    /// connection is silenced here and the packet starts a new failover from that ACK.
    pub superseded: u64,
    /// Connections entered unprotected because a local socket already served them (the
    /// agent restarted under them): see [`Engine::learn_unprotected`].
    pub learned: u64,
    /// Connections a local socket serves that this engine never saw set up (its agent
    /// restarted under them), protected again from their stored record
    /// ([`Engine::relearn`]).
    pub relearned: u64,
    /// Records stored again only to keep them from expiring ([`Config::refresh_ms`]).
    pub refreshed: u64,
    /// Connections protected again after a store failure had left them unprotected: the store
    /// came back and took a full new record.
    pub rearmed: u64,
    /// Deletes of a finished connection's record tried again after a store failure.
    pub delete_retries: u64,
    /// Server segments dropped because an earlier one never reached the engine.
    pub server_gaps: u64,
    /// Pure ACKs the engine built to tell a client that the hold moved past its request
    /// ([`Engine::take_injected`]).
    pub acks_injected: u64,
    /// Client packets of known connections with a wrong TCP checksum: dropped, no state change.
    pub bad_checksum: u64,
    /// Client segments outside the receive window: passed to the kernel (which answers them
    /// as RFC 9293 says), no state change here.
    pub out_of_window: u64,
    /// RSTs at the exact expected sequence number: the connection ends (RFC 5961 section 3).
    pub rst_exact: u64,
    /// In-window RSTs at another sequence number: dropped, answered with a challenge ACK.
    pub rst_challenged: u64,
    /// RSTs outside the window: dropped.
    pub rst_dropped: u64,
    /// SYNs with a new sequence number on a protected live connection: dropped, answered with
    /// a challenge ACK (RFC 5961 section 4); the connection and its record stay.
    pub syn_challenged: u64,
    /// FINs not at the end of the client's stream as seen (out of order or forged): ignored
    /// until the stream reaches them.
    pub fin_deferred: u64,
    /// Client FINs on protected connections: the connection (and its record) stays protected
    /// until both FINs are acknowledged ([`Counters::closed`] then), so a client that
    /// half-closed and still reads is served by a new server too.
    pub client_fins: u64,
    /// Challenge ACKs built ([`Engine::take_injected`]); at most one per connection per
    /// [`CHALLENGE_EVERY_MS`].
    pub challenge_acks: u64,
    /// Half-open connections (no client ACK, no request) forgotten after `syn_ms`.
    pub half_open_expired: u64,
    /// Half-open connections evicted to make room (`max_conns`).
    pub half_open_evicted: u64,
    /// Closed, muted or unprotected connections evicted to make room.
    pub idle_evicted: u64,
    /// New connections not tracked because the table was full of protected ones.
    pub conns_refused: u64,
    /// Client segments of a guarded connection acknowledging bytes the server never sent
    /// (RFC 5961 section 5.2): passed to the kernel (which drops them), nothing learned.
    pub ack_unsent_dropped: u64,
    /// Client SYNs evicted from a full table (`max_syns`).
    pub syns_evicted: u64,
}

/// How far past the requests an adopted connection knows the client's stream may stand when
/// it acknowledges bytes another server sent (requests sent meanwhile; see `acks_unsent`).
const UNSEEN_REQUESTS: u64 = 16 << 10;

/// At most one challenge ACK per connection this often (ms), like Linux's
/// `net.ipv4.tcp_invalid_ratelimit`.
pub const CHALLENGE_EVERY_MS: u64 = 500;

/// Whether the TCP checksum of an IP packet is right.
pub fn tcp_checksum_ok(pkt: &[u8]) -> bool {
    let Ok(ip) = IpInfo::parse(pkt) else { return false };
    let Some(seg) = pkt.get(ip.l4_offset..ip.l4_offset + ip.l4_len) else { return false };
    let Ok(t) = tcp::Packet::new_checked(seg) else { return false };
    t.verify_checksum(ip.pseudo_sum(ip.l4_len))
}

/// What the engine asks its driver to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Write `value` under `key`; report with [`Engine::store_done`]`(token, ok)`.
    Store { token: u64, conn: Key, key: String, value: Vec<u8> },
    /// Delete `key`; report with [`Engine::store_done`] too (the result matters only for
    /// ordering, see [`Engine::store_done`]).
    Delete { token: u64, conn: Key, key: String },
}


#[derive(Debug)]
enum SrvParse {
    /// Between responses.
    Idle,
    /// Collecting a response header that started at `start`.
    Header { start: u64, buf: Vec<u8> },
    /// Inside a body with `left` bytes to go.
    Body { left: u64 },
}

struct PendingReq {
    off: u64,
    len: u32,
    req: http::Request,
}

/// What the kernel's fast path moved on a connection while it carried it (issue 22 item 3),
/// for [`Engine::absorb`]: the engine's fields of the same names, `last_seen` already on the
/// engine's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FastKept {
    pub client_acked: u64,
    pub srv_next: u64,
    pub sent_next: u64,
    pub last_window: u16,
    pub last_ts: Option<(u32, u32)>,
    pub last_seen: u64,
}

/// One connection as [`Engine::fast_view`] shows it: the fields of the engine's private
/// state, by the same names (`parse` split into `header_pending` and `body_left`; queues by
/// their length; the first stored response by its end), plus the configured `progress_step`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FastView {
    pub hs: Handshake,
    pub protected: bool,
    pub degraded: bool,
    pub closed: bool,
    pub muted: bool,
    pub adopted: bool,
    pub moved_unseen: bool,
    pub unsent_acks: bool,
    pub fin_recorded: bool,
    pub last_seen: u64,
    pub cli_next: u64,
    pub req_buf: usize,
    pub reqs: usize,
    pub client_acked: u64,
    pub srv_next: u64,
    pub sent_next: u64,
    pub srv_fin: Option<u64>,
    pub header_pending: bool,
    /// A response body is being parsed (`body_left` of it still to come; never 0 bytes).
    pub in_body: bool,
    pub body_left: u64,
    pub entries: usize,
    pub first_end: Option<u64>,
    pub ack_limit: Option<u64>,
    pub gen: u64,
    pub stored_gen: u64,
    pub in_flight: bool,
    pub progress_stored: u64,
    pub progress_asked: u64,
    pub held: usize,
    pub deleting: bool,
    pub stale_record: bool,
    pub srv_ack: u64,
    pub told: u64,
    pub last_window: u16,
    pub last_ts: Option<(u32, u32)>,
    pub est: bool,
    pub fin_at: Option<u64>,
    pub cli_fin: Option<u64>,
    pub tomb_on_ack: bool,
    pub challenged_at: Option<u64>,
    pub needs_no_record: bool,
    pub progress_step: u64,
}

struct Held {
    id: u64,
    bytes: Vec<u8>,
    /// Generation of the record that must be stored first (`u64::MAX`: not yet known).
    need: u64,
}

struct Conn {
    hs: Handshake,
    protected: bool,
    closed_at: Option<u64>,
    /// The LB moved this connection's bucket to another server while this one lives: its
    /// packets to the client are dropped, and its record is the new owner's business.
    muted: bool,
    /// Rebuilt here by a failover ([`Engine::adopt`]).
    adopted: bool,
    /// Its bucket may have been another server's while this one lived ([`Engine::may_have_moved`]):
    /// a stand-in may have sent the client bytes this server's socket never did.
    moved_unseen: bool,
    /// In-window client ACKs beyond everything this rebuilt socket sent, in a row: how many,
    /// since when, and the latest ACK's offset (see [`Conn::keeps_acking_unsent`]).
    unsent_acks: Option<(u32, u64, u64)>,
    /// A stored record names the client's FIN ([`Conn::fin_acceptable`]).
    fin_recorded: bool,
    last_seen: u64,
    // client stream
    cli_next: u64,
    req_buf: Vec<u8>,
    reqs: VecDeque<PendingReq>,
    client_acked: u64,
    // server stream
    srv_next: u64,
    /// Server stream offset just past the highest byte actually sent. Equal to `srv_next`
    /// except after a failover, when the rebuilt socket sends again from the client's ACK
    /// bytes that were parsed long ago. The reference for placing 32-bit numbers.
    sent_next: u64,
    /// Server stream offset of its FIN, once sent.
    srv_fin: Option<u64>,
    parse: SrvParse,
    entries: VecDeque<Entry>,
    // store
    /// Client stream offset beyond which no ACK may leave (`None`: no limit).
    ack_limit: Option<u64>,
    gen: u64,
    stored_gen: u64,
    in_flight: Option<InFlight>,
    progress_stored: u64,
    progress_asked: u64,
    held: VecDeque<Held>,
    /// A Delete is in flight; the ACK limit is lifted when it completes.
    deleting: Option<u64>,
    /// The connection's record may be stale (it stopped being protected) and no tombstone is
    /// stored yet: until one is, the server may not run more than [`STALE_SEND_LIMIT`] past
    /// the last stored progress mark, or a new server could place the client's 32-bit ACK
    /// in the wrong 4 GiB of a large object.
    stale_record: bool,
    /// Unprotected because a store failed, not because of what the connection carries: its
    /// streams are still parsed, and protection re-arms once a tombstone reaches the store
    /// (the store is back), with a full new record ([`Counters::rearmed`]).
    degraded: bool,
    /// The stored generation [`Engine::expire`] last saw, and when it first saw it.
    refresh_gen: u64,
    refresh_at: u64,
    // what the client was told
    /// Client stream offset the server acknowledged (its highest ACK field seen).
    srv_ack: u64,
    /// Client stream offset the highest ACK that left for the client acknowledged.
    told: u64,
    /// Window field and timestamps of the server's latest segment: an injected ACK carries
    /// them, as the server's own next ACK would.
    last_window: u16,
    last_ts: Option<(u32, u32)>,
    /// When the entry was made (identifies it in the half-open queue).
    born: u64,
    /// The client acknowledged the SYN-ACK (an in-window, checksummed ACK was seen).
    est: bool,
    /// Client stream offset of a FIN seen ahead of the stream (a gap before it): the
    /// connection closes when the stream reaches it.
    fin_at: Option<u64>,
    /// Client stream offset of the client's FIN, taken at the end of its stream (`cli_next`
    /// then): the record is kept, and says so, until [`Conn::needs_no_record`].
    cli_fin: Option<u64>,
    /// Set up by a SYN-ACK whose SYN this engine never saw (its agent restarted during the
    /// handshake, or the SYN was evicted): unprotected, and nothing in the store names it. A
    /// tombstone is stored once the client's exact ACK of the SYN-ACK proves the connection
    /// real (a spoofed SYN flood still costs no store write), so that after a server death
    /// the new owner's probe of its moved buckets finds it, draws the client's ACK and resets
    /// the client visibly; without it a client waiting for data was never heard from again
    /// (object sim seed 12764: a hang).
    tomb_on_ack: bool,
    /// When the last challenge ACK was built.
    challenged_at: Option<u64>,
}

struct InFlight {
    token: u64,
    gen: u64,
    hold_off: u64,
    sent_off: u64,
    /// The client's FIN as that record names it.
    client_fin: Option<u64>,
}

#[derive(Clone, Copy)]
struct SynInfo {
    irs: u32,
    mss: u16,
    ws: Option<u8>,
    sack: bool,
    ts: bool,
    at: u64,
}

/// The TRODS engine for one server: every connection of its services.
/// See [`Conn::keeps_acking_unsent`]: client ACKs beyond what a rebuilt socket sent, in a row,
/// and the time they must span, before the connection is planned again.
pub const UNSENT_ACKS_REPLAN: u32 = 4;
pub const UNSENT_ACKS_MS: u64 = 1_000;
/// A run of such ACKs longer than this starts again.
pub const UNSENT_ACKS_SPAN_MS: u64 = 10_000;

pub struct Engine {
    cfg: Config,
    conns: HashMap<Key, Conn>,
    syns: HashMap<Key, SynInfo>,
    tokens: HashMap<u64, Key>,
    next_token: u64,
    actions: VecDeque<Action>,
    released: VecDeque<(u64, Vec<u8>, bool)>,
    dropped: VecDeque<u64>,
    injected: VecDeque<Vec<u8>>,
    tomb_retry: Vec<Key>,
    /// Finished connections whose record's delete failed (tried again at [`Engine::expire`]).
    delete_retry: Vec<Key>,
    /// Entries made at SYN-ACKs, oldest first, with their `born` (stale ones skipped): the
    /// eviction order of half-open connections.
    half_open: VecDeque<(Key, u64)>,
    /// Client SYNs in arrival order, with their time (stale ones skipped).
    syn_order: VecDeque<(Key, u64)>,
    last_unprotect_reason: &'static str,
    pub counters: Counters,
}

struct Seg<'a> {
    key: Key,
    seq: u32,
    ack: u32,
    flags: u8,
    payload: &'a [u8],
    /// Where the payload starts in the packet.
    payload_at: usize,
    window: u16,
    ts: Option<(u32, u32)>,
}

/// The connection a packet belongs to, from its IP header parsed once by the caller (ports
/// read at the transport offset; no option is walked).
pub fn key_at(pkt: &[u8], ip: &IpInfo, dir: Dir) -> Option<Key> {
    if ip.protocol != 6 {
        return None;
    }
    let ports = pkt.get(ip.l4_offset..ip.l4_offset + 4)?;
    let (sp, dp) = (u16::from_be_bytes([ports[0], ports[1]]), u16::from_be_bytes([ports[2], ports[3]]));
    Some(match dir {
        Dir::FromClient => Key { client: SocketAddr::new(ip.src, sp), service: SocketAddr::new(ip.dst, dp) },
        Dir::ToClient => Key { client: SocketAddr::new(ip.dst, dp), service: SocketAddr::new(ip.src, sp) },
    })
}

/// A packet the engine kept (held or sent earlier), read again.
fn parse_stored(pkt: &[u8], dir: Dir) -> Option<Seg<'_>> {
    parse_seg(pkt, &IpInfo::parse(pkt).ok()?, dir)
}

fn parse_seg<'a>(pkt: &'a [u8], ip: &IpInfo, dir: Dir) -> Option<Seg<'a>> {
    let ip = *ip;
    if ip.protocol != 6 {
        return None;
    }
    let seg = pkt.get(ip.l4_offset..ip.l4_offset + ip.l4_len)?;
    let t = tcp::Packet::new_checked(seg).ok()?;
    let (c, s) = match dir {
        Dir::FromClient => (SocketAddr::new(ip.src, t.src_port()), SocketAddr::new(ip.dst, t.dst_port())),
        Dir::ToClient => (SocketAddr::new(ip.dst, t.dst_port()), SocketAddr::new(ip.src, t.src_port())),
    };
    let hl = t.header_len();
    let ts = t.options_iter().flatten().find_map(|o| match o {
        TcpOption::Timestamp { tsval, tsecr } => Some((tsval, tsecr)),
        _ => None,
    });
    Some(Seg {
        key: Key { client: c, service: s },
        seq: t.seq().0,
        ack: t.ack().0,
        flags: t.flags(),
        payload: &seg[hl..],
        payload_at: ip.l4_offset + hl,
        window: t.window(),
        ts,
    })
}

fn syn_options(pkt: &[u8]) -> (u16, Option<u8>, bool, bool) {
    let (mut mss, mut ws, mut sack, mut ts) = (536, None, false, false);
    if let Ok(ip) = IpInfo::parse(pkt) {
        if let Some(seg) = pkt.get(ip.l4_offset..ip.l4_offset + ip.l4_len) {
            if let Ok(t) = tcp::Packet::new_checked(seg) {
                for o in t.options_iter().flatten() {
                    match o {
                        TcpOption::Mss(m) => mss = m,
                        TcpOption::WindowScale(w) => ws = Some(w.min(14)),
                        TcpOption::SackPermitted => sack = true,
                        TcpOption::Timestamp { .. } => ts = true,
                        _ => {}
                    }
                }
            }
        }
    }
    (mss, ws, sack, ts)
}

/// Lowers the ACK field to `limit` (when above it) and removes SACK blocks reaching above it.
/// Returns whether the packet changed.
fn limit_ack(pkt: &mut [u8], limit: Seq, counters: &mut Counters) -> bool {
    let Ok(ip) = IpInfo::parse(pkt) else { return false };
    let Some(seg) = pkt.get_mut(ip.l4_offset..ip.l4_offset + ip.l4_len) else { return false };
    let Ok(mut t) = tcp::Packet::new_checked(seg) else { return false };
    let mut modified = false;
    if t.has(flags::ACK) && t.ack().gt(limit) {
        t.rewrite_ack(limit);
        counters.acks_lowered += 1;
        modified = true;
    }
    let mut sack_slot = None;
    for o in t.option_slots().flatten() {
        if o.kind == kind::SACK {
            sack_slot = Some(o);
        }
    }
    if let Some(slot) = sack_slot {
        let reaches_above = match t.options_iter().flatten().find(|o| matches!(o, TcpOption::Sack(..))) {
            Some(TcpOption::Sack(blocks, n)) => blocks[..n as usize].iter().any(|&(_, r)| r.gt(limit)),
            _ => false,
        };
        if reaches_above {
            t.nop_option(slot);
            counters.sack_removed += 1;
            modified = true;
        }
    }
    modified
}

impl Engine {
    pub fn new(cfg: Config) -> Engine {
        Engine {
            cfg,
            conns: HashMap::new(),
            syns: HashMap::new(),
            tokens: HashMap::new(),
            next_token: 1,
            actions: VecDeque::new(),
            released: VecDeque::new(),
            dropped: VecDeque::new(),
            injected: VecDeque::new(),
            tomb_retry: Vec::new(),
            delete_retry: Vec::new(),
            half_open: VecDeque::new(),
            syn_order: VecDeque::new(),
            last_unprotect_reason: "",
            counters: Counters::default(),
        }
    }

    /// Connections known (protected or not).
    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    /// Protected connections.
    pub fn protected(&self) -> usize {
        self.conns.values().filter(|c| c.protected && c.closed_at.is_none()).count()
    }

    /// Whether the engine speaks for `key` (known and not muted; the agent starts no
    /// failover for those).
    pub fn knows(&self, key: &Key) -> bool {
        self.conns.get(key).is_some_and(|c| !c.muted)
    }

    /// Whether the engine holds any state for `key` (a connection, muted or not, or a client
    /// SYN waiting for the SYN-ACK).
    pub fn tracks(&self, key: &Key) -> bool {
        self.conns.contains_key(key) || self.syns.contains_key(key)
    }

    /// Whether `key` is a protected connection (its record in the store describes it), or
    /// `None` when the engine does not track it (for simulations and status pages).
    pub fn is_protected(&self, key: &Key) -> Option<bool> {
        self.conns.get(key).map(|c| c.protected && !c.muted)
    }

    /// Takes back what the kernel's fast path moved while it carried `key` (the agent's
    /// hand-off, before the engine decides the packet or event that brought the connection
    /// back: docs/architecture.md, "Fast path: object mode"). The fast path passes only packets
    /// inside a response body or acknowledging one, so it can only move these forward: the
    /// client's ACK, the server's stream inside the current body (the body's end stays where
    /// the engine parsed it), the window and timestamps last seen. False, and nothing changed,
    /// for an unknown connection or figures the fast path cannot have produced (one going
    /// back, the server's stream past the body's end or moving outside a body).
    pub fn absorb(&mut self, key: &Key, k: &FastKept) -> bool {
        let Some(c) = self.conns.get_mut(key) else { return false };
        if k.client_acked < c.client_acked || k.srv_next < c.srv_next || k.sent_next < c.sent_next || k.last_seen < c.last_seen {
            return false;
        }
        let left = match c.parse {
            SrvParse::Body { left } => {
                let end = c.srv_next + left;
                if k.srv_next > end {
                    return false;
                }
                Some(end - k.srv_next)
            }
            _ if k.srv_next != c.srv_next => return false,
            _ => None,
        };
        if let Some(left) = left {
            // As `on_server` would have left it: a body sent whole is no body being parsed.
            c.parse = if left == 0 { SrvParse::Idle } else { SrvParse::Body { left } };
        }
        c.client_acked = k.client_acked;
        c.srv_next = k.srv_next;
        c.sent_next = k.sent_next;
        c.last_window = k.last_window;
        c.last_ts = k.last_ts;
        c.last_seen = k.last_seen;
        true
    }

    /// A read-only snapshot of one connection's state (issue 22 item 3): what the kernel fast
    /// path (`crates/drivers/bpf/object/`) needs to decide a packet as this engine would, and
    /// what its tests compare the kernel's kept state with. `None` when `key` is not tracked.
    pub fn fast_view(&self, key: &Key) -> Option<FastView> {
        let c = self.conns.get(key)?;
        let (header_pending, body_left) = match &c.parse {
            SrvParse::Idle => (false, 0),
            SrvParse::Header { .. } => (true, 0),
            SrvParse::Body { left } => (false, *left),
        };
        let in_body = matches!(c.parse, SrvParse::Body { .. });
        Some(FastView {
            hs: c.hs,
            protected: c.protected,
            degraded: c.degraded,
            closed: c.closed_at.is_some(),
            muted: c.muted,
            adopted: c.adopted,
            moved_unseen: c.moved_unseen,
            unsent_acks: c.unsent_acks.is_some(),
            fin_recorded: c.fin_recorded,
            last_seen: c.last_seen,
            cli_next: c.cli_next,
            req_buf: c.req_buf.len(),
            reqs: c.reqs.len(),
            client_acked: c.client_acked,
            srv_next: c.srv_next,
            sent_next: c.sent_next,
            srv_fin: c.srv_fin,
            header_pending,
            in_body,
            body_left,
            entries: c.entries.len(),
            first_end: c.entries.front().map(|e| e.end_off()),
            ack_limit: c.ack_limit,
            gen: c.gen,
            stored_gen: c.stored_gen,
            in_flight: c.in_flight.is_some(),
            progress_stored: c.progress_stored,
            progress_asked: c.progress_asked,
            held: c.held.len(),
            deleting: c.deleting.is_some(),
            stale_record: c.stale_record,
            srv_ack: c.srv_ack,
            told: c.told,
            last_window: c.last_window,
            last_ts: c.last_ts,
            est: c.est,
            fin_at: c.fin_at,
            cli_fin: c.cli_fin,
            tomb_on_ack: c.tomb_on_ack,
            challenged_at: c.challenged_at,
            needs_no_record: c.needs_no_record(),
            progress_step: self.cfg.progress_step,
        })
    }

    /// Next store or delete to perform.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// Next held packet now released: (id, bytes, modified).
    pub fn take_released(&mut self) -> Option<(u64, Vec<u8>, bool)> {
        self.released.pop_front()
    }

    /// Next packet the engine itself sends to a client: a complete IP packet (a pure ACK
    /// telling the client that the hold moved past its request) for the driver to inject
    /// toward the client, after the verdicts it already has. Only [`Engine::store_done`]
    /// produces them.
    pub fn take_injected(&mut self) -> Option<Vec<u8>> {
        self.injected.pop_front()
    }

    fn token(&mut self, key: Key) -> u64 {
        let t = self.next_token;
        self.next_token += 1;
        self.tokens.insert(t, key);
        t
    }

    /// One packet of a service. `id` names it if it is held. The packet may be rewritten in
    /// place (ACK field lowered, a SACK option replaced by NOPs); its length never changes.
    /// A client packet's TCP checksum is verified (see [`Engine::packet_csum`]).
    pub fn packet(&mut self, id: u64, pkt: &mut [u8], dir: Dir, now: u64) -> Verdict {
        self.packet_csum(id, pkt, dir, now, false)
    }

    /// [`Engine::packet`], told whether the kernel has not computed the packet's checksum yet
    /// (`csum_not_ready`: a packet the local host built, e.g. over veth; its checksum field is
    /// not meaningful, and no forged packet from the wire comes that way).
    ///
    /// Every client packet may be forged (issue 9 item 2). A known connection's state changes
    /// only on a client segment with a valid checksum and within the receive window
    /// (RFC 9293 section 3.10.7.4); RSTs follow RFC 5961: only one at the exact expected
    /// sequence number ends the connection, an in-window one at any other number is answered
    /// with a challenge ACK, others are dropped; a SYN with a new sequence number on a live
    /// protected connection is answered with a challenge ACK too, never taken as a new
    /// connection; a FIN closes only at the end of the client's stream. So a blind attacker
    /// who spoofs the client's address cannot unprotect a download or delete its record.
    pub fn packet_csum(&mut self, id: u64, pkt: &mut [u8], dir: Dir, now: u64, csum_not_ready: bool) -> Verdict {
        match IpInfo::parse(pkt) {
            Ok(ip) => self.packet_parsed(id, pkt, &ip, dir, now, csum_not_ready),
            Err(_) => {
                self.counters.malformed += 1;
                Verdict::Accept { modified: false }
            }
        }
    }

    /// [`Engine::packet_csum`] with the IP header already parsed by the caller (issue 10
    /// item 0: a packet is parsed once; the agent's core needs its key before the engine).
    pub fn packet_parsed(&mut self, id: u64, pkt: &mut [u8], ip: &IpInfo, dir: Dir, now: u64, csum_not_ready: bool) -> Verdict {
        let Some(seg) = parse_seg(pkt, ip, dir) else {
            self.counters.malformed += 1;
            return Verdict::Accept { modified: false };
        };
        let (key, seq, ack, fl) = (seg.key, seg.seq, seg.ack, seg.flags);
        let payload_len = seg.payload.len();
        let payload_at = seg.payload_at;
        match dir {
            Dir::FromClient => {
                let known = self.conns.contains_key(&key);
                let csum_ok = || csum_not_ready || tcp_checksum_ok(pkt);
                if known && !csum_ok() {
                    self.counters.bad_checksum += 1;
                    return Verdict::Drop;
                }
                if fl & flags::SYN != 0 && fl & flags::ACK == 0 {
                    if !known && !csum_ok() {
                        // Proves nothing (the kernel drops it too): never filed, never the
                        // handshake a later ACK is taken against.
                        self.counters.bad_checksum += 1;
                        return Verdict::Drop;
                    }
                    let (mss, ws, sack, ts) = syn_options(pkt);
                    self.counters.syns += 1;
                    if let Some(c) = self.conns.get(&key) {
                        // A retransmitted SYN of a live connection changes nothing. Of a muted
                        // one (its bucket went elsewhere during the handshake and came back),
                        // it starts the connection here afresh: the muted entry would drop
                        // every answer of the server's new socket (its old one was destroyed).
                        if c.hs.irs == seq && !c.muted {
                            return Verdict::Accept { modified: false };
                        }
                        if c.guarded() && !c.half_open() {
                            // RFC 5961 section 4: a SYN on a synchronized connection is
                            // answered with a challenge ACK, whatever its sequence number. A
                            // client that really lost the connection answers it with an exact
                            // RST (which ends it here), then sends its SYN again.
                            self.counters.syn_challenged += 1;
                            self.challenge(key, now);
                            return Verdict::Drop;
                        }
                        self.forget(key, true);
                    }
                    if !self.syns.contains_key(&key) && self.syns.len() >= self.cfg.max_syns {
                        self.evict_syn();
                    }
                    self.syns.insert(key, SynInfo { irs: seq, mss, ws, sack, ts, at: now });
                    self.syn_order.push_back((key, now));
                    return Verdict::Accept { modified: false };
                }
                if self.conns.get(&key).is_some_and(|c| c.muted) && fl & flags::RST == 0 {
                    // The bucket came back: the connection must be rebuilt here again.
                    self.counters.unknown_from_client += 1;
                    return Verdict::Unknown;
                }
                if fl & flags::ACK != 0 && fl & flags::RST == 0 && self.conns.get_mut(&key).is_some_and(|c| (c.acks_unsent(seq, ack) && c.in_window(seq, 0)) || c.keeps_acking_unsent(seq, ack, now)) {
                    // The client acknowledged bytes this rebuilt socket never sent: another
                    // server sent them after this server planned its resume point (a stand-in
                    // still sending when its bucket came home). The kernel would discard this
                    // ACK (RFC 9293: it acknowledges unsent data) and every later one, and the
                    // socket would retransmit forever: silence it and rebuild from this ACK.
                    self.silence(key);
                    self.counters.superseded += 1;
                    self.counters.unknown_from_client += 1;
                    return Verdict::Unknown;
                }
                if fl & flags::ACK != 0 && fl & flags::RST == 0 {
                    // The client's in-window ACK within what this socket sent: no stand-in sent
                    // it more, so the mark of a possible unseen move (a wider opening for a
                    // blind forgery's ACK) ends here.
                    if let Some(c) = self.conns.get_mut(&key).filter(|c| c.moved_unseen && c.in_window(seq, 0)) {
                        if c.within_sent(c.srv_off(ack)) {
                            c.moved_unseen = false;
                        }
                    }
                }
                if !self.conns.contains_key(&key) {
                    // A client SYN seen without its SYN-ACK says nothing of this packet: the
                    // SYN may have been a blind one on the address pair of a connection that
                    // is failing over here (issue 9), whose client's ACKs must reach the
                    // failover, never the kernel (which would reset the connection). The
                    // driver decides ([`Engine::handshake_pending`]).
                    if fl & flags::RST != 0 {
                        return Verdict::Accept { modified: false };
                    }
                    self.counters.unknown_from_client += 1;
                    return Verdict::Unknown;
                }
                let payload = seg.payload.to_vec();
                self.on_client(key, seq, ack, fl, &payload, now)
            }
            Dir::ToClient => {
                if fl & flags::SYN != 0 && fl & flags::ACK != 0 {
                    self.syn_ack(key, seq, pkt, now);
                    return Verdict::Accept { modified: false };
                }
                let Some(c) = self.conns.get_mut(&key) else {
                    self.counters.unknown_from_server += 1;
                    return Verdict::Accept { modified: false };
                };
                c.last_seen = now;
                if c.muted {
                    self.counters.muted_dropped += 1;
                    return Verdict::Drop;
                }
                c.last_window = seg.window;
                c.last_ts = seg.ts;
                let ack_off = (fl & flags::ACK != 0).then(|| unwrap_near(ack.wrapping_sub(c.hs.irs.wrapping_add(1)), c.cli_next));
                if let Some(a) = ack_off {
                    // (One more: the client's FIN.)
                    c.srv_ack = c.srv_ack.max(a.min(c.cli_next + c.cli_fin.is_some() as u64));
                }
                if fl & flags::RST != 0 {
                    self.forget(key, true);
                    return Verdict::Accept { modified: false };
                }
                if c.closed_at.is_some() {
                    return Verdict::Accept { modified: false };
                }
                if c.needs_no_record() {
                    // This packet acknowledges the client's FIN, the last thing the record
                    // waited for: it leaves unchanged (and tells the client), and the record goes.
                    c.told = c.told.max(ack_off.unwrap_or(0));
                    self.close(key, now);
                    return Verdict::Accept { modified: false };
                }
                if !c.protected && !c.degraded {
                    // A stale record must never become ambiguous: hold what would run too far
                    // past its progress mark until the tombstone is stored.
                    let off = c.srv_off(seq);
                    c.sent_next = c.sent_next.max(off + payload_len as u64);
                    if c.stale_record && (!c.held.is_empty() || c.sent_next.saturating_sub(c.progress_stored) > STALE_SEND_LIMIT) {
                        c.held.push_back(Held { id, bytes: pkt.to_vec(), need: u64::MAX });
                        self.counters.held += 1;
                        return Verdict::Held;
                    }
                    // Still under its ACK limit (until its tombstone is stored, or for good
                    // when the store failed): the client keeps its request, so a server death
                    // reaches the client as a visible RST rather than silence.
                    let Some(l) = c.ack_limit else {
                        c.told = c.told.max(ack_off.unwrap_or(0));
                        return Verdict::Accept { modified: false };
                    };
                    let limit = Seq(c.hs.irs.wrapping_add(1).wrapping_add(l as u32));
                    if payload_len == 0 && fl & (flags::FIN | flags::SYN) == 0 && Seq(ack).gt(limit) {
                        self.counters.pure_acks_dropped += 1;
                        return Verdict::Drop;
                    }
                    c.told = c.told.max(ack_off.unwrap_or(0).min(l));
                    let modified = limit_ack(pkt, limit, &mut self.counters);
                    return Verdict::Accept { modified };
                }
                self.on_server(id, key, seq, ack, fl, payload_at, payload_len, pkt, now)
            }
        }
    }

    fn syn_ack(&mut self, key: Key, iss: u32, pkt: &[u8], now: u64) {
        let Some(syn) = self.syns.remove(&key) else {
            if !self.conns.contains_key(&key) && self.make_room() {
                self.counters.unprotected += 1;
                self.counters.unprotected_no_syn += 1;
                let mut c = Conn::new(Handshake { iss, ..Handshake::default() }, now);
                c.protected = false;
                c.ack_limit = None;
                c.tomb_on_ack = true;
                self.conns.insert(key, c);
                self.half_open.push_back((key, now));
            }
            return;
        };
        if !self.conns.contains_key(&key) && !self.make_room() {
            // Full of protected connections: this one is not tracked (its client's packets
            // are unknown here, and go to the kernel after the gate's wait).
            return;
        }
        let (_mss, sws, sack, ts) = syn_options(pkt);
        let hs = Handshake {
            iss,
            irs: syn.irs,
            client_mss: syn.mss,
            client_ws: if sws.is_some() { syn.ws } else { None },
            server_ws: if syn.ws.is_some() { sws.unwrap_or(0) } else { 0 },
            sack: syn.sack && sack,
            timestamps: syn.ts && ts,
        };
        self.counters.connections += 1;
        self.counters.protected += 1;
        self.conns.insert(key, Conn::new(hs, now));
        self.half_open.push_back((key, now));
        // Nothing is stored yet: the record (the handshake, case ②) is written when the
        // client proves it received this SYN-ACK (see `on_client`; issue 9 item 5).
    }

    fn on_client(&mut self, key: Key, seq: u32, ack: u32, fl: u8, payload: &[u8], now: u64) -> Verdict {
        const PASS: Verdict = Verdict::Accept { modified: false };
        let max_req = self.cfg.max_request_head;
        let c = self.conns.get_mut(&key).unwrap();
        if c.muted {
            c.last_seen = now;
            return PASS;
        }
        let fin = fl & flags::FIN != 0;
        if c.guarded() {
            // Issue 9 item 2: only a segment that proves knowledge of the connection (its
            // checksum was checked by the caller) changes anything.
            if fl & flags::RST != 0 {
                // RFC 5961 section 3.2: the exact expected number (the stream's end as the
                // server's socket sees it, or the acknowledgement the client was last told,
                // which is what a client answering a challenge ACK puts there).
                let told = c.hs.irs.wrapping_add(1).wrapping_add(c.told as u32);
                // (After its FIN the client's next number is one past the stream's end.)
                let end = c.client_delta(seq) == c.cli_fin.is_some() as i64;
                if c.client_delta(seq) == 0 || end || seq == told {
                    self.counters.rst_exact += 1;
                    self.forget(key, true);
                    return PASS;
                }
                if c.in_window(seq, 0) {
                    self.counters.rst_challenged += 1;
                    self.challenge(key, now);
                } else {
                    self.counters.rst_dropped += 1;
                }
                return Verdict::Drop;
            }
            if !c.in_window(seq, payload.len() as u64 + fin as u64) {
                // The kernel answers it (a duplicate ACK) and changes nothing either.
                self.counters.out_of_window += 1;
                return PASS;
            }
            // RFC 5961 section 5.2: an acknowledgement of bytes the server never sent (one
            // more: its FIN) makes the kernel drop the segment; nothing is learned from it.
            if fl & flags::ACK != 0 && c.srv_off(ack) > c.sent_next + 1 {
                self.counters.ack_unsent_dropped += 1;
                return PASS;
            }
        } else if fl & flags::RST != 0 {
            // Closed, or unprotected: no record to keep.
            self.forget(key, true);
            return PASS;
        }
        if fl & flags::ACK != 0 {
            c.est = true;
        }
        c.last_seen = now;
        if c.tomb_on_ack && fl & flags::ACK != 0 && ack == c.hs.iss.wrapping_add(1) && c.closed_at.is_none() && !c.muted {
            // (Its checksum was checked by the caller; the first client segment after the
            // handshake starts at the client's initial sequence number plus one.)
            c.tomb_on_ack = false;
            c.hs.irs = seq.wrapping_sub(1);
            c.stale_record = true;
            self.counters.no_syn_tombstones += 1;
            self.store_tombstone(key);
        }
        let c = self.conns.get_mut(&key).unwrap();
        if c.closed_at.is_some() || (!c.protected && !c.degraded) {
            if fin && c.closed_at.is_none() {
                c.closed_at = Some(now);
            }
            return PASS;
        }
        let mut why = None;
        // The client's first proof that it received the SYN-ACK (its ACK of it, or its first
        // request bytes): the record (the handshake, case ②) is stored now, not at the
        // SYN-ACK. A spoofed SYN flood, whose SYN-ACKs go to addresses that never answer,
        // costs no store write (issue 9 item 5): state is committed once the return path is
        // proven, as a SYN cookie does. Nothing waited for that record before: the server's
        // ACKs stay lowered to the hold, and the first response waits for the record that
        // names it.
        // Exactly: the SYN-ACK's sequence number plus one (a blind guess passes one time in
        // 2^32; "at or after it" passed half of random values), and request bytes count only
        // with that acknowledgement.
        let acks_synack = fl & flags::ACK != 0 && ack == c.hs.iss.wrapping_add(1);
        if c.gen == 0 && c.stored_gen == 0 && !c.adopted && acks_synack {
            c.gen += 1;
        }
        // Requests, in byte order (none after the client's FIN: the kernel takes no byte
        // past it either).
        if !payload.is_empty() && c.cli_fin.is_none() {
            let off = unwrap_near(seq.wrapping_sub(c.hs.irs.wrapping_add(1)), c.cli_next);
            let end = off + payload.len() as u64;
            if off > c.cli_next {
                self.counters.client_gaps += 1;
            } else if end > c.cli_next {
                let skip = (c.cli_next - off) as usize;
                let start = c.cli_next - c.req_buf.len() as u64;
                c.req_buf.extend_from_slice(&payload[skip..]);
                c.cli_next = end;
                let mut base = start;
                while let Some(n) = http::header_end(&c.req_buf) {
                    match http::parse_request(&c.req_buf[..n]) {
                        Ok(req) => c.reqs.push_back(PendingReq { off: base, len: n as u32, req }),
                        Err(e) => {
                            why = Some(e.0);
                            break;
                        }
                    }
                    c.req_buf.drain(..n);
                    base += n as u64;
                }
                if why.is_none() && c.req_buf.len() > max_req {
                    why = Some("request header too long");
                }
            }
        }
        // What the client acknowledged: prune fully received responses.
        if fl & flags::ACK != 0 {
            let a = c.srv_off(ack);
            // Never past what this server sent (one more: its FIN). A plausible ACK past it on
            // an adopted connection rebuilds the connection from that ACK (`acks_unsent`);
            // an implausible one is ignored, as the kernel ignores it.
            if a > c.client_acked && a <= c.sent_next + 1 {
                c.client_acked = a;
                let before = c.entries.len();
                while c.entries.front().is_some_and(|e| e.end_off() <= a) {
                    c.entries.pop_front();
                }
                if c.entries.len() != before {
                    c.gen += 1;
                }
            }
        }
        let mut close = c.fin_at == Some(c.cli_next);
        if fin {
            // Only at the end of the stream as seen: a FIN ahead of a gap waits for the bytes
            // before it (and a blind one must guess where the client's stream ends).
            // (In window: checked above.)
            let d = c.client_delta(seq) + payload.len() as i64;
            if d == 0 {
                close = true;
            } else if d > 0 {
                c.fin_at = Some(c.cli_next + d as u64);
                self.counters.fin_deferred += 1;
            }
        }
        if close {
            // The client closed its side. It may still read (a half-close, `shutdown(SHUT_WR)`):
            // the connection stays protected, and its record (now naming the FIN) stays until
            // the connection no longer needs it. The FIN is acknowledged to the client only once
            // a stored record names it and every response is acknowledged (`fin_acceptable`);
            // before, after a server death the client sends it again to the new server, which
            // plans from this record; after, the record tells the new server to close. (Unprotected since a
            // store failed, the same: its FIN unacknowledged, a client that reads on sends it
            // again after a server death and meets a visible reset, never silence.)
            c.fin_at = None;
            if c.cli_fin.is_none() {
                c.cli_fin = Some(c.cli_next);
                if c.protected && c.ack_limit.is_none_or(|l| l > c.cli_next) {
                    c.ack_limit = Some(c.cli_next);
                }
                self.counters.client_fins += 1;
                // The record must name the FIN before the client may learn it arrived (see
                // `fin_acceptable`): a new server then closes after the resumed responses, or
                // after nothing, for a client that will not send its FIN again.
                c.gen += 1;
            }
        }
        if let Some(why) = why {
            self.unprotect(key, why, false);
            return PASS;
        }
        if c.needs_no_record() {
            self.close(key, now);
            return PASS;
        }
        self.maybe_store(key);
        PASS
    }

    /// Table 1's end: the connection no longer needs its record ([`Conn::needs_no_record`]).
    /// Closed (forgotten after [`Config::linger_ms`]), the record deleted, the ACK limit
    /// lifted; and when the server's acknowledgement of the client's FIN was lowered before,
    /// the client is told now (a pure ACK), so it does not send its FIN again to a server
    /// that no longer has the record.
    fn close(&mut self, key: Key, now: u64) {
        let Some(c) = self.conns.get_mut(&key) else { return };
        c.closed_at = Some(now);
        c.ack_limit = None;
        self.counters.closed += 1;
        let fin_ack = c.cli_fin.map(|f| f + 1).filter(|&a| c.srv_ack >= a && c.told < a);
        if let Some(pkt) = fin_ack.and_then(|a| c.pure_ack(key, a)) {
            c.told = fin_ack.unwrap();
            self.counters.acks_injected += 1;
            self.injected.push_back(pkt);
        }
        self.release_all(key);
        self.delete(key);
    }

    /// A challenge ACK (RFC 5961 sections 3.2 and 4.2) for `key`, at most one per
    /// [`CHALLENGE_EVERY_MS`]: built like the server's own ACK, acknowledging no more than the
    /// client was told (so never a request the record does not hold yet).
    fn challenge(&mut self, key: Key, now: u64) {
        let Some(c) = self.conns.get_mut(&key) else { return };
        if c.challenged_at.is_some_and(|t| now.saturating_sub(t) < CHALLENGE_EVERY_MS) {
            return;
        }
        c.challenged_at = Some(now);
        let Some(pkt) = c.pure_ack(key, c.told) else { return };
        self.counters.challenge_acks += 1;
        self.injected.push_back(pkt);
    }

    /// Makes room for one more connection (see [`Config::max_conns`]); false when the table
    /// is full of connections worth keeping.
    fn make_room(&mut self) -> bool {
        if self.conns.len() < self.cfg.max_conns {
            return true;
        }
        while let Some((k, born)) = self.half_open.pop_front() {
            if self.conns.get(&k).is_some_and(|c| c.born == born && c.half_open()) {
                self.forget(k, false);
                self.counters.half_open_evicted += 1;
                return true;
            }
        }
        // Rare (no half-open entry left): one pass for an entry that holds nothing to protect.
        let victim = self
            .conns
            .iter()
            .find(|(_, c)| c.held.is_empty() && c.deleting.is_none() && c.in_flight.is_none() && (c.closed_at.is_some() || c.muted || (!c.protected && !c.degraded)))
            .map(|(k, _)| *k);
        if let Some(k) = victim {
            self.forget(k, false);
            self.counters.idle_evicted += 1;
            return true;
        }
        self.counters.conns_refused += 1;
        false
    }

    fn evict_syn(&mut self) {
        while let Some((k, at)) = self.syn_order.pop_front() {
            if self.syns.get(&k).is_some_and(|s| s.at == at) {
                self.syns.remove(&k);
                self.counters.syns_evicted += 1;
                return;
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    /// A server segment; its payload is `pkt[payload_at..payload_at + len]` (not copied: a
    /// body segment is only counted).
    fn on_server(&mut self, id: u64, key: Key, seq: u32, _ack: u32, fl: u8, payload_at: usize, len: usize, pkt: &mut [u8], _now: u64) -> Verdict {
        let cfg_max_entries = self.cfg.max_entries;
        let max_head = self.cfg.max_response_head;
        let step = self.cfg.progress_step;
        let c = self.conns.get_mut(&key).unwrap();
        let off = c.srv_off(seq);
        let end = off + len as u64;
        // A retransmission of bytes that all lie before the first held packet: they left once
        // already, under records stored then, and wait for nothing. Held behind a packet that
        // waits (the start of a response header cut at the client's window edge), the
        // retransmission the client needs would never leave, the window never open, and the
        // rest of that header never come: a deadlock.
        let hs = c.hs;
        let sent_next = c.sent_next;
        let before_held = end <= c.srv_next
            && c.held.front().is_some_and(|h| {
                parse_stored(&h.bytes, Dir::ToClient).is_some_and(|g| end <= unwrap_near(g.seq.wrapping_sub(hs.iss.wrapping_add(1)), sent_next))
            });
        let mut why = None;
        let mut new_entry = false;
        let mut header_pending = false;
        // The server's FIN takes one sequence number: its later segments (the ACK of a
        // retransmitted request) start one past the last byte.
        let after_fin = (c.srv_fin == Some(c.srv_next)) as u64;
        if off > c.srv_next + after_fin {
            // A segment before this one never reached the engine (the queue was full and the
            // kernel dropped it, so it was never sent either). Drop this one too: the server's
            // TCP sends the missing bytes again, and the stream is parsed in order.
            self.counters.server_gaps += 1;
            return Verdict::Drop;
        } else if end > c.srv_next && off <= c.srv_next {
            let payload = &pkt[payload_at..payload_at + len];
            let mut data = &payload[(c.srv_next - off) as usize..];
            let mut pos = c.srv_next;
            while !data.is_empty() && why.is_none() {
                match &mut c.parse {
                    SrvParse::Idle => {
                        c.parse = SrvParse::Header { start: pos, buf: Vec::new() };
                    }
                    SrvParse::Header { start, buf } => {
                        let old = buf.len();
                        let scan_from = old.saturating_sub(3);
                        buf.extend_from_slice(data);
                        match http::header_end(&buf[scan_from..]).map(|e| e + scan_from) {
                            None => {
                                if buf.len() > max_head {
                                    why = Some("response header too long");
                                }
                                pos += data.len() as u64;
                                data = &[];
                                header_pending = true;
                            }
                            Some(n) => {
                                buf.truncate(n);
                                let header = std::mem::take(buf);
                                let start = *start;
                                let used = n - old;
                                data = &data[used..];
                                pos += used as u64;
                                let Some(req) = c.reqs.pop_front() else {
                                    why = Some("response without a request seen");
                                    break;
                                };
                                match http::parse_response(&header, req.req.head) {
                                    Err(e) => why = Some(e.0),
                                    // Issue 9 item 7: the header is stored as sent, so never one that sets a cookie.
                                    Ok(r) if r.credentials => why = Some(http::CREDENTIALS.0),
                                    // Issue 9 item 8: a body resumed with Range needs a validator.
                                    Ok(r) if http::needs_validator(&r, req.req.head) && http::if_range(&r.etag, &r.last_modified, &r.date).is_none() => {
                                        why = Some(http::NO_VALIDATOR.0);
                                    }
                                    Ok(r) if c.entries.len() >= cfg_max_entries => {
                                        let _ = r;
                                        why = Some("too many pipelined responses");
                                    }
                                    Ok(r) => {
                                        c.entries.push_back(Entry {
                                            req_off: req.off,
                                            req_len: req.len,
                                            resp_off: start,
                                            status: r.status,
                                            head: req.req.head,
                                            close: r.close,
                                            body_len: r.body_len,
                                            range_start: r.range_start,
                                            header,
                                            object_id: req.req.object_id,
                                            etag: r.etag,
                                            last_modified: r.last_modified,
                                        });
                                        new_entry = true;
                                        c.gen += 1;
                                        self.counters.entries += 1;
                                        c.parse = if r.body_len > 0 { SrvParse::Body { left: r.body_len } } else { SrvParse::Idle };
                                    }
                                }
                            }
                        }
                    }
                    SrvParse::Body { left } => {
                        let n = (*left).min(data.len() as u64);
                        *left -= n;
                        pos += n;
                        data = &data[n as usize..];
                        if *left == 0 {
                            c.parse = SrvParse::Idle;
                        }
                    }
                }
            }
            c.srv_next = end.max(c.srv_next);
        }
        c.sent_next = c.sent_next.max(end);
        if fl & flags::FIN != 0 && why.is_none() && end >= c.srv_next {
            c.srv_fin = Some(end);
        }
        if why.is_none() && c.sent_next >= c.progress_asked + step {
            c.progress_asked = c.sent_next;
            c.gen += 1;
        }
        if let Some(why) = why {
            self.unprotect(key, why, true);
            return self.packet_after_unprotect(key, pkt);
        }
        let c = self.conns.get_mut(&key).unwrap();
        // Does this packet wait for a store? Its own new entry, an unfinished header, the
        // progress mark too far behind, or an earlier held packet (order is kept).
        let far = c.sent_next.saturating_sub(c.progress_stored) > FAR_PAST_PROGRESS;
        let need = if c.degraded {
            // Nothing waits for a store that failed, except what would run too far past the
            // stale record's progress mark before its tombstone is stored.
            let stale_far = !c.held.is_empty() || c.sent_next.saturating_sub(c.progress_stored) > STALE_SEND_LIMIT;
            (c.stale_record && stale_far).then_some(u64::MAX)
        } else if header_pending {
            Some(u64::MAX)
        } else if new_entry || far {
            Some(c.gen)
        } else if before_held {
            None
        } else {
            c.held.back().map(|h| h.need)
        };
        if new_entry && !c.degraded {
            for h in c.held.iter_mut().filter(|h| h.need == u64::MAX) {
                h.need = c.gen;
            }
        }
        let stores = c.gen != c.stored_gen;
        if let Some(need) = need.filter(|&n| n > c.stored_gen) {
            c.held.push_back(Held { id, bytes: pkt.to_vec(), need });
            self.counters.held += 1;
            if stores {
                self.maybe_store(key);
            }
            return Verdict::Held;
        }
        let is_pure_ack = len == 0 && fl & (flags::FIN | flags::SYN) == 0;
        let limit = c.ack_limit.map(|l| Seq(c.hs.irs.wrapping_add(1).wrapping_add(l as u32)));
        let mut verdict = Verdict::Accept { modified: false };
        if let Some(limit) = limit {
            let ack = Seq(_ack);
            if is_pure_ack && ack.gt(limit) {
                self.counters.pure_acks_dropped += 1;
                verdict = Verdict::Drop;
            } else if limit_ack(pkt, limit, &mut self.counters) {
                verdict = Verdict::Accept { modified: true };
            }
        }
        if verdict != Verdict::Drop && fl & flags::ACK != 0 {
            let a = unwrap_near(_ack.wrapping_sub(c.hs.irs.wrapping_add(1)), c.cli_next);
            c.told = c.told.max(c.ack_limit.map_or(a, |l| a.min(l)));
        }
        if stores {
            self.maybe_store(key);
        }
        verdict
    }

    /// The packet that ended protection: still under the old ACK limit until the record's
    /// delete completes.
    fn packet_after_unprotect(&mut self, key: Key, pkt: &mut [u8]) -> Verdict {
        let Some(c) = self.conns.get(&key) else { return Verdict::Accept { modified: false } };
        let limit = c.ack_limit.map(|l| Seq(c.hs.irs.wrapping_add(1).wrapping_add(l as u32)));
        let modified = limit.is_some_and(|l| limit_ack(pkt, l, &mut self.counters));
        Verdict::Accept { modified }
    }

    /// Issue a store of the current record if none is in flight and it changed.
    fn maybe_store(&mut self, key: Key) {
        let Some(c) = self.conns.get(&key) else { return };
        if c.in_flight.is_some() || c.gen == c.stored_gen || !c.protected || c.closed_at.is_some() || c.muted {
            return;
        }
        let rec = Record {
            hs: c.hs,
            hold_off: c.hold_off(),
            sent_off: c.sent_off(),
            acked_off: c.client_acked,
            entries: c.entries.iter().cloned().collect(),
            unprotected: false,
            client_fin: c.cli_fin,
        };
        let (gen, hold_off, sent_off, client_fin) = (c.gen, rec.hold_off, rec.sent_off, rec.client_fin);
        let token = self.token(key);
        let c = self.conns.get_mut(&key).unwrap();
        c.in_flight = Some(InFlight { token, gen, hold_off, sent_off, client_fin });
        self.counters.stores += 1;
        self.actions.push_back(Action::Store {
            token,
            conn: key,
            key: key.store_key(),
            value: rec.encode(),
        });
    }

    fn delete(&mut self, key: Key) {
        let token = self.token(key);
        self.counters.deletes += 1;
        if let Some(c) = self.conns.get_mut(&key) {
            c.deleting = Some(token);
        }
        self.actions.push_back(Action::Delete { token, conn: key, key: key.store_key() });
    }

    /// The result of an [`Action`]. A failed store leaves the connection unprotected (its held
    /// packets go out at once: a slow or dead store never stalls a client).
    pub fn store_done(&mut self, token: u64, ok: bool) {
        let Some(key) = self.tokens.remove(&token) else { return };
        let Some(c) = self.conns.get_mut(&key) else { return };
        if c.deleting == Some(token) {
            c.deleting = None;
            if ok && c.degraded && c.closed_at.is_none() && !c.muted {
                // The store is back and holds a tombstone: protect the connection again with a
                // full record of what it is now (its streams were parsed all along). Until
                // that record is stored a death still finds the tombstone (a visible reset).
                c.degraded = false;
                c.protected = true;
                c.stale_record = false;
                c.gen += 1;
                self.counters.rearmed += 1;
                self.release_all(key);
                self.maybe_store(key);
                return;
            }
            if ok {
                c.degraded = false;
                c.ack_limit = None;
                c.stale_record = false;
                self.release_all(key);
                self.announce_hold(key);
            } else if c.stale_record {
                self.tomb_retry.push(key);
            } else if c.closed_at.is_some() && !c.muted {
                // The record of a finished connection must go (left behind, the server that
                // gets its bucket next would probe it and rebuild a connection its client has
                // closed): tried again while the connection lingers.
                self.delete_retry.push(key);
            }
            return;
        }
        let Some(f) = c.in_flight.take().filter(|f| f.token == token) else { return };
        if !ok {
            self.counters.stores_failed += 1;
            self.counters.unprotected_store += 1;
            c.protected = false;
            c.degraded = true;
            c.stale_record = true;
            self.counters.unprotected += 1;
            self.tomb_retry.push(key);
            let c = self.conns.get_mut(&key).unwrap();
            // Held packets go out, except what would run too far past the stored mark.
            let limit = c.ack_limit.map(|l| Seq(c.hs.irs.wrapping_add(1).wrapping_add(l as u32)));
            let mut keep = VecDeque::new();
            while let Some(mut h) = c.held.pop_front() {
                let far = !keep.is_empty() || {
                    let hs = c.hs;
                    IpInfo::parse(&h.bytes).ok().and_then(|ip| {
                        let seg = h.bytes.get(ip.l4_offset..ip.l4_offset + ip.l4_len)?;
                        let t = tcp::Packet::new_checked(seg).ok()?;
                        let off = unwrap_near(t.seq().0.wrapping_sub(hs.iss.wrapping_add(1)), c.sent_next);
                        Some(off + t.payload().len() as u64)
                    }).is_some_and(|end| end.saturating_sub(c.progress_stored) > STALE_SEND_LIMIT)
                };
                if far {
                    h.need = u64::MAX;
                    keep.push_back(h);
                    continue;
                }
                let modified = limit.is_some_and(|l| limit_ack(&mut h.bytes, l, &mut self.counters));
                c.note_told(&h.bytes);
                self.counters.released += 1;
                self.released.push_back((h.id, h.bytes, modified));
            }
            c.held = keep;
            return;
        }
        self.counters.stores_ok += 1;
        c.stored_gen = c.stored_gen.max(f.gen);
        c.progress_stored = f.sent_off;
        c.fin_recorded |= f.client_fin.is_some() && f.client_fin == c.cli_fin;
        if c.ack_limit.is_some() {
            c.ack_limit = Some(f.hold_off.max(c.ack_limit.unwrap_or(0)));
            c.fin_acceptable();
        }
        self.release_ready(key);
        self.announce_hold(key);
        self.maybe_store(key);
    }

    /// The ACK limit rose (a stored hold, or a lifted limit): when the server acknowledged
    /// more than any packet has told the client, and no held server packet waits to carry the
    /// news, build the pure ACK the server's TCP would send (see the module docs: without it
    /// the client may wait for its retransmission timer before its next request).
    fn announce_hold(&mut self, key: Key) {
        let Some(c) = self.conns.get_mut(&key) else { return };
        if c.muted || c.closed_at.is_some() || !c.held.is_empty() {
            return;
        }
        let target = c.ack_limit.map_or(c.srv_ack, |l| c.srv_ack.min(l));
        if target <= c.told {
            return;
        }
        let Some(pkt) = c.pure_ack(key, target) else { return };
        c.told = target;
        self.counters.acks_injected += 1;
        self.injected.push_back(pkt);
    }

    fn release_ready(&mut self, key: Key) {
        let Some(c) = self.conns.get_mut(&key) else { return };
        let limit = c.ack_limit.map(|l| Seq(c.hs.irs.wrapping_add(1).wrapping_add(l as u32)));
        while c.held.front().is_some_and(|h| h.need <= c.stored_gen) {
            let mut h = c.held.pop_front().unwrap();
            let modified = limit.is_some_and(|l| limit_ack(&mut h.bytes, l, &mut self.counters));
            c.note_told(&h.bytes);
            self.counters.released += 1;
            self.released.push_back((h.id, h.bytes, modified));
        }
    }

    fn release_all(&mut self, key: Key) {
        let Some(c) = self.conns.get_mut(&key) else { return };
        let limit = c.ack_limit.map(|l| Seq(c.hs.irs.wrapping_add(1).wrapping_add(l as u32)));
        while let Some(mut h) = c.held.pop_front() {
            let modified = limit.is_some_and(|l| limit_ack(&mut h.bytes, l, &mut self.counters));
            c.note_told(&h.bytes);
            self.counters.released += 1;
            self.released.push_back((h.id, h.bytes, modified));
        }
    }

    /// The agent could not take back what the kernel's fast path kept for `key` ([`Engine::absorb`]
    /// refused it): this engine no longer knows where the connection's streams are, so it stops
    /// protecting it as it does any response it cannot resume (a tombstone; its packets pass
    /// unparsed from then on, never judged against stale figures) and takes the server's stream
    /// as sent at least to `sent_next`. Counted in `unprotected_fast`. False for an unknown
    /// connection.
    pub fn abandon(&mut self, key: &Key, sent_next: u64) -> bool {
        let Some(c) = self.conns.get_mut(key) else { return false };
        c.sent_next = c.sent_next.max(sent_next);
        if c.protected || c.degraded {
            self.counters.unprotected_fast += 1;
        }
        self.unprotect(*key, FAST_REFUSED, false);
        true
    }

    /// Stop protecting `key` (counted). Its record is deleted first, so a failover cannot
    /// resume from a stale one; ACKs stay limited until that delete completes.
    fn unprotect(&mut self, key: Key, why: &'static str, _server_side: bool) {
        let Some(c) = self.conns.get_mut(&key) else { return };
        if !c.protected && !c.degraded {
            return;
        }
        if !c.degraded {
            self.counters.unprotected += 1;
        }
        c.protected = false;
        c.degraded = false;
        c.entries.clear();
        c.in_flight = None;
        if why != FAST_REFUSED {
            self.counters.unprotected_http += 1;
        }
        if why == http::CREDENTIALS.0 {
            self.counters.unprotected_credentials += 1;
        } else if why == http::NO_VALIDATOR.0 {
            self.counters.unprotected_no_validator += 1;
        }
        self.last_unprotect_reason = why;
        c.stale_record = true;
        self.release_all(key);
        // A tombstone, not a delete: a new server finds it (also by probing) and resets the
        // client at once. The ACK limit is lifted when it is stored (see store_done).
        self.store_tombstone(key);
    }

    fn store_tombstone(&mut self, key: Key) {
        let Some(c) = self.conns.get(&key) else { return };
        if c.deleting.is_some() || !c.stale_record || c.muted {
            return;
        }
        let rec = Record { hs: c.hs, hold_off: c.hold_off(), sent_off: c.sent_off(), acked_off: c.client_acked, entries: Vec::new(), unprotected: true, client_fin: None };
        let token = self.token(key);
        self.counters.stores += 1;
        self.conns.get_mut(&key).unwrap().deleting = Some(token);
        self.actions.push_back(Action::Store { token, conn: key, key: key.store_key(), value: rec.encode() });
    }

    /// Why the last connection stopped being protected (diagnostics).
    ///
    /// (`FAST_REFUSED` for [`Engine::abandon`].)
    pub fn last_unprotect_reason(&self) -> &'static str {
        self.last_unprotect_reason
    }

    fn forget(&mut self, key: Key, delete_record: bool) {
        if let Some(c) = self.conns.get(&key) {
            // A record exists only once a store was issued (the first request bytes).
            if delete_record && !c.muted && ((c.protected && c.gen > 0) || c.stored_gen > 0) {
                let token = self.next_token;
                self.next_token += 1;
                self.counters.deletes += 1;
                self.actions.push_back(Action::Delete { token, conn: key, key: key.store_key() });
            }
        }
        self.release_all(key);
        self.conns.remove(&key);
    }

    /// Periodic housekeeping: forget closed connections after the linger time, idle ones
    /// after the idle time (deleting their records), unanswered SYNs.
    pub fn expire(&mut self, now: u64) {
        // Tombstones whose store failed: try again (the store may be back).
        for key in std::mem::take(&mut self.tomb_retry) {
            self.store_tombstone(key);
        }
        // Deletes of finished connections' records that failed: the same.
        for key in std::mem::take(&mut self.delete_retry) {
            if self.conns.get(&key).is_some_and(|c| c.closed_at.is_some() && !c.muted && c.deleting.is_none()) {
                self.counters.delete_retries += 1;
                self.delete(key);
            }
        }
        let (linger, idle, syn_ms) = (self.cfg.linger_ms, self.cfg.idle_ms, self.cfg.syn_ms);
        self.syns.retain(|_, s| now.saturating_sub(s.at) < syn_ms);
        // The eviction queues keep only live entries.
        let syns = &self.syns;
        self.syn_order.retain(|(k, at)| syns.get(k).is_some_and(|s| s.at == *at));
        let half: Vec<Key> = self.conns.iter().filter(|(_, c)| c.half_open() && now.saturating_sub(c.born) >= syn_ms).map(|(k, _)| *k).collect();
        for k in half {
            self.counters.half_open_expired += 1;
            self.forget(k, false);
        }
        let conns = &self.conns;
        self.half_open.retain(|(k, born)| conns.get(k).is_some_and(|c| c.born == *born && c.half_open()));
        if self.cfg.refresh_ms > 0 {
            let refresh = self.cfg.refresh_ms;
            let mut due = Vec::new();
            for (k, c) in self.conns.iter_mut() {
                if c.stored_gen != c.refresh_gen {
                    c.refresh_gen = c.stored_gen;
                    c.refresh_at = now;
                } else if now.saturating_sub(c.refresh_at) >= refresh {
                    c.refresh_at = now;
                    if c.protected && c.closed_at.is_none() && !c.muted && c.in_flight.is_none() && c.gen == c.stored_gen && c.stored_gen > 0 {
                        c.gen += 1;
                        due.push(*k);
                    }
                }
            }
            for k in due {
                self.counters.refreshed += 1;
                self.maybe_store(k);
            }
        }
        let dead: Vec<(Key, bool)> = self
            .conns
            .iter()
            .filter_map(|(k, c)| match c.closed_at {
                _ if c.muted && now.saturating_sub(c.last_seen) >= linger => Some((*k, false)),
                Some(t) if now.saturating_sub(t) >= linger => Some((*k, false)),
                None if now.saturating_sub(c.last_seen) >= idle => Some((*k, true)),
                _ => None,
            })
            .collect();
        for (k, idle) in dead {
            if idle {
                self.counters.expired += 1;
            }
            self.forget(k, idle);
        }
    }

    /// The LB gave this connection's bucket to another server while this one is alive (a
    /// returning server takes its buckets back, or a false failure detection): stop speaking
    /// for it. Held packets are dropped ([`Engine::take_dropped`]); outgoing packets are
    /// dropped from now on; no store operation is issued for it again (the new owner has
    /// adopted the record). Returns whether the connection was known and not muted yet.
    pub fn mute(&mut self, key: Key) -> bool {
        let muted = self.silence(key);
        if muted {
            self.counters.muted += 1;
        }
        muted
    }

    /// The LB's tables may have given this connection's bucket to another server and back
    /// while this one lived without seeing it (its heartbeats lost: it saw the bucket owned
    /// before and after): a stand-in may have adopted the connection and sent the client more
    /// than this server's socket did. A client ACK of such bytes then supersedes this socket
    /// (a failover from the stand-in's record), as for a rebuilt one; nothing else changes.
    pub fn may_have_moved(&mut self, key: Key) {
        if let Some(c) = self.conns.get_mut(&key) {
            c.moved_unseen = true;
        }
    }

    /// Drops the connection's held and future packets to the client and stops its store
    /// operations (see [`Engine::mute`]). Returns whether it was known and not silent yet.
    fn silence(&mut self, key: Key) -> bool {
        let Some(c) = self.conns.get_mut(&key) else { return false };
        if c.muted {
            return false;
        }
        c.muted = true;
        c.in_flight = None;
        c.deleting = None;
        while let Some(h) = c.held.pop_front() {
            self.dropped.push_back(h.id);
        }
        true
    }

    /// Forgets `key` if its entry is muted (the agent's failover of it was refused where its
    /// bucket is owned now: nobody serves the connection, and the kernel's answer, a RST, must
    /// reach the client instead of being dropped as a stale socket's). Returns whether it did.
    pub fn forget_muted(&mut self, key: &Key) -> bool {
        if !self.conns.get(key).is_some_and(|c| c.muted) {
            return false;
        }
        self.release_all(*key);
        self.conns.remove(key);
        true
    }

    /// Whether `key` is only a client SYN waiting for the server's SYN-ACK (no connection yet).
    pub fn handshake_pending(&self, key: &Key) -> bool {
        self.syns.contains_key(key) && !self.conns.contains_key(key)
    }

    /// Make sure `key` is muted, inserting a muted placeholder when it is unknown (or only a
    /// pending handshake): the agent does this before destroying a stale local socket of the
    /// connection (a request socket included), whose RST or SYN-ACK must never leave.
    pub fn mute_or_insert(&mut self, key: Key, now: u64) {
        if !self.conns.contains_key(&key) {
            self.syns.remove(&key);
            let mut c = Conn::new(Handshake::default(), now);
            c.protected = false;
            c.ack_limit = None;
            c.muted = true;
            self.conns.insert(key, c);
            return;
        }
        self.mute(key);
    }

    /// Enter `key` as a known, unprotected connection: a local socket serves it that this
    /// engine never saw set up (its agent restarted). Its packets pass unchanged from now on
    /// and it is never a failover candidate here; its old record (whose positions are now
    /// stale) is replaced by a tombstone, so a failover elsewhere refuses instead of guessing.
    /// Returns false (and does nothing) when the engine already tracks `key`.
    pub fn learn_unprotected(&mut self, key: Key, now: u64) -> bool {
        if self.tracks(&key) {
            return false;
        }
        let mut c = Conn::new(Handshake::default(), now);
        c.protected = false;
        c.ack_limit = None;
        c.est = true;
        self.conns.insert(key, c);
        self.counters.learned += 1;
        self.counters.unprotected += 1;
        let rec = Record { hs: Handshake::default(), hold_off: 0, sent_off: 0, acked_off: 0, entries: Vec::new(), unprotected: true, client_fin: None };
        let token = self.token(key);
        self.counters.stores += 1;
        self.conns.get_mut(&key).unwrap().deleting = Some(token);
        self.actions.push_back(Action::Store { token, conn: key, key: key.store_key(), value: rec.encode() });
        true
    }

    /// Next held packet to drop (of a muted connection).
    pub fn take_dropped(&mut self) -> Option<u64> {
        self.dropped.pop_front()
    }

    /// Take over a connection rebuilt from `rec` according to `plan` (after a failover). The
    /// record is already stored, so the connection is protected at once.
    pub fn adopt(&mut self, key: Key, rec: &Record, plan: &Plan, now: u64) {
        self.take_over(key, rec, plan, now, true);
        self.counters.adopted += 1;
    }

    /// Protect again a connection a local socket still serves that this engine never saw set
    /// up (its agent restarted under it), from its stored record and the plan
    /// [`plan_recovery`] made of the client's packet. The plan succeeding is the proof that
    /// the record describes where the connection stands: the client acknowledged nothing the
    /// record does not know, and every request before the record's hold was answered. The
    /// socket is the original one, so unlike [`Engine::adopt`] nothing it sends is suspect
    /// (no `acks_unsent`); it is parsed from the end of the last recorded response on (a
    /// response to a request the record does not hold finds no request and ends protection,
    /// with a tombstone, as on any connection). Further stores carry on from the record.
    pub fn relearn(&mut self, key: Key, rec: &Record, plan: &Plan, now: u64) -> bool {
        if self.tracks(&key) {
            return false;
        }
        self.take_over(key, rec, plan, now, false);
        self.counters.relearned += 1;
        true
    }

    fn take_over(&mut self, key: Key, rec: &Record, plan: &Plan, now: u64, adopted: bool) {
        let entries: VecDeque<Entry> = rec.entries.iter().filter(|e| e.end_off() > plan.acked_off).cloned().collect();
        let srv_next = rec.entries.last().map_or(rec.sent_off, |e| e.end_off()).max(rec.sent_off);
        let cli_next = rec.entries.last().map_or(rec.hold_off, |e| e.req_off + e.req_len as u64).max(rec.hold_off);
        let mut c = Conn::new(rec.hs, now);
        c.entries = entries;
        c.srv_next = srv_next;
        c.sent_next = plan.acked_off;
        c.cli_next = cli_next;
        c.client_acked = plan.acked_off;
        // The rebuilt socket acknowledges every answered request (`Plan::rcv_nxt`); the client
        // may be told so. Newer requests are held as on any connection.
        c.ack_limit = Some(cli_next);
        c.gen = 1;
        c.stored_gen = 1;
        c.progress_stored = rec.sent_off;
        c.progress_asked = rec.sent_off;
        // What the client surely knows: the stored hold. The rebuilt socket acknowledged up to
        // `cli_next` (its receive point).
        c.told = rec.hold_off;
        c.srv_ack = cli_next;
        // The client's FIN, when it directly follows the answered requests (the rebuilt socket
        // expects it: it was never acknowledged while the record lived, and comes again).
        c.cli_fin = rec.client_fin.filter(|&f| f == cli_next);
        c.fin_recorded = c.cli_fin.is_some();
        c.adopted = adopted;
        self.counters.connections += 1;
        self.syns.remove(&key);
        self.conns.insert(key, c);
    }
}

impl Conn {
    fn new(hs: Handshake, now: u64) -> Conn {
        Conn {
            hs,
            protected: true,
            closed_at: None,
            muted: false,
            adopted: false,
            moved_unseen: false,
            unsent_acks: None,
            fin_recorded: false,
            last_seen: now,
            cli_next: 0,
            req_buf: Vec::new(),
            reqs: VecDeque::new(),
            client_acked: 0,
            srv_next: 0,
            sent_next: 0,
            srv_fin: None,
            parse: SrvParse::Idle,
            entries: VecDeque::new(),
            ack_limit: Some(0),
            gen: 0,
            stored_gen: 0,
            in_flight: None,
            progress_stored: 0,
            progress_asked: 0,
            held: VecDeque::new(),
            deleting: None,
            stale_record: false,
            degraded: false,
            refresh_gen: 0,
            refresh_at: now,
            srv_ack: 0,
            told: 0,
            last_window: 0,
            last_ts: None,
            born: now,
            est: false,
            fin_at: None,
            cli_fin: None,
            tomb_on_ack: false,
            challenged_at: None,
        }
    }

    /// Set up by a SYN-ACK and never heard from the client since: no ACK, no request, no
    /// record. The first to go when the table is full.
    fn half_open(&self) -> bool {
        !self.est && !self.adopted && !self.muted && self.gen == 0 && self.stored_gen == 0 && self.closed_at.is_none()
    }

    /// A protected (or degraded) connection whose client sent its FIN no longer needs its record: the client
    /// acknowledged every response byte and the server's FIN, and the server acknowledged the
    /// client's FIN. Before that a server death leaves a client that may still read (a
    /// half-close) or may still send its FIN, and the new server must rebuild it, not reset it.
    fn needs_no_record(&self) -> bool {
        let Some(f) = self.cli_fin else { return false };
        (self.protected || self.degraded)
            && !self.muted
            && self.closed_at.is_none()
            && self.entries.is_empty()
            && self.reqs.is_empty()
            && matches!(self.parse, SrvParse::Idle)
            && self.srv_fin.is_some_and(|sf| self.client_acked > sf)
            && self.srv_ack > f
    }

    /// Once the stored hold has reached the client's FIN (every request answered and its
    /// response fully acknowledged), the client may be told its FIN was received: the ACK
    /// limit takes it in, so the server's own FIN carries that acknowledgement (as in plain
    /// TCP). Then the client that acknowledges the server's FIN has surely had its own
    /// acknowledged, and never sends its FIN again to a server whose socket (and record) is
    /// gone, which would answer with a RST. Until the client has the server's FIN the record
    /// stays, so a client left waiting for it by a death is probed and rebuilt (closing after
    /// nothing: `close_after`). Not while unprotected by a store failure: there the FIN stays
    /// unacknowledged, so a waiting client keeps sending it and meets a visible reset.
    /// Only once a stored record names the FIN (`fin_recorded`): acknowledged before, a
    /// server death would leave the client in FIN-WAIT-2, never sending its FIN again, with a
    /// new server planning from a record that does not know it (no EOF for a half-closer).
    fn fin_acceptable(&mut self) {
        if self.protected && self.fin_recorded && self.cli_fin.is_some_and(|f| self.ack_limit == Some(f)) {
            self.ack_limit = self.cli_fin.map(|f| f + 1);
        }
    }

    /// Guards a record (or will): its packets must prove knowledge of the connection.
    fn guarded(&self) -> bool {
        (self.protected || self.degraded) && !self.muted && self.closed_at.is_none()
    }

    /// Whether a client segment at `seq` carrying `len` sequence numbers is acceptable (RFC
    /// 9293 section 3.10.7.4, one-sided as Linux's `tcp_sequence`): it starts before the end
    /// of the receive window (`cli_next` plus the window) and does not end before the
    /// client's stream position (a segment reaching the position exactly, such as a pure ACK
    /// there or a retransmission ending there, is acceptable). An older one (a keepalive, a
    /// retransmission of old bytes) is answered by the kernel and teaches nothing here.
    fn in_window(&self, seq: u32, len: u64) -> bool {
        // In 32-bit sequence space (an offset unwrapped below the stream's start would be
        // clamped to 0, which is within the window of every young connection).
        let d = self.client_delta(seq);
        let w = self.window() as i64;
        d < w && d + len as i64 >= 0
    }

    /// How far `seq` is from the client stream's position (`cli_next`), signed, in 32-bit
    /// sequence space.
    fn client_delta(&self, seq: u32) -> i64 {
        seq.wrapping_sub(self.hs.irs.wrapping_add(1).wrapping_add(self.cli_next as u32)) as i32 as i64
    }

    /// The client's receive window as the server announced it (at least 64 KiB, at most
    /// 1 GiB): how far from the stream's position a genuine segment can be.
    fn window(&self) -> u64 {
        ((self.last_window as u64) << self.hs.server_ws.min(14)).clamp(1 << 16, 1 << 30)
    }

    /// The pure ACK the server's TCP would send acknowledging client stream offset `ack_off`:
    /// at the server's send edge as the client sees it (everything seen left, nothing is held;
    /// its FIN takes one sequence number), with its latest window and timestamps.
    fn pure_ack(&self, key: Key, ack_off: u64) -> Option<Vec<u8>> {
        let fin = (self.srv_fin == Some(self.sent_next)) as u32;
        let hs = self.hs;
        let r = tcp::Repr {
            src_port: key.service.port(),
            dst_port: key.client.port(),
            seq: Seq(hs.iss.wrapping_add(1).wrapping_add(self.sent_next as u32).wrapping_add(fin)),
            ack: Seq(hs.irs.wrapping_add(1).wrapping_add(ack_off as u32)),
            flags: flags::ACK,
            window: self.last_window,
            timestamp: if hs.timestamps { self.last_ts } else { None },
            ..Default::default()
        };
        unbroken_wire::ip::tcp_packet(key.service.ip(), key.client.ip(), &r, &[]).ok()
    }

    /// A server packet left for the client: what its ACK field told the client.
    fn note_told(&mut self, pkt: &[u8]) {
        let Some(seg) = parse_stored(pkt, Dir::ToClient) else { return };
        if seg.flags & flags::ACK != 0 {
            let a = unwrap_near(seg.ack.wrapping_sub(self.hs.irs.wrapping_add(1)), self.cli_next);
            self.told = self.told.max(a);
        }
    }

    /// Whether a client packet (`seq`, `ack`) acknowledges bytes this server never sent on a
    /// connection it rebuilt (and still serves): proof that another server sent them after
    /// the plan. Only adopted connections are judged (their socket's every byte passes the
    /// engine before it reaches the wire; one past the last byte is its FIN), and only a
    /// plausible packet: its ACK within the responses this connection knows and its sequence
    /// number where the client's stream stands, so a blind forgery is as unlikely to cause a
    /// rebuild as an in-window RST is to be accepted.
    /// The server stream offset a 32-bit number of the server's space names (a sequence or
    /// acknowledgement number), placed nearest to what the server sent.
    fn srv_off(&self, v: u32) -> u64 {
        unwrap_near(v.wrapping_sub(self.hs.iss.wrapping_add(1)), self.sent_next)
    }

    /// The record's `sent_off`: server stream bytes sent, never the FIN's sequence number
    /// (segments after the FIN start one past the last byte). A planner takes a client ACK
    /// one past `sent_off` as acknowledging the FIN, and one at it as a client still waiting
    /// for it (object sim seed 17926: a record counting the FIN refused the ACK of a client
    /// that had every byte but not the FIN, and its failovers never planned).
    fn sent_off(&self) -> u64 {
        self.sent_next.min(self.srv_fin.unwrap_or(u64::MAX))
    }

    /// Whether a client ACK `a` (a server stream offset) lies within what this socket sent
    /// (one more: its FIN).
    fn within_sent(&self, a: u64) -> bool {
        a <= self.sent_next + self.srv_fin.is_some() as u64
    }

    /// A rebuilt socket whose client keeps acknowledging, in window, bytes it never sent and
    /// that no record explained (the record it was rebuilt from was stale: a store outage left
    /// a second pipelined response out of it, which the dead server had sent; object sim seeds
    /// 22704, 25182). The kernel discards every such ACK and the socket retransmits forever:
    /// after [`UNSENT_ACKS_REPLAN`] of them in a row over at least [`UNSENT_ACKS_MS`] the
    /// connection is planned again from the store, which resumes it if the record explains
    /// the ACK by now and resets the client visibly if not. A blind forger must land that many
    /// segments in a row, each at the client's stream position (as `acks_unsent` checks), with
    /// ACKs that never go back, within `UNSENT_ACKS_SPAN_MS`, to force the replan.
    fn keeps_acking_unsent(&mut self, seq: u32, ack: u32, now: u64) -> bool {
        if !self.adopted || self.muted || self.closed_at.is_some() || !self.in_window(seq, 0) {
            return false;
        }
        // The client's sequence number where `acks_unsent` expects it (a blind forger must
        // land there, not just anywhere in the window).
        if !self.at_stream_position(seq) {
            return false;
        }
        let a = self.srv_off(ack);
        if self.within_sent(a) {
            self.unsent_acks = None;
            return false;
        }
        // A run: ACKs that never go back, within a few seconds (forgeries cannot be
        // accumulated at leisure).
        let fresh = self.unsent_acks.is_none_or(|(_, since, last)| a < last || now > since + UNSENT_ACKS_SPAN_MS);
        if fresh {
            self.unsent_acks = Some((0, now, a));
        }
        let Some((n, since, last)) = self.unsent_acks.as_mut() else { return false };
        *n += 1;
        *last = a;
        *n >= UNSENT_ACKS_REPLAN && now >= *since + UNSENT_ACKS_MS
    }

    fn acks_unsent(&self, seq: u32, ack: u32) -> bool {
        if !(self.adopted || self.moved_unseen) || self.muted || self.closed_at.is_some() {
            return false;
        }
        let a = self.srv_off(ack);
        // A stand-in may have sent up to the end of the responses this server parsed.
        let high = self.srv_next.max(self.sent_next).max(if self.moved_unseen { self.entries.back().map_or(0, |e| e.end_off()) } else { 0 });
        !self.within_sent(a) && a <= high + 1 && self.at_stream_position(seq)
    }

    /// Whether the client's `seq` lies where its stream stands: from the acknowledged hold (or
    /// `cli_next`) to a little past `cli_next` (a pipelined request the rebuilt socket has not
    /// received yet; object sim seed 4493).
    fn at_stream_position(&self, seq: u32) -> bool {
        let s = unwrap_near(seq.wrapping_sub(self.hs.irs.wrapping_add(1)), self.cli_next);
        let lo = self.ack_limit.unwrap_or(self.cli_next).min(self.cli_next);
        (lo..=self.cli_next + UNSEEN_REQUESTS).contains(&s)
    }

    /// The client stream offset the record may let the client know about: the first request
    /// whose response is not known to be fully received (TRODS: the client keeps one request
    /// unacknowledged so it retransmits it to a new server).
    fn hold_off(&self) -> u64 {
        let partial = self.cli_next - self.req_buf.len() as u64;
        let mut h = partial;
        if let Some(r) = self.reqs.front() {
            h = h.min(r.off);
        }
        if let Some(e) = self.entries.front() {
            h = h.min(e.req_off);
        }
        h
    }
}

/// The address family's "any" for a key's service, for diagnostics.
pub fn is_v6(key: &Key) -> bool {
    matches!(key.service.ip(), IpAddr::V6(_))
}
