//! Replica mode's segment on real kernels (issue 10 item 1): a client and two servers on a
//! hub-mode switch ([`ReplicaLab`]), both servers holding the service address.
//!
//! - With the backup's ARP suppressed ([`ArpSuppress`]), the client resolves the service address
//!   to the primary's MAC every time, and the suppression's counters prove the backup saw the
//!   requests and did not answer them; the backup's own ARP with the service address as sender
//!   is not sent either.
//! - Every TCP segment of a client connection to the primary also reaches the backup's interface
//!   (counted by an nftables netdev ingress counter there), and the backup's stack does not
//!   answer it (the frames name the primary's MAC): the client sees no RST.
//! - Takeover: the primary's host dies; the backup removes its suppression and announces the
//!   address ([`Announcer`]); the client's neighbour entry names the backup's MAC, new
//!   connections reach the backup's server, and a fresh resolution is answered by the backup.
//! - Ownership of the suppression and hand-over tables; the hand-over ([`HubReceive`], one
//!   netdev rule `meta pkttype set host`) gives the mirrored frames to the backup's stack.
//! - The hand-over is the replicated service's TCP only: a ping gets one echo reply (the
//!   primary's), a SYN for another port the primary serves draws no RST from the backup.
//! - Local injection: a packet "from the client" sent with `RawSender` in the backup reaches its
//!   own server socket through `lo`, with `rp_filter=1` (what the backup daemon injects).
//! - Without a hub: the router in front mirrors toward the backup (`segment::Mirror`).
//!
//! Needs root; without it each test prints why and passes without running (fails instead with
//! UNBROKEN_REQUIRE_LAB=1).

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use unbroken_drivers::segment::{
    Announcer, ArpSuppress, ArpSuppressSpec, HubReceive, HubReceiveSpec, Owner,
};
use unbroken_lab::lab::{self, dev};
use unbroken_lab::replicalab::{addr, ReplicaLab};

/// Bound on every blocking socket call and on every wait for an event.
const T: Duration = Duration::from_secs(10);
const PORT: u16 = 7000;
/// Round trips of the mirrored connection: each is one client data segment the backup must see.
const ROUND_TRIPS: u64 = 20;
/// The backup's mirrored-segment counter.
const COUNT_TABLE: &str = "unbroken-test-mirror";

/// One lab at a time: two cores.
static LAB: Mutex<()> = Mutex::new(());

fn lab_or_skip(name: &str) -> Option<std::sync::MutexGuard<'static, ()>> {
    if !lab::lab_or_skip(name) {
        return None;
    }
    for tool in ["nft", "iptables"] {
        if Command::new(tool).arg("--version").output().is_err() {
            lab::skip_or_fail(name, &format!("`{tool}` is not installed"));
            return None;
        }
    }
    Some(LAB.lock().unwrap_or_else(|e| e.into_inner()))
}

fn service() -> SocketAddr {
    SocketAddr::new(IpAddr::V4(addr::SERVICE_V4), PORT)
}

/// A listener on the service address in `ns`, echoing every connection on its own thread.
fn echo_server(ns: &str) {
    let l = lab::in_ns(ns, || TcpListener::bind(service()))
        .unwrap()
        .unwrap();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { return };
            c.set_read_timeout(Some(T)).unwrap();
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = c.read(&mut buf) {
                    if n == 0 || c.write_all(&buf[..n]).is_err() {
                        return;
                    }
                }
            });
        }
    });
}

/// A connection from the client namespace to the service, with timeouts.
fn connect(client: &str) -> TcpStream {
    let s = lab::in_ns(client, || TcpStream::connect_timeout(&service(), T))
        .unwrap()
        .unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    s.set_write_timeout(Some(T)).unwrap();
    s
}

/// `rounds` request/response round trips of 100 bytes each, checked byte for byte.
fn echo_rounds(s: &mut TcpStream, rounds: u64) {
    for i in 0..rounds {
        let req: Vec<u8> = (0..100u8)
            .map(|b| b.wrapping_mul(7).wrapping_add(i as u8))
            .collect();
        s.write_all(&req).unwrap();
        let mut got = vec![0u8; req.len()];
        s.read_exact(&mut got).unwrap();
        assert_eq!(got, req, "echo of round {i}");
    }
}

fn neigh(ns: &str) -> Option<[u8; 6]> {
    lab::neigh_mac(ns, dev::APP, IpAddr::V4(addr::SERVICE_V4)).unwrap()
}

fn flush_neigh(ns: &str) {
    lab::run_ok(
        ns,
        Command::new("ip").args(["neigh", "flush", "dev", dev::APP]),
    )
    .unwrap();
}

/// Waits (bounded) until `cond` holds; `false` when the deadline passed first.
fn wait_for(mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + T;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() > end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5)); // polling an event, bounded by T
    }
}

/// Counts, on the backup's interface, every IPv4 TCP packet to the service port (netdev ingress
/// sees frames addressed to other hosts too, before the stack drops them).
fn install_mirror_counter(ns: &str) {
    let rules = format!(
        "table netdev {COUNT_TABLE} {{\n  chain c {{\n    type filter hook ingress device \"{}\" priority 0; policy accept;\n    \
         ip daddr {} tcp dport {PORT} counter\n  }}\n}}\n",
        dev::APP,
        addr::SERVICE_V4
    );
    nft_stdin(ns, &rules);
}

