//! The bucket marker: the source MAC the object-mode load balancer writes into every frame it
//! forwards, `02:75:62:00:HH:LL` with `HHLL` the frame's bucket (big endian), so that the
//! server's agent learns the bucket without replicating the balancer's hash. The balancer's
//! nftables `marker` map holds [`marker_mac`] of every bucket; the agent reads the frame's
//! source MAC (NFQUEUE's hardware address attribute) with [`bucket_of_mac`].
//!
//! | byte | value |
//! |---|---|
//! | 0..4 | [`MARKER_PREFIX`]: `02` (locally administered, unicast), `75 62` ("ub"), `00` |
//! | 4..6 | the bucket, big endian |

/// The first four bytes of every marker MAC (`02:75:62:00:HH:LL`).
pub const MARKER_PREFIX: [u8; 4] = [0x02, 0x75, 0x62, 0x00];

/// The marker source MAC the balancer writes into frames of bucket `bucket`.
pub fn marker_mac(bucket: u16) -> [u8; 6] {
    let b = bucket.to_be_bytes();
    [MARKER_PREFIX[0], MARKER_PREFIX[1], MARKER_PREFIX[2], MARKER_PREFIX[3], b[0], b[1]]
}

/// The bucket a marker MAC (`02:75:62:00:HH:LL`, the source MAC of a frame the balancer
/// forwarded) stands for; `None` for any other MAC.
pub fn bucket_of_mac(mac: [u8; 6]) -> Option<u16> {
    (mac[..4] == MARKER_PREFIX).then(|| u16::from_be_bytes([mac[4], mac[5]]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_stable() {
        assert_eq!(marker_mac(0x0102), [0x02, 0x75, 0x62, 0x00, 0x01, 0x02]);
        assert_eq!(marker_mac(4095), [0x02, 0x75, 0x62, 0x00, 0x0f, 0xff]);
        for b in [0u16, 1, 255, 256, 4095, u16::MAX] {
            assert_eq!(bucket_of_mac(marker_mac(b)), Some(b));
        }
        // Any other prefix is no marker (a server's own MAC, another balancer's scheme).
        for i in 0..4 {
            let mut m = marker_mac(7);
            m[i] ^= 1;
            assert_eq!(bucket_of_mac(m), None);
        }
    }
}
