//! The SDK's error type.

use core::fmt;
use std::io;

/// Everything that can go wrong talking to the guard or recovering a connection.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// Nothing answered (with a response that authenticates and matches the request, or a
    /// refusal) within all tries: no guard listens at that address, the path to it is down,
    /// or the guard drops our datagrams without a word (our source address is not in its
    /// `allowed_sources`, or it is refusing faster than its refusal rate limit).
    Timeout {
        /// How many datagrams were sent, each with a fresh nonce.
        tries: u32,
    },
    /// The guard refused the command before reading it: `reason` is
    /// [`unbroken_wire::ctl::refusal::KEY`] (our key is not the guard's) or
    /// [`CLOCK`](unbroken_wire::ctl::refusal::CLOCK) (our clock is further than the guard's
    /// `max_clock_skew_ms` from its own). The refusal cannot be authenticated (we do not share
    /// a key), but it echoes one of the request's random nonces, so only someone who saw the
    /// request could have forged it.
    Refused {
        /// Why, as the guard says.
        reason: u8,
    },
    /// The guard answered with a non-zero status (see [`status`]).
    Rejected(u8),
    /// The guard answered, but its state for the connection cannot support the operation:
    /// right after the handshake it must report both `RECOVERABLE` (it saw the peer's ACK) and
    /// `ACK_ALLOWED` (it saw the peer's SYN). `flags` are the last reply's flags
    /// ([`unbroken_wire::ctl::flag`]).
    NotRecoverable {
        /// Flags of the last reply.
        flags: u8,
    },
    /// The peer acknowledged more bytes than the application says it sent: the persisted
    /// `sent_total` is behind (or the record belongs to another connection). If the
    /// application had sent a FIN (after `shutdown_writing`) that the peer acknowledged,
    /// `delivered` is `sent + 1`.
    DeliveredBeyondSent {
        /// Bytes the peer acknowledged (already unwrapped near `sent`).
        delivered: u64,
        /// The application's `sent_total`.
        sent: u64,
    },
    /// The guard's state and the record or counters disagree in a way no delivery can
    /// explain (e.g. a record of another connection).
    Inconsistent(&'static str),
    /// A [`ConnRecord`](crate::ConnRecord) could not be decoded (wrong length, magic,
    /// version, checksum or field).
    BadRecord(&'static str),
    /// An argument was unusable (address family mismatch, unparsable address or key, ...).
    InvalidArgument(&'static str),
    /// The side-channel format refused to encode the command.
    Wire(unbroken_wire::Error),
    /// A system call failed (socket, bind, connect, send, TCP_INFO...).
    Io(io::Error),
    /// Nothing was asked: the client's start-up check
    /// ([`GuardClient::probe`](crate::GuardClient::probe)) failed with this error and no probe
    /// has succeeded since, so [`establish`](crate::establish) gave up at once, without a
    /// datagram (and marked the socket unprotected). See
    /// [`GuardClient::failed_check`](crate::GuardClient::failed_check).
    GuardCheckFailed(Box<Error>),
}

/// Response status codes of side-channel format v1 (byte 6 of a response).
pub mod status {
    /// Success.
    pub const OK: u8 = 0;
    /// The guard has no state for this connection (only TELL reports this).
    pub const NO_CONNECTION: u8 = 1;
    /// The guard could not make sense of the command.
    pub const BAD_REQUEST: u8 = 2;
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Timeout { tries } => write!(f, "nothing answered at the guard's address ({tries} tries): no guard there, or it drops our datagrams (source not in allowed_sources)"),
            Error::Refused { reason: unbroken_wire::ctl::refusal::KEY } => write!(f, "the guard rejected the side-channel key (its MAC check failed): the application's key is not the guard's"),
            Error::Refused { reason: unbroken_wire::ctl::refusal::CLOCK } => write!(f, "the guard rejected our clock (more than its max_clock_skew_ms from the guard's)"),
            Error::Refused { reason } => write!(f, "the guard refused the command (reason {reason})"),
            Error::Rejected(status::NO_CONNECTION) => write!(f, "guard rejected the command: no such connection"),
            Error::Rejected(status::BAD_REQUEST) => write!(f, "guard rejected the command: bad request"),
            Error::Rejected(s) => write!(f, "guard rejected the command: status {s}"),
            Error::NotRecoverable { flags } => write!(f, "guard cannot recover this connection (flags {flags:#04x})"),
            Error::DeliveredBeyondSent { delivered, sent } => {
                write!(f, "peer acknowledged {delivered} bytes but only {sent} were sent")
            }
            Error::Inconsistent(w) => write!(f, "inconsistent state: {w}"),
            Error::BadRecord(w) => write!(f, "bad connection record: {w}"),
            Error::InvalidArgument(w) => write!(f, "invalid argument: {w}"),
            Error::Wire(e) => write!(f, "side-channel encoding: {e}"),
            Error::Io(e) => write!(f, "i/o: {e}"),
            Error::GuardCheckFailed(e) => write!(f, "not asked: the guard check at start-up failed ({e})"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io(e) => Some(e),
            Error::Wire(e) => Some(e),
            Error::GuardCheckFailed(e) => Some(e.as_ref()),
            _ => None,
        }
    }
}

impl Error {
    /// A copy to keep (the error of a failed probe, returned again by later calls); an I/O
    /// error keeps its OS error code, or its kind and message.
    pub(crate) fn copy(&self) -> Error {
        match self {
            Error::Timeout { tries } => Error::Timeout { tries: *tries },
            Error::Refused { reason } => Error::Refused { reason: *reason },
            Error::Rejected(s) => Error::Rejected(*s),
            Error::NotRecoverable { flags } => Error::NotRecoverable { flags: *flags },
            Error::DeliveredBeyondSent { delivered, sent } => Error::DeliveredBeyondSent { delivered: *delivered, sent: *sent },
            Error::Inconsistent(w) => Error::Inconsistent(w),
            Error::BadRecord(w) => Error::BadRecord(w),
            Error::InvalidArgument(w) => Error::InvalidArgument(w),
            Error::Wire(e) => Error::Wire(*e),
            Error::Io(e) => Error::Io(match e.raw_os_error() {
                Some(code) => io::Error::from_raw_os_error(code),
                None => io::Error::new(e.kind(), e.to_string()),
            }),
            Error::GuardCheckFailed(e) => Error::GuardCheckFailed(Box::new(e.copy())),
        }
    }
}

impl From<io::Error> for Error {
    fn from(e: io::Error) -> Error {
        Error::Io(e)
    }
}

impl From<unbroken_wire::Error> for Error {
    fn from(e: unbroken_wire::Error) -> Error {
        Error::Wire(e)
    }
}

/// `Result` with the SDK's [`Error`].
pub type Result<T> = core::result::Result<T, Error>;