/// Counts, on the client's interface, every ARP packet from the backup's MAC naming the service
/// address as its sender: an answer to the client's request or an announcement. Zero while the
/// backup is suppressed; its gratuitous ARP on takeover.
fn install_backup_arp_counter(ns: &str) {
    nft_stdin(
        ns,
        &format!(
            "table netdev {COUNT_TABLE} {{\n  chain c {{\n    type filter hook ingress device \"{}\" priority 0; policy accept;\n    \
             ether saddr {} arp saddr ip {} counter\n  }}\n}}\n",
            dev::APP,
            mac_str(addr::BACKUP_MAC),
            addr::SERVICE_V4
        ),
    );
}

fn mac_str(m: [u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

fn nft_stdin(ns: &str, rules: &str) {
    let mut child = {
        let mut c = Command::new("nft");
        c.args(["-f", "-"]).stdin(std::process::Stdio::piped());
        lab::enter(ns, &mut c).unwrap();
        c.spawn().unwrap()
    };
    child
        .stdin
        .take()
        .unwrap()
        .write_all(rules.as_bytes())
        .unwrap();
    assert!(child.wait().unwrap().success(), "nft -f in {ns}:\n{rules}");
}

/// The packet count of the test's counter table in `ns`.
fn counted(ns: &str) -> u64 {
    let out = lab::run_ok(
        ns,
        Command::new("nft").args(["list", "table", "netdev", COUNT_TABLE]),
    )
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let after = text
        .split_once("counter packets ")
        .expect("counter in listing")
        .1;
    after.split_whitespace().next().unwrap().parse().unwrap()
}

#[test]
fn replica_segment_suppress_mirror_announce() {
    let Some(_g) = lab_or_skip("replica_segment_suppress_mirror_announce") else {
        return;
    };
    let mut rl = ReplicaLab::build().expect("build the replica segment");
    let (client, primary, backup) = (rl.client.clone(), rl.primary.clone(), rl.backup.clone());
    assert_eq!(rl.lab.mac(&backup, dev::APP).unwrap(), addr::BACKUP_MAC);

    // The backup's suppression first, then its service address.
    let mut spec = ArpSuppressSpec::new(dev::APP, addr::SERVICE_V4);
    spec.netns = Some(backup.clone());
    let suppress = ArpSuppress::install(&spec).expect("install the ARP suppression");
    let again = ArpSuppress::install(&spec).expect("installing again is idempotent");
    again.leave_installed();
    assert_eq!(
        ArpSuppress::owner(&spec).unwrap(),
        Some(Some(Owner::current()))
    );
    rl.add_backup_service_ip().unwrap();
    lab::install_rst_counter(&client).unwrap();
    install_mirror_counter(&backup);
    install_backup_arp_counter(&client);
    echo_server(&primary);

    // 1. The client resolves the address to the primary, every time; the backup saw each
    //    request and dropped it.
    for i in 1..=5u64 {
        flush_neigh(&client);
        let mut s = connect(&client);
        echo_rounds(&mut s, 1);
        assert_eq!(
            neigh(&client),
            Some(addr::PRIMARY_MAC),
            "resolution {i} names the primary"
        );
        let c = ArpSuppress::counters(&spec).unwrap();
        assert!(
            c.requests_dropped >= i,
            "resolution {i}: the backup dropped only {c:?}"
        );
    }

    // The backup's kernel does not use the address as an ARP sender either (that would announce
    // it): a packet from the service address to an unresolved neighbour makes it try. The lab
    // sets arp_announce = 2 as the README asks (the kernel then never tries); the suppression
    // must hold for an operator who forgot it, so it is back at the kernel's default here.
    lab::sysctls(&backup, &[("net.ipv4.conf.all.arp_announce", "0"), (&format!("net.ipv4.conf.{}.arp_announce", dev::APP), "0")]).unwrap();
    lab::in_ns(&backup, || {
        let u =
            std::net::UdpSocket::bind(SocketAddr::new(IpAddr::V4(addr::SERVICE_V4), 0)).unwrap();
        u.send_to(b"x", SocketAddr::new(IpAddr::V4(addr::CLIENT_V4), 9))
            .unwrap();
    })
    .unwrap();
    assert!(
        wait_for(|| ArpSuppress::counters(&spec).unwrap().announcements_dropped >= 1),
        "the backup's ARP with the service address as sender was not dropped: {:?}",
        ArpSuppress::counters(&spec)
    );
    assert_eq!(
        neigh(&client),
        Some(addr::PRIMARY_MAC),
        "the client still names the primary"
    );
    assert_eq!(
        counted(&client),
        0,
        "no ARP from the backup named the service address"
    );

    // 2. Mirroring: every client segment of a connection to the primary reaches the backup's
    //    interface, and the backup's stack does not answer any (no RST at the client).
    let before = counted(&backup);
    let mut s = connect(&client);
    echo_rounds(&mut s, ROUND_TRIPS);
    drop(s);
    // SYN, handshake ACK, one data segment per round trip (the client waits for each echo).
    let seen = counted(&backup) - before;
    assert!(
        seen >= ROUND_TRIPS + 2,
        "the backup saw {seen} of at least {} client segments",
        ROUND_TRIPS + 2
    );
    assert_eq!(
        lab::rsts_seen(&client).unwrap(),
        0,
        "no RST reached the client"
    );
    assert_eq!(neigh(&client), Some(addr::PRIMARY_MAC));
    assert_eq!(
        counted(&client),
        0,
        "no ARP from the backup named the service address"
    );

    // 3. Takeover: the primary's host dies; the backup stops suppressing and announces.
    rl.lab.crash_host(&primary).unwrap();
    echo_server(&backup);
    suppress.remove().expect("remove the suppression");
    assert_eq!(ArpSuppress::owner(&spec).unwrap(), None, "table gone");
    ArpSuppress::remove_leftovers(&spec).expect("removing again is a no-op");
    let announcer = lab::in_ns(&backup, || Announcer::open(dev::APP))
        .unwrap()
        .expect("open the announcer");
    assert_eq!(announcer.mac(), addr::BACKUP_MAC);
    announcer.announce(addr::SERVICE_V4).expect("announce");
    assert!(
        wait_for(|| counted(&client) >= 2),
        "the client got {} of the 2 announcement frames",
        counted(&client)
    );
    assert!(
        wait_for(|| neigh(&client) == Some(addr::BACKUP_MAC)),
        "the gratuitous ARP did not move the client's entry: {:?}",
        neigh(&client)
    );
    let mut s = connect(&client);
    echo_rounds(&mut s, 3);
    drop(s);
    // A fresh resolution: only the backup can answer now (the primary's link is down).
    flush_neigh(&client);
    let mut s = connect(&client);
    echo_rounds(&mut s, 1);
    assert_eq!(neigh(&client), Some(addr::BACKUP_MAC));
    assert_eq!(
        lab::rsts_seen(&client).unwrap(),
        0,
        "no RST reached the client"
    );
}

#[test]
fn replica_segment_suppression_ownership() {
    let Some(_g) = lab_or_skip("replica_segment_suppression_ownership") else {
        return;
    };
    let pair = lab::Lab::pair().expect("build a pair");
    let mut mine = ArpSuppressSpec::new(dev::PEER, addr::SERVICE_V4);
    mine.netns = Some(pair.a.clone());

    // Another running process's table is never touched, and the error names it. (It runs in
    // the lab's namespace, so the lab kills it even if this test fails.)
    let mut other = lab::spawn(&pair.a, Command::new("sleep").arg("600")).unwrap();
    let theirs = ArpSuppressSpec {
        owner: Owner::of_pid(other.id()).unwrap(),
        ..mine.clone()
    };
    ArpSuppress::install(&theirs).unwrap().leave_installed();
    let e = ArpSuppress::install(&mine).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse, "{e}");
    assert!(
        e.to_string().contains(&format!("pid {}", other.id())),
        "{e}"
    );
    assert_eq!(
        ArpSuppress::remove_leftovers(&mine).unwrap_err().kind(),
        std::io::ErrorKind::AddrInUse
    );
    assert_eq!(ArpSuppress::owner(&mine).unwrap(), Some(Some(theirs.owner)));

    // Once it is gone, its table is taken over in one transaction.
    other.kill().unwrap();
    other.wait().unwrap();
    let s = ArpSuppress::install(&mine).expect("take over a dead owner's table");
    assert_eq!(
        ArpSuppress::owner(&mine).unwrap(),
        Some(Some(Owner::current()))
    );
    let listing = lab::run_ok(&pair.a, Command::new("nft").args(["list", "ruleset"])).unwrap();
    let text = String::from_utf8_lossy(&listing.stdout);
    assert_eq!(
        text.matches("table arp ").count(),
        1,
        "one table, not two:\n{text}"
    );
    assert_eq!(
        text.matches(" drop ").count(),
        2,
        "two rules, not four:\n{text}"
    );

    // Drop removes it.
    drop(s);
    assert_eq!(ArpSuppress::owner(&mine).unwrap(), None);
}

/// [`HubReceive`]'s table is owned like the suppression's: another running process's is never
/// touched and the error names it; a dead owner's or an untagged one is replaced in one
/// transaction; installing twice leaves one table with one rule; `Drop` removes it; an IPv6
/// service address is refused before anything is touched.
#[test]
fn replica_segment_hub_receive_ownership() {
    let Some(_g) = lab_or_skip("replica_segment_hub_receive_ownership") else {
        return;
    };
    let pair = lab::Lab::pair().expect("build a pair");
    let svc = IpAddr::V4(addr::SERVICE_V4);
    let mut mine = HubReceiveSpec::tcp(dev::PEER, [svc], [PORT]);
    mine.netns = Some(pair.a.clone());
    let tables = || {
        let out = lab::run_ok(&pair.a, Command::new("nft").args(["list", "ruleset"])).unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let one_table_one_rule = |what: &str| {
        let text = tables();
        assert_eq!(
            text.matches("table netdev ").count(),
            1,
            "{what}: one table:\n{text}"
        );
        assert_eq!(
            text.matches("meta pkttype set host").count(),
            1,
            "{what}: one rule:\n{text}"
        );
    };

    let v6 = HubReceiveSpec {
        addrs: vec![svc, "fd77:3::10".parse().unwrap()],
        ..mine.clone()
    };
    let e = HubReceive::install(&v6).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::Unsupported, "{e}");
    assert!(e.to_string().contains("fd77:3::10"), "{e}");
    assert_eq!(HubReceive::owner(&mine).unwrap(), None, "nothing installed");
    assert_eq!(
        HubReceive::handed(&mine).unwrap_err().kind(),
        std::io::ErrorKind::NotFound
    );

    // An untagged table of the same name (an older version's, or hand-made) is replaced.
    nft_stdin(
        &pair.a,
        &format!(
            "table netdev {} {{\n  chain c {{\n    type filter hook ingress device \"{}\" priority 0; policy accept;\n    \
             ip daddr {svc} meta pkttype other meta pkttype set host\n  }}\n}}\n",
            mine.table,
            dev::PEER
        ),
    );
    assert_eq!(HubReceive::owner(&mine).unwrap(), Some(None));
    let first = HubReceive::install(&mine).expect("replace an untagged table");
    HubReceive::install(&mine)
        .expect("installing again is idempotent")
        .leave_installed();
    one_table_one_rule("installed twice");
    assert_eq!(
        HubReceive::owner(&mine).unwrap(),
        Some(Some(Owner::current()))
    );
    assert_eq!(HubReceive::handed(&mine).unwrap(), 0);
    first.leave_installed();

    // Another running process's table is never touched, and the error names it.
    let mut other = lab::spawn(&pair.a, Command::new("sleep").arg("600")).unwrap();
    let theirs = HubReceiveSpec {
        owner: Owner::of_pid(other.id()).unwrap(),
        ..mine.clone()
    };
    let e = HubReceive::install(&theirs).unwrap_err();
    assert_eq!(
        e.kind(),
        std::io::ErrorKind::AddrInUse,
        "ours is alive: {e}"
    );
    HubReceive::remove_leftovers(&mine).unwrap();
    HubReceive::install(&theirs).unwrap().leave_installed();
    let e = HubReceive::install(&mine).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse, "{e}");
    assert!(
        e.to_string().contains(&format!("pid {}", other.id())),
        "{e}"
    );
    assert_eq!(
        HubReceive::remove_leftovers(&mine).unwrap_err().kind(),
        std::io::ErrorKind::AddrInUse
    );
    assert_eq!(
        HubReceive::check_owner(&mine).unwrap_err().kind(),
        std::io::ErrorKind::AddrInUse
    );
    assert_eq!(HubReceive::owner(&mine).unwrap(), Some(Some(theirs.owner)));

    // Once it is gone, its table is taken over in one transaction.
    other.kill().unwrap();
    other.wait().unwrap();
    let s = HubReceive::install(&mine).expect("take over a dead owner's table");
    assert_eq!(
        HubReceive::owner(&mine).unwrap(),
        Some(Some(Owner::current()))
    );
    one_table_one_rule("taken over");

    // Drop removes it; removing again is no error.
    drop(s);
    assert_eq!(HubReceive::owner(&mine).unwrap(), None);
    HubReceive::remove_leftovers(&mine).expect("removing an absent table");
    assert!(!tables().contains("table netdev "), "{}", tables());
}

