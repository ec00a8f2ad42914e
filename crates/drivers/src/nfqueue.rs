//! An NFQUEUE consumer speaking nfnetlink directly over a `NETLINK_NETFILTER` socket.
//!
//! The kernel side is `net/netfilter/nfnetlink_queue.c`; the message formats are in
//! `include/uapi/linux/netfilter/nfnetlink_queue.h`. Every message starts with a `nlmsghdr`
//! whose type is `(NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_*`, then a 4-byte `nfgenmsg`
//! (`u8 family, u8 version, be16 res_id`, where `res_id` is the queue number), then
//! attributes. Netfilter attribute values are big-endian.
//!
//! Design points:
//! - **Receiving in batches.** [`Queue::recv_batch`] blocks (with `poll`) until something is
//!   readable, then drains with `recvmmsg(MSG_DONTWAIT)`, one datagram per buffer, so a busy
//!   queue costs one system call per batch rather than per packet.
//! - **Verdicts in batches.** [`Queue::set_verdict`] appends a `NFQNL_MSG_VERDICT` message to a
//!   send buffer; [`Queue::flush`] hands them all to the kernel in one `send`. The buffer is
//!   flushed automatically when it grows large and before `recv_batch` waits, so a consumer that
//!   forgets to flush delays its verdicts by one batch at most.
//! - **GSO.** With [`QueueConfig::gso`] the kernel hands over GSO super-packets (up to 64 KiB)
//!   unsegmented, about 6x the throughput of per-segment queueing on this kind of machine. Such
//!   packets usually carry a *partial* TCP/UDP checksum ([`QueuedPacket::csum_not_ready`]); a
//!   consumer that modifies one must write the full checksum, since the kernel treats the
//!   checksum of a mangled packet as final.
//! - **Overflow.** When the socket receive buffer overflows the kernel drops (or, with
//!   [`QueueConfig::fail_open`], accepts) the packet and flags `ENOBUFS` on the socket;
//!   `recv_batch` counts it in [`Stats::enobufs`] and carries on.
//! - **Errors.** Verdicts are sent without acknowledgement requests; the kernel still answers a
//!   failing one (for example an unknown packet id) with an error message, which `recv_batch`
//!   counts in [`Stats::verdict_errors`]. Configuration is acknowledged and checked, so
//!   [`Queue::open`] fails with a [`NetlinkError`] that says what went wrong.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use crate::netlink::{self, Msg, MsgWriter, ParseError, NLM_F_ACK, NLM_F_REQUEST};
use crate::sys;

// ---- include/uapi/linux/netfilter/nfnetlink.h and nfnetlink_queue.h -------------------------

const NFNL_SUBSYS_QUEUE: u16 = 3;
const NFNETLINK_V0: u8 = 0;

const NFQNL_MSG_PACKET: u16 = 0;
const NFQNL_MSG_VERDICT: u16 = 1;
const NFQNL_MSG_CONFIG: u16 = 2;

const NFQA_PACKET_HDR: u16 = 1;
const NFQA_VERDICT_HDR: u16 = 2;
const NFQA_MARK: u16 = 3;
const NFQA_HWADDR: u16 = 9;
const NFQA_IFINDEX_INDEV: u16 = 5;
const NFQA_IFINDEX_OUTDEV: u16 = 6;
const NFQA_PAYLOAD: u16 = 10;
const NFQA_CAP_LEN: u16 = 13;
const NFQA_SKB_INFO: u16 = 14;

const NFQA_CFG_CMD: u16 = 1;
const NFQA_CFG_PARAMS: u16 = 2;
const NFQA_CFG_QUEUE_MAXLEN: u16 = 3;
const NFQA_CFG_MASK: u16 = 4;
const NFQA_CFG_FLAGS: u16 = 5;

const NFQNL_CFG_CMD_BIND: u8 = 1;
const NFQNL_CFG_CMD_UNBIND: u8 = 2;
const NFQNL_COPY_PACKET: u8 = 2;

const NFQA_CFG_F_FAIL_OPEN: u32 = 1 << 0;
const NFQA_CFG_F_GSO: u32 = 1 << 2;

const NFQA_SKB_CSUMNOTREADY: u32 = 1 << 0;
const NFQA_SKB_GSO: u32 = 1 << 1;
const NFQA_SKB_CSUM_NOTVERIFIED: u32 = 1 << 2;

const NF_DROP: u32 = 0;
const NF_ACCEPT: u32 = 1;
const NF_REPEAT: u32 = 4;

/// The largest copy range the kernel grants (`NFQNL_MAX_COPY_RANGE`): a payload attribute's
/// length is a `u16` including its 4-byte header.
pub const MAX_PAYLOAD: usize = netlink::NLA_MAX_PAYLOAD;

/// Receive buffer per datagram: the largest packet message (payload attribute plus every
/// other attribute the kernel may add) fits with room to spare, so datagrams are never cut.
const RECV_BUF_SIZE: usize = 64 * 1024 + 4096;
/// Upper bound on datagrams fetched by one `recvmmsg`.
const MAX_BATCH: usize = 64;
/// Verdict messages are flushed once the pending bytes pass this.
const SEND_FLUSH_BYTES: usize = 256 * 1024;
/// How long [`Queue::open`] waits for the kernel's acknowledgement.
const ACK_TIMEOUT: Duration = Duration::from_secs(5);

const fn msg_type(m: u16) -> u16 {
    (NFNL_SUBSYS_QUEUE << 8) | m
}

// ---- public types ----------------------------------------------------------------------------

