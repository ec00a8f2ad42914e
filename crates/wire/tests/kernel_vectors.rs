//! Checksums and options checked against packets the Linux kernel built: a TCP transfer over
//! IPv4 and one over IPv6, captured on a veth with checksum offload off (so every checksum on the
//! wire is the kernel's own), in testdata/kernel_tcp.pcap (Ethernet link type).

mod kernel_pcap;

use kernel_pcap::ip_packets;
use unbroken_wire::ip::{IpInfo, PROTO_TCP};
use unbroken_wire::tcp::{flags, Packet as Tcp, Repr};
use unbroken_wire::ipv4;

#[test]
fn every_kernel_checksum_verifies() {
    let pkts = ip_packets();
    assert_eq!(pkts.len(), 32);
    let (mut v4, mut v6) = (0, 0);
    for p in &pkts {
        let info = IpInfo::parse(p).unwrap();
        assert_eq!(info.protocol, PROTO_TCP);
        if info.src.is_ipv4() {
            v4 += 1;
            assert!(ipv4::Packet::new_checked(&p[..]).unwrap().verify_checksum());
        } else {
            v6 += 1;
        }
        let seg = &p[info.l4_offset..info.l4_offset + info.l4_len];
        assert!(Tcp::new_checked(seg).unwrap().verify_checksum(info.pseudo_sum(info.l4_len)));
        // Recomputing from scratch gives back the kernel's exact value.
        let mut copy = seg.to_vec();
        let mut t = Tcp::new_checked(&mut copy[..]).unwrap();
        let kernel = t.checksum();
        t.fill_checksum(info.pseudo_sum(info.l4_len));
        assert_eq!(t.checksum(), kernel);
    }
    assert_eq!((v4, v6), (16, 16));
}

#[test]
fn kernel_syn_options_parse() {
    let pkts = ip_packets();
    let syns: Vec<(bool, Repr)> = pkts
        .iter()
        .filter_map(|p| {
            let info = IpInfo::parse(p).unwrap();
            let t = Tcp::new_checked(&p[info.l4_offset..info.l4_offset + info.l4_len]).unwrap();
            t.has(flags::SYN).then(|| (info.src.is_ipv4(), Repr::parse(&t).unwrap()))
        })
        .collect();
    assert_eq!(syns.len(), 4, "SYN and SYN-ACK of each connection");
    for (v4, s) in &syns {
        // 1500-byte MTU: 1460 over IPv4, 1440 over IPv6.
        assert_eq!(s.mss, Some(if *v4 { 1460 } else { 1440 }));
        assert_eq!(s.wscale, Some(10));
        assert!(s.sack_perm);
        assert!(s.timestamp.is_some());
    }
}

#[test]
fn incremental_rewrites_match_kernel_built_packets_recomputed() {
    // Every rewrite the engines do, applied to real packets: the RFC 1624 result must verify and
    // equal a full recomputation.
    for p in ip_packets() {
        let info = IpInfo::parse(&p).unwrap();
        let pseudo = info.pseudo_sum(info.l4_len);
        let mut seg = p[info.l4_offset..info.l4_offset + info.l4_len].to_vec();
        let mut t = Tcp::new_checked(&mut seg[..]).unwrap();
        t.rewrite_seq(t.seq() - 0x8000_0001);
        t.rewrite_ack(t.ack() + 0xdead_beef);
        t.rewrite_window(t.window().wrapping_mul(3));
        let ts_at = t.option_slots().map(|s| s.unwrap()).find(|s| s.kind == 8).map(|s| s.offset);
        if let Some(at) = ts_at {
            t.rewrite_u32_at(at + 2, 0x7fff_ffff);
            t.rewrite_u32_at(at + 6, 1);
        }
        assert!(t.verify_checksum(pseudo));
        let incremental = t.checksum();
        t.fill_checksum(pseudo);
        assert_eq!(incremental, t.checksum(), "RFC 1624 update equals a full recomputation");
    }
}