/// On a hub the mirrored frames name the primary's MAC, so the backup's stack ignores them
/// (PACKET_OTHERHOST). [`HubReceive`] (one nftables netdev rule on the backup's ingress, `meta
/// pkttype set host` for packets to the service address) hands them to its stack, whose answers
/// must then be withheld (here: dropped in OUTPUT and counted). Its server's socket answers the
/// client's SYN, which proves the delivery.
#[test]
fn replica_segment_backup_stack_gets_mirrored_frames() {
    let Some(_g) = lab_or_skip("replica_segment_backup_stack_gets_mirrored_frames") else {
        return;
    };
    let mut rl = ReplicaLab::build().expect("build the replica segment");
    let (client, primary, backup) = (rl.client.clone(), rl.primary.clone(), rl.backup.clone());
    let mut spec = ArpSuppressSpec::new(dev::APP, addr::SERVICE_V4);
    spec.netns = Some(backup.clone());
    let _suppress = ArpSuppress::install(&spec).expect("install the ARP suppression");
    rl.add_backup_service_ip().unwrap();
    lab::install_rst_counter(&client).unwrap();
    let mut rx = HubReceiveSpec::tcp(dev::APP, [IpAddr::V4(addr::SERVICE_V4)], [PORT]);
    rx.netns = Some(backup.clone());
    let _rx = HubReceive::install(&rx).expect("install the pkttype rule");
    assert_eq!(HubReceive::handed(&rx).unwrap(), 0);
    // The backup's output to clients is withheld (the daemon's job; a plain drop here).
    let withheld = |ns: &str| -> u64 {
        let out = lab::run_ok(
            ns,
            Command::new("iptables").args(["-w", "-L", "OUTPUT", "-v", "-n", "-x"]),
        )
        .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.lines()
            .find(|l| l.contains("spt:7000"))
            .and_then(|l| l.split_whitespace().next()?.parse().ok())
            .unwrap()
    };
    lab::run_ok(
        &backup,
        Command::new("iptables").args([
            "-w",
            "-A",
            "OUTPUT",
            "-p",
            "tcp",
            "-s",
            &addr::SERVICE_V4.to_string(),
            "--sport",
            "7000",
            "-j",
            "DROP",
        ]),
    )
    .unwrap();
    echo_server(&primary);
    echo_server(&backup);
    assert_eq!(withheld(&backup), 0);

    let mut s = connect(&client);
    echo_rounds(&mut s, 3);
    drop(s);
    assert!(
        HubReceive::handed(&rx).unwrap() >= 5,
        "only {} frames handed to the backup's stack",
        HubReceive::handed(&rx).unwrap()
    );
    // The backup's server answered at least the SYN (a SYN-ACK, withheld).
    assert!(
        wait_for(|| withheld(&backup) >= 1),
        "the backup's stack never answered"
    );
    assert_eq!(
        lab::rsts_seen(&client).unwrap(),
        0,
        "nothing of the backup's reached the client"
    );
    assert_eq!(neigh(&client), Some(addr::PRIMARY_MAC));
}