/// How to bind and configure a queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueConfig {
    /// Queue number, as in `iptables -j NFQUEUE --queue-num N`.
    pub queue_num: u16,
    /// Most packets the kernel holds waiting for a verdict (`NFQA_CFG_QUEUE_MAXLEN`); beyond
    /// that it drops new packets, or accepts them with [`QueueConfig::fail_open`].
    pub max_len: u32,
    /// Ask for unsegmented GSO packets (`NFQA_CFG_F_GSO`). See the module documentation.
    pub gso: bool,
    /// Accept instead of drop packets that do not fit in the queue or the socket buffer
    /// (`NFQA_CFG_F_FAIL_OPEN`). A stopped consumer that is still bound stalls traffic anyway.
    pub fail_open: bool,
    /// Socket receive buffer in bytes (set with `SO_RCVBUFFORCE`; the kernel doubles it for
    /// bookkeeping). Bounds how much the kernel can buffer between two `recv_batch` calls.
    pub rcvbuf: usize,
    /// Set `NETLINK_NO_ENOBUFS`: the kernel no longer reports receive-buffer overflows. The
    /// overflowing packets are dropped (or accepted) either way; leaving this `false` keeps
    /// [`Stats::enobufs`] meaningful.
    pub no_enobufs: bool,
}

impl Default for QueueConfig {
    fn default() -> Self {
        QueueConfig {
            queue_num: 0,
            max_len: 4096,
            gso: true,
            fail_open: false,
            rcvbuf: 16 << 20,
            no_enobufs: false,
        }
    }
}

/// A packet handed to user space, waiting for its verdict.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QueuedPacket {
    /// Packet id to pass to [`Queue::set_verdict`].
    pub id: u32,
    /// Netfilter hook: 0 PRE_ROUTING, 1 LOCAL_IN, 2 FORWARD, 3 LOCAL_OUT, 4 POST_ROUTING.
    pub hook: u8,
    /// Link-layer protocol in host byte order (0x0800 IPv4, 0x86dd IPv6).
    pub hw_protocol: u16,
    /// `skb->mark` (0 when the kernel did not send one).
    pub mark: u32,
    /// The transport checksum is partial (to be completed by offload); it "looks wrong" but
    /// is fine as long as the packet is not modified. Modified packets need a full checksum.
    pub csum_not_ready: bool,
    /// The packet is a GSO super-packet and may exceed the MTU.
    pub gso: bool,
    /// The checksum was not verified by the receiving device.
    pub csum_not_verified: bool,
    /// Input interface index (0 when none, e.g. on LOCAL_OUT).
    pub indev: u32,
    /// Source link-layer (Ethernet) address of a received frame (`NFQA_HWADDR`), when the
    /// kernel reports one (incoming packets on Ethernet-like devices).
    pub hw_src: Option<[u8; 6]>,
    /// Output interface index (0 when none, e.g. on LOCAL_IN).
    pub outdev: u32,
    /// Length of the packet in the kernel. Larger than `data.len()` when the copy was cut at
    /// [`MAX_PAYLOAD`]; such a packet must not be given a replacement payload.
    pub orig_len: u32,
    /// The packet from its network header on.
    pub data: Vec<u8>,
}

impl QueuedPacket {
    /// Whether `data` holds only a prefix of the packet.
    pub fn truncated(&self) -> bool {
        (self.orig_len as usize) > self.data.len()
    }
}

/// What the kernel should do with a queued packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// Continue traversal with the next rule/hook (`NF_ACCEPT`).
    Accept,
    /// Discard the packet (`NF_DROP`).
    Drop,
    /// Run the packet through the same hook again from its start (`NF_REPEAT`); combine with
    /// a mark that a `RETURN` rule matches, or it comes straight back to the queue.
    Repeat,
}

impl Verdict {
    fn code(self) -> u32 {
        match self {
            Verdict::Accept => NF_ACCEPT,
            Verdict::Drop => NF_DROP,
            Verdict::Repeat => NF_REPEAT,
        }
    }
}

/// Counters kept by a [`Queue`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Packet messages delivered to the caller.
    pub received: u64,
    /// Receive-buffer overflows reported by the kernel (each lost one or more packets).
    pub enobufs: u64,
    /// Verdict messages handed to the kernel.
    pub verdicts: u64,
    /// Verdicts the kernel rejected (unknown id, bad payload...).
    pub verdict_errors: u64,
    /// Sends of buffered verdicts that failed (the verdicts were kept as drops and sent again).
    pub flush_errors: u64,
    /// Most recent errno of a rejected verdict.
    pub last_verdict_errno: i32,
    /// Messages that could not be decoded. A packet whose id could still be read was
    /// dropped so it does not stall: for a consumer that rewrites packets, letting one pass
    /// unexamined can do more harm than losing it (TCP retransmits a lost segment).
    pub parse_errors: u64,
}

/// A failed netlink request, with the errno the kernel answered and a hint at the cause.
///
/// Returned inside an [`io::Error`] whose kind matches the errno; get it back with
/// `err.get_ref().and_then(|e| e.downcast_ref::<NetlinkError>())`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetlinkError {
    /// What was being done, e.g. "binding NFQUEUE 3".
    pub operation: String,
    /// Positive errno.
    pub errno: i32,
    /// The kernel's extended-ack text or our explanation of the errno.
    pub detail: Option<String>,
}

impl core::fmt::Display for NetlinkError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(
            f,
            "{}: {}",
            self.operation,
            io::Error::from_raw_os_error(self.errno)
        )?;
        if let Some(d) = &self.detail {
            write!(f, " ({d})")?;
        }
        Ok(())
    }
}

impl std::error::Error for NetlinkError {}

impl NetlinkError {
    fn into_io(self) -> io::Error {
        io::Error::new(io::Error::from_raw_os_error(self.errno).kind(), self)
    }
}

/// Most packet buffers [`Queue::recycle`] keeps.
pub const MAX_SPARE: usize = 1024;

