//! The RTCP engine step by step, each test named after the paper's step (seed 004, section 3.1:
//! I1-I4, O1-O9, C1-C6) or after the extension it checks. *A* = 10.0.2.10:7000 (protected),
//! *B* = 10.0.1.2:41000 (peer). Every rewritten packet must carry valid checksums.

mod rtcp_vectors;

use rtcp_vectors::*;
use std::net::{IpAddr, SocketAddr};
use unbroken_engines::rtcp::{self, flag, Conn, Event};
use unbroken_engines::Verdict;
use unbroken_wire::ctl::{Command, ConnOptions, Op};
use unbroken_wire::ip::{self, IpInfo};
use unbroken_wire::tcp::{flags as F, Packet as Tcp, Repr};
use unbroken_wire::Seq;

#[test]
fn state_is_at_most_36_bytes() {
    // The paper's 32 and `a_end`, the end of what A's current socket sent (issue 21, item 2).
    assert!(std::mem::size_of::<Conn>() <= 36, "{}", std::mem::size_of::<Conn>());
}

#[test]
fn handshake_learns_checkpoint_and_options() {
    let c = established();
    assert_eq!(c.ack_a, B_ISN + 1, "I2: ackA <- SEQ + 1");
    assert_eq!(c.ack_b, A_ISN + 1, "I3: ackB <- ACK");
    assert!(c.flags & flag::RECOVERABLE != 0 && c.flags & flag::ACK_ALLOWED != 0);
    let o = c.options().unwrap();
    assert_eq!(o, ConnOptions { peer_mss: 1460, peer_wscale: Some(7), app_wscale: Some(7), sack: true, timestamps: true });
}

#[test]
fn i1_o2_unknown_options_become_nops() {
    let mut c = Conn::default();
    // A SYN from B carrying an MPTCP option (kind 30, length 12).
    let r = Repr { seq: Seq(B_ISN), flags: F::SYN, mss: Some(1460), ..Default::default() };
    let mut p = from_b(r, b"");
    // Append the option by hand: grow the header by 12 bytes.
    let info = IpInfo::parse(&p.buf[..p.len]).unwrap();
    let l4 = info.l4_offset;
    let opt = [30u8, 12, 0x00, 0x81, 1, 2, 3, 4, 5, 6, 7, 8];
    p.buf.splice(l4 + 24..l4 + 24, opt.iter().copied());
    p.len += 12;
    p.buf[l4 + 12] = ((36 / 4) as u8) << 4;
    p.buf[3] = p.len as u8;
    unbroken_wire::ipv4::Packet::new_checked(&mut p.buf[..p.len]).unwrap().fill_checksum();
    Tcp::new_checked(&mut p.buf[l4..p.len]).unwrap().fill_checksum(ip::pseudo_sum(b_ip(), a_ip(), 6, p.len - l4));
    let (o, p) = inc(&mut c, p);
    assert!(o.modified());
    let (_, _, _) = parse(&p, o.len);
    assert!(p.buf[l4 + 24..l4 + 36].iter().all(|&b| b == 1), "MPTCP option replaced by NOPs");
}

#[test]
fn o1_resets_from_a_are_dropped() {
    let mut c = established();
    let (o, _) = out(&mut c, from_a(Repr { seq: Seq(A_ISN + 1), flags: F::RST, ..Default::default() }, b""));
    assert_eq!((kind(o.verdict), o.event), (Verdict::Drop, Some(Event::SpuriousRstDropped)));
}

#[test]
fn o6_spurious_fin_is_turned_into_rst_for_a() {
    let mut c = established();
    let fin = Repr { seq: Seq(A_ISN + 1), ack: Seq(B_ISN + 1), flags: F::FIN | F::ACK, timestamp: Some((9100, 101)), ..Default::default() };
    let (o, p) = out(&mut c, from_a(fin, b""));
    assert_eq!((kind(o.verdict), o.event), (Verdict::Inject, Some(Event::SpuriousFinReset)));
    let (info, r, _) = parse(&p, o.len);
    assert_eq!((info.src, info.dst), (b_ip(), a_ip()), "reflected toward A, as if from B");
    assert_eq!((r.src_port, r.dst_port, r.flags), (B_PORT, A_PORT, F::RST));
    assert_eq!(r.seq, Seq(B_ISN + 1), "SEQ = A's RCV.NXT so A's TCP accepts it");
    assert_eq!(r.timestamp, None, "no timestamp: a RST must not fail PAWS");
}

#[test]
fn c3_shutdown_lets_the_fin_through() {
    let mut c = established();
    let mut ack = [0u8; 128];
    let cmd = Command::request(Op::ShutdownWriting, SocketAddr::new(a_ip(), A_PORT), SocketAddr::new(b_ip(), B_PORT), 1, 1);
    let res = rtcp::command(&mut c, &cmd, &mut ack);
    assert!(res.reply.response && res.ack_len.is_none());
    let fin = Repr { seq: Seq(A_ISN + 1), ack: Seq(B_ISN + 1), flags: F::FIN | F::ACK, ..Default::default() };
    let (o, _) = out(&mut c, from_a(fin, b""));
    assert_eq!(kind(o.verdict), FORWARD);
}

#[test]
fn o6_no_checkpoint_after_filter_restart_forces_recovery() {
    let mut c = Conn::default(); // the filter restarted: nothing known
    let data = Repr { seq: Seq(A_ISN + 1), ack: Seq(B_ISN + 1), flags: F::ACK | F::PSH, ..Default::default() };
    let (o, p) = out(&mut c, from_a(data, b"hello"));
    assert_eq!((kind(o.verdict), o.event), (Verdict::Inject, Some(Event::NoCheckpointReset)));
    let (_, r, payload) = parse(&p, o.len);
    assert_eq!((r.flags, r.seq), (F::RST, Seq(B_ISN + 1)));
    assert!(payload.is_empty());
}

