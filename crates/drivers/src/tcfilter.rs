//! Lists the tc filters of a device's clsact hook over rtnetlink (`RTM_GETTFILTER` dump), which
//! aya does not: a daemon whose program at tc egress is the only thing between its server and
//! the wire checks that it is still there (replica mode's `rep_b_out`, review finding 5: a
//! `tc qdisc del dev X clsact` or a recreated device removes it silently).
//!
//! Layout (`include/uapi/linux/rtnetlink.h`, `pkt_sched.h`, `pkt_cls.h`): the request and each
//! answer carry a 20-byte `struct tcmsg` (`u8 family, u8, u16, i32 ifindex, u32 handle, u32
//! parent, u32 info`; `info` = priority << 16 | protocol) before the attributes `TCA_KIND`
//! (a NUL-terminated name, "bpf" for cls_bpf) and `TCA_OPTIONS` (nested; for cls_bpf
//! `TCA_BPF_ID`, the program's id).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::netlink::{self, MsgWriter, NLMSG_ERROR, NLM_F_REQUEST};

const RTM_NEWTFILTER: u16 = 44;
const RTM_GETTFILTER: u16 = 46;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_DONE: u16 = 3;
/// `nlmsg_flags` of a dump message: the dump was interrupted by a change (inconsistent).
const NLM_F_DUMP_INTR: u16 = 0x10;
const TCA_KIND: u16 = 1;
const TCA_OPTIONS: u16 = 2;
const TCA_BPF_ID: u16 = 11;
const TCMSG_LEN: usize = 20;
/// `TC_H_MAKE(TC_H_CLSACT, TC_H_MIN_EGRESS)` and `..._INGRESS`.
pub const PARENT_EGRESS: u32 = 0xFFFF_FFF3;
pub const PARENT_INGRESS: u32 = 0xFFFF_FFF2;

/// One filter as the kernel lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filter {
    pub priority: u16,
    pub handle: u32,
    /// The classifier's name ("bpf" for cls_bpf).
    pub kind: String,
    /// For cls_bpf: the attached program's id.
    pub prog_id: Option<u32>,
}

/// The device's index; `Ok(None)` when there is no such device (in this network namespace),
/// an error when the kernel could not be asked (no descriptors left: not "no device").
pub fn ifindex(iface: &str) -> io::Result<Option<u32>> {
    let Ok(name) = std::ffi::CString::new(iface) else { return Ok(None) };
    // SAFETY: a NUL-terminated name.
    let i = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if i != 0 {
        return Ok(Some(i));
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::ENODEV) | Some(libc::ENXIO) => Ok(None),
        _ => Err(e),
    }
}

/// The filters at `parent` ([`PARENT_EGRESS`], [`PARENT_INGRESS`]) of device `ifindex`. A
/// device without a clsact qdisc has none (the kernel answers `EINVAL` or `ENOENT`: an empty
/// list); other errors are errors.
pub fn list(ifindex: u32, parent: u32) -> io::Result<Vec<Filter>> {
    // SAFETY: plain socket creation; the descriptor is owned below.
    let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::NETLINK_ROUTE) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let tv = libc::timeval { tv_sec: 2, tv_usec: 0 };
    // SAFETY: a timeval option on our socket; a failure only loses the bound on the wait.
    unsafe { libc::setsockopt(fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVTIMEO, &tv as *const libc::timeval as *const libc::c_void, std::mem::size_of::<libc::timeval>() as libc::socklen_t) };
    let mut req = Vec::with_capacity(64);
    let mut tcm = [0u8; TCMSG_LEN];
    tcm[0] = libc::AF_UNSPEC as u8;
    tcm[4..8].copy_from_slice(&(ifindex as i32).to_ne_bytes());
    tcm[12..16].copy_from_slice(&parent.to_ne_bytes());
    let mut w = MsgWriter::begin(&mut req, RTM_GETTFILTER, NLM_F_REQUEST | NLM_F_DUMP, 1);
    w.raw(&tcm);
    w.finish();
    // SAFETY: sending our buffer on our socket (the kernel's address is the default).
    let n = unsafe { libc::send(fd.as_raw_fd(), req.as_ptr() as *const libc::c_void, req.len(), 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        // SAFETY: receiving into our buffer.
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr() as *mut libc::c_void, buf.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "rtnetlink closed the dump"));
        }
        match parse_dump(&buf[..n as usize], &mut out)? {
            true => return Ok(out),
            false => continue,
        }
    }
}