/// Issue 20 item 13: the hand-over gives the backup's stack only the replicated service's TCP,
/// nothing else addressed to the service address. Before, every protocol and port went over:
/// each ping drew a second echo reply (the backup's), and a SYN for another port the primary
/// serves drew the backup's RST beside the primary's SYN-ACK.
///
/// The backup's own output is counted in its OUTPUT hook (before neighbour resolution, so an
/// answer counts whether or not it could leave). Every probe and the final barrier are sent
/// from threads pinned to one CPU, so they cross the hub and reach the backup's stack in the
/// order sent; the barrier is a SYN to the service port, whose (withheld) SYN-ACK from the
/// backup's stack proves that the service port still reaches it and that everything sent
/// before it has been processed there.
#[test]
fn hostile_replica_segment_hub_receive_hands_over_only_the_service_port() {
    let Some(_g) =
        lab_or_skip("hostile_replica_segment_hub_receive_hands_over_only_the_service_port")
    else {
        return;
    };
    const OTHER: u16 = PORT + 1;
    let mut rl = ReplicaLab::build().expect("build the replica segment");
    let (client, primary, backup) = (rl.client.clone(), rl.primary.clone(), rl.backup.clone());
    let mut spec = ArpSuppressSpec::new(dev::APP, addr::SERVICE_V4);
    spec.netns = Some(backup.clone());
    let _suppress = ArpSuppress::install(&spec).expect("install the ARP suppression");
    rl.add_backup_service_ip().unwrap();
    lab::install_rst_counter(&client).unwrap();
    let mut rx = HubReceiveSpec::tcp(dev::APP, [IpAddr::V4(addr::SERVICE_V4)], [PORT]);
    rx.netns = Some(backup.clone());
    let _rx = HubReceive::install(&rx).expect("install the hand-over rule");
    let svc = addr::SERVICE_V4;
    // What the backup's stack sends from the service address, by kind; its answers on the
    // service port are withheld (the daemon's job; a plain drop here).
    nft_stdin(
        &backup,
        &format!(
            "table inet {COUNT_TABLE} {{\n  chain out {{\n    type filter hook output priority 0; policy accept;\n    \
             ip saddr {svc} icmp type echo-reply counter comment \"echo\"\n    \
             ip saddr {svc} tcp sport {OTHER} counter comment \"other\"\n    \
             ip saddr {svc} tcp sport {PORT} counter drop comment \"service\"\n  }}\n}}\n"
        ),
    );
    // The echo replies the client receives, from either host.
    nft_stdin(
        &client,
        &format!(
            "table netdev {COUNT_TABLE} {{\n  chain c {{\n    type filter hook ingress device \"{}\" priority 0; policy accept;\n    \
             ip saddr {svc} icmp type echo-reply counter comment \"replies\"\n  }}\n}}\n",
            dev::APP
        ),
    );
    let backup_sent = |what: &str| counted_by(&backup, "inet", what);
    let replies = || counted_by(&client, "netdev", "replies");
    // The primary serves both ports; the backup's server only the replicated one.
    echo_server(&primary);
    echo_server(&backup);
    let other = SocketAddr::new(IpAddr::V4(svc), OTHER);
    let _other_listener = lab::in_ns(&primary, || TcpListener::bind(other))
        .unwrap()
        .unwrap();
    let cpu = first_allowed_cpu();

    // 1. A ping: the primary answers it, the backup's stack never sees it.
    pinned_in_ns(&client, cpu, || send_echo_request(svc, 0x7e9, 1)).expect("send the ping");
    assert!(
        wait_for(|| replies() >= 1),
        "the primary never answered the ping"
    );

    // 2. A connection to another port the primary serves: only the primary answers.
    let c = pinned_in_ns(&client, cpu, || TcpStream::connect_timeout(&other, T))
        .expect("the primary accepts on the other port");

    // 3. The barrier: a SYN to the replicated port reaches the backup's stack, which answers.
    let s = pinned_in_ns(&client, cpu, || TcpStream::connect_timeout(&service(), T))
        .expect("the primary accepts on the service port");
    assert!(
        wait_for(|| backup_sent("service") >= 1),
        "the service port no longer reaches the backup's stack"
    );
    assert!(HubReceive::handed(&rx).unwrap() >= 1);

    assert_eq!(
        backup_sent("echo"),
        0,
        "the backup's stack answered the ping"
    );
    assert_eq!(
        backup_sent("other"),
        0,
        "the backup's stack answered a SYN for a port it does not replicate (a RST)"
    );
    assert_eq!(replies(), 1, "exactly one echo reply, the primary's");
    assert_eq!(
        lab::rsts_seen(&client).unwrap(),
        0,
        "no RST reached the client"
    );
    drop((c, s));
}