/// I0: B's data reaches a restarted filter (nothing known, Δ unknown). Forwarded as it was,
/// its ACK (B's view) could acknowledge data A's recovered socket never sent, which A's TCP
/// drops without a word; it becomes a bare ACK 2^31 outside A's window instead, which A's TCP
/// answers (and O6 turns that answer into the reset that starts the recovery). B's clock and
/// ackB are still learned from it. A state that witnessed the handshake forwards as before.
#[test]
fn i0_peer_packet_on_a_lost_state_becomes_an_ack_eliciting_probe() {
    let mut c = Conn::default();
    let data = Repr { seq: Seq(B_ISN + 1), ack: Seq(A_ISN + 1), flags: F::ACK | F::PSH, window: 502, timestamp: Some((300, 9100)), ..Default::default() };
    let (o, p) = inc(&mut c, from_b(data, b"hello"));
    assert_eq!((kind(o.verdict), o.event), (FORWARD, Some(Event::PeerWithoutState)));
    let (info, r, payload) = parse(&p, o.len);
    assert_eq!((info.src, info.dst), (b_ip(), a_ip()), "still toward A");
    assert_eq!((r.flags, r.seq, r.ack), (F::ACK, Seq(B_ISN + 1) + 0x8000_0000, Seq(A_ISN + 1)));
    assert_eq!(r.timestamp, Some((300, 9100)));
    assert!(payload.is_empty(), "the data is dropped; B resends it");
    assert!(c.flags & flag::RECOVERABLE != 0 && c.ack_b == A_ISN + 1, "ackB learned");
    assert!(c.flags & flag::TS_B_KNOWN != 0 && c.ts_b == 300, "B's clock learned");
    // The answer of A's TCP is reset by O6 (not synced).
    let answer = Repr { seq: Seq(A_ISN + 1), ack: Seq(B_ISN + 1), flags: F::ACK, ..Default::default() };
    let (o, _) = out(&mut c, from_a(answer, b""));
    assert_eq!((kind(o.verdict), o.event), (Verdict::Inject, Some(Event::NoCheckpointReset)));
    // A synced state forwards B's data untouched.
    let mut c = established();
    let (o, p) = inc(&mut c, from_b(Repr { seq: Seq(B_ISN + 1), ack: Seq(A_ISN + 1), flags: F::ACK | F::PSH, window: 502, ..Default::default() }, b"hello"));
    assert_eq!((kind(o.verdict), o.event), (FORWARD, None));
    assert_eq!(parse(&p, o.len).2, b"hello");
}

#[test]
fn o6_acknowledge_alone_does_not_make_a_restarted_filter_forward() {
    // The filter restarted; the app's next ACKNOWLEDGE arrives before its next packet. ackA is
    // known again, Δ is not: the packet must still be turned into a RST (never forwarded with a
    // guessed Δ of 0, which would hand the peer wrongly numbered bytes).
    let mut c = Conn::default();
    let mut ackbuf = [0u8; 128];
    let mut cmd = Command::request(Op::Acknowledge, SocketAddr::new(a_ip(), A_PORT), SocketAddr::new(b_ip(), B_PORT), 8, 8);
    cmd.ack_a = B_ISN + 1;
    rtcp::command(&mut c, &cmd, &mut ackbuf);
    let (o, _) = inc(&mut c, from_b(Repr { seq: Seq(B_ISN + 1), ack: Seq(A_ISN + 1), flags: F::ACK, window: 9, ..Default::default() }, b"in"));
    assert_eq!(kind(o.verdict), FORWARD, "B's bytes are in B's own numbering: safe to pass");
    let data = Repr { seq: Seq(A_ISN + 1), ack: Seq(B_ISN + 3), flags: F::ACK | F::PSH, window: 9, ..Default::default() };
    let (o, p) = out(&mut c, from_a(data, b"out"));
    assert_eq!((kind(o.verdict), o.event), (Verdict::Inject, Some(Event::NoCheckpointReset)));
    assert_eq!(parse(&p, o.len).1.flags, F::RST);
}

#[test]
fn o7_ack_is_checkpointed_and_never_raised() {
    let mut c = established();
    // A's TCP acknowledges 1000 bytes of B's data the app has not checkpointed.
    let r = Repr { seq: Seq(A_ISN + 1), ack: Seq(B_ISN + 1001), flags: F::ACK, window: 500, ..Default::default() };
    let (o, p) = out(&mut c, from_a(r, b""));
    let r = parse(&p, o.len).1;
    assert_eq!(r.ack, Seq(B_ISN + 1), "ACK <- ackA");
    // Right edge kept: 500 << 7 bytes beyond B_ISN + 1001 is (500 << 7) + 1000 beyond ackA.
    assert_eq!(r.window, (((500u32 << 7) + 1000) >> 7) as u16, "window widened by the held bytes");
    // The app checkpoints 600 bytes: C2.
    let mut ackbuf = [0u8; 128];
    let mut cmd = Command::request(Op::Acknowledge, SocketAddr::new(a_ip(), A_PORT), SocketAddr::new(b_ip(), B_PORT), 2, 2);
    cmd.ack_a = B_ISN + 601;
    let res = rtcp::command(&mut c, &cmd, &mut ackbuf);
    assert_eq!(res.reply.ack_a, B_ISN + 601);
    let n = res.ack_len.expect("C2 builds a fresh ACK for B");
    let ackp = P { buf: ackbuf.to_vec(), len: n };
    let (info, r, _) = parse(&ackp, n);
    assert_eq!((info.src, info.dst, r.src_port, r.dst_port), (a_ip(), b_ip(), A_PORT, B_PORT));
    // The right edge stays where A's last packet put it: B_ISN + 1 + (507 << 7).
    assert_eq!((r.seq, r.ack, r.flags), (Seq(A_ISN + 1), Seq(B_ISN + 601), F::ACK));
    assert_eq!(r.window as u32, ((507u32 << 7) - 600) >> 7, "the window shrinks by the 600 bytes the ACK advanced");
    // An ACKNOWLEDGE beyond what A's TCP acknowledges never raises the ACK (O7 takes the min).
    cmd.ack_a = B_ISN + 5000;
    rtcp::command(&mut c, &cmd, &mut ackbuf);
    let r = Repr { seq: Seq(A_ISN + 1), ack: Seq(B_ISN + 1001), flags: F::ACK, ..Default::default() };
    let (o, p) = out(&mut c, from_a(r, b""));
    assert_eq!(parse(&p, o.len).1.ack, Seq(B_ISN + 1001));
    // A stale (older) ACKNOWLEDGE does not move the checkpoint back.
    cmd.ack_a = B_ISN + 10;
    assert_eq!(rtcp::command(&mut c, &cmd, &mut ackbuf).reply.ack_a, B_ISN + 5000);
}