/// A bound NFQUEUE consumer.
///
/// The socket belongs to the network namespace of the thread that called [`Queue::open`];
/// the `Queue` may then be moved to and used from any thread. Dropping it flushes pending
/// verdicts, unbinds the queue and closes the socket; the kernel drops packets that are still
/// waiting for a verdict. Use [`Queue::close`] to see errors.
pub struct Queue {
    fd: OwnedFd,
    queue_num: u16,
    seq: u32,
    /// One receive buffer per datagram of a `recvmmsg` batch, grown on demand.
    bufs: Vec<Vec<u8>>,
    /// Pending verdict messages.
    sendbuf: Vec<u8>,
    pending_verdicts: u64,
    /// The packet ids of the verdicts in `sendbuf`: when sending them fails they are turned
    /// into plain drops, kept and sent again at the next flush, so no packet is ever left
    /// waiting in the kernel without a verdict.
    pending_ids: Vec<u32>,
    /// Fault injection for tests: this many of the next sends fail with `ENOBUFS`.
    fail_sends: u32,
    /// Packets received but not handed out yet: those that arrived while `open` waited for
    /// its acknowledgement, or beyond a batch's `max`.
    early: VecDeque<QueuedPacket>,
    /// Payload buffers recycled from the caller's previous batch.
    spare: Vec<Vec<u8>>,
    stats: Stats,
    /// Set on every packet of one hook accepted without a mark of its own
    /// ([`Queue::set_accept_mark`]): (mark, hook).
    accept_mark: Option<(u32, u8)>,
    /// The packets received on that hook still waiting for their verdicts.
    accept_marked: std::collections::HashSet<u32>,
}

impl core::fmt::Debug for Queue {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Queue")
            .field("fd", &self.fd.as_raw_fd())
            .field("queue_num", &self.queue_num)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl Queue {
    /// Opens a `NETLINK_NETFILTER` socket in the calling thread's network namespace, binds it
    /// to `cfg.queue_num` with full-packet copies and the requested flags, and waits for the
    /// kernel's acknowledgement.
    ///
    /// Fails with a [`NetlinkError`] inside the `io::Error` when the kernel refuses: `EPERM`
    /// when the process lacks `CAP_NET_ADMIN` or another socket already holds the queue (the
    /// message tells which), `EOPNOTSUPP` for a flag the kernel does not know.
    pub fn open(cfg: &QueueConfig) -> io::Result<Queue> {
        let fd = sys::socket(libc::AF_NETLINK, libc::SOCK_RAW, libc::NETLINK_NETFILTER)?;
        let raw = fd.as_raw_fd();

        // Bind with port id 0 (the kernel picks one), then connect to the kernel (port 0) so
        // no other process can unicast fake queue messages to us.
        // SAFETY: sockaddr_nl is plain data; zeroed is a valid value.
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        let alen = std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t;
        // SAFETY: `addr` is a live sockaddr_nl of length `alen`.
        sys::cvt(unsafe { libc::bind(raw, (&addr as *const libc::sockaddr_nl).cast(), alen) })?;
        // SAFETY: as above.
        sys::cvt(unsafe { libc::connect(raw, (&addr as *const libc::sockaddr_nl).cast(), alen) })?;

        sys::set_buffer(&fd, libc::SO_RCVBUFFORCE, libc::SO_RCVBUF, cfg.rcvbuf)?;
        sys::set_buffer(
            &fd,
            libc::SO_SNDBUFFORCE,
            libc::SO_SNDBUF,
            4 * SEND_FLUSH_BYTES,
        )?;
        // Acks echo only the request's header, not a 64 KiB verdict payload. Best effort:
        // both options exist since Linux 4.2/4.12.
        let _ = sys::setsockopt_int(raw, libc::SOL_NETLINK, libc::NETLINK_CAP_ACK, 1);
        let _ = sys::setsockopt_int(raw, libc::SOL_NETLINK, libc::NETLINK_EXT_ACK, 1);
        if cfg.no_enobufs {
            sys::setsockopt_int(raw, libc::SOL_NETLINK, libc::NETLINK_NO_ENOBUFS, 1)?;
        }

        let mut q = Queue {
            fd,
            queue_num: cfg.queue_num,
            seq: 0,
            bufs: Vec::new(),
            sendbuf: Vec::with_capacity(SEND_FLUSH_BYTES + RECV_BUF_SIZE),
            pending_verdicts: 0,
            pending_ids: Vec::with_capacity(1024),
            fail_sends: 0,
            early: VecDeque::new(),
            spare: Vec::new(),
            stats: Stats::default(),
            accept_mark: None,
            accept_marked: std::collections::HashSet::new(),
        };

        let seq = q.next_seq();
        let mut msg = Vec::with_capacity(128);
        build_config(&mut msg, seq, cfg);
        q.send_all(&msg)?;
        q.wait_ack(seq)
            .map_err(|e| explain_config_error(e, cfg.queue_num))?;
        Ok(q)
    }

    /// The queue number this consumer is bound to.
    pub fn queue_num(&self) -> u16 {
        self.queue_num
    }

    /// Counters since `open`.
    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// Receives up to `max` packets into `out`, replacing its contents (the `data` buffers of
    /// the packets already in `out` are recycled, so a caller that reuses one `Vec` does not
    /// allocate in steady state).
    ///
    /// Flushes buffered verdicts first, then waits until at least one packet is available or
    /// `timeout` passes (`None`: wait forever; `Some(Duration::ZERO)`: do not wait), then
    /// takes whatever else is ready without blocking. Returns the number of packets, 0 on
    /// timeout. Overflows (`ENOBUFS`), verdict errors and undecodable messages are counted in
    /// [`Stats`] and do not end the call.
    pub fn recv_batch(
        &mut self,
        out: &mut Vec<QueuedPacket>,
        max: usize,
        timeout: Option<Duration>,
    ) -> io::Result<usize> {
        self.flush()?;
        self.spare.extend(out.drain(..).map(|p| p.data));
        if max == 0 {
            return Ok(0);
        }
        while out.len() < max {
            match self.early.pop_front() {
                Some(p) => out.push(p),
                None => break,
            }
        }
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            self.drain(out, max)?;
            // A datagram holding several packet messages may overshoot `max`; keep the rest.
            while out.len() > max {
                if let Some(p) = out.pop() {
                    self.early.push_front(p);
                }
            }
            if !out.is_empty() {
                break;
            }
            // Verdicts for undecodable packets may have been queued by drain().
            self.flush()?;
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left == Some(Duration::ZERO) || !sys::wait_readable(self.fd.as_raw_fd(), left)? {
                break;
            }
        }
        self.stats.received += out.len() as u64;
        if let Some((_, hook)) = self.accept_mark {
            self.accept_marked.extend(out.iter().filter(|p| p.hook == hook).map(|p| p.id));
        }
        Ok(out.len())
    }

