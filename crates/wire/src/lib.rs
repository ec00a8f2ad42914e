//! `unbroken-wire`: the bottom floor. Zero-copy packet views in the style of smoltcp's
//! `src/wire` (a `Packet<T: AsRef<[u8]>>` per header, checked once at construction, one getter
//! per field, setters only for `AsMut` buffers), RFC 1071/1624 checksums, sequence numbers
//! modulo 2^32, and every other byte layout that crosses a wire or a store. Checkpoint mode: the
//! side channel ([`ctl`]) and the connection record applications persist ([`ckptrec`]). Object
//! mode: the heartbeats between agents and load balancer ([`hb`]), the balancer's bucket marker
//! ([`marker`]), the store record ([`objrec`]), its sealed envelope ([`sealed`]) and RESP2, the
//! protocol of the Redis store ([`resp`]). Replica mode: the
//! primary's and backup's progress heartbeats ([`replica`]) and the gratuitous ARP a backup
//! announces the service address with ([`arp`]). Malformed input is an `Err`, never a panic.

pub mod arp;
pub mod checksum;
pub mod ckptrec;
pub mod ctl;
pub mod hb;
pub mod ip;
pub mod ipv4;
pub mod ipv6;
pub mod marker;
pub mod objrec;
pub mod resp;
pub mod sealed;
pub mod seq;
pub mod replica;
pub mod tcp;
pub mod udp;

pub use seq::Seq;

/// Why a buffer could not be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Error {
    /// Shorter than its headers or length fields say.
    Truncated,
    /// A field holds an impossible value.
    Malformed(&'static str),
    /// Valid but outside what this layer handles (fragments, extension headers, new versions).
    Unsupported(&'static str),
    /// A side-channel command whose MAC does not verify.
    Unauthenticated,
}

impl core::fmt::Display for Error {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Error::Truncated => write!(f, "truncated"),
            Error::Malformed(w) => write!(f, "malformed: {w}"),
            Error::Unsupported(w) => write!(f, "unsupported: {w}"),
            Error::Unauthenticated => write!(f, "authentication failed"),
        }
    }
}

impl std::error::Error for Error {}

pub type Result<T> = core::result::Result<T, Error>;