#[test]
fn c4_shutdown_reading_acknowledges_everything() {
    let mut c = established();
    let mut ackbuf = [0u8; 128];
    let cmd = Command::request(Op::ShutdownReading, SocketAddr::new(a_ip(), A_PORT), SocketAddr::new(b_ip(), B_PORT), 3, 3);
    rtcp::command(&mut c, &cmd, &mut ackbuf);
    let r = Repr { seq: Seq(A_ISN + 1), ack: Seq(B_ISN + 77), flags: F::ACK, ..Default::default() };
    let (o, p) = out(&mut c, from_a(r, b""));
    assert_eq!(parse(&p, o.len).1.ack, Seq(B_ISN + 77));
}

#[test]
fn c1_tell_and_c5_clear() {
    let mut c = established();
    let mut ackbuf = [0u8; 128];
    let cmd = Command::request(Op::Tell, SocketAddr::new(a_ip(), A_PORT), SocketAddr::new(b_ip(), B_PORT), 4, 4);
    let res = rtcp::command(&mut c, &cmd, &mut ackbuf);
    assert_eq!((res.reply.ack_a, res.reply.ack_b, res.reply.nonce), (B_ISN + 1, A_ISN + 1, 4));
    assert!(res.reply.options.is_some());
    let cmd = Command { op: Op::Clear, ..cmd };
    rtcp::command(&mut c, &cmd, &mut ackbuf);
    assert!(c.is_empty());
}

#[test]
fn o5_recovery_syn_is_answered_at_once() {
    let new_isn = 777;
    let (c, o, p) = recovered(new_isn);
    assert_eq!((kind(o.verdict), o.event), (Verdict::Inject, Some(Event::Recovered)));
    let (info, r, _) = parse(&p, o.len);
    assert_eq!((info.src, info.dst, r.src_port, r.dst_port), (b_ip(), a_ip(), B_PORT, A_PORT));
    assert_eq!(r.flags, F::SYN | F::ACK);
    assert_eq!(r.seq, Seq(B_ISN + 2000), "ISN = ackA - 1: B's numbering continues");
    assert_eq!(r.ack, Seq(new_isn + 1));
    assert_eq!((r.mss, r.wscale, r.sack_perm), (Some(1460), Some(7), true), "B's own options");
    assert_eq!(r.timestamp, Some((150, 20)), "TSval = B's latest, TSecr = the SYN's");
    assert_eq!(c.delta, (new_isn + 1).wrapping_sub(A_ISN + 3001), "delta = seq + 1 - ackB");
}

#[test]
fn after_recovery_sequence_ack_sack_timestamps_and_window_are_translated() {
    let new_isn = 777;
    let (mut c, _, _) = recovered(new_isn);
    // A's handshake ACK + resent data from its new sequence space.
    let r = Repr { seq: Seq(new_isn + 1), ack: Seq(B_ISN + 2001), flags: F::ACK | F::PSH, window: 100, timestamp: Some((25, 150)), ..Default::default() };
    let (o, p) = out(&mut c, from_a(r, b"resent"));
    let (_, r2, payload) = parse(&p, o.len);
    assert_eq!(r2.seq, Seq(A_ISN + 3001), "SEQ - delta lands where B expects");
    assert_eq!(r2.ack, Seq(B_ISN + 2001));
    assert_eq!(r2.window, 400, "window 100 at scale 9 is 400 at the scale B applies (7)");
    let tsval = r2.timestamp.unwrap().0;
    assert!(Seq(tsval).gt(Seq(9600)), "PAWS: TSval {tsval} must stay above the last one B saw (9600)");
    assert_eq!(payload, b"resent");
    // B acknowledges with a SACK block above a hole.
    let sack = [(Seq(A_ISN + 3100), Seq(A_ISN + 3200)), (Seq(0), Seq(0)), (Seq(0), Seq(0)), (Seq(0), Seq(0))];
    let r = Repr { seq: Seq(B_ISN + 4001), ack: Seq(A_ISN + 3007), flags: F::ACK, window: 500, timestamp: Some((160, tsval)), sack, sack_len: 1, ..Default::default() };
    let (o, p) = inc(&mut c, from_b(r, b""));
    let (_, r3, _) = parse(&p, o.len);
    assert_eq!(r3.ack, Seq(new_isn + 7), "ACK + delta");
    assert_eq!(r3.sack[0], (Seq(new_isn + 100), Seq(new_isn + 200)), "SACK edges + delta");
    assert_eq!(r3.timestamp, Some((160, 25)), "TSecr translated back into A's clock");
}