/// Adds the filters of one received datagram to `out`; true once the dump ended.
fn parse_dump(buf: &[u8], out: &mut Vec<Filter>) -> io::Result<bool> {
    let bad = |e: netlink::ParseError| io::Error::new(io::ErrorKind::InvalidData, e.to_string());
    for m in netlink::messages(buf) {
        let m = m.map_err(bad)?;
        if m.flags & NLM_F_DUMP_INTR != 0 {
            // The filters changed while the kernel listed them: no answer this time.
            return Err(io::Error::new(io::ErrorKind::Interrupted, "the tc filter dump was interrupted by a change"));
        }
        match m.ty {
            NLMSG_DONE => {
                // Its payload is the dump's error code (0: complete).
                let code = m.payload.get(..4).map_or(0, |b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
                return match code {
                    0 => Ok(true),
                    c => Err(io::Error::from_raw_os_error(c.saturating_neg())),
                };
            }
            NLMSG_ERROR => {
                let e = netlink::parse_error(&m).map_err(bad)?;
                return match e.errno {
                    0 => Ok(true),
                    // No clsact qdisc (or no such parent): no filters.
                    libc::EINVAL | libc::ENOENT => Ok(true),
                    n => Err(io::Error::from_raw_os_error(n)),
                };
            }
            RTM_NEWTFILTER if m.payload.len() >= TCMSG_LEN => {
                let p = m.payload;
                let info = u32::from_ne_bytes([p[16], p[17], p[18], p[19]]);
                let handle = u32::from_ne_bytes([p[8], p[9], p[10], p[11]]);
                let mut f = Filter { priority: (info >> 16) as u16, handle, kind: String::new(), prog_id: None };
                for a in netlink::attributes(&p[TCMSG_LEN..]) {
                    let (ty, v) = a.map_err(bad)?;
                    match ty {
                        TCA_KIND => f.kind = String::from_utf8_lossy(v.split(|&c| c == 0).next().unwrap_or(&[])).into_owned(),
                        TCA_OPTIONS => {
                            for o in netlink::attributes(v) {
                                let (oty, ov) = o.map_err(bad)?;
                                if oty == TCA_BPF_ID && ov.len() >= 4 {
                                    f.prog_id = Some(u32::from_ne_bytes([ov[0], ov[1], ov[2], ov[3]]));
                                }
                            }
                        }
                        _ => {}
                    }
                }
                // A filter with no handle is the priority's placeholder (its chain head).
                if f.handle != 0 || f.prog_id.is_some() {
                    out.push(f);
                }
            }
            _ => {}
        }
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(ty: u16, payload: &[u8]) -> Vec<u8> {
        let mut b = Vec::new();
        let mut w = MsgWriter::begin(&mut b, ty, 0, 1);
        w.raw(payload);
        w.finish();
        b
    }

    fn filter_msg(prio: u16, handle: u32, kind: &str, id: Option<u32>) -> Vec<u8> {
        let mut p = vec![0u8; TCMSG_LEN];
        p[8..12].copy_from_slice(&handle.to_ne_bytes());
        p[16..20].copy_from_slice(&(((prio as u32) << 16) | 0x0003).to_ne_bytes());
        let mut attrs = Vec::new();
        let mut k = kind.as_bytes().to_vec();
        k.push(0);
        push_attr(&mut attrs, TCA_KIND, &k);
        if let Some(id) = id {
            let mut nested = Vec::new();
            push_attr(&mut nested, TCA_BPF_ID, &id.to_ne_bytes());
            push_attr(&mut attrs, TCA_OPTIONS, &nested);
        }
        p.extend(attrs);
        msg(RTM_NEWTFILTER, &p)
    }

    fn push_attr(b: &mut Vec<u8>, ty: u16, v: &[u8]) {
        b.extend(((4 + v.len()) as u16).to_ne_bytes());
        b.extend(ty.to_ne_bytes());
        b.extend(v);
        b.resize(netlink::align4(b.len()), 0);
    }

    #[test]
    fn a_dump_names_each_filter_with_its_program() {
        let mut buf = filter_msg(0x7562, 0x7562, "bpf", Some(42));
        buf.extend(filter_msg(1, 0, "bpf", None));
        buf.extend(filter_msg(3, 1, "u32", None));
        let mut out = Vec::new();
        assert!(!parse_dump(&buf, &mut out).unwrap(), "no DONE yet");
        assert_eq!(out, vec![Filter { priority: 0x7562, handle: 0x7562, kind: "bpf".into(), prog_id: Some(42) }, Filter { priority: 3, handle: 1, kind: "u32".into(), prog_id: None }]);
        assert!(parse_dump(&msg(NLMSG_DONE, &[0; 4]), &mut out).unwrap());
    }

    #[test]
    fn hostile_a_dump_that_ended_in_an_error_or_was_interrupted_is_no_answer() {
        let mut out = Vec::new();
        let err = parse_dump(&msg(NLMSG_DONE, &(-libc::EBUSY).to_ne_bytes()), &mut out).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EBUSY));
        let mut intr = filter_msg(1, 1, "bpf", Some(7));
        intr[6..8].copy_from_slice(&NLM_F_DUMP_INTR.to_ne_bytes());
        assert_eq!(parse_dump(&intr, &mut out).unwrap_err().kind(), io::ErrorKind::Interrupted);
    }

    #[test]
    fn hostile_truncated_or_garbled_answers_are_errors_not_panics() {
        let good = filter_msg(1, 1, "bpf", Some(7));
        for cut in 0..good.len() {
            let mut out = Vec::new();
            let _ = parse_dump(&good[..cut], &mut out);
        }
        let mut garbled = good.clone();
        garbled[TCMSG_LEN + 16] = 2; // an attribute length below its header
        let mut out = Vec::new();
        assert!(parse_dump(&garbled, &mut out).is_err());
    }
}