    /// Queues a verdict for packet `id`, optionally replacing the packet with `new_payload`
    /// (from the network header on, at most [`MAX_PAYLOAD`] bytes; transport checksums are the
    /// caller's job). Sent at the next [`Queue::flush`] or `recv_batch`, or at once when the
    /// send buffer is full.
    pub fn set_verdict(
        &mut self,
        id: u32,
        verdict: Verdict,
        new_payload: Option<&[u8]>,
    ) -> io::Result<()> {
        self.set_verdict_mark(id, verdict, None, new_payload)
    }

    /// From now on every packet received on `hook` (see [`QueuedPacket::hook`]) and accepted
    /// (by [`Queue::set_verdict`], or [`Queue::set_verdict_mark`] without a mark) leaves with
    /// `skb->mark` set to `mark` (the kernel replaces the whole mark): a later hook, e.g. a tc
    /// program, can tell what this queue's reader decided. Only one hook: a mark on the
    /// packets of the other direction could be inherited by sockets (`tcp_fwmark_accept`) or
    /// restored by connmark rules onto packets the reader's rules let pass by their mark.
    /// `None`: marks are left alone.
    pub fn set_accept_mark(&mut self, mark: Option<(u32, u8)>) {
        self.accept_mark = mark;
        self.accept_marked.clear();
    }