/// Issue 21, item 2: after a recovery *B* may still acknowledge the dead incarnation's output
/// (or FIN) beyond anything the new socket has resent; *A*'s TCP would discard that ACK (it
/// covers data never sent), so it is lowered to the end of what the new socket sent, and ackB
/// keeps *B*'s own.
#[test]
fn peer_ack_beyond_what_the_recovered_socket_sent_is_lowered_to_its_end() {
    let new_isn = 777;
    let (mut c, _, _) = recovered(new_isn);
    let mut ackbuf = [0u8; 128];
    let cmd = Command::request(Op::Tell, SocketAddr::new(a_ip(), A_PORT), SocketAddr::new(b_ip(), B_PORT), 6, 6);
    assert_eq!(rtcp::command(&mut c, &cmd, &mut ackbuf).reply.ack_b, A_ISN + 3001);
    // The new socket resends 100 bytes; the dead one had sent 500 more, and its FIN.
    let r = Repr { seq: Seq(new_isn + 1), ack: Seq(B_ISN + 2001), flags: F::ACK | F::PSH, window: 100, timestamp: Some((25, 150)), ..Default::default() };
    let (o, _) = out(&mut c, from_a(r, &[7u8; 100]));
    assert_eq!(kind(o.verdict), FORWARD);
    let late = Repr { seq: Seq(B_ISN + 4001), ack: Seq(A_ISN + 3502), flags: F::ACK, window: 500, timestamp: Some((160, 9700)), ..Default::default() };
    let (o, p) = inc(&mut c, from_b(late, b""));
    assert_eq!(kind(o.verdict), FORWARD);
    assert_eq!(parse(&p, o.len).1.ack, Seq(new_isn + 101), "lowered to what the new socket sent");
    assert_eq!(c.ack_b, A_ISN + 3502, "ackB is B's own");
    // Once the new socket sent beyond it (the rest and its FIN, after SHUTDOWN), B's ACK
    // passes unchanged (+ Δ).
    rtcp::command(&mut c, &Command { op: Op::Shutdown, ..cmd }, &mut ackbuf);
    let r = Repr { seq: Seq(new_isn + 101), ack: Seq(B_ISN + 2001), flags: F::ACK | F::PSH | F::FIN, window: 100, timestamp: Some((26, 160)), ..Default::default() };
    let (o, _) = out(&mut c, from_a(r, &[7u8; 400]));
    assert_eq!(kind(o.verdict), FORWARD);
    let (o, p) = inc(&mut c, from_b(Repr { timestamp: Some((161, 9701)), ..late }, b""));
    assert_eq!(parse(&p, o.len).1.ack, Seq(new_isn + 502), "the FIN's ACK reaches A's TCP");
}

#[test]
fn recovery_across_sequence_wrap() {
    // The new ISN sits just below 2^32, the old stream well above 0: delta wraps.
    let new_isn = u32::MAX - 2;
    let (mut c, o, _) = recovered(new_isn);
    assert_eq!(o.event, Some(Event::Recovered));
    let r = Repr { seq: Seq(new_isn) + 1 + 10, ack: Seq(B_ISN + 2001), flags: F::ACK, window: 100, ..Default::default() };
    let (o, p) = out(&mut c, from_a(r, b"x"));
    assert_eq!(parse(&p, o.len).1.seq, Seq(A_ISN + 3011));
    let r = Repr { seq: Seq(B_ISN + 4001), ack: Seq(A_ISN + 3012), flags: F::ACK, window: 9, ..Default::default() };
    let (o, p) = inc(&mut c, from_b(r, b""));
    assert_eq!(parse(&p, o.len).1.ack, Seq(new_isn) + 12);
}

#[test]
fn recovery_clears_shutdown_state() {
    let mut c = established();
    let mut ackbuf = [0u8; 128];
    let cmd = Command::request(Op::Shutdown, SocketAddr::new(a_ip(), A_PORT), SocketAddr::new(b_ip(), B_PORT), 6, 6);
    rtcp::command(&mut c, &cmd, &mut ackbuf);
    let (o, _) = out(&mut c, from_a(Repr { seq: Seq(42), flags: F::SYN, ..syn_opts(1) }, b""));
    assert_eq!(o.event, Some(Event::Recovered));
    assert_eq!(c.flags & (flag::FIN_ALLOWED | flag::ACK_EVERYTHING), 0, "O5 returns to the default behaviour");
}

#[test]
fn section6_filter_restart_answers_from_the_peers_ack() {
    // The filter restarted and the application crashed at the same moment (section 2.7).
    let mut c = Conn::default();
    let mut ackbuf = [0u8; 128];
    // Recovery step 1: ACKNOWLEDGE with the options the app's socket knew.
    let mut cmd = Command::request(Op::Acknowledge, SocketAddr::new(a_ip(), A_PORT), SocketAddr::new(b_ip(), B_PORT), 7, 7);
    cmd.ack_a = B_ISN + 2001;
    cmd.options = Some(ConnOptions { peer_mss: 1400, peer_wscale: Some(7), app_wscale: Some(7), sack: true, timestamps: true });
    let res = rtcp::command(&mut c, &cmd, &mut ackbuf);
    assert!(res.ack_len.is_none(), "no ackB known yet: no ACK can be built");
    // Step 2: the SYN finds no ackB: forwarded unchanged.
    let syn = Repr { seq: Seq(555), flags: F::SYN, ..syn_opts(30) };
    let (o, p) = out(&mut c, from_a(syn, b""));
    assert_eq!((kind(o.verdict), o.event), (FORWARD, Some(Event::RecoverySynForwarded)));
    assert_eq!(parse(&p, o.len).1.seq, Seq(555));
    // B answers the unexpected SYN with a challenge ACK: rewritten into A's SYN-ACK at once.
    let chal = Repr { seq: Seq(B_ISN + 4001), ack: Seq(A_ISN + 3001), flags: F::ACK, window: 100, timestamp: Some((170, 9600)), ..Default::default() };
    let (o, p) = inc(&mut c, from_b(chal, b""));
    assert_eq!((kind(o.verdict), o.event), (FORWARD, Some(Event::RecoveredFromPeerAck)));
    let (info, r, _) = parse(&p, o.len);
    assert_eq!((info.src, info.dst), (b_ip(), a_ip()));
    assert_eq!((r.flags, r.seq, r.ack), (F::SYN | F::ACK, Seq(B_ISN + 2000), Seq(556)));
    assert_eq!((r.mss, r.wscale, r.sack_perm, r.timestamp), (Some(1400), Some(7), true, Some((170, 30))));
    assert!(o.len > p.len, "the SYN-ACK is longer than the ACK it was rewritten from");
    // A's next packet lands where B expects it, with TSval above what B saw.
    let (o, p) = out(&mut c, from_a(Repr { seq: Seq(556), ack: Seq(B_ISN + 2001), flags: F::ACK, window: 10, timestamp: Some((31, 170)), ..Default::default() }, b""));
    let (_, r, _) = parse(&p, o.len);
    assert_eq!(r.seq, Seq(A_ISN + 3001));
    assert!(Seq(r.timestamp.unwrap().0).gt(Seq(9600)));
}

