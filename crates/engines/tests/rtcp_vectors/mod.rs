//! The RTCP engine's test vectors: *A* = 10.0.2.10:7000 (protected), *B* = 10.0.1.2:41000
//! (peer), packets built with their checksums, and the states the paper's steps lead to
//! (`established`, `recovered`). Shared by the engine's steps (`rtcp_steps.rs`) and by the
//! checkpoint fast path's tests, which run the same packets through the BPF programs
//! (`crates/drivers/tests/fastpath_checkpoint.rs`, included with `#[path]`).
#![allow(dead_code)] // each including test uses a different subset

use std::net::{IpAddr, SocketAddr};
use unbroken_engines::rtcp::{self, Conn};
use unbroken_engines::Verdict;
use unbroken_wire::ctl::{Command, Op};
use unbroken_wire::ip::{self, IpInfo};
use unbroken_wire::tcp::{flags as F, Packet as Tcp, Repr};
use unbroken_wire::Seq;

/// Any `Accept`, as [`kind`] reports it: these steps assert that a packet went on its way;
/// whether it was rewritten is asserted on its own where it matters.
pub const FORWARD: Verdict = Verdict::Accept { modified: false };

pub fn kind(v: Verdict) -> Verdict {
    if let Verdict::Accept { .. } = v { FORWARD } else { v }
}
pub const A_PORT: u16 = 7000;
pub const B_PORT: u16 = 41000;

pub fn a_ip() -> IpAddr {
    "10.0.2.10".parse().unwrap()
}
pub fn b_ip() -> IpAddr {
    "10.0.1.2".parse().unwrap()
}

/// A packet in a buffer with 64 bytes of room to grow.
pub struct P {
    pub buf: Vec<u8>,
    pub len: usize,
}

pub fn build(src: IpAddr, dst: IpAddr, r: Repr, payload: &[u8]) -> P {
    let tl = r.header_len() + payload.len();
    let mut buf = vec![0u8; 60 + tl + 64];
    let hl = ip::emit_header(&mut buf, src, dst, ip::PROTO_TCP, tl).unwrap();
    r.emit(&mut buf[hl..]).unwrap();
    buf[hl + r.header_len()..hl + tl].copy_from_slice(payload);
    Tcp::new_checked(&mut buf[hl..hl + tl]).unwrap().fill_checksum(ip::pseudo_sum(src, dst, ip::PROTO_TCP, tl));
    P { buf, len: hl + tl }
}

pub fn from_a(r: Repr, payload: &[u8]) -> P {
    build(a_ip(), b_ip(), Repr { src_port: A_PORT, dst_port: B_PORT, ..r }, payload)
}
pub fn from_b(r: Repr, payload: &[u8]) -> P {
    build(b_ip(), a_ip(), Repr { src_port: B_PORT, dst_port: A_PORT, ..r }, payload)
}

/// Parses a packet, asserting its checksums verify.
pub fn parse(p: &P, len: usize) -> (IpInfo, Repr, Vec<u8>) {
    let info = IpInfo::parse(&p.buf[..len]).unwrap();
    let seg = &p.buf[info.l4_offset..info.l4_offset + info.l4_len];
    let t = Tcp::new_checked(seg).unwrap();
    assert!(t.verify_checksum(info.pseudo_sum(info.l4_len)), "bad TCP checksum");
    if let IpAddr::V4(_) = info.src {
        assert!(unbroken_wire::ipv4::Packet::new_checked(&p.buf[..len]).unwrap().verify_checksum(), "bad IPv4 checksum");
    }
    (info, Repr::parse(&t).unwrap(), t.payload().to_vec())
}

pub fn out(c: &mut Conn, mut p: P) -> (rtcp::Outcome, P) {
    let o = rtcp::outgoing(c, &mut p.buf, p.len).unwrap();
    (o, p)
}
pub fn inc(c: &mut Conn, mut p: P) -> (rtcp::Outcome, P) {
    let o = rtcp::incoming(c, &mut p.buf, p.len).unwrap();
    (o, p)
}

pub const B_ISN: u32 = 1_000_000;
pub const A_ISN: u32 = 5_000_000;

pub fn syn_opts(ts: u32) -> Repr {
    Repr { mss: Some(1460), wscale: Some(7), sack_perm: true, timestamp: Some((ts, 0)), window: 64240, ..Default::default() }
}

/// B connects to A (A is the server), options MSS 1460 / WS 7 / SACK / TS both ways. Returns the
/// state after the three-way handshake.
pub fn established() -> Conn {
    let mut c = Conn::default();
    let (o, p) = inc(&mut c, from_b(Repr { seq: Seq(B_ISN), flags: F::SYN, ..syn_opts(100) }, b""));
    assert_eq!(kind(o.verdict), Verdict::Accept { modified: false });
    assert_eq!(parse(&p, o.len).1.seq, Seq(B_ISN));
    let synack = Repr { seq: Seq(A_ISN), ack: Seq(B_ISN + 1), flags: F::SYN | F::ACK, timestamp: Some((9000, 100)), ..syn_opts(0) };
    let (o, p) = out(&mut c, from_a(synack, b""));
    assert_eq!(kind(o.verdict), FORWARD);
    assert_eq!(parse(&p, o.len).1, Repr { src_port: A_PORT, dst_port: B_PORT, ..synack });
    let (o, _) = inc(&mut c, from_b(Repr { seq: Seq(B_ISN + 1), ack: Seq(A_ISN + 1), flags: F::ACK, window: 502, timestamp: Some((101, 9000)), ..Default::default() }, b""));
    assert_eq!(kind(o.verdict), FORWARD);
    c
}

/// Crash of A after 3000 bytes were delivered and 2000 checkpointed; the new socket has a new
/// ISN, a much smaller timestamp clock and window scale 9 instead of 7.
pub fn recovered(new_isn: u32) -> (Conn, rtcp::Outcome, P) {
    let mut c = established();
    // A sent 3000 bytes; B acknowledged them (with a SACK block too).
    let (o, _) = inc(&mut c, from_b(Repr { seq: Seq(B_ISN + 4001), ack: Seq(A_ISN + 3001), flags: F::ACK, window: 500, timestamp: Some((150, 9500)), ..Default::default() }, b""));
    assert_eq!(kind(o.verdict), FORWARD);
    let (o, _) = out(&mut c, from_a(Repr { seq: Seq(A_ISN + 3001), ack: Seq(B_ISN + 4001), flags: F::ACK, window: 300, timestamp: Some((9600, 150)), ..Default::default() }, b""));
    assert_eq!(kind(o.verdict), FORWARD);
    let mut ackbuf = [0u8; 128];
    let mut cmd = Command::request(Op::Acknowledge, SocketAddr::new(a_ip(), A_PORT), SocketAddr::new(b_ip(), B_PORT), 5, 5);
    cmd.ack_a = B_ISN + 2001;
    rtcp::command(&mut c, &cmd, &mut ackbuf);
    // The recovery SYN.
    let syn = Repr { seq: Seq(new_isn), flags: F::SYN, wscale: Some(9), ..syn_opts(20) };
    let (o, p) = out(&mut c, from_a(syn, b""));
    (c, o, p)
}
