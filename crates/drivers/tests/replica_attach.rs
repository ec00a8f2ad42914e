//! The replica backup's attached fast path on a real device (review findings 4 and 5 of the
//! attach, docs/architecture.md): the OUTPUT queue rule's pinned match (`rep_q_out`) takes
//! packets only once the daemon says so with one map write, and the daemon can tell that its
//! egress filter is gone. Root, in throw-away network namespaces; SKIP otherwise
//! (UNBROKEN_REQUIRE_LAB=1 makes a skip a failure).

mod common;

use std::net::{SocketAddr, UdpSocket};

use common::*;
use unbroken_drivers::fastpath::replica::{unpin_queue_matches, EgressSeen, Replica};

/// The programs, or `None` after a SKIP (a kernel without what they need).
fn load_or_skip(test: &str) -> Option<Replica> {
    loaded_or_skip(test, Replica::load())
}

/// One datagram from namespace `a` to `b` (not the service's: `rep_b_out` passes it).
fn send_one(sock: &UdpSocket) {
    sock.send_to(b"x", SocketAddr::from((B4, 9999))).expect("send");
}

#[test]
fn the_output_gate_follows_one_map_write_and_a_removed_egress_filter_is_seen() {
    let test = "the_output_gate_follows_one_map_write_and_a_removed_egress_filter_is_seen";
    let Some(pair) = NetnsPair::setup(test) else { return };
    let dir = std::path::PathBuf::from(format!("/sys/fs/bpf/unbroken/test-replica-attach-{}", std::process::id()));
    // Unpinned also when the test fails (a pin keeps its programs and maps in kernel memory).
    struct Unpin(std::path::PathBuf);
    impl Drop for Unpin {
        fn drop(&mut self) {
            let _ = unpin_queue_matches(&self.0);
        }
    }
    let _unpin = Unpin(dir.clone());
    if let Err(e) = unbroken_drivers::fastpath::object::ensure_bpffs() {
        skip_or_fail(test, &e.to_string());
        return;
    }
    // iptables from this thread, which is in the namespace (`ip netns exec` remounts /sys and
    // hides the pins: linux-facts.md).
    let iptables = |args: &[&str]| -> String {
        let out = std::process::Command::new("iptables").args(["-w", "-t", "mangle"]).args(args).output().expect("iptables");
        assert!(out.status.success(), "iptables {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let counted = || -> u64 {
        let out = iptables(&["-L", "OUTPUT", "-v", "-x", "-n"]);
        out.lines().skip(2).find(|l| l.contains("9999")).and_then(|l| l.split_whitespace().next()?.parse().ok()).unwrap_or_else(|| panic!("no rule:\n{out}"))
    };
    pair.run_in(&pair.a.clone(), || {
        let Some(mut fp) = load_or_skip(test) else { return };
        fp.add_service(SocketAddr::from((A4, 7000))).unwrap();
        assert!(fp.egress_now().is_err(), "not attached yet: nothing to look for");
        fp.attach_backup("va").expect("attach");
        assert_eq!(fp.egress_now(), Ok(EgressSeen::Present), "attached: its filter is listed with its program's id");
        let (to_service, from_service) = fp.pin_queue_matches(&dir).expect("pin");
        assert!(to_service.exists() && from_service.exists());
        iptables(&["-A", "OUTPUT", "-p", "udp", "--dport", "9999", "-m", "bpf", "--object-pinned", &from_service.to_string_lossy()]);
        let sock = UdpSocket::bind(SocketAddr::from((A4, 0))).unwrap();
        // Copy mode (attach_backup turned it on): the rule takes nothing.
        send_one(&sock);
        assert_eq!(counted(), 0, "before the take-over the egress program has the output");
        // The take-over: one write, and the rule takes every packet.
        fp.set_promoted(true).unwrap();
        send_one(&sock);
        assert_eq!(counted(), 1, "promoted: the queue takes the output");
        fp.set_promoted(false).unwrap();
        send_one(&sock);
        assert_eq!(counted(), 1);
        // The egress filter lost: the same, by the other flag.
        fp.set_user_out().unwrap();
        send_one(&sock);
        assert_eq!(counted(), 2, "user_out: the queue takes the output");
        // Another filter that runs first could let packets past it (second review, finding 4).
        pair.exec_ok(&pair.a, &["tc", "filter", "add", "dev", "va", "egress", "pref", "1", "protocol", "ip", "u32", "match", "ip", "dst", "10.9.9.9/32", "classid", "1:1"]);
        assert!(matches!(fp.egress_now(), Ok(EgressSeen::Gone(why)) if why.contains("u32") && why.contains("priority 1")), "{:?}", fp.egress_now());
        pair.exec_ok(&pair.a, &["tc", "filter", "del", "dev", "va", "egress", "pref", "1"]);
        assert_eq!(fp.egress_now(), Ok(EgressSeen::Present));
        // The watch thread sees the same.
        let watch = fp.watch_egress(std::time::Duration::from_millis(10)).unwrap();
        wait_for("a first look", || matches!(watch.seen(), (n, Some(Ok(EgressSeen::Present))) if n > 0));
        // Another tool removes the clsact qdisc: the filter is gone and the daemon can see it.
        pair.exec_ok(&pair.a, &["tc", "qdisc", "del", "dev", "va", "clsact"]);
        assert!(matches!(fp.egress_now(), Ok(EgressSeen::Gone(why)) if why.contains("no longer attached")), "a removed filter is seen");
        wait_for("the watch sees it", || matches!(watch.seen().1, Some(Ok(EgressSeen::Gone(_)))));
        // The rule goes before the pins (iptables-legacy opens them again on every rewrite).
        iptables(&["-F", "OUTPUT"]);
        unpin_queue_matches(&dir).unwrap();
        assert!(!dir.exists());
    });
}

#[test]
fn a_deleted_device_means_the_filter_is_gone() {
    let test = "a_deleted_device_means_the_filter_is_gone";
    let Some(pair) = NetnsPair::setup(test) else { return };
    pair.run_in(&pair.a.clone(), || {
        let Some(mut fp) = load_or_skip(test) else { return };
        fp.attach_backup("va").expect("attach");
        assert_eq!(fp.egress_now(), Ok(EgressSeen::Present));
        pair.exec_ok(&pair.a, &["ip", "link", "del", "va"]);
        assert!(matches!(fp.egress_now(), Ok(EgressSeen::Gone(why)) if why.contains("device va is gone")), "no device, no filter");
    });
}

/// The primary's attach (issue 22 item 4): `rep_p_out` at egress is the filter the watch looks
/// for, and the OUTPUT rule's match follows `set_queue_out` both ways (the primary queues its
/// server's output until the backup is heard, and again once the pair no longer protects).
#[test]
fn the_primarys_output_rule_switches_both_ways_with_one_map_write() {
    let test = "the_primarys_output_rule_switches_both_ways_with_one_map_write";
    let Some(pair) = NetnsPair::setup(test) else { return };
    let dir = std::path::PathBuf::from(format!("/sys/fs/bpf/unbroken/test-replica-primary-{}", std::process::id()));
    struct Unpin(std::path::PathBuf);
    impl Drop for Unpin {
        fn drop(&mut self) {
            let _ = unpin_queue_matches(&self.0);
        }
    }
    let _unpin = Unpin(dir.clone());
    if let Err(e) = unbroken_drivers::fastpath::object::ensure_bpffs() {
        skip_or_fail(test, &e.to_string());
        return;
    }
    let iptables = |args: &[&str]| -> String {
        let out = std::process::Command::new("iptables").args(["-w", "-t", "mangle"]).args(args).output().expect("iptables");
        assert!(out.status.success(), "iptables {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let counted = || -> u64 {
        let out = iptables(&["-L", "OUTPUT", "-v", "-x", "-n"]);
        out.lines().skip(2).find(|l| l.contains("9999")).and_then(|l| l.split_whitespace().next()?.parse().ok()).unwrap_or_else(|| panic!("no rule:\n{out}"))
    };
    pair.run_in(&pair.a.clone(), || {
        let Some(mut fp) = load_or_skip(test) else { return };
        fp.add_service(SocketAddr::from((A4, 7000))).unwrap();
        fp.set_queue_out(true).unwrap();
        fp.attach_primary("va").expect("attach");
        assert_eq!(fp.egress_now(), Ok(EgressSeen::Present), "rep_p_out's filter is listed with its program's id");
        let (_, from_service) = fp.pin_queue_matches(&dir).expect("pin");
        iptables(&["-A", "OUTPUT", "-p", "udp", "--dport", "9999", "-m", "bpf", "--object-pinned", &from_service.to_string_lossy()]);
        let sock = UdpSocket::bind(SocketAddr::from((A4, 0))).unwrap();
        send_one(&sock);
        assert_eq!(counted(), 1, "before the backup is heard the queue takes the output");
        fp.set_queue_out(false).unwrap();
        send_one(&sock);
        assert_eq!(counted(), 1, "protecting: the egress program has it");
        fp.set_queue_out(true).unwrap();
        send_one(&sock);
        assert_eq!(counted(), 2, "no longer protecting: the queue again");
        // A restarted daemon's filter replaces it; `remove_egress` removes it.
        assert_eq!(unbroken_drivers::fastpath::replica::remove_egress("va").unwrap(), 1);
        assert!(matches!(fp.egress_now(), Ok(EgressSeen::Gone(_))));
        iptables(&["-F", "OUTPUT"]);
        unpin_queue_matches(&dir).unwrap();
        assert!(!dir.exists());
    });
}