#[test]
fn section6_filter_restart_between_acknowledge_and_syn_resets_the_syn() {
    // The application's ACKNOWLEDGE reached the old filter, which then restarted: the new one
    // sees the recovery SYN without a checkpoint. B's challenge ACK cannot become a SYN-ACK; it
    // becomes a RST for A's SYN (not a silent drop: nothing would ever teach this filter ackA,
    // and A's connect would hang until its timeout), so A recovers again, ACKNOWLEDGE first.
    let mut c = Conn::default();
    // B keeps streaming: the new filter learns ackB from it.
    let data = Repr { seq: Seq(B_ISN + 4001), ack: Seq(A_ISN + 3001), flags: F::ACK, window: 100, timestamp: Some((169, 9600)), ..Default::default() };
    assert_eq!(kind(inc(&mut c, from_b(data, b"xyz")).0.verdict), FORWARD);
    let syn = Repr { seq: Seq(555), flags: F::SYN, ..syn_opts(30) };
    let (o, _) = out(&mut c, from_a(syn, b""));
    assert_eq!((kind(o.verdict), o.event), (FORWARD, Some(Event::RecoverySynForwarded)));
    let chal = Repr { seq: Seq(B_ISN + 4001), ack: Seq(A_ISN + 3001), flags: F::ACK, window: 100, timestamp: Some((170, 9600)), ..Default::default() };
    let (o, p) = inc(&mut c, from_b(chal, b""));
    assert_eq!((kind(o.verdict), o.event), (FORWARD, Some(Event::PendingWithoutCheckpoint)));
    let (info, r, _) = parse(&p, o.len);
    assert_eq!((info.src, info.dst, r.src_port, r.dst_port), (b_ip(), a_ip(), B_PORT, A_PORT));
    assert_eq!((r.flags, r.ack, r.timestamp), (F::RST | F::ACK, Seq(556), None), "acceptable to A's SYN-SENT socket");
    assert_eq!((c.flags & flag::SYN_PENDING, c.delta, c.ts_off), (0, 0, 0), "nothing pending, nothing shifted");
    // The second attempt: ACKNOWLEDGE, then the SYN is answered at once (O5).
    let mut cmd = Command::request(Op::Acknowledge, SocketAddr::new(a_ip(), A_PORT), SocketAddr::new(b_ip(), B_PORT), 8, 8);
    cmd.ack_a = B_ISN + 4001;
    cmd.options = Some(ConnOptions { peer_mss: 1400, peer_wscale: Some(7), app_wscale: Some(7), sack: true, timestamps: true });
    rtcp::command(&mut c, &cmd, &mut [0u8; 128]);
    let (o, p) = out(&mut c, from_a(Repr { seq: Seq(777), flags: F::SYN, ..syn_opts(40) }, b""));
    assert_eq!((kind(o.verdict), o.event), (Verdict::Inject, Some(Event::Recovered)));
    let (_, r, _) = parse(&p, o.len);
    assert_eq!((r.flags, r.seq, r.ack), (F::SYN | F::ACK, Seq(B_ISN + 4000), Seq(778)));
}

#[test]
fn pure_acks_beyond_a_recovered_sockets_window_are_brought_inside() {
    // After a recovery A's new socket advertises a small window; B's pure ACK (of A's resent
    // output) carries B's SND.NXT, far beyond it: A's TCP would drop it, ACK field and all.
    let (mut c, _, _) = recovered(9000);
    let (o, p) = out(&mut c, from_a(Repr { seq: Seq(9001), ack: Seq(B_ISN + 2001), flags: F::ACK, window: 100, timestamp: Some((50, 170)), ..Default::default() }, b""));
    // The right edge B now sees: the ACK and window it got, in the scale B applies to A.
    let (_, r, _) = parse(&p, o.len);
    let shift = match c.ws >> 4 { 15 => 0, s => s as u32 };
    let edge = r.ack + ((r.window as u32) << shift);
    assert!(edge.lt(Seq(B_ISN + 900_001)));
    let far = Repr { seq: Seq(B_ISN + 900_001), ack: Seq(A_ISN + 3001), flags: F::ACK, window: 300, timestamp: Some((180, 60)), ..Default::default() };
    let (o, p) = inc(&mut c, from_b(far, b""));
    let (_, r, _) = parse(&p, o.len);
    assert_eq!((kind(o.verdict), r.seq), (FORWARD, edge), "SEQ lowered to the right edge B saw");
    assert_eq!(r.ack, Seq(A_ISN + 3001) + c.delta, "the ACK field still shifted by Δ");
    // Inside the window, and for data segments, SEQ is never touched.
    let near = Repr { seq: Seq(B_ISN + 2001), ack: Seq(A_ISN + 3001), flags: F::ACK, window: 300, timestamp: Some((181, 60)), ..Default::default() };
    let (o, p) = inc(&mut c, from_b(near, b""));
    assert_eq!(parse(&p, o.len).1.seq, Seq(B_ISN + 2001));
    let (o, p) = inc(&mut c, from_b(Repr { seq: Seq(B_ISN + 900_001), ..far }, b"data"));
    assert_eq!(parse(&p, o.len).1.seq, Seq(B_ISN + 900_001));
}