/// The packet count of the rule commented `comment` in the test's counter table of `family`.
fn counted_by(ns: &str, family: &str, comment: &str) -> u64 {
    let out = lab::run_ok(
        ns,
        Command::new("nft").args(["list", "table", family, COUNT_TABLE]),
    )
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.contains(&format!("comment \"{comment}\"")))
        .unwrap_or_else(|| panic!("no rule {comment:?} in\n{text}"));
    let after = line.split_once("counter packets ").expect("a counter").1;
    after.split_whitespace().next().unwrap().parse().unwrap()
}

/// The lowest CPU this thread may run on.
fn first_allowed_cpu() -> usize {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; the call fills it for this thread.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let r = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    assert_eq!(
        r,
        0,
        "sched_getaffinity: {}",
        std::io::Error::last_os_error()
    );
    (0..libc::CPU_SETSIZE as usize)
        .find(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .expect("some CPU")
}

/// `f` on a thread in `ns` pinned to `cpu`: what it sends is queued on that CPU's backlog, so
/// frames sent by successive calls cross the veths and the hub in the order sent.
fn pinned_in_ns<T: Send>(
    ns: &str,
    cpu: usize,
    f: impl FnOnce() -> std::io::Result<T> + Send,
) -> std::io::Result<T> {
    lab::in_ns(ns, || {
        // SAFETY: a zeroed cpu_set_t is a valid empty set; one CPU added; this thread only.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        unsafe { libc::CPU_SET(cpu, &mut set) };
        if unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) } != 0
        {
            return Err(std::io::Error::last_os_error());
        }
        f()
    })?
}

