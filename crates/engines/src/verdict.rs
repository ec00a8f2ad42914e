//! The one verdict every mode's core gives a packet (issue 10 item 0: the engines and the
//! daemons had three verdict enums, `rtcp::Verdict`, `trods::Verdict` and `guard::Action`,
//! each a subset of this one). The daemon maps it to the queue's kernel verdict.

/// What the daemon does with a packet a core has seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Let it go on its way; `modified` when its bytes were rewritten (checksums updated).
    Accept { modified: bool },
    /// Discard it.
    Drop,
    /// It was rewritten into a packet travelling the other way (back toward its sender):
    /// discard the original and inject the rewritten bytes instead.
    Inject,
    /// The core kept a copy and releases it later (object mode: a response waiting for its
    /// record; replica mode: output waiting for the backup).
    Held,
    /// A packet of a connection the core does not know that may be one it must take over (a
    /// failover candidate): the mode decides from state outside the packet (the store, the
    /// backup, the LB's view).
    Unknown,
}

impl Verdict {
    /// Unchanged bytes, let through.
    pub const PASS: Verdict = Verdict::Accept { modified: false };
}