#[test]
fn first_connection_as_client_is_not_a_recovery() {
    let mut c = Conn::default();
    let (o, _) = out(&mut c, from_a(Repr { seq: Seq(A_ISN), flags: F::SYN, ..syn_opts(5) }, b""));
    assert_eq!((kind(o.verdict), o.event), (FORWARD, None));
    let synack = Repr { seq: Seq(B_ISN), ack: Seq(A_ISN + 1), flags: F::SYN | F::ACK, ..syn_opts(60) };
    let (o, p) = inc(&mut c, from_b(Repr { timestamp: Some((60, 5)), ..synack }, b""));
    assert_eq!(kind(o.verdict), FORWARD);
    assert_eq!(parse(&p, o.len).1.ack, Seq(A_ISN + 1), "no shift on a first connection");
    assert_eq!(c.delta, 0);
    assert_eq!(c.options().unwrap().app_wscale, Some(7));
    let (o, p) = out(&mut c, from_a(Repr { seq: Seq(A_ISN + 1), ack: Seq(B_ISN + 1), flags: F::ACK, window: 9, ..Default::default() }, b"hi"));
    assert_eq!(kind(o.verdict), FORWARD);
    assert_eq!(parse(&p, o.len).1.seq, Seq(A_ISN + 1));
}

#[test]
fn ipv6_recovery() {
    let a6: IpAddr = "fd77:2::10".parse().unwrap();
    let b6: IpAddr = "fd77:1::2".parse().unwrap();
    let mut c = Conn::default();
    let p = build(b6, a6, Repr { src_port: B_PORT, dst_port: A_PORT, seq: Seq(B_ISN), flags: F::SYN, ..syn_opts(1) }, b"");
    inc(&mut c, p);
    let p = build(a6, b6, Repr { src_port: A_PORT, dst_port: B_PORT, seq: Seq(A_ISN), ack: Seq(B_ISN + 1), flags: F::SYN | F::ACK, ..syn_opts(2) }, b"");
    out(&mut c, p);
    let p = build(b6, a6, Repr { src_port: B_PORT, dst_port: A_PORT, seq: Seq(B_ISN + 1), ack: Seq(A_ISN + 1), flags: F::ACK, ..Default::default() }, b"");
    inc(&mut c, p);
    let p = build(a6, b6, Repr { src_port: A_PORT, dst_port: B_PORT, seq: Seq(9), flags: F::SYN, ..syn_opts(3) }, b"");
    let (o, p) = out(&mut c, p);
    assert_eq!(kind(o.verdict), Verdict::Inject);
    let (info, r, _) = parse(&p, o.len);
    assert_eq!((info.src, info.dst, r.flags, r.ack), (b6, a6, F::SYN | F::ACK, Seq(10)));
}

mod hostile {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        /// Arbitrary bytes never panic the engine, in either direction, whatever the state.
        #[test]
        fn arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..120), state in any::<[u32; 9]>()) {
            let mut c: Conn = unsafe { std::mem::transmute(state) };
            let mut buf = bytes.clone();
            buf.resize(bytes.len() + 64, 0);
            let _ = rtcp::incoming(&mut c, &mut buf, bytes.len());
            let mut buf = bytes.clone();
            buf.resize(bytes.len() + 64, 0);
            let _ = rtcp::outgoing(&mut c, &mut buf, bytes.len());
        }

        /// A valid packet with random bytes flipped: an error or a packet with valid checksums.
        #[test]
        fn mutated_packets(pos in 0usize..80, val in any::<u8>(), incoming in any::<bool>(), syn in any::<bool>()) {
            let mut c = established();
            let r = Repr { seq: Seq(A_ISN + 1), ack: Seq(B_ISN + 1), flags: if syn { F::SYN } else { F::ACK }, window: 5, sack_len: 1, sack: [(Seq(1), Seq(2)); 4], ..syn_opts(9) };
            let mut p = if incoming { from_b(r, b"data") } else { from_a(r, b"data") };
            if pos < p.len { p.buf[pos] = val; }
            let res = if incoming { rtcp::incoming(&mut c, &mut p.buf, p.len) } else { rtcp::outgoing(&mut c, &mut p.buf, p.len) };
            if let Ok(o) = res {
                prop_assert!(o.len <= p.buf.len());
            }
        }
    }
}

// Issue 9, item 2: packets from B may be forged. Only a packet whose checksum verifies and that
// lies where A's TCP could accept it changes the state (ackB, timestamps, flags, FIN); RSTs per
// RFC 5961. A blind forger knows the 4-tuple but not the sequence numbers.

/// A genuine ACK from B after the handshake (in window, valid checksum).
fn genuine_ack(ack: u32, tsval: u32) -> Repr {
    Repr { seq: Seq(B_ISN + 1), ack: Seq(ack), flags: F::ACK, window: 502, timestamp: Some((tsval, 9000)), ..Default::default() }
}