    /// Like [`Queue::set_verdict`], also setting `skb->mark` to `mark` when given.
    pub fn set_verdict_mark(
        &mut self,
        id: u32,
        verdict: Verdict,
        mark: Option<u32>,
        new_payload: Option<&[u8]>,
    ) -> io::Result<()> {
        if let Some(p) = new_payload {
            if p.len() > MAX_PAYLOAD {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "replacement payload of {} bytes exceeds {MAX_PAYLOAD}",
                        p.len()
                    ),
                ));
            }
        }
        let upcoming = 64 + new_payload.map_or(0, <[u8]>::len);
        if !self.sendbuf.is_empty() && self.sendbuf.len() + upcoming > SEND_FLUSH_BYTES {
            if let Err(e) = self.flush() {
                // The earlier verdicts are drops kept for the next flush; this one is kept
                // too, as a drop (the replacement payload is what could not be sent).
                self.push_verdict(id, Verdict::Drop, None, None);
                return Err(e);
            }
        }
        let ours = self.accept_mark.is_some() && self.accept_marked.remove(&id);
        let mark = match (verdict, self.accept_mark) {
            (Verdict::Accept, Some((m, _))) if ours => mark.or(Some(m)),
            _ => mark,
        };
        self.push_verdict(id, verdict, mark, new_payload);
        Ok(())
    }

    fn push_verdict(&mut self, id: u32, verdict: Verdict, mark: Option<u32>, new_payload: Option<&[u8]>) {
        let seq = self.next_seq();
        build_verdict(
            &mut self.sendbuf,
            seq,
            self.queue_num,
            id,
            verdict,
            mark,
            new_payload,
        );
        self.pending_verdicts += 1;
        self.pending_ids.push(id);
    }

    /// Gives a packet buffer back for the next packets (a caller that moved `data` out of its
    /// batch returns it here once done, so the packet path does not allocate per packet).
    /// At most [`MAX_SPARE`] are kept.
    pub fn recycle(&mut self, buf: Vec<u8>) {
        if self.spare.len() < MAX_SPARE && buf.capacity() > 0 {
            self.spare.push(buf);
        }
    }

    /// Makes the next `n` sends of verdicts fail with `ENOBUFS` (fault injection for tests of
    /// the error paths).
    #[doc(hidden)]
    pub fn fail_next_sends(&mut self, n: u32) {
        self.fail_sends = n;
    }

    /// Sends all buffered verdicts in one system call. When that fails, every buffered verdict
    /// is turned into a plain drop of its packet (replacements and marks are lost, the packet
    /// is not: TCP resends what is dropped), kept, and sent again at the next flush (also the
    /// one `recv_batch` does first); the error is returned and counted in
    /// [`Stats::flush_errors`]. A packet handed out by `recv_batch` and given a verdict thus
    /// never stays queued in the kernel.
    pub fn flush(&mut self) -> io::Result<()> {
        if self.sendbuf.is_empty() {
            return Ok(());
        }
        let res = if self.fail_sends > 0 {
            self.fail_sends -= 1;
            Err(io::Error::from_raw_os_error(libc::ENOBUFS))
        } else {
            send_all_fd(self.fd.as_raw_fd(), &self.sendbuf)
        };
        self.sendbuf.clear();
        let n = std::mem::take(&mut self.pending_verdicts);
        let ids = std::mem::take(&mut self.pending_ids);
        match res {
            Ok(()) => {
                self.stats.verdicts += n;
                self.pending_ids = ids;
                self.pending_ids.clear();
                Ok(())
            }
            Err(e) => {
                self.stats.flush_errors += 1;
                for &id in &ids {
                    self.push_verdict(id, Verdict::Drop, None, None);
                }
                Err(e)
            }
        }
    }

    /// Flushes pending verdicts, unbinds the queue and closes the socket, reporting errors
    /// that `Drop` would swallow. Packets still waiting for a verdict are dropped by the kernel.
    pub fn close(mut self) -> io::Result<()> {
        let flushed = self.flush();
        let unbound = self.unbind();
        // Drop runs next but has nothing left to flush; its second unbind is harmless.
        flushed.and(unbound)
    }

    fn unbind(&mut self) -> io::Result<()> {
        let seq = self.next_seq();
        let mut msg = Vec::with_capacity(32);
        build_unbind(&mut msg, seq, self.queue_num);
        self.send_all(&msg)
    }

    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    fn send_all(&self, buf: &[u8]) -> io::Result<()> {
        send_all_fd(self.fd.as_raw_fd(), buf)
    }

    /// Waits for the acknowledgement of request `seq`, keeping packets that arrive meanwhile.
    fn wait_ack(&mut self, seq: u32) -> Result<(), NetlinkError> {
        let deadline = Instant::now() + ACK_TIMEOUT;
        let fail = |errno: i32, detail: Option<String>| NetlinkError {
            operation: String::new(),
            errno,
            detail,
        };
        let mut buf = vec![0u8; RECV_BUF_SIZE];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match sys::wait_readable(self.fd.as_raw_fd(), Some(left)) {
                Ok(true) => {}
                Ok(false) => {
                    return Err(fail(
                        libc::ETIMEDOUT,
                        Some("no acknowledgement from the kernel".into()),
                    ))
                }
                Err(e) => return Err(fail(e.raw_os_error().unwrap_or(libc::EIO), None)),
            }
            // SAFETY: `buf` is live and writable for its length.
            let n = unsafe {
                libc::recv(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EAGAIN) | Some(libc::EINTR) => continue,
                    Some(libc::ENOBUFS) => {
                        self.stats.enobufs += 1;
                        continue;
                    }
                    other => return Err(fail(other.unwrap_or(libc::EIO), None)),
                }
            }
            let mut result = None;
            let data = &buf[..n as usize];
            for m in netlink::messages(data) {
                let m = match m {
                    Ok(m) => m,
                    Err(_) => {
                        self.stats.parse_errors += 1;
                        break;
                    }
                };
                if m.ty == netlink::NLMSG_ERROR {
                    match netlink::parse_error(&m) {
                        Ok(e) if e.request_seq == seq => result = Some(e),
                        Ok(e) => self.note_error(&e),
                        Err(_) => self.stats.parse_errors += 1,
                    }
                } else {
                    self.handle_data_msg(&m, None);
                }
            }
            if let Some(e) = result {
                return if e.errno == 0 {
                    Ok(())
                } else {
                    Err(fail(e.errno, e.text))
                };
            }
        }
    }

    /// Drains ready datagrams into `out` (until `max` packets or nothing is ready).
    fn drain(&mut self, out: &mut Vec<QueuedPacket>, max: usize) -> io::Result<()> {
        while out.len() < max {
            let want = (max - out.len()).clamp(1, MAX_BATCH);
            while self.bufs.len() < want {
                self.bufs.push(vec![0u8; RECV_BUF_SIZE]);
            }
            let n = match recvmmsg_dontwait(self.fd.as_raw_fd(), &mut self.bufs[..want]) {
                Ok(r) => r,
                Err(e) => match e.raw_os_error() {
                    Some(libc::EAGAIN) => return Ok(()),
                    Some(libc::EINTR) => continue,
                    Some(libc::ENOBUFS) => {
                        self.stats.enobufs += 1;
                        continue;
                    }
                    _ => return Err(e),
                },
            };
            // Take the buffers out so the parse can borrow `self` mutably.
            let bufs = std::mem::take(&mut self.bufs);
            for (i, &(len, truncated)) in n.iter().enumerate() {
                let data = &bufs[i][..len.min(RECV_BUF_SIZE)];
                if truncated {
                    self.stats.parse_errors += 1;
                }
                self.handle_datagram(data, Some(out));
            }
            let got = n.len();
            self.bufs = bufs;
            if got < want {
                return Ok(());
            }
        }
        Ok(())
    }

    fn handle_datagram(&mut self, data: &[u8], mut out: Option<&mut Vec<QueuedPacket>>) {
        for m in netlink::messages(data) {
            match m {
                Ok(m) if m.ty == netlink::NLMSG_ERROR => match netlink::parse_error(&m) {
                    Ok(e) => self.note_error(&e),
                    Err(_) => self.stats.parse_errors += 1,
                },
                Ok(m) => self.handle_data_msg(&m, out.as_deref_mut()),
                Err(_) => {
                    self.stats.parse_errors += 1;
                    return;
                }
            }
        }
    }

    /// Handles a non-error message: packets go to `out`, or to `early` when `out` is `None`.
    fn handle_data_msg(&mut self, m: &Msg<'_>, out: Option<&mut Vec<QueuedPacket>>) {
        if m.ty != msg_type(NFQNL_MSG_PACKET) {
            // NLMSG_NOOP/DONE/OVERRUN or something we did not ask for.
            return;
        }
        let mut data = self.spare.pop().unwrap_or_default();
        data.clear();
        let mut pkt = QueuedPacket {
            data,
            ..QueuedPacket::default()
        };
        match parse_packet(m.payload, &mut pkt) {
            Ok(has_payload) => {
                if out.is_none() && !has_payload {
                    // Queued during open() before the copy mode applied, so without its bytes:
                    // nothing to show the caller. Dropped rather than passed unexamined (see
                    // `Stats::parse_errors`).
                    let _ = self.set_verdict(pkt.id, Verdict::Drop, None);
                    self.spare.push(pkt.data);
                    return;
                }
                match out {
                    Some(out) => out.push(pkt),
                    None => self.early.push_back(pkt),
                }
            }
            Err(e) => {
                self.stats.parse_errors += 1;
                if let Some(id) = e.id {
                    let _ = self.set_verdict(id, Verdict::Drop, None);
                }
                self.spare.push(pkt.data);
            }
        }
    }

    fn note_error(&mut self, e: &netlink::ErrorMsg) {
        if e.errno != 0 {
            self.stats.verdict_errors += 1;
            self.stats.last_verdict_errno = e.errno;
        }
    }
}