/// One ICMP echo request to `to` from a raw socket of the calling thread's namespace.
fn send_echo_request(to: std::net::Ipv4Addr, id: u16, seq: u16) -> std::io::Result<()> {
    use std::os::fd::{FromRawFd, OwnedFd};
    let mut msg = vec![8u8, 0, 0, 0];
    msg.extend_from_slice(&id.to_be_bytes());
    msg.extend_from_slice(&seq.to_be_bytes());
    msg.extend_from_slice(b"unbroken-hub-receive");
    let mut sum: u32 = msg
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum();
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    msg[2..4].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    // SAFETY: plain socket(2); the fd is owned below.
    let fd = unsafe {
        libc::socket(
            libc::AF_INET,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::IPPROTO_ICMP,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh fd nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let sa = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(to).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: a live socket, a live buffer and a live sockaddr_in with their sizes.
    let r = unsafe {
        libc::sendto(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            msg.as_ptr().cast(),
            msg.len(),
            0,
            (&sa as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `ioctl(fd, req)` for an int-valued TCP queue figure (`SIOCOUTQ`, `SIOCOUTQNSD`).
fn queue_bytes(s: &TcpStream, req: libc::c_ulong) -> u32 {
    use std::os::fd::AsRawFd;
    let mut v: libc::c_int = 0;
    // SAFETY: a live socket and a live int for the ioctl to fill.
    let r = unsafe { libc::ioctl(s.as_raw_fd(), req as _, &mut v) };
    assert_eq!(r, 0, "ioctl {req:#x}: {}", std::io::Error::last_os_error());
    v as u32
}

/// The socket's TSval clock now (`TCP_TIMESTAMP`; no repair mode needed to read it).
fn ts_clock(s: &TcpStream) -> u32 {
    use std::os::fd::AsRawFd;
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: a live socket, a live int and its size.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_TCP,
            libc::TCP_TIMESTAMP,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    assert_eq!(r, 0, "TCP_TIMESTAMP: {}", std::io::Error::last_os_error());
    v as u32
}

/// A `TcpExt` figure of `/proc/net/netstat` in `ns`.
fn tcp_ext(ns: &str, name: &str) -> u64 {
    let out = lab::run_ok(ns, Command::new("cat").arg("/proc/net/netstat")).unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut lines = text.lines().filter(|l| l.starts_with("TcpExt:"));
    let (names, values) = (lines.next().unwrap(), lines.next().unwrap());
    let i = names
        .split_whitespace()
        .position(|n| n == name)
        .unwrap_or_else(|| panic!("{name} not in {names}"));
    values.split_whitespace().nth(i).unwrap().parse().unwrap()
}

/// What the backup's daemon injects into its own server's socket (`Backup::primary_report`: a
/// client ACK the backup missed, as the client sent it): an IPv4 packet from the client's address
/// to the service address, which is local on the backup, sent with `RawSender` (IP_HDRINCL,
/// marked). Its route is the local table's, through `lo`, which keeps the output route on the
/// packet, so the input side does no route lookup and reverse-path filtering never runs: with
/// `rp_filter=1` on every interface of the backup the packet is delivered, and the kernel's
/// `IPReversePathFilter` counter stays 0.
///
/// A real connection from the client reaches the backup's server through the hub and
/// [`HubReceive`] (the primary drops it silently, the backup answers the client directly: the
/// backup's output is not withheld here). Then the client goes silent and deaf (repair mode, its
/// input dropped): the backup's next output stays unacknowledged until an injected ACK with the
/// client's numbers acknowledges it; an injected data segment reaches the backup's server.
#[test]
fn replica_segment_backup_local_injection() {
    use unbroken_drivers::rawsend::RawSender;
    use unbroken_drivers::repair::{self, SIOCOUTQ, SIOCOUTQNSD};
    use unbroken_wire::{ip, tcp, Seq};
    let Some(_g) = lab_or_skip("replica_segment_backup_local_injection") else {
        return;
    };
    let mut rl = ReplicaLab::build().expect("build the replica segment");
    let (client, primary, backup) = (rl.client.clone(), rl.primary.clone(), rl.backup.clone());
    let mut spec = ArpSuppressSpec::new(dev::APP, addr::SERVICE_V4);
    spec.netns = Some(backup.clone());
    let _suppress = ArpSuppress::install(&spec).expect("install the ARP suppression");
    rl.add_backup_service_ip().unwrap();
    let mut rx = HubReceiveSpec::tcp(dev::APP, [IpAddr::V4(addr::SERVICE_V4)], [PORT]);
    rx.netns = Some(backup.clone());
    let _rx = HubReceive::install(&rx).expect("install the pkttype rule");
    let rp = "net.ipv4.conf.{}.rp_filter";
    let keys: Vec<String> = ["all", "default", "lo", dev::APP]
        .iter()
        .map(|d| rp.replace("{}", d))
        .collect();
    let kv: Vec<(&str, &str)> = keys.iter().map(|k| (k.as_str(), "1")).collect();
    // arp_announce=2: the backup resolves the client with its host address as the ARP sender
    // (the suppression drops ARP naming the service address).
    let announce = format!("net.ipv4.conf.{}.arp_announce", dev::APP);
    lab::sysctls(&backup, &kv).unwrap();
    lab::sysctls(&backup, &[(announce.as_str(), "2")]).unwrap();
    for k in &keys {
        assert_eq!(lab::sysctl_get(&backup, k).unwrap().trim(), "1", "{k}");
    }
    // The primary stays silent for this port (no RST, no SYN-ACK): the backup serves it.
    lab::run_ok(
        &primary,
        Command::new("iptables").args([
            "-w",
            "-A",
            "INPUT",
            "-p",
            "tcp",
            "-d",
            &addr::SERVICE_V4.to_string(),
            "--dport",
            &PORT.to_string(),
            "-j",
            "DROP",
        ]),
    )
    .unwrap();
    let listener = lab::in_ns(&backup, || TcpListener::bind(service()))
        .unwrap()
        .unwrap();

    let mut c = connect(&client);
    let (mut b, peer) = listener.accept().unwrap();
    b.set_read_timeout(Some(T)).unwrap();
    assert_eq!(peer, c.local_addr().unwrap());
    c.write_all(b"ping").unwrap();
    let mut got = [0u8; 4];
    b.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"ping");
    b.write_all(b"pong").unwrap();
    c.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"pong");
    assert!(
        wait_for(|| queue_bytes(&b, SIOCOUTQ) == 0),
        "the client's ACK of pong never reached the backup's server"
    );
    assert!(
        HubReceive::handed(&rx).unwrap() >= 3,
        "handshake ACK, ping, ACK of pong"
    );

    // The client's numbers, then silence: nothing it sends or receives from here on.
    let d = repair::dump(&c).expect("read the client's sequence numbers");
    repair::enter_repair(std::os::fd::AsRawFd::as_raw_fd(&c)).unwrap();
    lab::run_ok(
        &client,
        Command::new("iptables").args([
            "-w",
            "-A",
            "INPUT",
            "-p",
            "tcp",
            "-s",
            &addr::SERVICE_V4.to_string(),
            "--sport",
            &PORT.to_string(),
            "-j",
            "DROP",
        ]),
    )
    .unwrap();
    let reply = vec![0x5au8; 1000];
    b.write_all(&reply).unwrap();
    assert!(
        wait_for(|| queue_bytes(&b, SIOCOUTQNSD) == 0),
        "the backup's server did not send its reply"
    );
    assert_eq!(queue_bytes(&b, SIOCOUTQ), 1000, "nothing acknowledged it");

    let sender = lab::in_ns(&backup, || RawSender::new(0x7e9))
        .unwrap()
        .expect("open the raw sender in the backup");
    assert_eq!(d.local, c.local_addr().unwrap());
    let segment = |flags: u8, payload: &[u8]| {
        let r = tcp::Repr {
            src_port: d.local.port(),
            dst_port: PORT,
            seq: Seq(d.snd_nxt),
            ack: Seq(d.rcv_nxt.wrapping_add(reply.len() as u32)),
            flags,
            window: 1000,
            // The client's clock (PAWS) and the backup's latest TSval echoed, as the engine does.
            timestamp: d.timestamp.map(|_| (ts_clock(&c), ts_clock(&b))),
            ..Default::default()
        };
        ip::tcp_packet(
            IpAddr::V4(addr::CLIENT_V4),
            IpAddr::V4(addr::SERVICE_V4),
            &r,
            payload,
        )
        .unwrap()
    };
    let rpf_before = tcp_ext(&backup, "IPReversePathFilter");

    // 1. A pure ACK the backup missed: its server's reply is acknowledged.
    sender
        .send(&segment(tcp::flags::ACK, &[]))
        .expect("inject the ACK");
    assert!(
        wait_for(|| queue_bytes(&b, SIOCOUTQ) == 0),
        "the injected ACK was not taken: {} bytes still unacknowledged",
        queue_bytes(&b, SIOCOUTQ)
    );

    // 2. A data segment from the client: it reaches the backup's server.
    let data = b"injected from the client's address";
    sender
        .send(&segment(tcp::flags::ACK | tcp::flags::PSH, data))
        .expect("inject the data");
    let mut got = vec![0u8; data.len()];
    b.read_exact(&mut got)
        .expect("the injected data reaches the server");
    assert_eq!(&got, data);

    assert_eq!(
        tcp_ext(&backup, "IPReversePathFilter"),
        rpf_before,
        "reverse-path filtering dropped something"
    );
    assert_eq!(rpf_before, 0);
    drop(c); // in repair mode: closes silently
}

/// A bridge-less segment: the router in front duplicates every frame it sends toward the
/// primary to the service address out of its link to the backup ([`Mirror`], nftables netdev
/// egress `dup`). Before the mirror and after its removal the backup sees nothing.
#[test]
fn replica_segment_router_mirror() {
    use unbroken_drivers::segment::{Mirror, MirrorSpec};
    let Some(_g) = lab_or_skip("replica_segment_router_mirror") else {
        return;
    };
    let svc = std::net::Ipv4Addr::new(10, 77, 5, 10);
    let mut lab = lab::Lab::new();
    let client = lab.add_ns("client").unwrap();
    let router = lab.add_ns("router").unwrap();
    let primary = lab.add_ns("primary").unwrap();
    let backup = lab.add_ns("backup").unwrap();
    lab.add_veth(&client, "eth0", None, &router, "wan0", None)
        .unwrap();
    lab.add_veth(&router, "lan0", None, &primary, "eth0", None)
        .unwrap();
    lab.add_veth(&router, "bk0", None, &backup, "eth0", None)
        .unwrap();
    lab.add_addr(&client, "eth0", "10.77.4.2/24").unwrap();
    lab.add_route(&client, "default via 10.77.4.1").unwrap();
    lab.add_addr(&router, "wan0", "10.77.4.1/24").unwrap();
    lab.add_addr(&router, "lan0", "10.77.5.1/24").unwrap();
    lab::sysctls(&router, &[("net.ipv4.ip_forward", "1")]).unwrap();
    for (ns, host) in [(&primary, "10.77.5.11/24"), (&backup, "10.77.5.12/24")] {
        lab.add_addr(ns, "eth0", host).unwrap();
        lab.add_addr(ns, "eth0", &format!("{svc}/32")).unwrap();
        lab.add_route(ns, "default via 10.77.5.1").unwrap();
    }
    lab::install_rst_counter(&client).unwrap();
    nft_stdin(
        &backup,
        &format!(
            "table netdev {COUNT_TABLE} {{\n  chain c {{\n    type filter hook ingress device \"eth0\" priority 0; policy accept;\n    \
             ip daddr {svc} tcp dport {PORT} counter\n  }}\n}}\n"
        ),
    );
    let l = lab::in_ns(&primary, || TcpListener::bind((svc, PORT)))
        .unwrap()
        .unwrap();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { return };
            c.set_read_timeout(Some(T)).unwrap();
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = c.read(&mut buf) {
                    if n == 0 || c.write_all(&buf[..n]).is_err() {
                        return;
                    }
                }
            });
        }
    });
    let session = |rounds: u64| {
        let mut s = lab::in_ns(&client, || {
            TcpStream::connect_timeout(&SocketAddr::from((svc, PORT)), T)
        })
        .unwrap()
        .unwrap();
        s.set_read_timeout(Some(T)).unwrap();
        echo_rounds(&mut s, rounds);
        // Close both ways before counting: the client's FIN and last ACK are segments too.
        s.shutdown(std::net::Shutdown::Write).unwrap();
        assert_eq!(s.read(&mut [0u8; 16]).unwrap(), 0, "the server's FIN");
    };

    session(3);
    assert_eq!(counted(&backup), 0, "no mirror, nothing reaches the backup");

    let mut spec = MirrorSpec::new("lan0", "bk0", IpAddr::V4(svc));
    spec.netns = Some(router.clone());
    let mirror = Mirror::install(&spec).expect("install the mirror");
    Mirror::install(&spec)
        .expect("installing again is idempotent")
        .leave_installed();
    session(ROUND_TRIPS);
    // Every copy the router made arrives (the last ones may still be on their way).
    assert!(
        wait_for(|| counted(&backup) == Mirror::mirrored(&spec).unwrap()),
        "the backup saw {} of the {} copies",
        counted(&backup),
        Mirror::mirrored(&spec).unwrap()
    );
    let seen = counted(&backup);
    assert!(
        seen >= ROUND_TRIPS + 2,
        "the backup saw {seen} of at least {} client segments",
        ROUND_TRIPS + 2
    );
    assert_eq!(
        lab::rsts_seen(&client).unwrap(),
        0,
        "no RST reached the client"
    );

    mirror.remove().expect("remove the mirror");
    Mirror::remove_leftovers(&spec).expect("removing again is a no-op");
    session(3);
    assert_eq!(counted(&backup), seen, "nothing more after removal");
}