#[test]
fn hostile_peer_packet_with_a_bad_checksum_changes_nothing() {
    let mut c = established();
    let before = c;
    let mut p = from_b(genuine_ack(A_ISN + 2001, 120), b"");
    let info = IpInfo::parse(&p.buf[..p.len]).unwrap();
    p.buf[info.l4_offset + 16] ^= 0x5a; // the checksum field
    let (o, _) = inc(&mut c, p);
    assert_eq!((kind(o.verdict), o.event), (Verdict::Drop, Some(Event::PeerBadChecksum)));
    assert_eq!(c, before, "nothing learned from a packet that fails its checksum");
    // The same packet with its checksum intact teaches ackB.
    let (o, _) = inc(&mut c, from_b(genuine_ack(A_ISN + 2001, 120), b""));
    assert_eq!(kind(o.verdict), FORWARD);
    assert_eq!(c.ack_b, A_ISN + 2001);
    // A checksum the driver says is partial (built on this host) is not checked.
    let mut c = established();
    let mut p = from_b(genuine_ack(A_ISN + 2001, 120), b"");
    let info = IpInfo::parse(&p.buf[..p.len]).unwrap();
    p.buf[info.l4_offset + 16] ^= 0x5a;
    let o = rtcp::incoming_with(&mut c, &mut p.buf, p.len, rtcp::PeerChecksum::Partial).unwrap();
    assert_eq!(kind(o.verdict), FORWARD);
    assert_eq!(c.ack_b, A_ISN + 2001);
}

#[test]
fn hostile_peer_blind_ack_outside_the_window_moves_nothing() {
    let mut c = established();
    let before = c;
    // A blind forger: right 4-tuple, a valid checksum, SEQ and ACK guessed.
    for seq in [B_ISN.wrapping_add(0x0400_0000), B_ISN.wrapping_add(0x4000_0000), B_ISN.wrapping_add(0x7fff_0000)] {
        let forged = Repr { seq: Seq(seq), ack: Seq(A_ISN + 1_000_000), flags: F::ACK, window: 500, timestamp: Some((5000, 9000)), ..Default::default() };
        let (o, _) = inc(&mut c, from_b(forged, b""));
        assert_eq!((kind(o.verdict), o.event), (Verdict::Drop, Some(Event::PeerOutOfWindow)), "seq {seq}");
        let (o, _) = inc(&mut c, from_b(Repr { flags: F::ACK | F::FIN, ..forged }, b"xyz"));
        assert_eq!(kind(o.verdict), Verdict::Drop);
    }
    // Behind the checkpoint: forwarded (A's TCP answers with a duplicate ACK), nothing learned.
    for seq in [B_ISN.wrapping_sub(0x0100_0000), B_ISN.wrapping_add(0x9000_0000)] {
        let forged = Repr { seq: Seq(seq), ack: Seq(A_ISN + 1_000_000), flags: F::ACK | F::FIN, window: 500, timestamp: Some((5000, 9000)), ..Default::default() };
        let (o, _) = inc(&mut c, from_b(forged, b"xyz"));
        assert_eq!((kind(o.verdict), o.event), (FORWARD, None), "seq {seq}");
    }
    assert_eq!(c, before, "ackB, timestamps and flags untouched");
    // An old duplicate (entirely before the checkpoint) is forwarded, for A's TCP to answer
    // with a duplicate ACK, but teaches nothing.
    let cmd = Command { ack_a: B_ISN + 3001, ..Command::request(Op::Acknowledge, SocketAddr::new(a_ip(), A_PORT), SocketAddr::new(b_ip(), B_PORT), 3, 3) };
    rtcp::command(&mut c, &cmd, &mut [0u8; 128]);
    let before = c;
    let old = Repr { seq: Seq(B_ISN + 1), ack: Seq(A_ISN + 7001), flags: F::ACK | F::FIN, window: 500, timestamp: Some((130, 9000)), ..Default::default() };
    let (o, _) = inc(&mut c, from_b(old, &[1u8; 1000]));
    assert_eq!(kind(o.verdict), FORWARD);
    assert_eq!(c, before, "an old segment moves neither ackB nor the FIN flag");
    assert!(c.flags & flag::FIN_B_SEEN == 0);
}

#[test]
fn hostile_peer_resets_follow_rfc5961() {
    let mut c = established();
    let before = c;
    // Out of the window: dropped, never reaches A's TCP.
    for seq in [B_ISN.wrapping_add(0x2000_0000), B_ISN.wrapping_sub(10), B_ISN.wrapping_add(0xC000_0000)] {
        let (o, _) = inc(&mut c, from_b(Repr { seq: Seq(seq), flags: F::RST, ..Default::default() }, b""));
        assert_eq!((kind(o.verdict), o.event), (Verdict::Drop, Some(Event::PeerOutOfWindow)), "seq {seq}");
    }
    // In the window: A's own TCP checks it exactly (an exact SEQ resets, an inexact one draws
    // a challenge ACK). Either way the guard keeps its state.
    for seq in [B_ISN + 1, B_ISN + 5000] {
        let (o, _) = inc(&mut c, from_b(Repr { seq: Seq(seq), ack: Seq(A_ISN + 1), flags: F::RST | F::ACK, ..Default::default() }, b""));
        assert_eq!(kind(o.verdict), FORWARD, "seq {seq}");
    }
    assert_eq!(c, before, "a RST never changes the state");
}

#[test]
fn hostile_peer_syn_or_synack_on_a_synchronized_connection_changes_nothing() {
    let mut c = established();
    let before = c;
    // A SYN: A's TCP answers with a challenge ACK (RFC 5961 section 4); nothing re-keyed.
    let (o, _) = inc(&mut c, from_b(Repr { seq: Seq(0x1234_5678), flags: F::SYN, ..syn_opts(7) }, b""));
    assert_eq!((kind(o.verdict), o.event), (FORWARD, Some(Event::PeerSynChallenged)));
    assert_eq!(c, before, "ackA, Δ and options untouched");
    // A SYN-ACK that answers no pending SYN: dropped.
    let (o, _) = inc(&mut c, from_b(Repr { seq: Seq(0x1234_5678), ack: Seq(A_ISN + 1), flags: F::SYN | F::ACK, ..syn_opts(7) }, b""));
    assert_eq!((kind(o.verdict), o.event), (Verdict::Drop, Some(Event::PeerOutOfWindow)));
    assert_eq!(c, before);
    // B's own SYN-ACK again (A's handshake ACK was lost): passed, nothing changes.
    let (o, _) = inc(&mut c, from_b(Repr { seq: Seq(B_ISN), ack: Seq(A_ISN + 1), flags: F::SYN | F::ACK, ..syn_opts(7) }, b""));
    assert_eq!(kind(o.verdict), FORWARD);
    assert_eq!(c, before);
    // As a client: the SYN-ACK must answer the pending SYN.
    let mut c = Conn::default();
    out(&mut c, from_a(Repr { seq: Seq(A_ISN), flags: F::SYN, ..syn_opts(1) }, b""));
    let pending = c;
    let (o, _) = inc(&mut c, from_b(Repr { seq: Seq(B_ISN), ack: Seq(A_ISN + 99), flags: F::SYN | F::ACK, ..syn_opts(2) }, b""));
    assert_eq!(kind(o.verdict), Verdict::Drop);
    assert_eq!(c, pending);
    let (o, _) = inc(&mut c, from_b(Repr { seq: Seq(B_ISN), ack: Seq(A_ISN + 1), flags: F::SYN | F::ACK, ..syn_opts(2) }, b""));
    assert_eq!(kind(o.verdict), FORWARD);
    assert_eq!(c.ack_a, B_ISN + 1);
}

