//! `unbroken-sdk`: the application side of checkpoint mode (RTCP, Surton et al., "Man-in-the-
//! Middle TCP Recovery", section 4), as a Rust library and a C ABI (`include/unbroken.h`).
//!
//! A guard (packet filter) between the application *A* and its peer *B* holds back *A*'s
//! acknowledgments until *A* says its input is safely stored, suppresses the RSTs and FINs *A*'s
//! kernel sends when *A* crashes, and answers *A*'s reconnection SYN as if it came from *B*, so
//! the connection survives. This crate is how *A* takes part:
//!
//! - [`GuardClient`]: the authenticated UDP side channel (RTCP_TELL, _ACKNOWLEDGE, _SHUTDOWN,
//!   _SHUTDOWN_READING, _SHUTDOWN_WRITING, _CLEAR), with fresh nonces and retransmission.
//! - [`ConnRecord`]: the 64-byte record to persist per connection.
//! - [`establish`], [`acknowledge`], [`acknowledge_eof`], [`shutdown`], [`shutdown_writing`],
//!   [`shutdown_reading`], [`clear`], [`recover`]: the section 4 protocol.
//! - [`ffi`]: the same for C.
//!
//! The application keeps two counters with its checkpoint: `consumed_total`, input bytes
//! safely stored or processed, and `sent_total`, output bytes journaled and then written. It
//! must journal output *before* writing it (output determinism, section 2.3.1): after a
//! recovery it resends from the byte the peer is known to have received.
//!
//! ```no_run
//! use std::io::{Read, Write};
//! use unbroken_sdk::{GuardClient, ConnRecord};
//! # fn persist(_: &[u8], _: u64, _: u64) {}
//! # fn load() -> (Vec<u8>, u64, u64) { unimplemented!() }
//! # fn journal_from(_: u64) -> Vec<u8> { unimplemented!() }
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let client = GuardClient::from_strs("10.77.2.1:7900", "00112233445566778899aabbccddeeff")?;
//! // A server listens with SO_REUSEPORT so that recovered connections can bind its port.
//! let listener = unbroken_sdk::reuseport_listener("0.0.0.0:7000".parse()?, 128)?;
//! let (mut stream, _) = listener.accept()?;
//! let rec = unbroken_sdk::establish(&stream, &client)?; // before sending anything
//! persist(&rec.to_bytes(), 0, 0);
//! let mut buf = [0u8; 4096];
//! let n = stream.read(&mut buf)?;
//! // ... store or process buf[..n] durably, then:
//! persist(&rec.to_bytes(), n as u64, 0);
//! unbroken_sdk::acknowledge(&rec, &client, n as u64)?;
//!
//! // After a crash, in the new process:
//! let (bytes, consumed, sent) = load();
//! let rec = ConnRecord::from_bytes(&bytes)?;
//! let (mut stream, delivered) = unbroken_sdk::recover(&rec, &client, consumed, sent)?;
//! stream.write_all(&journal_from(delivered))?; // output the peer may not have received
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

pub mod client;
pub mod conn;
pub mod error;
pub mod ffi;
pub mod record;

pub use client::{ClientConfig, ClientStats, GuardClient, Reply};
pub use conn::{acknowledge, acknowledge_eof, acknowledge_nowait, adopt, clear, decline, establish, recover, reuseport_listener, shutdown, shutdown_reading, shutdown_writing, tcp_info_options, unprotect};
pub use error::{status, Error, Result};
pub use record::{delivered_total, ConnRecord, RECORD_LEN, RECORD_MAGIC, RECORD_VERSION};
/// The side-channel format this API speaks: `Key`, `ConnOptions`, `Op`, `Command`, flags.
pub use unbroken_wire::ctl;
pub use unbroken_wire::ctl::{ConnOptions, Key, Op};