impl AsRawFd for Queue {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl AsFd for Queue {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl Drop for Queue {
    fn drop(&mut self) {
        let _ = self.flush();
        let _ = self.unbind();
        // The socket closes with `fd`; the kernel destroys the instance on NETLINK_URELEASE too.
    }
}

// ---- system calls ----------------------------------------------------------------------------

fn send_all_fd(fd: RawFd, buf: &[u8]) -> io::Result<()> {
    loop {
        // SAFETY: `buf` is live for its length. A netlink datagram is sent whole or not at all.
        let n = unsafe { libc::send(fd, buf.as_ptr().cast(), buf.len(), 0) };
        if n >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// `recvmmsg(MSG_DONTWAIT)` into `bufs`, one datagram each; returns `(length, was_cut)` per
/// datagram received.
fn recvmmsg_dontwait(fd: RawFd, bufs: &mut [Vec<u8>]) -> io::Result<Vec<(usize, bool)>> {
    let mut iovs: Vec<libc::iovec> = bufs
        .iter_mut()
        .map(|b| libc::iovec {
            iov_base: b.as_mut_ptr().cast(),
            iov_len: b.len(),
        })
        .collect();
    let mut hdrs: Vec<libc::mmsghdr> = iovs
        .iter_mut()
        .map(|iov| {
            // SAFETY: msghdr/mmsghdr are plain data; zeroed is valid (no name, no control).
            let mut h: libc::mmsghdr = unsafe { std::mem::zeroed() };
            h.msg_hdr.msg_iov = iov;
            h.msg_hdr.msg_iovlen = 1;
            h
        })
        .collect();
    // SAFETY: every header points at one live iovec that points at a live buffer.
    let n = unsafe {
        libc::recvmmsg(
            fd,
            hdrs.as_mut_ptr(),
            hdrs.len() as libc::c_uint,
            libc::MSG_DONTWAIT,
            std::ptr::null_mut(),
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(hdrs[..n as usize]
        .iter()
        .map(|h| {
            (
                h.msg_len as usize,
                h.msg_hdr.msg_flags & libc::MSG_TRUNC != 0,
            )
        })
        .collect())
}

// ---- message building and parsing ------------------------------------------------------------

/// Appends the one configuration message `open` sends: bind, copy mode, queue length, flags.
/// All in one message so the queue never runs with the default (metadata-only) copy mode.
fn build_config(buf: &mut Vec<u8>, seq: u32, cfg: &QueueConfig) {
    let mut w = MsgWriter::begin(
        buf,
        msg_type(NFQNL_MSG_CONFIG),
        NLM_F_REQUEST | NLM_F_ACK,
        seq,
    );
    nfgen(&mut w, cfg.queue_num);
    // struct nfqnl_msg_config_cmd { u8 command; u8 _pad; be16 pf; }
    w.attr(NFQA_CFG_CMD, &[NFQNL_CFG_CMD_BIND, 0, 0, 0]);
    // struct nfqnl_msg_config_params { be32 copy_range; u8 copy_mode; } __packed
    let range = (MAX_PAYLOAD as u32).to_be_bytes();
    w.attr(
        NFQA_CFG_PARAMS,
        &[range[0], range[1], range[2], range[3], NFQNL_COPY_PACKET],
    );
    w.attr_be32(NFQA_CFG_QUEUE_MAXLEN, cfg.max_len);
    let mut flags = 0;
    if cfg.gso {
        flags |= NFQA_CFG_F_GSO;
    }
    if cfg.fail_open {
        flags |= NFQA_CFG_F_FAIL_OPEN;
    }
    // The mask says which flags this message sets; both are set explicitly either way.
    w.attr_be32(NFQA_CFG_FLAGS, flags);
    w.attr_be32(NFQA_CFG_MASK, NFQA_CFG_F_GSO | NFQA_CFG_F_FAIL_OPEN);
    w.finish();
}

fn build_unbind(buf: &mut Vec<u8>, seq: u32, queue_num: u16) {
    let mut w = MsgWriter::begin(buf, msg_type(NFQNL_MSG_CONFIG), NLM_F_REQUEST, seq);
    nfgen(&mut w, queue_num);
    w.attr(NFQA_CFG_CMD, &[NFQNL_CFG_CMD_UNBIND, 0, 0, 0]);
    w.finish();
}

/// Appends one `NFQNL_MSG_VERDICT`. `payload` must be at most [`MAX_PAYLOAD`] bytes.
fn build_verdict(
    buf: &mut Vec<u8>,
    seq: u32,
    queue_num: u16,
    id: u32,
    verdict: Verdict,
    mark: Option<u32>,
    payload: Option<&[u8]>,
) {
    let mut w = MsgWriter::begin(buf, msg_type(NFQNL_MSG_VERDICT), NLM_F_REQUEST, seq);
    nfgen(&mut w, queue_num);
    // struct nfqnl_msg_verdict_hdr { be32 verdict; be32 id; }
    let mut hdr = [0u8; 8];
    hdr[..4].copy_from_slice(&verdict.code().to_be_bytes());
    hdr[4..].copy_from_slice(&id.to_be_bytes());
    w.attr(NFQA_VERDICT_HDR, &hdr);
    if let Some(mark) = mark {
        w.attr_be32(NFQA_MARK, mark);
    }
    if let Some(p) = payload {
        w.attr(NFQA_PAYLOAD, p);
    }
    w.finish();
}

/// `struct nfgenmsg { u8 family; u8 version; be16 res_id; }`; the family is AF_UNSPEC.
fn nfgen(w: &mut MsgWriter<'_>, queue_num: u16) {
    let q = queue_num.to_be_bytes();
    w.raw(&[libc::AF_UNSPEC as u8, NFNETLINK_V0, q[0], q[1]]);
}

/// A packet message that could not be decoded, with its id when that much was readable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PacketError {
    id: Option<u32>,
    #[allow(dead_code)] // kept for debugging output
    cause: ParseError,
}

fn be32(v: &[u8]) -> Option<u32> {
    Some(u32::from_be_bytes(v.get(..4)?.try_into().ok()?))
}

/// Decodes the payload (after `nlmsghdr`) of an `NFQNL_MSG_PACKET` into `pkt`, copying the
/// packet bytes into `pkt.data` (which the caller cleared). Returns whether a payload was
/// present.
fn parse_packet(payload: &[u8], pkt: &mut QueuedPacket) -> Result<bool, PacketError> {
    let attrs = payload.get(4..).ok_or(PacketError {
        id: None,
        cause: ParseError::Truncated,
    })?;
    let mut id = None;
    let mut has_payload = false;
    let mut cap_len = None;
    let mut first_err = None;
    for a in netlink::attributes(attrs) {
        let (ty, v) = match a {
            Ok(a) => a,
            Err(e) => {
                first_err.get_or_insert(e);
                break;
            }
        };
        match ty {
            NFQA_PACKET_HDR => {
                // struct nfqnl_msg_packet_hdr { be32 packet_id; be16 hw_protocol; u8 hook; } __packed
                if v.len() < 7 {
                    first_err.get_or_insert(ParseError::Missing("NFQA_PACKET_HDR"));
                    continue;
                }
                pkt.id = u32::from_be_bytes([v[0], v[1], v[2], v[3]]);
                pkt.hw_protocol = u16::from_be_bytes([v[4], v[5]]);
                pkt.hook = v[6];
                id = Some(pkt.id);
            }
            NFQA_MARK => match be32(v) {
                Some(m) => pkt.mark = m,
                None => {
                    first_err.get_or_insert(ParseError::Missing("NFQA_MARK"));
                }
            },
            NFQA_IFINDEX_INDEV => pkt.indev = be32(v).unwrap_or(0),
            NFQA_HWADDR => {
                // struct nfqnl_msg_packet_hw { be16 hw_addrlen; u16 pad; u8 hw_addr[8]; }
                if v.len() >= 10 && u16::from_be_bytes([v[0], v[1]]) == 6 {
                    let mut mac = [0u8; 6];
                    mac.copy_from_slice(&v[4..10]);
                    pkt.hw_src = Some(mac);
                }
            }
            NFQA_IFINDEX_OUTDEV => pkt.outdev = be32(v).unwrap_or(0),
            NFQA_CAP_LEN => cap_len = be32(v),
            NFQA_SKB_INFO => {
                let info = be32(v).unwrap_or(0);
                pkt.csum_not_ready = info & NFQA_SKB_CSUMNOTREADY != 0;
                pkt.gso = info & NFQA_SKB_GSO != 0;
                pkt.csum_not_verified = info & NFQA_SKB_CSUM_NOTVERIFIED != 0;
            }
            NFQA_PAYLOAD => {
                pkt.data.extend_from_slice(v);
                has_payload = true;
            }
            _ => {}
        }
    }
    pkt.orig_len = cap_len.unwrap_or(pkt.data.len() as u32);
    match (id, first_err) {
        (None, e) => Err(PacketError {
            id: None,
            cause: e.unwrap_or(ParseError::Missing("NFQA_PACKET_HDR")),
        }),
        (Some(id), Some(e)) => Err(PacketError {
            id: Some(id),
            cause: e,
        }),
        (Some(_), None) => Ok(has_payload),
    }
}

/// Adds the operation and, for `EPERM`/`EBUSY`, the likely cause.
fn explain_config_error(mut e: NetlinkError, queue_num: u16) -> io::Error {
    e.operation = format!("binding NFQUEUE {queue_num}");
    if e.detail.is_none() {
        e.detail = match e.errno {
            libc::EPERM => Some(match sys::has_capability(sys::CAP_NET_ADMIN) {
                Some(false) => "CAP_NET_ADMIN is required".to_string(),
                _ => format!("queue {queue_num} is already bound by another netlink socket in this network namespace"),
            }),
            libc::EBUSY => Some(format!("queue {queue_num} is already bound by this socket")),
            libc::EOPNOTSUPP => Some("the kernel does not support a requested queue flag".into()),
            _ => None,
        };
    }
    e.into_io()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hdr(buf: &[u8]) -> (u32, u16, u16, u32) {
        let m = netlink::messages(buf).next().unwrap().unwrap();
        (buf.len() as u32, m.ty, m.flags, m.seq)
    }

    #[test]
    fn config_message_bytes() {
        let mut buf = vec![];
        let cfg = QueueConfig {
            queue_num: 0x0102,
            max_len: 4096,
            gso: true,
            fail_open: false,
            ..Default::default()
        };
        build_config(&mut buf, 5, &cfg);
        let len = 16 + 4 + 8 + 12 + 8 + 8 + 8;
        assert_eq!(hdr(&buf), (len, 0x0302, 0x5, 5));
        let mut expect = Vec::new();
        expect.extend_from_slice(&(len).to_ne_bytes());
        expect.extend_from_slice(&0x0302u16.to_ne_bytes());
        expect.extend_from_slice(&5u16.to_ne_bytes());
        expect.extend_from_slice(&5u32.to_ne_bytes());
        expect.extend_from_slice(&0u32.to_ne_bytes());
        expect.extend_from_slice(&[0, 0, 0x01, 0x02]); // nfgenmsg: AF_UNSPEC, v0, queue (BE)
        expect.extend_from_slice(&8u16.to_ne_bytes());
        expect.extend_from_slice(&1u16.to_ne_bytes());
        expect.extend_from_slice(&[1, 0, 0, 0]); // bind
        expect.extend_from_slice(&9u16.to_ne_bytes());
        expect.extend_from_slice(&2u16.to_ne_bytes());
        expect.extend_from_slice(&[0, 0, 0xff, 0xfb, 2, 0, 0, 0]); // range 65531, COPY_PACKET
        expect.extend_from_slice(&8u16.to_ne_bytes());
        expect.extend_from_slice(&3u16.to_ne_bytes());
        expect.extend_from_slice(&[0, 0, 0x10, 0]); // maxlen 4096
        expect.extend_from_slice(&8u16.to_ne_bytes());
        expect.extend_from_slice(&5u16.to_ne_bytes());
        expect.extend_from_slice(&[0, 0, 0, 4]); // flags GSO
        expect.extend_from_slice(&8u16.to_ne_bytes());
        expect.extend_from_slice(&4u16.to_ne_bytes());
        expect.extend_from_slice(&[0, 0, 0, 5]); // mask GSO|FAIL_OPEN
        assert_eq!(buf, expect);
    }

    #[test]
    fn verdict_messages_concatenate() {
        let mut buf = vec![];
        build_verdict(&mut buf, 1, 3, 0x11223344, Verdict::Accept, None, None);
        build_verdict(
            &mut buf,
            2,
            3,
            7,
            Verdict::Drop,
            Some(0xabcd),
            Some(&[0x45, 0, 0]),
        );
        let msgs: Vec<_> = netlink::messages(&buf).map(Result::unwrap).collect();
        assert_eq!(msgs.len(), 2);
        assert_eq!(msgs[0].ty, 0x0301);
        assert_eq!(msgs[0].flags, NLM_F_REQUEST);
        assert_eq!(&msgs[0].payload[..4], &[0, 0, 0, 3]);
        let a0: Vec<_> = netlink::attributes(&msgs[0].payload[4..])
            .map(Result::unwrap)
            .collect();
        assert_eq!(
            a0,
            vec![(NFQA_VERDICT_HDR, &[0, 0, 0, 1, 0x11, 0x22, 0x33, 0x44][..])]
        );
        let a1: Vec<_> = netlink::attributes(&msgs[1].payload[4..])
            .map(Result::unwrap)
            .collect();
        assert_eq!(
            a1,
            vec![
                (NFQA_VERDICT_HDR, &[0, 0, 0, 0, 0, 0, 0, 7][..]),
                (NFQA_MARK, &[0, 0, 0xab, 0xcd][..]),
                (NFQA_PAYLOAD, &[0x45, 0, 0][..]),
            ]
        );
        assert_eq!(msgs[1].seq, 2);
        assert_eq!(buf.len() % 4, 0);
    }

    #[test]
    fn unbind_message() {
        let mut buf = vec![];
        build_unbind(&mut buf, 9, 4);
        let m = netlink::messages(&buf).next().unwrap().unwrap();
        assert_eq!((m.ty, m.flags), (0x0302, NLM_F_REQUEST));
        let a: Vec<_> = netlink::attributes(&m.payload[4..])
            .map(Result::unwrap)
            .collect();
        assert_eq!(a, vec![(NFQA_CFG_CMD, &[2, 0, 0, 0][..])]);
    }

    /// A packet message as the kernel builds it (attribute order of `nfqnl_build_packet_message`).
    fn kernel_packet(id: u32, payload: &[u8], cap_len: Option<u32>) -> Vec<u8> {
        let mut buf = vec![];
        let mut w = MsgWriter::begin(&mut buf, 0x0300, 0, 0);
        w.raw(&[libc::AF_INET as u8, 0, 0, 3]);
        let mut h = id.to_be_bytes().to_vec();
        h.extend_from_slice(&0x0800u16.to_be_bytes());
        h.push(1);
        w.attr(NFQA_PACKET_HDR, &h);
        w.attr_be32(NFQA_IFINDEX_INDEV, 2);
        w.attr_be32(NFQA_MARK, 0x42);
        w.attr(4, &[0; 16]); // NFQA_TIMESTAMP, ignored
        w.attr(NFQA_HWADDR, &[0, 6, 0, 0, 1, 2, 3, 4, 5, 6, 0, 0]);
        if let Some(c) = cap_len {
            w.attr_be32(NFQA_CAP_LEN, c);
        }
        w.attr_be32(NFQA_SKB_INFO, NFQA_SKB_CSUMNOTREADY | NFQA_SKB_GSO);
        w.attr(NFQA_PAYLOAD, payload);
        w.finish();
        buf
    }

    #[test]
    fn parses_kernel_packet() {
        let buf = kernel_packet(77, &[0x45, 1, 2, 3, 4], None);
        let m = netlink::messages(&buf).next().unwrap().unwrap();
        let mut p = QueuedPacket::default();
        assert_eq!(parse_packet(m.payload, &mut p), Ok(true));
        assert_eq!(
            p,
            QueuedPacket {
                id: 77,
                hook: 1,
                hw_protocol: 0x0800,
                mark: 0x42,
                csum_not_ready: true,
                gso: true,
                csum_not_verified: false,
                indev: 2,
                hw_src: Some([1, 2, 3, 4, 5, 6]),
                outdev: 0,
                orig_len: 5,
                data: vec![0x45, 1, 2, 3, 4],
            }
        );
        assert!(!p.truncated());

        let buf = kernel_packet(78, &[0x45; 8], Some(70000));
        let m = netlink::messages(&buf).next().unwrap().unwrap();
        let mut p = QueuedPacket::default();
        assert_eq!(parse_packet(m.payload, &mut p), Ok(true));
        assert_eq!(p.orig_len, 70000);
        assert!(p.truncated());
    }

    #[test]
    fn damaged_packets_report_their_id_when_readable() {
        let buf = kernel_packet(99, &[0x60; 40], None);
        let m = netlink::messages(&buf).next().unwrap().unwrap();
        // Cut inside the payload attribute: the id is known, the packet is not.
        let cut = &m.payload[..m.payload.len() - 10];
        let mut p = QueuedPacket::default();
        let e = parse_packet(cut, &mut p).unwrap_err();
        assert_eq!(e.id, Some(99));
        // Cut inside the first attribute: nothing is known.
        let mut p = QueuedPacket::default();
        assert_eq!(parse_packet(&m.payload[..8], &mut p).unwrap_err().id, None);
        // Every prefix parses without panicking.
        for cut in 0..m.payload.len() {
            let mut p = QueuedPacket::default();
            let _ = parse_packet(&m.payload[..cut], &mut p);
        }
    }

    #[test]
    fn queue_moves_between_threads() {
        fn check<T: Send>() {}
        check::<Queue>();
    }

    #[test]
    fn error_text_names_the_cause() {
        let e = NetlinkError {
            operation: "binding NFQUEUE 3".into(),
            errno: libc::EPERM,
            detail: Some("x".into()),
        };
        let io = e.clone().into_io();
        assert_eq!(io.kind(), io::ErrorKind::PermissionDenied);
        assert!(io
            .to_string()
            .starts_with("binding NFQUEUE 3: Operation not permitted"));
        let back = io
            .get_ref()
            .and_then(|e| e.downcast_ref::<NetlinkError>())
            .unwrap();
        assert_eq!(back, &e);
    }
}