#[test]
fn hostile_blind_packets_after_a_recovery_move_neither_delta_nor_ackb_nor_end_protection() {
    let (mut c, o, _) = recovered(777);
    assert_eq!(o.event, Some(Event::Recovered));
    let before = c;
    let far = B_ISN.wrapping_add(0x8000_0000);
    let forged = [
        Repr { seq: Seq(far), ack: Seq(A_ISN + 900_000), flags: F::ACK, window: 10, ..Default::default() },
        Repr { seq: Seq(far), ack: Seq(A_ISN + 900_000), flags: F::ACK | F::FIN, window: 10, ..Default::default() },
        Repr { seq: Seq(far), flags: F::RST, ..Default::default() },
        Repr { seq: Seq(far), ack: Seq(778), flags: F::SYN | F::ACK, ..syn_opts(3) },
        Repr { seq: Seq(far), flags: F::SYN, ..syn_opts(3) },
    ];
    for r in forged {
        inc(&mut c, from_b(r, b""));
        assert_eq!((c.delta, c.ack_b, c.ack_a, c.ts_off), (before.delta, before.ack_b, before.ack_a, before.ts_off), "{r:?}");
        assert!(c.flags & (flag::FIN_B_SEEN | flag::SYNCED | flag::RECOVERABLE) == before.flags & (flag::FIN_B_SEEN | flag::SYNCED | flag::RECOVERABLE));
    }
    // A's genuine FIN after SHUTDOWN does not close the connection for the guard: B's FIN
    // never came.
    let cmd = Command::request(Op::Shutdown, SocketAddr::new(a_ip(), A_PORT), SocketAddr::new(b_ip(), B_PORT), 9, 9);
    rtcp::command(&mut c, &cmd, &mut [0u8; 128]);
    out(&mut c, from_a(Repr { seq: Seq(778), ack: Seq(B_ISN + 2001), flags: F::FIN | F::ACK, window: 100, timestamp: Some((40, 150)), ..Default::default() }, b""));
    assert!(!c.is_closed(), "a forged FIN did not make the guard forget the connection");
}

/// Issue 10 item 0: a caller that parsed the IP header hands its view down (the packet is
/// parsed once) and gets the same answer; a view that does not fit the packet is refused as
/// an error, never a panic or a read past the packet.
#[test]
fn hostile_a_parsed_view_gives_the_same_answer_and_a_wrong_one_is_refused() {
    let syn = Repr { seq: Seq(B_ISN), flags: F::SYN, mss: Some(1460), window: 65535, ..Default::default() };
    let (mut c1, mut c2) = (Conn::default(), Conn::default());
    let (o1, p1) = inc(&mut c1, from_b(syn, b""));
    let mut p2 = from_b(syn, b"");
    let info = IpInfo::parse(&p2.buf[..p2.len]).unwrap();
    let o2 = rtcp::incoming_parsed(&mut c2, &mut p2.buf, p2.len, &info, rtcp::PeerChecksum::Verify).unwrap();
    assert_eq!((o1, &p1.buf), (o2, &p2.buf));
    assert_eq!(c1, c2);
    let mut p3 = from_a(Repr { seq: Seq(7), ack: Seq(B_ISN + 1), flags: F::SYN | F::ACK, window: 65535, ..Default::default() }, b"");
    let (mut c3, mut c4) = (c1, c1);
    let (o3, p3a) = out(&mut c3, from_a(Repr { seq: Seq(7), ack: Seq(B_ISN + 1), flags: F::SYN | F::ACK, window: 65535, ..Default::default() }, b""));
    let info3 = IpInfo::parse(&p3.buf[..p3.len]).unwrap();
    let o4 = rtcp::outgoing_parsed(&mut c4, &mut p3.buf, p3.len, &info3).unwrap();
    assert_eq!((o3, &p3a.buf, c3), (o4, &p3.buf, c4));
    // A view whose segment runs past the packet (or is not TCP): an error, state untouched.
    let before = c2;
    let mut long = info;
    long.l4_len += 1000;
    assert!(rtcp::incoming_parsed(&mut c2, &mut p2.buf, p2.len, &long, rtcp::PeerChecksum::Verify).is_err());
    assert!(rtcp::outgoing_parsed(&mut c2, &mut p2.buf, p2.len, &long).is_err());
    let mut far = info;
    far.l4_offset = usize::MAX - 2;
    assert!(rtcp::incoming_parsed(&mut c2, &mut p2.buf, p2.len, &far, rtcp::PeerChecksum::Verify).is_err());
    let mut udp = info;
    udp.protocol = 17;
    assert!(rtcp::outgoing_parsed(&mut c2, &mut p2.buf, p2.len, &udp).is_err());
    assert_eq!(c2, before);
}
