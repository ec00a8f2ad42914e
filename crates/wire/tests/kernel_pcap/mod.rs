//! The kernel-built packets of testdata/kernel_tcp.pcap (a TCP transfer over IPv4 and one over
//! IPv6, captured on a veth with checksum offload off, so every checksum is the kernel's own).
//! Shared by the wire's kernel vectors and the fast path's tests
//! (`crates/drivers/tests/fastpath_checkpoint.rs`, included with `#[path]`).

/// The IP packets in a classic little-endian pcap of Ethernet frames.
pub fn ip_packets() -> Vec<Vec<u8>> {
    let pcap = include_bytes!("../../../../testdata/kernel_tcp.pcap");
    assert_eq!(&pcap[..4], &[0xd4, 0xc3, 0xb2, 0xa1], "little-endian pcap");
    assert_eq!(u32::from_le_bytes(pcap[20..24].try_into().unwrap()), 1, "Ethernet link type");
    let mut out = Vec::new();
    let mut at = 24;
    while at + 16 <= pcap.len() {
        let caplen = u32::from_le_bytes(pcap[at + 8..at + 12].try_into().unwrap()) as usize;
        let frame = &pcap[at + 16..at + 16 + caplen];
        let ethertype = u16::from_be_bytes([frame[12], frame[13]]);
        if ethertype == 0x0800 || ethertype == 0x86dd {
            out.push(frame[14..].to_vec());
        }
        at += 16 + caplen;
    }
    out
}
